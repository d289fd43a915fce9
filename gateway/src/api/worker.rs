//! Sending a request to a worker: the candidates in order, retried until
//! one produces a first token (or the first-token deadline passes).

use super::*;

/// A worker stream that has produced its first token (or finished).
pub(super) struct Started {
    pub(super) stream: tonic::Streaming<pb::GenerateEvent>,
    pub(super) accepted: pb::Accepted,
    pub(super) first: pb::generate_event::Event,
    pub(super) _in_flight: crate::fleet::InFlight,
}

pub(super) fn retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::Unknown
            | Code::Cancelled
            | Code::ResourceExhausted
            | Code::Internal
            | Code::Aborted
            | Code::DeadlineExceeded
    )
}

pub(super) fn worker_error(status: &tonic::Status) -> ApiError {
    match status.code() {
        Code::InvalidArgument => {
            let mut e = ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "invalid_request",
                status.message().to_owned(),
            );
            e.param = status
                .message()
                .split_once(':')
                .map(|(p, _)| p.trim().to_owned())
                .filter(|p| !p.contains(' '));
            e
        }
        Code::NotFound | Code::FailedPrecondition => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "adapter_unavailable",
            format!(
                "the adapter for this model could not be loaded: {}",
                status.message()
            ),
        ),
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "workers_unavailable",
            format!("no worker could serve the request: {}", status.message()),
        ),
    }
}

/// Tries the candidates in order until one produces a first token.
pub(super) async fn start(
    s: &AppState,
    p: &Prepared,
    trail: &mut Trail,
) -> Result<Started, ApiError> {
    let lora_int_id = p.resolved.adapter.as_ref().map_or(0, |a| a.lora_int_id);
    let base_hash = &p.resolved.route.base_hash;
    let Some(route) = s.fleet.route(lora_int_id, base_hash) else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "no_compatible_worker",
            format!(
                "no worker serving base model {} (base hash {base_hash}) is available; \
                 the request was not sent to any other model",
                p.resolved.route.base_model
            ),
        ));
    };
    let span = tracing::Span::current();
    span.record("route_reason", route.reason.as_str());
    span.record("residency_hit", route.device_hit);
    metrics::counter!("lorafleet_gateway_routing_decisions_total",
        "reason" => route.reason.as_str(),
        "device_hit" => if route.device_hit { "true" } else { "false" })
    .increment(1);
    if lora_int_id != 0 {
        metrics::counter!("lorafleet_gateway_residency_checks_total",
            "tenant" => trail.tenant_name.clone(),
            "adapter" => trail.adapter_label.clone(),
            "hit" => if route.device_hit { "true" } else { "false" })
        .increment(1);
    }
    let mut last: Option<tonic::Status> = None;
    let mut first_token_timeouts = 0usize;
    for worker in route.candidates.iter().take(s.max_attempts) {
        trail.record.attempts += 1;
        let in_flight = s.fleet.track(worker, lora_int_id);
        let worker_id = worker.state().worker_id;
        span.record("worker", worker_id.as_str());
        trail.record.worker_id = Some(worker_id.clone());
        let mut client = worker.client.clone();
        let outcome = async {
            let mut stream = client.generate(p.request.clone()).await?.into_inner();
            let mut accepted = pb::Accepted::default();
            loop {
                match stream.message().await? {
                    Some(pb::GenerateEvent { event: Some(event) }) => match event {
                        pb::generate_event::Event::Accepted(a) => accepted = a,
                        first => return Ok((stream, accepted, first)),
                    },
                    Some(_) => {}
                    None => {
                        return Err(tonic::Status::unavailable(
                            "the worker closed the stream before the first token",
                        ));
                    }
                }
            }
        };
        // A worker that accepts and never answers is skipped like one that
        // fails: the next candidate gets the request.
        let outcome = match tokio::time::timeout(s.first_token_timeout, outcome).await {
            Ok(o) => o,
            Err(_) => {
                first_token_timeouts += 1;
                Err(tonic::Status::deadline_exceeded(format!(
                    "no first token within {} s",
                    s.first_token_timeout.as_secs()
                )))
            }
        };
        match outcome {
            Ok((stream, accepted, first)) => {
                return Ok(Started {
                    stream,
                    accepted,
                    first,
                    _in_flight: in_flight,
                });
            }
            Err(status) if retryable(status.code()) => {
                tracing::warn!(worker = %worker_id, code = ?status.code(), message = status.message(), "attempt failed before the first token; trying the next worker");
                metrics::counter!("lorafleet_gateway_retries_total").increment(1);
                last = Some(status);
            }
            Err(status) => return Err(worker_error(&status)),
        }
    }
    if first_token_timeouts > 0 && first_token_timeouts == trail.record.attempts as usize {
        return Err(ApiError::new(
            StatusCode::GATEWAY_TIMEOUT,
            "server_error",
            "first_token_timeout",
            format!(
                "no worker produced a first token within {} s ({} tried)",
                s.first_token_timeout.as_secs(),
                first_token_timeouts
            ),
        ));
    }
    Err(worker_error(&last.unwrap_or_else(|| {
        tonic::Status::unavailable("no candidate worker")
    })))
}

pub(super) fn residency_label(r: pb::Residency) -> Option<&'static str> {
    match r {
        pb::Residency::Device => Some("device"),
        pb::Residency::Host => Some("host"),
        pb::Residency::NotLoaded => Some("not_loaded"),
        pb::Residency::Loading => Some("loading"),
        _ => None,
    }
}
