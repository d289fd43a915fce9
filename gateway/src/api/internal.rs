//! Requests the gateway makes itself (a rollout's evaluation): they travel
//! as a tenant's do from the route on (the router, the pre-first-token
//! retries, the first-token and request deadlines, the worker), under the
//! route's tenant, and each writes its audit row, durable before the
//! answer is used, with its `features` saying what it was. They take none
//! of the tenant's rate limits or concurrency slots, and on the worker
//! they are a fairness key of their own with a small weight, so a
//! tenant's request waiting there is always admitted first.

use super::params::Endpoint;
use super::*;
use crate::audit::{AuditStatus, micros};
use crate::registry::{Adapter, Route};
use crate::upstream::{Finished, TokenLogprob};

/// One request the gateway makes on its own behalf.
#[derive(Debug, Clone)]
pub struct InternalCall {
    /// The route it is made under: its tenant and base model.
    pub route: Arc<Route>,
    /// The version it pins, whatever the route's weights say.
    pub adapter: Arc<Adapter>,
    /// One choice, checked.
    pub spec: upstream::Valid<upstream::GenerationSpec>,
    /// Who makes it, for the row's `subject`.
    pub subject: String,
    /// The row's `features`, in `api::features`' order.
    pub features: String,
    /// Its share of the worker (see the module's note).
    pub fairness_key: upstream::FairnessKey,
    pub fairness_weight: f64,
}

/// What a worker answered to an [`InternalCall`].
#[derive(Debug, Clone)]
pub struct InternalAnswer {
    /// The prompt's tokens with their log probabilities, when asked.
    pub prompt_logprobs: Vec<TokenLogprob>,
    pub text: String,
    pub finished: Finished,
    /// The row's key.
    pub request_id: Uuid,
}

/// Sends `call` to the fleet and reads its whole answer; the answer comes
/// back only once its audit row is durable.
pub async fn generate(s: &AppState, call: InternalCall) -> Result<InternalAnswer, ApiError> {
    let request_id = Uuid::now_v7();
    let ticket = s.audit.admit().map_err(audit_unavailable)?;
    let mut trail = Trail::new(request_id, ticket, s.tenant_series.clone());
    let tenant = s.registry.snapshot().tenant(&call.route.tenant_id).cloned();
    trail.record.tenant_id = Some(call.route.tenant_id);
    trail.tenant_name = tenant.map_or_else(String::new, |t| t.name);
    trail.record.subject = Some(call.subject.clone());
    trail.record.features = call.features.clone();
    trail.record.model_name = call.route.model_name.clone();
    let resolved = Resolved {
        route: call.route.clone(),
        adapter: Some(call.adapter.clone()),
    };
    trail.resolved(&resolved);
    let request = Generation {
        request_id: crate::upstream::RequestId::new(request_id.to_string()),
        adapter: adapter_ref(&resolved),
        spec: call.spec,
        traceparent: String::new(),
        tracestate: String::new(),
        fairness_key: call.fairness_key,
        fairness_weight: call.fairness_weight,
    };
    let endpoint = Endpoint::of(&request.spec.prompt);
    let answered = tokio::time::timeout(s.request_timeout, async {
        let started = start(s, &resolved, &request, endpoint, &mut trail).await?;
        trail.record.ttft_us = Some(trail.started.elapsed().as_micros() as i64);
        trail.record.prompt_tokens = started.accepted.prompt_tokens as i32;
        trail.record.adapter_residency = started
            .accepted
            .residency
            .map(upstream::Residency::label)
            .map(str::to_owned);
        read_all(started, request_id, endpoint).await
    })
    .await
    .unwrap_or(Err(ApiError::RequestTimeout {
        after: s.request_timeout,
    }));
    match answered {
        Ok(answer) => {
            let f = answer.finished;
            trail.record.prompt_tokens = f.prompt_tokens as i32;
            trail.record.cached_tokens = f.cached_prompt_tokens as i32;
            trail.record.completion_tokens = f.completion_tokens as i32;
            trail.record.device_us = Some(micros(f.device_time));
            trail.record.load_us = Some(micros(f.load_time));
            trail.record.finish_reason = Some(
                match f.reason {
                    upstream::FinishReason::Stop => "stop",
                    upstream::FinishReason::Length => "length",
                }
                .into(),
            );
            if durable(trail.close(AuditStatus::Ok, StatusCode::OK, None)).await {
                Ok(answer)
            } else {
                Err(row_not_durable())
            }
        }
        Err(e) => {
            let Parts { status, code, .. } = e.parts();
            durable(trail.close(AuditStatus::Error, status, Some(code))).await;
            Err(e)
        }
    }
}

/// The rest of a started stream: the prompt's log probabilities, the
/// text, the end.
async fn read_all(
    started: worker::Started,
    request_id: Uuid,
    endpoint: Endpoint,
) -> Result<InternalAnswer, ApiError> {
    let worker::Started {
        mut stream, first, ..
    } = started;
    let mut answer = InternalAnswer {
        prompt_logprobs: Vec::new(),
        text: String::new(),
        finished: Finished {
            reason: upstream::FinishReason::Stop,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_prompt_tokens: 0,
            device_time: std::time::Duration::ZERO,
            load_time: std::time::Duration::ZERO,
        },
        request_id,
    };
    let mut next = Some(first);
    loop {
        match next.take() {
            Some(WorkerEvent::PromptLogprobs(p)) => answer.prompt_logprobs.extend(p),
            Some(WorkerEvent::Delta { text, channel, .. }) => {
                // A harmony answer's text is its content, as a tenant's
                // (its reasoning and calls are not).
                if channel
                    .as_ref()
                    .is_none_or(|c| super::harmony::part(c) == super::harmony::Part::Content)
                {
                    answer.text.push_str(&text);
                }
            }
            Some(WorkerEvent::Finished(f)) => {
                answer.finished = f;
                return Ok(answer);
            }
            Some(WorkerEvent::Accepted(_)) | None => {}
        }
        next = match stream.next().await {
            Ok(Some(e)) => Some(e),
            Ok(None) => {
                return Err(worker_error(
                    &UpstreamError::unavailable("the worker closed the stream before the end"),
                    endpoint,
                ));
            }
            Err(e) => return Err(worker_error(&e, endpoint)),
        };
    }
}
