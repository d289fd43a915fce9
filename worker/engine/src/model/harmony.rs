//! OpenAI's harmony format, in which GPT-OSS answers: a sequence of
//! messages, each a header (`<|channel|>analysis`, or
//! `<|channel|>commentary to=functions.get_weather <|constrain|>json`)
//! then `<|message|>`, a body, and `<|end|>` (another message follows, after
//! `<|start|>assistant`), `<|call|>` (a tool call: the turn ends) or
//! `<|return|>` (the answer ends).
//!
//! The engine reads it on token ids, as a harmony model's tokens come: the
//! markers are special tokens, never text, so a body that talks about
//! `<|channel|>` cannot open a message. Each body's text goes out tagged
//! with its message's [`Channel`]; headers and markers are not text.

use super::tokenizer::Tokenizer;

pub use lorafleet_domain::generation::Channel;

/// Reads a header's text: the role, a recipient (`to=…`) before or after
/// the channel, the channel after `<|channel|>`, and a content type after
/// `<|constrain|>` or as a last word (`commentary json`, as the template
/// writes a past call).
pub fn parse_header(header: &str) -> Channel {
    let mut out = Channel::default();
    let spaced = header
        .replace(CHANNEL, " <|channel|> ")
        .replace(CONSTRAIN, " <|constrain|> ");
    let mut words = spaced.split_whitespace();
    while let Some(w) = words.next() {
        if w == CHANNEL {
            out.channel = words.next().unwrap_or_default().to_owned();
        } else if w == CONSTRAIN {
            out.content_type = words.next().map(str::to_owned);
        } else if let Some(to) = w.strip_prefix("to=") {
            out.recipient = Some(to.to_owned());
        } else if !out.channel.is_empty() && out.content_type.is_none() {
            out.content_type = Some(w.to_owned());
        }
        // Any other word is the role (`assistant`) a later message
        // opens with.
    }
    out
}

const CHANNEL: &str = "<|channel|>";
const CONSTRAIN: &str = "<|constrain|>";

/// The special tokens of harmony, by id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HarmonyTokens {
    pub start: u32,
    pub channel: u32,
    pub message: u32,
    pub end: u32,
    pub call: u32,
    pub ret: u32,
    pub constrain: u32,
}

impl HarmonyTokens {
    /// The model's harmony tokens: when its chat template writes
    /// `<|channel|>` and its tokenizer has every marker as a special token.
    pub fn of(tokenizer: &Tokenizer) -> Option<HarmonyTokens> {
        if !tokenizer
            .chat_template()
            .is_some_and(|t| t.contains("<|channel|>"))
        {
            return None;
        }
        let id = |t: &str| tokenizer.special_id(t);
        Some(HarmonyTokens {
            start: id("<|start|>")?,
            channel: id("<|channel|>")?,
            message: id("<|message|>")?,
            end: id("<|end|>")?,
            call: id("<|call|>")?,
            ret: id("<|return|>")?,
            constrain: id(CONSTRAIN)?,
        })
    }
}

/// Where one answer stands.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    /// Reading a header, as its text (the prompt ends with
    /// `<|start|>assistant`).
    Header(String),
    /// In a message's body.
    Body(Channel),
}

/// What one token is, for the answer's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// Text of the body of this message.
    Body(Channel),
    /// Part of a header, or a marker: no text.
    Header,
    /// The token ends this message: the text held for it goes out under it.
    Ends(Channel),
}

/// One answer's harmony reader.
#[derive(Debug, Clone)]
pub struct HarmonyReader {
    tokens: HarmonyTokens,
    phase: Phase,
}

impl HarmonyReader {
    pub fn new(tokens: HarmonyTokens) -> HarmonyReader {
        HarmonyReader {
            tokens,
            phase: Phase::Header(String::new()),
        }
    }

    /// The reader for an answer after `prompt`, when the prompt leaves the
    /// model inside a harmony message (its last `<|start|>` opens one, as
    /// the template's `<|start|>assistant` does); None for any other
    /// prompt (text that never opens a message reads as plain text).
    pub fn after_prompt(
        tokens: HarmonyTokens,
        prompt: &[u32],
        tokenizer: &Tokenizer,
    ) -> Option<HarmonyReader> {
        let from = prompt.iter().rposition(|&id| id == tokens.start)?;
        let mut reader = HarmonyReader::new(tokens);
        for &id in &prompt[from..] {
            let text = tokenizer.decode(&[id]).unwrap_or_default();
            reader.push(id, &text);
        }
        Some(reader)
    }

    /// Whether the answer is inside a message's body.
    pub fn in_body(&self) -> bool {
        matches!(self.phase, Phase::Body(_))
    }

    /// Takes the next token, with the text it decodes to (special tokens
    /// decode to none), and says what the token is.
    pub fn push(&mut self, id: u32, text: &str) -> Step {
        let t = self.tokens;
        match &mut self.phase {
            Phase::Body(c) if [t.end, t.call, t.ret].contains(&id) => {
                let c = c.clone();
                self.phase = Phase::Header(String::new());
                Step::Ends(c)
            }
            Phase::Body(c) => Step::Body(c.clone()),
            Phase::Header(h) if id == t.message => {
                self.phase = Phase::Body(parse_header(h));
                Step::Header
            }
            Phase::Header(h) => {
                if id == t.channel {
                    h.push_str(CHANNEL);
                } else if id == t.constrain {
                    h.push_str(CONSTRAIN);
                } else if id != t.start {
                    h.push_str(text);
                }
                Step::Header
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(channel: &str, recipient: Option<&str>, content_type: Option<&str>) -> Channel {
        Channel {
            channel: channel.into(),
            recipient: recipient.map(Into::into),
            content_type: content_type.map(Into::into),
        }
    }

    #[test]
    fn headers_read_as_the_model_and_the_template_write_them() {
        for (header, want) in [
            ("<|channel|>analysis", c("analysis", None, None)),
            ("assistant<|channel|>final", c("final", None, None)),
            (
                "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json",
                c("commentary", Some("functions.get_weather"), Some("json")),
            ),
            (
                "<|channel|>commentary to=functions.f<|constrain|>json",
                c("commentary", Some("functions.f"), Some("json")),
            ),
            (
                "assistant to=functions.get_weather<|channel|>commentary json",
                c("commentary", Some("functions.get_weather"), Some("json")),
            ),
            ("<|channel|>commentary", c("commentary", None, None)),
        ] {
            assert_eq!(parse_header(header), want, "{header:?}");
        }
    }

    const T: HarmonyTokens = HarmonyTokens {
        start: 1,
        channel: 2,
        message: 3,
        end: 4,
        call: 5,
        ret: 6,
        constrain: 7,
    };

    #[test]
    fn bodies_are_text_under_their_channel_and_markers_are_not() {
        let mut r = HarmonyReader::new(T);
        let analysis = c("analysis", None, None);
        let call = c("commentary", Some("functions.f"), Some("json"));
        let steps: Vec<Step> = [
            (2, ""),
            (10, "analysis"),
            (3, ""),
            (11, "Think"),
            (11, "ing."),
            (4, ""),
            (1, ""),
            (12, "assistant"),
            (2, ""),
            (13, "commentary"),
            (14, " to=functions.f "),
            (7, ""),
            (15, "json"),
            (3, ""),
            (16, "{}"),
            (5, ""),
        ]
        .into_iter()
        .map(|(id, text)| r.push(id, text))
        .collect();
        use Step::{Body, Ends, Header};
        let mut want = vec![Header; 3];
        want.extend([
            Body(analysis.clone()),
            Body(analysis.clone()),
            Ends(analysis),
        ]);
        want.extend(vec![Header; 8]);
        want.extend([Body(call.clone()), Ends(call)]);
        assert_eq!(steps, want);
    }
}
