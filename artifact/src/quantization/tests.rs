use super::*;

#[test]
fn fp8_e4m3_decodes_every_class_of_value() {
    assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
    // 1.0 is exponent 7, mantissa 0.
    assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
    assert_eq!(fp8_e4m3_to_f32(0xb8), -1.0);
    // The largest finite value, 448 = 1.75 × 2^8.
    assert_eq!(fp8_e4m3_to_f32(0x7e), 448.0);
    // The smallest subnormal, 2^-9.
    assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
    assert!(fp8_e4m3_to_f32(0x7f).is_nan());
}

#[test]
fn a_weight_is_its_code_minus_the_zero_point_times_the_scale_of_its_group() {
    // One row of 10 inputs, values -8..=1, groups of 4 (the last
    // partial): scales 1, 2, 3.
    let m = QuantizedMatrix {
        out: 1,
        fan_in: 10,
        codes: Codes::Int4((-8..2).collect()),
        scales: vec![1.0, 2.0, 3.0],
        zeros: None,
        group: (0..10).map(|k| k / 4).collect(),
    };
    let w = m.to_f32();
    assert_eq!(w[0], -8.0);
    assert_eq!(w[4], -4.0 * 2.0);
    assert_eq!(w[9], 1.0 * 3.0);
    assert_eq!(m.stored_bytes(), 5 + 3 * 4);
    // With zero points: minus the zero point first; groups follow
    // `group`, in any order.
    let m = QuantizedMatrix {
        out: 2,
        fan_in: 2,
        codes: Codes::Uint4(vec![5, 7, 9, 0]),
        scales: vec![0.5, 1.0, 2.0, 4.0],
        zeros: Some(vec![3.0, 8.0, 1.0, 0.0]),
        group: vec![1, 0],
    };
    assert_eq!(
        m.to_f32(),
        vec![
            (5.0 - 1.0) * 2.0,
            (7.0 - 3.0) * 0.5,
            9.0 * 4.0,
            (0.0 - 8.0) * 1.0
        ]
    );
}

#[test]
fn gptq_unpacks_along_the_input_and_offsets_its_zero_points() {
    // 10 inputs, 2 outputs: qweight is [2 words, 2 outputs].
    let q: Vec<u32> = (0..20).map(|i| (i * 7 % 16) as u32).collect(); // [in, out]
    let mut words = [0u32; 2 * 2];
    for k in 0..10 {
        for o in 0..2 {
            words[(k / 8) * 2 + o] |= q[k * 2 + o] << (4 * (k % 8));
        }
    }
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    assert_eq!(unpack_int4_rows(&bytes, (10, 2)), q);
    let file = Path::new("config.json");
    let gptq = |q: Value| {
        let mut m = Map::new();
        m.insert("quantization_config".into(), q);
        parse(file, &m)
    };
    let good = serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 128,
        "desc_act": true, "sym": false, "checkpoint_format": "gptq"});
    let q = gptq(good.clone()).unwrap().unwrap();
    assert_eq!(
        (q.format, q.strategy, q.symmetric),
        (Format::Gptq4, Strategy::Group(128), false)
    );
    let mut channel = good.clone();
    channel["group_size"] = (-1).into();
    assert_eq!(gptq(channel).unwrap().unwrap().strategy, Strategy::Channel);
    for (field, value, needle) in [
        ("bits", Value::from(8), "quantization_config.bits"),
        (
            "group_size",
            Value::from(0),
            "quantization_config.group_size",
        ),
        (
            "checkpoint_format",
            Value::from("marlin"),
            "quantization_config.checkpoint_format",
        ),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        let e = gptq(bad).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
}

#[test]
fn awq_unpacks_in_its_column_order_and_refuses_other_layouts_by_field() {
    // One row of 8 columns 0..8 packed in AWQ's order: nibble i holds
    // column AWQ_ORDER[i].
    let word: u32 = AWQ_ORDER
        .iter()
        .enumerate()
        .map(|(i, &c)| (c as u32) << (4 * i))
        .sum();
    assert_eq!(
        unpack_awq(&word.to_le_bytes(), (1, 8)),
        (0..8).collect::<Vec<u32>>()
    );
    let file = Path::new("config.json");
    let awq = |q: Value| {
        let mut m = Map::new();
        m.insert("quantization_config".into(), q);
        parse(file, &m)
    };
    let good = serde_json::json!({"quant_method": "awq", "bits": 4, "group_size": 128,
        "zero_point": true, "version": "gemm"});
    let q = awq(good.clone()).unwrap().unwrap();
    assert_eq!((q.format, q.strategy), (Format::Awq4, Strategy::Group(128)));
    for (field, value, needle) in [
        ("bits", Value::from(3), "quantization_config.bits"),
        (
            "group_size",
            Value::from(-1),
            "quantization_config.group_size",
        ),
        (
            "version",
            Value::from("gemv"),
            "quantization_config.version",
        ),
        (
            "zero_point",
            Value::from(false),
            "quantization_config.zero_point",
        ),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        let e = awq(bad).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
}

#[test]
fn anything_but_the_supported_layouts_is_refused_by_field() {
    let file = Path::new("config.json");
    let config = |q: Value| -> Map<String, Value> {
        let mut m = Map::new();
        m.insert("quantization_config".into(), q);
        m
    };
    let good = serde_json::json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32}}},
        "ignore": ["lm_head"]
    });
    let q = parse(file, &config(good.clone())).unwrap().unwrap();
    assert_eq!(q.format, Format::PackedInt4);
    assert_eq!(q.strategy, Strategy::Group(32));
    assert_eq!(q.ignore, vec!["lm_head".to_owned()]);
    assert_eq!(parse(file, &Map::new()).unwrap(), None);
    let refused = |edit: &dyn Fn(&mut Value), field: &str| {
        let mut v = good.clone();
        edit(&mut v);
        let e = parse(file, &config(v)).unwrap_err().to_string();
        assert!(e.contains(field), "{field}: {e}");
    };
    let weights = |v: &mut Value, k: &str, x: Value| {
        v["config_groups"]["group_0"]["weights"][k] = x;
    };
    refused(
        &|v| v["quant_method"] = "bitsandbytes".into(),
        "quantization_config.quant_method",
    );
    refused(
        &|v| v["format"] = "marlin-24".into(),
        "quantization_config.format",
    );
    refused(
        &|v| v["quantization_status"] = "frozen".into(),
        "quantization_config.quantization_status",
    );
    refused(
        &|v| weights(v, "num_bits", 3.into()),
        "config_groups.group_0.weights",
    );
    // Asymmetric 4-bit is read (zero points packed along the output);
    // asymmetric FP8 is not a format.
    let mut asymmetric = good.clone();
    weights(&mut asymmetric, "symmetric", false.into());
    assert!(!parse(file, &config(asymmetric)).unwrap().unwrap().symmetric);
    refused(
        &|v| {
            v["format"] = "float-quantized".into();
            weights(v, "type", "float".into());
            weights(v, "num_bits", 8.into());
            weights(v, "symmetric", false.into());
        },
        "weights.symmetric",
    );
    refused(
        &|v| weights(v, "strategy", "block".into()),
        "weights.block_structure",
    );
    refused(
        &|v| weights(v, "group_size", 0.into()),
        "weights.group_size",
    );
    refused(&|v| weights(v, "dynamic", true.into()), "weights.dynamic");
    refused(
        &|v| v["config_groups"]["group_1"] = v["config_groups"]["group_0"].clone(),
        "quantization_config.config_groups",
    );
    refused(
        &|v| v["config_groups"]["group_0"]["targets"] = serde_json::json!(["Embedding"]),
        "targets",
    );
    refused(&|v| v["ignore"] = 3.into(), "quantization_config.ignore");
    refused(
        &|v| v["config_groups"]["group_0"]["input_activations"] = "dynamic".into(),
        "config_groups.group_0.input_activations",
    );
    // Recorded when given, null or absent meaning weight-only.
    let mut w8a8 = good.clone();
    w8a8["config_groups"]["group_0"]["input_activations"] =
        serde_json::json!({"num_bits": 8, "type": "float", "dynamic": true, "strategy": "token"});
    assert!(parse(file, &config(w8a8)).unwrap().unwrap().activations());
    let mut null = good.clone();
    null["config_groups"]["group_0"]["input_activations"] = Value::Null;
    assert!(!parse(file, &config(null)).unwrap().unwrap().activations());
    assert!(
        !parse(file, &config(good.clone()))
            .unwrap()
            .unwrap()
            .activations()
    );
}

#[test]
fn transformers_fp8_is_read_as_the_official_releases_write_it() {
    let file = Path::new("config.json");
    let fp8 = |q: Value| {
        let mut m = Map::new();
        m.insert("quantization_config".into(), q);
        parse(file, &m)
    };
    let good = serde_json::json!({"quant_method": "fp8", "activation_scheme": "dynamic",
        "fmt": "e4m3", "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]});
    let q = fp8(good.clone()).unwrap().unwrap();
    assert_eq!(
        (q.format, q.strategy, q.input),
        (
            Format::TransformersFp8,
            Strategy::Block {
                rows: 128,
                cols: 128
            },
            None
        )
    );
    assert_eq!(q.ignore, vec!["lm_head".to_owned()]);
    assert_eq!(q.label(), "fp8-e4m3, blocks of 128x128");
    let mut whole = good.clone();
    whole["weight_block_size"] = Value::Null;
    assert_eq!(fp8(whole).unwrap().unwrap().strategy, Strategy::Tensor);
    let mut absent = good.clone();
    absent.as_object_mut().unwrap().remove("weight_block_size");
    assert_eq!(
        fp8(absent).unwrap().unwrap().strategy,
        Strategy::Block {
            rows: 128,
            cols: 128
        }
    );
    for (field, value, said) in [
        ("activation_scheme", Value::from("static"), "\"static\""),
        ("fmt", Value::from("e5m2"), "\"e5m2\""),
        ("weight_block_size", serde_json::json!([128]), "[128]"),
        ("scale_fmt", Value::from("e4m3"), "\"e4m3\""),
        (
            "modules_to_not_convert",
            Value::from("lm_head"),
            "list of module names",
        ),
        ("weight_scale_format", Value::from(1), "not a field"),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        let e = fp8(bad).unwrap_err().to_string();
        assert!(
            e.contains(&format!("quantization_config.{field}")),
            "{field}: {e}"
        );
        assert!(e.contains(said), "{said}: {e}");
    }
}

#[test]
fn mxfp4_is_read_as_gpt_oss_was_released() {
    let file = Path::new("config.json");
    let mx = |q: Value| {
        let mut m = Map::new();
        m.insert("quantization_config".into(), q);
        parse(file, &m)
    };
    let good = serde_json::json!({"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]});
    let q = mx(good.clone()).unwrap().unwrap();
    assert_eq!((q.format, q.strategy), (Format::Mxfp4, Strategy::Group(32)));
    assert_eq!(q.ignore.len(), 4);
    assert_eq!(q.label(), "mxfp4, groups of 32");
    assert!(
        q.canonical()
            .starts_with("format=mxfp4-e2m1-e8m0;strategy=group-32")
    );
    let mut loaded = good.clone();
    loaded["dequantize"] = true.into();
    assert!(mx(loaded).unwrap().is_some());
    for (field, value, said) in [
        (
            "modules_to_not_convert",
            Value::from("lm_head"),
            "list of module names",
        ),
        ("dequantize", Value::from("yes"), "true or false"),
        ("block_size", Value::from(16), "not a field"),
    ] {
        let mut bad = good.clone();
        bad[field] = value;
        let e = mx(bad).unwrap_err().to_string();
        assert!(
            e.contains(&format!("quantization_config.{field}")),
            "{field}: {e}"
        );
        assert!(e.contains(said), "{said}: {e}");
    }
    // Every E2M1 code's value: sign, two exponent bits, one mantissa bit.
    for c in 0u8..16 {
        let (sign, e, m) = (c >> 3, (c >> 1) & 3, c & 1);
        let magnitude = match e {
            0 => f32::from(m) * 0.5,
            _ => (1.0 + f32::from(m) * 0.5) * 2f32.powi(i32::from(e) - 1),
        };
        let want = if sign == 1 { -magnitude } else { magnitude };
        assert_eq!(Codes::Fp4E2m1(vec![c]).value(0), want, "code {c}");
    }
}
