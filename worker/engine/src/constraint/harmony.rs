//! A constraint bound to a harmony answer (GPT-OSS), where it means one
//! message's body, not the whole output: the answer may first think (an
//! `analysis` message, free text), then writes the message the constraint
//! is about, markers and header as the format spells them. A content
//! constraint (JSON, a regular expression, a choice, a Lark grammar) is
//! the body of the `final` message, ended by `<|return|>` (a client's Lark
//! grammar is a grammar of its own there, referenced from the answer's, so
//! its rules and lexer never meet the answer's); a tool call is a `commentary`
//! message to `functions.NAME` whose body, `<|constrain|>json`, matches the
//! function's parameters, ended by `<|call|>`.

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use lorafleet_domain::generation::{Constraint, ToolCall};
use serde_json::Value;

use super::{json_layout, lark_choices, lark_string};
use crate::error::{EngineError, Result};

/// The name the answer's grammar gives a client's own.
const CLIENT_GRAMMAR: &str = "client";

/// The grammar of `c` in a harmony answer: the answer's, in Lark
/// (llguidance's dialect, special tokens by name), and a client's Lark
/// grammar beside it.
pub(super) fn grammar(c: &Constraint) -> Result<TopLevelGrammar> {
    let answer = GrammarWithLexer::from_lark(answer(c)?);
    let grammars = match c {
        Constraint::Grammar(g) => vec![
            answer,
            GrammarWithLexer {
                name: Some(CLIENT_GRAMMAR.into()),
                ..GrammarWithLexer::from_lark(g.clone())
            },
        ],
        _ => vec![answer],
    };
    Ok(TopLevelGrammar {
        grammars,
        max_tokens: None,
    })
}

/// The answer's Lark grammar.
fn answer(c: &Constraint) -> Result<String> {
    let refuse = |why: String| EngineError::request(c.field(), why);
    let json = |schema: Value| format!("%json {}", json_layout(schema));
    let final_body = |body: String| {
        format!("answer: <|channel|> \"final\" <|message|> body <|return|>\nbody: {body}\n")
    };
    let answer = match c {
        Constraint::JsonObject => final_body(json(serde_json::json!({"type": "object"}))),
        Constraint::JsonSchema(s) => {
            let schema: Value =
                serde_json::from_str(s).map_err(|e| refuse(format!("is not valid JSON: {e}")))?;
            final_body(json(schema))
        }
        Constraint::Regex(r) => final_body(format!("/{}/", llguidance::regex_to_lark(r, ""))),
        Constraint::Choice(choices) => final_body(lark_choices(choices)),
        Constraint::ToolCall(t) => calls(t, &refuse)?,
        Constraint::Grammar(_) => final_body(format!("@{CLIENT_GRAMMAR}")),
    };
    Ok(format!(
        "start: analysis? answer\n\
         analysis: <|channel|> \"analysis\" <|message|> THOUGHT <|end|> <|start|> \"assistant\"\n\
         THOUGHT: /(.|\\n)*/\n{answer}"
    ))
}

/// One call message, to any of the allowed functions (harmony's turn ends
/// at its first call, so `parallel` allows no more).
fn calls(t: &ToolCall, refuse: &dyn Fn(String) -> EngineError) -> Result<String> {
    let mut rules = Vec::with_capacity(t.functions.len() + 1);
    let mut names = Vec::with_capacity(t.functions.len());
    for (i, f) in t.functions.iter().enumerate() {
        let parameters: Value = serde_json::from_str(&f.parameters)
            .map_err(|e| refuse(format!("function {:?}: parameters: {e}", f.name)))?;
        let header = lark_string(&format!("commentary to=functions.{} ", f.name));
        rules.push(format!(
            "call_{i}: <|channel|> {header} <|constrain|> \"json\" <|message|> args_{i} <|call|>\n\
             args_{i}: %json {}\n",
            json_layout(parameters)
        ));
        names.push(format!("call_{i}"));
    }
    Ok(format!("answer: {}\n{}", names.join(" | "), rules.concat()))
}
