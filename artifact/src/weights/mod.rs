//! Weights in safetensors files, one file or sharded, and the base hash.
//!
//! # The base hash
//!
//! A base model is identified by SHA-256 over its weights in canonical order,
//! so that the same weights give the same hash however they are sharded:
//!
//! ```text
//! sha256( "lorafleet-base-hash-v1\n"
//!         for each tensor, sorted by name (byte order):
//!             u64le(len(name))  name
//!             u64le(len(dtype)) dtype         -- safetensors dtype, e.g. "BF16"
//!             u64le(ndim)       u64le(dim)...
//!             u64le(len(data))  data          -- raw little-endian bytes as stored
//!       )
//! ```
//!
//! followed, for a quantized model, by
//!
//! ```text
//!         "quantization\n"  u64le(len(q))  q   -- Quantization::canonical()
//! ```
//!
//! (a dense model's hash has nothing after its tensors). It is printed as 64
//! lowercase hex digits. The same weights stored in another dtype are a
//! different base model (their numbers differ), and so are the same
//! quantized bytes under another quantization config (GPTQ's zero-point
//! convention, a group size): they dequantize to other weights.

mod experts;
mod quantized;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use lorafleet_domain::digest::BaseHash;
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};

use crate::error::{FileError, Result};
use crate::json::read_json_object;
use crate::quantization::{self, Format, Quantization};

const HASH_DOMAIN: &[u8] = b"lorafleet-base-hash-v1\n";

/// The safetensors files of one model (or adapter), memory-mapped.
#[derive(Debug)]
pub struct WeightFiles {
    files: Vec<(PathBuf, Mmap)>,
    /// Tensor name -> where it is. Each header is parsed once, when the
    /// files are opened: an adapter is read tensor by tensor, and parsing
    /// the JSON header again for each one made loading quadratic in the
    /// number of tensors.
    index: BTreeMap<String, Located>,
    /// How a quantized model's linear weights are stored (from its
    /// `config.json`); they are dequantized as they are read.
    quantization: Option<Quantization>,
    /// Names the engine asks for -> names as stored, where they differ: a
    /// multimodal Gemma 3 checkpoint keeps its language model under
    /// `language_model.` (see [`language_model_names`]).
    aliases: BTreeMap<String, String>,
}

/// One tensor's place in the mapped files.
#[derive(Debug)]
struct Located {
    /// Index into `files`.
    file: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range in the file.
    bytes: std::ops::Range<usize>,
}

/// One tensor's raw view.
#[derive(Debug)]
pub struct RawTensor<'a> {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards that
    /// `model.safetensors.index.json` names.
    pub fn open_model_dir(dir: &Path) -> Result<WeightFiles> {
        let mut files = WeightFiles::open_model_files(dir)?;
        let config = dir.join("config.json");
        if config.exists() {
            let root = read_json_object(&config)?;
            files.quantization = quantization::parse(&config, &root)?;
            if root.get("model_type").and_then(|t| t.as_str()) == Some("gemma3") {
                files.aliases = language_model_names(files.index.keys());
            }
        }
        Ok(files)
    }

    fn open_model_files(dir: &Path) -> Result<WeightFiles> {
        let single = dir.join("model.safetensors");
        let index = dir.join("model.safetensors.index.json");
        if single.exists() {
            return WeightFiles::open(vec![single]);
        }
        if !index.exists() {
            return Err(FileError::model(
                dir,
                "model.safetensors",
                "neither model.safetensors nor model.safetensors.index.json exists",
            ));
        }
        let root = read_json_object(&index)?;
        let (shards, map) = index_shards(&index, &root)?;
        let files = WeightFiles::open(shards.iter().map(|s| dir.join(s)).collect())?;
        for (tensor, file) in map {
            let at = files.index.get(tensor).map(|t| &files.files[t.file].0);
            if at.is_none_or(|p| p.file_name().and_then(|n| n.to_str()) != file.as_str()) {
                return Err(FileError::model(
                    &index,
                    format!("weight_map.{tensor}"),
                    format!("the tensor is not in {file}"),
                ));
            }
        }
        Ok(files)
    }

    /// Maps the given safetensors files. A tensor name may appear only once.
    /// (`index_shards` checks a sharded model's index first.)
    pub fn open(paths: Vec<PathBuf>) -> Result<WeightFiles> {
        let mut files: Vec<(PathBuf, Mmap)> = Vec::with_capacity(paths.len());
        let mut index: BTreeMap<String, Located> = BTreeMap::new();
        for path in paths {
            let file = File::open(&path).map_err(|e| FileError::io(&path, e))?;
            let map = map_file(&file).map_err(|e| FileError::io(&path, e))?;
            // The JSON header is parsed in memory: a few MiB at most, as the
            // admin plane checks an adapter's at registration.
            if let Some(len) = map
                .get(..8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
                && len > crate::safetensors_header::MAX_HEADER_BYTES
            {
                return Err(FileError::model(
                    &path,
                    "(header)",
                    format!(
                        "declares a {len}-byte header, above the {} bytes a safetensors header may take",
                        crate::safetensors_header::MAX_HEADER_BYTES
                    ),
                ));
            }
            // `read_metadata` checks that every tensor's byte range lies
            // inside the file and matches its dtype and shape.
            let (header, metadata) = SafeTensors::read_metadata(&map).map_err(|e| {
                FileError::model(
                    &path,
                    "(header)",
                    format!("not a valid safetensors file: {e}"),
                )
            })?;
            let data_start = 8 + header;
            let file_index = files.len();
            for (name, info) in metadata.tensors() {
                if let Some(other) = index.get(&name) {
                    return Err(FileError::model(
                        &path,
                        name,
                        format!(
                            "the tensor also appears in {}",
                            files[other.file].0.display()
                        ),
                    ));
                }
                let (lo, hi) = info.data_offsets;
                index.insert(
                    name,
                    Located {
                        file: file_index,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                        bytes: data_start + lo..data_start + hi,
                    },
                );
            }
            files.push((path, map));
        }
        Ok(WeightFiles {
            files,
            index,
            quantization: None,
            aliases: BTreeMap::new(),
        })
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Every tensor's dtype and shape, as a checked header describes them.
    pub fn header(&self) -> crate::safetensors_header::Header {
        use crate::safetensors_header::{Header, TensorInfo};
        Header {
            tensors: self
                .index
                .iter()
                .map(|(name, t)| {
                    let info = TensorInfo {
                        dtype: format!("{:?}", t.dtype),
                        shape: t.shape.iter().map(|&d| d as u64).collect(),
                    };
                    (name.clone(), info)
                })
                .collect(),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.located(name).is_some() || self.quantized(name).is_some()
    }

    /// Where a tensor is, by the name the engine asks for.
    fn located(&self, name: &str) -> Option<&Located> {
        let stored = self.aliases.get(name).map_or(name, String::as_str);
        self.index.get(stored)
    }

    /// How the model's linear weights are quantized, if they are.
    pub fn quantization(&self) -> Option<&Quantization> {
        self.quantization.as_ref()
    }

    /// Whether weight `name` is stored quantized.
    pub fn stored_quantized(&self, name: &str) -> bool {
        self.quantized(name).is_some()
    }

    /// The quantization of weight `name`, when it is stored quantized: a
    /// `….weight` with a `….weight_scale` beside it.
    pub(crate) fn quantized<'a>(&self, name: &'a str) -> Option<(&Quantization, &'a str)> {
        let q = self.quantization.as_ref()?;
        let stem = name.strip_suffix(".weight")?;
        let marker = match q.format {
            // MXFP4 quantizes the experts' parameters alone, never a
            // `….weight` (see `WeightFiles::mxfp4_experts`).
            Format::Mxfp4 => return None,
            Format::Gptq4 | Format::Gptq4V2 | Format::Awq4 => "qweight",
            Format::TransformersFp8 => "weight_scale_inv",
            _ => "weight_scale",
        };
        self.located(&format!("{stem}.{marker}"))
            .is_some()
            .then_some((q, stem))
    }

    /// A quantized `[out, in]` weight dequantized to f32 (see
    /// [`crate::quantization`]); `None` when `name` is not stored quantized.
    fn dequantized(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<f32>>> {
        Ok(self.quantized_matrix(name, shape)?.map(|m| m.to_f32()))
    }

    /// Whether the files hold a tensor of this name, as stored.
    pub(crate) fn has_tensor(&self, name: &str) -> bool {
        self.located(name).is_some()
    }

    /// The file a tensor lives in, for error messages.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.located(name).map(|t| self.files[t.file].0.as_path())
    }

    /// The raw bytes of one tensor.
    pub fn raw(&self, name: &str) -> Result<RawTensor<'_>> {
        let t = self.located(name).ok_or_else(|| {
            let first = self.files.first().map(|f| f.0.clone()).unwrap_or_default();
            FileError::model(first, name, "the tensor is missing")
        })?;
        Ok(RawTensor {
            dtype: t.dtype,
            shape: t.shape.clone(),
            data: &self.files[t.file].1[t.bytes.clone()],
        })
    }

    /// One tensor with its shape checked, and the file it is in.
    pub(crate) fn shaped(&self, name: &str, shape: &[usize]) -> Result<(RawTensor<'_>, PathBuf)> {
        let raw = self.raw(name)?;
        let path = self.file_of(name).unwrap_or(Path::new("")).to_path_buf();
        if raw.shape != shape {
            return Err(FileError::model(
                path,
                name,
                format!("has shape {:?}, expected {:?}", raw.shape, shape),
            ));
        }
        Ok((raw, path))
    }

    pub(crate) fn non_finite(path: &Path, name: &str, value: f32, at: usize) -> FileError {
        FileError::model(
            path,
            name,
            format!("holds a non-finite value ({value}) at element {at}"),
        )
    }

    /// One tensor as f32, checking its shape. f32, f16 and bf16 are accepted;
    /// NaN and infinite values are refused.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        if let Some(w) = self.dequantized(name, shape)? {
            return Ok(w);
        }
        self.f32_values(name, shape)
    }

    /// [`WeightFiles::f32`] for a tensor stored as floats.
    pub(crate) fn f32_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (raw, path) = self.shaped(name, shape)?;
        let values = to_f32(raw.dtype, raw.data).map_err(|other| {
            FileError::model(
                &path,
                name,
                format!("dtype {other:?} is not supported; expected F32, F16 or BF16"),
            )
        })?;
        if let Some(bad) = values.iter().position(|v| !v.is_finite()) {
            return Err(Self::non_finite(&path, name, values[bad], bad));
        }
        Ok(values)
    }

    /// One tensor's bf16 bits when the file stores it as bf16, checking its
    /// shape and refusing NaN and infinite values as [`WeightFiles::f32`]
    /// does; `None` for any other dtype.
    pub fn bf16_bits(&self, name: &str, shape: &[usize]) -> Result<Option<Vec<u16>>> {
        if self.quantized(name).is_some() {
            return Ok(None);
        }
        let (raw, path) = self.shaped(name, shape)?;
        if raw.dtype != Dtype::BF16 {
            return Ok(None);
        }
        let bits: Vec<u16> = raw
            .data
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        // All exponent bits set is an infinity or a NaN.
        if let Some(bad) = bits.iter().position(|&h| h & 0x7f80 == 0x7f80) {
            let value = half::bf16::from_bits(bits[bad]).to_f32();
            return Err(Self::non_finite(&path, name, value, bad));
        }
        Ok(Some(bits))
    }

    /// SHA-256 over every tensor in canonical order; see the module docs.
    /// `progress` is called with (bytes hashed, bytes in all).
    pub fn base_hash(&self, progress: &mut dyn FnMut(u64, u64)) -> Result<BaseHash> {
        let total: u64 = self.files.iter().map(|(_, m)| m.len() as u64).sum();
        let mut done = 0u64;
        let mut hasher = Sha256::new();
        hasher.update(HASH_DOMAIN);
        let len = |n: usize| (n as u64).to_le_bytes();
        for name in self.index.keys() {
            let raw = self.raw(name)?;
            let dtype = format!("{:?}", raw.dtype);
            hasher.update(len(name.len()));
            hasher.update(name.as_bytes());
            hasher.update(len(dtype.len()));
            hasher.update(dtype.as_bytes());
            hasher.update(len(raw.shape.len()));
            for &d in &raw.shape {
                hasher.update(len(d));
            }
            hasher.update(len(raw.data.len()));
            for chunk in raw.data.chunks(64 << 20) {
                hasher.update(chunk);
                done += chunk.len() as u64;
                progress(done, total);
            }
        }
        if let Some(q) = &self.quantization {
            let canonical = q.canonical();
            hasher.update(b"quantization\n");
            hasher.update(len(canonical.len()));
            hasher.update(canonical.as_bytes());
        }
        Ok(BaseHash::from_bytes(hasher.finalize().into()))
    }
}

impl WeightFiles {
    /// Makes an adapter's tensors answer to the names a text model's
    /// adapter gives them ([`language_model_name`]).
    pub fn serve_language_model_adapter(&mut self) {
        self.aliases = self
            .index
            .keys()
            .filter_map(|stored| {
                let served = language_model_name(stored)?;
                (served != stored.as_str()).then(|| (served.into_owned(), stored.clone()))
            })
            .collect();
    }
}

/// An adapter tensor's name as a text model's adapter names it, or None for
/// a tensor outside the language model. A multimodal checkpoint's adapter
/// (Gemma 3's) holds its language model's factors under
/// `base_model.model.model.language_model.` (transformers 5) or
/// `base_model.model.language_model.model.` (transformers 4), and may hold
/// factors on the vision tower and the projector too (a target list such
/// as `["q_proj", "v_proj"]` matches their modules): those act on images
/// alone, which the engine refuses, so a text request's result is the same
/// with or without them, and they are left out.
pub fn language_model_name(name: &str) -> Option<std::borrow::Cow<'_, str>> {
    use std::borrow::Cow;
    if name.contains(".vision_tower.") || name.contains(".multi_modal_projector.") {
        return None;
    }
    for (stored, served) in [
        (
            "base_model.model.model.language_model.",
            "base_model.model.model.",
        ),
        ("base_model.model.language_model.", "base_model.model."),
    ] {
        if let Some(rest) = name.strip_prefix(stored) {
            return Some(Cow::Owned(format!("{served}{rest}")));
        }
    }
    Some(Cow::Borrowed(name))
}

/// The language model's tensors of a multimodal Gemma 3 checkpoint under
/// the names a text model gives them: `language_model.model.…` and
/// `language_model.lm_head.…` (transformers 4) or `model.language_model.…`
/// (transformers 5) become `model.…` and `lm_head.…`. The vision tower and
/// the projector keep their names, which no text model asks for.
pub fn language_model_names<'a>(
    stored: impl Iterator<Item = &'a String>,
) -> BTreeMap<String, String> {
    stored
        .filter_map(|name| {
            let served = if let Some(rest) = name.strip_prefix("language_model.") {
                rest.to_owned()
            } else if let Some(rest) = name.strip_prefix("model.language_model.") {
                format!("model.{rest}")
            } else {
                return None;
            };
            Some((served, name.clone()))
        })
        .collect()
}

/// The base hash of a model directory; see the module docs.
pub fn base_hash(dir: &Path, progress: &mut dyn FnMut(u64, u64)) -> Result<BaseHash> {
    WeightFiles::open_model_dir(dir)?.base_hash(progress)
}

/// The shard files a `model.safetensors.index.json` (parsed as `root`)
/// names, distinct and sorted, and its `weight_map`. A shard must be a
/// plain file name beside the index: no directories, no escape.
pub fn index_shards<'m>(
    index: &Path,
    root: &'m serde_json::Map<String, serde_json::Value>,
) -> Result<(Vec<String>, &'m serde_json::Map<String, serde_json::Value>)> {
    let Some(serde_json::Value::Object(map)) = root.get("weight_map") else {
        return Err(FileError::model(
            index,
            "weight_map",
            "is required and must be an object",
        ));
    };
    let mut shards: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(FileError::model(
                index,
                format!("weight_map.{tensor}"),
                "must be a file name",
            ));
        };
        if file.is_empty() || file.contains(['/', '\\']) || file == ".." || file == "." {
            return Err(FileError::model(
                index,
                format!("weight_map.{tensor}"),
                format!("{file:?} must be a plain file name in the model directory"),
            ));
        }
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_owned());
        }
    }
    shards.sort();
    Ok((shards, map))
}

/// The values of a float tensor; the dtype itself when it is not one.
fn to_f32(dtype: Dtype, data: &[u8]) -> std::result::Result<Vec<f32>, Dtype> {
    Ok(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => return Err(other),
    })
}

#[allow(unsafe_code)]
fn map_file(file: &File) -> std::io::Result<Mmap> {
    // SAFETY: model and adapter files are treated as read-only while mapped;
    // a process that truncated them underneath would be a deployment error,
    // the same contract every safetensors loader relies on.
    unsafe { Mmap::map(file) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;

    fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, TensorView<'_>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn a_header_larger_than_a_few_mib_is_refused_before_it_is_parsed() {
        // A real header the size of the limit, padded with spaces as the
        // format allows, is read; one byte more is refused by its size.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("model.safetensors");
        let json = br#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
        let write = |len: u64| {
            let mut bytes = len.to_le_bytes().to_vec();
            bytes.extend_from_slice(json);
            bytes.resize(8 + len as usize, b' ');
            bytes.extend_from_slice(&1f32.to_le_bytes());
            std::fs::write(&path, bytes).unwrap();
        };
        let max = crate::safetensors_header::MAX_HEADER_BYTES;
        write(max);
        assert_eq!(
            WeightFiles::open(vec![path.clone()])
                .unwrap()
                .f32("a", &[1])
                .unwrap(),
            [1.0]
        );
        assert_eq!(
            crate::safetensors_header::read(&path)
                .unwrap()
                .tensors
                .len(),
            1
        );
        write(max + 1);
        let err = WeightFiles::open(vec![path.clone()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("above the 8388608 bytes"), "{err}");
        let err = crate::safetensors_header::read(&path)
            .unwrap_err()
            .to_string();
        assert!(err.contains("implausible"), "{err}");
    }

    #[test]
    fn base_hash_ignores_sharding_but_not_content() {
        let a = (
            "a.weight",
            Dtype::F32,
            vec![2, 2],
            f32_bytes(&[1.0, 2.0, 3.0, 4.0]),
        );
        let b = ("b.weight", Dtype::F32, vec![3], f32_bytes(&[5.0, 6.0, 7.0]));
        let one = tempfile::tempdir().unwrap();
        write_st(
            &one.path().join("model.safetensors"),
            &[a.clone(), b.clone()],
        );
        let sharded = tempfile::tempdir().unwrap();
        write_st(
            &sharded.path().join("model-00002-of-00002.safetensors"),
            std::slice::from_ref(&a),
        );
        write_st(
            &sharded.path().join("model-00001-of-00002.safetensors"),
            std::slice::from_ref(&b),
        );
        std::fs::write(
            sharded.path().join("model.safetensors.index.json"),
            serde_json::json!({"metadata": {}, "weight_map": {
                "a.weight": "model-00002-of-00002.safetensors",
                "b.weight": "model-00001-of-00002.safetensors"}})
            .to_string(),
        )
        .unwrap();
        let h1 = base_hash(one.path(), &mut |_, _| {}).unwrap();
        let mut calls = 0;
        let h2 = base_hash(sharded.path(), &mut |done, total| {
            calls += 1;
            assert!(done <= total);
        })
        .unwrap();
        assert_eq!(h1, h2);
        assert_eq!(h1.len(), 64);
        assert!(calls >= 2);

        let changed = tempfile::tempdir().unwrap();
        let b2 = ("b.weight", Dtype::F32, vec![3], f32_bytes(&[5.0, 6.0, 7.5]));
        write_st(&changed.path().join("model.safetensors"), &[a.clone(), b2]);
        assert_ne!(h1, base_hash(changed.path(), &mut |_, _| {}).unwrap());

        let reshaped = tempfile::tempdir().unwrap();
        let a2 = ("a.weight", Dtype::F32, vec![4], a.3.clone());
        write_st(&reshaped.path().join("model.safetensors"), &[a2, b]);
        assert_ne!(h1, base_hash(reshaped.path(), &mut |_, _| {}).unwrap());
    }

    #[test]
    fn converts_half_types_and_refuses_bad_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        let bf: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        let f16: Vec<u8> = [0.25f32, 8.0]
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_le_bytes())
            .collect();
        write_st(
            &path,
            &[
                ("bf", Dtype::BF16, vec![2], bf),
                ("h", Dtype::F16, vec![2], f16),
                ("nan", Dtype::F32, vec![2], f32_bytes(&[1.0, f32::NAN])),
                ("int", Dtype::I32, vec![1], vec![0, 0, 0, 0]),
                (
                    "bf_inf",
                    Dtype::BF16,
                    vec![2],
                    [0x3fc0u16, 0x7f80]
                        .iter()
                        .flat_map(|h| h.to_le_bytes())
                        .collect(),
                ),
            ],
        );
        let w = WeightFiles::open(vec![path]).unwrap();
        // bf16 kept as bits: the same values, checks and messages as f32.
        let bits = w.bf16_bits("bf", &[2]).unwrap().unwrap();
        assert_eq!(
            bits,
            [1.5f32, -2.0].map(|x| half::bf16::from_f32(x).to_bits())
        );
        assert_eq!(w.bf16_bits("h", &[2]).unwrap(), None);
        let err = w.bf16_bits("bf", &[3]).unwrap_err().to_string();
        assert!(err.contains("`bf`: has shape [2], expected [3]"), "{err}");
        let err = w.bf16_bits("bf_inf", &[2]).unwrap_err().to_string();
        assert!(
            err.contains("`bf_inf`: holds a non-finite value (inf) at element 1"),
            "{err}"
        );
        assert_eq!(w.f32("bf", &[2]).unwrap(), vec![1.5, -2.0]);
        assert_eq!(w.f32("h", &[2]).unwrap(), vec![0.25, 8.0]);
        let err = w.f32("h", &[3]).unwrap_err().to_string();
        assert!(err.contains("`h`: has shape [2], expected [3]"), "{err}");
        let err = w.f32("nan", &[2]).unwrap_err().to_string();
        assert!(err.contains("`nan`: holds a non-finite value"), "{err}");
        let err = w.f32("int", &[1]).unwrap_err().to_string();
        assert!(err.contains("dtype I32 is not supported"), "{err}");
        assert!(
            w.f32("missing", &[1])
                .unwrap_err()
                .to_string()
                .contains("`missing`: the tensor is missing")
        );
    }

    #[test]
    fn byte_ranges_recorded_at_open_pick_each_tensor_and_a_cut_file_is_refused_at_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w.safetensors");
        write_st(
            &path,
            &[
                ("x", Dtype::F32, vec![2], f32_bytes(&[1.0, 2.0])),
                ("y", Dtype::F32, vec![1, 1], f32_bytes(&[3.0])),
            ],
        );
        let w = WeightFiles::open(vec![path.clone()]).unwrap();
        // The byte ranges recorded at open pick out each tensor's own data.
        assert_eq!(w.f32("x", &[2]).unwrap(), vec![1.0, 2.0]);
        assert_eq!(w.f32("y", &[1, 1]).unwrap(), vec![3.0]);
        assert_eq!(w.raw("y").unwrap().shape, vec![1, 1]);
        drop(w);
        // A file cut short: its header names bytes that are not there.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
        let err = WeightFiles::open(vec![path]).unwrap_err().to_string();
        assert!(
            err.contains("(header)") && err.contains("not a valid safetensors file"),
            "{err}"
        );
    }

    #[test]
    fn an_index_may_not_point_outside_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("model.safetensors.index.json"),
            serde_json::json!({"weight_map": {"a": "../evil.safetensors"}}).to_string(),
        )
        .unwrap();
        let err = WeightFiles::open_model_dir(dir.path())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`weight_map.a`") && err.contains("plain file name"),
            "{err}"
        );
    }
}
