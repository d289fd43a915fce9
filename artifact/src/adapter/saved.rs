//! What an adapter keeps of the embedding layers beyond LoRA factors:
//! `modules_to_save` (a whole trained copy of `embed_tokens` or `lm_head`,
//! which PEFT uses in place of the model's layer for that adapter) and
//! `trainable_token_indices` (new values for some rows of them).

use serde_json::Value;

use super::AdapterError;
use super::config::{invalid, unsupported};

/// One of the two layers an adapter may keep whole or in rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Layer {
    /// `model.embed_tokens`.
    Embedding,
    /// `lm_head`.
    LmHead,
}

impl Layer {
    /// The module's name as PEFT's configs write it.
    pub fn module_name(self) -> &'static str {
        match self {
            Layer::Embedding => "embed_tokens",
            Layer::LmHead => "lm_head",
        }
    }

    /// The module's path in the model (`rank_pattern` keys, PEFT's paths).
    pub fn path(self) -> &'static str {
        match self {
            Layer::Embedding => "model.embed_tokens",
            Layer::LmHead => "lm_head",
        }
    }

    fn named(name: &str) -> Option<Layer> {
        [Layer::Embedding, Layer::LmHead]
            .into_iter()
            .find(|l| name == l.module_name() || name == l.path())
    }
}

/// The rows of one layer an adapter trained (`trainable_token_indices`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRows {
    pub layer: Layer,
    /// In the order PEFT stores their values.
    pub indices: Vec<u32>,
}

/// `modules_to_save` and `trainable_token_indices` as read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SavedModules {
    /// Layers saved whole, sorted.
    pub whole: Vec<Layer>,
    /// Layers with trained rows, as the config names them. A list (not a
    /// dict) names the embeddings; PEFT ties the lm_head's rows to them
    /// where the model ties the two layers (the backend applies that).
    pub rows: Vec<TokenRows>,
}

impl SavedModules {
    pub fn is_empty(&self) -> bool {
        self.whole.is_empty() && self.rows.is_empty()
    }

    pub fn keeps_whole(&self, layer: Layer) -> bool {
        self.whole.contains(&layer)
    }

    pub fn rows_of(&self, layer: Layer) -> Option<&[u32]> {
        self.rows
            .iter()
            .find(|r| r.layer == layer)
            .map(|r| r.indices.as_slice())
    }
}

/// Reads both fields; `lora_on` says which layers carry LoRA already
/// (`target_modules` listing them), which a saved layer may not.
pub(super) fn parse(
    adapter: &str,
    modules_to_save: Option<&Value>,
    trainable_token_indices: Option<&Value>,
    lora_on: &[Layer],
) -> Result<SavedModules, AdapterError> {
    let mut saved = SavedModules::default();
    if let Some(v) = modules_to_save.filter(|v| !v.is_null()) {
        let field = "modules_to_save";
        let Value::Array(items) = v else {
            return Err(invalid(
                adapter,
                field,
                format!("must be a list of module names, got {v}"),
            ));
        };
        for item in items {
            let name = item
                .as_str()
                .ok_or_else(|| invalid(adapter, field, format!("{item} is not a module name")))?;
            let layer = Layer::named(name).ok_or_else(|| {
                unsupported(
                    adapter,
                    field,
                    &format!("{name:?}: only embed_tokens and lm_head can be saved whole"),
                )
            })?;
            if !saved.whole.contains(&layer) {
                saved.whole.push(layer);
            }
        }
        saved.whole.sort();
    }
    if let Some(v) = trainable_token_indices.filter(|v| !v.is_null()) {
        let field = "trainable_token_indices";
        let named: Vec<(Layer, &Value)> = match v {
            Value::Array(_) => vec![(Layer::Embedding, v)],
            Value::Object(map) => map
                .iter()
                .map(|(k, list)| {
                    Layer::named(k).map(|l| (l, list)).ok_or_else(|| {
                        unsupported(
                            adapter,
                            &format!("{field}.{k}"),
                            "only embed_tokens and lm_head can have trainable tokens",
                        )
                    })
                })
                .collect::<Result<_, _>>()?,
            other => {
                return Err(invalid(
                    adapter,
                    field,
                    format!("must be a list of token ids or a dict of them by module, got {other}"),
                ));
            }
        };
        for (layer, list) in named {
            let at = match v {
                Value::Array(_) => field.to_owned(),
                _ => format!("{field}.{}", layer.module_name()),
            };
            let Value::Array(items) = list else {
                return Err(invalid(
                    adapter,
                    &at,
                    format!("must be a list of token ids, got {list}"),
                ));
            };
            let mut indices = Vec::with_capacity(items.len());
            for item in items {
                let id = item
                    .as_u64()
                    .and_then(|i| u32::try_from(i).ok())
                    .ok_or_else(|| invalid(adapter, &at, format!("{item} is not a token id")))?;
                if indices.contains(&id) {
                    return Err(invalid(adapter, &at, format!("lists token {id} twice")));
                }
                indices.push(id);
            }
            if indices.is_empty() {
                continue;
            }
            saved.rows.push(TokenRows { layer, indices });
        }
    }
    for layer in [Layer::Embedding, Layer::LmHead] {
        let whole = saved.keeps_whole(layer);
        let rows = saved.rows_of(layer).is_some();
        let name = layer.module_name();
        if whole && lora_on.contains(&layer) {
            return Err(unsupported(
                adapter,
                "modules_to_save",
                &format!("{name} is a LoRA target too; PEFT keeps one or the other"),
            ));
        }
        if rows && lora_on.contains(&layer) {
            return Err(unsupported(
                adapter,
                "trainable_token_indices",
                &format!(
                    "{name} is a LoRA target too; trainable tokens and LoRA on one layer are not supported"
                ),
            ));
        }
        if rows && whole {
            return Err(unsupported(
                adapter,
                "trainable_token_indices",
                &format!("{name} is saved whole (modules_to_save) already"),
            ));
        }
    }
    Ok(saved)
}

/// The tensor PEFT stores a whole saved layer as.
pub fn whole_tensor(layer: Layer) -> &'static str {
    match layer {
        Layer::Embedding => "base_model.model.model.embed_tokens.weight",
        Layer::LmHead => "base_model.model.lm_head.weight",
    }
}

/// The tensor PEFT stores a layer's trained rows as, `[rows, hidden]`.
pub fn rows_tensor(layer: Layer) -> &'static str {
    match layer {
        Layer::Embedding => {
            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"
        }
        Layer::LmHead => "base_model.model.lm_head.token_adapter.trainable_tokens_delta",
    }
}

/// How many token ids an adapter's own `tokenizer.json` uses (its largest
/// id plus one, over the model's vocabulary and the added tokens), read
/// from `dir` when the adapter ships one.
pub fn tokenizer_tokens(adapter: &str, dir: &std::path::Path) -> Result<Option<u64>, AdapterError> {
    const FILE: &str = "tokenizer.json";
    let path = dir.join(FILE);
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&path).map_err(|source| AdapterError::Io {
        adapter: adapter.into(),
        path: FILE.into(),
        source,
    })?;
    let not = |why: &str| invalid(adapter, FILE, format!("is not a tokenizer: {why}"));
    let root: Value = serde_json::from_str(&text).map_err(|e| not(&e.to_string()))?;
    let ids: Vec<u64> = match root.pointer("/model/vocab") {
        // BPE and WordPiece: token → id.
        Some(Value::Object(vocab)) => vocab.values().filter_map(Value::as_u64).collect(),
        // Unigram: [token, score] pairs, by id.
        Some(Value::Array(pieces)) => (0..pieces.len() as u64).collect(),
        _ => return Err(not("it has no model.vocab")),
    };
    let added = root
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|t| t.get("id").and_then(Value::as_u64));
    Ok(ids.into_iter().chain(added).max().map(|m| m + 1))
}

/// Refuses an adapter whose own tokenizer has ids past `rows`, the
/// vocabulary its embedding and lm_head rows cover (`what` names them).
pub fn check_tokenizer(
    adapter: &str,
    dir: &std::path::Path,
    rows: u64,
    what: &str,
) -> Result<(), AdapterError> {
    match tokenizer_tokens(adapter, dir)? {
        Some(tokens) if tokens > rows => Err(invalid(
            adapter,
            "tokenizer.json",
            format!(
                "has {tokens} tokens, but {what} has {rows} rows: its new tokens would have no row"
            ),
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(mts: &str, tti: &str, lora_on: &[Layer]) -> Result<SavedModules, (String, String)> {
        let (a, b): (Value, Value) = (
            serde_json::from_str(mts).unwrap(),
            serde_json::from_str(tti).unwrap(),
        );
        parse("a", Some(&a), Some(&b), lora_on).map_err(|e| match e {
            AdapterError::Invalid { field, reason, .. }
            | AdapterError::Unsupported { field, reason, .. } => (field, reason),
            other => panic!("{other:?}"),
        })
    }

    #[test]
    fn saved_layers_and_token_rows_are_read_as_peft_writes_them() {
        let s = read(r#"["lm_head", "embed_tokens"]"#, "null", &[]).unwrap();
        assert_eq!(s.whole, vec![Layer::Embedding, Layer::LmHead]);
        let s = read("null", "[5, 3]", &[]).unwrap();
        assert_eq!(s.rows_of(Layer::Embedding), Some(&[5, 3][..]));
        assert_eq!(s.rows_of(Layer::LmHead), None);
        let s = read("null", r#"{"embed_tokens": [1], "lm_head": [2, 9]}"#, &[]).unwrap();
        assert_eq!(s.rows_of(Layer::LmHead), Some(&[2, 9][..]));
        assert!(read("[]", "null", &[]).unwrap().is_empty());
    }

    #[test]
    fn what_cannot_be_served_is_refused_by_field() {
        let (f, r) = read(r#"["norm"]"#, "null", &[]).unwrap_err();
        assert_eq!(f, "modules_to_save");
        assert!(
            r.contains("\"norm\"") && r.contains("only embed_tokens and lm_head"),
            "{r}"
        );
        let (f, _) = read(r#"["lm_head"]"#, "null", &[Layer::LmHead]).unwrap_err();
        assert_eq!(f, "modules_to_save");
        let (f, r) = read("null", "[1, 1]", &[]).unwrap_err();
        assert_eq!(
            (f.as_str(), r.as_str()),
            ("trainable_token_indices", "lists token 1 twice")
        );
        let (f, _) = read("null", r#"{"q_proj": [1]}"#, &[]).unwrap_err();
        assert_eq!(f, "trainable_token_indices.q_proj");
        let (f, _) = read("null", r#"{"lm_head": [-1]}"#, &[]).unwrap_err();
        assert_eq!(f, "trainable_token_indices.lm_head");
        let (f, r) = read(r#"["embed_tokens"]"#, "[4]", &[]).unwrap_err();
        assert_eq!(f, "trainable_token_indices");
        assert!(r.contains("saved whole"), "{r}");
        let (f, _) = read("null", "[4]", &[Layer::Embedding]).unwrap_err();
        assert_eq!(f, "trainable_token_indices");
    }
}
