//! Which modules of which layers an adapter adapts, as PEFT matches their
//! names: `target_modules` as a regular expression (a module is targeted
//! when the expression matches its whole path, `model.layers.3.self_attn.q_proj`,
//! as Python's `re.fullmatch`), and `exclude_modules` (a list: a module
//! whose path is a name of the list or ends with `.` and one; a string:
//! a regular expression over the whole path), which no module it names is
//! adapted past. A list `target_modules` keeps its own rule (the last path
//! component, with `layers_to_transform`), in `config.rs`.

use serde_json::Value;

use super::config::{invalid, unsupported};
use super::{AdapterError, Projection, Target};

/// The layers probed when the model's layer count is not known (the
/// registry): a pattern that selects nothing below this selects nothing.
const LAYERS_PROBED: usize = 512;

/// See the module docs.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// `target_modules` as written, compiled to match whole paths.
    regex: Option<(regex::Regex, String)>,
    /// `target_modules` as a list of names.
    names: Option<Vec<String>>,
    /// A pattern's targets under the other reading of the model.
    alternative: Option<(Vec<Projection>, bool)>,
    exclude: Exclude,
}

#[derive(Debug, Clone, Default)]
enum Exclude {
    #[default]
    Nothing,
    Names(Vec<String>),
    Regex(regex::Regex),
}

/// A Python `re.fullmatch` pattern as a Rust regex over the whole string,
/// refused by `field` where the regex crate cannot read it (look-around,
/// backreferences).
fn whole(adapter: &str, field: &str, pattern: &str) -> Result<regex::Regex, AdapterError> {
    regex::Regex::new(&format!("^(?:{pattern})$")).map_err(|e| {
        invalid(
            adapter,
            field,
            format!("{pattern:?} is not a regular expression this reader takes: {e}"),
        )
    })
}

/// PEFT's rule for a listed name: the whole path, or its end after a dot;
/// a multimodal checkpoint's own path (`model.language_model.layers.…`)
/// names the same module.
fn names_path(name: &str, path: &str) -> bool {
    forms(path).iter().any(|path| {
        path == name
            || path
                .strip_suffix(name)
                .is_some_and(|head| head.ends_with('.'))
    })
}

/// A module's path as a text model and as a multimodal checkpoint name it.
fn forms(path: &str) -> [String; 2] {
    [
        path.to_owned(),
        path.replacen("model.layers.", "model.language_model.layers.", 1),
    ]
}

/// Whether `re` matches either form of `path`.
fn full_match(re: &regex::Regex, path: &str) -> bool {
    forms(path).iter().any(|p| re.is_match(p))
}

/// The paths a `target_modules` pattern is matched against in `layer`.
fn paths(layer: usize) -> impl Iterator<Item = (String, Target)> {
    Projection::ALL
        .into_iter()
        .map(Target::single)
        .chain([Target::QKV, Target::GATE_UP])
        .map(move |t| (format!("model.layers.{layer}.{}", t.path), t))
}

impl Selection {
    /// `exclude_modules` (absent, null, a list of names, or a pattern).
    pub(super) fn new(adapter: &str, exclude: Option<&Value>) -> Result<Selection, AdapterError> {
        let exclude = match exclude {
            None | Some(Value::Null) => Exclude::Nothing,
            Some(Value::String(s)) => Exclude::Regex(whole(adapter, "exclude_modules", s)?),
            Some(Value::Array(items)) => Exclude::Names(
                items
                    .iter()
                    .map(|v| v.as_str().map(str::to_owned))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        invalid(
                            adapter,
                            "exclude_modules",
                            "must be a list of module names or a regular expression".into(),
                        )
                    })?,
            ),
            Some(_) => {
                return Err(invalid(
                    adapter,
                    "exclude_modules",
                    "must be a list of module names or a regular expression".into(),
                ));
            }
        };
        Ok(Selection {
            regex: None,
            names: None,
            alternative: None,
            exclude,
        })
    }

    /// `target_modules` as a list: each name matched against the end of a
    /// module's path.
    pub(super) fn with_names(mut self, names: Vec<String>) -> Selection {
        self.names = Some(names);
        self
    }

    /// `target_modules` as a pattern: the projections it selects in some
    /// layer of a model whose projections are separate modules, and of one
    /// that fuses them (Phi-3's `qkv_proj`, `gate_up_proj`), each with
    /// `o_proj` and `down_proj`. Which one the model has is known when the
    /// config meets the architecture ([`Selection::alternative`]). Refused
    /// by name when it selects the embeddings or the lm_head, or nothing.
    pub(super) fn with_pattern(
        mut self,
        adapter: &str,
        pattern: &str,
        num_layers: Option<usize>,
    ) -> Result<(Selection, Vec<Projection>, bool), AdapterError> {
        let re = whole(adapter, "target_modules", pattern)?;
        for outside in ["lm_head", "model.embed_tokens"] {
            if full_match(&re, outside) {
                return Err(unsupported(
                    adapter,
                    "target_modules",
                    &format!(
                        "{pattern:?} matches {outside}: list embed_tokens or lm_head by name to adapt them (a pattern over them is not supported)"
                    ),
                ));
            }
        }
        let (mut split, mut fused) = (Vec::new(), Vec::new());
        for layer in 0..num_layers.unwrap_or(LAYERS_PROBED) {
            for (path, t) in paths(layer) {
                if !full_match(&re, &path) || self.excludes(&path) {
                    continue;
                }
                let both = matches!(t.parts, [Projection::O] | [Projection::Down]);
                if t.parts.len() > 1 || both {
                    fused.extend_from_slice(t.parts);
                }
                if t.parts.len() == 1 {
                    split.extend_from_slice(t.parts);
                }
            }
        }
        for set in [&mut split, &mut fused] {
            set.sort();
            set.dedup();
        }
        // Separate modules unless the pattern names only fused ones.
        let fused_only = !fused.is_empty()
            && split
                .iter()
                .all(|p| matches!(p, Projection::O | Projection::Down))
            && fused.len() > split.len();
        let (chosen, other) = if fused_only {
            ((fused, true), (split, false))
        } else {
            ((split, false), (fused, true))
        };
        if chosen.0.is_empty() {
            return Err(invalid(
                adapter,
                "target_modules",
                format!(
                    "{pattern:?} matches no module of this model (a pattern must match a whole path such as \"model.layers.0.self_attn.q_proj\")"
                ),
            ));
        }
        self.regex = Some((re, pattern.to_owned()));
        self.alternative = Some(other);
        Ok((self, chosen.0, chosen.1))
    }

    /// For a pattern, the targets it selects under the other reading of
    /// the model (fused projections or separate ones), and whether that
    /// reading is the fused one; taken once.
    pub fn alternative(&mut self) -> Option<(Vec<Projection>, bool)> {
        self.alternative.take()
    }

    /// Whether `exclude_modules` names the module at `path`.
    fn excludes(&self, path: &str) -> bool {
        match &self.exclude {
            Exclude::Nothing => false,
            Exclude::Names(names) => names.iter().any(|n| names_path(n, path)),
            Exclude::Regex(re) => full_match(re, path),
        }
    }

    /// Whether the module `t` of `layer` is adapted, given that the list
    /// rule (or `"all-linear"`) would adapt it.
    pub fn admits(&self, layer: usize, t: Target) -> bool {
        let path = format!("model.layers.{layer}.{}", t.path);
        !self.excludes(&path)
            && self
                .regex
                .as_ref()
                .is_none_or(|(re, _)| full_match(re, &path))
            && self
                .names
                .as_ref()
                .is_none_or(|names| names.iter().any(|n| names_path(n, &path)))
    }

    /// Whether `target_modules` is a pattern.
    pub fn is_pattern(&self) -> bool {
        self.regex.is_some()
    }

    /// Whether `exclude_modules` names anything.
    pub fn excludes_any(&self) -> bool {
        !matches!(self.exclude, Exclude::Nothing)
    }
}
