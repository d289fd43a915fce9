//! A setting the gateway cannot start with: the flag, and why.

/// A refused flag (or the file it names).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{flag}: {reason}")]
pub struct FlagError {
    pub flag: String,
    pub reason: String,
}

impl FlagError {
    pub fn new(flag: impl Into<String>, reason: impl Into<String>) -> FlagError {
        FlagError {
            flag: flag.into(),
            reason: reason.into(),
        }
    }
}

/// `Err(FlagError)` unless `ok`.
pub fn ensure(
    ok: bool,
    flag: impl Into<String>,
    reason: impl Into<String>,
) -> Result<(), FlagError> {
    if ok {
        Ok(())
    } else {
        Err(FlagError::new(flag, reason))
    }
}
