//! Log probabilities in OpenAI's two shapes: the legacy one of
//! /v1/completions (`tokens`, `token_logprobs`, `top_logprobs`,
//! `text_offset`) and chat's (`content[]` with `token`, `logprob`, `bytes`,
//! `top_logprobs`). A token's text is its bytes as UTF-8, with U+FFFD where
//! a token holds part of a character; chat also gives the raw bytes.

use serde_json::{Map, Value, json};

use crate::upstream::{Prompt, Sampling, TokenLogprob};

/// What a response says about log probabilities.
#[derive(Debug, Clone, Default)]
pub(super) struct Asked {
    /// Completion tokens' log probabilities are returned.
    pub tokens: bool,
    /// /v1/completions' `echo`: the prompt's text opens the choice's text,
    /// and (with `tokens`) its tokens open the log probabilities.
    pub echo: Option<Echo>,
}

/// Where the echoed prompt's text comes from.
#[derive(Debug, Clone)]
pub(super) enum Echo {
    /// The client's own text.
    Text(String),
    /// Token ids: their bytes, as the worker sends them with the prompt's
    /// log probabilities.
    FromTokens,
}

impl Asked {
    pub fn new(prompt: &Prompt, sampling: &Sampling) -> Asked {
        Asked {
            tokens: sampling.logprobs.is_some(),
            echo: sampling.prompt_logprobs.map(|_| match prompt {
                Prompt::Text(t) => Echo::Text(t.clone()),
                _ => Echo::FromTokens,
            }),
        }
    }

    /// The echoed prompt's text, given its tokens' log probabilities.
    pub fn echo_text(&self, prompt: &[TokenLogprob]) -> Option<String> {
        match self.echo.as_ref()? {
            Echo::Text(t) => Some(t.clone()),
            Echo::FromTokens => {
                let bytes: Vec<u8> = prompt.iter().flat_map(|e| e.bytes.clone()).collect();
                Some(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn number(x: f32) -> Value {
    // JSON has no infinities: a probability of zero has no logprob.
    serde_json::Number::from_f64(f64::from(x)).map_or(Value::Null, Value::Number)
}

/// The legacy shape for `entries`; `offset` is the text offset, in
/// characters, of the first, and moves past the last.
pub(super) fn legacy(entries: &[TokenLogprob], offset: &mut usize) -> Value {
    let (mut tokens, mut values, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for e in entries {
        let token = text(&e.bytes);
        offsets.push(json!(*offset));
        *offset += token.chars().count();
        match e.logprob {
            // The prompt's first token: nothing predicts it.
            None => {
                values.push(Value::Null);
                tops.push(Value::Null);
            }
            Some(lp) => {
                values.push(number(lp));
                let mut top = Map::new();
                for t in &e.top {
                    top.entry(text(&t.bytes)).or_insert(number(t.logprob));
                }
                // The chosen token is always among them, as vLLM returns.
                top.entry(token.clone()).or_insert(number(lp));
                tops.push(Value::Object(top));
            }
        }
        tokens.push(Value::String(token));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": values,
        "top_logprobs": tops,
        "text_offset": offsets,
    })
}

/// Chat's shape for `entries`.
pub(super) fn chat(entries: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let top: Vec<Value> = e
                .top
                .iter()
                .map(|t| json!({"token": text(&t.bytes), "logprob": number(t.logprob), "bytes": t.bytes}))
                .collect();
            json!({
                "token": text(&e.bytes),
                "logprob": e.logprob.map_or(Value::Null, number),
                "bytes": e.bytes,
                "top_logprobs": top,
            })
        })
        .collect();
    json!({"content": content, "refusal": null})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::upstream::TopLogprob;

    fn entry(bytes: &[u8], logprob: Option<f32>, top: &[(&[u8], f32)]) -> TokenLogprob {
        TokenLogprob {
            token_id: 0,
            logprob,
            bytes: bytes.to_vec(),
            top: top
                .iter()
                .enumerate()
                .map(|(i, (b, lp))| TopLogprob {
                    token_id: i as u32,
                    logprob: *lp,
                    bytes: b.to_vec(),
                })
                .collect(),
        }
    }

    #[test]
    fn the_legacy_shape_with_echo_and_a_split_character() {
        let entries = [
            entry(b"He", None, &[]),
            entry(b"llo", Some(-0.5), &[(b"llo", -0.5), (b"y", -1.5)]),
            // The first two bytes of "\u{1F680}" alone.
            entry(&[0xF0, 0x9F], Some(-2.0), &[(b"!", -0.25)]),
        ];
        let mut offset = 0;
        let v = legacy(&entries, &mut offset);
        assert_eq!(v["tokens"], json!(["He", "llo", "\u{FFFD}"]));
        assert_eq!(v["token_logprobs"], json!([null, -0.5, -2.0]));
        assert_eq!(v["top_logprobs"][0], Value::Null);
        assert_eq!(v["top_logprobs"][1], json!({"llo": -0.5, "y": -1.5}));
        // The chosen token joins the alternatives.
        assert_eq!(v["top_logprobs"][2], json!({"!": -0.25, "\u{FFFD}": -2.0}));
        assert_eq!(v["text_offset"], json!([0, 2, 5]));
        assert_eq!(offset, 6);
    }

    #[test]
    fn the_chat_shape_keeps_the_raw_bytes() {
        let v = chat(&[entry(&[0xF0, 0x9F], Some(-2.0), &[(b"a", -0.1)])]);
        assert_eq!(
            v,
            json!({"content": [{"token": "\u{FFFD}", "logprob": -2.0, "bytes": [240, 159],
                                "top_logprobs": [{"token": "a", "logprob": -0.1f32 as f64, "bytes": [97]}]}],
                   "refusal": null})
        );
    }
}
