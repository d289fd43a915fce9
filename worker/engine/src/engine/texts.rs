//! Adapters that ship a tokenizer of their own (new tokens, or tokens
//! renamed, as Unsloth and Axolotl write them beside an adapter with
//! trained token rows): their requests are tokenized, templated,
//! detokenized and constrained with it. An adapter whose `tokenizer.json`
//! is the base's (the same vocabulary) uses the base's. An adapter whose
//! saved embed_tokens and lm_head grow the vocabulary past the base's has
//! a text side of its own even without a tokenizer: its ids reach its rows.

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
    /// Its logits per position: the base model's `vocab_size`, or the rows
    /// of an adapter's own embed_tokens and lm_head grown past it.
    pub vocab: usize,
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

    /// The text side of the adapter in `dir`, if it ships a tokenizer of
    /// its own or grows the vocabulary; its tokens must have rows in the
    /// model or in its own layers.
    pub(super) fn adapter_text(
        &self,
        name: &str,
        dir: &std::path::Path,
    ) -> Result<Option<TextSide>> {
        let refused = |reason: String| {
            EngineError::request(Field::Adapter, format!("adapter {name:?}: {reason}"))
        };
        let vocab = self.config.vocab_size;
        // A weights file that cannot be read here is refused when the
        // adapter loads, by its tensor; until then it reads as the base's.
        let rows =
            lorafleet_artifact::safetensors_header::read(&dir.join("adapter_model.safetensors"))
                .ok()
                .map(|header| lorafleet_artifact::adapter::tensors::saved_vocab(name, &header))
                .transpose()
                .map_err(|e| refused(e.to_string()))?
                .flatten()
                .map_or(vocab, |r| {
                    usize::try_from(r).unwrap_or(usize::MAX).max(vocab)
                });
        let own =
            Tokenizer::for_adapter(dir, &self.tokenizer).map_err(|e| refused(e.to_string()))?;
        if own.is_none() && rows == vocab {
            return Ok(None);
        }
        let own = own.map_or_else(|| self.tokenizer.clone(), Arc::new);
        let limit = own.id_limit();
        if limit > rows {
            let whose = if rows > vocab {
                "its own embed_tokens and lm_head have"
            } else {
                "the base model's vocabulary has"
            };
            return Err(refused(format!(
                "its tokenizer.json has {limit} tokens, but {whose} {rows} rows: its new tokens \
                 would have no row"
            )));
        }
        Ok(Some(TextSide {
            id_limit: (limit < rows).then_some(limit),
            vocab: rows,
            prompter: Prompter::new(
                own.clone(),
                rows,
                self.config
                    .rope
                    .max_model_len(self.config.max_position_embeddings),
            ),
            constraints: Compiler::new(
                own,
                rows,
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
                vocab: self.prompter.vocab_size(),
            })
    }
}
