//! The tensors of a PEFT adapter: the names PEFT gives them, and the one
//! check of a weight file's header against its `adapter_config.json` that
//! the admin plane runs at registration and the worker before it loads a
//! byte.

use crate::safetensors_header::Header;

use super::{AdapterConfig, AdapterError, ExpertTarget, Target};

/// What one adapter tensor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holds {
    /// A module targeted by `target_modules`: one projection, or a fused
    /// group of them.
    Module(Target),
    /// A Mixture-of-Experts parameter targeted by `target_parameters`.
    Expert(ExpertTarget),
    /// The token embeddings (`embed_tokens` in `target_modules`).
    Embedding,
    /// The output projection (`lm_head` in `target_modules`).
    LmHead,
}

/// Which factor of a LoRA pair a tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Factor {
    /// `lora_A`: `[rank, in]`.
    A,
    /// `lora_B`: `[out, rank]`.
    B,
    /// DoRA's `lora_magnitude_vector`: `[out]`, one per output row.
    Magnitude,
    /// `lora_B.bias` (`lora_bias`): `[out]`.
    Bias,
    /// The embedding layer itself, `[vocab, hidden]`, which PEFT saves
    /// beside an embedding or lm_head LoRA (`save_embedding_layers`) and
    /// loads over the model's: it must be the base's own.
    BaseCopy,
    /// A layer saved whole (`modules_to_save`), `[vocab, hidden]`: the
    /// adapter's own, used in place of the model's.
    Whole,
    /// A layer's trained rows (`trainable_token_indices`), `[n, hidden]`.
    TokenRows,
    /// What PEFT also writes of a layer saved whole when the vocabulary was
    /// resized (`save_embedding_layers` turns itself on): the wrapper's
    /// `original_module.weight` (the resized base layer, which the adapter
    /// does not use) and `modules_to_save.weight` (the saved layer again).
    /// PEFT's loader uses neither for the adapter; neither is read.
    WrapperCopy,
}

/// One tensor an adapter stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    pub name: String,
    pub layer: usize,
    pub holds: Holds,
    pub factor: Factor,
}

/// The name PEFT gives one layer's module factor.
pub fn module_tensor(layer: usize, t: Target, factor: Factor) -> String {
    let what = match factor {
        Factor::A => "lora_A.weight",
        Factor::B => "lora_B.weight",
        Factor::Magnitude => "lora_magnitude_vector",
        Factor::Bias => "lora_B.bias",
        Factor::BaseCopy => "base_layer.weight",
        Factor::Whole | Factor::TokenRows | Factor::WrapperCopy => {
            unreachable!("only the embedding layers are saved")
        }
    };
    format!("base_model.model.model.layers.{layer}.{}.{what}", t.path)
}

/// Where PEFT stores an expert parameter's factors in one layer: the fused
/// gate_up sits under `base_layer` when down is targeted too.
pub fn expert_prefix(layer: usize, target: ExpertTarget, targets: &[ExpertTarget]) -> String {
    let experts = format!("base_model.model.model.layers.{layer}.mlp.experts");
    let both = targets.contains(&ExpertTarget::GateUp) && targets.contains(&ExpertTarget::Down);
    match target {
        ExpertTarget::GateUp if both => format!("{experts}.base_layer"),
        ExpertTarget::GateUp | ExpertTarget::Down => experts,
        ExpertTarget::Router => format!("base_model.model.model.layers.{layer}.mlp.gate"),
    }
}

/// Every tensor `config` stores in `layer` (none when the layer is not
/// transformed).
pub fn expected_in_layer(config: &AdapterConfig, layer: usize) -> Vec<Expected> {
    let mut out = Vec::new();
    let factors: &[Factor] = match (config.use_dora, config.lora_bias) {
        (true, _) => &[Factor::A, Factor::B, Factor::Magnitude],
        (false, true) => &[Factor::A, Factor::B, Factor::Bias],
        (false, false) => &[Factor::A, Factor::B],
    };
    for t in config.targets_in_layer(layer) {
        for &factor in factors {
            out.push(Expected {
                name: module_tensor(layer, t, factor),
                layer,
                holds: Holds::Module(t),
                factor,
            });
        }
    }
    if !config.transforms_layer(layer) {
        return out;
    }
    for &t in &config.expert_targets {
        let prefix = expert_prefix(layer, t, &config.expert_targets);
        for (factor, letter) in [(Factor::A, 'A'), (Factor::B, 'B')] {
            out.push(Expected {
                name: format!("{prefix}.lora_{letter}.weight"),
                layer,
                holds: Holds::Expert(t),
                factor,
            });
        }
    }
    out
}

/// The tensors `config` stores outside the layers: an embedding LoRA's
/// `lora_embedding_A` `[r, vocab]` and `lora_embedding_B` `[hidden, r]`,
/// an lm_head LoRA's `lora_A` `[r, hidden]` and `lora_B` `[vocab, r]`, and
/// each one's copy of the layer (optional).
pub fn expected_outside_layers(config: &AdapterConfig) -> Vec<Expected> {
    let mut out = Vec::new();
    let mut push = |name: String, holds: Holds, factor: Factor| {
        out.push(Expected {
            name,
            layer: 0,
            holds,
            factor,
        })
    };
    if config.embed_tokens {
        let e = "base_model.model.model.embed_tokens";
        push(format!("{e}.lora_embedding_A"), Holds::Embedding, Factor::A);
        push(format!("{e}.lora_embedding_B"), Holds::Embedding, Factor::B);
        push(
            format!("{e}.base_layer.weight"),
            Holds::Embedding,
            Factor::BaseCopy,
        );
    }
    if config.lm_head {
        let h = "base_model.model.lm_head";
        push(format!("{h}.lora_A.weight"), Holds::LmHead, Factor::A);
        push(format!("{h}.lora_B.weight"), Holds::LmHead, Factor::B);
        push(
            format!("{h}.base_layer.weight"),
            Holds::LmHead,
            Factor::BaseCopy,
        );
    }
    use super::saved::{Layer, rows_tensor, whole_tensor};
    for layer in [Layer::Embedding, Layer::LmHead] {
        let holds = match layer {
            Layer::Embedding => Holds::Embedding,
            Layer::LmHead => Holds::LmHead,
        };
        if config.saved.keeps_whole(layer) {
            let whole = whole_tensor(layer);
            let module = whole.strip_suffix(".weight").unwrap_or(whole);
            for copy in ["original_module", "modules_to_save"] {
                push(
                    format!("{module}.{copy}.weight"),
                    holds,
                    Factor::WrapperCopy,
                );
            }
            push(whole.into(), holds, Factor::Whole);
        }
        if config.saved.rows_of(layer).is_some() {
            push(rows_tensor(layer).into(), holds, Factor::TokenRows);
        }
    }
    out
}

pub use crate::weights::language_model_name;

/// The layer a PEFT tensor name belongs to, if it names one.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("base_model.model.model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}

/// Why a tensor that no target explains is refused.
fn unexpected(name: &str) -> &'static str {
    use super::saved::{Layer, rows_tensor, whole_tensor};
    if [Layer::Embedding, Layer::LmHead]
        .iter()
        .any(|&l| name == whole_tensor(l))
    {
        "is a layer saved whole, but modules_to_save does not list it"
    } else if [Layer::Embedding, Layer::LmHead]
        .iter()
        .any(|&l| name == rows_tensor(l))
    {
        "is a layer's trained token rows, but trainable_token_indices does not name the layer"
    } else if name.contains("lora_embedding") || name.contains("embed_tokens") {
        "is an embedding LoRA's, but target_modules does not list embed_tokens"
    } else if name.contains("lm_head") {
        "is an lm_head LoRA's, but target_modules does not list lm_head"
    } else if name.ends_with("lora_B.bias") {
        "is a bias on lora_B, but adapter_config.json does not set lora_bias"
    } else if name.contains("lora_magnitude_vector") {
        "is a DoRA magnitude vector, but adapter_config.json does not set use_dora"
    } else {
        "is not a lora_A/lora_B weight of a targeted projection or expert parameter in a transformed layer"
    }
}

/// The module path a tensor's rank is looked up by in `rank_pattern`.
pub fn rank_path(e: &Expected) -> String {
    match e.holds {
        Holds::Module(t) => format!("model.layers.{}.{}", e.layer, t.path),
        Holds::Expert(t) => t.path(e.layer),
        Holds::Embedding => "model.embed_tokens".into(),
        Holds::LmHead => "lm_head".into(),
    }
}

/// Checks a weight file's header against its config: every tensor is a
/// `lora_A` or `lora_B` of a targeted projection or expert parameter in a
/// transformed layer, two-dimensional, with the rank the config gives it
/// (a multiple of it for fused experts, one rank per expert). With the
/// base model's layer count (the worker), every tensor the config implies
/// must be there too and no layer lies past the model; without it (the
/// registry) the layers present are checked.
pub fn check(
    adapter: &str,
    config: &AdapterConfig,
    header: &Header,
    layers: Option<usize>,
) -> Result<(), AdapterError> {
    let bad = |tensor: &str, reason: String| AdapterError::InvalidTensor {
        adapter: adapter.into(),
        tensor: tensor.into(),
        reason,
    };
    if header.tensors.is_empty() {
        return Err(bad("adapter_model.safetensors", "holds no tensors".into()));
    }
    for (stored, info) in &header.tensors {
        let Some(name) = language_model_name(stored) else {
            continue;
        };
        let name = name.as_ref();
        let expected = layer_of(name)
            .filter(|&l| layers.is_none_or(|n| l < n))
            .and_then(|l| {
                expected_in_layer(config, l)
                    .into_iter()
                    .find(|e| e.name == name)
            })
            .or_else(|| {
                expected_outside_layers(config)
                    .into_iter()
                    .find(|e| e.name == name)
            })
            .ok_or_else(|| bad(name, unexpected(name).into()))?;
        if expected.factor == Factor::WrapperCopy {
            if info.shape.len() != 2 {
                return Err(bad(
                    name,
                    format!("has shape {:?}, not [vocab, hidden]", info.shape),
                ));
            }
            continue;
        }
        if expected.factor == Factor::BaseCopy {
            // Its values are compared with the base's where the base is
            // at hand (the backend, when it writes the adapter's slot).
            if info.shape.len() != 2 {
                return Err(bad(
                    name,
                    format!("has shape {:?}, not [vocab, hidden]", info.shape),
                ));
            }
            continue;
        }
        if let (Factor::Whole | Factor::TokenRows, Holds::Embedding | Holds::LmHead) =
            (expected.factor, expected.holds)
        {
            check_saved(config, &expected, &info.shape, &|r| bad(name, r))?;
            continue;
        }
        if matches!(expected.factor, Factor::Magnitude | Factor::Bias) {
            // One value per output row: as many as lora_B has rows.
            let Holds::Module(t) = expected.holds else {
                unreachable!("magnitudes and biases are expected for modules only")
            };
            let b = module_tensor(expected.layer, t, Factor::B);
            let rows = header
                .tensors
                .get(&b)
                .and_then(|b| b.shape.first().copied());
            match (&info.shape[..], rows) {
                ([n], Some(rows)) if *n == rows => {}
                ([n], Some(rows)) => {
                    return Err(bad(
                        name,
                        format!(
                            "has {n} values, but the module has {rows} outputs (the rows of lora_B)"
                        ),
                    ));
                }
                ([_], None) => {}
                (shape, _) => {
                    return Err(bad(
                        name,
                        format!("has shape {shape:?}, not one value per output row"),
                    ));
                }
            }
            continue;
        }
        let [rows, cols] = info.shape[..] else {
            return Err(bad(
                name,
                format!("has shape {:?}, not two-dimensional", info.shape),
            ));
        };
        let rank_dim = match expected.factor {
            Factor::A => rows,
            Factor::B
            | Factor::Magnitude
            | Factor::Bias
            | Factor::BaseCopy
            | Factor::Whole
            | Factor::TokenRows
            | Factor::WrapperCopy => cols,
        };
        let path = rank_path(&expected);
        let (rank, _) = config.rank_and_alpha(adapter, &path)?;
        let fits = match expected.holds {
            Holds::Module(_) | Holds::Embedding | Holds::LmHead => rank_dim == rank as u64,
            Holds::Expert(_) => rank_dim != 0 && rank_dim % rank as u64 == 0,
        };
        if !fits {
            return Err(bad(
                name,
                format!(
                    "has rank dimension {rank_dim}, but adapter_config.json gives {path} rank {rank}"
                ),
            ));
        }
    }
    if let Some(layers) = layers {
        let present: std::collections::BTreeSet<String> = header
            .tensors
            .keys()
            .filter_map(|n| language_model_name(n).map(|n| n.into_owned()))
            .collect();
        for layer in 0..layers {
            if let Some(missing) = expected_in_layer(config, layer)
                .into_iter()
                .find(|e| !present.contains(&e.name))
            {
                return Err(bad(&missing.name, missing_reason(missing.factor)));
            }
        }
        if let Some(missing) = expected_outside_layers(config).into_iter().find(|e| {
            !matches!(e.factor, Factor::BaseCopy | Factor::WrapperCopy)
                && !present.contains(&e.name)
        }) {
            return Err(bad(&missing.name, missing_reason(missing.factor)));
        }
    } else if config.use_dora || config.lora_bias {
        // Without the layer count, each module present must have its
        // magnitude (DoRA) or its lora_B's bias beside its factors.
        for stored in header.tensors.keys() {
            let Some(name) = language_model_name(stored) else {
                continue;
            };
            let Some(e) = layer_of(&name).and_then(|l| {
                expected_in_layer(config, l)
                    .into_iter()
                    .find(|e| e.name == name.as_ref() && e.factor == Factor::B)
            }) else {
                continue;
            };
            let Holds::Module(t) = e.holds else { continue };
            let beside = if config.use_dora {
                Factor::Magnitude
            } else {
                Factor::Bias
            };
            let m = module_tensor(e.layer, t, beside);
            let present = header
                .tensors
                .keys()
                .any(|k| language_model_name(k).is_some_and(|k| k.as_ref() == m));
            if !present {
                return Err(bad(&m, missing_reason(beside)));
            }
        }
    }
    Ok(())
}

fn missing_reason(factor: Factor) -> String {
    match factor {
        Factor::Magnitude => {
            "the tensor is missing (a DoRA adapter, `use_dora: true`, stores a magnitude vector per module)".into()
        }
        Factor::Bias => {
            "the tensor is missing (`lora_bias: true` gives each module's lora_B a bias)".into()
        }
        Factor::Whole => "the tensor is missing (modules_to_save lists its layer)".into(),
        Factor::TokenRows => {
            "the tensor is missing (trainable_token_indices names its layer)".into()
        }
        Factor::A | Factor::B | Factor::BaseCopy | Factor::WrapperCopy => {
            "the tensor is missing".into()
        }
    }
}

/// A saved layer is `[rows, hidden]`; trained rows are one per listed
/// token. Whether the rows are the base's vocabulary is the worker's
/// check, with the model at hand.
fn check_saved(
    config: &AdapterConfig,
    e: &Expected,
    shape: &[u64],
    bad: &dyn Fn(String) -> AdapterError,
) -> Result<(), AdapterError> {
    use super::saved::Layer;
    let [rows, cols] = shape[..] else {
        return Err(bad(format!("has shape {shape:?}, not two-dimensional")));
    };
    if cols == 0 || rows == 0 {
        return Err(bad(format!("has shape {shape:?}")));
    }
    if e.factor == Factor::TokenRows {
        let layer = match e.holds {
            Holds::LmHead => Layer::LmHead,
            _ => Layer::Embedding,
        };
        let listed = config.saved.rows_of(layer).map_or(0, <[u32]>::len) as u64;
        if rows != listed {
            return Err(bad(format!(
                "has {rows} rows, but trainable_token_indices lists {listed} tokens for {}",
                layer.module_name()
            )));
        }
    }
    Ok(())
}

/// The vocabulary an adapter's saved layers have (their rows), if it
/// saves one whole; both must agree.
pub fn saved_vocab(adapter: &str, header: &Header) -> Result<Option<u64>, AdapterError> {
    use super::saved::{Layer, whole_tensor};
    let mut vocab: Option<(u64, &str)> = None;
    for layer in [Layer::Embedding, Layer::LmHead] {
        let name = whole_tensor(layer);
        let Some(info) = header
            .tensors
            .iter()
            .find(|(k, _)| language_model_name(k).is_some_and(|k| k.as_ref() == name))
            .map(|(_, i)| i)
        else {
            continue;
        };
        let rows = info.shape.first().copied().unwrap_or(0);
        match vocab {
            Some((v, other)) if v != rows => {
                return Err(AdapterError::InvalidTensor {
                    adapter: adapter.into(),
                    tensor: name.into(),
                    reason: format!(
                        "has {rows} rows, but {other} has {v}: the saved layers disagree on the vocabulary"
                    ),
                });
            }
            _ => vocab = Some((rows, name)),
        }
    }
    Ok(vocab.map(|(v, _)| v))
}

#[cfg(test)]
mod tests {
    use crate::safetensors_header::TensorInfo;

    use super::*;

    fn config(text: &str) -> AdapterConfig {
        AdapterConfig::from_text("a", text, None).unwrap()
    }

    fn header(tensors: &[(&str, &[u64])]) -> Header {
        Header {
            tensors: tensors
                .iter()
                .map(|(n, s)| {
                    (
                        (*n).to_owned(),
                        TensorInfo {
                            dtype: "F32".into(),
                            shape: s.to_vec(),
                        },
                    )
                })
                .collect(),
        }
    }

    const Q_A: &str = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight";
    const Q_B: &str = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";

    fn reason(e: AdapterError) -> (String, String) {
        match e {
            AdapterError::InvalidTensor { tensor, reason, .. } => (tensor, reason),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_header_that_fits_its_config_passes_and_every_misfit_is_refused_by_tensor() {
        let c = config(r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["q_proj"]}"#);
        assert!(
            check(
                "a",
                &c,
                &header(&[(Q_A, &[4, 16]), (Q_B, &[16, 4])]),
                Some(1)
            )
            .is_ok()
        );
        // Without the layer count, the layers present are checked.
        assert!(check("a", &c, &header(&[(Q_A, &[4, 16]), (Q_B, &[16, 4])]), None).is_ok());

        let (t, r) =
            reason(check("a", &c, &header(&[(Q_A, &[8, 16]), (Q_B, &[16, 4])]), None).unwrap_err());
        assert_eq!(t, Q_A);
        assert!(
            r.contains("rank dimension 8") && r.contains("rank 4"),
            "{r}"
        );

        let (t, r) = reason(check("a", &c, &header(&[(Q_A, &[4, 16, 1])]), None).unwrap_err());
        assert_eq!(t, Q_A);
        assert!(r.contains("not two-dimensional"), "{r}");

        let k = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight";
        let (t, r) = reason(check("a", &c, &header(&[(k, &[4, 16])]), None).unwrap_err());
        assert_eq!(t, k);
        assert!(r.contains("not a lora_A/lora_B weight"), "{r}");

        let head = "base_model.model.lm_head.lora_A.weight";
        let (_, r) = reason(check("a", &c, &header(&[(head, &[4, 16])]), None).unwrap_err());
        assert_eq!(
            r,
            "is an lm_head LoRA's, but target_modules does not list lm_head"
        );

        // A layer past the model, and a tensor the config implies but the
        // file lacks, are refused when the model is known.
        let far = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight";
        let (t, _) = reason(check("a", &c, &header(&[(far, &[4, 16])]), Some(2)).unwrap_err());
        assert_eq!(t, far);
        let (t, r) = reason(check("a", &c, &header(&[(Q_A, &[4, 16])]), Some(1)).unwrap_err());
        assert_eq!((t.as_str(), r.as_str()), (Q_B, "the tensor is missing"));

        let (_, r) = reason(check("a", &c, &header(&[]), None).unwrap_err());
        assert_eq!(r, "holds no tensors");
    }

    #[test]
    fn a_dora_magnitude_holds_one_value_per_output_and_needs_use_dora() {
        let m = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector";
        let plain =
            config(r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"target_modules":["q_proj"]}"#);
        let dora = config(
            r#"{"peft_type":"LORA","r":4,"lora_alpha":8,"use_dora":true,"target_modules":["q_proj"]}"#,
        );
        let with = |n: u64| header(&[(Q_A, &[4, 16]), (Q_B, &[16, 4]), (m, &[n])]);
        assert!(check("a", &dora, &with(16), Some(1)).is_ok());
        assert!(check("a", &dora, &with(16), None).is_ok());
        let (t, r) = reason(check("a", &dora, &with(15), None).unwrap_err());
        assert_eq!(t, m);
        assert!(r.contains("15 values") && r.contains("16 outputs"), "{r}");
        let (t, r) = reason(check("a", &plain, &with(16), None).unwrap_err());
        assert_eq!(t, m);
        assert!(r.contains("does not set use_dora"), "{r}");
        // The magnitude is required with use_dora.
        let (t, r) = reason(
            check(
                "a",
                &dora,
                &header(&[(Q_A, &[4, 16]), (Q_B, &[16, 4])]),
                Some(1),
            )
            .unwrap_err(),
        );
        assert_eq!(t.as_str(), m);
        assert!(
            r.contains("the tensor is missing") && r.contains("use_dora"),
            "{r}"
        );
        // At registration (no layer count) too.
        let (t, _) = reason(
            check(
                "a",
                &dora,
                &header(&[(Q_A, &[4, 16]), (Q_B, &[16, 4])]),
                None,
            )
            .unwrap_err(),
        );
        assert_eq!(t.as_str(), m);
        let square = header(&[(Q_A, &[4, 16]), (Q_B, &[16, 4]), (m, &[16, 1])]);
        let (_, r) = reason(check("a", &dora, &square, None).unwrap_err());
        assert!(r.contains("not one value per output row"), "{r}");
    }

    #[test]
    fn fused_expert_factors_hold_a_multiple_of_the_rank() {
        let c = config(
            r#"{"peft_type":"LORA","r":2,"lora_alpha":4,"target_modules":[],
                "target_parameters":["mlp.experts.down_proj"]}"#,
        );
        let a = "base_model.model.model.layers.0.mlp.experts.lora_A.weight";
        let b = "base_model.model.model.layers.0.mlp.experts.lora_B.weight";
        assert!(check("a", &c, &header(&[(a, &[8, 16]), (b, &[16, 8])]), Some(1)).is_ok());
        let (t, _) =
            reason(check("a", &c, &header(&[(a, &[7, 16]), (b, &[16, 8])]), None).unwrap_err());
        assert_eq!(t, a);
    }
}
