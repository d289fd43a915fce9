//! A safetensors file's JSON header, read without the tensor data: the
//! admin plane checks an adapter's tensor names and shapes at registration
//! with the rules the worker applies (`adapter::tensors`).

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use serde_json::{Map, Value};

/// The largest header accepted, by the admin plane and by the worker's
/// weight files alike: real headers are kilobytes (a sharded 70B model's
/// largest shard about 100 KiB), and a header is JSON parsed in memory.
pub const MAX_HEADER_BYTES: u64 = 8 << 20;

/// What is wrong with a safetensors header; the file is named by the caller.
#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("cannot be opened: {0}")]
    Open(#[source] std::io::Error),
    #[error("cannot be read: {0}")]
    Read(#[source] std::io::Error),
    #[error("is too short to be safetensors")]
    TooShort,
    #[error("declares a {0}-byte header, which is implausible")]
    Implausible(u64),
    #[error("ends inside its header")]
    Truncated,
    #[error("has a header that is not a JSON object")]
    NotObject,
    #[error("tensor {0:?} has no dtype")]
    NoDtype(String),
    #[error("tensor {0:?} has no shape of whole numbers")]
    NoShape(String),
}

/// One tensor as the header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The safetensors dtype as written (`F32`, `BF16`, ...).
    pub dtype: String,
    pub shape: Vec<u64>,
}

/// A typed header: every tensor by name (`__metadata__` left out).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Header {
    pub tensors: BTreeMap<String, TensorInfo>,
}

impl Header {
    /// The tensors of a header's JSON object; a tensor without a dtype or a
    /// shape of whole numbers is refused by name.
    pub fn from_json(map: &Map<String, Value>) -> Result<Header, HeaderError> {
        let mut tensors = BTreeMap::new();
        for (name, info) in map {
            if name == "__metadata__" {
                continue;
            }
            let dtype = info
                .get("dtype")
                .and_then(Value::as_str)
                .ok_or_else(|| HeaderError::NoDtype(name.clone()))?;
            let shape = info
                .get("shape")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>())
                .ok_or_else(|| HeaderError::NoShape(name.clone()))?;
            tensors.insert(
                name.clone(),
                TensorInfo {
                    dtype: dtype.to_owned(),
                    shape,
                },
            );
        }
        Ok(Header { tensors })
    }
}

/// A file's typed header. The error says what is wrong with the file.
pub fn read(path: &Path) -> Result<Header, HeaderError> {
    let mut f = std::fs::File::open(path).map_err(HeaderError::Open)?;
    Header::from_json(&parse(&mut f)?)
}

/// The header's JSON object (tensor name → dtype, shape, offsets, plus
/// `__metadata__`) from any reader.
pub fn parse(r: &mut impl Read) -> Result<Map<String, Value>, HeaderError> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len).map_err(|_| HeaderError::TooShort)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(HeaderError::Implausible(len));
    }
    // Grown as bytes arrive, so a short file that declares a huge header
    // costs what it holds, not what it claims.
    let mut header = Vec::new();
    r.take(len)
        .read_to_end(&mut header)
        .map_err(HeaderError::Read)?;
    if header.len() as u64 != len {
        return Err(HeaderError::Truncated);
    }
    match serde_json::from_slice(&header) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(HeaderError::NotObject),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(header: &[u8], declared: u64) -> Vec<u8> {
        let mut v = declared.to_le_bytes().to_vec();
        v.extend_from_slice(header);
        v
    }

    #[test]
    fn headers_are_read_or_refused_with_a_reason() {
        let ok = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let map = parse(&mut &file(ok, ok.len() as u64)[..]).unwrap();
        assert!(map.contains_key("a"));
        assert_eq!(
            parse(&mut &b"\x01\x02"[..]).unwrap_err().to_string(),
            "is too short to be safetensors"
        );
        // A short file that claims a large header is refused without
        // allocating what it claims.
        assert_eq!(
            parse(&mut &file(b"{}", 5 << 20)[..])
                .unwrap_err()
                .to_string(),
            "ends inside its header"
        );
        assert!(
            parse(&mut &file(b"{}", MAX_HEADER_BYTES + 1)[..])
                .unwrap_err()
                .to_string()
                .contains("implausible")
        );
        assert_eq!(
            parse(&mut &file(b"[1]", 3)[..]).unwrap_err().to_string(),
            "has a header that is not a JSON object"
        );
    }

    #[test]
    fn typed_headers_refuse_a_tensor_without_dtype_or_shape_by_name() {
        let read = |h: &[u8]| Header::from_json(&parse(&mut &file(h, h.len() as u64)[..]).unwrap());
        let ok = read(br#"{"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}"#)
            .unwrap();
        assert_eq!(ok.tensors.len(), 1);
        assert_eq!(ok.tensors["a"].shape, vec![2, 3]);
        assert_eq!(
            read(br#"{"a":{"shape":[1]}}"#).unwrap_err().to_string(),
            "tensor \"a\" has no dtype"
        );
        assert_eq!(
            read(br#"{"a":{"dtype":"F32","shape":[-1]}}"#)
                .unwrap_err()
                .to_string(),
            "tensor \"a\" has no shape of whole numbers"
        );
    }
}
