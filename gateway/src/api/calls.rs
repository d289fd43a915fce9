//! A chat answer's tool calls, as OpenAI returns them: in a whole
//! response's `message.tool_calls`, and in one stream delta's
//! `tool_calls` (a call's name and arguments whole, once the answer is
//! complete).

use serde_json::{Value, json};

use super::openai::tools::{Call, ToolChoice, Tools};

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

/// Where a streamed answer stands while it may still turn out to hold
/// calls.
#[derive(Debug, PartialEq, Eq)]
enum Phase {
    /// Only whitespace so far: a JSON call may still start.
    Start,
    /// Plain text: it streams, up to where a `<tool_call>` tag may begin.
    Text,
    /// A call may be under way: everything is held to the end.
    Call,
}

const TAG: &str = "<tool_call>";

/// A streamed answer's text while tools apply: text that cannot be part of
/// a call streams at once; from where a call may start (a JSON object or
/// array opening the answer, or a `<tool_call>` tag) it is held and read at
/// the end. With `required` or a named function everything is held: the
/// answer is a call.
#[derive(Debug)]
pub(super) struct Holder {
    phase: Phase,
    held: String,
}

impl Holder {
    pub(super) fn new(tools: &Tools) -> Holder {
        Holder {
            phase: match tools.choice {
                ToolChoice::Required | ToolChoice::Named(_) => Phase::Call,
                ToolChoice::None | ToolChoice::Auto => Phase::Start,
            },
            held: String::new(),
        }
    }

    /// Takes new text; returns what can be sent now.
    pub(super) fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.phase == Phase::Start {
            let t = self.held.trim_start();
            if t.is_empty() {
                return String::new();
            }
            self.phase = if t.starts_with('{') || t.starts_with('[') {
                Phase::Call
            } else {
                Phase::Text
            };
        }
        if self.phase != Phase::Text {
            return String::new();
        }
        if let Some(at) = self.held.find(TAG) {
            self.phase = Phase::Call;
            return self.held.drain(..at).collect();
        }
        // Hold back a tail that could be the start of the tag.
        let keep = (1..TAG.len())
            .rev()
            .find(|&n| self.held.ends_with(&TAG[..n]))
            .unwrap_or(0);
        let send = self.held.len() - keep;
        self.held.drain(..send).collect()
    }

    /// The text held to the end (a call, or text that only looked like the
    /// start of one).
    pub(super) fn finish(self) -> String {
        self.held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(choice: &str) -> Tools {
        super::super::openai::tools::for_tests(choice)
    }

    fn run(choice: &str, pieces: &[&str]) -> (String, String) {
        let mut h = Holder::new(&tools(choice));
        let sent: String = pieces.iter().map(|p| h.push(p)).collect();
        (sent, h.finish())
    }

    #[test]
    fn plain_text_streams_and_a_call_is_held() {
        // Text streams as it comes.
        assert_eq!(
            run("auto", &["It is ", "sunny."]),
            ("It is sunny.".into(), String::new())
        );
        // A JSON call opening the answer is held whole.
        let call = r#"{"name": "time", "arguments": {}}"#;
        assert_eq!(
            run("auto", &["  ", &call[..5], &call[5..]]),
            (String::new(), format!("  {call}"))
        );
        // Text before a tag streams; the tag and what follows are held, even
        // when the tag arrives in pieces.
        assert_eq!(
            run(
                "auto",
                &["Let me check.\n<tool", "_call>{\"name\"", "}</tool_call>"]
            ),
            (
                "Let me check.\n".into(),
                "<tool_call>{\"name\"}</tool_call>".into()
            )
        );
        // A tail that only looked like a tag is sent at the end.
        assert_eq!(run("auto", &["a <to"]), ("a ".into(), "<to".into()));
        // required and named: everything is held.
        assert_eq!(run("required", &["x"]), (String::new(), "x".into()));
    }
}
