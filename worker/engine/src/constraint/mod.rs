//! Structured outputs: a request's output constrained to a JSON schema, any
//! JSON object, a regular expression, one of a list of strings, or a Lark
//! grammar, with llguidance (the library vLLM and SGLang use for this).
//!
//! A constraint is compiled before the request reaches the engine (the
//! worker compiles it on a blocking thread while it tokenizes the prompt;
//! refused there, by field, if it does not compile or is too large); the
//! compiled matcher is kept in a small cache keyed by the constraint's
//! SHA-256, so the engine's own compile at submission, and every other
//! request with the same constraint (the `n` choices of one request), only
//! clones it. At each step its token mask removes every token the grammar
//! cannot take next, after the other sampling controls and before the
//! draw. Log probabilities are the model's own, taken before the mask. A
//! request without a constraint pays nothing.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};

use crate::error::{EngineError, Result};
use crate::model::tokenizer::Tokenizer;

mod harmony;

pub use lorafleet_domain::generation::{Constraint, MAX_CONSTRAINT_BYTES};
use lorafleet_domain::generation::{Field, ToolCall};

/// The llguidance grammar of a constraint. Its size and a choice list's
/// strings were checked with the request's sampling
/// ([`lorafleet_domain::generation::Sampling::validate`]).
fn grammar(c: &Constraint) -> Result<TopLevelGrammar> {
    let refuse = |why: String| EngineError::request(c.field(), why);
    Ok(match c {
        Constraint::JsonObject => {
            TopLevelGrammar::from_json_schema(json_layout(serde_json::json!({"type": "object"})))
        }
        Constraint::JsonSchema(s) => {
            let schema: serde_json::Value =
                serde_json::from_str(s).map_err(|e| refuse(format!("is not valid JSON: {e}")))?;
            TopLevelGrammar::from_json_schema(json_layout(schema))
        }
        Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
        Constraint::Choice(choices) => {
            TopLevelGrammar::from_lark(format!("start: {}", lark_choices(choices)))
        }
        Constraint::Grammar(g) => TopLevelGrammar::from_lark(g.clone()),
        Constraint::ToolCall(t) => TopLevelGrammar::from_json_schema(json_layout(
            tool_call_schema(t)
                .map_err(|(name, e)| refuse(format!("function {name:?}: parameters: {e}")))?,
        )),
    })
}

/// A call as a JSON object, `{"name": ..., "arguments": {...}}`, the
/// arguments matching the function's parameters; any of the functions;
/// an array of one or more calls with `parallel`. Err: the function whose
/// parameters are not JSON.
fn tool_call_schema(t: &ToolCall) -> std::result::Result<serde_json::Value, (String, String)> {
    let mut calls = Vec::with_capacity(t.functions.len());
    for f in &t.functions {
        let parameters: serde_json::Value =
            serde_json::from_str(&f.parameters).map_err(|e| (f.name.clone(), e.to_string()))?;
        calls.push(serde_json::json!({
            "type": "object",
            "properties": {"name": {"const": f.name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        }));
    }
    let one = match calls.len() {
        1 => calls.remove(0),
        _ => serde_json::json!({"anyOf": calls}),
    };
    Ok(if t.parallel {
        serde_json::json!({"type": "array", "items": one, "minItems": 1})
    } else {
        one
    })
}

/// JSON as `json.dumps` lays it out (`", "` and `": "`, no other
/// whitespace) unless the schema sets llguidance's own `x-guidance`
/// options: free whitespace lets a model pad its output until max_tokens.
fn json_layout(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(o) = schema.as_object_mut()
        && !o.contains_key("x-guidance")
    {
        o.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ",
                               "key_separator": ": "}),
        );
    }
    schema
}

/// Where in `schema` (a JSON pointer) the feature llguidance refused with
/// `message` sits: an unimplemented keyword, an unknown `format`, or a
/// `$ref` it cannot follow. None when the message names none of them.
fn place_of(schema: &serde_json::Value, message: &str) -> Option<String> {
    let quoted = |after: &str, open: char, close: char| -> Option<String> {
        let rest = &message[message.find(after)? + after.len()..];
        let start = rest.find(open)? + 1;
        let end = start + rest[start..].find(close)?;
        Some(rest[start..end].to_owned())
    };
    // The key to find, and the value it must hold, if any.
    let (key, value): (String, Option<String>) = if message.contains("Unimplemented keys") {
        (quoted("Unimplemented keys", '"', '"')?, None)
    } else if let Some(rest) = message.split("Unknown format:").nth(1) {
        ("format".into(), Some(rest.trim().to_owned()))
    } else if message.contains("ref '") {
        ("$ref".into(), Some(quoted("ref ", '\'', '\'')?))
    } else {
        return None;
    };
    walk(schema, "", &key, value.as_deref())
}

/// The JSON pointer of the first object in `v` (depth first) holding `key`
/// (with `value`, when given).
fn walk(v: &serde_json::Value, at: &str, key: &str, value: Option<&str>) -> Option<String> {
    use serde_json::Value;
    match v {
        Value::Object(o) => {
            if let Some(found) = o.get(key)
                && value.is_none_or(|want| found.as_str() == Some(want))
            {
                return Some(if at.is_empty() {
                    "/".into()
                } else {
                    at.to_owned()
                });
            }
            o.iter().find_map(|(k, child)| {
                let k = k.replace('~', "~0").replace('/', "~1");
                walk(child, &format!("{at}/{k}"), key, value)
            })
        }
        Value::Array(items) => items
            .iter()
            .enumerate()
            .find_map(|(i, child)| walk(child, &format!("{at}/{i}"), key, value)),
        _ => None,
    }
}

/// A Lark string literal for `s`.
/// Exactly one of `choices`, as a Lark rule's body.
fn lark_choices(choices: &[String]) -> String {
    let alternatives: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
    alternatives.join(" | ")
}

fn lark_string(s: &str) -> String {
    serde_json::to_string(s).expect("a string serializes")
}

/// The model's tokens as llguidance sees them: each token's bytes, special
/// tokens marked so that no grammar produces them as text.
struct Tokens {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Tokens {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false)
            .unwrap_or_default()
    }
}

/// Compiled constraints kept for reuse.
pub const CACHED_CONSTRAINTS: usize = 64;

/// A constraint's cache key: SHA-256 over its kind and its source.
type Key = [u8; 32];

fn key_of(c: &Constraint) -> Key {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    // The kind first: a regular expression and a grammar of the same
    // text are different constraints.
    h.update(match c {
        Constraint::JsonObject => b"object\0",
        Constraint::JsonSchema(_) => b"schema\0",
        Constraint::Regex(_) => b"regexp\0",
        Constraint::Choice(_) => b"choice\0",
        Constraint::Grammar(_) => b"lark--\0",
        Constraint::ToolCall(_) => b"tools-\0",
    });
    match c {
        Constraint::JsonObject => {}
        Constraint::JsonSchema(s) | Constraint::Regex(s) | Constraint::Grammar(s) => {
            h.update(s.as_bytes())
        }
        Constraint::Choice(choices) => {
            for c in choices {
                // Length-prefixed, so ["ab", "c"] and ["a", "bc"] differ.
                h.update((c.len() as u64).to_le_bytes());
                h.update(c.as_bytes());
            }
        }
        Constraint::ToolCall(t) => {
            h.update([u8::from(t.parallel)]);
            for f in &t.functions {
                for part in [&f.name, &f.parameters] {
                    h.update((part.len() as u64).to_le_bytes());
                    h.update(part.as_bytes());
                }
            }
        }
    }
    h.finalize().into()
}

/// Compiled matchers at the start of the output, most recently used last.
#[derive(Default)]
struct Cache {
    entries: VecDeque<(Key, Matcher)>,
    /// Constraints being compiled now: a request with the same one waits
    /// for that compile rather than repeating it (a request's `n` choices
    /// arrive together).
    compiling: std::collections::HashSet<Key>,
    hits: u64,
    compiles: u64,
}

/// Compiles constraints for one model. The token trie and the parser
/// factory are built on the first constrained request. Clones share the
/// factory and the cache.
#[derive(Clone)]
pub struct Compiler {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    eos: u32,
    /// The model answers in harmony (GPT-OSS): a constraint binds one
    /// message's body ([`harmony`]).
    harmony: bool,
    factory: Arc<OnceLock<Result<ParserFactory>>>,
    cache: Arc<Mutex<Cache>>,
    /// Signalled when a compile ends.
    compiled: Arc<Condvar>,
}

/// How often compiles found their constraint compiled already.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CompileCounters {
    pub hits: u64,
    pub compiles: u64,
}

impl std::fmt::Debug for Compiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiler")
            .field("vocab_size", &self.vocab_size)
            .finish_non_exhaustive()
    }
}

impl Compiler {
    /// A compiler for a model; with `harmony`, every constraint binds the
    /// body of one message of a harmony answer.
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: u32, harmony: bool) -> Compiler {
        Compiler {
            tokenizer,
            vocab_size,
            eos,
            harmony,
            factory: Arc::new(OnceLock::new()),
            cache: Arc::default(),
            compiled: Arc::default(),
        }
    }

    pub fn counters(&self) -> CompileCounters {
        let cache = self.cache.lock().expect("the constraint cache's lock");
        CompileCounters {
            hits: cache.hits,
            compiles: cache.compiles,
        }
    }

    fn factory(&self) -> Result<&ParserFactory> {
        self.factory
            .get_or_init(|| {
                let words: Vec<Vec<u8>> = (0..self.vocab_size as u32)
                    .map(|id| {
                        let bytes = self.tokenizer.token_bytes(id);
                        if self.tokenizer.is_special(id) {
                            [&[TokTrie::SPECIAL_TOKEN_MARKER][..], bytes].concat()
                        } else {
                            bytes.to_vec()
                        }
                    })
                    .collect();
                let info = TokRxInfo::new(self.vocab_size as u32, self.eos);
                let env: TokEnv = Arc::new(Tokens {
                    trie: TokTrie::from(&info, &words),
                    tokenizer: self.tokenizer.clone(),
                });
                let mut factory = ParserFactory::new_simple(&env)
                    .map_err(|e| EngineError::Backend(e.to_string()))?;
                factory.quiet();
                Ok(factory)
            })
            .as_ref()
            .map_err(|e| EngineError::Backend(format!("structured outputs: {e}")))
    }

    /// Compiles `c` into a matcher at the start of the output, or clones
    /// the one compiled for the same constraint before, or waits for the
    /// compile of the same constraint under way and clones its result.
    pub fn compile(&self, c: &Constraint) -> Result<Grammar> {
        let key = key_of(c);
        let grammar = |matcher| Grammar {
            matcher,
            field: c.field(),
        };
        {
            let mut cache = self.cache.lock().expect("the constraint cache's lock");
            loop {
                if let Some(at) = cache.entries.iter().position(|(k, _)| *k == key) {
                    let entry = cache.entries.remove(at).expect("found above");
                    let matcher = entry.1.deep_clone();
                    cache.entries.push_back(entry);
                    cache.hits += 1;
                    return Ok(grammar(matcher));
                }
                if cache.compiling.insert(key) {
                    break;
                }
                // The same constraint is being compiled: its result will be
                // in the cache (or, if it failed, this compile goes ahead).
                cache = self
                    .compiled
                    .wait(cache)
                    .expect("the constraint cache's lock");
            }
        }
        // Compiled outside the lock: another constraint's compile never
        // waits for this one.
        let compiled = self.compile_new(c);
        let mut cache = self.cache.lock().expect("the constraint cache's lock");
        cache.compiling.remove(&key);
        if let Ok(matcher) = &compiled {
            cache.compiles += 1;
            if cache.entries.len() == CACHED_CONSTRAINTS {
                cache.entries.pop_front();
            }
            cache.entries.push_back((key, matcher.deep_clone()));
        }
        drop(cache);
        self.compiled.notify_all();
        compiled.map(grammar)
    }

    fn compile_new(&self, c: &Constraint) -> Result<Matcher> {
        let grammar = match self.harmony {
            true => harmony::grammar(c)?,
            false => grammar(c)?,
        };
        let parser = self.factory()?.create_parser(grammar).map_err(|e| {
            let message = e.to_string();
            let message = match c {
                Constraint::JsonSchema(text) => match serde_json::from_str(text)
                    .ok()
                    .and_then(|schema| place_of(&schema, &message))
                {
                    Some(place) => format!("at {place}: {message}"),
                    None => message,
                },
                _ => message,
            };
            EngineError::request(c.field(), message)
        })?;
        let matcher = Matcher::new(Ok(parser));
        // The first mask, on a copy: a grammar too complex to start (too
        // many alternatives at once, say) is refused here, by field, not
        // at its first step.
        let mut probe = matcher.deep_clone();
        probe
            .compute_mask_or_eos()
            .map_err(|e| grammar_error(c.field(), &e.to_string()))?;
        Ok(matcher)
    }
}

/// Why a grammar could not go on, named by the request's field: the
/// parser's own first line (its state dump is for developers).
fn grammar_error(field: Field, message: &str) -> EngineError {
    let first = message.lines().next().unwrap_or(message);
    EngineError::request(field, format!("the constraint cannot be followed: {first}"))
}

/// A compiled constraint following one sequence's output.
pub struct Grammar {
    matcher: Matcher,
    /// The request field it came from, for errors.
    field: Field,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Grammar")
    }
}

impl Grammar {
    /// The tokens the grammar can take next.
    pub fn allowed(&mut self) -> Result<Allowed> {
        self.matcher
            .compute_mask_or_eos()
            .map(Allowed)
            .map_err(|e| grammar_error(self.field, &e.to_string()))
    }

    /// Moves past a drawn token. True once the grammar is complete: the
    /// output must end here.
    pub fn advance(&mut self, token: u32) -> Result<bool> {
        self.matcher
            .consume_token(token)
            .map_err(|e| grammar_error(self.field, &e.to_string()))?;
        Ok(self.matcher.is_stopped())
    }
}

/// The tokens a grammar can take next: a step's token mask.
#[derive(Debug)]
pub struct Allowed(llguidance::toktrie::SimpleVob);

impl Allowed {
    /// Sets every token outside the mask to -inf in `logits`.
    pub fn apply(&self, logits: &mut [f32]) {
        for (id, x) in logits.iter_mut().enumerate() {
            if !self.0.is_allowed(id as TokenId) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}
