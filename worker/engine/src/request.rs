//! What goes into the engine (a request, its prompt and fairness) and
//! what comes out (events, the acceptance, a whole completion).

use lorafleet_domain::{FairnessKey, RequestId};

use crate::error::EngineError;
use crate::logprobs::TokenLogprob;
use crate::pool::{AdapterId, Residency};
use crate::sampling::Sampling;
use crate::sequence::Finish;
pub use lorafleet_domain::generation::{ChatMessage, ChatPrompt, Prompt, Role};
use lorafleet_domain::generation::{GenerationSpec, Valid};

/// Whose share of the engine a request uses: a key (the tenant) and the
/// key's weight. Waiting requests are admitted from the key with the least
/// weighted service so far (see [`crate::scheduler`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Fairness {
    pub key: FairnessKey,
    /// Positive; a key of weight 2 gets twice the tokens of one of weight 1
    /// when both wait.
    pub weight: f64,
}

impl Default for Fairness {
    fn default() -> Fairness {
        Fairness {
            key: FairnessKey::default(),
            weight: 1.0,
        }
    }
}

/// A request to the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Unique among the engine's live requests.
    pub id: RequestId,
    /// None for the base model.
    pub adapter: Option<AdapterId>,
    pub prompt: Prompt,
    /// Checked where the request entered the process.
    pub params: Valid<Sampling>,
}

impl Request {
    /// The request for one choice of a checked generation (its prompt and
    /// sampling); a request for several choices runs each as its own
    /// request ([`Valid::choice`]).
    pub fn new(id: RequestId, adapter: Option<AdapterId>, spec: Valid<GenerationSpec>) -> Request {
        let (prompt, params) = spec.into_parts();
        Request {
            id,
            adapter,
            prompt,
            params,
        }
    }
}

/// What a request produced, streamed out of [`Engine::step`](crate::Engine::step).
#[derive(Debug)]
pub enum Event {
    /// Log probabilities of prompt tokens, in position order from the
    /// first (whose `logprob` is None); only for requests with
    /// `prompt_logprobs`, before their first `Delta`. A long prompt's come
    /// in several events, one per prefill chunk.
    PromptLogprobs(Vec<TokenLogprob>),
    /// New tokens and the text they complete; `logprobs` holds one entry
    /// per token when the request asked for log probabilities.
    Delta {
        token_ids: Vec<u32>,
        text: String,
        logprobs: Vec<TokenLogprob>,
        /// A harmony model's answer: the message `text` belongs to. None
        /// for other models, and while a message's header is read.
        channel: Option<crate::model::harmony::Channel>,
        /// The request's device time and adapter-load time so far (what
        /// its `Finished` will report, up to this step), so that a request
        /// that is cancelled still accounts for what it used.
        device_time: std::time::Duration,
        load_time: std::time::Duration,
    },
    /// The request completed.
    Finished(Finish),
    /// The request failed after it was accepted (for example, its adapter
    /// could not be loaded). No further events follow.
    Failed(EngineError),
}

/// What [`Engine::submit`](crate::Engine::submit) tells the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Accepted {
    pub prompt_tokens: usize,
    /// Where the adapter was on arrival; None for the base model.
    pub residency: Option<Residency>,
}

/// One request's whole output, as collected by [`Engine::run_to_completion`](crate::Engine::run_to_completion).
#[derive(Debug)]
pub struct Completion {
    pub request_id: RequestId,
    pub prompt_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    /// Set when the request completed.
    pub finish: Option<Finish>,
    /// Set when the request was refused or failed.
    pub error: Option<EngineError>,
    /// One per completion token, with `logprobs`.
    pub logprobs: Vec<TokenLogprob>,
    /// One per prompt token, with `prompt_logprobs`.
    pub prompt_logprobs: Vec<TokenLogprob>,
}
