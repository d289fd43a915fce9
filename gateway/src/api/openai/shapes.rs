//! The request fields whose JSON may take several shapes, read straight
//! from the body's bytes. Nothing is buffered into an intermediate
//! `serde_json::Value` (or serde's private untagged buffer), so a body costs
//! about its own size in memory whatever it holds, and fields the gateway
//! only checks for presence are skipped without being kept.

use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// `prompt`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, PartialEq)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

/// What `prompt` must be, in every error about it.
pub const PROMPT_EXPECTED: &str = "a string, an array of one string, or token ids";

/// One element of a `prompt` array.
enum PromptItem {
    Text(String),
    Token(u32),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string, a token id or a list of token ids")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(s))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<PromptItem, E> {
                u32::try_from(n)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom(format!("token id {n} is out of range")))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<PromptItem, A::Error> {
                Vec::<u32>::deserialize(de::value::SeqAccessDeserializer::new(seq))
                    .map(PromptItem::Tokens)
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for PromptInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = PromptInput;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(PROMPT_EXPECTED)
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<PromptInput, E> {
                Ok(PromptInput::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<PromptInput, E> {
                Ok(PromptInput::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PromptInput, A::Error> {
                let mixed = || de::Error::custom("mixes strings, token ids and lists");
                let mut out = PromptInput::Tokens(Vec::new());
                while let Some(item) = seq.next_element::<PromptItem>()? {
                    match (&mut out, item) {
                        (PromptInput::Tokens(v), PromptItem::Token(t)) => v.push(t),
                        (PromptInput::Texts(v), PromptItem::Text(t)) => v.push(t),
                        (PromptInput::TokenLists(v), PromptItem::Tokens(t)) => v.push(t),
                        // The first element decides the shape.
                        (PromptInput::Tokens(v), first) if v.is_empty() => {
                            out = match first {
                                PromptItem::Text(t) => PromptInput::Texts(vec![t]),
                                PromptItem::Tokens(t) => PromptInput::TokenLists(vec![t]),
                                PromptItem::Token(t) => PromptInput::Tokens(vec![t]),
                            };
                        }
                        _ => return Err(mixed()),
                    }
                }
                Ok(out)
            }
        }
        d.deserialize_any(V)
    }
}

/// `stop`: one string or several.
#[derive(Debug, PartialEq)]
pub enum StopInput {
    One(String),
    Many(Vec<String>),
}

impl<'de> Deserialize<'de> for StopInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StopInput;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of strings")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<StopInput, E> {
                Ok(StopInput::One(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<StopInput, E> {
                Ok(StopInput::One(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<StopInput, A::Error> {
                Vec::<String>::deserialize(de::value::SeqAccessDeserializer::new(seq))
                    .map(StopInput::Many)
            }
        }
        d.deserialize_any(V)
    }
}

/// A chat message's `content`: text, or typed parts.
#[derive(Debug)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or an array of content parts")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Content, E> {
                Ok(Content::Text(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Content, E> {
                Ok(Content::Text(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Content, A::Error> {
                Vec::<ContentPart>::deserialize(de::value::SeqAccessDeserializer::new(seq))
                    .map(Content::Parts)
            }
        }
        d.deserialize_any(V)
    }
}

/// A field of a refused body, as text for its audit row: a string as it
/// is, a scalar as its JSON, and an array or object by its kind alone.
#[derive(Debug)]
pub struct Echo(pub String);

impl<'de> Deserialize<'de> for Echo {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Echo;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Echo, E> {
                Ok(Echo("null".into()))
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<Echo, E> {
                Ok(Echo(b.to_string()))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<Echo, E> {
                Ok(Echo(n.to_string()))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<Echo, E> {
                Ok(Echo(n.to_string()))
            }
            fn visit_f64<E: de::Error>(self, n: f64) -> Result<Echo, E> {
                Ok(Echo(n.to_string()))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Echo, E> {
                Ok(Echo(s.to_owned()))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Echo, E> {
                Ok(Echo(s))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Echo, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Echo("[array]".into()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Echo, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Echo("{object}".into()))
            }
        }
        d.deserialize_any(V)
    }
}

/// `logprobs`: a count on /v1/completions (the legacy API), a switch on
/// chat; each endpoint refuses the other's shape by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsInput {
    Switch(bool),
    Count(i64),
}

impl<'de> Deserialize<'de> for LogprobsInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = LogprobsInput;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a boolean or an integer")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> Result<LogprobsInput, E> {
                Ok(LogprobsInput::Switch(b))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<LogprobsInput, E> {
                Ok(LogprobsInput::Count(n))
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<LogprobsInput, E> {
                Ok(LogprobsInput::Count(i64::try_from(n).unwrap_or(i64::MAX)))
            }
        }
        d.deserialize_any(V)
    }
}
