//! `tokenizer.json` through the tokenizers crate, the chat template from
//! `tokenizer_config.json` rendered with minijinja, and incremental
//! detokenization that never splits a UTF-8 character.

use std::path::Path;

use minijinja::{Environment, ErrorKind, context};
use serde_json::Value;

use crate::error::{EngineError, Result};
use crate::model::config::read_json_object;
use crate::model::template_json;

/// One chat message as the template sees it: the contract's
/// [`lorafleet_domain::generation::ChatMessage`] with its tool calls parsed.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
    /// An assistant's tool calls, in OpenAI's shape with each call's
    /// `arguments` as a JSON object (what Hugging Face templates read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Value>,
    /// A tool message's answer: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant's earlier reasoning, as Hugging Face templates read it
    /// (GPT-OSS's: `thinking`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
}

/// Everything a chat template is given.
#[derive(Debug, Clone, Copy)]
pub struct TemplateChat<'a> {
    pub messages: &'a [TemplateMessage],
    /// OpenAI's `tools`, as the template's `tools`.
    pub tools: Option<&'a Value>,
    pub add_generation_prompt: bool,
    /// `reasoning_effort`, given only when set.
    pub reasoning_effort: Option<&'a str>,
    /// More variables (a request's `chat_template_kwargs`); the ones above
    /// win over any of the same name.
    pub extra: Option<&'a serde_json::Map<String, Value>>,
}

/// The model's tokenizer and chat template.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: String,
    eos_token: String,
    /// Each token's own bytes, built on first use (log probabilities).
    token_bytes: std::sync::OnceLock<Vec<Vec<u8>>>,
}

impl Tokenizer {
    /// Loads `tokenizer.json` and, if present, `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| EngineError::Tokenizer(format!("{}: {e}", path.display())))?;
        Tokenizer::around(dir, inner)
    }

    /// An adapter's own tokenizer: the `tokenizer.json` its directory
    /// ships, when that file's vocabulary (added tokens included) is not
    /// `base`'s; None when it ships none or the same one. Its chat template
    /// and special tokens are its own `tokenizer_config.json`'s (and
    /// `chat_template.jinja`'s) where it ships them, the base's otherwise.
    /// Errors name the file alone, not where this machine keeps it.
    pub fn for_adapter(dir: &Path, base: &Tokenizer) -> Result<Option<Tokenizer>> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Ok(None);
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
            EngineError::Tokenizer(format!("the adapter's tokenizer.json does not load: {e}"))
        })?;
        if inner.get_vocab(true) == base.inner.get_vocab(true) {
            return Ok(None);
        }
        let shown = dir.display().to_string();
        let mut own = Tokenizer::around(dir, inner).map_err(|e| match e {
            EngineError::Tokenizer(m) => EngineError::Tokenizer(m.replace(&shown, "adapter")),
            EngineError::ChatTemplate(m) => EngineError::ChatTemplate(m.replace(&shown, "adapter")),
            other => other,
        })?;
        if !dir.join("tokenizer_config.json").exists() {
            own.bos_token = base.bos_token.clone();
            own.eos_token = base.eos_token.clone();
        }
        if own.chat_template.is_none() {
            own.chat_template = base.chat_template.clone();
        }
        Ok(Some(own))
    }

    /// The tokenizer `inner` with the chat template and special tokens of
    /// `dir`'s `tokenizer_config.json` and `chat_template.jinja`.
    fn around(dir: &Path, inner: tokenizers::Tokenizer) -> Result<Tokenizer> {
        let config_path = dir.join("tokenizer_config.json");
        let (mut chat_template, mut bos_token, mut eos_token) =
            (None, String::new(), String::new());
        if config_path.exists() {
            let config = read_json_object(&config_path)?;
            chat_template = match config.get("chat_template") {
                None | Some(Value::Null) => None,
                Some(Value::String(t)) => Some(t.clone()),
                // A list of named templates: the one named "default" serves chat.
                Some(Value::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template").and_then(Value::as_str))
                    .map(str::to_owned),
                Some(other) => {
                    return Err(EngineError::model(
                        &config_path,
                        "chat_template",
                        format!("must be a string or a list of named templates, got {other}"),
                    ));
                }
            };
            bos_token = special_token(config.get("bos_token"));
            eos_token = special_token(config.get("eos_token"));
        }
        // transformers saves a template in a file of its own now, and reads
        // it before the one in tokenizer_config.json.
        let template_path = dir.join("chat_template.jinja");
        if template_path.exists() {
            chat_template = Some(std::fs::read_to_string(&template_path).map_err(|e| {
                EngineError::ChatTemplate(format!("{}: {e}", template_path.display()))
            })?);
        }
        let tokenizer = Tokenizer {
            inner,
            chat_template,
            bos_token,
            eos_token,
            token_bytes: std::sync::OnceLock::new(),
        };
        if let Some(template) = &tokenizer.chat_template {
            // Compile once now so a broken template fails at load, not per request.
            tokenizer
                .environment()
                .template_from_str(template)
                .map_err(|e| {
                    EngineError::ChatTemplate(format!(
                        "{}: does not compile: {e}",
                        config_path.display()
                    ))
                })?;
        }
        Ok(tokenizer)
    }

    /// Encodes text, adding the tokenizer's special tokens (such as BOS) when asked.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        self.inner
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| EngineError::Tokenizer(format!("encode: {e}")))
    }

    /// Decodes ids, leaving out special tokens.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer(format!("decode: {e}")))
    }

    /// The bytes a token stands for, alone: what OpenAI's `bytes` field
    /// holds. A byte-level BPE token may be part of a UTF-8 character, so
    /// these need not be valid UTF-8. Empty for an id outside the
    /// vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let table = self.token_bytes.get_or_init(|| {
            let byte_level = matches!(
                self.inner.get_decoder(),
                Some(tokenizers::DecoderWrapper::ByteLevel(_))
            );
            let unicode_to_byte = byte_level_alphabet();
            (0..self.inner.get_vocab_size(true) as u32)
                .map(|id| {
                    let piece = self.inner.id_to_token(id).unwrap_or_default();
                    if byte_level
                        && !self.inner.get_added_vocabulary().is_special_token(&piece)
                        && let Some(bytes) = piece
                            .chars()
                            .map(|c| unicode_to_byte.get(&c).copied())
                            .collect::<Option<Vec<u8>>>()
                    {
                        return bytes;
                    }
                    // SentencePiece's byte fallback pieces, "<0xE3>".
                    if let Some(hex) = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'))
                        && hex.len() == 2
                        && let Ok(b) = u8::from_str_radix(hex, 16)
                    {
                        return vec![b];
                    }
                    self.inner
                        .decode(&[id], false)
                        .map(String::into_bytes)
                        .unwrap_or_else(|_| piece.into_bytes())
                })
                .collect()
        });
        table.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Whether `id` is a special token (such as BOS or EOS), which text
    /// never spells.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .id_to_token(id)
            .is_some_and(|p| self.inner.get_added_vocabulary().is_special_token(&p))
    }

    /// One past the largest id any token has, added tokens included.
    pub fn id_limit(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1)
    }

    /// The number of tokens in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The id of a special (added) token, by its text.
    pub fn special_id(&self, token: &str) -> Option<u32> {
        self.inner
            .token_to_id(token)
            .filter(|_| self.inner.get_added_vocabulary().is_special_token(token))
    }

    /// Renders chat messages with the model's template.
    pub fn apply_chat_template(
        &self,
        messages: &[TemplateMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_chat(messages, None, add_generation_prompt)
    }

    /// Renders chat messages, and the tools the model may call (OpenAI's
    /// `tools`, which the template receives as `tools`), with the model's
    /// template.
    pub fn render_chat(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render(&TemplateChat {
            messages,
            tools,
            add_generation_prompt,
            reasoning_effort: None,
            extra: None,
        })
    }

    /// Renders a chat, with every input the template is given.
    pub fn render(&self, chat: &TemplateChat<'_>) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::ChatTemplate(
                "the model has no chat_template in tokenizer_config.json".into(),
            )
        })?;
        let env = self.environment();
        let tmpl = env
            .template_from_str(template)
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        let mut ctx = context! {
            messages => chat.messages,
            tools => chat.tools,
            add_generation_prompt => chat.add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        };
        // Given only when set: templates test `is not defined` for their
        // own default.
        if let Some(effort) = chat.reasoning_effort {
            ctx = context! { reasoning_effort => effort, ..ctx };
        }
        if let Some(extra) = chat.extra {
            ctx = context! { ..ctx, ..minijinja::Value::from_serialize(extra) };
        }
        tmpl.render(ctx)
            .map_err(|e| EngineError::ChatTemplate(format!("render: {e}")))
    }

    /// Renders chat messages and tokenizes the result. The template already
    /// writes the special tokens it wants, so none are added.
    pub fn encode_chat(
        &self,
        messages: &[TemplateMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Tokenizer::encode_chat`], with the tools the model may call.
    pub fn encode_chat_with_tools(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        self.encode_chat_continued(messages, tools, add_generation_prompt, "")
    }

    /// [`Tokenizer::encode_chat_with_tools`] with `continuation` after the
    /// rendered chat, tokenized together with it: a given answer, scored as
    /// lm-evaluation-harness scores a continuation under a chat template.
    pub fn encode_chat_continued(
        &self,
        messages: &[TemplateMessage],
        tools: Option<&Value>,
        add_generation_prompt: bool,
        continuation: &str,
    ) -> Result<Vec<u32>> {
        self.encode_template_chat(
            &TemplateChat {
                messages,
                tools,
                add_generation_prompt,
                reasoning_effort: None,
                extra: None,
            },
            continuation,
        )
    }

    /// [`Tokenizer::render`], then `continuation`, tokenized together.
    pub fn encode_template_chat(
        &self,
        chat: &TemplateChat<'_>,
        continuation: &str,
    ) -> Result<Vec<u32>> {
        let mut text = self.render(chat)?;
        text.push_str(continuation);
        self.encode(&text, false)
    }

    fn environment(&self) -> Environment<'static> {
        let mut env = Environment::new();
        // Hugging Face templates are written for Jinja2 in Python: they call
        // str methods such as .strip() and raise_exception().
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        // transformers gives templates today's date (GPT-OSS's writes it
        // into its system message), and a `tojson` that is Python's
        // `json.dumps`, not minijinja's HTML-safe one.
        env.add_function("strftime_now", template_json::strftime_now);
        env.add_filter("tojson", template_json::tojson);
        env
    }
}

fn special_token(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// Turns a growing list of token ids into text deltas. A delta is released
/// only when it ends on a whole character, so multi-byte characters split
/// across tokens are never cut.
#[derive(Debug, Default, Clone)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the window decoded for context (some tokenizers need the
    /// previous tokens to place spaces right).
    prefix_offset: usize,
    /// Tokens before this one have had their text released.
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Starts after `prompt` ids, whose text is never emitted.
    pub fn new(prompt: &[u32]) -> Self {
        // A few tokens of context are enough for spacing decisions.
        let start = prompt.len().saturating_sub(5);
        IncrementalDecoder {
            ids: prompt[start..].to_vec(),
            prefix_offset: 0,
            read_offset: prompt.len() - start,
        }
    }

    /// Adds one token and returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        // A window that ends inside a character (a prompt cut mid-character)
        // decodes with a trailing U+FFFD that the longer decode completes.
        let raw_prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let prefix = raw_prefix.trim_end_matches('\u{FFFD}');
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(prefix) {
            let delta = full[prefix.len()..].to_owned();
            // Move the context window only to a point that starts a whole
            // character; otherwise the next window would begin mid-character.
            if raw_prefix.len() == prefix.len() {
                self.prefix_offset = self.read_offset;
            }
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Any text still held back at the end of the sequence.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let prefix = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset])?;
        let prefix = prefix.trim_end_matches('\u{FFFD}');
        let full = tokenizer.decode(&self.ids[self.prefix_offset..])?;
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        Ok(full
            .strip_prefix(prefix)
            .map(str::to_owned)
            .unwrap_or_default())
    }
}

/// GPT-2's byte-level alphabet, reversed: the printable character that
/// stands for each byte in a byte-level BPE vocabulary, to that byte.
fn byte_level_alphabet() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut out = std::collections::HashMap::with_capacity(256);
    let mut next = 256u32;
    for b in 0..=255u8 {
        let c = if printable(b) {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        out.insert(char::from_u32(c).expect("a valid code point"), b);
    }
    out
}
