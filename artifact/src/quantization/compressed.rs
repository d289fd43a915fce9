//! compressed-tensors' `quantization_config`, as llm-compressor writes it:
//! every field read and checked. A field that does not change the math
//! (`observer`, `observer_kwargs`, `scale_dtype`, `zp_dtype`, `version`,
//! `global_compression_ratio`, empty `sparsity_config` and
//! `transform_config`, null `kv_cache_scheme` and `output_activations`) is
//! accepted for what it is; one that would change it and is not
//! implemented (`actorder` with a group index, a kv cache scheme, sparsity,
//! transforms, output activations, static or asymmetric input scales) is
//! refused by its name, and so is a field this reader does not know.

use serde_json::{Map, Value};

use super::{
    Format, InputGranularity, InputKind, InputQuantization, Quantization, Strategy, shown,
};
use crate::error::FileError;

type Err<'a> = &'a dyn Fn(&str, String) -> FileError;

/// The top-level fields compressed-tensors writes.
const TOP: &[&str] = &[
    "quant_method",
    "format",
    "quantization_status",
    "config_groups",
    "ignore",
    "kv_cache_scheme",
    "sparsity_config",
    "transform_config",
    "global_compression_ratio",
    "version",
];
const GROUP: &[&str] = &[
    "targets",
    "weights",
    "input_activations",
    "output_activations",
    "format",
];
/// The fields of one tensor's quantization arguments.
const ARGS: &[&str] = &[
    "num_bits",
    "type",
    "symmetric",
    "strategy",
    "group_size",
    "block_structure",
    "dynamic",
    "actorder",
    "observer",
    "observer_kwargs",
    "scale_dtype",
    "zp_dtype",
];

/// Refuses a field of `map` (at `at`) that is not in `known`.
fn known_fields(
    map: &Map<String, Value>,
    known: &[&str],
    at: &str,
    err: Err,
) -> Result<(), FileError> {
    match map.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(err(
            &format!("{at}.{k}"),
            "is not a field this reader knows, so what it would change cannot be checked".into(),
        )),
        None => Ok(()),
    }
}

/// Null, absent, or an empty object: nothing applied.
fn nothing(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Object(m)) => m.is_empty(),
        Some(_) => false,
    }
}

pub(super) fn parse(q: &Map<String, Value>, err: Err) -> Result<Quantization, FileError> {
    known_fields(q, TOP, "", err)?;
    let text = |map: &Map<String, Value>, field: &str| {
        map.get(field).and_then(Value::as_str).map(str::to_owned)
    };
    match q.get("quantization_status") {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "compressed" => {}
        Some(other) => {
            return Err(err(
                ".quantization_status",
                format!("{}: only compressed checkpoints are read", shown(other)),
            ));
        }
    }
    if !nothing(q.get("kv_cache_scheme")) {
        return Err(err(
            ".kv_cache_scheme",
            "a quantized KV cache is not supported; the cache is kept in the weights' type".into(),
        ));
    }
    if !nothing(q.get("sparsity_config")) {
        return Err(err(
            ".sparsity_config",
            "sparse (pruned or 2:4) weights are not supported".into(),
        ));
    }
    if !nothing(q.get("transform_config")) {
        return Err(err(
            ".transform_config",
            "rotations (SpinQuant, QuIP) applied to the weights are not supported".into(),
        ));
    }
    let groups = match q.get("config_groups") {
        Some(Value::Object(g)) if g.len() == 1 => g,
        Some(Value::Object(g)) => {
            return Err(err(
                ".config_groups",
                format!(
                    "has {} groups; one group for every linear layer is supported",
                    g.len()
                ),
            ));
        }
        _ => {
            return Err(err(
                ".config_groups",
                "must be an object of one group".into(),
            ));
        }
    };
    let (group_name, group) = groups.iter().next().expect("one group");
    let at = |field: &str| format!(".config_groups.{group_name}{field}");
    let Value::Object(group) = group else {
        return Err(err(&at(""), "must be an object".into()));
    };
    known_fields(group, GROUP, &at(""), err)?;
    // The format is the group's where it has one (a mixed-precision
    // checkpoint names it there), else the checkpoint's.
    let format = match (text(group, "format"), text(q, "format")) {
        (Some(g), _) => g,
        (None, Some(top)) => top,
        (None, None) => return Err(err(".format", "is required".into())),
    };
    let format_field = if group.contains_key("format") {
        at(".format")
    } else {
        ".format".into()
    };
    let targets_linear = group
        .get("targets")
        .and_then(Value::as_array)
        .is_some_and(|t| t.iter().any(|t| t.as_str() == Some("Linear")));
    if !targets_linear {
        return Err(err(&at(".targets"), "must include \"Linear\"".into()));
    }
    if !nothing(group.get("output_activations")) {
        return Err(err(
            &at(".output_activations"),
            "quantized outputs are not supported".into(),
        ));
    }
    let Some(Value::Object(w)) = group.get("weights") else {
        return Err(err(&at(".weights"), "must be an object".into()));
    };
    let wat = |field: &str| at(&format!(".weights.{field}"));
    known_fields(w, ARGS, &at(".weights"), err)?;
    let bits = w.get("num_bits").cloned().unwrap_or(Value::Null);
    let kind = w.get("type").cloned().unwrap_or(Value::Null);
    let symmetric = match w.get("symmetric") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => {
            return Err(err(
                &wat("symmetric"),
                format!("{}: must be true or false", shown(other)),
            ));
        }
    };
    let format = match (format.as_str(), kind.as_str(), bits.as_u64()) {
        // "naive-quantized" stores each code in the smallest type that
        // holds it: for 8 bits, the layout of the two above.
        ("int-quantized" | "naive-quantized", Some("int"), Some(8)) => Format::Int8,
        ("pack-quantized", Some("int"), Some(4)) => Format::PackedInt4,
        ("pack-quantized", Some("int"), Some(8)) => Format::PackedInt8,
        ("float-quantized" | "naive-quantized", Some("float"), Some(8)) => Format::Fp8E4m3,
        ("int-quantized" | "pack-quantized" | "float-quantized" | "naive-quantized", _, _) => {
            return Err(err(
                &wat("num_bits"),
                format!(
                    "{} weights of {} bits are not supported in \"{format}\"; expected int 8 \
                     (int-quantized), int 4 or 8 (pack-quantized), float 8 (float-quantized) or int \
                     8 or float 8 (naive-quantized)",
                    shown(&kind),
                    shown(&bits),
                ),
            ));
        }
        _ => {
            return Err(err(
                &format_field,
                format!(
                    "\"{format}\" is not supported; expected \"int-quantized\", \"pack-quantized\", \
                     \"float-quantized\" or \"naive-quantized\""
                ),
            ));
        }
    };
    if !symmetric && format == Format::Fp8E4m3 {
        return Err(err(
            &wat("symmetric"),
            "asymmetric FP8 weights are not supported".into(),
        ));
    }
    match w.get("dynamic") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(other) => {
            return Err(err(
                &wat("dynamic"),
                format!(
                    "{}: weights are read with the scales stored beside them",
                    shown(other)
                ),
            ));
        }
    }
    match w.get("actorder") {
        // "weight" (and its alias "static") only orders the quantization;
        // the groups stay contiguous.
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s == "weight" || s == "static" => {}
        Some(other) => {
            return Err(err(
                &wat("actorder"),
                format!(
                    "{}: groups in activation order (a `weight_g_idx` per layer) are not supported",
                    shown(other)
                ),
            ));
        }
    }
    let strategy = strategy_of(w, &wat, err)?;
    if matches!(format, Format::PackedInt4 | Format::PackedInt8)
        && !matches!(strategy, Strategy::Group(_) | Strategy::Channel)
    {
        return Err(err(
            &wat("strategy"),
            "packed int weights need per-channel or per-group scales".into(),
        ));
    }
    if matches!(strategy, Strategy::Block { .. }) && format != Format::Fp8E4m3 {
        return Err(err(
            &wat("strategy"),
            "\"block\" scales are read for FP8 weights".into(),
        ));
    }
    let ignore = match q.get("ignore") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(names)) => names
            .iter()
            .map(|n| n.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| err(".ignore", "must be a list of module names".into()))?,
        Some(_) => return Err(err(".ignore", "must be a list of module names".into())),
    };
    let input = match group.get("input_activations") {
        None | Some(Value::Null) => None,
        Some(Value::Object(a)) => Some(input_of(
            a,
            &|f: &str| at(&format!(".input_activations{f}")),
            err,
        )?),
        Some(_) => {
            return Err(err(
                &at(".input_activations"),
                "must be an object (the activations' scheme) or null".into(),
            ));
        }
    };
    Ok(Quantization {
        format,
        strategy,
        symmetric,
        ignore,
        input,
    })
}

fn strategy_of(
    w: &Map<String, Value>,
    wat: &dyn Fn(&str) -> String,
    err: Err,
) -> Result<Strategy, FileError> {
    let positive = |v: &Value| v.as_u64().filter(|&g| g > 0).map(|g| g as usize);
    let strategy = w.get("strategy").cloned().unwrap_or(Value::Null);
    let strategy = match strategy.as_str() {
        Some("tensor") => Strategy::Tensor,
        Some("channel") => Strategy::Channel,
        Some("group") => match w.get("group_size").and_then(positive) {
            Some(g) => Strategy::Group(g),
            None => {
                return Err(err(&wat("group_size"), "must be a positive integer".into()));
            }
        },
        Some("block") => match w.get("block_structure") {
            Some(Value::Array(b)) if b.len() == 2 => match (positive(&b[0]), positive(&b[1])) {
                (Some(rows), Some(cols)) => Strategy::Block { rows, cols },
                _ => {
                    return Err(err(
                        &wat("block_structure"),
                        format!(
                            "{}: must be two positive integers",
                            shown(&Value::Array(b.clone()))
                        ),
                    ));
                }
            },
            _ => {
                return Err(err(
                    &wat("block_structure"),
                    "must be [rows, columns] for \"block\" scales".into(),
                ));
            }
        },
        _ => {
            return Err(err(
                &wat("strategy"),
                format!(
                    "{} is not supported; expected \"tensor\", \"channel\", \"group\" or \"block\"",
                    shown(&strategy)
                ),
            ));
        }
    };
    if !matches!(strategy, Strategy::Block { .. }) && !nothing_or_null(w.get("block_structure")) {
        return Err(err(
            &wat("block_structure"),
            "is only read with \"block\" scales".into(),
        ));
    }
    Ok(strategy)
}

fn nothing_or_null(v: Option<&Value>) -> bool {
    matches!(v, None | Some(Value::Null))
}

/// `input_activations`: quantized on the fly, symmetric, a scale per
/// token or per group of inputs.
fn input_of(
    a: &Map<String, Value>,
    at: &dyn Fn(&str) -> String,
    err: Err,
) -> Result<InputQuantization, FileError> {
    known_fields(a, ARGS, &at(""), err)?;
    let kind = match (
        a.get("type").and_then(Value::as_str),
        a.get("num_bits").and_then(Value::as_u64),
    ) {
        (Some("int"), Some(8)) => InputKind::Int8,
        (Some("float"), Some(8)) => InputKind::Fp8E4m3,
        _ => {
            return Err(err(
                &at(".num_bits"),
                format!(
                    "{} inputs of {} bits are not supported; expected int 8 or float 8",
                    shown(a.get("type").unwrap_or(&Value::Null)),
                    shown(a.get("num_bits").unwrap_or(&Value::Null)),
                ),
            ));
        }
    };
    if a.get("dynamic") != Some(&Value::Bool(true)) {
        return Err(err(
            &at(".dynamic"),
            format!(
                "{}: static input scales (`input_scale` per layer) are not supported; inputs are quantized dynamically",
                shown(a.get("dynamic").unwrap_or(&Value::Null))
            ),
        ));
    }
    if a.get("symmetric") == Some(&Value::Bool(false)) {
        return Err(err(
            &at(".symmetric"),
            "asymmetric input quantization is not supported".into(),
        ));
    }
    let granularity = match a.get("strategy").and_then(Value::as_str) {
        Some("token") => InputGranularity::Token,
        Some("group") => match a
            .get("group_size")
            .and_then(Value::as_u64)
            .filter(|&g| g > 0)
        {
            Some(g) => InputGranularity::Group(g as usize),
            None => return Err(err(&at(".group_size"), "must be a positive integer".into())),
        },
        _ => {
            return Err(err(
                &at(".strategy"),
                format!(
                    "{} is not supported for inputs; expected \"token\" or \"group\" (a dynamic scale per tensor \
                     would make each request's output depend on the others in its batch)",
                    shown(a.get("strategy").unwrap_or(&Value::Null))
                ),
            ));
        }
    };
    match a.get("actorder") {
        None | Some(Value::Null) => {}
        Some(other) => {
            return Err(err(
                &at(".actorder"),
                format!("{}: not read for inputs", shown(other)),
            ));
        }
    }
    Ok(InputQuantization { kind, granularity })
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::json;

    use super::super::*;

    fn config(q: Value) -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("quantization_config".into(), q);
        m
    }

    /// As llm-compressor 0.14 writes W8A16 (every field it writes).
    fn w8a16() -> Value {
        json!({
            "config_groups": {"group_0": {
                "format": "pack-quantized", "input_activations": null, "output_activations": null,
                "targets": ["Linear"],
                "weights": {"actorder": null, "block_structure": null, "dynamic": false, "group_size": 128,
                    "num_bits": 8, "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": null,
                    "strategy": "group", "symmetric": true, "type": "int", "zp_dtype": null}}},
            "format": "pack-quantized", "global_compression_ratio": null, "ignore": ["lm_head"],
            "kv_cache_scheme": null, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.19.0"
        })
    }

    fn fp8_block() -> Value {
        let mut v = w8a16();
        let g = &mut v["config_groups"]["group_0"];
        g["format"] = "float-quantized".into();
        g["weights"]["type"] = "float".into();
        g["weights"]["strategy"] = "block".into();
        g["weights"]["group_size"] = Value::Null;
        g["weights"]["block_structure"] = json!([128, 128]);
        g["input_activations"] = json!({"actorder": null, "block_structure": null, "dynamic": true,
            "group_size": 128, "num_bits": 8, "observer": null, "observer_kwargs": {}, "scale_dtype": null,
            "strategy": "group", "symmetric": true, "type": "float", "zp_dtype": null});
        v["format"] = "float-quantized".into();
        v
    }

    #[test]
    fn what_llm_compressor_writes_is_read_with_every_field_checked() {
        let file = Path::new("config.json");
        let q = parse(file, &config(w8a16())).unwrap().unwrap();
        assert_eq!(
            (q.format, q.strategy, q.symmetric),
            (Format::PackedInt8, Strategy::Group(128), true)
        );
        assert_eq!(q.input, None);
        assert_eq!(q.label(), "int8, groups of 128");
        let q = parse(file, &config(fp8_block())).unwrap().unwrap();
        assert_eq!(
            q.strategy,
            Strategy::Block {
                rows: 128,
                cols: 128
            }
        );
        assert_eq!(
            q.input,
            Some(InputQuantization {
                kind: InputKind::Fp8E4m3,
                granularity: InputGranularity::Group(128)
            })
        );
        assert_eq!(
            q.label(),
            "fp8-e4m3, blocks of 128x128, inputs fp8-e4m3 per group of 128"
        );
        assert!(
            q.canonical().contains("strategy=block-128x128"),
            "{}",
            q.canonical()
        );
        assert!(
            q.canonical().ends_with(";input=fp8-e4m3-group-128"),
            "{}",
            q.canonical()
        );
    }

    #[test]
    fn what_would_change_the_math_is_refused_by_name_with_the_value_as_written() {
        let file = Path::new("config.json");
        let refused = |base: Value, edit: &dyn Fn(&mut Value), field: &str, said: &str| {
            let mut v = base;
            edit(&mut v);
            let e = parse(file, &config(v)).unwrap_err().to_string();
            assert!(e.contains(field), "{field}: {e}");
            assert!(e.contains(said), "{said}: {e}");
            assert!(!e.contains("Some("), "no debug form: {e}");
        };
        let w = |v: &mut Value, k: &str, x: Value| v["config_groups"]["group_0"]["weights"][k] = x;
        refused(
            w8a16(),
            &|v| w(v, "num_bits", 3.into()),
            "weights.num_bits",
            "\"int\" weights of 3 bits",
        );
        refused(
            w8a16(),
            &|v| w(v, "actorder", "group".into()),
            "weights.actorder",
            "\"group\"",
        );
        refused(
            w8a16(),
            &|v| w(v, "strategy", "block".into()),
            "weights.block_structure",
            "[rows, columns]",
        );
        refused(
            w8a16(),
            &|v| w(v, "strategy", "tensor_group".into()),
            "weights.strategy",
            "\"tensor_group\"",
        );
        refused(
            w8a16(),
            &|v| w(v, "dynamic", true.into()),
            "weights.dynamic",
            "true",
        );
        refused(
            w8a16(),
            &|v| w(v, "hessian", 1.into()),
            "weights.hessian",
            "not a field",
        );
        refused(
            w8a16(),
            &|v| v["kv_cache_scheme"] = json!({"num_bits": 8}),
            "kv_cache_scheme",
            "KV cache",
        );
        refused(
            w8a16(),
            &|v| v["sparsity_config"] = json!({"format": "sparse-24-bitmask"}),
            "sparsity_config",
            "sparse",
        );
        refused(
            w8a16(),
            &|v| v["transform_config"] = json!({"config_groups": {}}),
            "transform_config",
            "rotations",
        );
        refused(
            w8a16(),
            &|v| v["quantization_status"] = "frozen".into(),
            "quantization_status",
            "\"frozen\"",
        );
        refused(
            w8a16(),
            &|v| v["unknown"] = 1.into(),
            "quantization_config.unknown",
            "not a field",
        );
        refused(
            w8a16(),
            &|v| v["config_groups"]["group_0"]["output_activations"] = json!({"num_bits": 8}),
            "output_activations",
            "outputs",
        );
        refused(
            w8a16(),
            &|v| {
                v["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized".into();
            },
            "config_groups.group_0.format",
            "\"nvfp4-pack-quantized\"",
        );
        refused(
            fp8_block(),
            &|v| w(v, "block_structure", json!([128, 0])),
            "weights.block_structure",
            "[128,0]",
        );
        let a = |v: &mut Value, k: &str, x: Value| {
            v["config_groups"]["group_0"]["input_activations"][k] = x
        };
        refused(
            fp8_block(),
            &|v| a(v, "dynamic", false.into()),
            "input_activations.dynamic",
            "static",
        );
        refused(
            fp8_block(),
            &|v| a(v, "strategy", "tensor".into()),
            "input_activations.strategy",
            "\"tensor\"",
        );
        refused(
            fp8_block(),
            &|v| a(v, "symmetric", false.into()),
            "input_activations.symmetric",
            "asymmetric",
        );
        refused(
            fp8_block(),
            &|v| a(v, "num_bits", 4.into()),
            "input_activations.num_bits",
            "\"float\" inputs of 4 bits",
        );
        // Fields that do not change the math may take any value.
        let mut v = w8a16();
        w(&mut v, "observer", "mse".into());
        w(&mut v, "observer_kwargs", json!({"maxshrink": 0.2}));
        w(&mut v, "actorder", "weight".into());
        v["version"] = "0.20.1".into();
        v["global_compression_ratio"] = 1.5.into();
        assert!(parse(file, &config(v)).unwrap().is_some());
    }
}
