//! The console's pages, one file each: fleet, routes, adapters, tenants
//! and keys, audit, changes, usage.

use axum::extract::{Path, Query};
use serde::Serialize;

use super::client::seg;
use super::*;

mod adapters;
mod audit;
mod changes;
mod fleet;
mod routes;
mod tenants;
mod usage;

pub(super) fn router() -> Router<Console> {
    Router::new()
        .route("/console/fleet", get(fleet::page))
        .route("/console/fleet/live", get(fleet::live))
        .route("/console/routes", get(routes::list))
        .route("/console/routes/{tenant}/{model}", get(routes::page))
        .route(
            "/console/routes/{tenant}/{model}/weights",
            post(routes::set_weights),
        )
        .route(
            "/console/routes/{tenant}/{model}/promote",
            post(routes::promote),
        )
        .route(
            "/console/routes/{tenant}/{model}/rollback",
            post(routes::rollback),
        )
        .route(
            "/console/routes/{tenant}/{model}/rollout",
            post(routes::start_rollout),
        )
        .route(
            "/console/routes/{tenant}/{model}/rollout/{action}",
            post(routes::change_rollout),
        )
        .route(
            "/console/adapters",
            get(adapters::page).post(adapters::register),
        )
        .route(
            "/console/adapters/{lora_int_id}/retire",
            post(adapters::retire),
        )
        .route("/console/tenants", get(tenants::list).post(tenants::create))
        .route("/console/tenants/{tenant}", get(tenants::page))
        .route(
            "/console/tenant-tokens/revoke",
            post(tenants::revoke_tenant_token),
        )
        .route("/console/tenants/{tenant}/disable", post(tenants::disable))
        .route("/console/tenants/{tenant}/enable", post(tenants::enable))
        .route("/console/tenants/{tenant}/keys", post(tenants::create_key))
        .route(
            "/console/tenants/{tenant}/limits",
            post(tenants::update_limits),
        )
        .route(
            "/console/tenants/{tenant}/keys/{prefix}/revoke",
            post(tenants::revoke_key),
        )
        .route("/console/audit", get(audit::page))
        .route("/console/audit/export", get(audit::export))
        .route("/console/audit/{request_id}", get(audit::row))
        .route("/console/changes", get(changes::page))
        .route("/console/usage", get(usage::page))
}

/// What the last form submission left for the page to show: which form it
/// was, its refusal (shown beside the field it names) with the values as
/// typed, or a notice of what was done.
#[derive(Debug, Default, Serialize)]
pub(super) struct Outcome {
    pub form: Option<&'static str>,
    pub error: Option<ApiError>,
    pub echo: Value,
    pub notice: Option<String>,
}

impl Outcome {
    pub fn refused(form: &'static str, error: ApiError, fields: Option<&Fields>) -> Outcome {
        Outcome {
            form: Some(form),
            error: Some(error),
            echo: fields.map_or(Value::Null, Fields::echo),
            notice: None,
        }
    }

    pub fn status(&self) -> StatusCode {
        self.error.as_ref().map_or(StatusCode::OK, |e| e.status)
    }
}

/// Renders a page from its loaded data, or the loading error.
fn show(
    c: &Console,
    s: &Session,
    template: &str,
    nav: &str,
    outcome: Outcome,
    data: Result<Value, ApiError>,
) -> Response {
    match data {
        Ok(mut data) => {
            let status = outcome.status();
            data["nav"] = Value::String(nav.into());
            let mut o = serde_json::to_value(&outcome).unwrap_or_else(|_| json!({}));
            // Templates look fields up by name: the refusal's field, and
            // the values as typed, always as objects.
            let mut errors = serde_json::Map::new();
            if let Some(e) = &outcome.error
                && let Some(p) = &e.param
            {
                errors.insert(p.clone(), Value::String(e.message.clone()));
            }
            o["errors"] = Value::Object(errors);
            if !o["echo"].is_object() {
                o["echo"] = json!({});
            }
            data["outcome"] = o;
            c.render(Some(s), template, status, data)
        }
        Err(e) => c.error_page(Some(s), &e),
    }
}

/// A form's optional number, or a refusal naming its field.
fn number<T: std::str::FromStr>(fields: &Fields, name: &str) -> Result<Option<T>, ApiError> {
    match non_blank(fields.get(name)) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|_| ApiError::field(name, &format!("{v:?} is not a valid number"))),
    }
}

/// A short form of a long hex digest.
fn short(digest: &str) -> String {
    digest.chars().take(12).collect()
}
