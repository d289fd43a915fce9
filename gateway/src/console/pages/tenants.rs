//! Tenants and their API keys: create and disable tenants; create keys
//! (the secret is shown once, on the page that created it) and revoke them;
//! revoke a tenant's JWT from the token itself (its `jti` until its `exp`).

use super::*;
use crate::admin::types::{Limit, NewKey, NewTenant, TenantPatch, TokenRevocation};
use crate::admin::{
    CreateKey, CreateTenant, GetTenant, ListKeys, ListTenants, RevokeKey, RevokeTenantToken,
    SetTenantDisabled, UpdateTenant,
};

pub(super) async fn list(State(c): State<Console>, s: Session) -> Response {
    render_list(&c, &s, Outcome::default()).await
}

async fn render_list(c: &Console, s: &Session, outcome: Outcome) -> Response {
    let data = async {
        let tenants = c.read(s, ListTenants).await?;
        let rows: Vec<Value> = tenants
            .tenants
            .iter()
            .map(|t| {
                json!({
                    "name": t.name,
                    "path": seg(&t.name),
                    "display_name": t.display_name,
                    "rpm_limit": t.rpm_limit,
                    "tpm_limit": t.tpm_limit,
                    "weight": t.weight,
                    "disabled": t.disabled_at.is_some(),
                    "created_at": t.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                })
            })
            .collect();
        Ok(json!({ "tenants": rows }))
    }
    .await;
    show(c, s, "tenants.html", "tenants", outcome, data)
}

pub(super) async fn create(
    State(c): State<Console>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let spec = NewTenant {
            name: fields.get("name").to_owned(),
            display_name: fields.get("display_name").to_owned(),
            rpm_limit: number(&fields, "rpm_limit")?,
            tpm_limit: number(&fields, "tpm_limit")?,
            weight: number(&fields, "weight")?,
        };
        c.exec(&s, CreateTenant(spec)).await
    }
    .await;
    match result {
        Ok(_) => Redirect::to("/console/tenants").into_response(),
        Err(e) => render_list(&c, &s, Outcome::refused("create", e, Some(&fields))).await,
    }
}

/// `POST /console/tenant-tokens/revoke`: a tenant JWT pasted whole,
/// revoked by its `jti` until its `exp` (read from the token, whose
/// signature this does not need: revoking a forged token denies nothing).
pub(super) async fn revoke_tenant_token(
    State(c): State<Console>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let revocation = claims_of(fields.get("token"))?;
        c.exec(&s, RevokeTenantToken(revocation)).await
    }
    .await;
    match result {
        Ok(r) => {
            let outcome = Outcome {
                form: Some("revoke-token"),
                notice: Some(format!(
                    "tenant token {} revoked until {}",
                    r.jti,
                    r.expires_at
                        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
                )),
                ..Outcome::default()
            };
            render_list(&c, &s, outcome).await
        }
        Err(e) => {
            // The token is never echoed back into the page.
            render_list(&c, &s, Outcome::refused("revoke-token", e, None)).await
        }
    }
}

/// The `jti` and `exp` of a JWT's payload, refused by field `token`.
fn claims_of(token: &str) -> Result<TokenRevocation, ApiError> {
    let bad = |why: &str| ApiError::field("token", why);
    let claims: Value = jsonwebtoken::dangerous::insecure_decode_claims(token.trim())
        .map_err(|_| bad("is not a JWT (three base64url parts, a JSON payload)"))?;
    let jti = claims["jti"]
        .as_str()
        .filter(|j| !j.is_empty())
        .ok_or_else(|| bad("has no jti claim: it cannot be revoked alone"))?;
    let exp = claims["exp"]
        .as_i64()
        .and_then(|e| chrono::DateTime::from_timestamp(e, 0))
        .ok_or_else(|| bad("has no exp claim"))?;
    Ok(TokenRevocation {
        jti: jti.to_owned(),
        expires_at: exp,
    })
}

async fn switch(
    c: Console,
    s: Session,
    fields: Fields,
    tenant: String,
    disabled: bool,
) -> Response {
    match c.exec(&s, SetTenantDisabled { tenant, disabled }).await {
        Ok(_) => Redirect::to("/console/tenants").into_response(),
        Err(e) => render_list(&c, &s, Outcome::refused("switch", e, Some(&fields))).await,
    }
}

pub(super) async fn disable(
    State(c): State<Console>,
    Path(tenant): Path<String>,
    Write { session: s, fields }: Write,
) -> Response {
    switch(c, s, fields, tenant, true).await
}

pub(super) async fn enable(
    State(c): State<Console>,
    Path(tenant): Path<String>,
    Write { session: s, fields }: Write,
) -> Response {
    switch(c, s, fields, tenant, false).await
}

pub(super) async fn page(
    State(c): State<Console>,
    s: Session,
    Path(tenant): Path<String>,
) -> Response {
    render(&c, &s, &tenant, Outcome::default(), None).await
}

/// One tenant's keys; `created` is a key just made, shown this once.
async fn render(
    c: &Console,
    s: &Session,
    tenant: &str,
    outcome: Outcome,
    created: Option<Value>,
) -> Response {
    let data = async {
        let tenant_name = tenant.to_owned();
        let keys = c.read(s, ListKeys { tenant: tenant_name }).await?;
        let t = c
            .read(
                s,
                GetTenant {
                    tenant: tenant.to_owned(),
                },
            )
            .await?;
        let limits = json!({
            "rpm_limit": limit_text(t.rpm_limit),
            "tpm_limit": limit_text(t.tpm_limit),
            "max_concurrent": limit_text(t.max_concurrent),
            "weight": t.weight.to_string(),
        });
        let rows: Vec<Value> = keys
            .keys
            .iter()
            .map(|k| {
                json!({
                    "prefix": k.prefix,
                    "name": k.name,
                    "scopes": k.scopes.join(", "),
                    "created_at": k.created_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    "expires_at": k.expires_at.map(|t| t.to_rfc3339_opts(chrono::SecondsFormat::Secs, true)),
                    "revoked": k.revoked_at.is_some(),
                })
            })
            .collect();
        Ok(json!({ "tenant": tenant, "path": seg(tenant), "keys": rows, "created": created,
                   "limits": limits }))
    }
    .await;
    show(c, s, "tenant.html", "tenants", outcome, data)
}

pub(super) async fn create_key(
    State(c): State<Console>,
    Path(tenant): Path<String>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let spec = NewKey {
            name: fields.get("name").to_owned(),
            expires_in_secs: number(&fields, "expires_in_secs")?,
            ..NewKey::default()
        };
        let tenant = tenant.clone();
        c.exec(&s, CreateKey { tenant, spec }).await
    }
    .await;
    match result {
        Ok(key) => {
            let created = json!({ "prefix": key.row.prefix, "key": key.key });
            render(&c, &s, &tenant, Outcome::default(), Some(created)).await
        }
        Err(e) => {
            render(
                &c,
                &s,
                &tenant,
                Outcome::refused("key", e, Some(&fields)),
                None,
            )
            .await
        }
    }
}

pub(super) async fn revoke_key(
    State(c): State<Console>,
    Path((tenant, prefix)): Path<(String, String)>,
    Write { session: s, fields }: Write,
) -> Response {
    match c.exec(&s, RevokeKey { prefix }).await {
        Ok(_) => Redirect::to(&format!("/console/tenants/{}", seg(&tenant))).into_response(),
        Err(e) => {
            render(
                &c,
                &s,
                &tenant,
                Outcome::refused("revoke", e, Some(&fields)),
                None,
            )
            .await
        }
    }
}

/// A limit as the form shows and takes it.
fn limit_text(l: Limit) -> String {
    match l {
        Limit::Default => "default".into(),
        Limit::Unlimited => "unlimited".into(),
        Limit::Max(n) => n.to_string(),
    }
}

/// A form's limit: blank leaves it as it is.
fn limit(fields: &Fields, name: &str) -> Result<Option<Limit>, ApiError> {
    match non_blank(fields.get(name)) {
        None => Ok(None),
        Some(v) => v
            .parse()
            .map(Some)
            .map_err(|e: crate::admin::types::NotALimit| ApiError::field(name, &e.to_string())),
    }
}

/// `POST /console/tenants/{tenant}/limits`: the limits form.
pub(super) async fn update_limits(
    State(c): State<Console>,
    Path(tenant): Path<String>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let patch = TenantPatch {
            display_name: None,
            rpm_limit: limit(&fields, "rpm_limit")?,
            tpm_limit: limit(&fields, "tpm_limit")?,
            max_concurrent: limit(&fields, "max_concurrent")?,
            weight: number(&fields, "weight")?,
        };
        let tenant = tenant.clone();
        c.exec(&s, UpdateTenant { tenant, patch }).await
    }
    .await;
    match result {
        Ok(_) => Redirect::to(&format!("/console/tenants/{}", seg(&tenant))).into_response(),
        Err(e) => {
            render(
                &c,
                &s,
                &tenant,
                Outcome::refused("limits", e, Some(&fields)),
                None,
            )
            .await
        }
    }
}
