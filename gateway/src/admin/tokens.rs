//! Admin tokens revoked before they expire: by an admin, by `jti`, or by
//! their own holder (the console's sign-out); and tenant JWTs, by an admin,
//! by `jti`. Every replica honours a revocation once its registry reloads
//! (at once on the announcement).

use super::*;

/// A token revoked by its `jti`, kept until its own expiry.
#[derive(Debug)]
pub struct RevokeAdminToken(pub TokenRevocation);

/// A tenant JWT revoked by its `jti`, kept until its own expiry.
#[derive(Debug)]
pub struct RevokeTenantToken(pub TokenRevocation);

/// The caller's own token revoked: any role may sign itself out.
#[derive(Debug)]
pub struct RevokeOwnToken;

impl Command for RevokeAdminToken {
    type Output = TokenRevoked;

    async fn run(self, cx: &mut Cx<'_>) -> Result<TokenRevoked, AdminError> {
        let r = self.0;
        check(&r)?;
        // Kept at least as long as any admin token may live from now (the
        // maximum lifetime), whatever expiry the request gives: no token
        // with this jti outlives its revocation.
        let kept_until = match cx.state.jwt.max_ttl_secs() {
            Some(max) => r
                .expires_at
                .max(Utc::now() + chrono::Duration::seconds(max)),
            None => r.expires_at,
        };
        revoke_in(cx, Revoked::Admin, r.jti, r.expires_at, kept_until).await
    }
}

impl Command for RevokeTenantToken {
    type Output = TokenRevoked;

    async fn run(self, cx: &mut Cx<'_>) -> Result<TokenRevoked, AdminError> {
        let r = self.0;
        check(&r)?;
        revoke_in(cx, Revoked::Tenant, r.jti, r.expires_at, r.expires_at).await
    }
}

/// A revocation's own fields: a `jti` of 1-256 characters, and an expiry
/// still ahead (one already past would deny nothing).
fn check(r: &TokenRevocation) -> Result<(), AdminError> {
    if r.jti.is_empty() || r.jti.len() > 256 {
        return Err(AdminError::field("jti", "must be 1-256 characters"));
    }
    if r.expires_at <= Utc::now() {
        return Err(AdminError::field(
            "expires_at",
            "is not in the future: give the token's exp (a token past it is refused anyway)",
        ));
    }
    Ok(())
}

/// Which deny list a revocation goes on.
#[derive(Debug, Clone, Copy)]
enum Revoked {
    Admin,
    Tenant,
}

impl Command for RevokeOwnToken {
    type Output = TokenRevoked;
    const NEED: Need = Need::Read;

    async fn run(self, cx: &mut Cx<'_>) -> Result<TokenRevoked, AdminError> {
        let jti = cx.caller.token_id.clone().ok_or_else(|| {
            AdminError::field(
                "token",
                "has no jti claim, so it cannot be revoked; it ends at its expiry",
            )
        })?;
        let expires_at = DateTime::from_timestamp(cx.caller.token_expires_at, 0)
            .ok_or_else(|| AdminError::field("token", "its exp is out of range"))?;
        revoke_in(cx, Revoked::Admin, jti, expires_at, expires_at).await
    }
}

/// Puts `jti` on `list` until `kept_until`; a row already there that
/// covers `covers` (the token's own expiry) is left as it is, one that does
/// not is extended.
async fn revoke_in(
    cx: &mut Cx<'_>,
    list: Revoked,
    jti: String,
    covers: DateTime<Utc>,
    kept_until: DateTime<Utc>,
) -> Result<TokenRevoked, AdminError> {
    let by = cx.caller.subject.clone();
    let (object_type, action) = match list {
        Revoked::Admin => ("admin_token", "admin_token.revoke"),
        Revoked::Tenant => ("tenant_token", "tenant_token.revoke"),
    };
    // A revocation of a jti whose row ends before the token does extends
    // it (so a short-lived row cannot block the real revocation); one
    // that the row already covers changes nothing.
    // One statement per deny list, each a literal.
    let sql = match list {
        Revoked::Admin => {
            "INSERT INTO admin_token_revocations AS r (jti, expires_at, revoked_by) VALUES ($1, $2, $3)
             ON CONFLICT (jti) DO UPDATE
                 SET expires_at = EXCLUDED.expires_at, revoked_at = now(), revoked_by = EXCLUDED.revoked_by
                 WHERE r.expires_at < $4
             RETURNING jti, expires_at, revoked_at, revoked_by"
        }
        Revoked::Tenant => {
            "INSERT INTO tenant_token_revocations AS r (jti, expires_at, revoked_by) VALUES ($1, $2, $3)
             ON CONFLICT (jti) DO UPDATE
                 SET expires_at = EXCLUDED.expires_at, revoked_at = now(), revoked_by = EXCLUDED.revoked_by
                 WHERE r.expires_at < $4
             RETURNING jti, expires_at, revoked_at, revoked_by"
        }
    };
    let row: Option<TokenRevoked> = sqlx::query_as(sql)
        .bind(&jti)
        .bind(kept_until)
        .bind(&by)
        .bind(covers)
        .fetch_optional(cx.db().await?)
        .await
        .map_err(db_error)?;
    let row = row.ok_or_else(|| {
        AdminError::conflict(
            AdminCode::NoChange,
            "jti",
            format!("token {jti:?} is already revoked until then or later"),
        )
    })?;
    cx.record(action, (object_type, &jti), None, Some(to_json(&row)));
    Ok(row)
}
