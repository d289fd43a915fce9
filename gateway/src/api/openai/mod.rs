//! The OpenAI wire shapes the gateway accepts and returns, and how a request
//! body becomes a worker `GenerateRequest`.
//!
//! A body is read straight into these typed structs from its bytes, with no
//! intermediate `serde_json::Value` ([`shapes`]).
//!
//! Unknown fields are ignored, as OpenAI's own API does, so that SDKs that
//! send newer fields keep working. Known fields that would change the output
//! but are not supported are refused with a 400 that names the field,
//! never ignored.
//!
//! Choices: `n` (1 to 16) on both endpoints; `best_of` (n to 16, not
//! streamed) on /v1/completions generates that many and returns the `n`
//! with the highest cumulative log probability.
//!
//! Sampling controls: `presence_penalty` and `frequency_penalty` (OpenAI's),
//! `repetition_penalty`, `top_k` and `min_p` (vLLM's), `logit_bias`,
//! `min_tokens`, `stop_token_ids` and `ignore_eos`. vLLM's `typical_p`,
//! `use_beam_search`, `length_penalty`, `bad_words`, `allowed_token_ids`,
//! `include_stop_str_in_output` and `truncate_prompt_tokens` are refused
//! unless off.
//!
//! Log probabilities: `logprobs` (0 to 20) and `echo` on /v1/completions,
//! `logprobs: true` with `top_logprobs` (0 to 20) on chat. They are the
//! model's own log-softmax over the whole vocabulary, before temperature
//! and the other sampling controls.

use super::params::{Endpoint, client_param};
use crate::audit::sanitize::{MAX_MODEL_BYTES, MAX_USER_BYTES, check_field};
use crate::upstream::{self, Choices, GenerationSpec, Prompt, Sampling, Valid};
use serde::{Deserialize, Serialize};
use serde_json::Value;

mod constraint;
mod shapes;
pub mod tools;

pub use constraint::MAX_CONSTRAINT_BYTES;
use constraint::ResponseFormat;

pub use shapes::{Content, ContentPart, LogprobsInput, PromptInput, StopInput};
use shapes::{Echo, PROMPT_EXPECTED};

/// A 400 with the offending field.
#[derive(Debug, Clone, PartialEq)]
pub struct BadRequest {
    pub param: String,
    pub message: String,
}

/// The generation the parser built, checked by the contract once, here at
/// the edge; a refusal names the parameter the client sent.
pub fn checked(
    spec: GenerationSpec,
    endpoint: Endpoint,
) -> Result<Valid<GenerationSpec>, BadRequest> {
    spec.validate().map_err(|e| {
        let param = client_param(e.field, endpoint).unwrap_or_else(|| e.field.wire_path());
        BadRequest {
            message: format!("{param}: {}", e.reason),
            param,
        }
    })
}

pub(crate) fn bad(param: &str, message: impl Into<String>) -> BadRequest {
    BadRequest {
        param: param.into(),
        message: format!("{param}: {}", message.into()),
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// A request body: the fields shared by both endpoints, and each
/// endpoint's input (`prompt` or `messages`), which the endpoint requires.
#[derive(Debug, Deserialize)]
pub struct Common {
    pub model: String,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    /// vLLM's min-p: drop tokens less likely than this times the most
    /// likely one.
    pub min_p: Option<f32>,
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub stop: Option<StopInput>,
    pub seed: Option<u64>,
    pub user: Option<String>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// vLLM's extra field.
    pub repetition_penalty: Option<f32>,
    /// Token id (as a string, OpenAI's shape) -> bias.
    logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    pub min_tokens: Option<u32>,
    pub stop_token_ids: Option<Vec<u32>>,
    response_format: Option<ResponseFormat>,
    /// vLLM's structured-output fields.
    guided_json: Option<Box<serde_json::value::RawValue>>,
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    guided_grammar: Option<String>,
    /// Chat's tools (`tools.rs`).
    tools: Option<Box<serde_json::value::RawValue>>,
    tool_choice: Option<Box<serde_json::value::RawValue>>,
    parallel_tool_calls: Option<bool>,
    /// Chat's reasoning effort, for the chat template (GPT-OSS's).
    reasoning_effort: Option<String>,
    /// vLLM's extra variables for chat's template (`enable_thinking`).
    chat_template_kwargs: Option<Box<serde_json::value::RawValue>>,
    logprobs: Option<LogprobsInput>,
    top_logprobs: Option<i64>,
    pub echo: Option<bool>,
    pub best_of: Option<u32>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's sampling fields this gateway does not implement: refused when
    /// set to anything but their off value, never ignored.
    typical_p: Option<f32>,
    use_beam_search: Option<bool>,
    length_penalty: Option<f32>,
    bad_words: Option<Vec<String>>,
    allowed_token_ids: Option<Vec<u32>>,
    include_stop_str_in_output: Option<bool>,
    truncate_prompt_tokens: Option<i64>,
    prompt: Option<PromptInput>,
    messages: Option<Vec<Message>>,
}

#[derive(Debug)]
pub struct CompletionRequest {
    pub prompt: PromptInput,
    pub common: Common,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
    /// An assistant's earlier tool calls (OpenAI's shape).
    tool_calls: Option<Box<serde_json::value::RawValue>>,
    /// A tool message: the call it answers.
    tool_call_id: Option<String>,
    name: Option<String>,
    /// An assistant's reasoning, as this API returned it.
    reasoning_content: Option<String>,
}

#[derive(Debug)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub common: Common,
}

/// Default `max_tokens` for /v1/completions, as OpenAI's.
const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;
/// Default for chat, where OpenAI means "up to the context"; capped here so
/// that a forgotten limit cannot hold a sequence for minutes.
const CHAT_DEFAULT_MAX_TOKENS: u32 = 1024;

/// Reads a body into [`Common`], naming the field at fault.
fn parse(body: &[u8]) -> Result<Common, BadRequest> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        let message = if serde_json::from_slice::<serde::de::IgnoredAny>(body).is_ok() {
            "the body must be a JSON object".to_owned()
        } else {
            format!(
                "the body is not valid JSON: {}",
                serde_json::from_slice::<serde::de::IgnoredAny>(body)
                    .err()
                    .map_or_else(String::new, |e| e.to_string())
            )
        };
        return Err(BadRequest {
            param: String::new(),
            message,
        });
    }
    // Through serde_path_to_error, so every error names its field: a wrong
    // type, or text no JSON string may hold (a lone UTF-16 surrogate).
    let mut de = serde_json::Deserializer::from_slice(body);
    let common: Common = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        field_error(&path, e.into_inner())
    })?;
    de.end().map_err(|e| BadRequest {
        param: String::new(),
        message: format!("the body is not valid JSON: {e}"),
    })?;
    Ok(common)
}

/// The 400 for an error at `path` (serde_path_to_error's rendering).
fn field_error(path: &str, inner: serde_json::Error) -> BadRequest {
    use serde_json::error::Category;
    let syntax = matches!(inner.classify(), Category::Syntax | Category::Eof);
    // `?` is where serde_path_to_error lost the place (the body ended).
    let param = match path {
        "." | "" => String::new(),
        p if p.contains('?') => String::new(),
        p => p.to_owned(),
    };
    if syntax {
        return match param.as_str() {
            "" => BadRequest {
                param,
                message: format!("the body is not valid JSON: {inner}"),
            },
            field => bad(field, format!("is not valid JSON text: {inner}")),
        };
    }
    let message = inner.to_string();
    // "missing field `x`" is reported at the parent.
    if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|r| r.split('`').next())
    {
        let param = if param.is_empty() {
            field.to_owned()
        } else {
            format!("{param}.{field}")
        };
        return bad(&param, "is required");
    }
    if param == "prompt" || param.starts_with("prompt[") {
        return bad("prompt", format!("must be {PROMPT_EXPECTED}"));
    }
    if param.is_empty() {
        BadRequest {
            param,
            message: format!("the body is not a valid request: {message}"),
        }
    } else {
        bad(&param, message)
    }
}

/// The `model` and `user` a refused body gave, for its audit row (made
/// safe later like every field), with UTF-16 surrogate escapes (which a
/// lone one makes invalid) read as U+FFFD. None if it is not an object.
pub fn refused_echo(body: &[u8]) -> Option<(Option<String>, Option<String>)> {
    #[derive(Deserialize)]
    struct Fields {
        model: Option<Echo>,
        user: Option<Echo>,
    }
    let read = |bytes: &[u8]| {
        serde_json::from_slice::<Fields>(bytes)
            .ok()
            .map(|f| (f.model.map(|e| e.0), f.user.map(|e| e.0)))
    };
    if let Some(found) = read(body) {
        return Some(found);
    }
    let mut fixed = Vec::with_capacity(body.len());
    let mut i = 0;
    while i < body.len() {
        let escape = body.get(i..i + 6).filter(|w| {
            w[0] == b'\\'
                && w[1] == b'u'
                && matches!(w[2], b'd' | b'D')
                && matches!(w[3], b'8'..=b'9' | b'a'..=b'f' | b'A'..=b'F')
                && w[4..].iter().all(u8::is_ascii_hexdigit)
        });
        if escape.is_some() {
            fixed.extend_from_slice(b"\\ufffd");
            i += 6;
        } else {
            fixed.push(body[i]);
            i += 1;
        }
    }
    read(&fixed)
}

impl CompletionRequest {
    /// Parses a /v1/completions body, naming the field at fault.
    pub fn parse(body: &[u8]) -> Result<CompletionRequest, BadRequest> {
        let mut common = parse(body)?;
        let prompt = common
            .prompt
            .take()
            .ok_or_else(|| bad("prompt", "is required"))?;
        common.messages = None;
        Ok(CompletionRequest { prompt, common })
    }
}

impl ChatRequest {
    /// Parses a /v1/chat/completions body, naming the field at fault.
    pub fn parse(body: &[u8]) -> Result<ChatRequest, BadRequest> {
        let mut common = parse(body)?;
        let messages = common
            .messages
            .take()
            .ok_or_else(|| bad("messages", "is required"))?;
        common.prompt = None;
        Ok(ChatRequest { messages, common })
    }
}

impl Common {
    fn check(&self) -> Result<(), BadRequest> {
        // The strings copied into the audit row, before anything else.
        check_field(&self.model, MAX_MODEL_BYTES).map_err(|e| bad("model", e.to_string()))?;
        if let Some(user) = &self.user {
            check_field(user, MAX_USER_BYTES).map_err(|e| bad("user", e.to_string()))?;
        }
        if self.model.trim().is_empty() {
            return Err(bad("model", "is required"));
        }
        if self.choices().ranked() && self.stream {
            return Err(bad("best_of", "above n cannot be streamed"));
        }
        let unsupported = [
            ("typical_p", self.typical_p.is_some_and(|v| v != 1.0)),
            ("use_beam_search", self.use_beam_search == Some(true)),
            (
                "length_penalty",
                self.length_penalty.is_some_and(|v| v != 1.0),
            ),
            (
                "bad_words",
                self.bad_words.as_ref().is_some_and(|v| !v.is_empty()),
            ),
            (
                "allowed_token_ids",
                self.allowed_token_ids
                    .as_ref()
                    .is_some_and(|v| !v.is_empty()),
            ),
            (
                "include_stop_str_in_output",
                self.include_stop_str_in_output == Some(true),
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens.is_some(),
            ),
        ];
        if let Some((name, _)) = unsupported.iter().find(|(_, set)| *set) {
            return Err(bad(
                name,
                "is not supported by this gateway; leave it out or at its off value",
            ));
        }
        if self.stream_options.is_some() && !self.stream {
            return Err(bad(
                "stream_options",
                "is only allowed with \"stream\": true",
            ));
        }
        if self.top_k.is_some_and(|k| k < -1) {
            return Err(bad("top_k", "must be -1 (off), 0 (off) or positive"));
        }
        Ok(())
    }

    /// The worker's sampling; `scores_prompt` (echo) allows `max_tokens` 0.
    fn sampling(&self, default_max: u32, scores_prompt: bool) -> Result<Sampling, BadRequest> {
        let max_tokens = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) | (None, Some(m)) => m,
            (None, None) => default_max,
        };
        if max_tokens == 0 && !scores_prompt {
            let field = if self.max_completion_tokens.is_some() {
                "max_completion_tokens"
            } else {
                "max_tokens"
            };
            return Err(bad(field, "must be at least 1"));
        }
        let stop = match &self.stop {
            None => vec![],
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        };
        Ok(Sampling {
            max_tokens: max_tokens as usize,
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.map_or(0, |k| k.max(0) as usize),
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed,
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: self.logit_bias()?,
            min_tokens: self.min_tokens.unwrap_or(0) as usize,
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            constraint: self.constraint()?,
        })
    }

    /// `logit_bias`: token ids (as strings) to biases, in token order.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, BadRequest> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        let mut out = Vec::with_capacity(map.len());
        for (key, &bias) in map {
            let id: u32 = key.parse().map_err(|_| {
                bad(
                    "logit_bias",
                    format!("{key:?} is not a token id (a non-negative integer)"),
                )
            })?;
            out.push((id, bias));
        }
        out.sort_by_key(|&(id, _)| id);
        Ok(out)
    }

    /// `logprobs` and `echo` on /v1/completions: the count of alternatives
    /// for completion tokens, and for prompt tokens.
    fn completion_logprobs(&self) -> Result<(Option<u32>, Option<u32>), BadRequest> {
        if self.top_logprobs.is_some() {
            return Err(bad(
                "top_logprobs",
                "is the chat API's; completions take \"logprobs\": N",
            ));
        }
        let logprobs = match self.logprobs {
            None | Some(LogprobsInput::Switch(false)) => None,
            Some(LogprobsInput::Switch(true)) => {
                return Err(bad(
                    "logprobs",
                    format!(
                        "must be an integer from 0 to {MAX_TOP_LOGPROBS} on (legacy) completions"
                    ),
                ));
            }
            Some(LogprobsInput::Count(n)) => Some(top_count("logprobs", n)?),
        };
        let echo = self.echo == Some(true);
        Ok((logprobs, echo.then(|| logprobs.unwrap_or(0))))
    }

    /// `logprobs` and `top_logprobs` on chat: the count of alternatives for
    /// completion tokens, when asked.
    fn chat_logprobs(&self) -> Result<Option<u32>, BadRequest> {
        if self.echo == Some(true) {
            return Err(bad("echo", "is only for (legacy) completions"));
        }
        if self.best_of.is_some() {
            return Err(bad("best_of", "is only for (legacy) completions"));
        }
        let on = match self.logprobs {
            None | Some(LogprobsInput::Switch(false)) => false,
            Some(LogprobsInput::Switch(true)) => true,
            Some(LogprobsInput::Count(_)) => {
                return Err(bad(
                    "logprobs",
                    "must be true or false on chat completions; top_logprobs gives the count",
                ));
            }
        };
        let top = match self.top_logprobs {
            None => 0,
            Some(n) => top_count("top_logprobs", n)?,
        };
        if top > 0 && !on {
            return Err(bad("top_logprobs", "needs \"logprobs\": true"));
        }
        Ok(on.then_some(top))
    }

    /// Choices to generate, and how many of them to return: `best_of`
    /// (default `n`) and `n`; the contract checks their range.
    pub fn choices(&self) -> Choices {
        let returned = self.n.unwrap_or(1);
        Choices {
            generated: self.best_of.unwrap_or(returned),
            returned,
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

impl CompletionRequest {
    /// The checked generation, or the field at fault.
    pub fn to_worker(&self) -> Result<Valid<GenerationSpec>, BadRequest> {
        self.common.check()?;
        if self.common.tools.is_some() {
            return Err(bad("tools", "is only for chat completions"));
        }
        if self.common.reasoning_effort.is_some() {
            return Err(bad("reasoning_effort", "is only for chat completions"));
        }
        if self.common.chat_template_kwargs.is_some() {
            return Err(bad("chat_template_kwargs", "is only for chat completions"));
        }
        let prompt = match &self.prompt {
            PromptInput::Text(t) => Prompt::Text(t.clone()),
            PromptInput::Texts(v) if v.len() == 1 => Prompt::Text(v[0].clone()),
            PromptInput::Tokens(ids) => Prompt::TokenIds(ids.clone()),
            PromptInput::TokenLists(v) if v.len() == 1 => Prompt::TokenIds(v[0].clone()),
            _ => {
                return Err(bad(
                    "prompt",
                    "exactly one prompt per request is supported (a string or a token list)",
                ));
            }
        };
        let (logprobs, prompt_logprobs) = self.common.completion_logprobs()?;
        let sampling = Sampling {
            logprobs: logprobs.map(|n| n as usize),
            prompt_logprobs: prompt_logprobs.map(|n| n as usize),
            ..self
                .common
                .sampling(COMPLETIONS_DEFAULT_MAX_TOKENS, prompt_logprobs.is_some())?
        };
        let spec = GenerationSpec {
            prompt,
            sampling,
            choices: self.common.choices(),
        };
        checked(spec, Endpoint::Completions)
    }
}

impl ChatRequest {
    pub fn to_worker(&self) -> Result<Valid<GenerationSpec>, BadRequest> {
        self.common.check()?;
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let content = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        if p.kind != "text" {
                            return Err(bad(
                                &format!("messages[{i}].content[{j}].type"),
                                format!("{:?} is not supported; only \"text\" parts", p.kind),
                            ));
                        }
                        text.push_str(p.text.as_deref().unwrap_or_default());
                    }
                    text
                }
            };
            // OpenAI's `developer` is the templates' `system`.
            let role = match m.role.as_str() {
                "developer" => upstream::Role::System,
                other => upstream::Role::parse(other).ok_or_else(|| {
                    bad(
                        &format!("messages[{i}].role"),
                        format!(
                            "{:?} is not system, developer, user, assistant or tool",
                            m.role
                        ),
                    )
                })?,
            };
            messages.push(upstream::ChatMessage {
                role,
                content,
                tool_calls_json: m
                    .tool_calls
                    .as_deref()
                    .map(|raw| tool_calls_for_template(raw, i))
                    .transpose()?,
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
                reasoning: m.reasoning_content.clone(),
            });
        }
        let tools = self.tools()?;
        let mut sampling = Sampling {
            logprobs: self.common.chat_logprobs()?.map(|n| n as usize),
            ..self.common.sampling(CHAT_DEFAULT_MAX_TOKENS, false)?
        };
        if let Some(c) = tools.as_ref().and_then(tools::Tools::constraint) {
            if sampling.constraint.is_some() {
                return Err(bad(
                    "tool_choice",
                    "required or a named function cannot be combined with response_format or guided_*",
                ));
            }
            sampling.constraint = Some(c);
        }
        let reasoning_effort = self
            .common
            .reasoning_effort
            .as_deref()
            .map(|word| {
                upstream::ReasoningEffort::parse(word).ok_or_else(|| {
                    bad(
                        "reasoning_effort",
                        format!("{word:?} is not low, medium or high"),
                    )
                })
            })
            .transpose()?;
        let prompt = Prompt::Chat(upstream::ChatPrompt {
            messages,
            add_generation_prompt: true,
            tools_json: tools.map(|t| t.json.to_string()),
            continuation: None,
            reasoning_effort,
            template_kwargs_json: self.template_kwargs()?,
        });
        let spec = GenerationSpec {
            prompt,
            sampling,
            choices: self.common.choices(),
        };
        checked(spec, Endpoint::Chat)
    }

    /// `chat_template_kwargs`: an object, as the client's text, naming
    /// none of the variables the request itself gives the template; None
    /// when absent, null or empty.
    fn template_kwargs(&self) -> Result<Option<String>, BadRequest> {
        const PARAM: &str = "chat_template_kwargs";
        let Some(raw) = &self.common.chat_template_kwargs else {
            return Ok(None);
        };
        let map: serde_json::Map<String, Value> =
            serde_json::from_str(raw.get()).map_err(|_| bad(PARAM, "must be a JSON object"))?;
        if let Some(name) = map
            .keys()
            .find(|k| upstream::TEMPLATE_NAMES.contains(&k.as_str()))
        {
            return Err(bad(
                &format!("{PARAM}.{name}"),
                "is given to the template by the request itself",
            ));
        }
        Ok((!map.is_empty()).then(|| raw.get().to_owned()))
    }

    /// The request's tools, checked.
    pub fn tools(&self) -> Result<Option<tools::Tools>, BadRequest> {
        tools::parse(
            self.common.tools.as_deref(),
            self.common.tool_choice.as_deref(),
            self.common.parallel_tool_calls,
        )
    }
}

#[derive(Debug, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// OpenAI's breakdown of the prompt's tokens.
#[derive(Debug, Serialize)]
pub struct PromptTokensDetails {
    /// Served from the worker's prefix cache (their prefill skipped).
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt: u32, completion: u32, cached: u32) -> Usage {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: cached.min(prompt),
            },
        }
    }
}

/// OpenAI's finish_reason for the worker's.
pub fn finish_reason(f: &upstream::Finished) -> &'static str {
    match f.reason {
        upstream::FinishReason::Length => "length",
        upstream::FinishReason::Stop => "stop",
    }
}

/// An assistant message's `tool_calls` as the chat template reads them:
/// each call's `function.arguments`, a JSON string on the wire, as the
/// object it holds.
fn tool_calls_for_template(
    raw: &serde_json::value::RawValue,
    message: usize,
) -> Result<String, BadRequest> {
    let field = format!("messages[{message}].tool_calls");
    let mut calls: Vec<Value> =
        serde_json::from_str(raw.get()).map_err(|e| bad(&field, e.to_string()))?;
    for (j, c) in calls.iter_mut().enumerate() {
        let args = &mut c["function"]["arguments"];
        if let Value::String(text) = args {
            *args = serde_json::from_str(text).map_err(|e| {
                bad(
                    &format!("{field}[{j}].function.arguments"),
                    format!("is not JSON: {e}"),
                )
            })?;
        }
    }
    Ok(Value::Array(calls).to_string())
}

/// The most alternatives per position (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

fn top_count(field: &str, n: i64) -> Result<u32, BadRequest> {
    u32::try_from(n)
        .ok()
        .filter(|&n| n <= MAX_TOP_LOGPROBS)
        .ok_or_else(|| {
            bad(
                field,
                format!("{n} is not an integer from 0 to {MAX_TOP_LOGPROBS}"),
            )
        })
}

/// The body of an OpenAI error.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Value {
    serde_json::json!({
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code,
        }
    })
}

#[cfg(test)]
mod tests;
