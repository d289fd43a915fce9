//! The OpenAI API's errors: one enum, mapped in one exhaustive place
//! ([`ApiError::parts`]) to an HTTP status, an OpenAI error type, a stable
//! code, the field at fault and a `Retry-After`. Handlers say what went
//! wrong; only this file decides how a client sees it.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::openai::{self, BadRequest};
use super::params::{Endpoint, client_param};
use crate::auth::AuthError;
use crate::ratelimit::Limited;
use crate::upstream::{UpstreamError, UpstreamErrorKind};

/// Everything a completion or a model listing can end with, short of
/// success.
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// No usable credential.
    Unauthenticated(AuthError),
    /// This client address has failed authentication too often; its
    /// requests are refused before their bodies until the bucket refills.
    FailedAuthLimited {
        retry_after: Duration,
    },
    /// A good credential whose tenant is disabled.
    TenantDisabled,
    /// The usage rollups could not be read.
    UsageUnavailable,
    /// The credential lacks the scope; `what` is the action refused.
    InsufficientScope {
        scope: &'static str,
        what: &'static str,
    },
    /// The same answer whether the model does not exist or belongs to
    /// another tenant: the response must not reveal other tenants.
    ModelNotFound {
        model: String,
    },
    /// A field of the body, named.
    BadRequest(BadRequest),
    BodyTooLarge {
        limit: usize,
    },
    /// The request cannot fit the context of the workers serving its
    /// model, decided before any limit is charged.
    ContextLength {
        /// Known exactly when the prompt was sent as token ids.
        prompt_tokens: Option<u64>,
        max_tokens: u32,
        max_model_len: u32,
    },
    BodyTimeout {
        after: Duration,
    },
    /// The tenant has `per_tenant` requests in the gateway already.
    TenantConcurrency {
        per_tenant: usize,
    },
    /// The gateway's global concurrency limit.
    GatewayOverloaded,
    RateLimited(Limited),
    /// The registry snapshot is older than allowed.
    RegistryStale {
        max_age: Duration,
    },
    /// No room for the request's audit row (`reason`), so no work is done.
    AuditUnavailable {
        reason: String,
    },
    /// The completion's row could not be made durable, so it is not served.
    RowNotDurable,
    NoCompatibleWorker {
        base_model: String,
    },
    /// Every worker tried took longer than the deadline to a first token.
    FirstTokenTimeout {
        after: Duration,
        tried: usize,
    },
    /// The whole request took longer than the deadline.
    RequestTimeout {
        after: Duration,
    },
    /// The drain deadline passed.
    GatewayShutdown,
    /// A worker's failure, as the tenant may see it.
    Worker(WorkerFailure),
}

/// A worker's failure reduced to what a tenant may see: a refusal of the
/// tenant's own fields keeps the worker's words; anything about the
/// adapter, the artifact or the worker keeps only a stable reason code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerFailure {
    InvalidRequest {
        field: Option<String>,
        message: String,
        /// The prompt plus `max_tokens` is over the model's context
        /// (OpenAI's `context_length_exceeded`).
        context: bool,
    },
    AdapterUnavailable {
        reason: String,
    },
    Unavailable {
        reason: String,
    },
}

impl WorkerFailure {
    /// The tenant's view of `e`; the worker's full text goes to the log.
    /// A field is named as the client sent it to `endpoint`.
    pub fn from_upstream(e: &UpstreamError, endpoint: Endpoint) -> WorkerFailure {
        let reason = e.reason_code().to_owned();
        match &e.kind {
            UpstreamErrorKind::InvalidRequest { field } => {
                // The worker names its own wire fields; the client hears
                // of the fields it sent.
                let client = field.and_then(|f| client_param(f, endpoint));
                let message = match (field, &client) {
                    (Some(f), Some(c)) => match e.message.strip_prefix(f.wire_path().as_str()) {
                        Some(rest) => format!("{c}{rest}"),
                        None => e.message.clone(),
                    },
                    _ => e.message.clone(),
                };
                WorkerFailure::InvalidRequest {
                    field: client,
                    message,
                    context: e.context_exceeded(),
                }
            }
            UpstreamErrorKind::AdapterUnavailable => {
                tracing::warn!(reason, error = %e.detail, "the worker could not use the adapter");
                WorkerFailure::AdapterUnavailable { reason }
            }
            UpstreamErrorKind::Unavailable
            | UpstreamErrorKind::FirstTokenTimeout
            | UpstreamErrorKind::Failed => {
                tracing::warn!(reason, error = %e.detail, "no worker served the request");
                WorkerFailure::Unavailable { reason }
            }
        }
    }
}

/// How a client sees an [`ApiError`].
#[derive(Debug, Clone, PartialEq)]
pub struct Parts {
    pub status: StatusCode,
    /// OpenAI's error `type`.
    pub kind: &'static str,
    /// The stable code: the body's `code`, the audit row's `error_code`.
    pub code: &'static str,
    pub param: Option<String>,
    pub message: String,
    pub retry_after_secs: Option<u64>,
}

const INVALID: &str = "invalid_request_error";
const SERVER: &str = "server_error";
const RATE: &str = "rate_limit_error";

impl ApiError {
    /// The one mapping to a status, a type, a code, a field, a message and
    /// a `Retry-After`.
    pub fn parts(&self) -> Parts {
        let p = |status, kind, code, message: String| Parts {
            status,
            kind,
            code,
            param: None,
            message,
            retry_after_secs: None,
        };
        match self {
            ApiError::Unauthenticated(e) => p(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                crate::sources::UNAUTHENTICATED_CODE,
                e.to_string(),
            ),
            ApiError::FailedAuthLimited { retry_after } => Parts {
                retry_after_secs: Some(retry_after.as_secs_f64().ceil().max(1.0) as u64),
                ..p(
                    StatusCode::TOO_MANY_REQUESTS,
                    RATE,
                    crate::sources::THROTTLED_CODE,
                    format!(
                        "too many failed authentications from this address; retry in {} s \
                         with a valid credential",
                        retry_after.as_secs_f64().ceil().max(1.0)
                    ),
                )
            },
            ApiError::TenantDisabled => p(
                StatusCode::FORBIDDEN,
                "permission_error",
                "tenant_disabled",
                AuthError::TenantDisabled.to_string(),
            ),
            ApiError::InsufficientScope { scope, what } => p(
                StatusCode::FORBIDDEN,
                "permission_error",
                "insufficient_scope",
                format!("this credential may not {what} (scope {scope})"),
            ),
            ApiError::ModelNotFound { model } => Parts {
                param: Some("model".into()),
                ..p(
                    StatusCode::NOT_FOUND,
                    INVALID,
                    "model_not_found",
                    format!("The model `{model}` does not exist or you do not have access to it."),
                )
            },
            ApiError::BadRequest(b) => Parts {
                param: (!b.param.is_empty()).then(|| b.param.clone()),
                ..p(
                    StatusCode::BAD_REQUEST,
                    INVALID,
                    "invalid_request",
                    b.message.clone(),
                )
            },
            ApiError::BodyTooLarge { limit } => p(
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID,
                "request_too_large",
                format!("the body is larger than {limit} bytes"),
            ),
            ApiError::BodyTimeout { after } => p(
                StatusCode::REQUEST_TIMEOUT,
                INVALID,
                "body_timeout",
                format!("the body did not arrive within {} s", after.as_secs()),
            ),
            ApiError::TenantConcurrency { per_tenant } => Parts {
                retry_after_secs: Some(1),
                ..p(
                    StatusCode::TOO_MANY_REQUESTS,
                    RATE,
                    "tenant_concurrency_limit",
                    format!(
                        "this tenant has {per_tenant} requests in flight already; retry \
                         when one ends"
                    ),
                )
            },
            ApiError::UsageUnavailable => Parts {
                retry_after_secs: Some(5),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    SERVER,
                    "usage_unavailable",
                    "the usage report could not be read; retry shortly".into(),
                )
            },
            ApiError::GatewayOverloaded => Parts {
                retry_after_secs: Some(1),
                ..p(
                    StatusCode::TOO_MANY_REQUESTS,
                    RATE,
                    "gateway_overloaded",
                    "the gateway is at its concurrency limit; retry shortly".into(),
                )
            },
            ApiError::RateLimited(l) => Parts {
                retry_after_secs: Some(l.retry_after_secs),
                ..p(
                    StatusCode::TOO_MANY_REQUESTS,
                    RATE,
                    "rate_limit_exceeded",
                    format!("rate limit reached: {}", l.what),
                )
            },
            ApiError::RegistryStale { max_age } => p(
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER,
                "registry_stale",
                format!(
                    "the registry snapshot is older than {} s (Postgres is unreachable), so \
                     revocations may be missed; retry when it is back",
                    max_age.as_secs()
                ),
            ),
            ApiError::AuditUnavailable { reason } => Parts {
                retry_after_secs: Some(5),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    SERVER,
                    "audit_unavailable",
                    reason.clone(),
                )
            },
            ApiError::RowNotDurable => Parts {
                retry_after_secs: Some(5),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    SERVER,
                    "audit_unavailable",
                    "the completion's audit row could not be made durable, so it is not \
                     served; retry shortly"
                        .into(),
                )
            },
            ApiError::NoCompatibleWorker { base_model } => p(
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER,
                "no_compatible_worker",
                format!(
                    "no worker serving base model {base_model} is available; the request was \
                     not sent to any other model"
                ),
            ),
            ApiError::FirstTokenTimeout { after, tried } => p(
                StatusCode::GATEWAY_TIMEOUT,
                SERVER,
                "first_token_timeout",
                format!(
                    "no worker produced a first token within {} s ({tried} tried)",
                    after.as_secs()
                ),
            ),
            ApiError::RequestTimeout { after } => p(
                StatusCode::GATEWAY_TIMEOUT,
                SERVER,
                "request_timeout",
                format!("the request took longer than {after:?}"),
            ),
            ApiError::GatewayShutdown => p(
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER,
                "gateway_shutdown",
                "the gateway is shutting down and its drain deadline passed; retry on another \
                 replica"
                    .into(),
            ),
            ApiError::Worker(WorkerFailure::InvalidRequest {
                field,
                message,
                context,
            }) => Parts {
                param: field.clone(),
                ..p(
                    StatusCode::BAD_REQUEST,
                    INVALID,
                    if *context {
                        "context_length_exceeded"
                    } else {
                        "invalid_request"
                    },
                    message.clone(),
                )
            },
            ApiError::ContextLength {
                prompt_tokens,
                max_tokens,
                max_model_len,
            } => {
                // The prompt is at fault when it fills the context alone
                // (a token-id prompt is only ever sent as `prompt`).
                let field = match prompt_tokens {
                    Some(n) if *n >= u64::from(*max_model_len) => "prompt",
                    _ => "max_tokens",
                };
                Parts {
                    param: Some(field.into()),
                    ..p(
                        StatusCode::BAD_REQUEST,
                        INVALID,
                        "context_length_exceeded",
                        match prompt_tokens {
                            Some(n) => format!(
                                "{field}: the prompt ({n} tokens) plus max_tokens ({max_tokens}) \
                             exceeds the model's context of {max_model_len} tokens"
                            ),
                            None => format!(
                                "max_tokens: {max_tokens} exceeds the model's context of \
                             {max_model_len} tokens"
                            ),
                        },
                    )
                }
            }
            ApiError::Worker(WorkerFailure::AdapterUnavailable { reason }) => p(
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER,
                "adapter_unavailable",
                format!("the adapter for this model could not be loaded ({reason})"),
            ),
            ApiError::Worker(WorkerFailure::Unavailable { reason }) => p(
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER,
                "workers_unavailable",
                format!("no worker could serve the request ({reason})"),
            ),
        }
    }

    pub fn status(&self) -> StatusCode {
        self.parts().status
    }

    pub fn code(&self) -> &'static str {
        self.parts().code
    }

    /// A credential refused by [`crate::auth`].
    pub fn unauthorized(e: AuthError) -> ApiError {
        // The credential is good; its tenant is not allowed in.
        if e == AuthError::TenantDisabled {
            ApiError::TenantDisabled
        } else {
            ApiError::Unauthenticated(e)
        }
    }
}

impl From<BadRequest> for ApiError {
    fn from(b: BadRequest) -> ApiError {
        ApiError::BadRequest(b)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let parts = self.parts();
        let body = openai::error_body(
            &parts.message,
            parts.kind,
            parts.param.as_deref(),
            Some(parts.code),
        );
        let mut r = (parts.status, axum::Json(body)).into_response();
        if let Some(secs) = parts.retry_after_secs {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant, once: each has a stable code, a client or server
    /// status as its kind says, and 429s and audit refusals say when to
    /// come back.
    #[test]
    fn every_error_maps_to_a_status_and_a_stable_code() {
        let d = Duration::from_secs(3);
        let all = [
            ApiError::Unauthenticated(AuthError::Missing),
            ApiError::FailedAuthLimited { retry_after: d },
            ApiError::TenantDisabled,
            ApiError::InsufficientScope {
                scope: "inference",
                what: "run completions",
            },
            ApiError::ModelNotFound { model: "m".into() },
            ApiError::BadRequest(BadRequest {
                param: "max_tokens".into(),
                message: "max_tokens: bad".into(),
            }),
            ApiError::BodyTooLarge { limit: 1 },
            ApiError::BodyTimeout { after: d },
            ApiError::TenantConcurrency { per_tenant: 4 },
            ApiError::GatewayOverloaded,
            ApiError::RateLimited(Limited {
                retry_after_secs: 7,
                what: "requests per minute",
            }),
            ApiError::RegistryStale { max_age: d },
            ApiError::AuditUnavailable {
                reason: "full".into(),
            },
            ApiError::RowNotDurable,
            ApiError::NoCompatibleWorker {
                base_model: "b".into(),
            },
            ApiError::FirstTokenTimeout { after: d, tried: 2 },
            ApiError::RequestTimeout { after: d },
            ApiError::GatewayShutdown,
            ApiError::Worker(WorkerFailure::InvalidRequest {
                field: Some("prompt".into()),
                message: "prompt: too long".into(),
                context: false,
            }),
            ApiError::ContextLength {
                prompt_tokens: Some(3),
                max_tokens: 100,
                max_model_len: 64,
            },
            ApiError::Worker(WorkerFailure::AdapterUnavailable {
                reason: "artifact_digest_mismatch".into(),
            }),
            ApiError::Worker(WorkerFailure::Unavailable {
                reason: "queue_full".into(),
            }),
        ];
        let mut codes = std::collections::BTreeSet::new();
        for e in &all {
            let p = e.parts();
            assert!(!p.message.is_empty(), "{e:?}");
            assert!(
                p.code.chars().all(|c| c.is_ascii_lowercase() || c == '_'),
                "{e:?}"
            );
            let client = p.status.is_client_error();
            assert_eq!(client, p.kind != SERVER, "{e:?}: {} {}", p.status, p.kind);
            if p.status == StatusCode::TOO_MANY_REQUESTS {
                assert!(p.retry_after_secs.is_some(), "{e:?}");
            }
            codes.insert(p.code);
        }
        // Two variants share a code on purpose (a row that cannot be made
        // durable is the audit log being unavailable; a worker's refusal of
        // a field is an invalid request).
        assert_eq!(codes.len(), all.len() - 2);
        assert_eq!(
            ApiError::unauthorized(AuthError::TenantDisabled).status(),
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            ApiError::ModelNotFound { model: "m".into() }
                .parts()
                .param
                .as_deref(),
            Some("model")
        );
    }

    #[test]
    fn a_workers_field_reaches_the_client_as_the_field_it_sent() {
        use lorafleet_domain::generation::Field;
        let long_chat = UpstreamError {
            kind: UpstreamErrorKind::InvalidRequest {
                field: Some(Field::Prompt),
            },
            reason: None,
            message: "prompt: 9000 tokens and max_tokens 16 exceed the context (8192)".into(),
            detail: String::new(),
        };
        match WorkerFailure::from_upstream(&long_chat, Endpoint::Chat) {
            WorkerFailure::InvalidRequest { field, message, .. } => {
                assert_eq!(field.as_deref(), Some("messages"));
                assert!(message.starts_with("messages: 9000 tokens"), "{message}");
            }
            other => panic!("{other:?}"),
        }
        let upstream = UpstreamError {
            kind: UpstreamErrorKind::InvalidRequest {
                field: Some(Field::MaxTokens),
            },
            reason: None,
            message: "sampling.max_tokens: 99 exceeds the context".into(),
            detail: String::new(),
        };
        assert_eq!(
            WorkerFailure::from_upstream(&upstream, Endpoint::Completions),
            WorkerFailure::InvalidRequest {
                field: Some("max_tokens".into()),
                message: "max_tokens: 99 exceeds the context".into(),
                context: false,
            }
        );
        // A field no client parameter stands for keeps the worker's words.
        let internal = UpstreamError {
            kind: UpstreamErrorKind::InvalidRequest {
                field: Some(Field::RequestId),
            },
            reason: None,
            message: "request_id: is required".into(),
            detail: String::new(),
        };
        assert!(matches!(
            WorkerFailure::from_upstream(&internal, Endpoint::Chat),
            WorkerFailure::InvalidRequest { field: None, .. }
        ));
    }
}
