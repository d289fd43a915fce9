//! `adapter_config.json`: what PEFT wrote, checked field by field.

use std::path::Path;

use serde_json::{Map, Value};

use super::selection::Selection;
use super::{AdapterError, Projection};
use crate::model_config::{Architecture, ModelConfig};

/// Keys PEFT writes that do not change inference math, whatever their value.
const HARMLESS_KEYS: &[&str] = &[
    "auto_mapping",
    "base_model_name_or_path",
    "corda_config",
    "eva_config",
    "inference_mode",
    "loftq_config",
    "lora_dropout",
    "megatron_config",
    "megatron_core",
    "peft_version",
    "qalora_group_size",
    "revision",
    "runtime_config",
    "task_type",
];

/// A validated `adapter_config.json`.
#[derive(Debug, Clone)]
pub struct AdapterConfig {
    pub r: usize,
    pub lora_alpha: f32,
    pub use_rslora: bool,
    /// DoRA (`use_dora`): each targeted module also stores a magnitude
    /// vector, and its output is `m / ‖W + s·B·A‖` (per output row) times
    /// the LoRA-adapted output, bias apart.
    pub use_dora: bool,
    /// `lora_bias`: each targeted module's lora_B has a bias too, added
    /// with the delta (`s · (B·A·x + b_B)`).
    pub lora_bias: bool,
    /// (compiled pattern, key as written, rank).
    pub rank_pattern: Patterns<usize>,
    /// (compiled pattern, key as written, alpha).
    pub alpha_pattern: Patterns<f32>,
    /// The projections targeted, in `Projection` order.
    pub targets: Vec<Projection>,
    /// `target_modules` names fused modules (`qkv_proj`, `gate_up_proj`,
    /// as Phi-3 has): each stores one LoRA pair for the projections it
    /// fuses (see [`AdapterConfig::stored_targets`]).
    pub fused: bool,
    /// None: every layer.
    pub layers_to_transform: Option<Vec<usize>>,
    /// Parameters of a Mixture-of-Experts block targeted directly
    /// (`target_parameters`), sorted: PEFT's form for LoRA on the fused
    /// expert tensors and on the router.
    pub expert_targets: Vec<ExpertTarget>,
    /// A regular expression `target_modules` and `exclude_modules`, as
    /// PEFT matches them ([`AdapterConfig::targets_in_layer`]).
    pub selection: Selection,
    /// `target_modules` lists `embed_tokens`: LoRA on the token embeddings
    /// (PEFT's `lora_embedding_A` `[r, vocab]` and `lora_embedding_B`
    /// `[hidden, r]`), a token's row plus `s · B · A[:, token]`.
    pub embed_tokens: bool,
    /// `target_modules` lists `lm_head`: LoRA on the output projection,
    /// `logits + s · B · A · h`.
    pub lm_head: bool,
    /// `modules_to_save` and `trainable_token_indices`.
    pub saved: super::saved::SavedModules,
}

/// A parameter of a Mixture-of-Experts block that a LoRA may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExpertTarget {
    /// `mlp.experts.gate_up_proj`: every expert's gate and up, fused
    /// `[experts, 2 * intermediate, hidden]`.
    GateUp,
    /// `mlp.experts.down_proj`: `[experts, hidden, intermediate]`.
    Down,
    /// `mlp.gate.weight`: the router, `[experts, hidden]`.
    Router,
}

impl ExpertTarget {
    /// The path rank_pattern and alpha_pattern match for this parameter
    /// in `layer` (PEFT's module path, then the parameter's name).
    pub fn path(self, layer: usize) -> String {
        format!("model.layers.{layer}.{}", self.parameter_name())
    }

    /// The parameter's name as `target_parameters` lists it.
    pub fn parameter_name(self) -> &'static str {
        match self {
            ExpertTarget::GateUp => "mlp.experts.gate_up_proj",
            ExpertTarget::Down => "mlp.experts.down_proj",
            ExpertTarget::Router => "mlp.gate.weight",
        }
    }
}

impl AdapterConfig {
    pub fn from_file(
        adapter: &str,
        path: &Path,
        model: &ModelConfig,
    ) -> Result<AdapterConfig, AdapterError> {
        let text = std::fs::read_to_string(path).map_err(|source| AdapterError::Io {
            adapter: adapter.into(),
            path: "adapter_config.json".into(),
            source,
        })?;
        AdapterConfig::from_text(adapter, &text, Some(model.num_layers))?.for_model(adapter, model)
    }

    /// Checks the targets against the model's architecture; see
    /// [`AdapterConfig::for_architecture`].
    pub fn for_model(
        self,
        adapter: &str,
        model: &ModelConfig,
    ) -> Result<AdapterConfig, AdapterError> {
        use super::saved::Layer;
        if model.tie_word_embeddings && self.saved.rows_of(Layer::LmHead).is_some() {
            return Err(unsupported(
                adapter,
                "trainable_token_indices.lm_head",
                "the model ties lm_head to embed_tokens, so its rows follow the embeddings'",
            ));
        }
        self.for_architecture(adapter, model.architecture)
    }

    /// Checks the targets against an architecture: on a Mixture-of-Experts
    /// model `target_modules` may name the attention projections, and
    /// `target_parameters` the experts and the router (PEFT's form on
    /// transformers 5, whose experts are fused tensors rather than modules;
    /// its "all-linear" is written as both); on a dense model there are no
    /// expert parameters. The registry checks with the architecture alone.
    pub fn for_architecture(
        mut self,
        adapter: &str,
        architecture: Architecture,
    ) -> Result<AdapterConfig, AdapterError> {
        // A pattern reads as the architecture's modules: fused or separate.
        if self.fused != architecture.fused_projections()
            && let Some((targets, fused)) = self.selection.alternative()
            && !targets.is_empty()
        {
            self.targets = targets;
            self.fused = fused;
        }
        if self.fused != architecture.fused_projections() {
            let split = [
                Projection::Q,
                Projection::K,
                Projection::V,
                Projection::Gate,
                Projection::Up,
            ];
            let named = match self.stored_targets().into_iter().find(|t| {
                if self.fused {
                    t.parts.len() > 1
                } else {
                    split.contains(&t.parts[0])
                }
            }) {
                Some(t) => t.module_name(),
                None => "",
            };
            if !named.is_empty() {
                let why = if self.fused {
                    "its projections are separate modules"
                } else {
                    "it fuses q, k and v into qkv_proj and gate and up into gate_up_proj"
                };
                return Err(invalid(
                    adapter,
                    "target_modules",
                    format!(
                        "{named:?} is not a module of a {} model: {why}",
                        architecture.model_type()
                    ),
                ));
            }
        }
        if !architecture.is_moe() {
            if let Some(t) = self.expert_targets.first() {
                return Err(invalid(
                    adapter,
                    "target_parameters",
                    format!(
                        "{} is a Mixture-of-Experts parameter, and a {} model has no experts",
                        t.parameter_name(),
                        architecture.model_type()
                    ),
                ));
            }
            return Ok(self);
        }
        if let Some(p) = self.targets.iter().find(|p| p.parent() != "self_attn") {
            return Err(unsupported(
                adapter,
                "target_modules",
                &format!(
                    "{:?} is not a module of a Mixture-of-Experts model, whose experts are fused tensors: target them with target_parameters (mlp.experts.gate_up_proj, mlp.experts.down_proj)",
                    p.module_name()
                ),
            ));
        }
        if architecture == Architecture::GptOss
            && self.expert_targets.contains(&ExpertTarget::Router)
        {
            return Err(unsupported(
                adapter,
                "target_parameters",
                "mlp.gate.weight is not a parameter of a gpt_oss model: its router is mlp.router, and LoRA on it is not supported",
            ));
        }
        Ok(self)
    }

    /// Parses the text of an `adapter_config.json`. Without `num_layers`
    /// (no base model at hand, as in the registry), `layers_to_transform`
    /// is checked for shape only.
    pub fn from_text(
        adapter: &str,
        text: &str,
        num_layers: Option<usize>,
    ) -> Result<AdapterConfig, AdapterError> {
        let root: Map<String, Value> = match serde_json::from_str(text) {
            Ok(Value::Object(map)) => map,
            Ok(_) => {
                return Err(invalid(
                    adapter,
                    "adapter_config.json",
                    "must be a JSON object".into(),
                ));
            }
            Err(e) => {
                return Err(invalid(
                    adapter,
                    "adapter_config.json",
                    format!("is not valid JSON: {e}"),
                ));
            }
        };
        parse(adapter, &root, num_layers)
    }

    /// The modules the adapter stores a LoRA pair for, in projection order:
    /// one per projection, or the fused modules its `target_modules` names.
    pub fn stored_targets(&self) -> Vec<super::Target> {
        use super::Target;
        let mut out: Vec<Target> = Vec::new();
        for &p in &self.targets {
            let t = match p {
                Projection::Q | Projection::K | Projection::V if self.fused => Target::QKV,
                Projection::Gate | Projection::Up if self.fused => Target::GATE_UP,
                _ => Target::single(p),
            };
            if out.last() != Some(&t) {
                out.push(t);
            }
        }
        out
    }

    /// The largest rank of any module, after rank_pattern.
    pub fn max_rank(&self) -> usize {
        self.rank_pattern
            .iter()
            .map(|(_, _, r)| *r)
            .fold(self.r, usize::max)
    }

    /// The modules the adapter stores a LoRA pair for in `layer`: the
    /// [`AdapterConfig::stored_targets`] that `layers_to_transform`, a
    /// regular expression `target_modules` and `exclude_modules` leave.
    pub fn targets_in_layer(&self, layer: usize) -> Vec<super::Target> {
        if !self.transforms_layer(layer) {
            return Vec::new();
        }
        self.stored_targets()
            .into_iter()
            .filter(|&t| self.selection.admits(layer, t))
            .collect()
    }

    /// What the adapter does beyond plain LoRA, by the names the registry
    /// records, in this order.
    pub fn features(&self) -> Vec<&'static str> {
        [
            (self.use_dora, "dora"),
            (self.lora_bias, "lora_bias"),
            (self.embed_tokens, "embed_tokens"),
            (self.lm_head, "lm_head"),
            (!self.saved.whole.is_empty(), "modules_to_save"),
            (!self.saved.rows.is_empty(), "trainable_tokens"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }

    /// Whether `layer` carries LoRA weights.
    pub fn transforms_layer(&self, layer: usize) -> bool {
        self.layers_to_transform
            .as_ref()
            .is_none_or(|l| l.contains(&layer))
    }

    /// The rank and alpha for one module path such as
    /// `model.layers.3.self_attn.q_proj`, after rank_pattern and alpha_pattern.
    pub fn rank_and_alpha(
        &self,
        adapter: &str,
        module_path: &str,
    ) -> Result<(usize, f32), AdapterError> {
        let rank =
            pick(adapter, "rank_pattern", module_path, &self.rank_pattern)?.unwrap_or(self.r);
        let alpha = pick(adapter, "alpha_pattern", module_path, &self.alpha_pattern)?
            .unwrap_or(self.lora_alpha);
        Ok((rank, alpha))
    }
}

/// The value of the one pattern that matches, refusing ambiguity: PEFT's
/// answer would depend on key order, which JSON does not promise.
fn pick<T: Copy + PartialEq + std::fmt::Debug>(
    adapter: &str,
    field: &str,
    module_path: &str,
    patterns: &[(regex::Regex, String, T)],
) -> Result<Option<T>, AdapterError> {
    let mut found: Option<(&str, T)> = None;
    for (re, key, value) in patterns {
        if re.is_match(module_path) {
            if let Some((other_key, other)) = found
                && other != *value
            {
                return Err(invalid(
                    adapter,
                    field,
                    format!(
                        "patterns {other_key:?} and {key:?} both match {module_path} with different values"
                    ),
                ));
            }
            found = Some((key, *value));
        }
    }
    Ok(found.map(|(_, v)| v))
}

pub(super) fn invalid(adapter: &str, field: &str, reason: String) -> AdapterError {
    AdapterError::Invalid {
        adapter: adapter.into(),
        field: field.into(),
        reason,
    }
}

pub(super) fn unsupported(adapter: &str, field: &str, reason: &str) -> AdapterError {
    AdapterError::Unsupported {
        adapter: adapter.into(),
        field: field.into(),
        reason: reason.into(),
    }
}

/// Null, false, "", [] and {} all mean "not used".
fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Number(_) | Value::Bool(true) => false,
    }
}

fn parse(
    adapter: &str,
    root: &Map<String, Value>,
    num_layers: Option<usize>,
) -> Result<AdapterConfig, AdapterError> {
    let get = |k: &str| root.get(k).filter(|v| !v.is_null());

    if let Some(t) = get("peft_type")
        && t.as_str() != Some("LORA")
    {
        return Err(unsupported(
            adapter,
            "peft_type",
            "only LORA adapters are supported",
        ));
    }
    // Features that change the math: refused unless unset.
    let refused: &[(&str, &str)] = &[
        (
            "fan_in_fan_out",
            "fan_in_fan_out (Conv1D-style weights) is not supported",
        ),
        ("layer_replication", "layer replication is not supported"),
        ("alora_invocation_tokens", "activated LoRA is not supported"),
        ("use_qalora", "QALoRA is not supported"),
        ("arrow_config", "Arrow routing is not supported"),
    ];
    for (key, reason) in refused {
        if let Some(v) = root.get(*key)
            && !is_unset(v)
        {
            return Err(unsupported(adapter, key, reason));
        }
    }
    // Most initialisations only shape training. PiSSA, OLoRA, CorDA and
    // LoftQ also rewrite the base weights, so an adapter saved with one of
    // them still named expects a base that is not the served one.
    if let Some(init) = get("init_lora_weights") {
        let ok =
            matches!(init, Value::Bool(_)) || matches!(init.as_str(), Some("gaussian" | "eva"));
        if !ok {
            return Err(unsupported(
                adapter,
                "init_lora_weights",
                &format!(
                    "{init} modifies the base weights; convert the adapter to plain LoRA first"
                ),
            ));
        }
    }
    if let Some(bias) = get("bias")
        && bias.as_str() != Some("none")
    {
        return Err(unsupported(
            adapter,
            "bias",
            &format!("{bias} is not supported; only \"none\""),
        ));
    }
    if let Some(p) = get("layers_pattern") {
        let ok = match p {
            Value::String(s) => s == "layers",
            Value::Array(a) => a.iter().all(|x| x.as_str() == Some("layers")),
            _ => false,
        };
        if !ok && !is_unset(p) {
            return Err(unsupported(
                adapter,
                "layers_pattern",
                "only \"layers\" matches this model's layer names",
            ));
        }
    }
    let known: &[&str] = &[
        "init_lora_weights",
        "peft_type",
        "r",
        "lora_alpha",
        "use_rslora",
        "use_dora",
        "lora_bias",
        "rank_pattern",
        "alpha_pattern",
        "target_modules",
        "target_parameters",
        "layers_to_transform",
        "layers_pattern",
        "bias",
        "exclude_modules",
        "modules_to_save",
        "trainable_token_indices",
    ];
    for (key, value) in root {
        let listed = known.contains(&key.as_str())
            || HARMLESS_KEYS.contains(&key.as_str())
            || refused.iter().any(|(k, _)| k == key);
        if !listed && !is_unset(value) {
            return Err(unsupported(
                adapter,
                key,
                "is not a field lorafleet knows, and it is set; refusing rather than ignoring what may change the math",
            ));
        }
    }

    let r = match get("r").and_then(Value::as_u64) {
        Some(r) if r > 0 => r as usize,
        _ => return Err(invalid(adapter, "r", "must be a positive integer".into())),
    };
    let lora_alpha = match get("lora_alpha") {
        None => 8.0,
        Some(v) => match v.as_f64() {
            Some(a) if a.is_finite() && a != 0.0 => a as f32,
            _ => {
                return Err(invalid(
                    adapter,
                    "lora_alpha",
                    format!("must be a finite non-zero number, got {v}"),
                ));
            }
        },
    };
    let use_rslora = match get("use_rslora") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(invalid(
                adapter,
                "use_rslora",
                format!("must be true or false, got {v}"),
            ));
        }
    };
    let use_dora = match get("use_dora") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(invalid(
                adapter,
                "use_dora",
                format!("must be true or false, got {v}"),
            ));
        }
    };
    let lora_bias = match get("lora_bias") {
        None => false,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(invalid(
                adapter,
                "lora_bias",
                format!("must be true or false, got {v}"),
            ));
        }
    };
    if lora_bias && use_dora {
        return Err(unsupported(
            adapter,
            "lora_bias",
            "PEFT does not take lora_bias with DoRA",
        ));
    }
    let rank_pattern = patterns(adapter, "rank_pattern", get("rank_pattern"), |v| {
        v.as_u64().filter(|&r| r > 0).map(|r| r as usize)
    })?;
    let alpha_pattern = patterns(adapter, "alpha_pattern", get("alpha_pattern"), |v| {
        v.as_f64()
            .filter(|a| a.is_finite() && *a != 0.0)
            .map(|a| a as f32)
    })?;

    let expert_targets = parse_target_parameters(adapter, get("target_parameters"))?;
    let (mut fused_names, mut split_names): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
    let (mut embed_tokens, mut lm_head) = (false, false);
    let mut selection = Selection::new(adapter, get("exclude_modules"))?;
    let mut pattern_fused = false;
    let mut targets: Vec<Projection> = match get("target_modules") {
        Some(Value::String(s)) if s == "all-linear" => Projection::ALL.to_vec(),
        Some(Value::String(s)) => {
            // PEFT: a string other than "all-linear" is a regular
            // expression over each module's whole path.
            if get("layers_to_transform").is_some() {
                return Err(unsupported(
                    adapter,
                    "layers_to_transform",
                    "PEFT does not take layers_to_transform with a regular expression target_modules",
                ));
            }
            let (with, targets, fused) = selection.with_pattern(adapter, s, num_layers)?;
            selection = with;
            pattern_fused = fused;
            targets
        }
        Some(Value::Array(items)) if !items.is_empty() => {
            let names = items
                .iter()
                .map(|i| i.as_str().unwrap_or_default().to_owned())
                .collect();
            selection = selection.with_names(names);
            let mut out = Vec::new();
            for item in items {
                let name = item.as_str().unwrap_or_default();
                // PEFT matches a listed name against the last path component.
                let last = name.rsplit('.').next().unwrap_or(name);
                if let Some(t) = super::Target::fused_from_name(last) {
                    out.extend_from_slice(t.parts);
                    fused_names.push(last);
                    continue;
                }
                match Projection::from_module_name(last) {
                    Some(p) => {
                        if !matches!(p, Projection::O | Projection::Down) {
                            split_names.push(last);
                        }
                        out.push(p)
                    }
                    // The model's own, not a layer's: PEFT matches
                    // `embed_tokens` as `model.embed_tokens` and `lm_head`.
                    None if last == "embed_tokens" => embed_tokens = true,
                    None if last == "lm_head" => lm_head = true,
                    None => {
                        return Err(invalid(
                            adapter,
                            "target_modules",
                            format!(
                                "{item} is not a module of this model; expected q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj or down_proj (qkv_proj, o_proj, gate_up_proj or down_proj where the model fuses them)"
                            ),
                        ));
                    }
                }
            }
            out
        }
        // LoRA on parameters alone.
        None | Some(Value::Array(_)) if !expert_targets.is_empty() => Vec::new(),
        _ => {
            return Err(invalid(
                adapter,
                "target_modules",
                "must be a non-empty list or \"all-linear\"".into(),
            ));
        }
    };
    targets.sort();
    targets.dedup();
    if let (Some(f), Some(p)) = (fused_names.first(), split_names.first()) {
        return Err(invalid(
            adapter,
            "target_modules",
            format!(
                "names both the fused {f:?} and the separate {p:?}; a model has one or the other"
            ),
        ));
    }
    let fused = !fused_names.is_empty() || pattern_fused;

    let layers_to_transform = match get("layers_to_transform") {
        None => None,
        Some(v) => {
            let list: Vec<Value> = match v {
                Value::Array(a) => a.clone(),
                other => vec![other.clone()],
            };
            let mut layers = Vec::new();
            for item in list {
                match item.as_u64() {
                    Some(l) if num_layers.is_none_or(|n| (l as usize) < n) => {
                        layers.push(l as usize)
                    }
                    _ => {
                        let bound = match num_layers {
                            Some(n) => format!("a layer index below num_hidden_layers {n}"),
                            None => "a layer index".to_owned(),
                        };
                        return Err(invalid(
                            adapter,
                            "layers_to_transform",
                            format!("{item} is not {bound}"),
                        ));
                    }
                }
            }
            Some(layers)
        }
    };
    if let Some(field) = [(use_dora, "use_dora"), (lora_bias, "lora_bias")]
        .into_iter()
        .find_map(|(on, f)| (on && (embed_tokens || lm_head)).then_some(f))
    {
        return Err(unsupported(
            adapter,
            field,
            "is not supported with LoRA on embed_tokens or lm_head",
        ));
    }
    if use_dora && !expert_targets.is_empty() {
        return Err(unsupported(
            adapter,
            "use_dora",
            "DoRA on target_parameters (a Mixture-of-Experts block's fused experts) is not defined",
        ));
    }
    let lora_on: Vec<super::saved::Layer> = [
        (embed_tokens, super::saved::Layer::Embedding),
        (lm_head, super::saved::Layer::LmHead),
    ]
    .into_iter()
    .filter_map(|(on, l)| on.then_some(l))
    .collect();
    let saved = super::saved::parse(
        adapter,
        root.get("modules_to_save"),
        root.get("trainable_token_indices"),
        &lora_on,
    )?;
    let config = AdapterConfig {
        r,
        lora_alpha,
        use_rslora,
        use_dora,
        lora_bias,
        rank_pattern,
        alpha_pattern,
        targets,
        fused,
        layers_to_transform,
        expert_targets,
        selection,
        embed_tokens,
        lm_head,
        saved,
    };
    // Excluding every module a list names leaves nothing to adapt.
    if config.selection.excludes_any() && config.expert_targets.is_empty() {
        let probed = num_layers.unwrap_or(512);
        if (0..probed).all(|l| config.targets_in_layer(l).is_empty()) {
            return Err(invalid(
                adapter,
                "exclude_modules",
                "excludes every module target_modules selects".into(),
            ));
        }
    }
    Ok(config)
}

/// `target_parameters`: PEFT names a parameter by a suffix of its path
/// (`gate_up_proj`, `mlp.experts.down_proj`, `gate.weight`).
fn parse_target_parameters(
    adapter: &str,
    value: Option<&Value>,
) -> Result<Vec<ExpertTarget>, AdapterError> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    let items = value.as_array().ok_or_else(|| {
        invalid(
            adapter,
            "target_parameters",
            "must be a list of parameter names".into(),
        )
    })?;
    let mut out = Vec::new();
    for item in items {
        let name = item.as_str().unwrap_or_default();
        let target = [ExpertTarget::GateUp, ExpertTarget::Down, ExpertTarget::Router]
            .into_iter()
            .find(|t| {
                let full = t.parameter_name();
                !name.is_empty() && (full == name || full.ends_with(&format!(".{name}")))
            })
            .ok_or_else(|| {
                invalid(
                    adapter,
                    "target_parameters",
                    format!(
                        "{item} is not a parameter LoRA may target; expected mlp.experts.gate_up_proj, mlp.experts.down_proj or mlp.gate.weight"
                    ),
                )
            })?;
        out.push(target);
    }
    out.sort();
    out.dedup();
    Ok(out)
}

/// Module-path patterns with their values.
pub type Patterns<T> = Vec<(regex::Regex, String, T)>;

fn patterns<T>(
    adapter: &str,
    field: &str,
    value: Option<&Value>,
    parse_value: impl Fn(&Value) -> Option<T>,
) -> Result<Patterns<T>, AdapterError> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    let Value::Object(map) = value else {
        return Err(invalid(
            adapter,
            field,
            "must be an object of pattern -> value".into(),
        ));
    };
    let mut out = Vec::new();
    for (key, v) in map {
        // PEFT's rule: the key matches the module path or a dotted suffix of it.
        let re = regex::Regex::new(&format!(r"^(?:.*\.)?(?:{key})$")).map_err(|e| {
            invalid(
                adapter,
                &format!("{field}.{key}"),
                format!("is not a valid pattern: {e}"),
            )
        })?;
        let parsed = parse_value(v).ok_or_else(|| {
            invalid(
                adapter,
                &format!("{field}.{key}"),
                format!("{v} is not valid"),
            )
        })?;
        out.push((re, key.clone(), parsed));
    }
    Ok(out)
}
