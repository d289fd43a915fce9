//! Tool calls in chat: the request's `tools`, `tool_choice` and
//! `parallel_tool_calls`; the constraint that makes `required` and a named
//! function always produce valid calls; and reading calls back out of the
//! model's text.
//!
//! A call is the JSON object `{"name": ..., "arguments": {...}}`, alone
//! or, for the Hermes and Qwen chat formats, between `<tool_call>` tags
//! (Llama 3.x's `{"name": ..., "parameters": {...}}` is read too). With
//! `required` or a named function the output is constrained to exactly
//! that object (an array of them with `parallel_tool_calls`), each call's
//! arguments to its function's `parameters` schema.

use serde::Deserialize;
use serde_json::{Value, json};

use super::{BadRequest, bad};
use crate::upstream::{Constraint, ToolCall, ToolFunction};

/// The most tools one request may offer.
pub const MAX_TOOLS: usize = 128;

/// `tools`, as the request gives them.
#[derive(Debug, Deserialize)]
struct ToolSpec {
    #[serde(rename = "type")]
    kind: String,
    function: Option<FunctionSpec>,
}

#[derive(Debug, Deserialize)]
struct FunctionSpec {
    name: String,
    parameters: Option<Value>,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model answers in text.
    None,
    /// The model decides; a call in its text is read back.
    Auto,
    /// At least one call, constrained to the functions' schemas.
    Required,
    /// A call of this function, constrained to its schema.
    Named(String),
}

/// A request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    /// The request's `tools`, as JSON, for the chat template.
    pub json: Value,
    /// (name, parameters schema) of each function.
    functions: Vec<(String, Value)>,
    pub choice: ToolChoice,
    pub parallel: bool,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    /// A JSON object, as text (OpenAI's `function.arguments`).
    pub arguments: String,
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls`.
pub(super) fn parse(
    raw_tools: Option<&serde_json::value::RawValue>,
    choice: Option<&serde_json::value::RawValue>,
    parallel: Option<bool>,
) -> Result<Option<Tools>, BadRequest> {
    let specs: Vec<ToolSpec> = raw_tools
        .map(|r| serde_json::from_str(r.get()))
        .transpose()
        .map_err(|e| bad("tools", e.to_string()))?
        .unwrap_or_default();
    if specs.is_empty() {
        if choice.is_some_and(|c| !matches!(c.get().trim(), "\"none\"" | "\"auto\"" | "null")) {
            return Err(bad("tool_choice", "needs tools"));
        }
        return Ok(None);
    }
    if specs.len() > MAX_TOOLS {
        return Err(bad("tools", format!("at most {MAX_TOOLS} tools")));
    }
    let mut functions = Vec::with_capacity(specs.len());
    for (i, t) in specs.iter().enumerate() {
        if t.kind != "function" {
            return Err(bad(
                &format!("tools[{i}].type"),
                format!("{:?} is not supported; only \"function\"", t.kind),
            ));
        }
        let f = t
            .function
            .as_ref()
            .ok_or_else(|| bad(&format!("tools[{i}].function"), "is required"))?;
        if f.name.is_empty() || functions.iter().any(|(n, _)| *n == f.name) {
            return Err(bad(
                &format!("tools[{i}].function.name"),
                "must be non-empty and unique",
            ));
        }
        let parameters = f
            .parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object"}));
        if !parameters.is_object() {
            return Err(bad(
                &format!("tools[{i}].function.parameters"),
                "must be a JSON schema object",
            ));
        }
        functions.push((f.name.clone(), parameters));
    }
    let choice = match choice.map(|c| serde_json::from_str::<Value>(c.get())) {
        None => ToolChoice::Auto,
        Some(Ok(Value::String(s))) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(
                    "tool_choice",
                    format!("{other:?} is not none, auto, required or a function"),
                ));
            }
        },
        Some(Ok(v)) => {
            let name = v["function"]["name"]
                .as_str()
                .filter(|_| v["type"] == "function");
            match name {
                Some(n) if functions.iter().any(|(f, _)| f == n) => ToolChoice::Named(n.into()),
                Some(n) => {
                    return Err(bad(
                        "tool_choice.function.name",
                        format!("{n:?} is not one of the tools"),
                    ));
                }
                None => {
                    return Err(bad(
                        "tool_choice",
                        "must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ));
                }
            }
        }
        Some(Err(e)) => return Err(bad("tool_choice", e.to_string())),
    };
    let json: Value = raw_tools
        .map(|r| serde_json::from_str(r.get()))
        .transpose()
        .map_err(|e| bad("tools", e.to_string()))?
        .unwrap_or(Value::Null);
    Ok(Some(Tools {
        json,
        functions,
        choice,
        parallel: parallel.unwrap_or(true),
    }))
}

impl Tools {
    /// Whether the answer's text is read for calls: unless `none`.
    pub fn reads_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The constraint `required` and a named function put on the output:
    /// a call of one of the allowed functions, which the engine writes in
    /// the model's own form.
    pub fn constraint(&self) -> Option<Constraint> {
        let function = |(name, parameters): &(String, Value)| ToolFunction {
            name: name.clone(),
            parameters: parameters.to_string(),
        };
        // A named function is one call; `required` is one or more with
        // `parallel_tool_calls`.
        let (functions, parallel) = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Named(n) => (
                self.functions
                    .iter()
                    .filter(|(f, _)| f == n)
                    .map(function)
                    .collect(),
                false,
            ),
            ToolChoice::Required => (self.functions.iter().map(function).collect(), self.parallel),
        };
        Some(Constraint::ToolCall(ToolCall {
            functions,
            parallel,
        }))
    }

    /// The calls in the model's text, and the text left around them (None
    /// when empty); None when the text holds no call of these tools.
    pub fn read(&self, text: &str) -> Option<(Option<String>, Vec<Call>)> {
        if !self.reads_calls() {
            return None;
        }
        let known = |name: &str| self.functions.iter().any(|(f, _)| f == name);
        let call_of = |v: &Value| -> Option<Call> {
            let name = v["name"].as_str().filter(|n| known(n))?;
            let args = v.get("arguments").or_else(|| v.get("parameters"))?;
            let args = match args {
                // Some models write the arguments as a JSON string.
                Value::String(s) => serde_json::from_str::<Value>(s).ok()?,
                other => other.clone(),
            };
            args.is_object().then(|| Call {
                name: name.to_owned(),
                arguments: args.to_string(),
            })
        };
        // Hermes / Qwen: <tool_call>{...}</tool_call>, any number of them.
        if text.contains("<tool_call>") {
            let (mut calls, mut rest) = (Vec::new(), String::new());
            let mut left = text;
            while let Some(start) = left.find("<tool_call>") {
                rest.push_str(&left[..start]);
                let after = &left[start + "<tool_call>".len()..];
                let end = after.find("</tool_call>").unwrap_or(after.len());
                let call = serde_json::from_str::<Value>(after[..end].trim()).ok()?;
                calls.push(call_of(&call)?);
                left = after.get(end + "</tool_call>".len()..).unwrap_or("");
            }
            rest.push_str(left);
            let rest = rest.trim();
            return Some(((!rest.is_empty()).then(|| rest.to_owned()), calls));
        }
        // The whole text: one call, or an array of them.
        let calls = match serde_json::from_str::<Value>(text.trim()).ok()? {
            Value::Array(items) => items.iter().map(call_of).collect::<Option<Vec<_>>>()?,
            v => vec![call_of(&v)?],
        };
        (!calls.is_empty()).then_some((None, calls))
    }
}

/// Tools with one function and `choice` (`"auto"`, `"required"`...), for
/// other modules' tests.
#[cfg(test)]
pub fn for_tests(choice: &str) -> Tools {
    let raw = serde_json::value::RawValue::from_string(
        r#"[{"type":"function","function":{"name":"time"}}]"#.into(),
    )
    .expect("JSON");
    let choice = serde_json::value::RawValue::from_string(format!("{choice:?}")).expect("JSON");
    parse(Some(&raw), Some(&choice), None)
        .expect("valid tools")
        .expect("tools")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: &str, parallel: bool) -> Tools {
        let raw = r#"[{"type":"function","function":{"name":"weather","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}},
                      {"type":"function","function":{"name":"time"}}]"#;
        let raw = serde_json::value::RawValue::from_string(raw.into()).unwrap();
        let choice = serde_json::value::RawValue::from_string(choice.into()).unwrap();
        parse(Some(&raw), Some(&choice), Some(parallel))
            .unwrap()
            .unwrap()
    }

    #[test]
    fn calls_are_read_in_each_format_and_only_for_known_tools() {
        let t = tools(r#""auto""#, true);
        let weather = Call {
            name: "weather".into(),
            arguments: r#"{"city":"Paris"}"#.into(),
        };
        assert_eq!(
            t.read(r#"{"name": "weather", "arguments": {"city": "Paris"}}"#),
            Some((None, vec![weather.clone()]))
        );
        assert_eq!(
            t.read(r#"{"name": "weather", "parameters": {"city": "Paris"}}"#),
            Some((None, vec![weather.clone()])),
            "Llama 3.x's shape"
        );
        assert_eq!(
            t.read("Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>"),
            Some((
                Some("Let me check.".into()),
                vec![weather.clone(), Call { name: "time".into(), arguments: "{}".into() }]
            ))
        );
        assert_eq!(t.read("It is sunny."), None);
        assert_eq!(
            t.read(r#"{"name": "launch", "arguments": {}}"#),
            None,
            "not a tool"
        );
        assert_eq!(
            tools(r#""none""#, true).read(r#"{"name": "time", "arguments": {}}"#),
            None
        );
    }

    #[test]
    fn required_and_named_choices_constrain_the_output() {
        assert_eq!(tools(r#""auto""#, true).constraint(), None);
        let names = |c: Option<Constraint>| match c {
            Some(Constraint::ToolCall(t)) => (
                t.functions.into_iter().map(|f| f.name).collect::<Vec<_>>(),
                t.parallel,
            ),
            other => panic!("{other:?}"),
        };
        assert_eq!(
            names(tools(r#"{"type":"function","function":{"name":"time"}}"#, true).constraint()),
            (vec!["time".to_owned()], false)
        );
        assert_eq!(names(tools(r#""required""#, false).constraint()).0.len(), 2);
        assert!(!names(tools(r#""required""#, false).constraint()).1);
    }

    #[test]
    fn bad_tools_are_refused_by_field() {
        let raw = |s: &str| serde_json::value::RawValue::from_string(s.into()).unwrap();
        let specs = raw(r#"[{"type":"retrieval"}]"#);
        assert_eq!(
            parse(Some(&specs), None, None).unwrap_err().param,
            "tools[0].type"
        );
        let specs = raw(
            r#"[{"type":"function","function":{"name":"a"}},{"type":"function","function":{"name":"a"}}]"#,
        );
        assert_eq!(
            parse(Some(&specs), None, None).unwrap_err().param,
            "tools[1].function.name"
        );
        let specs = raw(r#"[{"type":"function","function":{"name":"a"}}]"#);
        let named = raw(r#"{"type":"function","function":{"name":"b"}}"#);
        assert_eq!(
            parse(Some(&specs), Some(&named), None).unwrap_err().param,
            "tool_choice.function.name"
        );
        let required = raw(r#""required""#);
        assert_eq!(
            parse(None, Some(&required), None).unwrap_err().param,
            "tool_choice"
        );
    }
}
