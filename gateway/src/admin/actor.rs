//! Admin authentication (JWT roles) and recording each change with its `admin_changes` row.

use super::*;

#[derive(Debug, Deserialize)]
pub(super) struct AdminClaims {
    pub(super) sub: String,
    pub(super) role: String,
    pub(super) exp: i64,
}

/// The authenticated admin and this request's id.
#[derive(Debug)]
pub(super) struct Actor {
    pub(super) subject: String,
    pub(super) role: Role,
    pub(super) request_id: Uuid,
}

pub(super) fn authorize(
    state: &AdminState,
    headers: &HeaderMap,
    need: Need,
) -> Result<Actor, AdminError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let token = auth::bearer(value)
        .map_err(|e| AdminError::new(AdminCode::InvalidAdminToken, None, e.to_string()))?;
    let identity = identify(&state.jwt, token)?;
    if !identity.role.allows(need) {
        let what = match need {
            Need::Read => "read the registry",
            Need::Audit => "query the audit log",
            Need::Write => "change the registry",
        };
        return Err(AdminError::new(
            AdminCode::InsufficientRole,
            None,
            format!("role {} may not {what}", identity.role.name()),
        ));
    }
    Ok(Actor {
        subject: identity.subject,
        role: identity.role,
        request_id: Uuid::now_v7(),
    })
}

/// Who an admin token names, once it is verified.
#[derive(Debug, Clone)]
pub struct Identity {
    pub subject: String,
    pub role: Role,
    /// When the token expires (its `exp`), in seconds since the epoch.
    pub expires_at: i64,
}

/// Verifies an admin token (signature, issuer, audience, expiry) and reads
/// its subject and role: the one check the admin API and the console share.
pub fn identify(jwt: &JwtConfig, token: &str) -> Result<Identity, AdminError> {
    let unauthorized = |m: String| AdminError::new(AdminCode::InvalidAdminToken, None, m);
    let claims: AdminClaims =
        auth::decode_jwt(token, jwt).map_err(|e| unauthorized(e.to_string()))?;
    if claims.sub.trim().is_empty() {
        return Err(unauthorized("invalid token: sub is empty".into()));
    }
    let role = Role::parse(&claims.role).ok_or_else(|| {
        unauthorized(format!(
            "invalid token: role {:?} is not admin, auditor or viewer",
            claims.role
        ))
    })?;
    Ok(Identity {
        subject: claims.sub,
        role,
        expires_at: claims.exp,
    })
}

/// One change, recorded in the same transaction as the change itself.
pub(super) async fn record(
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
pub(super) async fn commit_change(
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
pub(super) async fn commit(
    state: &AdminState,
    tx: Transaction<'_, Postgres>,
) -> Result<(), AdminError> {
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
pub(super) fn reply(status: StatusCode, actor: &Actor, body: Value) -> Response {
    let mut r = (status, axum::Json(body)).into_response();
    if let Ok(v) = HeaderValue::from_str(&actor.request_id.to_string()) {
        r.headers_mut().insert("x-request-id", v);
    }
    r
}
