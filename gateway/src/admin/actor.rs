//! Admin authentication: an admin JWT verified, its subject and role read.

use super::*;

#[derive(Debug, Deserialize)]
pub(super) struct AdminClaims {
    pub(super) sub: String,
    pub(super) role: String,
    pub(super) exp: i64,
    /// When it was issued, if it says.
    #[serde(default)]
    pub(super) iat: Option<i64>,
    /// The token's id, by which it can be revoked before it expires.
    #[serde(default)]
    pub(super) jti: Option<String>,
}

/// Who an admin token names, once it is verified.
#[derive(Debug, Clone)]
pub struct Identity {
    pub subject: String,
    pub role: Role,
    /// When the token expires (its `exp`), in seconds since the epoch.
    pub expires_at: i64,
    /// Its `jti` (every admin token has one, so that it can be revoked).
    pub jti: Option<String>,
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
    // Every admin token can be revoked, and none outlives the maximum
    // lifetime: so a revocation, kept until then, always covers it.
    let jti = claims.jti.filter(|j| !j.is_empty()).ok_or_else(|| {
        unauthorized(
            "invalid token: it has no jti claim, so it could not be revoked \
             (`lorafleetctl token` sets one)"
                .into(),
        )
    })?;
    if let Some(max) = jwt.max_ttl_secs() {
        let from = claims.iat.unwrap_or_else(|| chrono::Utc::now().timestamp());
        let lifetime = claims.exp.saturating_sub(from);
        if lifetime > max {
            return Err(unauthorized(format!(
                "invalid token: it lives {lifetime} s, above the {max} s an admin token may \
                 (--admin-jwt-max-ttl-secs)"
            )));
        }
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
        jti: Some(jti),
    })
}

impl AdminState {
    /// Verifies an admin token and checks it was not revoked: what the
    /// admin API and the console accept as a caller.
    pub fn verify(&self, token: &str) -> Result<Identity, AdminError> {
        let identity = identify(&self.jwt, token)?;
        if let Some(jti) = &identity.jti
            && self.registry.snapshot().admin_token_revoked(jti)
        {
            return Err(AdminError::new(
                AdminCode::InvalidAdminToken,
                None,
                "invalid token: it was revoked".into(),
            ));
        }
        Ok(identity)
    }
}
