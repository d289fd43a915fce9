#![no_main]
//! A request's structured-output constraint as the worker compiles it:
//! the first byte picks the kind (JSON schema, regular expression, Lark
//! grammar, choices, a tool call) and the model's form (plain, or bound to
//! a harmony message), the rest is its source. What compiles is then
//! stepped: a mask, and tokens taken from the input, several times over.
//! A refusal is an answer; a panic is a bug.

use std::sync::{Arc, OnceLock};

use lorafleet_engine::constraint::{Compiler, Constraint};
use lorafleet_engine::model::tokenizer::Tokenizer;

/// The compiler of the fixture tokenizer's model, or (`harmony`) of the
/// harmony fixture's, whose constraints bind one message of an answer.
fn compiler(harmony: bool) -> &'static Compiler {
    static PLAIN: OnceLock<Compiler> = OnceLock::new();
    static HARMONY: OnceLock<Compiler> = OnceLock::new();
    let (cell, fixture) = match harmony {
        false => (&PLAIN, "tokenizer"),
        true => (&HARMONY, "gpt-oss-harmony"),
    };
    cell.get_or_init(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../worker/engine/tests/fixtures")
            .join(fixture);
        let tokenizer = Tokenizer::from_dir(&dir).expect("the fixture tokenizer loads");
        let vocab = tokenizer.vocab_size();
        Compiler::new(Arc::new(tokenizer), vocab, 2, harmony)
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let Ok(text) = std::str::from_utf8(rest) else {
        return;
    };
    let constraint = match kind % 6 {
        0 => Constraint::JsonSchema(text.into()),
        1 => Constraint::Regex(text.into()),
        2 => Constraint::Grammar(text.into()),
        3 => Constraint::Choice(text.split('\n').map(String::from).collect()),
        4 => {
            // A function's name on the first line, its parameters after.
            let (name, parameters) = text.split_once('\n').unwrap_or((text, "{}"));
            Constraint::ToolCall(lorafleet_engine::ToolCall {
                functions: vec![lorafleet_engine::ToolFunction {
                    name: name.into(),
                    parameters: parameters.into(),
                }],
                parallel: kind & 0x40 != 0,
            })
        }
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
    let compiler = compiler(kind & 0x80 != 0);
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
