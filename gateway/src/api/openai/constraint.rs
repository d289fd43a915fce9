//! Structured outputs on both endpoints: OpenAI's `response_format` and
//! vLLM's `guided_json`, `guided_regex`, `guided_choice` and
//! `guided_grammar`, at most one per request.

use serde::Deserialize;

use super::{BadRequest, Common, bad};
use crate::upstream;

/// OpenAI's `response_format`.
#[derive(Debug, Deserialize)]
pub(super) struct ResponseFormat {
    #[serde(rename = "type")]
    kind: String,
    json_schema: Option<JsonSchemaFormat>,
}

#[derive(Debug, Deserialize)]
struct JsonSchemaFormat {
    /// Kept as the client's own text: a schema is never rebuilt.
    schema: Option<Box<serde_json::value::RawValue>>,
    /// Every schema is enforced exactly, so `strict` changes nothing.
    #[serde(rename = "strict")]
    _strict: Option<bool>,
}

/// The largest schema, regular expression, choice list or grammar
/// accepted, in bytes (the workers' limit).
pub const MAX_CONSTRAINT_BYTES: usize = 64 * 1024;

impl Common {
    /// The structured-output constraint: `response_format`, or one of
    /// vLLM's `guided_json`, `guided_regex`, `guided_choice` and
    /// `guided_grammar`; at most one of them.
    pub(super) fn constraint(&self) -> Result<Option<upstream::Constraint>, BadRequest> {
        use upstream::Constraint as C;
        let mut found: Vec<(&str, C)> = Vec::new();
        if let Some(f) = &self.response_format {
            match f.kind.as_str() {
                "text" => {}
                "json_object" => found.push(("response_format", C::JsonObject)),
                "json_schema" => {
                    let schema = f
                        .json_schema
                        .as_ref()
                        .and_then(|j| j.schema.as_ref())
                        .ok_or_else(|| bad("response_format.json_schema.schema", "is required"))?;
                    found.push((
                        "response_format.json_schema.schema",
                        C::JsonSchema(schema.get().to_owned()),
                    ));
                }
                other => {
                    return Err(bad(
                        "response_format.type",
                        format!("{other:?} is not text, json_object or json_schema"),
                    ));
                }
            }
        }
        if let Some(raw) = &self.guided_json {
            // A schema object, or a string holding one.
            let text = match serde_json::from_str::<String>(raw.get()) {
                Ok(inner) => inner,
                Err(_) => raw.get().to_owned(),
            };
            found.push(("guided_json", C::JsonSchema(text)));
        }
        if let Some(r) = &self.guided_regex {
            found.push(("guided_regex", C::Regex(r.clone())));
        }
        if let Some(c) = &self.guided_choice {
            if c.is_empty() || c.iter().any(String::is_empty) {
                return Err(bad(
                    "guided_choice",
                    "must hold at least one non-empty string",
                ));
            }
            found.push(("guided_choice", C::Choice(c.clone())));
        }
        if let Some(g) = &self.guided_grammar {
            found.push(("guided_grammar", C::Grammar(g.clone())));
        }
        if found.len() > 1 {
            return Err(bad(
                found[1].0,
                format!(
                    "only one constraint per request; {} is given too",
                    found[0].0
                ),
            ));
        }
        let Some((field, c)) = found.pop() else {
            return Ok(None);
        };
        let size = c.source_bytes();
        if size > MAX_CONSTRAINT_BYTES {
            return Err(bad(
                field,
                format!("is {size} bytes, above the limit of {MAX_CONSTRAINT_BYTES}"),
            ));
        }
        Ok(Some(c))
    }
}
