//! The one place where the gateway's domain types become wire messages and
//! wire messages become domain types.

use lorafleet_domain::generation::Field;
use lorafleet_proto::refusal::{ERROR_DOMAIN, Reason};
use lorafleet_proto::worker::v1 as pb;
use tonic::Code;

use super::*;

impl From<&Generation> for pb::GenerateRequest {
    fn from(g: &Generation) -> pb::GenerateRequest {
        pb::GenerateRequest {
            request_id: g.request_id.as_str().to_owned(),
            adapter: g.adapter.as_ref().map(|a| pb::AdapterDescriptor {
                lora_int_id: a.lora_int_id.get(),
                artifact_uri: a.artifact_uri.clone(),
                artifact_sha256: a.artifact_sha256.to_string(),
                base_hash: a.base_hash.to_string(),
                rank: a.rank,
                display_name: a.display_name.clone(),
                artifact_bytes: a.artifact_size.map_or(0, |(b, _)| b),
                artifact_files: a.artifact_size.map_or(0, |(_, f)| f),
            }),
            prompt: Some(match &g.spec.prompt {
                Prompt::Text(t) => pb::generate_request::Prompt::Text(t.clone()),
                Prompt::TokenIds(ids) => {
                    pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: ids.clone() })
                }
                Prompt::Chat(chat) => pb::generate_request::Prompt::Chat(pb::ChatPrompt {
                    messages: chat
                        .messages
                        .iter()
                        .map(|m| pb::ChatMessage {
                            role: m.role.as_str().to_owned(),
                            content: m.content.clone(),
                            tool_calls_json: m.tool_calls_json.clone().unwrap_or_default(),
                            tool_call_id: m.tool_call_id.clone().unwrap_or_default(),
                            name: m.name.clone().unwrap_or_default(),
                            reasoning: m.reasoning.clone().unwrap_or_default(),
                        })
                        .collect(),
                    add_generation_prompt: chat.add_generation_prompt,
                    tools_json: chat.tools_json.clone().unwrap_or_default(),
                    template_kwargs_json: chat.template_kwargs_json.clone().unwrap_or_default(),
                    continuation: chat.continuation.clone().unwrap_or_default(),
                    reasoning_effort: chat
                        .reasoning_effort
                        .map_or("", ReasoningEffort::as_str)
                        .to_owned(),
                }),
            }),
            sampling: Some(pb::SamplingParams {
                max_tokens: wire_u32(g.spec.sampling.max_tokens),
                temperature: Some(g.spec.sampling.temperature),
                top_p: Some(g.spec.sampling.top_p),
                top_k: wire_u32(g.spec.sampling.top_k),
                min_p: g.spec.sampling.min_p,
                seed: g.spec.sampling.seed,
                stop: g.spec.sampling.stop.clone(),
                stop_token_ids: g.spec.sampling.stop_token_ids.clone(),
                ignore_eos: g.spec.sampling.ignore_eos,
                logprobs: g.spec.sampling.logprobs.map(wire_u32),
                prompt_logprobs: g.spec.sampling.prompt_logprobs.map(wire_u32),
                logit_bias: g.spec.sampling.logit_bias.iter().copied().collect(),
                min_tokens: wire_u32(g.spec.sampling.min_tokens),
                repetition_penalty: Some(g.spec.sampling.repetition_penalty).filter(|&p| p != 1.0),
                frequency_penalty: g.spec.sampling.frequency_penalty,
                presence_penalty: g.spec.sampling.presence_penalty,
                constraint: g.spec.sampling.constraint.as_ref().map(|c| {
                    use pb::sampling_params::Constraint as C;
                    match c {
                        Constraint::JsonObject => C::JsonObject(true),
                        Constraint::JsonSchema(s) => C::JsonSchema(s.clone()),
                        Constraint::Regex(r) => C::Regex(r.clone()),
                        Constraint::Choice(c) => C::Choice(pb::Choices { choices: c.clone() }),
                        Constraint::Grammar(g) => C::Grammar(g.clone()),
                        Constraint::ToolCall(t) => C::ToolCall(pb::ToolCallConstraint {
                            functions: t
                                .functions
                                .iter()
                                .map(|f| pb::ToolFunction {
                                    name: f.name.clone(),
                                    parameters_json: f.parameters.clone(),
                                })
                                .collect(),
                            parallel: t.parallel,
                        }),
                    }
                }),
            }),
            trace_context: Some(pb::TraceContext {
                traceparent: g.traceparent.clone(),
                tracestate: g.tracestate.clone(),
            }),
            fairness_key: g.fairness_key.to_string(),
            fairness_weight: g.fairness_weight,
        }
    }
}

/// None for a residency this gateway does not know (an older or newer
/// worker's).
pub(super) fn residency(r: pb::Residency) -> Option<Residency> {
    match r {
        pb::Residency::Device => Some(Residency::Device),
        pb::Residency::Host => Some(Residency::Host),
        pb::Residency::Loading => Some(Residency::Loading),
        pb::Residency::NotLoaded => Some(Residency::NotLoaded),
        pb::Residency::Unspecified => None,
    }
}

/// An event, or None for one this gateway does not know (skipped).
pub(super) fn event(e: pb::GenerateEvent) -> Option<WorkerEvent> {
    Some(match e.event? {
        pb::generate_event::Event::Accepted(a) => WorkerEvent::Accepted(Accepted {
            prompt_tokens: a.prompt_tokens,
            residency: residency(a.adapter_residency()),
        }),
        pb::generate_event::Event::Delta(d) => WorkerEvent::Delta {
            token_ids: d.token_ids,
            text: d.text,
            logprobs: d.logprobs.into_iter().map(token_logprob).collect(),
            channel: d.channel.map(|c| Channel {
                channel: c.channel,
                recipient: Some(c.recipient).filter(|r| !r.is_empty()),
                content_type: Some(c.content_type).filter(|t| !t.is_empty()),
            }),
            device_time: elapsed(d.device_time),
            load_time: elapsed(d.load_time),
        },
        pb::generate_event::Event::PromptLogprobs(p) => {
            WorkerEvent::PromptLogprobs(p.logprobs.into_iter().map(token_logprob).collect())
        }
        pb::generate_event::Event::Finished(f) => {
            let usage = f.usage.unwrap_or_default();
            WorkerEvent::Finished(Finished {
                reason: match f.finish_reason() {
                    pb::FinishReason::Length => FinishReason::Length,
                    _ => FinishReason::Stop,
                },
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_prompt_tokens: usage.cached_prompt_tokens.min(usage.prompt_tokens),
                device_time: elapsed(f.device_time),
                load_time: elapsed(f.load_time),
            })
        }
    })
}

/// A wire duration; a negative or absent one (an older worker) is zero.
fn elapsed<D>(d: Option<D>) -> std::time::Duration
where
    std::time::Duration: TryFrom<D>,
{
    d.and_then(|d| std::time::Duration::try_from(d).ok())
        .unwrap_or_default()
}

fn token_logprob(l: pb::TokenLogprob) -> TokenLogprob {
    TokenLogprob {
        token_id: l.token_id,
        logprob: l.logprob,
        bytes: l.token,
        top: l
            .top
            .into_iter()
            .map(|t| TopLogprob {
                token_id: t.token_id,
                logprob: t.logprob,
                bytes: t.token,
            })
            .collect(),
    }
}

pub(super) fn report(r: &pb::WorkerReport) -> Report {
    Report {
        worker_id: WorkerId::new(r.worker_id.clone()),
        serving: r.status == pb::ServingStatus::Serving as i32,
        draining: r.status == pb::ServingStatus::Draining as i32,
        base_name: r
            .base_model
            .as_ref()
            .map(|b| b.name.clone())
            .unwrap_or_default(),
        base_hash: r
            .base_model
            .as_ref()
            .and_then(|b| Sha256Hex::parse(&b.base_hash)),
        max_model_len: r.base_model.as_ref().map_or(0, |b| b.max_model_len),
        quantization: r
            .base_model
            .as_ref()
            .map(|b| b.quantization.clone())
            .unwrap_or_default(),
        weights_bytes: r.base_model.as_ref().map_or(0, |b| b.weights_bytes),
        load: r
            .load
            .map_or(0, |l| l.running_sequences + l.waiting_sequences),
        kv_blocks_used: r.load.map_or(0, |l| l.kv_blocks_used),
        kv_blocks_total: r.capacity.map_or(0, |c| c.kv_blocks_total),
        adapters: r
            .adapters
            .iter()
            .filter_map(|a| Some((AdapterId::new(a.lora_int_id)?, residency(a.residency())?)))
            .collect(),
    }
}

/// A worker's status as an [`UpstreamError`]. The worker's reason code
/// (`ErrorInfo`) says what kind of failure it is and the field at fault
/// comes from `BadRequest`; never from the message. A status without a
/// reason this build knows (a transport failure, a newer worker) is judged
/// by its code alone, and a refusal of unknown meaning is never shown to a
/// tenant as a refusal of their own fields.
pub(super) fn status(s: &tonic::Status) -> UpstreamError {
    use lorafleet_proto::tonic_types::StatusExt;
    let reason = s
        .get_details_error_info()
        .filter(|i| i.domain == ERROR_DOMAIN)
        .and_then(|i| {
            let known = Reason::parse(&i.reason);
            if known.is_none() {
                tracing::debug!(reason = %i.reason, "a worker refusal reason this gateway does not know");
            }
            known
        });
    let field = s
        .get_details_bad_request()
        .and_then(|b| b.field_violations.into_iter().next())
        .and_then(|v| Field::from_wire_path(&v.field));
    let kind = match reason {
        Some(r) => kind_of(r, field),
        None => match s.code() {
            Code::NotFound | Code::FailedPrecondition => UpstreamErrorKind::AdapterUnavailable,
            Code::Unavailable
            | Code::Unknown
            | Code::Cancelled
            | Code::ResourceExhausted
            | Code::Internal
            | Code::Aborted
            | Code::DeadlineExceeded => UpstreamErrorKind::Unavailable,
            _ => UpstreamErrorKind::Failed,
        },
    };
    UpstreamError {
        kind,
        reason,
        message: s.message().to_owned(),
        detail: causes(s),
    }
}

/// What a worker's reason code means for the request.
fn kind_of(reason: Reason, field: Option<Field>) -> UpstreamErrorKind {
    match reason {
        // The tenant's own request: their fields, their prompt.
        Reason::InvalidField | Reason::PromptInvalid | Reason::ContextLengthExceeded => {
            UpstreamErrorKind::InvalidRequest { field }
        }
        // The adapter or its artifact, never the tenant's to see in detail.
        Reason::DescriptorInvalid
        | Reason::ArtifactUriInvalid
        | Reason::ArtifactNotFound
        | Reason::ArtifactUnreadable
        | Reason::ArtifactDigestMismatch
        | Reason::ArtifactStoreUnavailable
        | Reason::ArtifactTooLarge
        | Reason::AdapterBaseHashMismatch
        | Reason::AdapterRankTooLarge
        | Reason::AdapterRankMismatch
        | Reason::AdapterIdReused
        | Reason::AdapterUnsupported
        | Reason::AdapterInvalid
        | Reason::AdapterLoadTimeout => UpstreamErrorKind::AdapterUnavailable,
        // This worker, now: another may serve the request.
        Reason::QueueFull | Reason::PinLimit | Reason::Draining | Reason::Internal => {
            UpstreamErrorKind::Unavailable
        }
    }
}

/// An error and its sources, as one line.
fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = s.source();
    }
    out
}

/// A count of the contract (a usize) on the wire (a u32); a valid one
/// fits, and a larger one saturates.
fn wire_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use lorafleet_proto::tonic_types::{ErrorDetails, StatusExt};

    use super::*;

    fn refusal(code: Code, reason: &str, field: Option<&str>) -> tonic::Status {
        let mut d = ErrorDetails::new();
        d.set_error_info(
            reason,
            ERROR_DOMAIN,
            std::collections::HashMap::<String, String>::new(),
        );
        if let Some(f) = field {
            d.add_bad_request_violation(f, "bad");
        }
        tonic::Status::with_error_details(code, "bad", d)
    }

    #[test]
    fn the_reason_code_not_the_field_or_message_decides_what_a_refusal_means() {
        // The tenant's own field keeps its words.
        let e = status(&refusal(
            Code::InvalidArgument,
            "invalid_field",
            Some("prompt"),
        ));
        assert_eq!(
            e.kind,
            UpstreamErrorKind::InvalidRequest {
                field: Some(Field::Prompt)
            }
        );
        // A descriptor field is the adapter's, whatever its name.
        for field in ["adapter.rank", "lora_int_id", "prompt"] {
            let e = status(&refusal(
                Code::InvalidArgument,
                "descriptor_invalid",
                Some(field),
            ));
            assert_eq!(e.kind, UpstreamErrorKind::AdapterUnavailable, "{field}");
            assert_eq!(e.reason_code(), "descriptor_invalid");
        }
        let e = status(&refusal(Code::ResourceExhausted, "queue_full", None));
        assert!(e.retry_elsewhere());
        // A reason this build does not know is never shown as the tenant's
        // own refusal.
        let e = status(&refusal(
            Code::InvalidArgument,
            "from_the_future",
            Some("prompt"),
        ));
        assert_eq!(e.kind, UpstreamErrorKind::Failed);
        assert_eq!(e.reason_code(), "unspecified");
        // Every reason a worker sends means something here.
        for &r in Reason::ALL {
            let e = status(&refusal(Code::InvalidArgument, r.as_str(), None));
            assert_eq!(e.reason, Some(r));
        }
    }
}
