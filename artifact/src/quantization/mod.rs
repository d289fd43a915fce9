//! Quantized base weights: a checkpoint's `quantization_config` and the
//! dequantization of its linear layers' weights.
//!
//! Read as they are shipped, in the `compressed-tensors` layout that
//! llm-compressor writes and vLLM reads (`quant_method:
//! "compressed-tensors"`), one config group whose weights are:
//!
//! - `int-quantized`: `W.weight` int8 `[out, in]`, 8 bits, symmetric or
//!   asymmetric (`W.weight_zero_point`, int8, the scale's shape);
//! - `pack-quantized`: `W.weight_packed` int32 `[out, ⌈in · bits / 32⌉]`
//!   at 4 or 8 bits (signed: each value plus `2^(bits-1)`, packed densely
//!   along the input, column `c` at bit `bits · c` of its row's words, four
//!   8-bit or eight 4-bit values to a word) and `W.weight_shape`;
//!   asymmetric, with `W.weight_zero_point` int32 `[⌈out · bits / 32⌉,
//!   groups]`, signed zero points packed the same way but along the output;
//! - `float-quantized`: `W.weight` FP8 e4m3 `[out, in]`;
//!
//! with `W.weight_scale` (f32, f16 or bf16) per tensor (`[1]`), per output
//! channel (`[out, 1]`), per group of `group_size` inputs (`[out, in /
//! group_size]`) or, for FP8, per block of `block_structure` (`[⌈out /
//! rows⌉, ⌈in / cols⌉]`, the last blocks partial). A weight dequantizes as
//! `(q - zero_point) · scale`, computed in f32 (the scale widened exactly).
//! A group's `input_activations` (int8 or FP8, symmetric, dynamic, a scale
//! per token or per group of inputs) are recorded
//! ([`Quantization::input`]): the CPU backend quantizes a projection's
//! inputs as compressed-tensors' own forward does, and the CUDA backend
//! runs FP8 weights per channel with FP8 inputs per token as FP8 GEMMs.
//! The fields are checked one by one (`compressed.rs`).
//!
//! transformers' own FP8 format (`quant_method: "fp8"`): `W.weight` FP8
//! e4m3 and `W.weight_scale_inv` f32 per block of `weight_block_size`,
//! `code · scale_inv`, inputs as they are (its reader on a CPU).
//!
//! and GPTQ checkpoints (`quant_method: "gptq"`, 4 bits): `W.qweight` int32
//! `[in / 8, out]` (eight values along the input to a word, row k in bits
//! `4 (k mod 8)` of word row `k / 8`), `W.qzeros` int32 `[groups, out / 8]`
//! (packed along the output the same way), `W.scales` `[groups, out]` and
//! `W.g_idx` (each input's group; `k / group_size` without it), dequantized
//! as `(q - zero) · scale` with the zero point stored minus one in
//! AutoGPTQ's `checkpoint_format: "gptq"` and as it is in `"gptq_v2"`.
//!
//! AWQ checkpoints (`quant_method: "awq"`, 4 bits, `version: "gemm"`, with
//! zero points) are AutoAWQ's GEMM layout: `W.qweight` int32 `[in, out /
//! 8]` and `W.qzeros` int32 `[groups, out / 8]`, both packed along the
//! output with column `8 w + [0, 2, 4, 6, 1, 3, 5, 7][i]` in bits `4 i` of
//! word `w`, and `W.scales` `[groups, out]`; `(q - zero) · scale`.
//!
//! MXFP4 (`quant_method: "mxfp4"`, GPT-OSS as OpenAI released it): the
//! Mixture-of-Experts projections alone, each `[experts, in, out]`
//! parameter `P` stored as `P_blocks` uint8 `[experts, out, in / 32, 16]`
//! (two FP4 E2M1 codes a byte, the lower input in the low nibble) and
//! `P_scales` uint8 `[experts, out, in / 32]` (E8M0: the group of 32
//! inputs is scaled by `2^(s - 127)`); `modules_to_not_convert` names what
//! stays in bf16, as the release writes it.
//!
//! Everything else — another `quant_method` (bitsandbytes, HQQ…), a
//! format, bit width, type or strategy not listed — is refused by the field
//! that names it.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{FileError, Result};

mod compressed;
mod inputs;
mod matrix;

pub use inputs::f32_to_fp8_e4m3;

pub use matrix::{
    AWQ_ORDER, Codes, FP4_E2M1, QuantizedMatrix, fp8_e4m3_to_f32, scale_shape, unpack_awq,
    unpack_int4_rows,
};
pub(crate) use matrix::{by_group, input_groups, nibble, packed_value, word_at};

/// How a checkpoint's quantized weights are stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantization {
    pub format: Format,
    pub strategy: Strategy,
    pub symmetric: bool,
    /// Modules left unquantized (by name or `re:` pattern), as written.
    pub ignore: Vec<String>,
    /// How the projections' inputs are quantized on the fly, where the
    /// checkpoint's own reader does so (compressed-tensors
    /// `input_activations`): the CPU backend quantizes them the same way,
    /// and the CUDA backend runs FP8 checkpoints with FP8 inputs per token
    /// as FP8 GEMMs.
    pub input: Option<InputQuantization>,
}

/// The inputs' quantization: symmetric, a scale computed per token or per
/// group of inputs from the values themselves (`max |x| / (range / 2)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InputQuantization {
    pub kind: InputKind,
    pub granularity: InputGranularity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputKind {
    Int8,
    Fp8E4m3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputGranularity {
    /// One scale per token (a row of the projection's input).
    Token,
    /// One scale per token and group of this many consecutive inputs.
    Group(usize),
}

impl InputQuantization {
    fn describe(&self) -> String {
        let kind = match self.kind {
            InputKind::Int8 => "int8",
            InputKind::Fp8E4m3 => "fp8-e4m3",
        };
        match self.granularity {
            InputGranularity::Token => format!("{kind}-token"),
            InputGranularity::Group(g) => format!("{kind}-group-{g}"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// int8 weights.
    Int8,
    /// 4-bit weights packed eight to an int32.
    PackedInt4,
    /// 8-bit weights packed four to an int32 (compressed-tensors
    /// `pack-quantized` at 8 bits, llm-compressor's W8A16).
    PackedInt8,
    /// FP8 e4m3 weights.
    Fp8E4m3,
    /// FP8 e4m3 weights with `weight_scale_inv` per block, in transformers'
    /// own `fp8` format.
    TransformersFp8,
    /// GPTQ 4-bit (`qweight`, `qzeros`, `scales`, `g_idx`), zero points
    /// stored minus one (AutoGPTQ's format).
    Gptq4,
    /// GPTQ 4-bit with zero points stored as they are.
    Gptq4V2,
    /// AWQ 4-bit in AutoAWQ's GEMM layout.
    Awq4,
    /// MXFP4: FP4 E2M1 codes with a power-of-two scale per 32 inputs, on
    /// the Mixture-of-Experts projections (GPT-OSS).
    Mxfp4,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    Tensor,
    Channel,
    Group(usize),
    /// A scale per block of `rows` outputs by `cols` inputs (the last
    /// blocks of a matrix may be partial).
    Block {
        rows: usize,
        cols: usize,
    },
}

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Int8 | Format::PackedInt8 => "int8",
            Format::PackedInt4 => "int4",
            Format::Fp8E4m3 | Format::TransformersFp8 => "fp8-e4m3",
            Format::Gptq4 | Format::Gptq4V2 => "gptq-int4",
            Format::Awq4 => "awq-int4",
            Format::Mxfp4 => "mxfp4",
        }
    }

    /// Whether the codes are FP8 e4m3.
    pub fn is_fp8(self) -> bool {
        matches!(self, Format::Fp8E4m3 | Format::TransformersFp8)
    }
}

impl Quantization {
    /// A short description for operators: `"gptq-int4, groups of 128"`.
    pub fn label(&self) -> String {
        let scales = match self.strategy {
            Strategy::Tensor => "per tensor".to_owned(),
            Strategy::Channel => "per channel".to_owned(),
            Strategy::Group(g) => format!("groups of {g}"),
            Strategy::Block { rows, cols } => format!("blocks of {rows}x{cols}"),
        };
        let input = match self.input.map(|i| (i.kind, i.granularity)) {
            None => String::new(),
            Some((kind, granularity)) => {
                let kind = match kind {
                    InputKind::Int8 => "int8",
                    InputKind::Fp8E4m3 => "fp8-e4m3",
                };
                match granularity {
                    InputGranularity::Token => format!(", inputs {kind} per token"),
                    InputGranularity::Group(g) => format!(", inputs {kind} per group of {g}"),
                }
            }
        };
        format!("{}, {scales}{input}", self.format.name())
    }

    /// Whether the checkpoint quantizes the projections' inputs too.
    pub fn activations(&self) -> bool {
        self.input.is_some()
    }

    /// Whether the checkpoint's FP8 weights take FP8 inputs with a scale
    /// per token: what an FP8 GEMM with a scale per row computes.
    pub fn fp8_inputs_per_token(&self) -> bool {
        self.format.is_fp8()
            && self.input
                == Some(InputQuantization {
                    kind: InputKind::Fp8E4m3,
                    granularity: InputGranularity::Token,
                })
    }

    /// What the base hash covers of the configuration (see
    /// the weights module): every field that changes what the stored bytes
    /// dequantize to, or what the model computes from them (the inputs'
    /// quantization), written the same whatever the JSON's layout, so the
    /// same bytes read another way are another base model.
    pub fn canonical(&self) -> String {
        let format = match self.format {
            Format::Int8 => "int8",
            Format::PackedInt4 => "int4-packed",
            Format::PackedInt8 => "int8-packed",
            Format::Fp8E4m3 => "fp8-e4m3",
            Format::TransformersFp8 => "transformers-fp8-e4m3",
            Format::Gptq4 => "gptq-int4",
            Format::Gptq4V2 => "gptq-v2-int4",
            Format::Awq4 => "awq-int4-gemm",
            Format::Mxfp4 => "mxfp4-e2m1-e8m0",
        };
        let strategy = match self.strategy {
            Strategy::Tensor => "tensor".to_owned(),
            Strategy::Channel => "channel".to_owned(),
            Strategy::Group(g) => format!("group-{g}"),
            Strategy::Block { rows, cols } => format!("block-{rows}x{cols}"),
        };
        let mut ignore = self.ignore.clone();
        ignore.sort();
        // Weight-only checkpoints keep the form (and so the hash) they
        // had before inputs were read.
        let input = self
            .input
            .map(|i| format!(";input={}", i.describe()))
            .unwrap_or_default();
        format!(
            "format={format};strategy={strategy};symmetric={};ignore={}{input}",
            self.symmetric,
            ignore.join(",")
        )
    }
}

/// Reads `quantization_config` of `config.json` at `file`, if there is one.
pub fn parse(file: &Path, config: &Map<String, Value>) -> Result<Option<Quantization>> {
    let Some(q) = config.get("quantization_config").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let err = |field: &str, reason: String| {
        FileError::model(file, format!("quantization_config{field}"), reason)
    };
    let Value::Object(q) = q else {
        return Err(err("", "must be an object".into()));
    };
    match q.get("quant_method") {
        Some(Value::String(m)) if m == "compressed-tensors" => compressed::parse(q, &err).map(Some),
        Some(Value::String(m)) if m == "fp8" => parse_transformers_fp8(q, &err).map(Some),
        Some(Value::String(m)) if m == "gptq" => parse_gptq(q, &err).map(Some),
        Some(Value::String(m)) if m == "awq" => parse_awq(q, &err).map(Some),
        Some(Value::String(m)) if m == "mxfp4" => parse_mxfp4(q, &err).map(Some),
        Some(other) => Err(err(
            ".quant_method",
            format!(
                "{} is not supported; quantized bases are read in the \"compressed-tensors\", \"fp8\", \"gptq\", \"awq\" or \"mxfp4\" layout",
                shown(other)
            ),
        )),
        None => Err(err(".quant_method", "is required".into())),
    }
}

/// A JSON value as the checkpoint wrote it (`8`, `"block"`, `[128,128]`),
/// for messages.
pub(crate) fn shown(v: &Value) -> String {
    v.to_string()
}

/// transformers' own FP8 format (`quant_method: "fp8"`, the official
/// Qwen3-*-FP8 and DeepSeek releases): `W.weight` FP8 e4m3 and
/// `W.weight_scale_inv` f32 per block of `weight_block_size` (128 × 128
/// when absent, as transformers defaults it; one block for the whole
/// matrix when null), `weight = code · scale_inv`. Its
/// `activation_scheme` says how a GPU quantizes the inputs; transformers'
/// own reader of the checkpoint on a CPU (`dequantize`) runs them as they
/// are, and so does this one.
fn parse_transformers_fp8(
    q: &Map<String, Value>,
    err: &dyn Fn(&str, String) -> FileError,
) -> Result<Quantization> {
    const KNOWN: &[&str] = &[
        "quant_method",
        "activation_scheme",
        "fmt",
        "weight_block_size",
        "modules_to_not_convert",
        "ignored_layers",
        "scale_fmt",
        "dequantize",
    ];
    if let Some(k) = q.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(err(
            &format!(".{k}"),
            "is not a field this reader knows, so what it would change cannot be checked".into(),
        ));
    }
    match q.get("activation_scheme") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "dynamic" => {}
        Some(other) => {
            return Err(err(
                ".activation_scheme",
                format!(
                    "{}: static input scales are not supported; expected \"dynamic\"",
                    shown(other)
                ),
            ));
        }
    }
    match q.get("fmt") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "e4m3" => {}
        Some(other) => {
            return Err(err(
                ".fmt",
                format!("{} is not supported; expected \"e4m3\"", shown(other)),
            ));
        }
    }
    match q.get("scale_fmt") {
        // ue8m0: the scales are powers of two; stored as f32 they are
        // read as any other (the tensor's dtype is checked).
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "ue8m0" => {}
        Some(other) => {
            return Err(err(
                ".scale_fmt",
                format!(
                    "{} is not supported; expected \"ue8m0\" or null",
                    shown(other)
                ),
            ));
        }
    }
    // transformers' default is blocks of 128 x 128; null is one block.
    let strategy = match q.get("weight_block_size") {
        None => Strategy::Block {
            rows: 128,
            cols: 128,
        },
        Some(Value::Null) => Strategy::Tensor,
        Some(Value::Array(b))
            if b.len() == 2 && b.iter().all(|v| v.as_u64().is_some_and(|n| n > 0)) =>
        {
            Strategy::Block {
                rows: b[0].as_u64().unwrap() as usize,
                cols: b[1].as_u64().unwrap() as usize,
            }
        }
        Some(other) => {
            return Err(err(
                ".weight_block_size",
                format!("{}: must be two positive integers", shown(other)),
            ));
        }
    };
    let ignore = module_lists(q, &["modules_to_not_convert", "ignored_layers"], err)?;
    Ok(Quantization {
        format: Format::TransformersFp8,
        strategy,
        symmetric: true,
        ignore,
        input: None,
    })
}

/// The list fields of module names a `quantization_config` leaves
/// unquantized, as written.
fn module_lists(
    q: &Map<String, Value>,
    fields: &[&str],
    err: &dyn Fn(&str, String) -> FileError,
) -> Result<Vec<String>> {
    let mut ignore = Vec::new();
    for field in fields {
        match q.get(*field) {
            None | Some(Value::Null) => {}
            Some(Value::Array(names)) => ignore.extend(
                names
                    .iter()
                    .map(|n| n.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        err(
                            &format!(".{field}"),
                            "must be a list of module names".into(),
                        )
                    })?,
            ),
            Some(_) => {
                return Err(err(
                    &format!(".{field}"),
                    "must be a list of module names".into(),
                ));
            }
        }
    }
    Ok(ignore)
}

/// GPT-OSS's MXFP4 (`quant_method: "mxfp4"`, transformers' `Mxfp4Config`):
/// its `modules_to_not_convert`, and `dequantize` (how transformers loads
/// it, the same values either way).
fn parse_mxfp4(
    q: &Map<String, Value>,
    err: &dyn Fn(&str, String) -> FileError,
) -> Result<Quantization> {
    const KNOWN: &[&str] = &["quant_method", "modules_to_not_convert", "dequantize"];
    if let Some(k) = q.keys().find(|k| !KNOWN.contains(&k.as_str())) {
        return Err(err(
            &format!(".{k}"),
            "is not a field this reader knows, so what it would change cannot be checked".into(),
        ));
    }
    match q.get("dequantize") {
        None | Some(Value::Null | Value::Bool(_)) => {}
        Some(other) => {
            return Err(err(
                ".dequantize",
                format!("must be true or false, got {}", shown(other)),
            ));
        }
    }
    Ok(Quantization {
        format: Format::Mxfp4,
        strategy: Strategy::Group(32),
        symmetric: true,
        ignore: module_lists(q, &["modules_to_not_convert"], err)?,
        input: None,
    })
}

/// A GPTQ checkpoint's `quantization_config`: 4 bits, a group size (or
/// -1, one group per output channel), `desc_act` (the groups then follow
/// `g_idx`), `sym`, and `checkpoint_format` `"gptq"` (zero points stored
/// minus one, as AutoGPTQ writes them) or `"gptq_v2"`.
fn parse_gptq(
    q: &Map<String, Value>,
    err: &dyn Fn(&str, String) -> FileError,
) -> Result<Quantization> {
    match q.get("bits") {
        Some(b) if b.as_u64() == Some(4) => {}
        other => {
            return Err(err(
                ".bits",
                format!(
                    "{} is not supported; GPTQ weights are read at 4 bits",
                    other.map_or("absent".into(), shown)
                ),
            ));
        }
    }
    let strategy = match q.get("group_size").and_then(Value::as_i64) {
        Some(-1) => Strategy::Channel,
        Some(g) if g > 0 => Strategy::Group(g as usize),
        _ => {
            return Err(err(
                ".group_size",
                "must be a positive integer or -1".into(),
            ));
        }
    };
    let format = match q.get("checkpoint_format") {
        None | Some(Value::Null) => Format::Gptq4,
        Some(Value::String(f)) if f == "gptq" => Format::Gptq4,
        Some(Value::String(f)) if f == "gptq_v2" => Format::Gptq4V2,
        Some(other) => {
            return Err(err(
                ".checkpoint_format",
                format!(
                    "{} is not supported; expected \"gptq\" or \"gptq_v2\"",
                    shown(other)
                ),
            ));
        }
    };
    Ok(Quantization {
        format,
        strategy,
        symmetric: q.get("sym").and_then(Value::as_bool).unwrap_or(true),
        ignore: Vec::new(),
        input: None,
    })
}

/// An AWQ checkpoint's `quantization_config`: 4 bits, a group size,
/// `zero_point: true` and `version: "gemm"` (AutoAWQ's GEMM layout).
fn parse_awq(
    q: &Map<String, Value>,
    err: &dyn Fn(&str, String) -> FileError,
) -> Result<Quantization> {
    match q.get("bits").or_else(|| q.get("w_bit")) {
        Some(b) if b.as_u64() == Some(4) => {}
        other => {
            return Err(err(
                ".bits",
                format!(
                    "{} is not supported; AWQ weights are read at 4 bits",
                    other.map_or("absent".into(), shown)
                ),
            ));
        }
    }
    let strategy = match q
        .get("group_size")
        .or_else(|| q.get("q_group_size"))
        .and_then(Value::as_i64)
    {
        Some(g) if g > 0 => Strategy::Group(g as usize),
        _ => return Err(err(".group_size", "must be a positive integer".into())),
    };
    match q.get("version") {
        None | Some(Value::Null) => {}
        Some(Value::String(v)) if v.eq_ignore_ascii_case("gemm") => {}
        Some(other) => {
            return Err(err(
                ".version",
                format!(
                    "{} is not supported; AWQ weights are read in the \"gemm\" layout",
                    shown(other)
                ),
            ));
        }
    }
    if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
        return Err(err(
            ".zero_point",
            "AWQ without zero points is not supported".into(),
        ));
    }
    Ok(Quantization {
        format: Format::Awq4,
        strategy,
        symmetric: false,
        ignore: Vec::new(),
        input: None,
    })
}

#[cfg(test)]
mod tests;
