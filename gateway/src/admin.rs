//! The admin API, under `/admin/v1` on its own listen address: tenants, API
//! keys, base models, adapter versions, routes and canaries, the fleet view,
//! and audit-log queries.
//!
//! - Callers present an admin JWT whose `role` claim is `admin` (every
//!   operation), `auditor` (reads and audit queries) or `viewer` (reads).
//! - Every change runs in one transaction that also writes its
//!   `admin_changes` row (who, what, when, before and after). After commit
//!   this replica reloads its registry snapshot and the change is announced
//!   on Redis, so the other replicas reload within moments.
//! - Route changes are optimistic: a route's etag is its current revision,
//!   and a change must send `If-Match` with it.
//! - Errors use the OpenAI shape, with `param` naming the field at fault.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use chrono::{DateTime, Utc};
use lorafleet_engine::artifact::{ArtifactError, ArtifactRoots};
use lorafleet_engine::lora::config::AdapterConfig;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use sqlx::{PgPool, Postgres, QueryBuilder, Transaction};
use uuid::Uuid;

use crate::auth::{self, JwtConfig};
use crate::fleet::Fleet;
use crate::registry::{self, Registry};

/// The projections a LoRA may target in each architecture the registry
/// accepts. Llama, Mistral and Qwen2 share one layer layout.
/// SQL assembled from this module's own constants (column lists, a lock
/// clause), never from input: input always travels as bind parameters.
macro_rules! sql {
    ($($t:tt)*) => {
        sqlx::AssertSqlSafe(format!($($t)*))
    };
}

const LLAMA_FAMILY_MODULES: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];
const ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2"];

/// Admin roles, from the token's `role` claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Auditor,
    Viewer,
}

/// What an operation needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Need {
    Read,
    Audit,
    Write,
}

impl Role {
    fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "auditor" => Some(Role::Auditor),
            "viewer" => Some(Role::Viewer),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Auditor => "auditor",
            Role::Viewer => "viewer",
        }
    }

    fn allows(self, need: Need) -> bool {
        match self {
            Role::Admin => true,
            Role::Auditor => need != Need::Write,
            Role::Viewer => need == Need::Read,
        }
    }
}

/// Everything the admin API needs. Cheap to clone.
#[derive(Debug, Clone)]
pub struct AdminState {
    pub pool: PgPool,
    pub registry: Registry,
    pub redis: Option<redis::aio::ConnectionManager>,
    /// The registry change channel.
    pub channel: String,
    pub jwt: Arc<JwtConfig>,
    /// Where adapter artifacts live; None turns adapter registration off.
    pub artifact_roots: Option<Arc<ArtifactRoots>>,
    /// The largest LoRA rank any worker pool accepts.
    pub max_lora_rank: usize,
    pub fleet: Fleet,
}

pub fn router(state: AdminState) -> Router {
    Router::new()
        .route("/admin/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/admin/v1/tenants/{tenant}/disable", post(disable_tenant))
        .route("/admin/v1/tenants/{tenant}/enable", post(enable_tenant))
        .route(
            "/admin/v1/tenants/{tenant}/keys",
            get(list_keys).post(create_key),
        )
        .route("/admin/v1/keys/{prefix}/revoke", post(revoke_key))
        .route(
            "/admin/v1/base-models",
            get(list_base_models).post(register_base_model),
        )
        .route(
            "/admin/v1/adapters",
            get(list_adapters).post(register_adapter),
        )
        .route(
            "/admin/v1/adapters/{lora_int_id}/retire",
            post(retire_adapter),
        )
        .route("/admin/v1/routes", get(list_routes))
        .route(
            "/admin/v1/routes/{tenant}/{model}",
            get(get_route).put(put_route),
        )
        .route("/admin/v1/routes/{tenant}/{model}/promote", post(promote))
        .route("/admin/v1/routes/{tenant}/{model}/rollback", post(rollback))
        .route("/admin/v1/fleet", get(fleet_view))
        .route("/admin/v1/audit", get(audit_query))
        .route("/admin/v1/changes", get(list_changes))
        .route("/healthz", get(|| async { "ok" }))
        .fallback(|| async {
            AdminError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                None,
                "no such admin endpoint".into(),
            )
        })
        .with_state(state)
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// An error response: `{"error": {"message", "type", "code", "param"}}`.
#[derive(Debug)]
pub struct AdminError {
    status: StatusCode,
    code: &'static str,
    param: Option<String>,
    message: String,
}

impl AdminError {
    fn new(
        status: StatusCode,
        code: &'static str,
        param: Option<&str>,
        message: String,
    ) -> AdminError {
        AdminError {
            status,
            code,
            param: param.map(str::to_owned),
            message,
        }
    }

    /// A field that is malformed: 400.
    fn field(param: &str, message: impl Into<String>) -> AdminError {
        AdminError::new(
            StatusCode::BAD_REQUEST,
            "invalid_field",
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }

    /// Well-formed but refused by a rule: 422.
    fn unprocessable(code: &'static str, param: &str, message: impl Into<String>) -> AdminError {
        AdminError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            code,
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }

    fn not_found(param: &str, what: impl Into<String>) -> AdminError {
        AdminError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            Some(param),
            format!("{param}: {} does not exist", what.into()),
        )
    }

    fn conflict(code: &'static str, param: &str, message: impl Into<String>) -> AdminError {
        AdminError::new(
            StatusCode::CONFLICT,
            code,
            Some(param),
            format!("{param}: {}", message.into()),
        )
    }

    fn internal(e: impl std::fmt::Display) -> AdminError {
        tracing::error!(error = %e, "admin request failed");
        AdminError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            None,
            format!("internal error: {e}"),
        )
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        let kind = match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            409 | 412 | 428 => "conflict_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "code": self.code,
            "param": self.param,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// Maps a database error to the field it concerns, using the schema's
/// named constraints; anything else is a 500 (or 503 when Postgres is away).
fn db_error(e: sqlx::Error) -> AdminError {
    if let sqlx::Error::Database(d) = &e
        && let Some(constraint) = d.constraint()
    {
        let message = d.message().to_owned();
        let (status, code, param) = match constraint {
            "tenants_name_unique" => (StatusCode::CONFLICT, "duplicate", "name"),
            "tenants_name_format" => (StatusCode::BAD_REQUEST, "invalid_field", "name"),
            "tenants_rpm_limit_positive" => (StatusCode::BAD_REQUEST, "invalid_field", "rpm_limit"),
            "tenants_tpm_limit_positive" => (StatusCode::BAD_REQUEST, "invalid_field", "tpm_limit"),
            "base_models_name_unique" => (StatusCode::CONFLICT, "duplicate", "name"),
            "base_models_base_hash_unique" => (StatusCode::CONFLICT, "duplicate", "base_hash"),
            "adapters_name_version_unique" => (StatusCode::CONFLICT, "duplicate", "version"),
            "adapters_name_format" => (StatusCode::BAD_REQUEST, "invalid_field", "name"),
            "adapters_artifact_uri_relative" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "artifact_outside_root",
                "artifact_uri",
            ),
            "adapters_alpha_finite_positive" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_adapter_config",
                "adapter_config.json.lora_alpha",
            ),
            "routes_model_name_format" => (StatusCode::BAD_REQUEST, "invalid_field", "model"),
            "route_weights_adapter_active" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "adapter_retired",
                "weights",
            ),
            "route_weights_adapter_tenant" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "adapter_of_another_tenant",
                "weights",
            ),
            "route_weights_adapter_same_base_fk" => (
                StatusCode::UNPROCESSABLE_ENTITY,
                "mixed_base_models",
                "weights",
            ),
            "route_revisions_weights_sum_10000" => {
                (StatusCode::UNPROCESSABLE_ENTITY, "weights_sum", "weights")
            }
            "api_keys_expiry_after_creation" => {
                (StatusCode::BAD_REQUEST, "invalid_field", "expires_at")
            }
            _ => return AdminError::internal(e),
        };
        return AdminError::new(status, code, Some(param), format!("{param}: {message}"));
    }
    if matches!(e, sqlx::Error::PoolTimedOut | sqlx::Error::Io(_)) {
        return AdminError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "database_unavailable",
            None,
            format!("the registry database is unavailable: {e}"),
        );
    }
    AdminError::internal(e)
}

/// Parses a JSON body, naming the field that is wrong.
fn parse_body<T: DeserializeOwned>(body: &Bytes) -> Result<T, AdminError> {
    let mut de = serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." {
            AdminError::field("body", format!("is not a valid JSON object: {inner}"))
        } else {
            AdminError::field(&path, inner.to_string())
        }
    })
}

// ---------------------------------------------------------------------------
// Authentication and change recording
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
struct AdminClaims {
    sub: String,
    role: String,
}

/// The authenticated admin and this request's id.
#[derive(Debug)]
struct Actor {
    subject: String,
    role: Role,
    request_id: Uuid,
}

fn authorize(state: &AdminState, headers: &HeaderMap, need: Need) -> Result<Actor, AdminError> {
    let unauthorized =
        |m: String| AdminError::new(StatusCode::UNAUTHORIZED, "invalid_admin_token", None, m);
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let token = auth::bearer(value).map_err(|e| unauthorized(e.to_string()))?;
    let claims: AdminClaims =
        auth::decode_jwt(token, &state.jwt).map_err(|e| unauthorized(e.to_string()))?;
    if claims.sub.trim().is_empty() {
        return Err(unauthorized("invalid token: sub is empty".into()));
    }
    let role = Role::parse(&claims.role).ok_or_else(|| {
        unauthorized(format!(
            "invalid token: role {:?} is not admin, auditor or viewer",
            claims.role
        ))
    })?;
    if !role.allows(need) {
        let what = match need {
            Need::Read => "read the registry",
            Need::Audit => "query the audit log",
            Need::Write => "change the registry",
        };
        return Err(AdminError::new(
            StatusCode::FORBIDDEN,
            "insufficient_role",
            None,
            format!("role {} may not {what}", role.name()),
        ));
    }
    Ok(Actor {
        subject: claims.sub,
        role,
        request_id: Uuid::now_v7(),
    })
}

/// One change, recorded in the same transaction as the change itself.
async fn record(
    tx: &mut Transaction<'_, Postgres>,
    actor: &Actor,
    action: &str,
    object: (&str, &str),
    before: Option<Value>,
    after: Option<Value>,
) -> Result<(), AdminError> {
    sqlx::query(
        "INSERT INTO admin_changes (actor, role, action, object_type, object_id, before, after, request_id)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8)",
    )
    .bind(&actor.subject)
    .bind(actor.role.name())
    .bind(action)
    .bind(object.0)
    .bind(object.1)
    .bind(before)
    .bind(after)
    .bind(actor.request_id)
    .execute(&mut **tx)
    .await
    .map_err(db_error)?;
    tracing::info!(
        actor = %actor.subject,
        action,
        object_type = object.0,
        object_id = object.1,
        request_id = %actor.request_id,
        "admin change"
    );
    Ok(())
}

/// Records a change in its own transaction, then commits and announces it.
async fn commit_change(
    state: &AdminState,
    mut tx: Transaction<'_, Postgres>,
    actor: &Actor,
    action: &str,
    object: (&str, &str),
    before: Option<Value>,
    after: Option<Value>,
) -> Result<(), AdminError> {
    record(&mut tx, actor, action, object, before, after).await?;
    commit(state, tx).await
}

/// Commits a recorded change; then this replica reloads now, and the others
/// on the announcement.
async fn commit(state: &AdminState, tx: Transaction<'_, Postgres>) -> Result<(), AdminError> {
    tx.commit().await.map_err(db_error)?;
    let _ = state.registry.reload(&state.pool).await;
    if let Some(mut redis) = state.redis.clone()
        && let Err(e) = registry::announce_change(&mut redis, &state.channel).await
    {
        tracing::warn!(error = %e, "could not announce a registry change; other replicas pick it up at their next refresh");
    }
    Ok(())
}

/// A JSON response carrying the request id.
fn reply(status: StatusCode, actor: &Actor, body: Value) -> Response {
    let mut r = (status, axum::Json(body)).into_response();
    if let Ok(v) = HeaderValue::from_str(&actor.request_id.to_string()) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}

// ---------------------------------------------------------------------------
// Tenants
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize, sqlx::FromRow)]
struct TenantRow {
    name: String,
    display_name: String,
    rpm_limit: Option<i32>,
    tpm_limit: Option<i64>,
    created_at: DateTime<Utc>,
    disabled_at: Option<DateTime<Utc>>,
}

const TENANT_COLUMNS: &str = "name, display_name, rpm_limit, tpm_limit, created_at, disabled_at";

fn to_json<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

async fn list_tenants(
    State(s): State<AdminState>,
    headers: HeaderMap,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
    let rows: Vec<TenantRow> =
        sqlx::query_as(sql!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY name"))
            .fetch_all(&s.pool)
            .await
            .map_err(db_error)?;
    Ok(reply(StatusCode::OK, &actor, json!({ "tenants": rows })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewTenant {
    name: String,
    #[serde(default)]
    display_name: String,
    rpm_limit: Option<u32>,
    tpm_limit: Option<u64>,
}

fn check_tenant_name(name: &str, param: &str) -> Result<(), AdminError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(AdminError::field(
            param,
            format!("{name:?} must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'"),
        ))
    }
}

async fn create_tenant(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let t: NewTenant = parse_body(&body)?;
    check_tenant_name(&t.name, "name")?;
    if t.rpm_limit == Some(0) {
        return Err(AdminError::field("rpm_limit", "must be at least 1"));
    }
    if t.tpm_limit == Some(0) {
        return Err(AdminError::field("tpm_limit", "must be at least 1"));
    }
    let rpm = t
        .rpm_limit
        .map(|v| i32::try_from(v).map_err(|_| AdminError::field("rpm_limit", "is too large")))
        .transpose()?;
    let tpm = t
        .tpm_limit
        .map(|v| i64::try_from(v).map_err(|_| AdminError::field("tpm_limit", "is too large")))
        .transpose()?;
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let row: TenantRow = sqlx::query_as(sql!(
        "INSERT INTO tenants (name, display_name, rpm_limit, tpm_limit) VALUES ($1, $2, $3, $4)
         RETURNING {TENANT_COLUMNS}"
    ))
    .bind(&t.name)
    .bind(&t.display_name)
    .bind(rpm)
    .bind(tpm)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| match db_error(e) {
        e if e.code == "duplicate" => AdminError::conflict(
            "duplicate",
            "name",
            format!("tenant {:?} already exists", t.name),
        ),
        e => e,
    })?;
    commit_change(
        &s,
        tx,
        &actor,
        "tenant.create",
        ("tenant", &row.name),
        None,
        Some(to_json(&row)),
    )
    .await?;
    Ok(reply(StatusCode::CREATED, &actor, to_json(&row)))
}

async fn set_tenant_disabled(
    s: AdminState,
    headers: HeaderMap,
    name: String,
    disable: bool,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let before: Option<TenantRow> = sqlx::query_as(sql!(
        "SELECT {TENANT_COLUMNS} FROM tenants WHERE name = $1 FOR UPDATE"
    ))
    .bind(&name)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db_error)?;
    let before =
        before.ok_or_else(|| AdminError::not_found("tenant", format!("tenant {name:?}")))?;
    if before.disabled_at.is_some() == disable {
        let state = if disable { "disabled" } else { "enabled" };
        return Err(AdminError::conflict(
            "no_change",
            "tenant",
            format!("tenant {name:?} is already {state}"),
        ));
    }
    let after: TenantRow = sqlx::query_as(sql!(
        "UPDATE tenants SET disabled_at = CASE WHEN $2 THEN now() ELSE NULL END WHERE name = $1
         RETURNING {TENANT_COLUMNS}"
    ))
    .bind(&name)
    .bind(disable)
    .fetch_one(&mut *tx)
    .await
    .map_err(db_error)?;
    let action = if disable {
        "tenant.disable"
    } else {
        "tenant.enable"
    };
    commit_change(
        &s,
        tx,
        &actor,
        action,
        ("tenant", &name),
        Some(to_json(&before)),
        Some(to_json(&after)),
    )
    .await?;
    Ok(reply(StatusCode::OK, &actor, to_json(&after)))
}

async fn disable_tenant(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, AdminError> {
    set_tenant_disabled(s, headers, name, true).await
}

async fn enable_tenant(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Result<Response, AdminError> {
    set_tenant_disabled(s, headers, name, false).await
}

async fn base_model_id(ex: impl sqlx::PgExecutor<'_>, name: &str) -> Result<i64, AdminError> {
    sqlx::query_scalar("SELECT id FROM base_models WHERE name = $1")
        .bind(name)
        .fetch_optional(ex)
        .await
        .map_err(db_error)?
        .ok_or_else(|| AdminError::not_found("base_model", format!("base model {name:?}")))
}

async fn tenant_id(
    ex: impl sqlx::PgExecutor<'_>,
    name: &str,
    param: &str,
) -> Result<Uuid, AdminError> {
    sqlx::query_scalar("SELECT id FROM tenants WHERE name = $1")
        .bind(name)
        .fetch_optional(ex)
        .await
        .map_err(db_error)?
        .ok_or_else(|| AdminError::not_found(param, format!("tenant {name:?}")))
}

// ---------------------------------------------------------------------------
// API keys
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize, sqlx::FromRow)]
struct KeyRow {
    prefix: String,
    tenant: String,
    name: String,
    scopes: Vec<String>,
    created_at: DateTime<Utc>,
    expires_at: Option<DateTime<Utc>>,
    revoked_at: Option<DateTime<Utc>>,
}

const KEY_SELECT: &str =
    "SELECT k.prefix, t.name AS tenant, k.name, k.scopes, k.created_at, k.expires_at, k.revoked_at
     FROM api_keys k JOIN tenants t ON t.id = k.tenant_id";

async fn list_keys(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
    let id = tenant_id(&s.pool, &tenant, "tenant").await?;
    let rows: Vec<KeyRow> = sqlx::query_as(sql!(
        "{KEY_SELECT} WHERE k.tenant_id = $1 ORDER BY k.created_at, k.prefix"
    ))
    .bind(id)
    .fetch_all(&s.pool)
    .await
    .map_err(db_error)?;
    Ok(reply(StatusCode::OK, &actor, json!({ "keys": rows })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewKey {
    #[serde(default)]
    name: String,
    scopes: Option<Vec<String>>,
    expires_at: Option<DateTime<Utc>>,
    expires_in_secs: Option<u64>,
}

async fn create_key(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    body: Bytes,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let k: NewKey = parse_body(&body)?;
    let scopes = k.scopes.unwrap_or_else(|| {
        vec![
            auth::SCOPE_INFERENCE.to_owned(),
            auth::SCOPE_MODELS_READ.to_owned(),
        ]
    });
    if scopes.is_empty() {
        return Err(AdminError::field("scopes", "must name at least one scope"));
    }
    for (i, scope) in scopes.iter().enumerate() {
        if scope != auth::SCOPE_INFERENCE && scope != auth::SCOPE_MODELS_READ {
            return Err(AdminError::field(
                &format!("scopes[{i}]"),
                format!("{scope:?} is not a scope; expected inference or models:read"),
            ));
        }
    }
    let expires_at = match (k.expires_at, k.expires_in_secs) {
        (Some(_), Some(_)) => {
            return Err(AdminError::field(
                "expires_in_secs",
                "give expires_at or expires_in_secs, not both",
            ));
        }
        (Some(at), None) => Some(at),
        (None, Some(secs)) => {
            let secs = i64::try_from(secs)
                .ok()
                .filter(|s| *s > 0 && *s <= 100 * 365 * 86_400)
                .ok_or_else(|| {
                    AdminError::field("expires_in_secs", "must be between 1 and 100 years")
                })?;
            Some(Utc::now() + chrono::Duration::seconds(secs))
        }
        (None, None) => None,
    };
    if let Some(at) = expires_at
        && at <= Utc::now()
    {
        return Err(AdminError::field(
            "expires_at",
            format!("{} is not in the future", at.to_rfc3339()),
        ));
    }
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let id = tenant_id(&mut *tx, &tenant, "tenant").await?;
    let (prefix, full_key, hash) = auth::new_api_key();
    sqlx::query(
        "INSERT INTO api_keys (tenant_id, prefix, secret_hash, name, scopes, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(id)
    .bind(&prefix)
    .bind(&hash[..])
    .bind(&k.name)
    .bind(&scopes)
    .bind(expires_at)
    .execute(&mut *tx)
    .await
    .map_err(db_error)?;
    let row: KeyRow = sqlx::query_as(sql!("{KEY_SELECT} WHERE k.prefix = $1"))
        .bind(&prefix)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
    commit_change(
        &s,
        tx,
        &actor,
        "api_key.create",
        ("api_key", &prefix),
        None,
        Some(to_json(&row)),
    )
    .await?;
    let mut body = to_json(&row);
    // The only time the secret leaves the gateway.
    body["key"] = Value::String(full_key);
    Ok(reply(StatusCode::CREATED, &actor, body))
}

async fn revoke_key(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(prefix): Path<String>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let before: Option<KeyRow> =
        sqlx::query_as(sql!("{KEY_SELECT} WHERE k.prefix = $1 FOR UPDATE OF k"))
            .bind(&prefix)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error)?;
    let before =
        before.ok_or_else(|| AdminError::not_found("prefix", format!("API key {prefix:?}")))?;
    if before.revoked_at.is_some() {
        return Err(AdminError::conflict(
            "no_change",
            "prefix",
            format!("API key {prefix:?} is already revoked"),
        ));
    }
    sqlx::query("UPDATE api_keys SET revoked_at = now() WHERE prefix = $1")
        .bind(&prefix)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    let after: KeyRow = sqlx::query_as(sql!("{KEY_SELECT} WHERE k.prefix = $1"))
        .bind(&prefix)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
    commit_change(
        &s,
        tx,
        &actor,
        "api_key.revoke",
        ("api_key", &prefix),
        Some(to_json(&before)),
        Some(to_json(&after)),
    )
    .await?;
    Ok(reply(StatusCode::OK, &actor, to_json(&after)))
}

// ---------------------------------------------------------------------------
// Base models
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize, sqlx::FromRow)]
struct BaseModelRow {
    name: String,
    architecture: String,
    base_hash: String,
    created_at: DateTime<Utc>,
}

async fn list_base_models(
    State(s): State<AdminState>,
    headers: HeaderMap,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
    let rows: Vec<BaseModelRow> = sqlx::query_as(
        "SELECT name, architecture, base_hash, created_at FROM base_models ORDER BY name",
    )
    .fetch_all(&s.pool)
    .await
    .map_err(db_error)?;
    Ok(reply(
        StatusCode::OK,
        &actor,
        json!({ "base_models": rows }),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewBaseModel {
    name: String,
    architecture: String,
    base_hash: String,
}

fn check_model_name(name: &str, param: &str) -> Result<(), AdminError> {
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._:/-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(AdminError::field(
            param,
            format!(
                "{name:?} must be 1-128 characters of letters, digits and . _ : / -, starting with a letter or digit"
            ),
        ))
    }
}

async fn register_base_model(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let b: NewBaseModel = parse_body(&body)?;
    check_model_name(&b.name, "name")?;
    if !ARCHITECTURES.contains(&b.architecture.as_str()) {
        return Err(AdminError::field(
            "architecture",
            format!(
                "{:?} is not supported; expected one of {}",
                b.architecture,
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    if !(b.base_hash.len() == 64
        && b.base_hash
            .bytes()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)))
    {
        return Err(AdminError::field(
            "base_hash",
            "must be 64 lowercase hex digits (lorafleetctl base-models hash DIR computes it)",
        ));
    }
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let row: BaseModelRow = sqlx::query_as(
        "INSERT INTO base_models (name, architecture, base_hash) VALUES ($1, $2, $3)
         RETURNING name, architecture, base_hash, created_at",
    )
    .bind(&b.name)
    .bind(&b.architecture)
    .bind(&b.base_hash)
    .fetch_one(&mut *tx)
    .await
    .map_err(db_error)?;
    commit_change(
        &s,
        tx,
        &actor,
        "base_model.register",
        ("base_model", &row.name),
        None,
        Some(to_json(&row)),
    )
    .await?;
    Ok(reply(StatusCode::CREATED, &actor, to_json(&row)))
}

// ---------------------------------------------------------------------------
// Adapters
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize, sqlx::FromRow)]
struct AdapterRow {
    lora_int_id: i64,
    name: String,
    version: i32,
    base_model: String,
    tenant: Option<String>,
    rank: i32,
    alpha: f64,
    use_rslora: bool,
    target_modules: Vec<String>,
    artifact_uri: String,
    artifact_sha256: String,
    state: String,
    created_at: DateTime<Utc>,
    retired_at: Option<DateTime<Utc>>,
}

const ADAPTER_SELECT: &str =
    "SELECT a.lora_int_id, a.name, a.version, b.name AS base_model, t.name AS tenant,
        a.rank, a.alpha, a.use_rslora, a.target_modules, a.artifact_uri, a.artifact_sha256,
        a.state::TEXT AS state, a.created_at, a.retired_at
     FROM adapters a JOIN base_models b ON b.id = a.base_model_id
     LEFT JOIN tenants t ON t.id = a.tenant_id";

#[derive(Debug, Deserialize)]
struct AdapterFilter {
    name: Option<String>,
    base_model: Option<String>,
}

async fn list_adapters(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Query(f): Query<AdapterFilter>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
    let rows: Vec<AdapterRow> = sqlx::query_as(sql!(
        "{ADAPTER_SELECT}
         WHERE ($1::TEXT IS NULL OR a.name = $1) AND ($2::TEXT IS NULL OR b.name = $2)
         ORDER BY a.name, a.version"
    ))
    .bind(f.name)
    .bind(f.base_model)
    .fetch_all(&s.pool)
    .await
    .map_err(db_error)?;
    Ok(reply(StatusCode::OK, &actor, json!({ "adapters": rows })))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NewAdapter {
    name: String,
    /// Default: one above the highest version of this name.
    version: Option<u32>,
    base_model: String,
    /// The owning tenant; absent for a platform-wide adapter.
    tenant: Option<String>,
    artifact_uri: String,
}

/// What registration learns from the artifact itself.
#[derive(Debug)]
struct Inspected {
    rank: usize,
    alpha: f32,
    use_rslora: bool,
    targets: Vec<String>,
    digest: String,
}

/// Reads and checks an adapter artifact against a base model: its
/// `adapter_config.json` (every rule the worker applies), the declared base
/// model, rank and target modules against the architecture, the weight
/// file's tensor shapes against the declared ranks, and its digest.
fn inspect_artifact(
    roots: &ArtifactRoots,
    uri: &str,
    adapter_name: &str,
    base_model: &str,
    architecture: &str,
    max_lora_rank: usize,
) -> Result<Inspected, AdminError> {
    let dir = roots.resolve(uri).map_err(|e| match e {
        ArtifactError::OutsideRoots { .. } => AdminError::unprocessable(
            "artifact_outside_root",
            "artifact_uri",
            format!("{uri:?} lies outside the artifact root"),
        ),
        ArtifactError::InvalidUri { reason, .. } => {
            AdminError::unprocessable("invalid_artifact_uri", "artifact_uri", reason)
        }
        ArtifactError::NotFound { .. } => AdminError::unprocessable(
            "artifact_not_found",
            "artifact_uri",
            format!("{uri:?} is not under the artifact root"),
        ),
        other => {
            AdminError::unprocessable("artifact_unreadable", "artifact_uri", other.to_string())
        }
    })?;
    let config_param = "adapter_config.json";
    let text = std::fs::read_to_string(dir.join("adapter_config.json")).map_err(|e| {
        AdminError::unprocessable(
            "invalid_adapter_config",
            config_param,
            format!("cannot be read: {e}"),
        )
    })?;
    let config = AdapterConfig::from_text(adapter_name, &text, None).map_err(|e| {
        use lorafleet_engine::lora::AdapterError;
        let field = match &e {
            AdapterError::Invalid { field, .. } | AdapterError::Unsupported { field, .. } => {
                field.clone()
            }
            _ => String::new(),
        };
        let param = if field.is_empty() || field == config_param {
            config_param.to_owned()
        } else {
            format!("{config_param}.{field}")
        };
        AdminError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_adapter_config",
            Some(&param),
            e.to_string(),
        )
    })?;
    // The declared base: PEFT records the name or path it was trained on;
    // its last path segment must name the base model it is registered to.
    let declared: Option<String> = serde_json::from_str::<Value>(&text).ok().and_then(|v| {
        v.get("base_model_name_or_path")?
            .as_str()
            .map(str::to_owned)
    });
    let base_param = "adapter_config.json.base_model_name_or_path";
    match declared {
        None => {
            return Err(AdminError::unprocessable(
                "base_model_mismatch",
                base_param,
                format!("is missing; the adapter must declare its base model {base_model:?}"),
            ));
        }
        Some(d) => {
            let last = |s: &str| {
                s.trim_end_matches('/')
                    .rsplit('/')
                    .next()
                    .unwrap_or("")
                    .to_owned()
            };
            if d != base_model && last(&d) != last(base_model) {
                return Err(AdminError::unprocessable(
                    "base_model_mismatch",
                    base_param,
                    format!(
                        "{d:?} does not name the base model {base_model:?} it is registered against"
                    ),
                ));
            }
        }
    }
    let rank = config.max_rank();
    if rank > max_lora_rank {
        let param = if config.r > max_lora_rank {
            "adapter_config.json.r"
        } else {
            "adapter_config.json.rank_pattern"
        };
        return Err(AdminError::unprocessable(
            "rank_too_large",
            param,
            format!("rank {rank} is above the fleet's max LoRA rank {max_lora_rank}"),
        ));
    }
    let modules = match architecture {
        "llama" | "mistral" | "qwen2" => LLAMA_FAMILY_MODULES,
        _ => &[][..],
    };
    let targets: Vec<String> = config
        .targets
        .iter()
        .map(|p| p.module_name().to_owned())
        .collect();
    if let Some(t) = targets.iter().find(|t| !modules.contains(&t.as_str())) {
        return Err(AdminError::unprocessable(
            "invalid_adapter_config",
            "adapter_config.json.target_modules",
            format!("{t} is not a projection of a {architecture} model"),
        ));
    }
    check_weight_shapes(
        &dir.join("adapter_model.safetensors"),
        &config,
        adapter_name,
    )?;
    let digest = roots.digest(&dir).map_err(|e| {
        AdminError::unprocessable("artifact_unreadable", "artifact_uri", e.to_string())
    })?;
    Ok(Inspected {
        rank,
        alpha: config.lora_alpha,
        use_rslora: config.use_rslora,
        targets,
        digest,
    })
}

/// Checks the safetensors header: every tensor is a lora_A or lora_B of a
/// targeted module, and its rank dimension is the rank the config gives
/// that module.
fn check_weight_shapes(
    path: &std::path::Path,
    config: &AdapterConfig,
    adapter_name: &str,
) -> Result<(), AdminError> {
    let param = "adapter_model.safetensors";
    let bad = |m: String| AdminError::unprocessable("invalid_adapter_weights", param, m);
    let header = read_safetensors_header(path).map_err(bad)?;
    if header.is_empty() {
        return Err(bad("holds no tensors".into()));
    }
    for (name, info) in &header {
        if name == "__metadata__" {
            continue;
        }
        let shape: Vec<u64> = info
            .get("shape")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect())
            .unwrap_or_default();
        let (module_path, factor) = name
            .strip_prefix("base_model.model.")
            .and_then(|n| {
                n.strip_suffix(".lora_A.weight")
                    .map(|m| (m, 'A'))
                    .or_else(|| n.strip_suffix(".lora_B.weight").map(|m| (m, 'B')))
            })
            .ok_or_else(|| {
                bad(format!(
                    "tensor {name:?} is not a PEFT lora_A or lora_B weight"
                ))
            })?;
        let module = module_path.rsplit('.').next().unwrap_or_default();
        if !config.targets.iter().any(|p| p.module_name() == module) {
            return Err(bad(format!(
                "tensor {name:?} belongs to {module:?}, which target_modules does not list"
            )));
        }
        let (rank, _) = config
            .rank_and_alpha(adapter_name, module_path)
            .map_err(|e| bad(e.to_string()))?;
        let rank_dim = match (factor, shape.as_slice()) {
            ('A', [r, _]) => *r,
            ('B', [_, r]) => *r,
            _ => return Err(bad(format!("tensor {name:?} has shape {shape:?}, not 2-D"))),
        };
        if rank_dim != rank as u64 {
            return Err(bad(format!(
                "tensor {name:?} has rank {rank_dim}, but adapter_config.json gives {module_path} rank {rank}"
            )));
        }
    }
    Ok(())
}

fn read_safetensors_header(
    path: &std::path::Path,
) -> Result<serde_json::Map<String, Value>, String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| format!("cannot be opened: {e}"))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .map_err(|_| "is too short to be safetensors".to_owned())?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return Err(format!(
            "declares a {len}-byte header, which is implausible"
        ));
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .map_err(|_| "ends inside its header".to_owned())?;
    match serde_json::from_slice(&header) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err("has a header that is not a JSON object".into()),
    }
}

async fn register_adapter(
    State(s): State<AdminState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let a: NewAdapter = parse_body(&body)?;
    let name_ok = !a.name.is_empty()
        && a.name.len() <= 128
        && a.name.as_bytes()[0].is_ascii_alphanumeric()
        && a.name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if !name_ok {
        return Err(AdminError::field(
            "name",
            format!(
                "{:?} must be 1-128 characters of letters, digits and . _ -",
                a.name
            ),
        ));
    }
    if a.version == Some(0) {
        return Err(AdminError::field("version", "must be at least 1"));
    }
    // Registries store the URI relative to the root, the same on every
    // host; checked before any file is read.
    let uri = a
        .artifact_uri
        .strip_prefix("file:")
        .unwrap_or(&a.artifact_uri)
        .to_owned();
    if uri.starts_with('/') {
        return Err(AdminError::unprocessable(
            "artifact_outside_root",
            "artifact_uri",
            "must be relative to the artifact root, as every worker resolves it under its own root",
        ));
    }
    let roots = s.artifact_roots.clone().ok_or_else(|| {
        AdminError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no_artifact_root",
            Some("artifact_uri"),
            "this gateway has no --artifact-root, so it cannot read artifacts to register them"
                .into(),
        )
    })?;
    let base: Option<(i64, String)> =
        sqlx::query_as("SELECT id, architecture FROM base_models WHERE name = $1")
            .bind(&a.base_model)
            .fetch_optional(&s.pool)
            .await
            .map_err(db_error)?;
    let (base_id, architecture) = base.ok_or_else(|| {
        AdminError::not_found("base_model", format!("base model {:?}", a.base_model))
    })?;
    let tenant = match &a.tenant {
        Some(t) => Some(tenant_id(&s.pool, t, "tenant").await?),
        None => None,
    };
    // Hashing a large artifact is blocking work.
    let inspected = {
        let (uri, name, base_model, max) = (
            a.artifact_uri.clone(),
            a.name.clone(),
            a.base_model.clone(),
            s.max_lora_rank,
        );
        tokio::task::spawn_blocking(move || {
            inspect_artifact(&roots, &uri, &name, &base_model, &architecture, max)
        })
        .await
        .map_err(AdminError::internal)??
    };
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    // Serialises version numbering per name.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('adapter:' || $1))")
        .bind(&a.name)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    let version: i32 = match a.version {
        Some(v) => i32::try_from(v).map_err(|_| AdminError::field("version", "is too large"))?,
        None => {
            sqlx::query_scalar("SELECT COALESCE(max(version), 0) + 1 FROM adapters WHERE name = $1")
                .bind(&a.name)
                .fetch_one(&mut *tx)
                .await
                .map_err(db_error)?
        }
    };
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO adapters (name, version, base_model_id, tenant_id, rank, alpha, use_rslora,
                               target_modules, artifact_uri, artifact_sha256)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) RETURNING lora_int_id",
    )
    .bind(&a.name)
    .bind(version)
    .bind(base_id)
    .bind(tenant)
    .bind(inspected.rank as i32)
    .bind(f64::from(inspected.alpha))
    .bind(inspected.use_rslora)
    .bind(&inspected.targets)
    .bind(&uri)
    .bind(&inspected.digest)
    .fetch_one(&mut *tx)
    .await
    .map_err(|e| match db_error(e) {
        e if e.code == "duplicate" => AdminError::conflict(
            "duplicate",
            "version",
            format!("adapter {:?} version {version} already exists; versions are immutable, register a new one", a.name),
        ),
        e => e,
    })?;
    let row: AdapterRow = sqlx::query_as(sql!("{ADAPTER_SELECT} WHERE a.lora_int_id = $1"))
        .bind(id)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
    commit_change(
        &s,
        tx,
        &actor,
        "adapter.register",
        ("adapter", &id.to_string()),
        None,
        Some(to_json(&row)),
    )
    .await?;
    Ok(reply(StatusCode::CREATED, &actor, to_json(&row)))
}

async fn retire_adapter(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let id: i64 = id.parse().ok().filter(|v| *v > 0).ok_or_else(|| {
        AdminError::field("lora_int_id", format!("{id:?} is not a positive integer"))
    })?;
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let before: Option<AdapterRow> = sqlx::query_as(sql!(
        "{ADAPTER_SELECT} WHERE a.lora_int_id = $1 FOR UPDATE OF a"
    ))
    .bind(id)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db_error)?;
    let before =
        before.ok_or_else(|| AdminError::not_found("lora_int_id", format!("adapter {id}")))?;
    if before.state == "retired" {
        return Err(AdminError::conflict(
            "no_change",
            "lora_int_id",
            format!("adapter {id} is already retired"),
        ));
    }
    let routed: Vec<String> = sqlx::query_scalar(
        "SELECT t.name || '/' || r.model_name FROM routes r
         JOIN route_weights w ON w.route_id = r.id AND w.revision = r.current_revision
         JOIN tenants t ON t.id = r.tenant_id
         WHERE w.lora_int_id = $1 ORDER BY 1",
    )
    .bind(id)
    .fetch_all(&mut *tx)
    .await
    .map_err(db_error)?;
    if !routed.is_empty() {
        return Err(AdminError::conflict(
            "adapter_in_use",
            "lora_int_id",
            format!(
                "adapter {id} still takes traffic on route(s) {}; move them off it (promote or set) first",
                routed.join(", ")
            ),
        ));
    }
    sqlx::query("UPDATE adapters SET state = 'retired', retired_at = now() WHERE lora_int_id = $1")
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    let after: AdapterRow = sqlx::query_as(sql!("{ADAPTER_SELECT} WHERE a.lora_int_id = $1"))
        .bind(id)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
    commit_change(
        &s,
        tx,
        &actor,
        "adapter.retire",
        ("adapter", &id.to_string()),
        Some(to_json(&before)),
        Some(to_json(&after)),
    )
    .await?;
    Ok(reply(StatusCode::OK, &actor, to_json(&after)))
}

// ---------------------------------------------------------------------------
// Routes and canaries
// ---------------------------------------------------------------------------

#[derive(Debug, Serialize, Deserialize, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
struct Weight {
    lora_int_id: i64,
    weight_bp: u32,
}

#[derive(Debug, Serialize)]
struct RouteView {
    tenant: String,
    model: String,
    revision: i32,
    etag: String,
    base_model: String,
    /// "base" or "adapters".
    target: String,
    weights: Vec<WeightView>,
    updated_at: DateTime<Utc>,
    created_by: String,
}

#[derive(Debug, Serialize, sqlx::FromRow)]
struct WeightView {
    lora_int_id: i64,
    adapter: String,
    version: i32,
    weight_bp: i32,
}

fn etag(revision: i32) -> String {
    format!("\"{revision}\"")
}

async fn load_route(
    ex: &mut sqlx::PgConnection,
    tenant: &str,
    model: &str,
    lock: bool,
) -> Result<Option<(Uuid, RouteView)>, AdminError> {
    type Row = (
        Uuid,
        String,
        String,
        i32,
        String,
        String,
        DateTime<Utc>,
        String,
    );
    let row: Option<Row> = sqlx::query_as(sql!(
        "SELECT r.id, t.name, r.model_name, r.current_revision, b.name, rr.target::TEXT,
                r.updated_at, rr.created_by
         FROM routes r JOIN tenants t ON t.id = r.tenant_id
         JOIN route_revisions rr ON rr.route_id = r.id AND rr.revision = r.current_revision
         JOIN base_models b ON b.id = rr.base_model_id
         WHERE t.name = $1 AND r.model_name = $2 {}",
        if lock { "FOR UPDATE OF r" } else { "" }
    ))
    .bind(tenant)
    .bind(model)
    .fetch_optional(&mut *ex)
    .await
    .map_err(db_error)?;
    let Some((id, tenant, model, revision, base_model, target, updated_at, created_by)) = row
    else {
        return Ok(None);
    };
    let weights = revision_weights(ex, id, revision).await?;
    Ok(Some((
        id,
        RouteView {
            tenant,
            model,
            revision,
            etag: etag(revision),
            base_model,
            target,
            weights,
            updated_at,
            created_by,
        },
    )))
}

async fn revision_weights(
    ex: &mut sqlx::PgConnection,
    route: Uuid,
    revision: i32,
) -> Result<Vec<WeightView>, AdminError> {
    sqlx::query_as(
        "SELECT w.lora_int_id, a.name AS adapter, a.version, w.weight_bp
         FROM route_weights w JOIN adapters a ON a.lora_int_id = w.lora_int_id
         WHERE w.route_id = $1 AND w.revision = $2 ORDER BY w.lora_int_id",
    )
    .bind(route)
    .bind(revision)
    .fetch_all(&mut *ex)
    .await
    .map_err(db_error)
}

fn route_reply(status: StatusCode, actor: &Actor, view: &RouteView) -> Response {
    let mut r = reply(status, actor, to_json(view));
    if let Ok(v) = HeaderValue::from_str(&view.etag) {
        r.headers_mut().insert(header::ETAG, v);
    }
    r
}

#[derive(Debug, Deserialize)]
struct RouteFilter {
    tenant: Option<String>,
}

async fn list_routes(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Query(f): Query<RouteFilter>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
    let mut conn = s.pool.acquire().await.map_err(db_error)?;
    let names: Vec<(String, String)> = sqlx::query_as(
        "SELECT t.name, r.model_name FROM routes r JOIN tenants t ON t.id = r.tenant_id
         WHERE ($1::TEXT IS NULL OR t.name = $1) ORDER BY t.name, r.model_name",
    )
    .bind(&f.tenant)
    .fetch_all(&mut *conn)
    .await
    .map_err(db_error)?;
    let mut routes = Vec::new();
    for (t, m) in names {
        if let Some((_, view)) = load_route(&mut conn, &t, &m, false).await? {
            routes.push(view);
        }
    }
    Ok(reply(StatusCode::OK, &actor, json!({ "routes": routes })))
}

async fn get_route(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
    let mut conn = s.pool.acquire().await.map_err(db_error)?;
    let (_, view) = load_route(&mut conn, &tenant, &model, false)
        .await?
        .ok_or_else(|| AdminError::not_found("model", format!("route {tenant}/{model}")))?;
    Ok(route_reply(StatusCode::OK, &actor, &view))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RouteSpec {
    /// Required for a base-model route; for adapter weights it defaults to
    /// the adapters' base model.
    base_model: Option<String>,
    /// Empty or absent: the route serves the base model itself.
    #[serde(default)]
    weights: Vec<Weight>,
}

/// The revision the client last saw, from `If-Match`.
fn if_match(headers: &HeaderMap) -> Result<Option<i32>, AdminError> {
    let Some(v) = headers.get(header::IF_MATCH) else {
        return Ok(None);
    };
    let s = v.to_str().unwrap_or_default().trim();
    let s = s.strip_prefix("W/").unwrap_or(s);
    s.trim_matches('"').parse::<i32>().map(Some).map_err(|_| {
        AdminError::field(
            "If-Match",
            format!("{s:?} is not a route etag such as \"3\""),
        )
    })
}

/// Checks `If-Match` against the route's current revision.
fn check_etag(
    sent: Option<i32>,
    current: Option<i32>,
    tenant: &str,
    model: &str,
) -> Result<(), AdminError> {
    match (sent, current) {
        (None, None) => Ok(()),
        (Some(s), Some(c)) if s == c => Ok(()),
        (None, Some(c)) => Err(AdminError::new(
            StatusCode::PRECONDITION_REQUIRED,
            "etag_required",
            Some("If-Match"),
            format!(
                "If-Match: route {tenant}/{model} exists (etag \"{c}\"); send its etag to change it"
            ),
        )),
        (Some(s), Some(c)) => Err(AdminError::new(
            StatusCode::PRECONDITION_FAILED,
            "stale_etag",
            Some("If-Match"),
            format!(
                "If-Match: etag \"{s}\" is stale; route {tenant}/{model} is at \"{c}\" since someone else changed it. Re-read the route and retry"
            ),
        )),
        (Some(s), None) => Err(AdminError::new(
            StatusCode::PRECONDITION_FAILED,
            "stale_etag",
            Some("If-Match"),
            format!("If-Match: etag \"{s}\" given, but route {tenant}/{model} does not exist"),
        )),
    }
}

/// Validates weights against the registry: every version exists, is
/// active, belongs to this tenant or the platform, and all share one base
/// model. Returns that base model's id.
async fn check_weights(
    ex: &mut sqlx::PgConnection,
    weights: &[Weight],
    base_model: Option<&str>,
    tenant: Uuid,
) -> Result<i64, AdminError> {
    let mut seen = std::collections::HashSet::new();
    let mut sum: u64 = 0;
    for (i, w) in weights.iter().enumerate() {
        if !(1..=registry::WEIGHT_TOTAL).contains(&w.weight_bp) {
            return Err(AdminError::field(
                &format!("weights[{i}].weight_bp"),
                format!("{} must be between 1 and 10000 basis points", w.weight_bp),
            ));
        }
        if !seen.insert(w.lora_int_id) {
            return Err(AdminError::field(
                &format!("weights[{i}].lora_int_id"),
                format!("adapter {} is listed twice", w.lora_int_id),
            ));
        }
        sum += u64::from(w.weight_bp);
    }
    if sum != u64::from(registry::WEIGHT_TOTAL) {
        return Err(AdminError::unprocessable(
            "weights_sum",
            "weights",
            format!("the weights sum to {sum} basis points; they must sum to exactly 10000"),
        ));
    }
    let mut base: Option<(i64, String, usize)> = None;
    if let Some(name) = base_model {
        let id = base_model_id(&mut *ex, name).await?;
        base = Some((id, name.to_owned(), usize::MAX));
    }
    for (i, w) in weights.iter().enumerate() {
        let param = format!("weights[{i}].lora_int_id");
        type Row = (i64, String, String, i32, Option<Uuid>, String);
        let row: Option<Row> = sqlx::query_as(
            "SELECT a.base_model_id, b.name, a.name, a.version, a.tenant_id, a.state::TEXT
             FROM adapters a JOIN base_models b ON b.id = a.base_model_id WHERE a.lora_int_id = $1",
        )
        .bind(w.lora_int_id)
        .fetch_optional(&mut *ex)
        .await
        .map_err(db_error)?;
        let (base_id, base_name, name, version, owner, state) = row.ok_or_else(|| {
            AdminError::unprocessable(
                "unknown_adapter",
                &param,
                format!("adapter {} does not exist", w.lora_int_id),
            )
        })?;
        if state == "retired" {
            return Err(AdminError::unprocessable(
                "adapter_retired",
                &param,
                format!(
                    "adapter {} ({name} v{version}) is retired and cannot receive traffic",
                    w.lora_int_id
                ),
            ));
        }
        if owner.is_some_and(|o| o != tenant) {
            return Err(AdminError::unprocessable(
                "adapter_of_another_tenant",
                &param,
                format!(
                    "adapter {} ({name} v{version}) belongs to another tenant",
                    w.lora_int_id
                ),
            ));
        }
        match &base {
            None => base = Some((base_id, base_name, i)),
            Some((id, other, at)) if *id != base_id => {
                let whose = if *at == usize::MAX {
                    "the route's base_model".to_owned()
                } else {
                    format!("weights[{at}]")
                };
                return Err(AdminError::unprocessable(
                    "mixed_base_models",
                    &param,
                    format!(
                        "adapter {} is on base model {base_name:?} but {whose} is on {other:?}; one route serves one base model",
                        w.lora_int_id
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    base.map(|(id, _, _)| id)
        .ok_or_else(|| AdminError::field("base_model", "is required for a route to the base model"))
}

/// Writes a new revision of a route (creating the route at revision 1) and
/// records the change. The caller has checked the etag.
#[allow(clippy::too_many_arguments)]
async fn write_revision(
    tx: &mut Transaction<'_, Postgres>,
    actor: &Actor,
    action: &str,
    tenant_name: &str,
    model: &str,
    existing: Option<(Uuid, RouteView)>,
    base_id: i64,
    weights: &[Weight],
) -> Result<RouteView, AdminError> {
    let tenant = tenant_id(&mut **tx, tenant_name, "tenant").await?;
    let (route_id, revision, before) = match existing {
        Some((id, view)) => (id, view.revision + 1, Some(view)),
        None => {
            check_model_name(model, "model")?;
            let id: Uuid = sqlx::query_scalar(
                "INSERT INTO routes (tenant_id, model_name, current_revision) VALUES ($1, $2, 1) RETURNING id",
            )
            .bind(tenant)
            .bind(model)
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error)?;
            (id, 1, None)
        }
    };
    let target = if weights.is_empty() {
        "base"
    } else {
        "adapters"
    };
    sqlx::query(
        "INSERT INTO route_revisions (route_id, revision, base_model_id, target, created_by)
         VALUES ($1, $2, $3, $4::route_target, $5)",
    )
    .bind(route_id)
    .bind(revision)
    .bind(base_id)
    .bind(target)
    .bind(&actor.subject)
    .execute(&mut **tx)
    .await
    .map_err(db_error)?;
    for w in weights {
        sqlx::query(
            "INSERT INTO route_weights (route_id, revision, base_model_id, lora_int_id, weight_bp)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(route_id)
        .bind(revision)
        .bind(base_id)
        .bind(w.lora_int_id)
        .bind(w.weight_bp as i32)
        .execute(&mut **tx)
        .await
        .map_err(db_error)?;
    }
    sqlx::query("UPDATE routes SET current_revision = $2, updated_at = now() WHERE id = $1")
        .bind(route_id)
        .bind(revision)
        .execute(&mut **tx)
        .await
        .map_err(db_error)?;
    // The deferred checks (weights sum, revision references) run now, so
    // their violations are reported as this request's errors.
    sqlx::query("SET CONSTRAINTS ALL IMMEDIATE")
        .execute(&mut **tx)
        .await
        .map_err(db_error)?;
    let (_, after) = load_route(tx, tenant_name, model, false)
        .await?
        .ok_or_else(|| AdminError::internal("the route vanished inside its transaction"))?;
    let object = format!("{tenant_name}/{model}");
    record(
        tx,
        actor,
        action,
        ("route", &object),
        before.as_ref().map(to_json),
        Some(to_json(&after)),
    )
    .await?;
    Ok(after)
}

async fn put_route(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let sent = if_match(&headers)?;
    let spec: RouteSpec = parse_body(&body)?;
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let tenant_uuid = tenant_id(&mut *tx, &tenant, "tenant").await?;
    let existing = load_route(&mut tx, &tenant, &model, true).await?;
    check_etag(
        sent,
        existing.as_ref().map(|(_, v)| v.revision),
        &tenant,
        &model,
    )?;
    let base_id = if spec.weights.is_empty() {
        let name = spec.base_model.as_deref().ok_or_else(|| {
            AdminError::field(
                "weights",
                "give adapter weights, or base_model alone for a route to the base model itself",
            )
        })?;
        base_model_id(&mut *tx, name).await?
    } else {
        check_weights(
            &mut tx,
            &spec.weights,
            spec.base_model.as_deref(),
            tenant_uuid,
        )
        .await?
    };
    let action = if existing.is_some() {
        "route.update"
    } else {
        "route.create"
    };
    let created = existing.is_none();
    let view = write_revision(
        &mut tx,
        &actor,
        action,
        &tenant,
        &model,
        existing,
        base_id,
        &spec.weights,
    )
    .await?;
    commit(&s, tx).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok(route_reply(status, &actor, &view))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PromoteSpec {
    lora_int_id: i64,
}

async fn promote(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
    body: Bytes,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let sent = if_match(&headers)?;
    let p: PromoteSpec = parse_body(&body)?;
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let tenant_uuid = tenant_id(&mut *tx, &tenant, "tenant").await?;
    let existing = load_route(&mut tx, &tenant, &model, true)
        .await?
        .ok_or_else(|| AdminError::not_found("model", format!("route {tenant}/{model}")))?;
    check_etag(sent, Some(existing.1.revision), &tenant, &model)?;
    let weights = [Weight {
        lora_int_id: p.lora_int_id,
        weight_bp: registry::WEIGHT_TOTAL,
    }];
    let base_id = check_weights(&mut tx, &weights, None, tenant_uuid)
        .await
        .map_err(|mut e| {
            if e.param.as_deref() == Some("weights[0].lora_int_id") {
                e.param = Some("lora_int_id".into());
            }
            e
        })?;
    let view = write_revision(
        &mut tx,
        &actor,
        "route.promote",
        &tenant,
        &model,
        Some(existing),
        base_id,
        &weights,
    )
    .await?;
    commit(&s, tx).await?;
    Ok(route_reply(StatusCode::OK, &actor, &view))
}

async fn rollback(
    State(s): State<AdminState>,
    headers: HeaderMap,
    Path((tenant, model)): Path<(String, String)>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Write)?;
    let sent = if_match(&headers)?;
    let mut tx = s.pool.begin().await.map_err(db_error)?;
    let tenant_uuid = tenant_id(&mut *tx, &tenant, "tenant").await?;
    let (route_id, current) = load_route(&mut tx, &tenant, &model, true)
        .await?
        .ok_or_else(|| AdminError::not_found("model", format!("route {tenant}/{model}")))?;
    check_etag(sent, Some(current.revision), &tenant, &model)?;
    if current.revision <= 1 {
        return Err(AdminError::conflict(
            "no_previous_revision",
            "model",
            format!("route {tenant}/{model} has no earlier revision to roll back to"),
        ));
    }
    let previous = current.revision - 1;
    let base_id: i64 = sqlx::query_scalar(
        "SELECT base_model_id FROM route_revisions WHERE route_id = $1 AND revision = $2",
    )
    .bind(route_id)
    .bind(previous)
    .fetch_one(&mut *tx)
    .await
    .map_err(db_error)?;
    let weights: Vec<Weight> = revision_weights(&mut tx, route_id, previous)
        .await?
        .into_iter()
        .map(|w| Weight {
            lora_int_id: w.lora_int_id,
            weight_bp: w.weight_bp as u32,
        })
        .collect();
    if !weights.is_empty() {
        check_weights(&mut tx, &weights, None, tenant_uuid)
            .await
            .map_err(|e| {
                AdminError::new(
                    e.status,
                    e.code,
                    Some("model"),
                    format!("cannot roll back to revision {previous}: {}", e.message),
                )
            })?;
    }
    let view = write_revision(
        &mut tx,
        &actor,
        "route.rollback",
        &tenant,
        &model,
        Some((route_id, current)),
        base_id,
        &weights,
    )
    .await?;
    commit(&s, tx).await?;
    Ok(route_reply(StatusCode::OK, &actor, &view))
}

// ---------------------------------------------------------------------------
// Fleet
// ---------------------------------------------------------------------------

async fn fleet_view(
    State(s): State<AdminState>,
    headers: HeaderMap,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
    let mut workers = Vec::new();
    for w in s.fleet.workers() {
        let st = w.state();
        let mut tiers: BTreeMap<&'static str, Vec<u64>> = BTreeMap::new();
        for (id, r) in &st.adapters {
            let tier = match r {
                lorafleet_proto::worker::v1::Residency::Device => "device",
                lorafleet_proto::worker::v1::Residency::Host => "host",
                lorafleet_proto::worker::v1::Residency::Loading => "loading",
                _ => "not_loaded",
            };
            tiers.entry(tier).or_default().push(*id);
        }
        for v in tiers.values_mut() {
            v.sort_unstable();
        }
        workers.push(json!({
            "addr": w.addr,
            "worker_id": st.worker_id,
            "up": w.up(),
            "base_hash": st.base_hash,
            "load": st.load,
            "in_flight": w.in_flight.load(std::sync::atomic::Ordering::Relaxed),
            "adapters": tiers,
            "last_report_ms_ago": st.last_report.map(|t| t.elapsed().as_millis() as u64),
        }));
    }
    Ok(reply(StatusCode::OK, &actor, json!({ "workers": workers })))
}

// ---------------------------------------------------------------------------
// Audit queries
// ---------------------------------------------------------------------------

/// Filters of `GET /admin/v1/audit`; all optional, combined with AND.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditFilter {
    pub tenant: Option<String>,
    /// An API key prefix.
    pub api_key: Option<String>,
    pub model: Option<String>,
    /// An adapter name, or `name:version`.
    pub adapter: Option<String>,
    pub lora_int_id: Option<i64>,
    pub worker: Option<String>,
    pub status: Option<String>,
    pub request_id: Option<Uuid>,
    /// RFC 3339; inclusive.
    pub since: Option<DateTime<Utc>>,
    /// RFC 3339; exclusive.
    pub until: Option<DateTime<Utc>>,
    /// Rows per page, 1 to 1000 (default 100).
    pub limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
    /// json (one page, default), jsonl or csv (every matching row).
    pub format: Option<String>,
}

/// One audit row as compliance sees it.
#[derive(Debug, Serialize, sqlx::FromRow)]
pub struct AuditRow {
    pub id: i64,
    pub request_id: Uuid,
    pub received_at: DateTime<Utc>,
    pub completed_at: DateTime<Utc>,
    pub tenant: Option<String>,
    pub api_key: Option<String>,
    pub subject: Option<String>,
    /// The OpenAI `user` field the request sent.
    pub user: Option<String>,
    pub model: String,
    pub route_revision: Option<i32>,
    pub lora_int_id: Option<i64>,
    pub adapter_name: Option<String>,
    pub adapter_version: Option<i32>,
    pub base_hash: Option<String>,
    pub worker_id: Option<String>,
    pub adapter_residency: Option<String>,
    pub status: String,
    pub http_status: i16,
    pub error_code: Option<String>,
    pub finish_reason: Option<String>,
    pub prompt_tokens: i32,
    pub completion_tokens: i32,
    pub latency_us: i64,
    pub ttft_us: Option<i64>,
    pub attempts: i16,
}

const AUDIT_COLUMNS: &[&str] = &[
    "id",
    "request_id",
    "received_at",
    "completed_at",
    "tenant",
    "api_key",
    "subject",
    "user",
    "model",
    "route_revision",
    "lora_int_id",
    "adapter_name",
    "adapter_version",
    "base_hash",
    "worker_id",
    "adapter_residency",
    "status",
    "http_status",
    "error_code",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "latency_us",
    "ttft_us",
    "attempts",
];

/// A validated audit query, ready to run page by page.
#[derive(Debug, Clone)]
pub struct AuditQuery {
    tenant: Option<Uuid>,
    api_key: Option<Uuid>,
    model: Option<String>,
    adapter: Option<(String, Option<i32>)>,
    lora_int_id: Option<i64>,
    worker: Option<String>,
    status: Option<String>,
    request_id: Option<Uuid>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    pub limit: i64,
}

/// Keyset position: rows strictly older than (received_at, id).
#[derive(Debug, Clone, Copy)]
pub struct Cursor {
    received_at: DateTime<Utc>,
    id: i64,
}

impl Cursor {
    pub fn encode(&self) -> String {
        format!("{}_{}", self.received_at.timestamp_micros(), self.id)
    }

    pub fn decode(s: &str) -> Result<Cursor, AdminError> {
        let bad = || {
            AdminError::field(
                "cursor",
                format!("{s:?} is not a cursor from a previous page"),
            )
        };
        let (t, id) = s.split_once('_').ok_or_else(bad)?;
        let micros: i64 = t.parse().map_err(|_| bad())?;
        let id: i64 = id.parse().map_err(|_| bad())?;
        Ok(Cursor {
            received_at: DateTime::from_timestamp_micros(micros).ok_or_else(bad)?,
            id,
        })
    }
}

impl AuditQuery {
    /// Checks the filters and resolves names to ids.
    pub async fn new(pool: &PgPool, f: &AuditFilter) -> Result<AuditQuery, AdminError> {
        let tenant = match &f.tenant {
            Some(t) => Some(tenant_id(pool, t, "tenant").await?),
            None => None,
        };
        let api_key = match &f.api_key {
            Some(p) => Some(
                sqlx::query_scalar::<_, Uuid>("SELECT id FROM api_keys WHERE prefix = $1")
                    .bind(p)
                    .fetch_optional(pool)
                    .await
                    .map_err(db_error)?
                    .ok_or_else(|| AdminError::not_found("api_key", format!("API key {p:?}")))?,
            ),
            None => None,
        };
        let adapter = match &f.adapter {
            None => None,
            Some(a) => match a.rsplit_once(':') {
                Some((name, v)) => {
                    let v: i32 = v.parse().ok().filter(|v| *v > 0).ok_or_else(|| {
                        AdminError::field(
                            "adapter",
                            format!("{a:?}: the version after ':' must be a positive integer"),
                        )
                    })?;
                    Some((name.to_owned(), Some(v)))
                }
                None => Some((a.clone(), None)),
            },
        };
        if let Some(st) = &f.status
            && !["ok", "cancelled", "rejected", "error"].contains(&st.as_str())
        {
            return Err(AdminError::field(
                "status",
                format!("{st:?} is not ok, cancelled, rejected or error"),
            ));
        }
        if let (Some(a), Some(b)) = (f.since, f.until)
            && a >= b
        {
            return Err(AdminError::field("until", "must be after since"));
        }
        let limit = f.limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(AdminError::field(
                "limit",
                format!("{limit} must be between 1 and 1000"),
            ));
        }
        Ok(AuditQuery {
            tenant,
            api_key,
            model: f.model.clone(),
            adapter,
            lora_int_id: f.lora_int_id,
            worker: f.worker.clone(),
            status: f.status.clone(),
            request_id: f.request_id,
            since: f.since,
            until: f.until,
            limit: i64::from(limit),
        })
    }

    /// One page, newest first, after `cursor`. The cursor of the next page
    /// is Some when this page is full.
    pub async fn page(
        &self,
        pool: &PgPool,
        cursor: Option<Cursor>,
    ) -> Result<(Vec<AuditRow>, Option<Cursor>), sqlx::Error> {
        let mut q: QueryBuilder<Postgres> = QueryBuilder::new(
            "SELECT l.id, l.request_id, l.received_at, l.completed_at, t.name AS tenant,
                    COALESCE(l.api_key_prefix, k.prefix) AS api_key, l.subject,
                    l.end_user AS user, l.model_name AS model, l.route_revision,
                    l.lora_int_id, l.adapter_name, l.adapter_version, l.base_hash, l.worker_id,
                    l.adapter_residency, l.status::TEXT AS status, l.http_status, l.error_code,
                    l.finish_reason, l.prompt_tokens, l.completion_tokens, l.latency_us,
                    l.ttft_us, l.attempts
             FROM audit_log l
             LEFT JOIN tenants t ON t.id = l.tenant_id
             LEFT JOIN api_keys k ON k.id = l.api_key_id
             WHERE TRUE",
        );
        if let Some(v) = self.tenant {
            q.push(" AND l.tenant_id = ").push_bind(v);
        }
        if let Some(v) = self.api_key {
            q.push(" AND l.api_key_id = ").push_bind(v);
        }
        if let Some(v) = &self.model {
            q.push(" AND l.model_name = ").push_bind(v.clone());
        }
        if let Some((name, version)) = &self.adapter {
            q.push(" AND l.adapter_name = ").push_bind(name.clone());
            if let Some(v) = version {
                q.push(" AND l.adapter_version = ").push_bind(*v);
            }
        }
        if let Some(v) = self.lora_int_id {
            q.push(" AND l.lora_int_id = ").push_bind(v);
        }
        if let Some(v) = &self.worker {
            q.push(" AND l.worker_id = ").push_bind(v.clone());
        }
        if let Some(v) = &self.status {
            q.push(" AND l.status = ")
                .push_bind(v.clone())
                .push("::audit_status");
        }
        if let Some(v) = self.request_id {
            q.push(" AND l.request_id = ").push_bind(v);
        }
        if let Some(v) = self.since {
            q.push(" AND l.received_at >= ").push_bind(v);
        }
        if let Some(v) = self.until {
            q.push(" AND l.received_at < ").push_bind(v);
        }
        if let Some(c) = cursor {
            q.push(" AND (l.received_at, l.id) < (")
                .push_bind(c.received_at)
                .push(", ")
                .push_bind(c.id)
                .push(")");
        }
        q.push(" ORDER BY l.received_at DESC, l.id DESC LIMIT ")
            .push_bind(self.limit);
        let rows: Vec<AuditRow> = q.build_query_as().fetch_all(pool).await?;
        let next = if rows.len() as i64 == self.limit {
            rows.last().map(|r| Cursor {
                received_at: r.received_at,
                id: r.id,
            })
        } else {
            None
        };
        Ok((rows, next))
    }
}

/// One CSV cell. A text cell that a spreadsheet would read as a formula
/// (it starts with `=`, `+`, `-`, `@`, a tab or a carriage return) gets a
/// leading `'`, so opening an export never runs what a client sent.
fn csv_field(v: &Value) -> String {
    let s = match v {
        Value::Null => return String::new(),
        Value::String(s) if s.starts_with(['=', '+', '-', '@', '\t', '\r']) => format!("'{s}"),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s
    }
}

fn csv_line(row: &AuditRow) -> String {
    let v = to_json(row);
    let mut line = AUDIT_COLUMNS
        .iter()
        .map(|c| csv_field(&v[*c]))
        .collect::<Vec<_>>()
        .join(",");
    line.push('\n');
    line
}

async fn audit_query(
    State(s): State<AdminState>,
    headers: HeaderMap,
    query: Result<Query<AuditFilter>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Audit)?;
    let Query(f) = query.map_err(|e| AdminError::field("query", e.body_text()))?;
    let q = AuditQuery::new(&s.pool, &f).await?;
    let cursor = f.cursor.as_deref().map(Cursor::decode).transpose()?;
    match f.format.as_deref().unwrap_or("json") {
        "json" => {
            let (rows, next) = q.page(&s.pool, cursor).await.map_err(db_error)?;
            Ok(reply(
                StatusCode::OK,
                &actor,
                json!({ "rows": rows, "next_cursor": next.map(|c| c.encode()) }),
            ))
        }
        format @ ("jsonl" | "csv") => {
            // An export streams every matching row, page by page, so its
            // size is not bounded by memory.
            let csv = format == "csv";
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(4);
            let pool = s.pool.clone();
            let mut q = q;
            q.limit = 1000;
            tokio::spawn(async move {
                if csv {
                    let _ = tx
                        .send(Ok(Bytes::from(format!("{}\n", AUDIT_COLUMNS.join(",")))))
                        .await;
                }
                let mut cursor = cursor;
                loop {
                    match q.page(&pool, cursor).await {
                        Ok((rows, next)) => {
                            let mut chunk = String::new();
                            for r in &rows {
                                if csv {
                                    chunk.push_str(&csv_line(r));
                                } else {
                                    chunk.push_str(&to_json(r).to_string());
                                    chunk.push('\n');
                                }
                            }
                            if tx.send(Ok(Bytes::from(chunk))).await.is_err() {
                                return;
                            }
                            match next {
                                Some(c) => cursor = Some(c),
                                None => return,
                            }
                        }
                        Err(e) => {
                            // Cut the body short so the client sees a
                            // failed transfer rather than a short export.
                            let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                            return;
                        }
                    }
                }
            });
            let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(rx));
            let content_type = if csv {
                "text/csv; charset=utf-8"
            } else {
                "application/x-ndjson"
            };
            let mut r = Response::new(body);
            r.headers_mut()
                .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            if let Ok(v) = HeaderValue::from_str(&actor.request_id.to_string()) {
                r.headers_mut().insert("x-request-id", v);
            }
            Ok(r)
        }
        other => Err(AdminError::field(
            "format",
            format!("{other:?} is not json, jsonl or csv"),
        )),
    }
}

// ---------------------------------------------------------------------------
// The admin change log
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ChangeFilter {
    object_type: Option<String>,
    object_id: Option<String>,
    limit: Option<u32>,
}

#[derive(Debug, Serialize, sqlx::FromRow)]
struct ChangeRow {
    id: i64,
    at: DateTime<Utc>,
    actor: String,
    role: String,
    action: String,
    object_type: String,
    object_id: String,
    before: Option<Value>,
    after: Option<Value>,
    request_id: Uuid,
}

async fn list_changes(
    State(s): State<AdminState>,
    headers: HeaderMap,
    query: Result<Query<ChangeFilter>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Audit)?;
    let Query(f) = query.map_err(|e| AdminError::field("query", e.body_text()))?;
    let limit = f.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(AdminError::field(
            "limit",
            format!("{limit} must be between 1 and 1000"),
        ));
    }
    let rows: Vec<ChangeRow> = sqlx::query_as(
        "SELECT id, at, actor, role, action, object_type, object_id, before, after, request_id
         FROM admin_changes
         WHERE ($1::TEXT IS NULL OR object_type = $1) AND ($2::TEXT IS NULL OR object_id = $2)
         ORDER BY at DESC, id DESC LIMIT $3",
    )
    .bind(f.object_type)
    .bind(f.object_id)
    .bind(i64::from(limit))
    .fetch_all(&s.pool)
    .await
    .map_err(db_error)?;
    Ok(reply(StatusCode::OK, &actor, json!({ "changes": rows })))
}

/// Where admin artifacts come from: the configured roots, canonicalised.
pub fn artifact_roots(roots: &[PathBuf]) -> anyhow::Result<Option<Arc<ArtifactRoots>>> {
    if roots.is_empty() {
        return Ok(None);
    }
    ArtifactRoots::new(roots)
        .map(|r| Some(Arc::new(r)))
        .map_err(|e| anyhow::anyhow!("--artifact-root: {e}"))
}

#[cfg(test)]
mod csv_tests {
    use super::*;

    #[test]
    fn csv_cells_that_look_like_formulas_are_neutralised() {
        for (cell, want) in [
            ("=HYPERLINK(\"x\")", "\"'=HYPERLINK(\"\"x\"\")\""),
            ("+1", "'+1"),
            ("-2", "'-2"),
            ("@SUM(A1)", "'@SUM(A1)"),
            ("\tx", "'\tx"),
            ("plain", "plain"),
        ] {
            assert_eq!(csv_field(&Value::String(cell.into())), want, "{cell:?}");
        }
        // Numbers are numbers, not client text.
        assert_eq!(csv_field(&json!(-5)), "-5");
        assert_eq!(csv_field(&Value::Null), "");
    }
}
