//! A chat answer's tool calls, as OpenAI returns them: in a whole
//! response's `message.tool_calls`, and in one stream delta's
//! `tool_calls` (a call's name and arguments whole, once the answer is
//! complete).

use serde_json::{Value, json};

use super::openai::tools::{Call, ToolChoice, Tools};

/// Whether a request's text is read for calls: it has tools and does not
/// forbid them.
pub(super) fn reads_calls(tools: Option<&Tools>) -> bool {
    tools.is_some_and(|t| t.choice != ToolChoice::None)
}

/// The answer's text split into its content (None when empty) and its
/// calls, or None when it holds no call.
pub(super) fn split(tools: Option<&Tools>, text: &str) -> Option<(Option<String>, Vec<Call>)> {
    tools?.read(text)
}

/// OpenAI's `tool_calls` for `calls`; with `indexed`, as stream deltas.
pub(super) fn tool_calls(calls: &[Call], indexed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": format!("call_{}", uuid::Uuid::new_v4().simple()),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            });
            if indexed {
                v["index"] = i.into();
            }
            v
        })
        .collect()
}
