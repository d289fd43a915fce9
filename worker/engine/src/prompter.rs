//! Turning a prompt into token ids, checked against the model, without the
//! engine: the worker runs it on a blocking thread before a request reaches
//! the engine's single thread, so a long prompt never delays other
//! requests' tokens, and a prompt that cannot fit is refused before it
//! costs the engine anything.

use std::sync::Arc;

use lorafleet_domain::generation::{ChatMessage, Field, MessagePart, TEMPLATE_NAMES};

use crate::error::{EngineError, Result};
use crate::model::tokenizer::{TemplateChat, TemplateMessage, Tokenizer};
use crate::request::Prompt;

/// The model's tokenizer and limits. Cheap to clone, and `Send`.
#[derive(Debug, Clone)]
pub struct Prompter {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    max_model_len: usize,
}

impl Prompter {
    pub(crate) fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, max_model_len: usize) -> Self {
        Prompter {
            tokenizer,
            vocab_size,
            max_model_len,
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The token ids its prompts may hold: the model's vocabulary, or an
    /// adapter's grown past it.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The prompt's token ids, every one below the vocabulary size.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let ids = match prompt {
            Prompt::Text(t) => self.tokenizer.encode(t, true)?,
            Prompt::TokenIds(ids) => ids.clone(),
            Prompt::Chat(chat) => {
                if chat.messages.is_empty() {
                    return Err(EngineError::request(
                        Field::Messages,
                        "must hold at least one message",
                    ));
                }
                let messages = chat
                    .messages
                    .iter()
                    .enumerate()
                    .map(|(index, m)| template_message(index, m))
                    .collect::<Result<Vec<_>>>()?;
                let tools = chat
                    .tools_json
                    .as_deref()
                    .map(|text| json_array(text, Field::Tools))
                    .transpose()?;
                let extra = chat
                    .template_kwargs_json
                    .as_deref()
                    .map(template_kwargs)
                    .transpose()?;
                self.tokenizer.encode_template_chat(
                    &TemplateChat {
                        messages: &messages,
                        tools: tools.as_ref(),
                        add_generation_prompt: chat.add_generation_prompt,
                        reasoning_effort: chat.reasoning_effort.map(|e| e.as_str()),
                        extra: extra.as_ref(),
                    },
                    chat.continuation.as_deref().unwrap_or(""),
                )?
            }
        };
        self.check(&ids)?;
        Ok(ids)
    }

    /// [`Prompter::tokenize`], then refuses a prompt that with `max_tokens`
    /// more would exceed the model's length.
    pub fn prepare(&self, prompt: &Prompt, max_tokens: usize) -> Result<Vec<u32>> {
        let ids = self.tokenize(prompt)?;
        self.check_length(ids.len(), max_tokens)?;
        Ok(ids)
    }

    /// The bytes a token stands for (see [`Tokenizer::token_bytes`]).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.tokenizer.token_bytes(id)
    }

    pub(crate) fn check(&self, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(EngineError::request(
                Field::Prompt,
                "is empty after tokenization",
            ));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(EngineError::request(
                Field::PromptTokenIds,
                format!("{bad} is not below vocab_size {}", self.vocab_size),
            ));
        }
        Ok(())
    }

    pub(crate) fn check_length(&self, prompt_tokens: usize, max_tokens: usize) -> Result<()> {
        if prompt_tokens + max_tokens > self.max_model_len {
            return Err(EngineError::ContextLength {
                prompt_tokens,
                max_tokens,
                max_model_len: self.max_model_len,
            });
        }
        Ok(())
    }
}

/// A chat message as the template sees it: its tool calls parsed.
fn template_message(index: usize, m: &ChatMessage) -> Result<TemplateMessage> {
    let field = Field::Message {
        index,
        part: MessagePart::ToolCalls,
    };
    Ok(TemplateMessage {
        role: m.role.as_str().to_owned(),
        content: m.content.clone(),
        tool_calls: m
            .tool_calls_json
            .as_deref()
            .map(|text| json_array(text, field))
            .transpose()?,
        tool_call_id: m.tool_call_id.clone(),
        name: m.name.clone(),
        thinking: m.reasoning.clone(),
    })
}

/// `text` as a JSON array, refused by `field` when it is not one.
/// A chat's `template_kwargs_json`: a JSON object naming none of the
/// variables the contract gives the template itself.
pub fn template_kwargs(text: &str) -> Result<serde_json::Map<String, serde_json::Value>> {
    let field = Field::TemplateKwargs;
    let map = match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(map)) => map,
        Ok(_) => return Err(EngineError::request(field, "must be a JSON object")),
        Err(e) => {
            return Err(EngineError::request(
                field,
                format!("is not valid JSON: {e}"),
            ));
        }
    };
    if let Some(name) = map.keys().find(|k| TEMPLATE_NAMES.contains(&k.as_str())) {
        return Err(EngineError::request(
            field,
            format!("{name:?} is given to the template by the request itself"),
        ));
    }
    Ok(map)
}

pub fn json_array(text: &str, field: Field) -> Result<serde_json::Value> {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(v @ serde_json::Value::Array(_)) => Ok(v),
        Ok(_) => Err(EngineError::request(field, "must be a JSON array")),
        Err(e) => Err(EngineError::request(
            field,
            format!("is not valid JSON: {e}"),
        )),
    }
}
