#![no_main]
//! A request's structured-output constraint as the worker compiles it:
//! the first byte picks the kind (JSON schema, regular expression, Lark
//! grammar, choices), the rest is its source. What compiles is then
//! stepped: a mask, and tokens taken from the input, several times over.
//! A refusal is an answer; a panic is a bug.

use std::sync::{Arc, OnceLock};

use lorafleet_engine::constraint::{Compiler, Constraint};
use lorafleet_engine::model::tokenizer::Tokenizer;

fn compiler() -> &'static Compiler {
    static COMPILER: OnceLock<Compiler> = OnceLock::new();
    COMPILER.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../worker/engine/tests/fixtures/tokenizer");
        let tokenizer = Tokenizer::from_dir(&dir).expect("the fixture tokenizer loads");
        let vocab = tokenizer.vocab_size();
        Compiler::new(Arc::new(tokenizer), vocab, 2)
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let constraint = match kind % 5 {
        0 => Constraint::JsonSchema(text.into()),
        1 => Constraint::Regex(text.into()),
        2 => Constraint::Grammar(text.into()),
        3 => Constraint::Choice(text.split('\n').map(String::from).collect()),
        _ => Constraint::JsonObject,
    };
    // As a request's constraint reaches the compiler: checked with its
    // sampling first (its size, a choice list's strings).
    let sampling = lorafleet_engine::Sampling {
        constraint: Some(constraint),
        ..Default::default()
    };
    let Ok(sampling) = sampling.validate() else {
        return;
    };
    let Some(constraint) = &sampling.constraint else {
        return;
    };
    let compiler = compiler();
    let Ok(mut grammar) = compiler.compile(constraint) else {
        return;
    };
    // Tokens from the input's bytes, in pairs.
    for pair in rest.chunks(2).take(8) {
        if grammar.allowed().is_err() {
            return;
        }
        let token = pair.iter().fold(0u32, |t, &b| t << 8 | u32::from(b));
        match grammar.advance(token % 32_000) {
            Ok(true) | Err(_) => return,
            Ok(false) => {}
        }
    }
});
