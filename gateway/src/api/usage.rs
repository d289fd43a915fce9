//! `GET /v1/usage?from&to&group_by`: a tenant's own usage, with any of its
//! API keys or JWTs (scope `inference` or `models:read`), from the same hourly rollups
//! as the admin plane's report ([`crate::usage`]) and scoped to the
//! caller's tenant: there is no `tenant` to ask for or group by. Routes are
//! named by the model name the tenant calls them by.

use axum::extract::{Query, State};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::Deserialize;
use serde_json::{Value, json};

use super::openai;
use super::{ApiError, AppState, client_of, failed_auth, principal};
use crate::auth;
use crate::usage::{Grouping, UsageError, UsageQuery};

/// The query string.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Params {
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    /// Comma-separated among route, adapter and one of day or hour.
    group_by: Option<String>,
}

pub(super) async fn usage(State(s): State<AppState>, request: axum::extract::Request) -> Response {
    let (parts, _body) = request.into_parts();
    let client = client_of(&s, &parts);
    match report(&s, &parts).await {
        Ok(r) => r,
        Err(ApiError::Unauthenticated(why)) => {
            failed_auth(&s, client, &parts.headers, why).into_response()
        }
        Err(e) => e.into_response(),
    }
}

fn bad(param: &str, message: impl std::fmt::Display) -> ApiError {
    ApiError::BadRequest(openai::bad(param, message.to_string()))
}

async fn report(s: &AppState, parts: &axum::http::request::Parts) -> Result<Response, ApiError> {
    let snapshot = s.registry.snapshot();
    let p = principal(s, &snapshot, &parts.headers)?;
    if !p.has_scope(auth::SCOPE_MODELS_READ) && !p.has_scope(auth::SCOPE_INFERENCE) {
        return Err(ApiError::InsufficientScope {
            scope: auth::SCOPE_MODELS_READ,
            what: "read usage",
        });
    }
    let Query(params) =
        Query::<Params>::try_from_uri(&parts.uri).map_err(|e| bad("query", e.body_text()))?;
    let refused = |e: UsageError| match e {
        UsageError::Field { field, reason } => bad(field, reason),
        UsageError::Db(e) => {
            tracing::warn!(error = %e, "a usage report failed");
            ApiError::UsageUnavailable
        }
    };
    let grouping = Grouping::parse(
        params.group_by.as_deref(),
        &["route", "adapter", "day", "hour"],
    )
    .map_err(refused)?;
    let query =
        UsageQuery::new(params.from, params.to, grouping, Some(p.tenant_id.0)).map_err(refused)?;
    // A few reports at once: the pool they share serves audit inserts.
    let _permit = s
        .usage_reports
        .try_acquire()
        .map_err(|_| ApiError::GatewayOverloaded)?;
    let rows = query.rows(&s.usage_pool).await.map_err(refused)?;
    let routes = snapshot.routes_of(&p.tenant_id);
    let data: Vec<Value> = rows
        .into_iter()
        .map(|r| {
            let model = r.route_id.map(|id| {
                routes
                    .iter()
                    .find(|route| route.id.0 == id)
                    .map_or_else(|| id.to_string(), |route| route.model_name.clone())
            });
            json!({
                "object": "usage",
                "period": r.period,
                "model": model,
                "lora_int_id": r.lora_int_id,
                "evaluation": r.evaluation,
                "requests": r.requests,
                "completed": r.completed,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "cached_tokens": r.cached_tokens,
                "device_seconds": r.device_seconds,
                "load_seconds": r.load_seconds,
                "device_cost": r.device_cost,
                "token_cost": r.token_cost,
                "cost": r.cost,
            })
        })
        .collect();
    Ok(axum::Json(json!({"object": "list", "data": data})).into_response())
}
