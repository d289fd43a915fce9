//! Adapters that ship a tokenizer of their own (new tokens, or tokens
//! renamed, as Unsloth and Axolotl write them beside an adapter with
//! trained token rows): their requests are tokenized, templated,
//! detokenized and constrained with it. An adapter whose `tokenizer.json`
//! is the base's (the same vocabulary) uses the base's.

use std::sync::Arc;

use super::Engine;
use crate::constraint::Compiler;
use crate::error::{EngineError, Result};
use crate::model::tokenizer::Tokenizer;
use crate::pool::AdapterId;
use crate::prompter::Prompter;
use lorafleet_domain::generation::Field;

/// What turns one adapter's (or the base model's) text into tokens and
/// back. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TextSide {
    pub prompter: Prompter,
    pub constraints: Compiler,
    /// The ids its tokenizer has (its largest plus one), where that is
    /// fewer than the model's rows: its requests draw no token past them.
    pub id_limit: Option<usize>,
}

impl TextSide {
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        self.prompter.tokenizer()
    }
}

impl Engine {
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The tokenizer and the model's limits, to prepare prompts on other
    /// threads (see [`Prompter`]).
    pub fn prompter(&self) -> Prompter {
        self.prompter.clone()
    }

    /// The model's constraint compiler, sharing the engine's cache of
    /// compiled constraints: what it compiles, the engine's submission
    /// only clones.
    pub fn constraint_compiler(&self) -> Compiler {
        self.constraints.clone()
    }

    /// Compiles a constraint as a request carrying it would, to refuse it
    /// before any work (the offline command checks every line first).
    pub fn check_constraint(&self, c: &crate::constraint::Constraint) -> Result<()> {
        self.constraints.compile(c).map(drop)
    }

    pub fn tokenize(&self, prompt: &crate::request::Prompt) -> Result<Vec<u32>> {
        self.prompter.tokenize(prompt)
    }

    /// The text side of the tokenizer in `dir`, if the adapter there ships
    /// its own; its tokens must have rows in the model.
    pub(super) fn adapter_text(
        &self,
        name: &str,
        dir: &std::path::Path,
    ) -> Result<Option<TextSide>> {
        let refused = |reason: String| {
            EngineError::request(Field::Adapter, format!("adapter {name:?}: {reason}"))
        };
        let Some(own) =
            Tokenizer::for_adapter(dir, &self.tokenizer).map_err(|e| refused(e.to_string()))?
        else {
            return Ok(None);
        };
        let vocab = self.config.vocab_size;
        if own.vocab_size() > vocab {
            return Err(refused(format!(
                "its tokenizer.json has {} tokens, but the base model's vocabulary has {vocab} rows: \
                 its new tokens would have no row",
                own.vocab_size()
            )));
        }
        let limit = own.id_limit();
        let own = Arc::new(own);
        Ok(Some(TextSide {
            id_limit: (limit < vocab).then_some(limit),
            prompter: Prompter::new(
                own.clone(),
                vocab,
                self.config
                    .rope
                    .max_model_len(self.config.max_position_embeddings),
            ),
            constraints: Compiler::new(
                own,
                vocab,
                self.config.eos_token_ids.first().copied().unwrap_or(0),
                self.harmony.is_some(),
            ),
        }))
    }

    /// The text side of an adapter that ships its own tokenizer.
    pub fn own_text(&self, adapter: AdapterId) -> Option<TextSide> {
        self.texts.get(&adapter).cloned()
    }

    /// What `adapter`'s requests are tokenized and detokenized with: its
    /// own tokenizer's side where it ships one, the base model's otherwise.
    pub fn text_side(&self, adapter: Option<AdapterId>) -> TextSide {
        adapter
            .and_then(|a| self.texts.get(&a))
            .cloned()
            .unwrap_or_else(|| TextSide {
                prompter: self.prompter.clone(),
                constraints: self.constraints.clone(),
                id_limit: None,
            })
    }
}
