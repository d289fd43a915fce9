//! Why a model file could not be used.

use std::path::PathBuf;

/// A model file that could not be read, or a field in it that is missing,
/// malformed or unsupported. The engine keeps these as its own variants.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
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
}

impl FileError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        FileError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn model(
        file: impl Into<PathBuf>,
        field: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        FileError::InvalidModel {
            file: file.into(),
            field: field.into(),
            reason: reason.into(),
        }
    }
}

pub type Result<T> = std::result::Result<T, FileError>;
