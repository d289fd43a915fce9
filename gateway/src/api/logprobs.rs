//! Log probabilities in OpenAI's two shapes: the legacy one of
//! /v1/completions (`tokens`, `token_logprobs`, `top_logprobs`,
//! `text_offset`) and chat's (`content[]` with `token`, `logprob`, `bytes`,
//! `top_logprobs`). A token is named by its text; one that holds part of a
//! character is named `bytes:\xNN...`, as OpenAI names it, so that two
//! such tokens never share a name. Chat also gives the raw bytes.

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
    /// What `sampling` asks for; `show` is whether the client asked for
    /// completion tokens' log probabilities (`best_of` asks the worker for
    /// them alone).
    pub fn new(prompt: &Prompt, sampling: &Sampling, show: bool) -> Asked {
        Asked {
            tokens: show && sampling.logprobs.is_some(),
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

/// A token's name: its text, or `bytes:` and its bytes escaped.
fn text(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(t) => t.to_owned(),
        Err(_) => {
            let mut out = String::from("bytes:");
            for b in bytes {
                out.push_str(&format!("\\x{b:02x}"));
            }
            out
        }
    }
}

/// Where the next token starts in the text, in characters: bytes of a
/// character split across tokens wait for the rest of it.
#[derive(Debug, Default)]
pub(super) struct TextOffset {
    chars: usize,
    pending: Vec<u8>,
}

impl TextOffset {
    fn advance(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(t) => {
                    self.chars += t.chars().count();
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.chars += std::str::from_utf8(&self.pending[..valid])
                        .map_or(0, |t| t.chars().count());
                    match e.error_len() {
                        // The rest may be completed by the next token.
                        None => {
                            self.pending.drain(..valid);
                            return;
                        }
                        // Never valid: one U+FFFD in the text.
                        Some(n) => {
                            self.chars += 1;
                            self.pending.drain(..valid + n);
                        }
                    }
                }
            }
        }
    }
}

fn number(x: f32) -> Value {
    // JSON has no infinities: a probability of zero has no logprob.
    serde_json::Number::from_f64(f64::from(x)).map_or(Value::Null, Value::Number)
}

/// The legacy shape for `entries`; `offset` is where the first starts in
/// the text, and moves past the last.
pub(super) fn legacy(entries: &[TokenLogprob], offset: &mut TextOffset) -> Value {
    let (mut tokens, mut values, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
    for e in entries {
        let token = text(&e.bytes);
        offsets.push(json!(offset.chars));
        offset.advance(&e.bytes);
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
        let mut offset = TextOffset::default();
        let v = legacy(&entries, &mut offset);
        assert_eq!(v["tokens"], json!(["He", "llo", "bytes:\\xf0\\x9f"]));
        assert_eq!(v["token_logprobs"], json!([null, -0.5, -2.0]));
        assert_eq!(v["top_logprobs"][0], Value::Null);
        assert_eq!(v["top_logprobs"][1], json!({"llo": -0.5, "y": -1.5}));
        // The chosen token joins the alternatives.
        assert_eq!(
            v["top_logprobs"][2],
            json!({"!": -0.25, "bytes:\\xf0\\x9f": -2.0})
        );
        assert_eq!(v["text_offset"], json!([0, 2, 5]));
        // The rest of the rocket completes one character.
        let v = legacy(&[entry(&[0x9A, 0x80], Some(-0.1), &[])], &mut offset);
        assert_eq!(v["text_offset"], json!([5]));
        assert_eq!(offset.chars, 6);
        // A byte that can never be UTF-8 is one replacement character.
        offset.advance(&[0xFF, b'a']);
        assert_eq!(offset.chars, 8);
    }

    #[test]
    fn the_chat_shape_keeps_the_raw_bytes() {
        let v = chat(&[entry(&[0xF0, 0x9F], Some(-2.0), &[(b"a", -0.1)])]);
        assert_eq!(
            v,
            json!({"content": [{"token": "bytes:\\xf0\\x9f", "logprob": -2.0, "bytes": [240, 159],
                                "top_logprobs": [{"token": "a", "logprob": -0.1f32 as f64, "bytes": [97]}]}],
                   "refusal": null})
        );
    }
}
