//! The OpenAI-compatible HTTP API: `/v1/completions`,
//! `/v1/chat/completions` (plain and SSE streaming), `/v1/models`, and
//! liveness/readiness probes.
//!
//! A completion request goes: a place for its audit row → concurrency
//! permit → authenticate → parse → rate limit → resolve (tenant, model) to
//! one adapter version → route to workers serving that adapter's base hash
//! → generate, retrying on the next candidate only before the first token
//! ([`worker`]) → respond ([`respond`]) → its row, durable before the answer
//! ([`trail`]).

use crate::audit::AuditStatus;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::Utc;
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use uuid::Uuid;

use crate::audit::{AuditLog, AuditRecord, Durable, Ticket, Unavailable};
use crate::auth::{self, AuthError, JwtConfig, Principal};
use crate::ratelimit::RateLimiter;
use crate::registry::{Registry, Resolved, Snapshot};
use crate::router::fleet::Fleet;
use crate::sources::{Sources, Verdict};
use crate::upstream::{self, Generation, UpstreamError, WorkerEvent};
pub use error::{ApiError, Parts, WorkerFailure};
use openai::{ChatRequest, CompletionRequest, Usage};

mod calls;
mod choices;
mod error;
mod harmony;
pub mod internal;
mod logprobs;
pub mod openai;
pub mod params;
mod respond;
pub mod series;
mod trail;
mod usage;
mod worker;

use respond::{run, shutting_down};
use trail::{Trail, audit_unavailable, durable, row_not_durable, with_request_id};
use worker::{start, worker_error};

/// Everything a request needs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AppState {
    pub registry: Registry,
    /// The tenants whose requests have metrics series of their own.
    pub tenant_series: Arc<series::TenantSeries>,
    pub jwt: Option<JwtConfig>,
    pub fleet: Fleet,
    pub limiter: RateLimiter,
    pub audit: AuditLog,
    pub permits: Arc<Semaphore>,
    /// Requests one tenant may have in flight at once across the fleet,
    /// body reads included, so one tenant can never take the others'
    /// capacity.
    pub tenant_slots: crate::concurrency::TenantSlots,
    /// The cap of a tenant whose registry row sets none.
    pub default_max_concurrent: usize,
    pub max_body_bytes: usize,
    /// Longest a client may take to send its body.
    pub body_timeout: Duration,
    /// Limits for tenants whose registry row leaves them unset.
    pub default_rpm_limit: Option<u32>,
    pub default_tpm_limit: Option<u64>,
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
    /// Client addresses, their failed-authentication limit and its rows.
    pub sources: Sources,
    /// Where tenants' usage reports read the rollups (the serving pool),
    /// and how many may run at once, so they never take the connections
    /// audit inserts wait for.
    pub usage_pool: sqlx::PgPool,
    pub usage_reports: Arc<Semaphore>,
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
        .route("/v1/usage", get(usage::usage))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(state)
}

/// `/readyz` on the public port: the status code alone. How many workers
/// are up and how old the registry is are the operator's to know, on the
/// metrics listener ([`readiness`]).
async fn ready(State(s): State<AppState>) -> Response {
    let (status, _) = readiness(&s);
    let body = if status == StatusCode::OK {
        "ready"
    } else {
        "not ready"
    };
    (status, body).into_response()
}

/// Whether the gateway can serve, and why not: a registry snapshot older
/// than its limit (Postgres unreachable) or no routable worker.
pub fn readiness(s: &AppState) -> (StatusCode, String) {
    let age = s.registry.age();
    if age > s.registry_max_age {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!(
                "the registry snapshot is {} s old (limit {} s): Postgres is unreachable",
                age.as_secs(),
                s.registry_max_age.as_secs()
            ),
        );
    }
    let up = s.fleet.routable();
    if up > 0 {
        (StatusCode::OK, format!("ready: {up} workers up"))
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "no worker is up".into())
    }
}

/// The caller, by the registry snapshot the request reads throughout.
fn principal(
    s: &AppState,
    snapshot: &Snapshot,
    headers: &HeaderMap,
) -> Result<Principal, ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    auth::authenticate(value, snapshot, s.jwt.as_ref()).map_err(ApiError::unauthorized)
}

/// The client address of a request: its peer, or what a trusted proxy
/// says (see [`crate::sources`]).
fn client_of(s: &AppState, parts: &axum::http::request::Parts) -> Option<std::net::IpAddr> {
    let peer = parts
        .extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map(|c| c.0.ip());
    s.sources.client(peer, &parts.headers)
}

/// A failed authentication: counted against its source and in the
/// source's aggregated audit row (never a row of its own), and answered
/// 401, or 429 once the source is past its limit.
fn failed_auth(
    s: &AppState,
    client: Option<std::net::IpAddr>,
    headers: &HeaderMap,
    why: AuthError,
) -> ApiError {
    let prefix = crate::sources::key_prefix(headers);
    match s.sources.failed(client, prefix.as_deref()) {
        Verdict::Unauthenticated => ApiError::Unauthenticated(why),
        Verdict::Throttled { retry_after } => ApiError::FailedAuthLimited { retry_after },
    }
}

async fn models(State(s): State<AppState>, request: axum::extract::Request) -> Response {
    let (parts, _body) = request.into_parts();
    let client = client_of(&s, &parts);
    match list_models(&s, &parts.headers) {
        Ok(r) => r,
        Err(ApiError::Unauthenticated(why)) => {
            failed_auth(&s, client, &parts.headers, why).into_response()
        }
        Err(e) => e.into_response(),
    }
}

fn list_models(s: &AppState, headers: &HeaderMap) -> Result<Response, ApiError> {
    let snapshot = s.registry.snapshot();
    let p = principal(s, &snapshot, headers)?;
    if !p.has_scope(auth::SCOPE_MODELS_READ) && !p.has_scope(auth::SCOPE_INFERENCE) {
        return Err(ApiError::InsufficientScope {
            scope: auth::SCOPE_MODELS_READ,
            what: "list models",
        });
    }
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

async fn completions(State(s): State<AppState>, request: axum::extract::Request) -> Response {
    handle(s, request, Kind::Completion).await
}

async fn chat_completions(State(s): State<AppState>, request: axum::extract::Request) -> Response {
    handle(s, request, Kind::Chat).await
}

async fn handle(s: AppState, request: axum::extract::Request, kind: Kind) -> Response {
    let (parts, body) = request.into_parts();
    let client = client_of(&s, &parts);
    let trusted = s.sources.from_trusted_proxy(
        parts
            .extensions
            .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
            .map(|c| c.0.ip()),
    );
    let headers = parts.headers;
    let request_id = Uuid::now_v7();
    // First of all, a place for the row: without one, no work is done.
    let ticket = match s.audit.admit() {
        Ok(t) => t,
        Err(u) => {
            tracing::warn!(%request_id, reason = u.reason(), "refused: no room for the audit row");
            return with_request_id(audit_unavailable(u).into_response(), request_id);
        }
    };
    let mut trail = Trail::new(request_id, ticket, s.tenant_series.clone());
    trail.record.client_addr = client.map(|c| c.to_string());
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
    // A caller's trace is joined only through a trusted proxy: anyone on
    // the internet could otherwise pick the trace the gateway's spans (and
    // the workers') belong to.
    if let Some(tp) = headers
        .get("traceparent")
        .filter(|_| trusted)
        .and_then(|v| v.to_str().ok())
    {
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
        Err(ApiError::Unauthenticated(why)) => {
            // Counted in its source's aggregated row, not a row of its own.
            trail.discard();
            let e = failed_auth(&s, client, &headers, why);
            span.in_scope(|| tracing::debug!(code = e.code(), "unauthenticated"));
            return with_request_id(e.into_response(), request_id);
        }
        Err(e) => {
            let Parts { code, status, .. } = e.parts();
            span.in_scope(|| tracing::info!(status = status.as_u16(), code, "refused"));
            let outcome = if code == "gateway_shutdown" {
                AuditStatus::Cancelled
            } else {
                AuditStatus::Rejected
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
    resolved: Resolved,
    /// Choice 0 of the request.
    request: Generation,
    /// Choices to generate, each a request of its own on one worker, and
    /// how many of them (the most likely) to return.
    choices: upstream::Choices,
    /// The client asked for log probabilities (`best_of` asks for them
    /// without showing them).
    show_logprobs: bool,
    /// Chat's tools: the answer's text is read for calls.
    tools: Option<openai::tools::Tools>,
    stream: bool,
    include_usage: bool,
    model: String,
    _tenant_slot: Option<crate::concurrency::Slot>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Prepared {
    /// The endpoint the client called: a chat completion sent its prompt
    /// as `messages`.
    fn endpoint(&self) -> params::Endpoint {
        params::Endpoint::of(&self.request.spec.prompt)
    }
}

/// The request body, within the size limit and the body deadline.
async fn read_body(s: &AppState, body: Body) -> Result<Bytes, ApiError> {
    match tokio::time::timeout(s.body_timeout, axum::body::to_bytes(body, s.max_body_bytes)).await {
        Ok(Ok(bytes)) => Ok(bytes),
        Ok(Err(_)) => Err(ApiError::BodyTooLarge {
            limit: s.max_body_bytes,
        }),
        Err(_) => Err(ApiError::BodyTimeout {
            after: s.body_timeout,
        }),
    }
}

/// A slot under the tenant's concurrency cap (its own, else the
/// gateway's), across the replicas; None when the tenant is unlimited.
async fn tenant_slot(
    s: &AppState,
    tenant: &crate::registry::Tenant,
) -> Result<Option<crate::concurrency::Slot>, ApiError> {
    let cap = tenant
        .max_concurrent
        .resolve(Some(s.default_max_concurrent as u64));
    let Some(cap) = cap else { return Ok(None) };
    let cap = usize::try_from(cap).unwrap_or(usize::MAX);
    let slot = s.tenant_slots.try_acquire(tenant.id, cap).await;
    slot.map(Some)
        .ok_or(ApiError::TenantConcurrency { per_tenant: cap })
}

/// Refuses a request whose `max_tokens` (plus its prompt, when it was
/// sent as token ids and so is known exactly) exceeds the context of the
/// workers serving its base model. A text prompt's length is the worker's
/// to count: it refuses the rest with the same code.
fn fits_the_context(
    s: &AppState,
    resolved: &crate::registry::Resolved,
    prompt: &upstream::Prompt,
    sampling: &upstream::Sampling,
) -> Result<(), ApiError> {
    let Some(max_model_len) = s.fleet.max_model_len(&resolved.route.base_hash) else {
        return Ok(());
    };
    let prompt_tokens = match prompt {
        upstream::Prompt::TokenIds(ids) => Some(ids.len() as u64),
        _ => None,
    };
    let max_tokens = u32::try_from(sampling.max_tokens).unwrap_or(u32::MAX);
    if u64::from(max_tokens) + prompt_tokens.unwrap_or(0) > u64::from(max_model_len) {
        return Err(ApiError::ContextLength {
            prompt_tokens,
            max_tokens,
            max_model_len,
        });
    }
    Ok(())
}

/// The tenant's requests and tokens per minute: its own, else the
/// gateway's defaults (None: unlimited).
fn rate_limits(s: &AppState, tenant: &crate::registry::Tenant) -> (Option<u32>, Option<u64>) {
    let rpm = tenant
        .rpm_limit
        .resolve(s.default_rpm_limit.map(u64::from))
        .map(|v| u32::try_from(v).unwrap_or(u32::MAX));
    (rpm, tenant.tpm_limit.resolve(s.default_tpm_limit))
}

async fn prepare(
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
    kind: Kind,
    trail: &mut Trail,
) -> Result<Prepared, ApiError> {
    // Admission order: the credential (headers only) first, then the
    // tenant's own share, then its body under a deadline, and only then a
    // global permit. An unauthenticated client never gets to send a body,
    // and a tenant with slow bodies holds only its own slots.
    // One read of the registry for the whole request: its credential, its
    // tenant, its route and the snapshot's age all come from it.
    let snapshot = s.registry.snapshot();
    let principal = principal(s, &snapshot, headers)?;
    trail.record.tenant_id = Some(principal.tenant_id);
    trail.record.api_key_id = principal.api_key_id;
    trail.record.api_key_prefix = principal.api_key_prefix.clone();
    trail.record.subject = principal.subject.clone();
    let tenant = snapshot
        .tenant(&principal.tenant_id)
        .cloned()
        .ok_or(ApiError::Unauthenticated(auth::AuthError::InvalidKey))?;
    trail.tenant_name = tenant.name.clone();
    tracing::Span::current().record("tenant", tenant.name.as_str());
    if !principal.has_scope(auth::SCOPE_INFERENCE) {
        return Err(ApiError::InsufficientScope {
            scope: auth::SCOPE_INFERENCE,
            what: "run completions",
        });
    }
    let tenant_slot = tenant_slot(s, &tenant).await?;
    let bytes = read_body(s, body).await?;
    let permit = s
        .permits
        .clone()
        .try_acquire_owned()
        .map_err(|_| ApiError::GatewayOverloaded)?;
    let parsed = parse_body(&bytes, kind);
    if parsed.is_err() {
        trail.note_refused_body(&bytes);
    }
    let Parsed {
        model: common_model,
        user,
        stream,
        include_usage,
        spec,
        show_logprobs,
        features,
        tools,
    } = parsed?;
    trail.record.features = features;
    trail.record.end_user = user.clone();
    if snapshot.age() > s.registry_max_age {
        return Err(ApiError::RegistryStale {
            max_age: s.registry_max_age,
        });
    }
    trail.record.model_name = common_model.clone();
    tracing::Span::current().record("model", common_model.as_str());
    // A tenant without its own limits gets the gateway's defaults.
    let stickiness = user
        .clone()
        .unwrap_or_else(|| trail.record.request_id.to_string());
    let resolved = snapshot
        .resolve(&principal.tenant_id, &common_model, &stickiness)
        .ok_or_else(|| ApiError::ModelNotFound {
            model: common_model.clone(),
        })?;
    trail.resolved(&resolved);
    // A request that cannot fit the model's context is refused before it
    // is charged against any limit.
    fits_the_context(s, &resolved, &spec.prompt, &spec.sampling)?;
    let (rpm_limit, tpm_limit) = rate_limits(s, &tenant);
    let reserve = reservation(&spec);
    trail.tokens = s
        .limiter
        .admit(tenant.id, rpm_limit, tpm_limit, reserve)
        .await
        .map_err(ApiError::RateLimited)?;
    let adapter = adapter_ref(&resolved);
    if let Some(a) = &adapter {
        tracing::Span::current().record("lora_int_id", a.lora_int_id.get());
    }
    let (traceparent, tracestate) = lorafleet_telemetry::inject(&tracing::Span::current());
    let request = Generation {
        request_id: upstream::RequestId::new(trail.record.request_id.to_string()),
        adapter,
        spec: spec.choice(0),
        traceparent,
        tracestate,
        // Each tenant is its own share of every worker.
        fairness_key: upstream::FairnessKey::new(tenant.id.to_string()),
        fairness_weight: tenant.weight,
    };
    Ok(Prepared {
        resolved,
        request,
        choices: spec.choices,
        show_logprobs,
        tools,
        stream,
        include_usage,
        model: common_model,
        _tenant_slot: tenant_slot,
        _permit: permit,
    })
}

/// The adapter a resolved route sends the worker, if any.
fn adapter_ref(resolved: &Resolved) -> Option<upstream::AdapterRef> {
    resolved.adapter.as_ref().map(|a| upstream::AdapterRef {
        lora_int_id: a.lora_int_id,
        artifact_uri: a.artifact_uri.clone(),
        artifact_sha256: a.artifact_sha256.clone(),
        base_hash: a.base_hash.clone(),
        rank: a.rank,
        display_name: format!("{}@{}", a.name, a.version),
        artifact_size: a.artifact_size,
    })
}

/// The tokens a request reserves of its tenant's tokens per minute: every
/// choice's `max_tokens`, the prompt once, and a constraint's source
/// (compiled on the worker) as tokens of about four bytes.
fn reservation(spec: &upstream::GenerationSpec) -> u64 {
    let constraint = spec
        .sampling
        .constraint
        .as_ref()
        .map_or(0, |c| c.source_bytes().div_ceil(4) as u64);
    spec.sampling.max_tokens as u64 * u64::from(spec.choices.generated)
        + estimate_prompt_tokens(&spec.prompt)
        + constraint
}

/// The prompt's tokens as the tokens-per-minute reservation counts them
/// before the worker has tokenized it: exact for token ids, and for text
/// about four bytes a token (the usual rate of byte-level BPE on English),
/// plus a few template tokens per chat message. The reservation is settled
/// to the worker's exact count when the request ends.
fn estimate_prompt_tokens(prompt: &upstream::Prompt) -> u64 {
    const BYTES_PER_TOKEN: usize = 4;
    const TEMPLATE_TOKENS_PER_MESSAGE: u64 = 4;
    match prompt {
        upstream::Prompt::TokenIds(ids) => ids.len() as u64,
        upstream::Prompt::Text(t) => t.len().div_ceil(BYTES_PER_TOKEN) as u64,
        upstream::Prompt::Chat(chat) => chat
            .messages
            .iter()
            .map(|m| m.content.len().div_ceil(BYTES_PER_TOKEN) as u64 + TEMPLATE_TOKENS_PER_MESSAGE)
            .sum(),
    }
}

/// What a request body asks for.
struct Parsed {
    model: String,
    user: Option<String>,
    stream: bool,
    include_usage: bool,
    spec: upstream::Valid<upstream::GenerationSpec>,
    /// The client asked for completion tokens' log probabilities.
    show_logprobs: bool,
    /// For the audit row.
    features: String,
    tools: Option<openai::tools::Tools>,
}

/// The API features a request uses, as the audit row records them: stable
/// names, comma-separated, in a fixed order.
fn features(spec: &upstream::GenerationSpec, tools: bool) -> String {
    let s = &spec.sampling;
    let upstream::Choices {
        generated: n,
        returned,
    } = spec.choices;
    let used = [
        ("logprobs", s.logprobs.is_some()),
        ("echo", s.prompt_logprobs.is_some()),
        ("n", returned > 1),
        ("best_of", n > returned),
        ("logit_bias", !s.logit_bias.is_empty()),
        (
            "penalties",
            s.repetition_penalty != 1.0 || s.frequency_penalty != 0.0 || s.presence_penalty != 0.0,
        ),
        ("min_tokens", s.min_tokens > 0),
        ("structured_output", s.constraint.is_some() && !tools),
        ("tools", tools),
    ];
    used.iter()
        .filter(|(_, on)| *on)
        .map(|(name, _)| *name)
        .collect::<Vec<_>>()
        .join(",")
}

fn parse_body(bytes: &[u8], kind: Kind) -> Result<Parsed, ApiError> {
    let (spec, c, tools) = match kind {
        Kind::Completion => {
            let r = CompletionRequest::parse(bytes)?;
            (r.to_worker()?, r.common, None)
        }
        Kind::Chat => {
            let r = ChatRequest::parse(bytes)?;
            let spec = r.to_worker()?;
            let tools = r.tools()?;
            (spec, r.common, tools)
        }
    };
    let features = features(&spec, tools.is_some());
    // Choosing the best needs each choice's log probabilities (each
    // choice's request asks for them); the client sees them only if it
    // asked.
    let show_logprobs = spec.sampling.logprobs.is_some();
    Ok(Parsed {
        tools,
        features,
        show_logprobs,
        include_usage: c.include_usage(),
        model: c.model,
        user: c.user,
        stream: c.stream,
        spec,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(
        sampling: upstream::Sampling,
        generated: u32,
        returned: u32,
    ) -> upstream::GenerationSpec {
        upstream::GenerationSpec {
            prompt: upstream::Prompt::TokenIds(vec![1; 7]),
            sampling,
            choices: upstream::Choices {
                generated,
                returned,
            },
        }
    }

    #[test]
    fn the_reservation_counts_every_choice_the_prompt_once_and_the_constraint() {
        let sampling = upstream::Sampling {
            max_tokens: 10,
            ..Default::default()
        };
        assert_eq!(reservation(&spec(sampling.clone(), 1, 1)), 17);
        assert_eq!(reservation(&spec(sampling.clone(), 3, 1)), 37);
        let constrained = upstream::Sampling {
            constraint: Some(upstream::Constraint::Regex("a".repeat(40))),
            ..sampling
        };
        assert_eq!(reservation(&spec(constrained, 1, 1)), 27);
        // The features the audit row records, in their fixed order.
        let s = upstream::Sampling {
            logprobs: Some(1),
            prompt_logprobs: Some(1),
            frequency_penalty: 0.5,
            ..Default::default()
        };
        assert_eq!(
            features(&spec(s, 4, 2), false),
            "logprobs,echo,n,best_of,penalties"
        );
        let plain = || spec(upstream::Sampling::default(), 1, 1);
        assert_eq!(features(&plain(), true), "tools");
        assert_eq!(features(&plain(), false), "");
    }
}
