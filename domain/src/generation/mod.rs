//! The generation contract: one request as a whole ([`GenerationSpec`]):
//! what it prompts with ([`Prompt`]), how it chooses its tokens and when
//! it stops ([`Sampling`], with its structured-output [`Constraint`] and
//! log probabilities), and how many [`Choices`]; checked once where it
//! enters a process into a [`Valid`] value that cannot be invalid, and the
//! [`Field`] a refusal names.
//!
//! The gateway builds a `GenerationSpec` from a client's OpenAI request
//! and validates it at its edge; it sends each choice to a worker as a
//! one-choice spec ([`Valid::choice`]); the worker validates what its wire
//! carries with the same function; the engine takes the valid prompt and
//! sampling ([`Valid::into_parts`]) and checks the one thing that needs
//! the model (token ids below its vocabulary, [`Sampling::check_vocab`]).
//! Each side converts to its wire at one boundary.

mod field;
mod prompt;
mod spec;

use std::fmt;
use std::ops::Deref;

pub use field::{ConstraintKind, Field, MessagePart};
pub use prompt::{Channel, ChatMessage, ChatPrompt, Prompt, ReasoningEffort, Role, TEMPLATE_NAMES};
pub use spec::{Choices, GenerationSpec, MAX_CHOICES};

/// The most stop strings a request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// The longest stop string, in bytes. Every generated token is checked
/// against each stop string on the engine's thread, over a window as long
/// as the longest one, so both limits bound what one request can cost
/// every other request's tokens.
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// The most stop token ids a request may carry.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// The most `logit_bias` entries a request may carry (OpenAI's limit).
pub const MAX_LOGIT_BIAS: usize = 300;
/// The most alternatives asked for at each position.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// The largest constraint source (schema, expression, choices, grammar),
/// in bytes.
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;

/// How a request chooses tokens and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub max_tokens: usize,
    /// 0 to 2; 0 means greedy.
    pub temperature: f32,
    /// In (0, 1]; 1 means off.
    pub top_p: f32,
    /// 0 means off.
    pub top_k: usize,
    /// In [0, 1]: tokens less likely than `min_p` times the most likely
    /// one are dropped (after temperature, top-k and top-p, as
    /// transformers' `MinPLogitsWarper`). 0 means off.
    pub min_p: f32,
    /// None: a seed is drawn for the request.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Log probabilities of every completion token, with this many most
    /// likely alternatives at each (0 to 20). None: no log probabilities.
    pub logprobs: Option<usize>,
    /// The same for every prompt token after the first (OpenAI's `echo`).
    /// A request that sets it computes its whole prompt: its prefill skips
    /// no cached blocks. With it, `max_tokens` may be 0 (score the prompt
    /// alone).
    pub prompt_logprobs: Option<usize>,
    /// Added to a token's logit before sampling, -100 to 100 each; in
    /// token order.
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and stop token ids cannot end the sequence before
    /// this many tokens.
    pub min_tokens: usize,
    /// 1 is off; above 1 discourages every token of prompt and output.
    pub repetition_penalty: f32,
    /// OpenAI's, -2 to 2; 0 is off.
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// What the output must match (structured outputs). None: anything.
    pub constraint: Option<Constraint>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            max_tokens: 16,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            prompt_logprobs: None,
            logit_bias: Vec::new(),
            min_tokens: 0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            constraint: None,
        }
    }
}

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Constraint {
    /// Any JSON object (OpenAI's `json_object`).
    JsonObject,
    /// A JSON schema, as JSON text.
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect).
    Grammar(String),
    /// A call of one of these functions (OpenAI's `tool_choice`
    /// `required`, or one named function): the engine writes it in the
    /// model's own form (a `{"name", "arguments"}` object, or a harmony
    /// model's call message).
    ToolCall(ToolCall),
}

/// The calls a `required` or named `tool_choice` allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    /// At least one; each name non-empty and unique.
    pub functions: Vec<ToolFunction>,
    /// Several calls at once (an array of them) where the model's form
    /// allows it.
    pub parallel: bool,
}

/// A function a call may name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolFunction {
    pub name: String,
    /// Its `parameters`: a JSON schema, as JSON text.
    pub parameters: String,
}

impl Constraint {
    pub fn kind(&self) -> ConstraintKind {
        match self {
            Constraint::JsonObject => ConstraintKind::JsonObject,
            Constraint::JsonSchema(_) => ConstraintKind::JsonSchema,
            Constraint::Regex(_) => ConstraintKind::Regex,
            Constraint::Choice(_) => ConstraintKind::Choice,
            Constraint::Grammar(_) => ConstraintKind::Grammar,
            Constraint::ToolCall(_) => ConstraintKind::ToolCall,
        }
    }

    /// The field a refusal of this constraint names.
    pub fn field(&self) -> Field {
        Field::Constraint(self.kind())
    }

    /// The bytes of its source.
    pub fn source_bytes(&self) -> usize {
        match self {
            Constraint::JsonObject => 0,
            Constraint::JsonSchema(t) | Constraint::Regex(t) | Constraint::Grammar(t) => t.len(),
            Constraint::Choice(v) => v.iter().map(String::len).sum(),
            Constraint::ToolCall(t) => t
                .functions
                .iter()
                .map(|f| f.name.len() + f.parameters.len())
                .sum(),
        }
    }
}

/// A value that passed its checks; only this module makes one, so a
/// function that takes `Valid<Sampling>` never checks it again.
#[derive(Debug, Clone, PartialEq)]
pub struct Valid<T>(T);

impl<T> Valid<T> {
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> Deref for Valid<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// A refused value: the field at fault and why, for a person.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    pub field: Field,
    pub reason: String,
}

impl Invalid {
    pub fn new(field: Field, reason: impl Into<String>) -> Invalid {
        Invalid {
            field,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl std::error::Error for Invalid {}

impl Sampling {
    /// Checks every field that does not depend on the model.
    pub fn validate(self) -> Result<Valid<Sampling>, Invalid> {
        let bad = |field, reason: String| Err(Invalid::new(field, reason));
        if self.max_tokens == 0 && self.prompt_logprobs.is_none() {
            return bad(
                Field::MaxTokens,
                "must be at least 1 (0 only with prompt_logprobs)".into(),
            );
        }
        for (field, n) in [
            (Field::Logprobs, self.logprobs),
            (Field::PromptLogprobs, self.prompt_logprobs),
        ] {
            if let Some(n) = n
                && n > MAX_TOP_LOGPROBS
            {
                return bad(
                    field,
                    format!("{n} is above the limit of {MAX_TOP_LOGPROBS}"),
                );
            }
        }
        if !(self.temperature.is_finite() && (0.0..=2.0).contains(&self.temperature)) {
            return bad(
                Field::Temperature,
                format!("{} is not in [0, 2]", self.temperature),
            );
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(Field::TopP, format!("{} is not in (0, 1]", self.top_p));
        }
        if !(self.min_p.is_finite() && (0.0..=1.0).contains(&self.min_p)) {
            return bad(Field::MinP, format!("{} is not in [0, 1]", self.min_p));
        }
        for (field, v) in [
            (Field::FrequencyPenalty, self.frequency_penalty),
            (Field::PresencePenalty, self.presence_penalty),
        ] {
            if !(v.is_finite() && (-2.0..=2.0).contains(&v)) {
                return bad(field, format!("{v} is not in [-2, 2]"));
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(
                Field::RepetitionPenalty,
                format!("{} is not a positive number", self.repetition_penalty),
            );
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return bad(
                Field::LogitBias,
                format!("at most {MAX_LOGIT_BIAS} entries"),
            );
        }
        for &(id, bias) in &self.logit_bias {
            if !(bias.is_finite() && (-100.0..=100.0).contains(&bias)) {
                return bad(
                    Field::LogitBiasToken(id),
                    format!("{bias} is not in [-100, 100]"),
                );
            }
        }
        if self.min_tokens > self.max_tokens {
            return bad(
                Field::MinTokens,
                format!(
                    "{} is above max_tokens {}",
                    self.min_tokens, self.max_tokens
                ),
            );
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return bad(
                Field::Stop,
                format!("at most {MAX_STOP_STRINGS} stop strings"),
            );
        }
        for (i, stop) in self.stop.iter().enumerate() {
            if stop.is_empty() {
                return bad(Field::StopString(i), "is empty".into());
            }
            if stop.len() > MAX_STOP_STRING_BYTES {
                return bad(
                    Field::StopString(i),
                    format!(
                        "is {} bytes, longer than the limit of {MAX_STOP_STRING_BYTES}",
                        stop.len()
                    ),
                );
            }
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return bad(
                Field::StopTokenIds,
                format!("at most {MAX_STOP_TOKEN_IDS} stop token ids"),
            );
        }
        if let Some(c) = &self.constraint {
            let size = c.source_bytes();
            if size > MAX_CONSTRAINT_BYTES {
                return bad(
                    c.field(),
                    format!("is {size} bytes, above the limit of {MAX_CONSTRAINT_BYTES}"),
                );
            }
            if let Constraint::Choice(list) = c
                && (list.is_empty() || list.iter().any(String::is_empty))
            {
                return bad(c.field(), "must hold at least one non-empty string".into());
            }
            if let Constraint::ToolCall(t) = c {
                if t.functions.is_empty() {
                    return bad(c.field(), "must allow at least one function".into());
                }
                for (i, f) in t.functions.iter().enumerate() {
                    if f.name.is_empty() || t.functions[..i].iter().any(|g| g.name == f.name) {
                        return bad(c.field(), format!("function {i}: a name, once each"));
                    }
                }
            }
        }
        Ok(Valid(self))
    }

    /// Whether any control changes the logits (`logit_bias`, `min_tokens`
    /// and the penalties).
    pub fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty()
            || self.min_tokens > 0
            || self.repetition_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
    }

    /// Checks the token ids it names against a model's vocabulary.
    pub fn check_vocab(&self, vocab_size: usize) -> Result<(), Invalid> {
        if let Some(&(id, _)) = self
            .logit_bias
            .iter()
            .find(|&&(id, _)| id as usize >= vocab_size)
        {
            return Err(Invalid::new(
                Field::LogitBiasToken(id),
                format!("{id} is not below vocab_size {vocab_size}"),
            ));
        }
        if let Some(id) = self
            .stop_token_ids
            .iter()
            .find(|&&id| id as usize >= vocab_size)
        {
            return Err(Invalid::new(
                Field::StopTokenIds,
                format!("{id} is not below vocab_size {vocab_size}"),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
