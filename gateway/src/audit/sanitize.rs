//! Client strings on their way into an audit row.
//!
//! A request whose `model` or `user` holds control characters or is too
//! long is refused with a 400 before anything else happens ([`check_field`]),
//! and its row still records the refusal, with [`safe`]'s rendering of the
//! value. Every text field of a row goes through [`safe`] before it is
//! queued, whatever its source (a JWT's `sub` is the client's too), so no
//! value can make Postgres refuse a batch: no NUL, no control character, and
//! a bounded length.

/// Longest `model` a request may name, in bytes.
pub const MAX_MODEL_BYTES: usize = 256;
/// Longest OpenAI `user` field a request may send, in bytes.
pub const MAX_USER_BYTES: usize = 256;
/// Longest any text field of a row may be, in bytes, after [`safe`].
pub const MAX_FIELD_BYTES: usize = 512;

/// Why a client string is refused; the message names no field (the caller
/// does).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FieldError {
    #[error("must not contain control characters (found U+{code:04X} at byte {at})")]
    Control { code: u32, at: usize },
    #[error("is {len} bytes long; at most {max} are allowed")]
    TooLong { len: usize, max: usize },
}

/// Refuses a client string with control characters or over `max_bytes`.
pub fn check_field(value: &str, max_bytes: usize) -> Result<(), FieldError> {
    if let Some((at, c)) = value.char_indices().find(|(_, c)| c.is_control()) {
        return Err(FieldError::Control { code: c as u32, at });
    }
    if value.len() > max_bytes {
        return Err(FieldError::TooLong {
            len: value.len(),
            max: max_bytes,
        });
    }
    Ok(())
}

/// A rendering of `value` that any text column accepts: control characters
/// are written as `\u{..}` escapes, and a value longer than `max_bytes` is
/// cut on a character boundary and marked with its full length. The result
/// is at most `max_bytes` plus the marker's few dozen bytes.
pub fn safe(value: &str, max_bytes: usize) -> String {
    let clean = value.len() <= max_bytes && !value.chars().any(char::is_control);
    if clean {
        return value.to_owned();
    }
    let mut out = String::with_capacity(value.len().min(max_bytes) + 32);
    for c in value.chars() {
        let piece_len = if c.is_control() {
            format!("\\u{{{:x}}}", c as u32).len()
        } else {
            c.len_utf8()
        };
        if out.len() + piece_len > max_bytes {
            out.push_str(&format!("…[{} bytes in all]", value.len()));
            return out;
        }
        if c.is_control() {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        } else {
            out.push(c);
        }
    }
    out
}

/// [`safe`] for an optional field.
pub fn safe_opt(value: &Option<String>, max_bytes: usize) -> Option<String> {
    value.as_deref().map(|v| safe(v, max_bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_names_the_control_character_and_the_length() {
        assert!(check_field("support", 16).is_ok());
        assert!(check_field("héllo wörld", 16).is_ok());
        let e = check_field("x\u{0}y", 16).unwrap_err().to_string();
        assert!(e.contains("U+0000 at byte 1"), "{e}");
        let e = check_field("a\u{7f}", 16).unwrap_err().to_string();
        assert!(e.contains("U+007F"), "{e}");
        let e = check_field(&"a".repeat(17), 16).unwrap_err().to_string();
        assert!(e.contains("17 bytes long; at most 16"), "{e}");
    }

    #[test]
    fn safe_escapes_control_characters_and_caps_on_a_char_boundary() {
        assert_eq!(safe("plain", 16), "plain");
        assert_eq!(safe("x\u{0}y\n", 64), "x\\u{0}y\\u{a}");
        let long = "é".repeat(1000);
        let s = safe(&long, 11);
        assert!(s.starts_with("ééééé…"), "{s}");
        assert!(s.ends_with("[2000 bytes in all]"), "{s}");
        assert!(!s.contains('\u{0}'));
        let huge = "\u{0}".repeat(1 << 20);
        let s = safe(&huge, MAX_FIELD_BYTES);
        assert!(s.len() <= MAX_FIELD_BYTES + 32, "{}", s.len());
        assert!(!s.chars().any(char::is_control));
    }
}
