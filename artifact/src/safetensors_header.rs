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
    let mut header = vec![0u8; len as usize];
    r.read_exact(&mut header)
        .map_err(|_| "ends inside its header".to_owned())?;
    match serde_json::from_slice(&header) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err("has a header that is not a JSON object".into()),
    }
}
