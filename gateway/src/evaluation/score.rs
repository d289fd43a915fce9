//! Scoring an item from what the model answered, as lm-evaluation-harness
//! scores it, and the gate a candidate's score must pass. Pure functions:
//! the runner gathers the model's numbers, this module judges them.

use serde::{Deserialize, Serialize};

use super::set::{Match, regex_of};

/// lm-evaluation-harness's split of a multiple-choice request: white space
/// that ends the prompt moves to the start of the continuation (so the
/// choice's first token carries it, as tokenizers that mark a word's
/// leading space expect).
pub fn split<'a>(prompt: &'a str, choice: &str) -> (&'a str, String) {
    let context = prompt.trim_end();
    let moved = &prompt[context.len()..];
    (context, format!("{moved}{choice}"))
}

/// The context's token count for a chat prompt, as lm-evaluation-harness
/// splits it: white space that ends the rendered chat (the assistant
/// header's newline, say) moves to the continuation, so the context is the
/// rendered chat's tokens but those that are white space alone at its end.
/// `tokens` are the bytes of each token of the rendered chat. A token that
/// holds both the end of the text and white space after it cannot be split
/// so, and is refused.
pub fn chat_context_tokens(tokens: &[&[u8]]) -> Result<usize, Unscorable> {
    let blank = |t: &[u8]| !t.is_empty() && t.iter().all(u8::is_ascii_whitespace);
    let mut n = tokens.len();
    while n > 0 && blank(tokens[n - 1]) {
        n -= 1;
    }
    if n > 0 && tokens[n - 1].last().is_some_and(u8::is_ascii_whitespace) {
        return Err(Unscorable::WhitespaceInToken(n - 1));
    }
    Ok(n)
}

/// The continuation's loglikelihood: the sum of the log probabilities of
/// the whole text's tokens after the first `context_tokens` (the number of
/// tokens the context alone is), as lm-evaluation-harness slices the
/// whole's tokens by the context's count.
pub fn loglikelihood(context_tokens: usize, whole: &[Option<f32>]) -> Result<f64, Unscorable> {
    if context_tokens == 0 {
        return Err(Unscorable::NoContext);
    }
    if context_tokens >= whole.len() {
        return Err(Unscorable::NoContinuation {
            tokens: whole.len(),
            context_tokens,
        });
    }
    whole[context_tokens..]
        .iter()
        .enumerate()
        .map(|(i, lp)| {
            lp.map(f64::from)
                .ok_or(Unscorable::NoLogprob(context_tokens + i))
        })
        .sum()
}

/// Why a choice cannot be scored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unscorable {
    #[error("the context has no token")]
    NoContext,
    #[error(
        "the continuation has no token of its own ({tokens} tokens in all, {context_tokens} of context)"
    )]
    NoContinuation {
        tokens: usize,
        context_tokens: usize,
    },
    #[error("token {0} has no log probability")]
    NoLogprob(usize),
    #[error(
        "token {0} of the rendered chat ends in white space after text: the context cannot be split there"
    )]
    WhitespaceInToken(usize),
}

/// The most likely choice: the first of equals, as `numpy.argmax` picks.
pub fn choose(loglikelihoods: &[f64]) -> usize {
    let mut best = 0;
    for (i, &ll) in loglikelihoods.iter().enumerate() {
        if ll > loglikelihoods[best] {
            best = i;
        }
    }
    best
}

/// Does a generation item's answer match what it expects?
pub fn matches(expected: &str, matching: Match, answer: &str) -> bool {
    match matching {
        Match::Exact => answer.trim() == expected.trim(),
        // The pattern was compiled when the set was registered.
        Match::Regex => regex_of(expected).is_ok_and(|r| r.is_match(answer)),
    }
}

/// What one version did on one item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Outcome {
    Choice {
        /// Each choice's loglikelihood, in the item's order.
        loglikelihoods: Vec<f64>,
        chosen: usize,
        correct: bool,
    },
    Generate {
        /// The greedy answer.
        answer: String,
        correct: bool,
    },
    /// The version could not answer the item (its adapter could not be
    /// loaded, the worker refused the request): wrong.
    Failed { code: String, message: String },
}

impl Outcome {
    pub fn correct(&self) -> bool {
        match self {
            Outcome::Choice { correct, .. } | Outcome::Generate { correct, .. } => *correct,
            Outcome::Failed { .. } => false,
        }
    }
}

/// A version's score: the fraction of items it got right.
pub fn score(correct: usize, items: usize) -> f64 {
    if items == 0 {
        0.0
    } else {
        correct as f64 / items as f64
    }
}

/// Does the candidate pass: its score at least the stable's plus
/// `min_delta` (negative: it may be that much worse)? Scores are
/// fractions of items, so they are compared in whole items to keep
/// floating point from deciding a tie.
pub fn passes(candidate: f64, stable: f64, min_delta: f64, items: usize) -> bool {
    let n = items as f64;
    let (c, s) = ((candidate * n).round(), (stable * n).round());
    // 1e-9 of an item: the delta itself is a fraction a person typed.
    c + 1e-9 >= s + min_delta * n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trailing_space_moves_to_the_continuation() {
        assert_eq!(split("Q: a ", "b"), ("Q: a", " b".to_owned()));
        assert_eq!(split("Q: a", " b"), ("Q: a", " b".to_owned()));
        assert_eq!(split("Q:\n\n", "b"), ("Q:", "\n\nb".to_owned()));
    }

    #[test]
    fn the_continuation_is_the_tokens_past_the_contexts_count() {
        let whole = [None, Some(-1.0), Some(-2.0), Some(-0.5)];
        assert_eq!(loglikelihood(2, &whole), Ok(-2.5));
        assert_eq!(loglikelihood(1, &whole), Ok(-3.5));
        assert!(matches!(
            loglikelihood(4, &whole),
            Err(Unscorable::NoContinuation { .. })
        ));
        assert!(loglikelihood(0, &whole).is_err());
        assert!(loglikelihood(0, &[None, Some(-1.0)]).is_err());
    }

    #[test]
    fn a_chat_context_ends_before_its_trailing_white_space() {
        let t: [&[u8]; 4] = [b"<s>", b"<|im_start|>", b"assistant", b"\n"];
        assert_eq!(chat_context_tokens(&t), Ok(3));
        assert_eq!(chat_context_tokens(&t[..3]), Ok(3));
        let merged: [&[u8]; 2] = [b"<s>", b"assistant\n"];
        assert_eq!(
            chat_context_tokens(&merged),
            Err(Unscorable::WhitespaceInToken(1))
        );
        let two: [&[u8]; 3] = [b"x", b"\n", b" "];
        assert_eq!(chat_context_tokens(&two), Ok(1));
    }

    #[test]
    fn the_first_of_equal_choices_wins_and_matching_trims() {
        assert_eq!(choose(&[-3.0, -1.0, -1.0]), 1);
        assert_eq!(choose(&[-1.0, -2.0]), 0);
        assert!(matches("GOD", Match::Exact, " GOD\n"));
        assert!(!matches("GOD", Match::Exact, "GOD SAID"));
        assert!(matches("^[A-Z ]+$", Match::Regex, "LET THERE BE"));
        assert!(!matches("^[A-Z ]+$", Match::Regex, "let there be"));
    }

    #[test]
    fn the_gate_compares_whole_items() {
        // 7/10 against 7/10 with a delta of -0.01: passes (a tie).
        assert!(passes(0.7, 0.7, -0.01, 10));
        // A delta of 0 passes a tie, not one item worse.
        assert!(passes(0.7, 0.7, 0.0, 10));
        assert!(!passes(0.6, 0.7, 0.0, 10));
        // A delta of -0.1 over 10 items allows one item worse, not two.
        assert!(passes(0.6, 0.7, -0.1, 10));
        assert!(!passes(0.5, 0.7, -0.1, 10));
        // A positive delta asks for an improvement.
        assert!(!passes(0.7, 0.7, 0.05, 10));
        assert!(passes(0.8, 0.7, 0.05, 10));
        // Thirds, which floating point does not hold exactly.
        assert!(passes(1.0 / 3.0, 1.0 / 3.0, 0.0, 3));
        assert_eq!(score(2, 3), 2.0 / 3.0);
        assert_eq!(score(0, 0), 0.0);
    }
}
