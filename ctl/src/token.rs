//! Minting HMAC-signed admin tokens for bootstrap.

use super::*;

/// A minting flag's value, or the usage error naming it.
fn given<'a, T: ?Sized>(v: Option<&'a T>, flag: &str) -> Result<&'a T, Failure> {
    v.ok_or_else(|| fail(USAGE, format!("{flag}: required to mint a token")))
}

pub(crate) fn mint_token(t: &TokenArgs) -> Result<(), Failure> {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    let hmac_secret_file = given(t.hmac_secret_file.as_deref(), "--hmac-secret-file")?;
    let subject = given(t.subject.as_deref(), "--subject")?;
    let role = given(t.role.as_deref(), "--role")?;
    let issuer = given(t.issuer.as_deref(), "--issuer")?;
    let audience = given(t.audience.as_deref(), "--audience")?;
    if !["admin", "auditor", "viewer"].contains(&role) {
        return Err(fail(
            USAGE,
            format!("--role: {role:?} is not admin, auditor or viewer"),
        ));
    }
    let alg = match t.algorithm.as_str() {
        "HS256" => Algorithm::HS256,
        "HS384" => Algorithm::HS384,
        "HS512" => Algorithm::HS512,
        other => {
            return Err(fail(
                USAGE,
                format!("--algorithm: {other:?} is not HS256, HS384 or HS512"),
            ));
        }
    };
    if subject.trim().is_empty() {
        return Err(fail(USAGE, "--subject: must not be empty"));
    }
    if t.ttl_secs == 0 {
        return Err(fail(USAGE, "--ttl-secs: must be at least 1"));
    }
    let secret = std::fs::read(hmac_secret_file).map_err(|e| {
        fail(
            USAGE,
            format!("--hmac-secret-file {}: {e}", hmac_secret_file.display()),
        )
    })?;
    let secret = secret.trim_ascii();
    if secret.len() < 32 {
        return Err(fail(
            USAGE,
            "--hmac-secret-file: the secret must be at least 32 bytes",
        ));
    }
    let now = chrono::Utc::now().timestamp();
    let claims = json!({
        "sub": subject, "role": role, "iss": issuer, "aud": audience,
        "iat": now, "nbf": now, "exp": now + t.ttl_secs as i64,
        // Its id, by which an admin (or the console's sign-out) revokes it.
        "jti": uuid::Uuid::now_v7().to_string(),
    });
    let token = jsonwebtoken::encode(
        &Header::new(alg),
        &claims,
        &EncodingKey::from_secret(secret),
    )
    .map_err(|e| fail(1, format!("signing the token: {e}")))?;
    println!("{token}");
    Ok(())
}

/// Revokes `token` by its `jti` until its `exp`, both read from its payload
/// (the gateway verifies nothing here: revoking a token needs an admin's
/// own token, and a forged jti revokes nothing real), through `path`: an
/// admin token's or a tenant JWT's deny list.
pub(crate) async fn revoke_token(c: &Client, token: &str, path: &str) -> Result<(), Failure> {
    use base64::Engine as _;
    let bad = |why: &str| fail(USAGE, format!("TOKEN: {why}"));
    let payload = token
        .trim()
        .split('.')
        .nth(1)
        .ok_or_else(|| bad("is not a JWT (three dot-separated parts)"))?;
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(payload.trim_end_matches('='))
        .map_err(|_| bad("its payload is not base64url"))?;
    let claims: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|_| bad("its payload is not JSON"))?;
    let jti = claims["jti"]
        .as_str()
        .ok_or_else(|| bad("has no jti claim, so it cannot be revoked; it ends at its exp"))?;
    let expires_at = claims["exp"]
        .as_i64()
        .and_then(|e| chrono::DateTime::from_timestamp(e, 0))
        .ok_or_else(|| bad("has no valid exp claim"))?;
    let body = lorafleet_admin_types::TokenRevocation {
        jti: jti.to_owned(),
        expires_at,
    };
    let revoked: lorafleet_admin_types::TokenRevoked = c.post_as(path, &body).await?;
    show_one(
        c,
        &as_json(&revoked),
        &["jti", "expires_at", "revoked_at", "revoked_by"],
    );
    Ok(())
}
