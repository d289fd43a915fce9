//! Who is calling: tenant API keys and tenant JWTs, both as
//! `Authorization: Bearer`.
//!
//! - An API key is `<prefix>.<secret>`; the prefix finds the key in the
//!   registry snapshot and SHA-256 of the secret is compared with the stored
//!   hash in constant time. Scopes, expiry and revocation apply.
//! - A JWT is checked against keys from configuration with an algorithm
//!   allow-list; `exp`, `nbf`, `iss` and `aud` are enforced. The tenant is
//!   the `tenant` claim (a tenant name); `scope` (space-separated) gives
//!   its scopes, and without one the token carries none.
//!
//! Every failure is one 401 with a reason that does not tell a wrong secret
//! from an unknown key.

use crate::flag_error::{FlagError, ensure};
use std::path::PathBuf;

use chrono::Utc;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use sha2::{Digest, Sha256};
use uuid::Uuid;

use crate::ids::{KeyId, TenantId};

use crate::registry::Snapshot;

pub const SCOPE_INFERENCE: &str = "inference";
pub const SCOPE_MODELS_READ: &str = "models:read";

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Principal {
    pub tenant_id: TenantId,
    pub api_key_id: Option<KeyId>,
    /// The API key's prefix (never its secret), for the audit row.
    pub api_key_prefix: Option<String>,
    /// The JWT subject, if the caller used a JWT.
    pub subject: Option<String>,
    pub scopes: Vec<String>,
}

impl Principal {
    pub fn has_scope(&self, scope: &str) -> bool {
        self.scopes.iter().any(|s| s == scope)
    }
}

/// Why a credential was refused. The messages are safe to return.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("no credential: send \"Authorization: Bearer <API key or JWT>\"")]
    Missing,
    #[error("the Authorization header is not \"Bearer <token>\"")]
    Malformed,
    #[error("invalid API key")]
    InvalidKey,
    #[error("the API key has expired")]
    Expired,
    #[error("the API key has been revoked")]
    Revoked,
    #[error("the tenant is disabled")]
    TenantDisabled,
    #[error("invalid token: {0}")]
    InvalidToken(String),
    #[error("JWTs are not accepted by this gateway")]
    JwtDisabled,
}

/// JWT settings, from flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct JwtArgs {
    /// File holding the shared secret for HS256/HS384/HS512 tokens.
    #[arg(long, env = "LORAFLEET_JWT_HMAC_SECRET_FILE")]
    pub jwt_hmac_secret_file: Option<PathBuf>,
    /// PEM file with the RSA or EC public key for RS*/PS*/ES* tokens.
    #[arg(long, env = "LORAFLEET_JWT_PUBLIC_KEY_FILE")]
    pub jwt_public_key_file: Option<PathBuf>,
    /// Algorithms accepted (comma-separated), e.g. "RS256,HS256".
    #[arg(long, env = "LORAFLEET_JWT_ALGORITHMS", value_delimiter = ',')]
    pub jwt_algorithms: Vec<String>,
    /// Required `iss`.
    #[arg(long, env = "LORAFLEET_JWT_ISSUER")]
    pub jwt_issuer: Option<String>,
    /// Required `aud`.
    #[arg(long, env = "LORAFLEET_JWT_AUDIENCE")]
    pub jwt_audience: Option<String>,
}

/// A validated JWT configuration.
#[derive(Clone)]
pub struct JwtConfig {
    hmac: Option<DecodingKey>,
    public: Option<DecodingKey>,
    algorithms: Vec<Algorithm>,
    issuer: String,
    audience: String,
    /// The longest lifetime a token may have, in seconds (admin tokens);
    /// None: any.
    max_ttl_secs: Option<i64>,
}

impl JwtConfig {
    /// Refuses tokens that live longer than `secs` (see
    /// [`JwtConfig::max_ttl_secs`]).
    pub fn with_max_ttl(mut self, secs: u64) -> JwtConfig {
        self.max_ttl_secs = Some(i64::try_from(secs).unwrap_or(i64::MAX));
        self
    }

    /// The longest lifetime a token may have, if bounded.
    pub fn max_ttl_secs(&self) -> Option<i64> {
        self.max_ttl_secs
    }
}

impl std::fmt::Debug for JwtConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtConfig")
            .field("algorithms", &self.algorithms)
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .finish_non_exhaustive()
    }
}

fn is_hmac(a: Algorithm) -> bool {
    matches!(a, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512)
}

impl JwtArgs {
    /// None when no JWT key is configured (JWTs are then refused).
    pub fn config(&self) -> Result<Option<JwtConfig>, FlagError> {
        jwt_config(
            "--jwt-",
            self.jwt_hmac_secret_file.as_deref(),
            self.jwt_public_key_file.as_deref(),
            &self.jwt_algorithms,
            self.jwt_issuer.as_deref(),
            self.jwt_audience.as_deref(),
        )
    }
}

/// Builds a JWT configuration from flags named `<flag_prefix>hmac-secret-file`
/// and so on, so that errors name the flag the operator set. None when no
/// key is configured.
pub fn jwt_config(
    flag_prefix: &str,
    hmac_secret_file: Option<&std::path::Path>,
    public_key_file: Option<&std::path::Path>,
    algorithm_names: &[String],
    issuer: Option<&str>,
    audience: Option<&str>,
) -> Result<Option<JwtConfig>, FlagError> {
    let flag = |name: &str| format!("{flag_prefix}{name}");
    if hmac_secret_file.is_none() && public_key_file.is_none() {
        ensure(
            algorithm_names.is_empty(),
            flag("algorithms"),
            format!(
                "set {} or {} too",
                flag("hmac-secret-file"),
                flag("public-key-file")
            ),
        )?;
        return Ok(None);
    }
    ensure(
        !algorithm_names.is_empty(),
        flag("algorithms"),
        "required with a JWT key, e.g. RS256",
    )?;
    let mut algorithms = Vec::new();
    for a in algorithm_names {
        let alg: Algorithm = a.trim().parse().map_err(|_| {
            FlagError::new(
                flag("algorithms"),
                format!("{a:?} is not a JWT algorithm such as RS256"),
            )
        })?;
        algorithms.push(alg);
    }
    let hmac = match hmac_secret_file {
        Some(p) => {
            let secret = std::fs::read(p).map_err(|e| {
                FlagError::new(flag("hmac-secret-file"), format!("{}: {e}", p.display()))
            })?;
            let secret = secret.trim_ascii();
            ensure(
                secret.len() >= 32,
                flag("hmac-secret-file"),
                "the secret must be at least 32 bytes",
            )?;
            Some(DecodingKey::from_secret(secret))
        }
        None => None,
    };
    let public = match public_key_file {
        Some(p) => {
            let pem = std::fs::read(p).map_err(|e| {
                FlagError::new(flag("public-key-file"), format!("{}: {e}", p.display()))
            })?;
            let key = DecodingKey::from_rsa_pem(&pem)
                .or_else(|_| DecodingKey::from_ec_pem(&pem))
                .map_err(|e| {
                    FlagError::new(
                        flag("public-key-file"),
                        format!("{}: not an RSA or EC public key in PEM: {e}", p.display()),
                    )
                })?;
            Some(key)
        }
        None => None,
    };
    for a in &algorithms {
        let needs = if is_hmac(*a) {
            (hmac.is_none(), "hmac-secret-file")
        } else {
            (public.is_none(), "public-key-file")
        };
        ensure(
            !needs.0,
            flag("algorithms"),
            format!("{a:?} needs {}", flag(needs.1)),
        )?;
    }
    let issuer = issuer
        .filter(|s| !s.is_empty())
        .ok_or_else(|| FlagError::new(flag("issuer"), "required with a JWT key"))?
        .to_owned();
    let audience = audience
        .filter(|s| !s.is_empty())
        .ok_or_else(|| FlagError::new(flag("audience"), "required with a JWT key"))?
        .to_owned();
    Ok(Some(JwtConfig {
        hmac,
        public,
        algorithms,
        issuer,
        audience,
        max_ttl_secs: None,
    }))
}

/// Verifies a JWT's signature (with an allowed algorithm), `exp`, `nbf`,
/// `iss` and `aud`, and returns its claims.
pub fn decode_jwt<C: serde::de::DeserializeOwned>(
    token: &str,
    jwt: &JwtConfig,
) -> Result<C, AuthError> {
    let bad = |e: jsonwebtoken::errors::Error| AuthError::InvalidToken(e.to_string());
    let header = jsonwebtoken::decode_header(token).map_err(bad)?;
    if !jwt.algorithms.contains(&header.alg) {
        return Err(AuthError::InvalidToken(format!(
            "algorithm {:?} is not accepted",
            header.alg
        )));
    }
    let key = if is_hmac(header.alg) {
        jwt.hmac.as_ref()
    } else {
        jwt.public.as_ref()
    }
    .ok_or_else(|| AuthError::InvalidToken("no key for this algorithm".into()))?;
    let mut validation = Validation::new(header.alg);
    validation.algorithms = vec![header.alg];
    validation.validate_exp = true;
    validation.validate_nbf = true;
    validation.leeway = 30;
    validation.set_issuer(&[&jwt.issuer]);
    validation.set_audience(&[&jwt.audience]);
    validation.set_required_spec_claims(&["exp", "iss", "aud"]);
    Ok(jsonwebtoken::decode::<C>(token, key, &validation)
        .map_err(bad)?
        .claims)
}

/// The token of an `Authorization: Bearer <token>` header.
pub fn bearer(header: Option<&str>) -> Result<&str, AuthError> {
    let header = header.ok_or(AuthError::Missing)?;
    header
        .strip_prefix("Bearer ")
        .or_else(|| header.strip_prefix("bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .ok_or(AuthError::Malformed)
}

#[derive(Debug, Deserialize)]
struct Claims {
    tenant: String,
    sub: Option<String>,
    scope: Option<String>,
    /// Its id, by which an admin revokes it before it expires.
    #[serde(default)]
    jti: Option<String>,
}

/// Authenticates the `Authorization` header value against the snapshot.
pub fn authenticate(
    header: Option<&str>,
    snapshot: &Snapshot,
    jwt: Option<&JwtConfig>,
) -> Result<Principal, AuthError> {
    let token = bearer(header)?;
    if token.starts_with("lf_") {
        api_key(token, snapshot)
    } else {
        json_web_token(token, snapshot, jwt.ok_or(AuthError::JwtDisabled)?)
    }
}

fn api_key(token: &str, snapshot: &Snapshot) -> Result<Principal, AuthError> {
    let (prefix, secret) = token.split_once('.').ok_or(AuthError::InvalidKey)?;
    let Some(key) = snapshot.api_keys.get(prefix) else {
        // Same work as a known prefix, so timing does not reveal which
        // prefixes exist.
        let _ = constant_time_eq(&Sha256::digest(secret.as_bytes()).into(), &[0u8; 32]);
        return Err(AuthError::InvalidKey);
    };
    let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
    if !constant_time_eq(&digest, &key.secret_sha256) {
        return Err(AuthError::InvalidKey);
    }
    if key.revoked {
        return Err(AuthError::Revoked);
    }
    if key.expires_at.is_some_and(|t| t <= Utc::now()) {
        return Err(AuthError::Expired);
    }
    let tenant = snapshot
        .tenant(&key.tenant_id)
        .ok_or(AuthError::InvalidKey)?;
    if tenant.disabled {
        return Err(AuthError::TenantDisabled);
    }
    Ok(Principal {
        tenant_id: key.tenant_id,
        api_key_id: Some(key.id),
        api_key_prefix: Some(prefix.to_owned()),
        subject: None,
        scopes: key.scopes.clone(),
    })
}

fn json_web_token(
    token: &str,
    snapshot: &Snapshot,
    jwt: &JwtConfig,
) -> Result<Principal, AuthError> {
    let claims: Claims = decode_jwt(token, jwt)?;
    if let Some(jti) = &claims.jti
        && snapshot.tenant_token_revoked(jti)
    {
        return Err(AuthError::InvalidToken("it was revoked".into()));
    }
    let tenant = snapshot
        .tenant_by_name(&claims.tenant)
        .ok_or_else(|| AuthError::InvalidToken("unknown tenant".into()))?;
    if tenant.disabled {
        return Err(AuthError::TenantDisabled);
    }
    let scopes = match claims.scope {
        Some(s) => s.split_whitespace().map(str::to_owned).collect(),
        // A token that names no scope grants none: an issuer's token made
        // for something else must not work here by default.
        None => Vec::new(),
    };
    Ok(Principal {
        tenant_id: tenant.id,
        api_key_id: None,
        api_key_prefix: None,
        subject: claims.sub,
        scopes,
    })
}

/// Compares without an early exit, so the time taken does not depend on
/// where the first differing byte is.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a
        .iter()
        .zip(b)
        .fold(0u8, |acc, (x, y)| acc | std::hint::black_box(x ^ y));
    diff == 0
}

/// A new API key for `tenant`: (prefix, full key to show once, SHA-256 of
/// the secret to store).
pub fn new_api_key() -> (String, String, [u8; 32]) {
    let prefix = format!("lf_{}", random_alnum(12));
    let secret = random_alnum(43);
    let hash: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
    (prefix.clone(), format!("{prefix}.{secret}"), hash)
}

/// `n` random alphanumerics from the OS generator (~5.95 bits each).
fn random_alnum(n: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut out = String::with_capacity(n);
    while out.len() < n {
        // Bytes 6 and 8 of a v4 UUID carry its version and variant bits;
        // the other 14 come straight from the OS generator.
        let uuid = Uuid::new_v4();
        let random = uuid
            .as_bytes()
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 6 && *i != 8)
            .map(|(_, b)| b);
        for b in random {
            // Rejection sampling keeps every character equally likely.
            if (*b as usize) < 248 && out.len() < n {
                out.push(ALPHABET[*b as usize % 62] as char);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::{ApiKey, Limit, Tenant};
    use jsonwebtoken::{EncodingKey, Header};

    const SECRET: &[u8] = b"an hmac secret of at least 32 bytes!";

    fn snapshot() -> (Snapshot, TenantId) {
        let tenant = Tenant {
            id: TenantId(Uuid::from_u128(1)),
            name: "acme".into(),
            rpm_limit: Limit::Default,
            tpm_limit: Limit::Default,
            max_concurrent: Limit::Default,
            disabled: false,
            weight: 1.0,
        };
        let mut s = Snapshot::default();
        s.insert_tenant(tenant.clone());
        let key = |id: u128, scopes: &[&str], expired: bool, revoked: bool| ApiKey {
            id: KeyId(Uuid::from_u128(id)),
            tenant_id: tenant.id,
            secret_sha256: Sha256::digest(b"s3cret").into(),
            scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
            expires_at: expired.then(|| Utc::now() - chrono::Duration::seconds(5)),
            revoked,
        };
        s.api_keys
            .insert("lf_good0001".into(), key(10, &["inference"], false, false));
        s.api_keys
            .insert("lf_expired01".into(), key(11, &["inference"], true, false));
        s.api_keys
            .insert("lf_revoked01".into(), key(12, &["inference"], false, true));
        (s, tenant.id)
    }

    fn jwt_config(algorithms: &[&str]) -> JwtConfig {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, SECRET).unwrap();
        JwtArgs {
            jwt_hmac_secret_file: Some(secret),
            jwt_public_key_file: None,
            jwt_algorithms: algorithms.iter().map(|s| (*s).to_owned()).collect(),
            jwt_issuer: Some("https://issuer.example".into()),
            jwt_audience: Some("lorafleet".into()),
        }
        .config()
        .unwrap()
        .unwrap()
    }

    fn token(alg: Algorithm, claims: serde_json::Value) -> String {
        jsonwebtoken::encode(
            &Header::new(alg),
            &claims,
            &EncodingKey::from_secret(SECRET),
        )
        .unwrap()
    }

    fn claims(tweak: impl FnOnce(&mut serde_json::Value)) -> serde_json::Value {
        let now = Utc::now().timestamp();
        let mut c = serde_json::json!({
            "tenant": "acme", "sub": "alice", "iss": "https://issuer.example",
            "aud": "lorafleet", "exp": now + 600, "nbf": now - 10,
        });
        tweak(&mut c);
        c
    }

    #[test]
    fn api_keys_are_checked_for_secret_expiry_and_revocation() {
        let (s, tenant) = snapshot();
        let p = authenticate(Some("Bearer lf_good0001.s3cret"), &s, None).unwrap();
        assert_eq!((p.tenant_id, p.has_scope(SCOPE_INFERENCE)), (tenant, true));
        assert!(!p.has_scope(SCOPE_MODELS_READ));
        let err = |h: Option<&str>| authenticate(h, &s, None).unwrap_err();
        assert_eq!(err(None), AuthError::Missing);
        assert_eq!(err(Some("Basic abc")), AuthError::Malformed);
        assert_eq!(err(Some("Bearer lf_good0001.wrong")), AuthError::InvalidKey);
        assert_eq!(
            err(Some("Bearer lf_unknown1.s3cret")),
            AuthError::InvalidKey
        );
        assert_eq!(err(Some("Bearer lf_good0001")), AuthError::InvalidKey);
        assert_eq!(err(Some("Bearer lf_expired01.s3cret")), AuthError::Expired);
        assert_eq!(err(Some("Bearer lf_revoked01.s3cret")), AuthError::Revoked);
        // A revoked key with a wrong secret says nothing about revocation.
        assert_eq!(err(Some("Bearer lf_revoked01.nope")), AuthError::InvalidKey);
        assert_eq!(err(Some("Bearer eyJ.x.y")), AuthError::JwtDisabled);
    }

    #[test]
    fn jwts_are_checked_for_algorithm_signature_and_claims() {
        let (s, tenant) = snapshot();
        let jwt = jwt_config(&["HS256"]);
        let check = |t: String| authenticate(Some(&format!("Bearer {t}")), &s, Some(&jwt));
        let p = check(token(Algorithm::HS256, claims(|_| {}))).unwrap();
        assert_eq!(p.tenant_id, tenant);
        assert_eq!(p.subject.as_deref(), Some("alice"));
        // No scope claim: no scope (a token made for something else does
        // not work here by default).
        assert!(!p.has_scope(SCOPE_INFERENCE) && !p.has_scope(SCOPE_MODELS_READ));
        let p = check(token(
            Algorithm::HS256,
            claims(|c| c["scope"] = "models:read".into()),
        ))
        .unwrap();
        assert!(!p.has_scope(SCOPE_INFERENCE) && p.has_scope(SCOPE_MODELS_READ));
        let p = check(token(
            Algorithm::HS256,
            claims(|c| c["scope"] = "inference models:read".into()),
        ))
        .unwrap();
        assert!(p.has_scope(SCOPE_INFERENCE) && p.has_scope(SCOPE_MODELS_READ));

        let now = Utc::now().timestamp();
        let refused: Vec<(&str, String)> = vec![
            ("HS384 not allowed", token(Algorithm::HS384, claims(|_| {}))),
            (
                "expired",
                token(Algorithm::HS256, claims(|c| c["exp"] = (now - 120).into())),
            ),
            (
                "not yet valid",
                token(Algorithm::HS256, claims(|c| c["nbf"] = (now + 600).into())),
            ),
            (
                "issuer",
                token(
                    Algorithm::HS256,
                    claims(|c| c["iss"] = "https://evil".into()),
                ),
            ),
            (
                "audience",
                token(Algorithm::HS256, claims(|c| c["aud"] = "other".into())),
            ),
            (
                "no exp",
                token(
                    Algorithm::HS256,
                    claims(|c| {
                        c.as_object_mut().unwrap().remove("exp");
                    }),
                ),
            ),
            (
                "unknown tenant",
                token(Algorithm::HS256, claims(|c| c["tenant"] = "globex".into())),
            ),
            (
                "no tenant",
                token(
                    Algorithm::HS256,
                    claims(|c| {
                        c.as_object_mut().unwrap().remove("tenant");
                    }),
                ),
            ),
        ];
        for (why, t) in refused {
            assert!(
                matches!(check(t), Err(AuthError::InvalidToken(_))),
                "{why} must be refused"
            );
        }
        // A forged signature.
        let good = token(Algorithm::HS256, claims(|_| {}));
        let forged = format!("{}x", &good[..good.len() - 1]);
        assert!(matches!(check(forged), Err(AuthError::InvalidToken(_))));
    }

    #[test]
    fn jwt_settings_are_validated_by_flag() {
        let err = |args: JwtArgs| args.config().unwrap_err().to_string();
        assert!(
            err(JwtArgs {
                jwt_algorithms: vec!["HS256".into()],
                ..Default::default()
            })
            .starts_with("--jwt-algorithms")
        );
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("s");
        std::fs::write(&secret, SECRET).unwrap();
        let with = |algs: &[&str], iss: Option<&str>| JwtArgs {
            jwt_hmac_secret_file: Some(secret.clone()),
            jwt_algorithms: algs.iter().map(|s| (*s).to_owned()).collect(),
            jwt_issuer: iss.map(Into::into),
            jwt_audience: Some("a".into()),
            ..Default::default()
        };
        assert!(err(with(&[], Some("i"))).starts_with("--jwt-algorithms: required"));
        assert!(err(with(&["XX1"], Some("i"))).contains("\"XX1\" is not a JWT algorithm"));
        assert!(err(with(&["RS256"], Some("i"))).contains("--jwt-public-key-file"));
        assert!(err(with(&["HS256"], None)).starts_with("--jwt-issuer"));
        std::fs::write(&secret, b"short").unwrap();
        assert!(err(with(&["HS256"], Some("i"))).contains("at least 32 bytes"));
    }

    #[test]
    fn constant_time_eq_compares_every_byte() {
        let a = [7u8; 32];
        let mut b = a;
        assert!(constant_time_eq(&a, &b));
        b[31] ^= 1;
        assert!(!constant_time_eq(&a, &b));
    }

    #[test]
    fn new_keys_match_the_schema_format_and_differ() {
        let (p1, k1, h1) = new_api_key();
        let (p2, _, _) = new_api_key();
        assert!(p1.starts_with("lf_") && p1.len() == 15 && p1 != p2);
        let (prefix, secret) = k1.split_once('.').unwrap();
        assert_eq!(prefix, p1);
        assert_eq!(<[u8; 32]>::from(Sha256::digest(secret.as_bytes())), h1);
        assert!(secret.chars().all(|c| c.is_ascii_alphanumeric()));
    }
}
