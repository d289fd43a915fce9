//! The workers as the gateway sees them. This module is the only gateway
//! code that knows the wire format (`lorafleet.worker.v1`): the rest of the
//! gateway speaks the domain types below, and `convert.rs` is the one place
//! they become wire messages and back.
//!
//! - [`Generation`]: what the gateway asks a worker to generate;
//! - [`WorkerEvent`]: what a generation streams back;
//! - [`Report`]: what a worker's Watch stream says about it;
//! - [`WorkerClient`]: one worker's connection (mutual TLS or plain text);
//! - [`UpstreamError`]: a failed call, saying whether a retry elsewhere is
//!   safe.

mod client;
mod convert;

use std::collections::HashMap;

use lorafleet_domain::digest::Sha256Hex;
use lorafleet_proto::refusal::Reason;

pub use client::{Events, Reports, Transport, WorkerClient};
pub use lorafleet_domain::generation::{
    Channel, ChatMessage, ChatPrompt, Choices, Constraint, GenerationSpec, MAX_CHOICES, Prompt,
    ReasoningEffort, Role, Sampling, TEMPLATE_NAMES, ToolCall, ToolFunction, Valid,
};
pub use lorafleet_domain::{AdapterId, FairnessKey, RequestId, Residency, WorkerId};

/// An adapter a generation uses, as the registry describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterRef {
    pub lora_int_id: AdapterId,
    pub artifact_uri: String,
    pub artifact_sha256: Sha256Hex,
    pub base_hash: Sha256Hex,
    pub rank: u32,
    /// `name@version`, for the worker's logs.
    pub display_name: String,
    /// What the artifact held at registration (bytes, files), if recorded.
    pub artifact_size: Option<(u64, u32)>,
}

/// One token at one position: its log probability and the most likely
/// tokens there.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token_id: u32,
    /// None only for a prompt's first token.
    pub logprob: Option<f32>,
    /// The bytes the token stands for; not always valid UTF-8.
    pub bytes: Vec<u8>,
    /// Most likely first.
    pub top: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub token_id: u32,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// What the gateway asks one worker to generate.
#[derive(Debug, Clone)]
pub struct Generation {
    pub request_id: RequestId,
    /// None: the base model.
    pub adapter: Option<AdapterRef>,
    /// One choice of a request checked at the gateway's edge
    /// ([`Valid::choice`]).
    pub spec: Valid<GenerationSpec>,
    /// W3C trace context, continued by the worker.
    pub traceparent: String,
    pub tracestate: String,
    /// Whose share of the worker the request uses (the tenant), and its
    /// weight.
    pub fairness_key: FairnessKey,
    pub fairness_weight: f64,
}

/// Why a generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End of sequence, a stop token or a stop string.
    Stop,
    /// `max_tokens`, or the model's context.
    Length,
}

/// The worker took the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Accepted {
    pub prompt_tokens: u32,
    pub residency: Option<Residency>,
}

/// The end of a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finished {
    pub reason: FinishReason,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Of the prompt tokens, those the worker's prefix cache served.
    pub cached_prompt_tokens: u32,
    /// The worker's forward-pass time this choice used (its share of each
    /// step it ran in).
    pub device_time: std::time::Duration,
    /// The copies of its adapter into a device slot charged to it.
    pub load_time: std::time::Duration,
}

/// One event of a generation's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerEvent {
    Accepted(Accepted),
    /// Prompt tokens' log probabilities, in position order from the first.
    PromptLogprobs(Vec<TokenLogprob>),
    /// New tokens; `logprobs` has one entry per token when asked.
    Delta {
        token_ids: Vec<u32>,
        text: String,
        logprobs: Vec<TokenLogprob>,
        /// A harmony model's answer: the message the text belongs to.
        channel: Option<Channel>,
        /// The choice's device and adapter-load time so far (zero from a
        /// worker that sends none).
        device_time: std::time::Duration,
        load_time: std::time::Duration,
    },
    Finished(Finished),
}

/// One worker's state, from its Watch stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub worker_id: WorkerId,
    pub serving: bool,
    /// Draining: running streams finish, new requests are refused.
    pub draining: bool,
    /// The base model's name as the worker was configured with it.
    pub base_name: String,
    /// None where the worker reported none, or something that is not a
    /// SHA-256: such a worker serves no base a route names.
    pub base_hash: Option<Sha256Hex>,
    /// The longest sequence (prompt plus completion) the worker accepts.
    pub max_model_len: u32,
    /// How the base's weights are quantized; empty for a dense base.
    pub quantization: String,
    /// Bytes the base's weights take in the worker's backend.
    pub weights_bytes: u64,
    /// Running plus waiting sequences.
    pub load: u32,
    /// KV cache blocks in use, and in all.
    pub kv_blocks_used: u32,
    pub kv_blocks_total: u32,
    pub adapters: HashMap<AdapterId, Residency>,
}

/// What went wrong with a call to a worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UpstreamErrorKind {
    /// The worker refused the request itself; `field` names the field at
    /// fault when the worker said which.
    InvalidRequest {
        field: Option<lorafleet_domain::generation::Field>,
    },
    /// The adapter could not be loaded there (missing, changed, refused).
    AdapterUnavailable,
    /// The worker is overloaded, draining, unreachable or failed; another
    /// worker may serve the request.
    Unavailable,
    /// No first token within the deadline.
    FirstTokenTimeout,
    /// The worker failed in a way another worker would too.
    Failed,
}

/// A failed call to a worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct UpstreamError {
    pub kind: UpstreamErrorKind,
    /// The worker's stable reason code, when it gave one this build knows.
    pub reason: Option<Reason>,
    /// The worker's message (or ours, for failures before it answered).
    pub message: String,
    /// The message with every underlying cause (a TLS refusal sits a few
    /// causes below "transport error"), for the gateway's own logs.
    pub detail: String,
}

impl UpstreamError {
    pub fn unavailable(message: impl Into<String>) -> UpstreamError {
        let message = message.into();
        UpstreamError {
            kind: UpstreamErrorKind::Unavailable,
            reason: None,
            detail: message.clone(),
            message,
        }
    }

    pub fn first_token_timeout(message: impl Into<String>) -> UpstreamError {
        let message = message.into();
        UpstreamError {
            kind: UpstreamErrorKind::FirstTokenTimeout,
            reason: None,
            detail: message.clone(),
            message,
        }
    }

    /// The stable code of the failure, for logs and tenants' messages:
    /// the worker's reason, or what the gateway saw itself.
    /// The worker found the prompt plus `max_tokens` over its context.
    pub fn context_exceeded(&self) -> bool {
        self.reason == Some(Reason::ContextLengthExceeded)
    }

    pub fn reason_code(&self) -> &'static str {
        match (self.reason, &self.kind) {
            (Some(r), _) => r.as_str(),
            (None, UpstreamErrorKind::FirstTokenTimeout) => "first_token_timeout",
            (None, _) => "unspecified",
        }
    }

    /// Whether the same request may go to another worker: only failures of
    /// the worker, never a refusal of the request itself.
    pub fn retry_elsewhere(&self) -> bool {
        matches!(
            self.kind,
            UpstreamErrorKind::Unavailable | UpstreamErrorKind::FirstTokenTimeout
        )
    }
}
