//! A JSON file whose root must be an object, read with errors that name
//! the file.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{FileError, Result};

/// The object at the root of the JSON file at `path`.
pub fn read_json_object(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| FileError::io(path, e))?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(FileError::model(path, "(root)", "must be a JSON object")),
        Err(e) => Err(FileError::model(
            path,
            "(root)",
            format!("is not valid JSON: {e}"),
        )),
    }
}

/// Typed access to one JSON object, with errors that name the file and field.
#[derive(Debug)]
pub struct Fields<'a> {
    pub file: &'a Path,
    pub map: &'a Map<String, Value>,
}

impl Fields<'_> {
    pub(crate) fn err(&self, field: &str, reason: impl Into<String>) -> FileError {
        FileError::model(PathBuf::from(self.file), field, reason)
    }

    /// The value, treating JSON null as absent.
    pub fn get(&self, field: &str) -> Option<&Value> {
        self.map.get(field).filter(|v| !v.is_null())
    }

    pub fn usize(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| self.err(field, format!("must be a non-negative integer, got {v}"))),
        }
    }

    pub fn positive(&self, field: &str) -> Result<usize> {
        match self.usize(field)? {
            Some(n) if n > 0 => Ok(n),
            Some(_) => Err(self.err(field, "must be positive")),
            None => Err(self.err(field, "is required")),
        }
    }

    pub fn f64(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(self.err(field, format!("must be a finite number, got {v}"))),
            },
        }
    }

    pub fn bool(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(field, format!("must be true or false, got {v}"))),
        }
    }

    pub fn str(&self, field: &str) -> Result<Option<&str>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.err(field, format!("must be a string, got {v}"))),
        }
    }

    /// A token id given as one integer or a list of integers.
    pub fn token_ids(&self, field: &str) -> Result<Option<Vec<u32>>> {
        let as_id = |v: &Value| {
            v.as_u64()
                .filter(|&n| n <= u32::MAX as u64)
                .map(|n| n as u32)
                .ok_or_else(|| self.err(field, format!("must hold token ids, got {v}")))
        };
        match self.get(field) {
            None => Ok(None),
            Some(Value::Array(items)) => items.iter().map(as_id).collect::<Result<_>>().map(Some),
            Some(v) => as_id(v).map(|id| Some(vec![id])),
        }
    }
}
