//! Admin tokens revoked before they expire: by an admin, by `jti`, or by
//! their own holder (the console's sign-out). Every replica honours a
//! revocation once its registry reloads (at once on the announcement).

use super::*;

/// A token revoked by its `jti`, kept until its own expiry.
#[derive(Debug)]
pub struct RevokeAdminToken(pub TokenRevocation);

/// The caller's own token revoked: any role may sign itself out.
#[derive(Debug)]
pub struct RevokeOwnToken;

impl Command for RevokeAdminToken {
    type Output = TokenRevoked;

    async fn run(self, cx: &mut Cx<'_>) -> Result<TokenRevoked, AdminError> {
        let r = self.0;
        if r.jti.is_empty() || r.jti.len() > 256 {
            return Err(AdminError::field("jti", "must be 1-256 characters"));
        }
        // A revocation lasts until its token's expiry; one already past
        // would deny nothing and is refused rather than recorded.
        if r.expires_at <= Utc::now() {
            return Err(AdminError::field(
                "expires_at",
                "is not in the future: give the token's exp (a token past it is refused anyway)",
            ));
        }
        revoke(cx, r.jti, r.expires_at).await
    }
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
        revoke(cx, jti, expires_at).await
    }
}

async fn revoke(
    cx: &mut Cx<'_>,
    jti: String,
    expires_at: DateTime<Utc>,
) -> Result<TokenRevoked, AdminError> {
    let by = cx.caller.subject.clone();
    // A revocation of a jti already revoked until an earlier time extends
    // it (so a short-lived revocation, made by the token's own holder,
    // cannot block the real one); one that extends nothing changes nothing.
    let row: Option<TokenRevoked> = sqlx::query_as(
        "INSERT INTO admin_token_revocations AS r (jti, expires_at, revoked_by) VALUES ($1, $2, $3)
         ON CONFLICT (jti) DO UPDATE
             SET expires_at = EXCLUDED.expires_at, revoked_at = now(), revoked_by = EXCLUDED.revoked_by
             WHERE r.expires_at < EXCLUDED.expires_at
         RETURNING jti, expires_at, revoked_at, revoked_by",
    )
    .bind(&jti)
    .bind(expires_at)
    .bind(&by)
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
    cx.record(
        "admin_token.revoke",
        ("admin_token", &jti),
        None,
        Some(to_json(&row)),
    );
    Ok(row)
}
