//! Minting HMAC-signed admin tokens for bootstrap.

use super::*;

pub(crate) fn mint_token(t: &TokenArgs) -> Result<(), Failure> {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    if !["admin", "auditor", "viewer"].contains(&t.role.as_str()) {
        return Err(fail(
            USAGE,
            format!("--role: {:?} is not admin, auditor or viewer", t.role),
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
    if t.subject.trim().is_empty() {
        return Err(fail(USAGE, "--subject: must not be empty"));
    }
    if t.ttl_secs == 0 {
        return Err(fail(USAGE, "--ttl-secs: must be at least 1"));
    }
    let secret = std::fs::read(&t.hmac_secret_file).map_err(|e| {
        fail(
            USAGE,
            format!("--hmac-secret-file {}: {e}", t.hmac_secret_file.display()),
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
        "sub": t.subject, "role": t.role, "iss": t.issuer, "aud": t.audience,
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
