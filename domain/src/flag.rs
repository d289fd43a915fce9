//! A setting a process cannot start with: the flag (or variable), and why.
//! Both processes check their flags into configs that refuse with it.

use std::fmt;

/// A refused flag (or the file it names).
#[derive(Debug, Clone, PartialEq, Eq)]
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

impl fmt::Display for FlagError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.flag, self.reason)
    }
}

impl std::error::Error for FlagError {}

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
