//! Sending a request to a worker: the candidates in order, retried until
//! one produces a first token (or the first-token deadline passes).

use super::params::Endpoint;
use super::*;

/// A worker stream that has produced its first token (or finished).
pub(super) struct Started {
    pub(super) stream: upstream::Events,
    pub(super) accepted: upstream::Accepted,
    pub(super) first: WorkerEvent,
    pub(super) _in_flight: crate::router::fleet::InFlight,
    /// Where it runs: a request's other choices go there too.
    pub(super) worker: Arc<crate::router::fleet::Worker>,
}

/// A worker's failure as the tenant sees it ([`WorkerFailure`]); `chat`:
/// the client sent its prompt as `messages`.
pub(super) fn worker_error(e: &UpstreamError, endpoint: Endpoint) -> ApiError {
    ApiError::Worker(WorkerFailure::from_upstream(e, endpoint))
}

/// Tries the candidates in order until one produces a first token.
pub(super) async fn start(
    s: &AppState,
    resolved: &Resolved,
    request: &Generation,
    endpoint: Endpoint,
    trail: &mut Trail,
) -> Result<Started, ApiError> {
    let adapter = resolved.adapter.as_ref().map(|a| a.lora_int_id);
    let base_hash = &resolved.route.base_hash;
    let Some(route) = s.fleet.route(adapter, base_hash) else {
        // The hash is for the operator's log, not the tenant's answer.
        tracing::warn!(%base_hash, base_model = %resolved.route.base_model, "no compatible worker");
        return Err(ApiError::NoCompatibleWorker {
            base_model: resolved.route.base_model.clone(),
        });
    };
    let span = tracing::Span::current();
    span.record("route_reason", route.reason.as_str());
    span.record("residency_hit", route.device_hit);
    metrics::counter!("lorafleet_gateway_routing_decisions_total",
        "reason" => route.reason.as_str(),
        "device_hit" => if route.device_hit { "true" } else { "false" })
    .increment(1);
    if adapter.is_some() {
        let [tenant, adapter] = trail.labels(trail.series.named(&trail.tenant_name));
        let hit = (
            "hit",
            if route.device_hit { "true" } else { "false" }.to_owned(),
        );
        metrics::counter!(
            "lorafleet_gateway_residency_checks_total",
            &[tenant, adapter, hit]
        )
        .increment(1);
    }
    let mut last: Option<UpstreamError> = None;
    let mut first_token_timeouts = 0usize;
    for candidate in route.candidates.iter().take(s.max_attempts) {
        let worker = &candidate.worker;
        trail.record.attempts += 1;
        let in_flight = s.fleet.track(worker);
        let worker_id = candidate.worker_id.clone();
        span.record("worker", worker_id.as_str());
        trail.record.worker_id = Some(worker_id.to_string());
        let outcome = first_event(worker, request);
        // A worker that accepts and never answers is skipped like one that
        // fails: the next candidate gets the request.
        let outcome = match tokio::time::timeout(s.first_token_timeout, outcome).await {
            Ok(o) => o,
            Err(_) => {
                first_token_timeouts += 1;
                Err(UpstreamError::first_token_timeout(format!(
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
                    worker: worker.clone(),
                });
            }
            Err(e) if e.retry_elsewhere() => {
                tracing::warn!(worker = %worker_id, kind = ?e.kind, error = %e.detail, "attempt failed before the first token; trying the next worker");
                metrics::counter!("lorafleet_gateway_retries_total").increment(1);
                last = Some(e);
            }
            Err(e) => return Err(worker_error(&e, endpoint)),
        }
    }
    if first_token_timeouts > 0 && first_token_timeouts == trail.record.attempts as usize {
        return Err(ApiError::FirstTokenTimeout {
            after: s.first_token_timeout,
            tried: first_token_timeouts,
        });
    }
    Err(worker_error(
        &last.unwrap_or_else(|| UpstreamError::unavailable("no candidate worker")),
        endpoint,
    ))
}

/// Sends `g` to `worker` and reads up to its first event past `Accepted`.
async fn first_event(
    worker: &crate::router::fleet::Worker,
    g: &Generation,
) -> Result<(upstream::Events, upstream::Accepted, WorkerEvent), UpstreamError> {
    let mut stream = worker.client.generate(g).await?;
    let mut accepted = upstream::Accepted::default();
    loop {
        match stream.next().await? {
            Some(WorkerEvent::Accepted(a)) => accepted = a,
            Some(first) => return Ok((stream, accepted, first)),
            None => {
                return Err(UpstreamError::unavailable(
                    "the worker closed the stream before the first token",
                ));
            }
        }
    }
}

/// Starts choices 1.. of a request on the worker that serves its choice 0
/// (`first`), whose prefix cache holds the prompt by then. Choice i is the
/// request with `-i` after its id and, when a seed was given, seed + i.
/// A choice that fails fails the request: it is not retried elsewhere.
pub(super) async fn start_siblings(
    s: &AppState,
    p: &Prepared,
    first: &Started,
) -> Result<Vec<Started>, ApiError> {
    let starts = (1..p.choices.generated).map(|i| {
        let mut g = p.request.clone();
        g.request_id = crate::upstream::RequestId::new(format!("{}-{i}", g.request_id));
        g.spec = g.spec.choice(i);
        let worker = first.worker.clone();
        async move {
            let in_flight = s.fleet.track(&worker);
            let started = tokio::time::timeout(s.first_token_timeout, first_event(&worker, &g))
                .await
                .map_err(|_| {
                    UpstreamError::first_token_timeout(format!(
                        "no first token within {} s",
                        s.first_token_timeout.as_secs()
                    ))
                })?;
            started.map(|(stream, accepted, first)| Started {
                stream,
                accepted,
                first,
                _in_flight: in_flight,
                worker,
            })
        }
    });
    futures::future::try_join_all(starts)
        .await
        .map_err(|e| worker_error(&e, p.endpoint()))
}
