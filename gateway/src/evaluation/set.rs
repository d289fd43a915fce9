//! An evaluation set as an admin registers it: a JSON Lines file, one item
//! a line, read into typed items or refused by line and field.
//!
//! - A **multiple-choice** item, `{"prompt" or "messages", "choices",
//!   "answer"}`, is scored by loglikelihood as lm-evaluation-harness scores
//!   its `multiple_choice` tasks: each choice's log probability after the
//!   prompt (after the chat rendered with the model's template and its
//!   assistant header, for `messages`), the most likely choice (the first
//!   of equals) against `answer`, an index into `choices`.
//! - A **generation** item, `{"prompt" or "messages", "expected"}`, is
//!   answered greedily (`max_tokens`, default 32, stopping at `stop`,
//!   default a newline) and scored by exact match of the answer and
//!   `expected`, both trimmed of surrounding white space, or, with
//!   `"match": "regex"`, by `expected` as a regular expression found in
//!   the answer.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The largest file accepted, in bytes.
pub const MAX_BYTES: usize = 1 << 20;
/// The most items a set may hold.
pub const MAX_ITEMS: usize = 2000;
/// The longest prompt, choice, message or expected answer, in bytes.
pub const MAX_TEXT_BYTES: usize = 16 * 1024;
/// The most choices of a multiple-choice item.
pub const MAX_CHOICES: usize = 26;
/// The largest `max_tokens` of a generation item.
pub const MAX_GENERATED_TOKENS: u32 = 512;
/// A generation item's `max_tokens` when it gives none.
pub const DEFAULT_MAX_TOKENS: u32 = 32;

/// One chat message of a generation item's prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// What a generation item's prompt is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
}

/// How a generation item's answer is matched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Match {
    /// The answer equals `expected`, both trimmed.
    #[default]
    Exact,
    /// `expected` is a regular expression found in the answer.
    Regex,
}

/// One item of a set, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Item {
    Choice {
        prompt: Prompt,
        choices: Vec<String>,
        answer: usize,
    },
    Generate {
        prompt: Prompt,
        expected: String,
        #[serde(rename = "match")]
        matching: Match,
        max_tokens: u32,
        stop: Vec<String>,
    },
}

/// A set read from its file: the items, and the file's SHA-256.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EvalSet {
    pub items: Vec<Item>,
    pub sha256: String,
}

impl EvalSet {
    /// How many items of each kind: (multiple choice, generation).
    pub fn kinds(&self) -> (usize, usize) {
        let choice = self
            .items
            .iter()
            .filter(|i| matches!(i, Item::Choice { .. }))
            .count();
        (choice, self.items.len() - choice)
    }
}

/// A line as written: every field optional, so that a missing one is
/// named by this module rather than by serde.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
    choices: Option<Vec<String>>,
    answer: Option<serde_json::Value>,
    expected: Option<String>,
    #[serde(rename = "match")]
    matching: Option<Match>,
    max_tokens: Option<u32>,
    stop: Option<Vec<String>>,
    /// The item's own name, kept for people; not used in scoring.
    #[allow(dead_code)]
    id: Option<serde_json::Value>,
}

/// Why a file is refused: the field (`line N` or `line N.field`, counting
/// from 1) and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SetError {
    pub field: String,
    pub message: String,
}

fn refuse(line: usize, field: &str, message: impl Into<String>) -> SetError {
    let field = if field.is_empty() {
        format!("line {line}")
    } else {
        format!("line {line}.{field}")
    };
    SetError {
        field,
        message: message.into(),
    }
}

fn text_fits(line: usize, field: &str, t: &str) -> Result<(), SetError> {
    if t.len() > MAX_TEXT_BYTES {
        return Err(refuse(
            line,
            field,
            format!("{} bytes; at most {MAX_TEXT_BYTES}", t.len()),
        ));
    }
    Ok(())
}

/// Reads a set file. Blank lines are skipped; every other line is one
/// item.
pub fn parse(bytes: &[u8]) -> Result<EvalSet, SetError> {
    let whole = |message: String| SetError {
        field: "file".into(),
        message,
    };
    if bytes.len() > MAX_BYTES {
        return Err(whole(format!(
            "{} bytes; a set is at most {MAX_BYTES}",
            bytes.len()
        )));
    }
    let text = std::str::from_utf8(bytes).map_err(|e| whole(format!("is not UTF-8: {e}")))?;
    let mut items = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        if items.len() == MAX_ITEMS {
            return Err(whole(format!("more than {MAX_ITEMS} items")));
        }
        let line: Line =
            serde_json::from_str(raw).map_err(|e| refuse(n, "", format!("is not an item: {e}")))?;
        items.push(item(n, line)?);
    }
    if items.is_empty() {
        return Err(whole("holds no item".into()));
    }
    Ok(EvalSet {
        items,
        sha256: hex::encode(Sha256::digest(bytes)),
    })
}

fn item(n: usize, l: Line) -> Result<Item, SetError> {
    if let Some(t) = &l.prompt {
        if t.is_empty() {
            return Err(refuse(n, "prompt", "is empty"));
        }
        text_fits(n, "prompt", t)?;
    }
    match (&l.choices, &l.expected) {
        (Some(_), Some(_)) => Err(refuse(
            n,
            "expected",
            "an item has `choices` (multiple choice) or `expected` (generation), not both",
        )),
        (None, None) => Err(refuse(
            n,
            "",
            "has neither `choices` with `answer` (multiple choice) nor `expected` (generation)",
        )),
        (Some(_), None) => choice(n, l),
        (None, Some(_)) => generate(n, l),
    }
}

fn choice(n: usize, l: Line) -> Result<Item, SetError> {
    for (field, present) in [
        ("match", l.matching.is_some()),
        ("max_tokens", l.max_tokens.is_some()),
        ("stop", l.stop.is_some()),
    ] {
        if present {
            return Err(refuse(n, field, "applies to generation items only"));
        }
    }
    let prompt = prompt_of(n, l.prompt, l.messages)?;
    let choices = l.choices.unwrap_or_default();
    if !(2..=MAX_CHOICES).contains(&choices.len()) {
        return Err(refuse(
            n,
            "choices",
            format!("has {}; give 2 to {MAX_CHOICES}", choices.len()),
        ));
    }
    let mut seen = BTreeSet::new();
    for (i, c) in choices.iter().enumerate() {
        let field = format!("choices[{i}]");
        if c.is_empty() {
            return Err(refuse(n, &field, "is empty"));
        }
        text_fits(n, &field, c)?;
        if !seen.insert(c.as_str()) {
            return Err(refuse(n, &field, format!("{c:?} is given twice")));
        }
    }
    let answer = match l.answer {
        None => return Err(refuse(n, "answer", "is missing")),
        Some(v) => v.as_u64().ok_or_else(|| {
            refuse(
                n,
                "answer",
                format!("{v} is not the index of a choice (0, 1, …)"),
            )
        })?,
    };
    if answer >= choices.len() as u64 {
        return Err(refuse(
            n,
            "answer",
            format!("{answer} is past the last choice ({})", choices.len() - 1),
        ));
    }
    Ok(Item::Choice {
        prompt,
        choices,
        answer: answer as usize,
    })
}

fn generate(n: usize, l: Line) -> Result<Item, SetError> {
    if l.answer.is_some() {
        return Err(refuse(
            n,
            "answer",
            "applies to multiple-choice items (with `choices`) only",
        ));
    }
    let prompt = prompt_of(n, l.prompt, l.messages)?;
    let expected = l.expected.unwrap_or_default();
    text_fits(n, "expected", &expected)?;
    let matching = l.matching.unwrap_or_default();
    match matching {
        Match::Exact if expected.trim().is_empty() => {
            return Err(refuse(n, "expected", "is empty"));
        }
        Match::Regex => {
            regex_of(&expected).map_err(|e| {
                refuse(
                    n,
                    "expected",
                    format!("is not a regular expression this gateway accepts: {e}"),
                )
            })?;
        }
        Match::Exact => {}
    }
    let max_tokens = l.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS);
    if !(1..=MAX_GENERATED_TOKENS).contains(&max_tokens) {
        return Err(refuse(
            n,
            "max_tokens",
            format!("{max_tokens} must be between 1 and {MAX_GENERATED_TOKENS}"),
        ));
    }
    let stop = l.stop.unwrap_or_else(|| vec!["\n".into()]);
    if stop.len() > 4 || stop.iter().any(|s| s.is_empty() || s.len() > 64) {
        return Err(refuse(
            n,
            "stop",
            "give at most 4 stop strings of 1 to 64 bytes",
        ));
    }
    Ok(Item::Generate {
        prompt,
        expected,
        matching,
        max_tokens,
        stop,
    })
}

/// An item's prompt: its text, or its chat messages.
fn prompt_of(
    n: usize,
    prompt: Option<String>,
    messages: Option<Vec<Message>>,
) -> Result<Prompt, SetError> {
    Ok(match (prompt, messages) {
        (Some(_), Some(_)) => {
            return Err(refuse(
                n,
                "messages",
                "give `prompt` or `messages`, not both",
            ));
        }
        (None, None) => return Err(refuse(n, "prompt", "is missing (or give `messages`)")),
        (Some(t), None) => Prompt::Text(t),
        (None, Some(m)) => {
            if m.is_empty() {
                return Err(refuse(n, "messages", "is empty"));
            }
            for (i, msg) in m.iter().enumerate() {
                if !matches!(msg.role.as_str(), "system" | "user" | "assistant") {
                    return Err(refuse(
                        n,
                        &format!("messages[{i}].role"),
                        format!("{:?} is not system, user or assistant", msg.role),
                    ));
                }
                text_fits(n, &format!("messages[{i}].content"), &msg.content)?;
            }
            Prompt::Messages(m)
        }
    })
}

/// A generation item's regular expression, compiled within a size limit.
pub fn regex_of(pattern: &str) -> Result<regex::Regex, regex::Error> {
    regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_set_of_both_kinds_is_read_with_its_defaults_and_digest() {
        let file = concat!(
            r#"{"prompt": "And God said", "choices": [" LET", " let"], "answer": 0}"#,
            "\n\n",
            r#"{"prompt": "In the beginning", "expected": "GOD", "match": "regex", "stop": ["."]}"#,
            "\n",
            r#"{"messages": [{"role": "user", "content": "Hi"}], "expected": "Hello", "max_tokens": 4}"#,
            "\n",
            r#"{"messages": [{"role": "user", "content": "Yes?"}], "choices": [" yes", " no"], "answer": 1}"#,
            "\n"
        );
        let set = parse(file.as_bytes()).unwrap();
        assert_eq!(set.kinds(), (2, 2));
        match &set.items[3] {
            Item::Choice {
                prompt: Prompt::Messages(m),
                answer: 1,
                ..
            } => assert_eq!(m[0].content, "Yes?"),
            other => panic!("{other:?}"),
        }
        assert_eq!(set.sha256, hex::encode(Sha256::digest(file.as_bytes())));
        assert_eq!(
            set.items[0],
            Item::Choice {
                prompt: Prompt::Text("And God said".into()),
                choices: vec![" LET".into(), " let".into()],
                answer: 0
            }
        );
        match &set.items[2] {
            Item::Generate {
                prompt: Prompt::Messages(m),
                matching: Match::Exact,
                max_tokens: 4,
                stop,
                ..
            } => {
                assert_eq!(m[0].content, "Hi");
                assert_eq!(stop, &["\n".to_owned()]);
            }
            other => panic!("{other:?}"),
        }
        // Stored and read back as the same items.
        let stored = serde_json::to_value(&set.items).unwrap();
        let back: Vec<Item> = serde_json::from_value(stored).unwrap();
        assert_eq!(back, set.items);
    }

    #[test]
    fn every_malformed_item_is_refused_by_line_and_field() {
        let cases: &[(&str, &str)] = &[
            (
                r#"{"prompt": "p", "choices": ["a"], "answer": 0}"#,
                "line 1.choices",
            ),
            (
                r#"{"prompt": "p", "choices": ["a", "a"], "answer": 0}"#,
                "line 1.choices[1]",
            ),
            (
                r#"{"prompt": "p", "choices": ["a", ""], "answer": 0}"#,
                "line 1.choices[1]",
            ),
            (
                r#"{"prompt": "p", "choices": ["a", "b"], "answer": 2}"#,
                "line 1.answer",
            ),
            (
                r#"{"prompt": "p", "choices": ["a", "b"], "answer": -1}"#,
                "line 1.answer",
            ),
            (r#"{"prompt": "p", "choices": ["a", "b"]}"#, "line 1.answer"),
            (r#"{"choices": ["a", "b"], "answer": 0}"#, "line 1.prompt"),
            (r#"{"prompt": "", "expected": "x"}"#, "line 1.prompt"),
            (
                r#"{"prompt": "p", "choices": ["a", "b"], "answer": 0, "expected": "a"}"#,
                "line 1.expected",
            ),
            (
                r#"{"prompt": "p", "choices": ["a", "b"], "answer": 0, "max_tokens": 3}"#,
                "line 1.max_tokens",
            ),
            (
                r#"{"prompt": "p", "messages": [{"role": "user", "content": "q"}], "choices": ["a", "b"], "answer": 0}"#,
                "line 1.messages",
            ),
            (
                r#"{"messages": [{"role": "bot", "content": "q"}], "choices": ["a", "b"], "answer": 0}"#,
                "line 1.messages[0].role",
            ),
            (r#"{"prompt": "p"}"#, "line 1"),
            (
                r#"{"prompt": "p", "expected": "x", "answer": 1}"#,
                "line 1.answer",
            ),
            (
                r#"{"prompt": "p", "expected": "(", "match": "regex"}"#,
                "line 1.expected",
            ),
            (
                r#"{"prompt": "p", "expected": "x", "match": "fuzzy"}"#,
                "line 1",
            ),
            (
                r#"{"prompt": "p", "expected": "x", "max_tokens": 0}"#,
                "line 1.max_tokens",
            ),
            (
                r#"{"prompt": "p", "expected": "x", "stop": [""]}"#,
                "line 1.stop",
            ),
            (
                r#"{"prompt": "p", "messages": [], "expected": "x"}"#,
                "line 1.messages",
            ),
            (
                r#"{"messages": [{"role": "robot", "content": "q"}], "expected": "x"}"#,
                "line 1.messages[0].role",
            ),
            (
                r#"{"prompt": "p", "expected": "x", "colour": "red"}"#,
                "line 1",
            ),
            ("not json", "line 1"),
        ];
        for (line, field) in cases {
            let e = parse(line.as_bytes()).unwrap_err();
            assert_eq!(e.field, *field, "{line}: {e}");
        }
        // The line number counts blank lines.
        let e =
            parse(b"{\"prompt\": \"p\", \"expected\": \"x\"}\n\n{\"prompt\": \"p\"}").unwrap_err();
        assert_eq!(e.field, "line 3");
        assert_eq!(parse(b"\n \n").unwrap_err().field, "file");
        assert_eq!(parse(&[0xff, 0xfe]).unwrap_err().field, "file");
        let big = vec![b' '; MAX_BYTES + 1];
        assert!(parse(&big).unwrap_err().message.contains("at most"));
        let many = "{\"prompt\": \"p\", \"expected\": \"x\"}\n".repeat(MAX_ITEMS + 1);
        assert!(
            parse(many.as_bytes())
                .unwrap_err()
                .message
                .contains("more than")
        );
        let long = format!(
            "{{\"prompt\": \"{}\", \"expected\": \"x\"}}",
            "a".repeat(MAX_TEXT_BYTES + 1)
        );
        assert_eq!(parse(long.as_bytes()).unwrap_err().field, "line 1.prompt");
    }
}
