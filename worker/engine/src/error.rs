//! The engine's errors. Every variant names the file or field at fault and
//! says why, so that a caller can show it to a person as is.

use std::path::PathBuf;

use lorafleet_domain::generation::{Field, Invalid};

/// Errors from loading a model or running the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A model file has a field that is missing, malformed or unsupported.
    #[error("{}: `{field}`: {reason}", file.display())]
    InvalidModel {
        file: PathBuf,
        field: String,
        reason: String,
    },
    /// The tokenizer failed to load or to encode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to load or to render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A request field is out of range.
    #[error("{field}: {reason}")]
    InvalidRequest { field: Field, reason: String },
    /// A setting of the engine (its sizes, its budget) is out of range,
    /// named as [`crate::EngineSettings`] names it.
    #[error("{name}: {reason}")]
    InvalidSetting { name: &'static str, reason: String },
    /// The prompt plus `max_tokens` does not fit the model's context. The
    /// field at fault ([`EngineError::context_field`]) is the prompt when
    /// it leaves no room for a single token, else `max_tokens`.
    #[error(
        "{}: the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) \
         exceeds the model's context of {max_model_len} tokens",
        context_field(*prompt_tokens, *max_model_len)
    )]
    ContextLength {
        prompt_tokens: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
    /// The waiting queue is full; the caller may retry later or elsewhere.
    #[error("the waiting queue is full ({waiting} requests)")]
    QueueFull { waiting: usize },
    /// Pinning another adapter would leave no slot for unpinned traffic.
    #[error("pin: {pinned} adapters are pinned already, the most allowed (max_pinned)")]
    PinLimit { pinned: usize },
    /// An adapter was refused.
    #[error(transparent)]
    Adapter(#[from] lorafleet_artifact::adapter::AdapterError),
    /// The backend failed.
    #[error("backend: {0}")]
    Backend(String),
}

impl From<Invalid> for EngineError {
    fn from(e: Invalid) -> Self {
        EngineError::InvalidRequest {
            field: e.field,
            reason: e.reason,
        }
    }
}

impl From<lorafleet_artifact::FileError> for EngineError {
    fn from(e: lorafleet_artifact::FileError) -> Self {
        match e {
            lorafleet_artifact::FileError::Io { path, source } => EngineError::Io { path, source },
            lorafleet_artifact::FileError::InvalidModel {
                file,
                field,
                reason,
            } => EngineError::InvalidModel {
                file,
                field,
                reason,
            },
        }
    }
}

impl EngineError {
    pub(crate) fn model(
        file: impl Into<PathBuf>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        EngineError::InvalidModel {
            file: file.into(),
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn request(field: Field, reason: impl Into<String>) -> Self {
        EngineError::InvalidRequest {
            field,
            reason: reason.into(),
        }
    }

    pub(crate) fn setting(name: &'static str, reason: impl Into<String>) -> Self {
        EngineError::InvalidSetting {
            name,
            reason: reason.into(),
        }
    }
}

/// The engine's result type.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// The field a context-length refusal blames: the prompt when it fills
/// the context alone, else `max_tokens`.
pub fn context_field(prompt_tokens: usize, max_model_len: usize) -> Field {
    if prompt_tokens >= max_model_len {
        Field::Prompt
    } else {
        Field::MaxTokens
    }
}
