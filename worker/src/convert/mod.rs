//! The one place where `lorafleet.worker.v1` wire messages become engine
//! types and back, and where a [`Refusal`] becomes a gRPC status. Every
//! refusal names the proto field it concerns.

use std::time::{Duration, SystemTime};

use lorafleet_domain::RequestId;
use lorafleet_domain::digest::Sha256Hex;
use lorafleet_domain::generation::{
    Choices, GenerationSpec, ReasoningEffort, ToolCall, ToolFunction,
};
use lorafleet_engine::AdapterId;
use lorafleet_engine::artifact::ArtifactError;
use lorafleet_engine::logprobs::TokenLogprob;
use lorafleet_engine::lora::AdapterError;
use lorafleet_engine::model::harmony::Channel;
use lorafleet_engine::pool::AdapterStatus;
use lorafleet_engine::{ChatMessage, ChatPrompt, MessagePart, Role};
use lorafleet_engine::{
    Constraint, EngineError, Fairness, Field, Finish, FinishReason, Prompt, Prompter, Residency,
    Sampling, StopReason, Valid,
};
use lorafleet_proto::refusal::{ERROR_DOMAIN, Reason};
use lorafleet_proto::worker::v1 as pb;
use tonic::{Code, Status};

use crate::info::{BaseModel, Capacity, WorkerInfo};
use crate::refusal::Refusal;

/// The longest request id accepted.
pub const MAX_REQUEST_ID: usize = 128;

/// A checked adapter descriptor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Descriptor {
    pub lora_int_id: AdapterId,
    pub artifact_uri: String,
    pub artifact_sha256: Sha256Hex,
    pub base_hash: Sha256Hex,
    pub rank: usize,
    pub display_name: String,
    /// What the artifact held at registration (bytes, files), if the
    /// registry recorded it: a fetch refuses more.
    pub artifact_size: Option<(u64, u32)>,
}

/// A wire `lora_int_id`: refused by `field` unless positive.
pub fn adapter_id(id: u64, field: &str) -> Result<AdapterId, Refusal> {
    AdapterId::new(id).ok_or_else(|| Refusal::descriptor(field, "must be positive"))
}

/// Checks a descriptor; `field` is its path in the request, such as "adapter".
pub fn descriptor(d: &pb::AdapterDescriptor, field: &str) -> Result<Descriptor, Refusal> {
    let lora_int_id = adapter_id(d.lora_int_id, &format!("{field}.lora_int_id"))?;
    if d.artifact_uri.is_empty() {
        return Err(Refusal::descriptor(
            format!("{field}.artifact_uri"),
            "is required",
        ));
    }
    let digest = |value: &str, name: &str| {
        Sha256Hex::parse(value).ok_or_else(|| {
            Refusal::descriptor(format!("{field}.{name}"), "must be 64 hexadecimal digits")
        })
    };
    let artifact_sha256 = digest(&d.artifact_sha256, "artifact_sha256")?;
    let base_hash = digest(&d.base_hash, "base_hash")?;
    if d.rank == 0 {
        return Err(Refusal::descriptor(
            format!("{field}.rank"),
            "must be positive",
        ));
    }
    let artifact_size = match (d.artifact_bytes, d.artifact_files) {
        (0, 0) => None,
        (_, 0) => {
            return Err(Refusal::descriptor(
                format!("{field}.artifact_files"),
                "must be positive when artifact_bytes is set",
            ));
        }
        (bytes, files) => Some((bytes, files)),
    };
    Ok(Descriptor {
        lora_int_id,
        artifact_uri: d.artifact_uri.clone(),
        artifact_sha256,
        base_hash,
        rank: d.rank as usize,
        display_name: if d.display_name.is_empty() {
            format!("lora-{}", d.lora_int_id)
        } else {
            d.display_name.clone()
        },
        artifact_size,
    })
}

/// The request's fair share: its key and weight, refused by field.
pub fn fairness(r: &pb::GenerateRequest) -> Result<Fairness, Refusal> {
    if r.fairness_key.len() > MAX_REQUEST_ID {
        return Err(Refusal::field(
            Field::FairnessKey,
            format!("is longer than {MAX_REQUEST_ID} bytes"),
        ));
    }
    let weight = match r.fairness_weight {
        0.0 => 1.0,
        w if w.is_finite() && w > 0.0 => w,
        w => {
            return Err(Refusal::field(
                Field::FairnessWeight,
                format!("{w} is not a positive number"),
            ));
        }
    };
    Ok(Fairness {
        key: r.fairness_key.clone().into(),
        weight,
    })
}

/// The request id and the checked generation of a Generate request (one
/// choice).
pub fn generate_request(
    r: &pb::GenerateRequest,
) -> Result<(RequestId, Valid<GenerationSpec>), Refusal> {
    if r.request_id.is_empty() {
        return Err(Refusal::field(Field::RequestId, "is required"));
    }
    if r.request_id.len() > MAX_REQUEST_ID {
        return Err(Refusal::field(
            Field::RequestId,
            format!("is longer than {MAX_REQUEST_ID} bytes"),
        ));
    }
    let prompt = match &r.prompt {
        None => {
            return Err(Refusal::field(
                Field::Prompt,
                "one of text, token_ids or chat is required",
            ));
        }
        Some(pb::generate_request::Prompt::Text(t)) => Prompt::Text(t.clone()),
        Some(pb::generate_request::Prompt::TokenIds(ids)) => Prompt::TokenIds(ids.ids.clone()),
        Some(pb::generate_request::Prompt::Chat(chat)) => {
            // The JSON the template reads is checked here, at the edge; the
            // engine's prompter parses it again as it renders.
            let json = |text: &str, field: Field| -> Result<Option<String>, Refusal> {
                if text.is_empty() {
                    return Ok(None);
                }
                lorafleet_engine::prompter::json_array(text, field)?;
                Ok(Some(text.to_owned()))
            };
            let mut messages = Vec::with_capacity(chat.messages.len());
            for (i, m) in chat.messages.iter().enumerate() {
                let field = |part| Field::Message { index: i, part };
                let role = Role::parse(&m.role).ok_or_else(|| {
                    Refusal::field(
                        field(MessagePart::Role),
                        format!("{:?} is not system, user, assistant or tool", m.role),
                    )
                })?;
                messages.push(ChatMessage {
                    role,
                    content: m.content.clone(),
                    tool_calls_json: json(&m.tool_calls_json, field(MessagePart::ToolCalls))?,
                    tool_call_id: Some(m.tool_call_id.clone()).filter(|s| !s.is_empty()),
                    name: Some(m.name.clone()).filter(|s| !s.is_empty()),
                    reasoning: Some(m.reasoning.clone()).filter(|s| !s.is_empty()),
                });
            }
            Prompt::Chat(ChatPrompt {
                messages,
                add_generation_prompt: chat.add_generation_prompt,
                tools_json: json(&chat.tools_json, Field::Tools)?,
                template_kwargs_json: match chat.template_kwargs_json.as_str() {
                    "" => None,
                    text => {
                        lorafleet_engine::prompter::template_kwargs(text)?;
                        Some(text.to_owned())
                    }
                },
                continuation: Some(chat.continuation.clone()).filter(|c| !c.is_empty()),
                reasoning_effort: match chat.reasoning_effort.as_str() {
                    "" => None,
                    word => Some(ReasoningEffort::parse(word).ok_or_else(|| {
                        Refusal::field(
                            Field::ReasoningEffort,
                            format!("{word:?} is not low, medium or high"),
                        )
                    })?),
                },
            })
        }
    };
    let s = r
        .sampling
        .as_ref()
        .ok_or_else(|| Refusal::field(Field::Sampling, "is required"))?;
    let sampling = Sampling {
        max_tokens: s.max_tokens as usize,
        temperature: s.temperature.unwrap_or(1.0),
        top_p: s.top_p.unwrap_or(1.0),
        top_k: s.top_k as usize,
        min_p: s.min_p,
        seed: s.seed,
        stop: s.stop.clone(),
        stop_token_ids: s.stop_token_ids.clone(),
        ignore_eos: s.ignore_eos,
        logprobs: s.logprobs.map(|n| n as usize),
        prompt_logprobs: s.prompt_logprobs.map(|n| n as usize),
        // In token order, so a request's controls do not depend on the
        // map's order on the wire.
        logit_bias: s
            .logit_bias
            .iter()
            .map(|(&id, &bias)| (id, bias))
            .collect::<std::collections::BTreeMap<u32, f32>>()
            .into_iter()
            .collect(),
        min_tokens: s.min_tokens as usize,
        repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
        frequency_penalty: s.frequency_penalty,
        presence_penalty: s.presence_penalty,
        constraint: s.constraint.as_ref().and_then(|c| {
            use pb::sampling_params::Constraint as C;
            Some(match c {
                C::JsonSchema(schema) => Constraint::JsonSchema(schema.clone()),
                C::JsonObject(true) => Constraint::JsonObject,
                C::JsonObject(false) => return None,
                C::Regex(r) => Constraint::Regex(r.clone()),
                C::Choice(list) => Constraint::Choice(list.choices.clone()),
                C::Grammar(g) => Constraint::Grammar(g.clone()),
                C::ToolCall(t) => Constraint::ToolCall(ToolCall {
                    functions: t
                        .functions
                        .iter()
                        .map(|f| ToolFunction {
                            name: f.name.clone(),
                            parameters: f.parameters_json.clone(),
                        })
                        .collect(),
                    parallel: t.parallel,
                }),
            })
        }),
    };
    let spec = GenerationSpec {
        prompt,
        sampling,
        choices: Choices::ONE,
    }
    .validate()?;
    Ok((RequestId::new(r.request_id.as_str()), spec))
}

pub fn residency(r: Residency) -> pb::Residency {
    match r {
        Residency::Device => pb::Residency::Device,
        Residency::Host => pb::Residency::Host,
        Residency::Loading => pb::Residency::Loading,
        Residency::NotLoaded => pb::Residency::NotLoaded,
    }
}

pub fn duration(d: Duration) -> prost_types::Duration {
    prost_types::Duration {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

pub fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

pub fn finished(f: &Finish) -> pb::Finished {
    pb::Finished {
        finish_reason: match f.reason {
            FinishReason::Stop => pb::FinishReason::Stop,
            FinishReason::Length => pb::FinishReason::Length,
        } as i32,
        stop_reason: f.stop.as_ref().map(|s| match s {
            StopReason::Token(t) => pb::finished::StopReason::StopTokenId(*t),
            StopReason::String(s) => pb::finished::StopReason::StopString(s.clone()),
        }),
        usage: Some(pb::Usage {
            prompt_tokens: f.prompt_tokens as u32,
            completion_tokens: f.completion_tokens as u32,
            cached_prompt_tokens: f.cached_tokens as u32,
        }),
        queue_time: Some(duration(f.queue_time)),
        time_to_first_token: Some(duration(f.time_to_first_token)),
        total_time: Some(duration(f.total_time)),
        adapter_residency: f.residency.map_or(pb::Residency::Unspecified, residency) as i32,
        preemptions: f.preemptions,
        device_time: Some(duration(f.device_time)),
        load_time: Some(duration(f.load_time)),
    }
}

/// An adapter in the pool, as reported. `sha256` is the digest the worker
/// verified for it.
pub fn adapter_state(a: &AdapterStatus, sha256: &str, epoch: SystemTime) -> pb::AdapterState {
    pb::AdapterState {
        lora_int_id: a.id.get(),
        artifact_sha256: sha256.to_owned(),
        rank: a.rank as u32,
        residency: residency(a.residency) as i32,
        pinned: a.pinned,
        active_requests: a.active,
        queued_requests: a.queued,
        // The pool keeps a logical clock; the report carries the time of
        // the report for every adapter touched since the previous one.
        last_used: Some(timestamp(epoch)),
        display_name: a.name.clone(),
    }
}

/// The gRPC status for a refusal: the one exhaustive mapping to a code, a
/// reason code ([`Reason`], in `ErrorInfo`) and the field at fault (in
/// `BadRequest`). The message stays for people and logs.
///
/// A status never says what the caller could not know: an artifact's
/// actual digest or a path on this machine go to the log only, so an error
/// is no oracle for the files.
pub fn status(r: &Refusal) -> Status {
    let (code, reason, field, message) = parts(r);
    use lorafleet_proto::tonic_types::{ErrorDetails, StatusExt};
    let mut details = ErrorDetails::new();
    details.set_error_info(
        reason.as_str(),
        ERROR_DOMAIN,
        std::collections::HashMap::new(),
    );
    if let Some(field) = field {
        details.add_bad_request_violation(field, message.clone());
    }
    Status::with_error_details(code, message, details)
}

impl From<Refusal> for Status {
    fn from(r: Refusal) -> Status {
        status(&r)
    }
}

type Parts = (Code, Reason, Option<String>, String);

fn parts(r: &Refusal) -> Parts {
    use Code::*;
    let text = r.to_string();
    match r {
        Refusal::Request(invalid) => (
            InvalidArgument,
            Reason::InvalidField,
            Some(invalid.field.wire_path()),
            text,
        ),
        Refusal::InvalidField { field, .. } => (
            InvalidArgument,
            Reason::InvalidField,
            Some((*field).to_owned()),
            text,
        ),
        Refusal::InvalidDescriptor { field, .. } => (
            InvalidArgument,
            Reason::DescriptorInvalid,
            Some(field.clone()),
            text,
        ),
        Refusal::Draining => (Unavailable, Reason::Draining, None, text),
        Refusal::AdapterIdReused { .. } => (
            FailedPrecondition,
            Reason::AdapterIdReused,
            Some("adapter.lora_int_id".into()),
            text,
        ),
        Refusal::BaseHashMismatch { .. } => (
            FailedPrecondition,
            Reason::AdapterBaseHashMismatch,
            Some("adapter.base_hash".into()),
            text,
        ),
        Refusal::RankTooLarge { .. } => (
            InvalidArgument,
            Reason::AdapterRankTooLarge,
            Some("adapter.rank".into()),
            text,
        ),
        Refusal::RankMismatch { .. } => (
            InvalidArgument,
            Reason::AdapterRankMismatch,
            Some("adapter.rank".into()),
            text,
        ),
        Refusal::LoadTimeout { .. } => (DeadlineExceeded, Reason::AdapterLoadTimeout, None, text),
        Refusal::Artifact(e) => artifact_parts(e),
        Refusal::Engine(e) => engine_parts(e),
        Refusal::TaskFailed { .. } => {
            tracing::error!(error = %r, "worker task failed");
            (Internal, Reason::Internal, None, text)
        }
    }
}

fn artifact_parts(e: &ArtifactError) -> Parts {
    let uri = || Some("adapter.artifact_uri".to_owned());
    match e {
        ArtifactError::InvalidUri { .. } | ArtifactError::OutsideRoots { .. } => (
            Code::InvalidArgument,
            Reason::ArtifactUriInvalid,
            uri(),
            format!("adapter.artifact_uri: {e}"),
        ),
        ArtifactError::NotFound { .. } => (
            Code::NotFound,
            Reason::ArtifactNotFound,
            uri(),
            format!("adapter.artifact_uri: {e}"),
        ),
        ArtifactError::Unreadable { .. } => {
            tracing::warn!(error = %e, "adapter artifact unreadable");
            (
                Code::FailedPrecondition,
                Reason::ArtifactUnreadable,
                uri(),
                "adapter.artifact_uri: the artifact cannot be read".into(),
            )
        }
        ArtifactError::StoreUnavailable { .. } => (
            Code::Unavailable,
            Reason::ArtifactStoreUnavailable,
            uri(),
            format!("adapter.artifact_uri: {e}"),
        ),
        ArtifactError::TooLarge { .. } => (
            Code::FailedPrecondition,
            Reason::ArtifactTooLarge,
            uri(),
            format!("adapter.artifact_uri: {e}"),
        ),
        ArtifactError::DigestMismatch { .. } => {
            tracing::warn!(error = %e, "adapter artifact digest mismatch");
            (
                Code::FailedPrecondition,
                Reason::ArtifactDigestMismatch,
                Some("adapter.artifact_sha256".into()),
                "adapter.artifact_sha256: the artifact's files do not match the registered digest"
                    .into(),
            )
        }
    }
}

fn engine_parts(e: &EngineError) -> Parts {
    use Code::*;
    match e {
        EngineError::InvalidRequest { field, .. } => (
            InvalidArgument,
            Reason::InvalidField,
            Some(field.wire_path()),
            e.to_string(),
        ),
        EngineError::ContextLength {
            prompt_tokens,
            max_model_len,
            ..
        } => (
            InvalidArgument,
            Reason::ContextLengthExceeded,
            Some(lorafleet_engine::context_field(*prompt_tokens, *max_model_len).wire_path()),
            e.to_string(),
        ),
        EngineError::QueueFull { .. } => {
            (ResourceExhausted, Reason::QueueFull, None, e.to_string())
        }
        EngineError::PinLimit { .. } => (ResourceExhausted, Reason::PinLimit, None, e.to_string()),
        EngineError::Adapter(a) => match a {
            AdapterError::RankTooLarge { .. } => (
                InvalidArgument,
                Reason::AdapterRankTooLarge,
                Some("adapter.rank".into()),
                format!("adapter.rank: {a}"),
            ),
            AdapterError::BaseHashMismatch { .. } => (
                FailedPrecondition,
                Reason::AdapterBaseHashMismatch,
                Some("adapter.base_hash".into()),
                format!("adapter.base_hash: {a}"),
            ),
            AdapterError::Unsupported { .. } => (
                FailedPrecondition,
                Reason::AdapterUnsupported,
                None,
                a.to_string(),
            ),
            AdapterError::Invalid { .. } | AdapterError::InvalidTensor { .. } => (
                FailedPrecondition,
                Reason::AdapterInvalid,
                None,
                a.to_string(),
            ),
            AdapterError::Io { adapter, .. } => {
                // The path and the OS error go to the log only.
                tracing::warn!(error = %a, "adapter file unreadable");
                (
                    FailedPrecondition,
                    Reason::ArtifactUnreadable,
                    None,
                    format!("adapter {adapter}: a file of the artifact cannot be read"),
                )
            }
        },
        EngineError::Tokenizer(_) | EngineError::ChatTemplate(_) => {
            (InvalidArgument, Reason::PromptInvalid, None, e.to_string())
        }
        EngineError::Io { .. }
        | EngineError::InvalidModel { .. }
        | EngineError::InvalidSetting { .. }
        | EngineError::Backend(_) => {
            tracing::error!(error = %e, "engine failure");
            (
                Internal,
                Reason::Internal,
                None,
                "the worker failed; see its log".into(),
            )
        }
    }
}

fn base_model(b: &BaseModel) -> pb::BaseModel {
    pb::BaseModel {
        name: b.name.clone(),
        base_hash: b.base_hash.to_string(),
        architecture: b.architecture.clone(),
        max_model_len: b.max_model_len,
        vocab_size: b.vocab_size,
        quantization: b.quantization.clone(),
        weights_bytes: b.weights_bytes,
    }
}

fn capacity(c: &Capacity) -> pb::Capacity {
    pb::Capacity {
        max_loras: c.max_loras,
        max_lora_rank: c.max_lora_rank,
        device_slots: c.device_slots,
        host_slots: c.host_slots,
        kv_blocks_total: c.kv_blocks_total,
        kv_block_size: c.kv_block_size,
        max_waiting: c.max_waiting,
    }
}

/// One Watch report: who this worker is, its load, its adapters.
pub fn report(
    info: &WorkerInfo,
    r: &crate::runtime::Report,
    status: pb::ServingStatus,
    adapters: Vec<pb::AdapterState>,
) -> pb::WorkerReport {
    let c = r.stats.pool;
    pb::WorkerReport {
        worker_id: info.worker_id.clone(),
        sequence: r.sequence,
        produced_at: Some(timestamp(r.produced_at)),
        status: status as i32,
        base_model: Some(base_model(&info.base_model)),
        capacity: Some(capacity(&info.capacity)),
        load: Some(pb::Load {
            running_sequences: r.stats.running as u32,
            waiting_sequences: r.stats.waiting as u32,
            kv_blocks_used: r.stats.kv_blocks_used as u32,
        }),
        adapters,
        counters: Some(pb::PoolCounters {
            device_hits: c.device_hits,
            host_hits: c.host_hits,
            host_loads: c.host_loads,
            device_loads: c.device_loads,
            device_evictions: c.device_evictions,
            host_evictions: c.host_evictions,
        }),
        instance_id: info.instance_id.clone(),
    }
}

/// The first event of a generation: the request was taken.
pub fn accepted_event(
    prompt_tokens: usize,
    residency_at_arrival: Option<Residency>,
) -> pb::GenerateEvent {
    pb::GenerateEvent {
        event: Some(pb::generate_event::Event::Accepted(pb::Accepted {
            prompt_tokens: prompt_tokens as u32,
            adapter_residency: residency_at_arrival.map_or(pb::Residency::Unspecified, residency)
                as i32,
        })),
    }
}

/// New tokens, with their log probabilities when asked; `prompter` gives
/// each token's bytes.
pub fn delta_event(
    token_ids: Vec<u32>,
    text: String,
    logprobs: &[TokenLogprob],
    channel: Option<Channel>,
    (device_time, load_time): (Duration, Duration),
    prompter: &Prompter,
) -> pb::GenerateEvent {
    pb::GenerateEvent {
        event: Some(pb::generate_event::Event::Delta(pb::TokenDelta {
            token_ids,
            text,
            logprobs: logprobs
                .iter()
                .map(|l| token_logprob(l, prompter))
                .collect(),
            channel: channel.map(|c| pb::HarmonyChannel {
                channel: c.channel,
                recipient: c.recipient.unwrap_or_default(),
                content_type: c.content_type.unwrap_or_default(),
            }),
            device_time: Some(duration(device_time)),
            load_time: Some(duration(load_time)),
        })),
    }
}

/// Prompt tokens' log probabilities.
pub fn prompt_logprobs_event(scored: &[TokenLogprob], prompter: &Prompter) -> pb::GenerateEvent {
    pb::GenerateEvent {
        event: Some(pb::generate_event::Event::PromptLogprobs(
            pb::PromptLogprobs {
                logprobs: scored.iter().map(|l| token_logprob(l, prompter)).collect(),
            },
        )),
    }
}

fn token_logprob(l: &TokenLogprob, prompter: &Prompter) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: l.token,
        logprob: l.logprob,
        token: prompter.token_bytes(l.token).to_vec(),
        top: l
            .top
            .iter()
            .map(|&(id, logprob)| pb::TopLogprob {
                token_id: id,
                logprob,
                token: prompter.token_bytes(id).to_vec(),
            })
            .collect(),
    }
}

pub fn finished_event(f: &Finish) -> pb::GenerateEvent {
    pb::GenerateEvent {
        event: Some(pb::generate_event::Event::Finished(finished(f))),
    }
}

pub fn load_response(
    adapter: Option<pb::AdapterState>,
    previous: Residency,
    load_time: Duration,
) -> pb::LoadAdapterResponse {
    pb::LoadAdapterResponse {
        adapter,
        previous_residency: residency(previous) as i32,
        load_time: Some(duration(load_time)),
    }
}

pub fn unload_response(previous: Residency, draining_requests: u32) -> pb::UnloadAdapterResponse {
    pb::UnloadAdapterResponse {
        previous_residency: residency(previous) as i32,
        draining_requests,
    }
}

pub fn list_response(adapters: Vec<pb::AdapterState>) -> pb::ListAdaptersResponse {
    pb::ListAdaptersResponse { adapters }
}

pub fn info_response(info: &WorkerInfo, status: pb::ServingStatus) -> pb::InfoResponse {
    pb::InfoResponse {
        worker_id: info.worker_id.clone(),
        instance_id: info.instance_id.clone(),
        base_model: Some(base_model(&info.base_model)),
        capacity: Some(capacity(&info.capacity)),
        backend: info.backend.clone(),
        device_name: info.device_name.clone(),
        version: env!("CARGO_PKG_VERSION").into(),
        artifact_schemes: vec!["file".into()],
        status: status as i32,
        memory_plan: info.memory_plan.map(|p| pb::MemoryPlan {
            weights_bytes: p.weights,
            kv_cache_bytes: p.kv_cache,
            adapter_slots_bytes: p.adapter_slots,
            workspace_bytes: p.workspace,
            margin_bytes: p.margin,
            device_total_bytes: p.device_total,
        }),
    }
}

#[cfg(test)]
mod tests;
