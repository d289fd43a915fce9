//! Turning a prompt into token ids, checked against the model, without the
//! engine: the worker runs it on a blocking thread before a request reaches
//! the engine's single thread, so a long prompt never delays other
//! requests' tokens, and a prompt that cannot fit is refused before it
//! costs the engine anything.

use std::sync::Arc;

use lorafleet_domain::generation::Field;

use crate::error::{EngineError, Result};
use crate::model::tokenizer::Tokenizer;
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

    /// The prompt's token ids, every one below the vocabulary size.
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let ids = match prompt {
            Prompt::Text(t) => self.tokenizer.encode(t, true)?,
            Prompt::TokenIds(ids) => ids.clone(),
            Prompt::Chat {
                messages,
                add_generation_prompt,
                tools,
                continuation,
            } => {
                if messages.is_empty() {
                    return Err(EngineError::request(
                        Field::Messages,
                        "must hold at least one message",
                    ));
                }
                self.tokenizer.encode_chat_continued(
                    messages,
                    tools.as_ref(),
                    *add_generation_prompt,
                    continuation,
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
