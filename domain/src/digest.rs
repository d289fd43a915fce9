//! A SHA-256 as the registry, the workers and the wire write it: 64
//! lowercase hexadecimal digits. An artifact digest and a base hash are
//! both one; a string that is not cannot become one.

use std::fmt;

/// A SHA-256 in lowercase hexadecimal.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Sha256Hex(String);

impl Sha256Hex {
    /// The digest `s` spells (upper case is lowered); None unless it is 64
    /// hexadecimal digits.
    pub fn parse(s: &str) -> Option<Sha256Hex> {
        (s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Sha256Hex(s.to_ascii_lowercase()))
    }

    /// The digest whose 32 bytes are `bytes`.
    pub fn from_bytes(bytes: [u8; 32]) -> Sha256Hex {
        use fmt::Write;
        let mut s = String::with_capacity(64);
        for b in bytes {
            let _ = write!(s, "{b:02x}");
        }
        Sha256Hex(s)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A base model's hash: the digest of its weights as the worker reads
/// them (names, dtypes, shapes, bytes, quantization), which an adapter's
/// registry row must match before any worker serves it.
pub type BaseHash = Sha256Hex;

impl std::ops::Deref for Sha256Hex {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Sha256Hex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sixty_four_hex_digits_are_a_digest_and_they_are_lowered() {
        let d = Sha256Hex::parse(&"AB".repeat(32)).unwrap();
        assert_eq!(d.as_str(), "ab".repeat(32));
        assert_eq!(&*d, "ab".repeat(32));
        assert!(Sha256Hex::parse(&"a".repeat(63)).is_none());
        assert!(Sha256Hex::parse(&"g".repeat(64)).is_none());
        assert!(Sha256Hex::parse("").is_none());
    }

    #[test]
    fn a_digests_bytes_are_spelt_as_parse_reads_them() {
        let mut bytes = [0u8; 32];
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i as u8).wrapping_mul(37) ^ 0xa5;
        }
        let d = Sha256Hex::from_bytes(bytes);
        assert_eq!(d.len(), 64);
        assert_eq!(&d.as_str()[..6], "a580ef");
        assert_eq!(Sha256Hex::parse(d.as_str()), Some(d.clone()));
        assert_eq!(Sha256Hex::from_bytes([0; 32]).as_str(), "0".repeat(64));
    }
}
