//! The OpenAI-compatible HTTP API: `/v1/completions`,
//! `/v1/chat/completions` (plain and SSE streaming), `/v1/models`, and
//! liveness/readiness probes.
//!
//! A completion request goes: concurrency permit → authenticate → parse →
//! rate limit → resolve (tenant, model) to one adapter version → route to
//! workers serving that adapter's base hash → generate, retrying on the next
//! candidate only before the first token → respond → one audit row.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::Utc;
use lorafleet_proto::worker::v1 as pb;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tonic::Code;
use uuid::Uuid;

use crate::audit::{AuditLog, AuditRecord, Durable, Ticket, Unavailable};
use crate::auth::{self, JwtConfig, Principal};
use crate::fleet::Fleet;
use crate::openai::{self, BadRequest, ChatRequest, CompletionRequest, Usage};
use crate::ratelimit::RateLimiter;
use crate::registry::{Registry, Resolved};

/// Everything a request needs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    pub registry: Registry,
    pub jwt: Option<JwtConfig>,
    pub fleet: Fleet,
    pub limiter: RateLimiter,
    pub audit: AuditLog,
    pub permits: Arc<Semaphore>,
    pub max_body_bytes: usize,
    pub request_timeout: Duration,
    pub max_attempts: usize,
    /// Longest a worker may take to its first token before the request
    /// moves to the next candidate.
    pub first_token_timeout: Duration,
    /// Longest age of the registry snapshot a completion is served from.
    pub registry_max_age: Duration,
    /// Turns true when the drain deadline has passed: open requests end
    /// with an error event (streams) or a 503, and a `cancelled` row.
    pub cut: tokio::sync::watch::Receiver<bool>,
}

/// Resolves once the drain deadline has passed (never, if it cannot).
async fn cut(mut rx: tokio::sync::watch::Receiver<bool>) {
    if rx.wait_for(|v| *v).await.is_err() {
        std::future::pending::<()>().await;
    }
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(state)
}

/// An OpenAI-shaped error response.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &'static str, message: String) -> Self {
        ApiError {
            status,
            kind,
            code,
            message,
            param: None,
            retry_after: None,
        }
    }

    fn unauthorized(e: &auth::AuthError) -> Self {
        // The credential is good; its tenant is not allowed in.
        if *e == auth::AuthError::TenantDisabled {
            return Self::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                "tenant_disabled",
                e.to_string(),
            );
        }
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            e.to_string(),
        )
    }

    fn model_not_found(model: &str) -> Self {
        // The same answer whether the model does not exist or belongs to
        // another tenant: the response must not reveal other tenants.
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("The model `{model}` does not exist or you do not have access to it."),
        );
        e.param = Some("model".into());
        e
    }

    fn bad_request(b: BadRequest) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            b.message,
        );
        e.param = (!b.param.is_empty()).then_some(b.param);
        e
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = openai::error_body(
            &self.message,
            self.kind,
            self.param.as_deref(),
            Some(self.code),
        );
        let mut r = (self.status, axum::Json(body)).into_response();
        if let Some(secs) = self.retry_after {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

async fn ready(State(s): State<AppState>) -> Response {
    let age = s.registry.age();
    if age > s.registry_max_age {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the registry snapshot is {} s old (limit {} s): Postgres is unreachable",
                age.as_secs(),
                s.registry_max_age.as_secs()
            ),
        )
            .into_response();
    }
    let up = s.fleet.workers().iter().filter(|w| w.up()).count();
    if up > 0 {
        (StatusCode::OK, format!("ready: {up} workers up")).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no worker is up").into_response()
    }
}

fn principal(s: &AppState, headers: &HeaderMap) -> Result<Principal, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    auth::authenticate(value, &s.registry.snapshot(), s.jwt.as_ref())
        .map_err(|e| ApiError::unauthorized(&e))
}

async fn models(State(s): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    let p = principal(&s, &headers)?;
    if !p.has_scope(auth::SCOPE_MODELS_READ) && !p.has_scope(auth::SCOPE_INFERENCE) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "insufficient_scope",
            "this credential may not list models (scope models:read)".into(),
        ));
    }
    let snapshot = s.registry.snapshot();
    let owner = snapshot
        .tenant(&p.tenant_id)
        .map_or_else(String::new, |t| t.name.clone());
    let data: Vec<Value> = snapshot
        .routes_of(&p.tenant_id)
        .iter()
        .map(|r| {
            json!({
                "id": r.model_name,
                "object": "model",
                "created": r.created_at.timestamp(),
                "owned_by": owner,
            })
        })
        .collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    handle(s, headers, body, Kind::Completion).await
}

async fn chat_completions(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    handle(s, headers, body, Kind::Chat).await
}

/// What the audit row and metrics need, filled in as the request proceeds.
///
/// It holds the request's audit [`Ticket`]: a trail dropped without
/// [`Trail::close`] (the client went away and the handler's future was
/// dropped) still records its row, as `cancelled`.
struct Trail {
    record: AuditRecord,
    started: Instant,
    tenant_name: String,
    adapter_label: String,
    ticket: Option<Ticket>,
}

/// HTTP status recorded for a request whose client closed the connection
/// before any answer (nginx's convention; no response was sent).
const CLIENT_CLOSED: u16 = 499;

impl Drop for Trail {
    fn drop(&mut self) {
        if self.ticket.is_some() {
            let code = StatusCode::from_u16(CLIENT_CLOSED).expect("a valid status");
            // The row is queued at once; nobody is left to wait for it.
            let _ = self.finish("cancelled", code, Some("client_closed"));
        }
    }
}

impl Trail {
    fn new(request_id: Uuid, ticket: Ticket) -> Trail {
        let now = Utc::now();
        Trail {
            record: AuditRecord {
                request_id,
                received_at: now,
                completed_at: now,
                tenant_id: None,
                api_key_id: None,
                api_key_prefix: None,
                subject: None,
                end_user: None,
                model_name: String::new(),
                route_id: None,
                route_revision: None,
                lora_int_id: None,
                adapter_name: None,
                adapter_version: None,
                base_hash: None,
                worker_id: None,
                adapter_residency: None,
                status: "rejected".into(),
                http_status: 0,
                error_code: None,
                finish_reason: None,
                prompt_tokens: 0,
                completion_tokens: 0,
                latency_us: 0,
                ttft_us: None,
                attempts: 0,
            },
            started: Instant::now(),
            tenant_name: String::new(),
            adapter_label: String::new(),
            ticket: Some(ticket),
        }
    }

    /// Records what a refused body said its `model` and `user` were, made
    /// safe later like every field.
    fn note_refused_body(&mut self, body: &[u8]) {
        let Some(v) = openai::lossy_object(body) else {
            return;
        };
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if let Some(m) = v.get("model") {
            self.record.model_name = text(m);
        }
        if let Some(u) = v.get("user").filter(|u| !u.is_null()) {
            self.record.end_user = Some(text(u));
        }
    }

    fn resolved(&mut self, r: &Resolved) {
        self.record.route_id = Some(r.route.id);
        self.record.route_revision = Some(r.route.revision);
        self.record.base_hash = Some(r.route.base_hash.clone());
        match &r.adapter {
            Some(a) => {
                self.record.lora_int_id = Some(a.lora_int_id as i64);
                self.record.adapter_name = Some(a.name.clone());
                self.record.adapter_version = Some(a.version as i32);
                self.adapter_label = format!("{}@{}", a.name, a.version);
            }
            None => self.adapter_label = "base".into(),
        }
    }

    /// Finishes the row and the metrics; the result resolves when the row
    /// is durable.
    fn close(mut self, status: &str, http: StatusCode, code: Option<&str>) -> Option<Durable> {
        self.finish(status, http, code)
    }

    fn finish(&mut self, status: &str, http: StatusCode, code: Option<&str>) -> Option<Durable> {
        let ticket = self.ticket.take()?;
        self.record.completed_at = Utc::now();
        self.record.latency_us = self.started.elapsed().as_micros() as i64;
        self.record.status = status.into();
        self.record.http_status = http.as_u16() as i16;
        self.record.error_code = code.map(str::to_owned);
        if status != "ok" {
            self.record.finish_reason = None;
        }
        let labels = [
            ("tenant", self.tenant_name.clone()),
            ("adapter", self.adapter_label.clone()),
        ];
        metrics::counter!(
            "lorafleet_gateway_requests_total",
            &[
                ("tenant", self.tenant_name.clone()),
                ("adapter", self.adapter_label.clone()),
                ("status", status.to_owned()),
            ]
        )
        .increment(1);
        metrics::histogram!("lorafleet_gateway_request_duration_seconds", &labels)
            .record(self.started.elapsed().as_secs_f64());
        if let Some(ttft) = self.record.ttft_us {
            metrics::histogram!("lorafleet_gateway_time_to_first_token_seconds", &labels)
                .record(ttft as f64 / 1e6);
        }
        Some(ticket.record(self.record.clone()))
    }
}

/// Waits for a row to be durable; false if it is not (then the answer must
/// not be a success).
async fn durable(d: Option<Durable>) -> bool {
    match d {
        Some(d) => d.wait().await,
        None => false,
    }
}

fn audit_unavailable(u: Unavailable) -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "audit_unavailable",
        u.to_string(),
    );
    e.retry_after = Some(5);
    e
}

fn row_not_durable() -> ApiError {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "audit_unavailable",
        "the completion's audit row could not be made durable, so it is not served; retry shortly"
            .into(),
    );
    e.retry_after = Some(5);
    e
}

/// Every completion response carries its request id, the key of its row.
fn with_request_id(mut r: Response, request_id: Uuid) -> Response {
    if let Ok(v) = HeaderValue::from_str(&request_id.to_string()) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

async fn handle(s: AppState, headers: HeaderMap, body: Body, kind: Kind) -> Response {
    let request_id = Uuid::now_v7();
    // First of all, a place for the row: without one, no work is done.
    let ticket = match s.audit.admit() {
        Ok(t) => t,
        Err(u) => {
            tracing::warn!(%request_id, reason = u.reason(), "refused: no room for the audit row");
            return with_request_id(audit_unavailable(u).into_response(), request_id);
        }
    };
    let mut trail = Trail::new(request_id, ticket);
    let span = tracing::info_span!(
        "completion",
        %request_id,
        tenant = tracing::field::Empty,
        model = tracing::field::Empty,
        lora_int_id = tracing::field::Empty,
        worker = tracing::field::Empty,
        route_reason = tracing::field::Empty,
        residency_hit = tracing::field::Empty,
        trace_id = tracing::field::Empty,
    );
    if let Some(tp) = headers.get("traceparent").and_then(|v| v.to_str().ok()) {
        let ts = headers
            .get("tracestate")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        lorafleet_telemetry::set_parent(&span, tp, ts);
    }
    if let Some(id) = lorafleet_telemetry::trace_id(&span) {
        span.record("trace_id", id);
    }
    // A slow body or a slow step must not outlive the drain deadline either.
    let result = tokio::select! {
        r = tracing::Instrument::instrument(
            prepare(&s, &headers, body, kind, &mut trail),
            span.clone(),
        ) => r,
        () = cut(s.cut.clone()) => Err(shutting_down()),
    };
    let prepared = match result {
        Ok(p) => p,
        Err(e) => {
            let code = e.code;
            let status = e.status;
            span.in_scope(|| tracing::info!(status = status.as_u16(), code, "refused"));
            let outcome = if code == "gateway_shutdown" {
                "cancelled"
            } else {
                "rejected"
            };
            // A refusal is answered even if its row is late: it serves nothing.
            durable(trail.close(outcome, status, Some(code))).await;
            return with_request_id(e.into_response(), request_id);
        }
    };
    with_request_id(
        run(s, prepared, trail, span, kind, request_id).await,
        request_id,
    )
}

struct Prepared {
    principal: Principal,
    resolved: Resolved,
    request: pb::GenerateRequest,
    stream: bool,
    include_usage: bool,
    model: String,
    /// The tenant has a tokens-per-minute limit, so finished requests are
    /// charged to it.
    charges_tokens: bool,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

async fn prepare(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
    kind: Kind,
    trail: &mut Trail,
) -> Result<Prepared, ApiError> {
    let permit = s.permits.clone().try_acquire_owned().map_err(|_| {
        let mut e = ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "gateway_overloaded",
            "the gateway is at its concurrency limit; retry shortly".into(),
        );
        e.retry_after = Some(1);
        e
    })?;
    let principal = principal(s, headers)?;
    trail.record.tenant_id = Some(principal.tenant_id);
    trail.record.api_key_id = principal.api_key_id;
    trail.record.api_key_prefix = principal.api_key_prefix.clone();
    trail.record.subject = principal.subject.clone();
    let snapshot = s.registry.snapshot();
    let tenant = snapshot
        .tenant(&principal.tenant_id)
        .cloned()
        .ok_or_else(|| ApiError::unauthorized(&auth::AuthError::InvalidKey))?;
    trail.tenant_name = tenant.name.clone();
    tracing::Span::current().record("tenant", tenant.name.as_str());
    if !principal.has_scope(auth::SCOPE_INFERENCE) {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "insufficient_scope",
            "this credential may not run completions (scope inference)".into(),
        ));
    }
    let bytes: Bytes = axum::body::to_bytes(body, s.max_body_bytes)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                "request_too_large",
                format!("the body is larger than {} bytes", s.max_body_bytes),
            )
        })?;
    let parsed = parse_body(&bytes, kind);
    if parsed.is_err() {
        trail.note_refused_body(&bytes);
    }
    let (common_model, user, stream, include_usage, prompt, sampling) = parsed?;
    trail.record.end_user = user.clone();
    if s.registry.age() > s.registry_max_age {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "registry_stale",
            format!(
                "the registry snapshot is older than {} s (Postgres is unreachable), so \
                 revocations may be missed; retry when it is back",
                s.registry_max_age.as_secs()
            ),
        ));
    }
    trail.record.model_name = common_model.clone();
    tracing::Span::current().record("model", common_model.as_str());
    s.limiter
        .admit(tenant.id, tenant.rpm_limit, tenant.tpm_limit)
        .await
        .map_err(|l| {
            let mut e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "rate_limit_exceeded",
                format!("rate limit reached: {}", l.what),
            );
            e.retry_after = Some(l.retry_after_secs);
            e
        })?;
    let stickiness = user
        .clone()
        .unwrap_or_else(|| trail.record.request_id.to_string());
    let resolved = snapshot
        .resolve(&principal.tenant_id, &common_model, &stickiness)
        .ok_or_else(|| ApiError::model_not_found(&common_model))?;
    trail.resolved(&resolved);
    let adapter = resolved.adapter.as_ref().map(|a| pb::AdapterDescriptor {
        lora_int_id: a.lora_int_id,
        artifact_uri: a.artifact_uri.clone(),
        artifact_sha256: a.artifact_sha256.clone(),
        base_hash: a.base_hash.clone(),
        rank: a.rank,
        display_name: format!("{}@{}", a.name, a.version),
    });
    if let Some(a) = &adapter {
        tracing::Span::current().record("lora_int_id", a.lora_int_id);
    }
    let (traceparent, tracestate) = lorafleet_telemetry::inject(&tracing::Span::current());
    let request = pb::GenerateRequest {
        request_id: trail.record.request_id.to_string(),
        adapter,
        prompt: Some(prompt),
        sampling: Some(sampling),
        trace_context: Some(pb::TraceContext {
            traceparent,
            tracestate,
        }),
    };
    Ok(Prepared {
        principal,
        resolved,
        request,
        stream,
        include_usage,
        model: common_model,
        charges_tokens: tenant.tpm_limit.is_some(),
        _permit: permit,
    })
}

type Parsed = (
    String,
    Option<String>,
    bool,
    bool,
    pb::generate_request::Prompt,
    pb::SamplingParams,
);

/// The body as (model, user, stream, include_usage, prompt, sampling).
fn parse_body(bytes: &[u8], kind: Kind) -> Result<Parsed, ApiError> {
    Ok(match kind {
        Kind::Completion => {
            let r = CompletionRequest::parse(bytes).map_err(ApiError::bad_request)?;
            let (p, sp) = r.to_worker().map_err(ApiError::bad_request)?;
            let c = r.common;
            let iu = c.include_usage();
            (c.model, c.user, c.stream, iu, p, sp)
        }
        Kind::Chat => {
            let r = ChatRequest::parse(bytes).map_err(ApiError::bad_request)?;
            let (p, sp) = r.to_worker().map_err(ApiError::bad_request)?;
            let c = r.common;
            let iu = c.include_usage();
            (c.model, c.user, c.stream, iu, p, sp)
        }
    })
}

/// A worker stream that has produced its first token (or finished).
struct Started {
    stream: tonic::Streaming<pb::GenerateEvent>,
    accepted: pb::Accepted,
    first: pb::generate_event::Event,
    _in_flight: crate::fleet::InFlight,
}

fn retryable(code: Code) -> bool {
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

fn worker_error(status: &tonic::Status) -> ApiError {
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
async fn start(s: &AppState, p: &Prepared, trail: &mut Trail) -> Result<Started, ApiError> {
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

fn residency_label(r: pb::Residency) -> Option<&'static str> {
    match r {
        pb::Residency::Device => Some("device"),
        pb::Residency::Host => Some("host"),
        pb::Residency::NotLoaded => Some("not_loaded"),
        pb::Residency::Loading => Some("loading"),
        _ => None,
    }
}

async fn run(
    s: AppState,
    p: Prepared,
    mut trail: Trail,
    span: tracing::Span,
    kind: Kind,
    request_id: Uuid,
) -> Response {
    use tracing::Instrument;
    let started = tokio::select! {
        r = async { start(&s, &p, &mut trail).await }.instrument(span.clone()) => r.map_err(|e| (e, "error")),
        () = cut(s.cut.clone()) => Err((shutting_down(), "cancelled")),
    };
    let started = match started {
        Ok(st) => st,
        Err((e, outcome)) => {
            let (status, code) = (e.status, e.code);
            span.in_scope(
                || tracing::warn!(status = status.as_u16(), code, message = %e.message, "failed"),
            );
            durable(trail.close(outcome, status, Some(code))).await;
            return e.into_response();
        }
    };
    trail.record.ttft_us = Some(trail.started.elapsed().as_micros() as i64);
    trail.record.prompt_tokens = started.accepted.prompt_tokens as i32;
    trail.record.adapter_residency = residency_label(started.accepted.adapter_residency())
        .filter(|_| p.resolved.adapter.is_some())
        .map(str::to_owned);
    let created = Utc::now().timestamp();
    let id = match kind {
        Kind::Completion => format!("cmpl-{request_id}"),
        Kind::Chat => format!("chatcmpl-{request_id}"),
    };
    let meta = Meta {
        id,
        created,
        model: p.model.clone(),
        kind,
    };
    if p.stream {
        stream_response(s, p, started, trail, span, meta)
    } else {
        collect_response(s, p, started, trail, span, meta).await
    }
}

struct Meta {
    id: String,
    created: i64,
    model: String,
    kind: Kind,
}

impl Meta {
    fn chunk(&self, text: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text.unwrap_or(""), "logprobs": null,
                             "finish_reason": finish}],
            }),
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), "assistant".into());
                }
                if let Some(t) = text {
                    delta.insert("content".into(), t.into());
                }
                json!({
                    "id": self.id, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null,
                                 "finish_reason": finish}],
                })
            }
        }
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        let object = match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": [], "usage": usage})
    }

    fn full(&self, text: &str, finish: &str, usage: &Usage) -> Value {
        match self.kind {
            Kind::Completion => json!({
                "id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
                "usage": usage,
            }),
            Kind::Chat => json!({
                "id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0,
                             "message": {"role": "assistant", "content": text},
                             "logprobs": null, "finish_reason": finish}],
                "usage": usage,
            }),
        }
    }
}

/// Records a finished completion in the trail and charges its tokens to
/// the tenant's minute; returns the usage to report.
///
/// The charge is a Redis round trip that the client need not wait for, so
/// it runs beside the response instead of before it.
fn settle(
    s: &AppState,
    p: &Prepared,
    trail: &mut Trail,
    f: &pb::Finished,
    completion_tokens: usize,
) -> Usage {
    let reported = f.usage.unwrap_or_default();
    let usage = Usage::new(
        reported.prompt_tokens,
        reported.completion_tokens.max(completion_tokens as u32),
    );
    trail.record.prompt_tokens = usage.prompt_tokens as i32;
    trail.record.completion_tokens = usage.completion_tokens as i32;
    trail.record.finish_reason = Some(openai::finish_reason(f).into());
    if p.charges_tokens {
        let (limiter, tenant) = (s.limiter.clone(), p.principal.tenant_id);
        let tokens = u64::from(usage.total_tokens);
        tokio::spawn(async move { limiter.charge_tokens(tenant, tokens).await });
    }
    usage
}

fn shutting_down() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "server_error",
        "gateway_shutdown",
        "the gateway is shutting down and its drain deadline passed; retry on another replica"
            .into(),
    )
}

/// How a worker stream ended before its `Finished` event.
enum Cut {
    Worker(tonic::Status),
    Timeout,
    Shutdown,
}

async fn collect_response(
    s: AppState,
    p: Prepared,
    mut st: Started,
    mut trail: Trail,
    span: tracing::Span,
    meta: Meta,
) -> Response {
    let mut text = String::new();
    let mut event = Some(st.first.clone());
    let deadline = tokio::time::Instant::now() + s.request_timeout;
    let finished = loop {
        match event.take() {
            Some(pb::generate_event::Event::Delta(d)) => {
                text.push_str(&d.text);
                // Kept on the row as they come, so a client that goes away
                // leaves a row with the tokens it used.
                trail.record.completion_tokens += d.token_ids.len() as i32;
            }
            Some(pb::generate_event::Event::Finished(f)) => break Ok(f),
            Some(pb::generate_event::Event::Accepted(_)) | None => {}
        }
        tokio::select! {
            m = tokio::time::timeout_at(deadline, st.stream.message()) => match m {
                Ok(Ok(Some(e))) => event = e.event,
                Ok(Ok(None)) => {
                    break Err(Cut::Worker(tonic::Status::unavailable(
                        "the worker closed the stream before the end",
                    )));
                }
                Ok(Err(status)) => break Err(Cut::Worker(status)),
                Err(_) => break Err(Cut::Timeout),
            },
            () = cut(s.cut.clone()) => break Err(Cut::Shutdown),
        }
    };
    let tokens = trail.record.completion_tokens as usize;
    match finished {
        Ok(f) => {
            let usage = settle(&s, &p, &mut trail, &f, tokens);
            let body = meta.full(&text, openai::finish_reason(&f), &usage);
            span.in_scope(|| {
                tracing::info!(completion_tokens = usage.completion_tokens, "completed")
            });
            // Served only once its row cannot be lost.
            if !durable(trail.close("ok", StatusCode::OK, None)).await {
                return row_not_durable().into_response();
            }
            axum::Json(body).into_response()
        }
        Err(cut) => {
            // Tokens were produced, so no retry: the client gets an error.
            let (e, outcome) = match cut {
                Cut::Timeout => (
                    ApiError::new(
                        StatusCode::GATEWAY_TIMEOUT,
                        "server_error",
                        "timeout",
                        format!("the request took longer than {:?}", s.request_timeout),
                    ),
                    "error",
                ),
                Cut::Shutdown => (shutting_down(), "cancelled"),
                Cut::Worker(status) => (worker_error(&status), "error"),
            };
            span.in_scope(|| tracing::warn!(message = %e.message, "failed after the first token"));
            durable(trail.close(outcome, e.status, Some(e.code))).await;
            e.into_response()
        }
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream_response(
    s: AppState,
    p: Prepared,
    mut st: Started,
    mut trail: Trail,
    span: tracing::Span,
    meta: Meta,
) -> Response {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(32);
    let task = async move {
        let mut sent_role = false;
        let mut event = Some(st.first.clone());
        let deadline = tokio::time::Instant::now() + s.request_timeout;
        // Every send also ends at the drain deadline: a client that stops
        // reading must not hold the shutdown.
        let send = |v: Bytes| {
            let (tx, cut_rx) = (tx.clone(), s.cut.clone());
            async move {
                tokio::select! {
                    r = tx.send(Ok(v)) => r.is_ok(),
                    () = cut(cut_rx) => false,
                }
            }
        };
        if meta.kind == Kind::Chat {
            sent_role = true;
            if !send(sse(&meta.chunk(None, true, None))).await {
                let _ = trail.close("cancelled", StatusCode::OK, Some("client_closed"));
                return;
            }
        }
        let outcome: Result<pb::Finished, (&str, &str)> = loop {
            match event.take() {
                Some(pb::generate_event::Event::Delta(d)) => {
                    trail.record.completion_tokens += d.token_ids.len() as i32;
                    if !d.text.is_empty()
                        && !send(sse(&meta.chunk(Some(&d.text), !sent_role, None))).await
                    {
                        // The client went away (or the drain deadline cut
                        // it): dropping the worker stream cancels the
                        // request there and frees its blocks.
                        break Err(if *s.cut.borrow() {
                            ("cancelled", "gateway_shutdown")
                        } else {
                            ("cancelled", "client_closed")
                        });
                    }
                }
                Some(pb::generate_event::Event::Finished(f)) => break Ok(f),
                _ => {}
            }
            tokio::select! {
                m = tokio::time::timeout_at(deadline, st.stream.message()) => match m {
                    Ok(Ok(Some(e))) => event = e.event,
                    Ok(Ok(None)) => break Err(("error", "worker_stream_ended")),
                    Ok(Err(_)) => break Err(("error", "worker_failed")),
                    Err(_) => break Err(("error", "timeout")),
                },
                () = tx.closed() => break Err(("cancelled", "client_closed")),
                () = cut(s.cut.clone()) => break Err(("cancelled", "gateway_shutdown")),
            }
        };
        let tokens = trail.record.completion_tokens as usize;
        match outcome {
            Ok(f) => {
                let usage = settle(&s, &p, &mut trail, &f, tokens);
                let reason = openai::finish_reason(&f);
                send(sse(&meta.chunk(None, false, Some(reason)))).await;
                if p.include_usage {
                    send(sse(&meta.usage_chunk(&usage))).await;
                }
                tracing::info!(completion_tokens = usage.completion_tokens, "completed");
                // [DONE] only once the row cannot be lost.
                if durable(trail.close("ok", StatusCode::OK, None)).await {
                    send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                } else {
                    let e = row_not_durable();
                    let body = openai::error_body(&e.message, e.kind, None, Some(e.code));
                    send(sse(&body)).await;
                }
            }
            Err((status, code)) => {
                if status == "error" || code == "gateway_shutdown" {
                    // Headers are gone; tell the client in-band, OpenAI-style.
                    let message = if code == "gateway_shutdown" {
                        "the gateway is shutting down and its drain deadline passed"
                    } else {
                        "the worker failed after the stream started"
                    };
                    let body = openai::error_body(message, "server_error", None, Some(code));
                    // Best effort, and never past the deadline.
                    let _ =
                        tokio::time::timeout(Duration::from_millis(100), tx.send(Ok(sse(&body))))
                            .await;
                }
                tracing::warn!(status, code, "stream ended early");
                durable(trail.close(status, StatusCode::OK, Some(code))).await;
            }
        }
        drop(st);
    };
    tokio::spawn(tracing::Instrument::instrument(task, span));
    let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .expect("a valid response")
}
