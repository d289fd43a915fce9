//! A safetensors file's JSON header, read without the tensor data: the
//! admin plane checks an adapter's tensor names and shapes at registration.

use std::io::Read;
use std::path::Path;

use serde_json::{Map, Value};

/// The largest header accepted; real adapter headers are kilobytes.
const MAX_HEADER_BYTES: u64 = 100 << 20;

/// The header's JSON object (tensor name → dtype, shape, offsets, plus
/// `__metadata__`). The error says what is wrong with the file.
pub fn read(path: &Path) -> Result<Map<String, Value>, String> {
    let mut f = std::fs::File::open(path).map_err(|e| format!("cannot be opened: {e}"))?;
    parse(&mut f)
}

/// [`read`] from any reader.
pub fn parse(r: &mut impl Read) -> Result<Map<String, Value>, String> {
    let mut len = [0u8; 8];
    r.read_exact(&mut len)
        .map_err(|_| "is too short to be safetensors".to_owned())?;
    let len = u64::from_le_bytes(len);
    if len > MAX_HEADER_BYTES {
        return Err(format!(
            "declares a {len}-byte header, which is implausible"
        ));
    }
    // Grown as bytes arrive, so a short file that declares a huge header
    // costs what it holds, not what it claims.
    let mut header = Vec::new();
    r.take(len)
        .read_to_end(&mut header)
        .map_err(|e| format!("cannot be read: {e}"))?;
    if header.len() as u64 != len {
        return Err("ends inside its header".into());
    }
    match serde_json::from_slice(&header) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err("has a header that is not a JSON object".into()),
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
            parse(&mut &b"\x01\x02"[..]).unwrap_err(),
            "is too short to be safetensors"
        );
        // A short file that claims a large header is refused without
        // allocating what it claims.
        assert_eq!(
            parse(&mut &file(b"{}", 50 << 20)[..]).unwrap_err(),
            "ends inside its header"
        );
        assert!(
            parse(&mut &file(b"{}", 200 << 20)[..])
                .unwrap_err()
                .contains("implausible")
        );
        assert_eq!(
            parse(&mut &file(b"[1]", 3)[..]).unwrap_err(),
            "has a header that is not a JSON object"
        );
    }
}
