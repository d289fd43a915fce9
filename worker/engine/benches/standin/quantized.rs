//! The bf16 stand-in quantized as llm-compressor's round-to-nearest
//! scheme would, in the `compressed-tensors` layout: int8 per output
//! channel (`int-quantized`), 4-bit per group of 128 inputs
//! (`pack-quantized`), or FP8 e4m3 per output channel with dynamic
//! per-token activations (`float-quantized`, W8A8), symmetric, scales in
//! f32. Embeddings and norms stay bf16, as in a quantized checkpoint.
//! Written once beside the others.

use std::path::PathBuf;

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// The stand-in quantized to `bits` (8 or 4), created if missing.
#[allow(dead_code)]
pub fn model_quantized(bits: u32) -> PathBuf {
    quantize(&super::model_in(Dtype::BF16), &format!("int{bits}"))
}

/// The bf16 model at `source` quantized as `kind` ("int8", "int4" or
/// "fp8"), written beside it the first time.
pub fn quantize(source: &std::path::Path, kind: &str) -> PathBuf {
    let bits = match kind {
        "int8" | "fp8" => 8,
        "int4" => 4,
        other => panic!("no {other} stand-in"),
    };
    let fp8 = kind == "fp8";
    let dir = source.with_file_name(format!("model-{kind}"));
    if dir.join("model.safetensors").exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(source.join(f), dir.join(f)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(source.join("config.json")).unwrap()).unwrap();
    let (format, strategy, group) = match bits {
        8 => ("int-quantized", "channel", serde_json::Value::Null),
        4 => ("pack-quantized", "group", 128.into()),
        other => panic!("no {other}-bit stand-in"),
    };
    config["quantization_config"] = serde_json::json!({
        "quant_method": "compressed-tensors", "format": format, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": bits, "type": "int", "symmetric": true, "strategy": strategy,
            "group_size": group, "dynamic": false}}},
        "ignore": ["lm_head"]
    });
    if fp8 {
        let q = &mut config["quantization_config"];
        q["format"] = "float-quantized".into();
        q["config_groups"]["group_0"]["weights"]["type"] = "float".into();
        q["config_groups"]["group_0"]["input_activations"] = serde_json::json!({
            "num_bits": 8, "type": "float", "symmetric": true, "strategy": "token", "dynamic": true});
    }
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(source.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let projection = name.ends_with("_proj.weight");
        if !projection {
            out.push((
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            ));
            continue;
        }
        let (rows, cols) = (view.shape()[0], view.shape()[1]);
        let w: Vec<f32> = view
            .data()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let stem = name.strip_suffix(".weight").unwrap().to_owned();
        if fp8 {
            let (scales, codes) = fp8_rows(&w, cols);
            let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
            out.push((
                format!("{stem}.weight_scale"),
                Dtype::F32,
                vec![rows, 1],
                scale_bytes,
            ));
            out.push((name, Dtype::F8_E4M3, vec![rows, cols], codes));
            continue;
        }
        let group = if bits == 8 { cols } else { 128 };
        let (qmax, qmin) = if bits == 8 {
            (127.0, -128.0)
        } else {
            (7.0, -8.0)
        };
        let mut scales = Vec::with_capacity(rows * cols / group);
        let mut codes = vec![0i8; rows * cols];
        for r in 0..rows {
            for g0 in (0..cols).step_by(group) {
                let part = &w[r * cols + g0..r * cols + g0 + group];
                let max = part.iter().fold(0f32, |m, v| m.max(v.abs()));
                let s = if max > 0.0 { max / qmax } else { 1.0 };
                scales.push(s);
                for (c, v) in part.iter().enumerate() {
                    codes[r * cols + g0 + c] = (v / s).round().clamp(qmin, qmax) as i8;
                }
            }
        }
        let scale_bytes = scales.iter().flat_map(|s| s.to_le_bytes()).collect();
        out.push((
            format!("{stem}.weight_scale"),
            Dtype::F32,
            vec![rows, cols / group],
            scale_bytes,
        ));
        if bits == 8 {
            out.push((
                name,
                Dtype::I8,
                vec![rows, cols],
                codes.iter().map(|&c| c as u8).collect(),
            ));
        } else {
            let words: Vec<u8> = codes
                .chunks_exact(8)
                .flat_map(|eight| {
                    let word = eight
                        .iter()
                        .enumerate()
                        .fold(0u32, |w, (i, &c)| w | (((c + 8) as u32) << (4 * i)));
                    word.to_le_bytes()
                })
                .collect();
            out.push((
                format!("{stem}.weight_packed"),
                Dtype::I32,
                vec![rows, cols / 8],
                words,
            ));
        }
    }
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    dir
}

/// Each row of `w` (`cols` wide) as FP8 e4m3 codes under a scale of
/// max|row| / 448: the nearest code to each value / scale.
fn fp8_rows(w: &[f32], cols: usize) -> (Vec<f32>, Vec<u8>) {
    // The finite non-negative codes in increasing value.
    let table: Vec<(f32, u8)> = (0u8..0x7f)
        .map(|c| (lorafleet_engine::model::quantization::fp8_e4m3_to_f32(c), c))
        .collect();
    let nearest = |v: f32| -> u8 {
        let a = v.abs().min(448.0);
        let i = table.partition_point(|&(x, _)| x < a);
        let code = if i == 0 {
            table[0].1
        } else if i == table.len() || a - table[i - 1].0 <= table[i].0 - a {
            table[i - 1].1
        } else {
            table[i].1
        };
        if v < 0.0 { code | 0x80 } else { code }
    };
    let mut scales = Vec::with_capacity(w.len() / cols);
    let mut codes = Vec::with_capacity(w.len());
    for row in w.chunks_exact(cols) {
        let max = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if max > 0.0 { max / 448.0 } else { 1.0 };
        scales.push(s);
        codes.extend(row.iter().map(|v| nearest(v / s)));
    }
    (scales, codes)
}
