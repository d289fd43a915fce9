//! Tenants and their API keys: create and disable tenants; create keys
//! (the secret is shown once, on the page that created it) and revoke them.

use super::*;
use crate::admin::types::{KeyList, TenantList};

pub(super) async fn list(State(c): State<Console>, s: Session) -> Response {
    render_list(&c, &s, Outcome::default()).await
}

async fn render_list(c: &Console, s: &Session, outcome: Outcome) -> Response {
    let data = async {
        let tenants: TenantList = c.api(s, Call::get("/admin/v1/tenants")).await?;
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
        let mut spec = json!({
            "name": fields.get("name"),
            "display_name": fields.get("display_name"),
        });
        if let Some(v) = number::<u32>(&fields, "rpm_limit")? {
            spec["rpm_limit"] = json!(v);
        }
        if let Some(v) = number::<u64>(&fields, "tpm_limit")? {
            spec["tpm_limit"] = json!(v);
        }
        if let Some(v) = number::<f64>(&fields, "weight")? {
            spec["weight"] = json!(v);
        }
        c.api::<Value>(&s, Call::post("/admin/v1/tenants", spec))
            .await
    }
    .await;
    match result {
        Ok(_) => Redirect::to("/console/tenants").into_response(),
        Err(e) => render_list(&c, &s, Outcome::refused("create", e, Some(&fields))).await,
    }
}

async fn switch(c: Console, s: Session, fields: Fields, tenant: String, action: &str) -> Response {
    let path = format!("/admin/v1/tenants/{}/{action}", seg(&tenant));
    match c.api::<Value>(&s, Call::post(path, json!({}))).await {
        Ok(_) => Redirect::to("/console/tenants").into_response(),
        Err(e) => render_list(&c, &s, Outcome::refused("switch", e, Some(&fields))).await,
    }
}

pub(super) async fn disable(
    State(c): State<Console>,
    Path(tenant): Path<String>,
    Write { session: s, fields }: Write,
) -> Response {
    switch(c, s, fields, tenant, "disable").await
}

pub(super) async fn enable(
    State(c): State<Console>,
    Path(tenant): Path<String>,
    Write { session: s, fields }: Write,
) -> Response {
    switch(c, s, fields, tenant, "enable").await
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
        let path = format!("/admin/v1/tenants/{}/keys", seg(tenant));
        let keys: KeyList = c.api(s, Call::get(path)).await?;
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
        Ok(json!({ "tenant": tenant, "path": seg(tenant), "keys": rows, "created": created }))
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
        let mut spec = json!({ "name": fields.get("name") });
        if let Some(v) = number::<u64>(&fields, "expires_in_secs")? {
            spec["expires_in_secs"] = json!(v);
        }
        let path = format!("/admin/v1/tenants/{}/keys", seg(&tenant));
        c.api::<Value>(&s, Call::post(path, spec)).await
    }
    .await;
    match result {
        Ok(key) => {
            let created = json!({ "prefix": key["prefix"], "key": key["key"] });
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
    let path = format!("/admin/v1/keys/{}/revoke", seg(&prefix));
    match c.api::<Value>(&s, Call::post(path, json!({}))).await {
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
