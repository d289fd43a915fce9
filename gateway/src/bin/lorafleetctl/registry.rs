//! Tenants, API keys, base models and adapter versions.

use super::*;

pub(crate) const TENANT_COLUMNS: &[&str] = &[
    "name",
    "display_name",
    "rpm_limit",
    "tpm_limit",
    "created_at",
    "disabled_at",
];

pub(crate) async fn tenants(c: &Client, cmd: TenantCmd) -> Result<(), Failure> {
    match cmd {
        TenantCmd::List => {
            let body = c.get("/tenants", &[]).await?;
            show_list(c, &body, "tenants", TENANT_COLUMNS);
        }
        TenantCmd::Create {
            name,
            display_name,
            rpm_limit,
            tpm_limit,
        } => {
            let body = c
                .post(
                    "/tenants",
                    json!({"name": name, "display_name": display_name,
                           "rpm_limit": rpm_limit, "tpm_limit": tpm_limit}),
                )
                .await?;
            show_one(c, &body, TENANT_COLUMNS);
        }
        TenantCmd::Disable { name } => {
            let body = c
                .post(&format!("/tenants/{}/disable", segment(&name)), json!({}))
                .await?;
            show_one(c, &body, TENANT_COLUMNS);
        }
        TenantCmd::Enable { name } => {
            let body = c
                .post(&format!("/tenants/{}/enable", segment(&name)), json!({}))
                .await?;
            show_one(c, &body, TENANT_COLUMNS);
        }
    }
    Ok(())
}

pub(crate) const KEY_COLUMNS: &[&str] = &[
    "prefix",
    "tenant",
    "name",
    "scopes",
    "created_at",
    "expires_at",
    "revoked_at",
];

pub(crate) async fn keys(c: &Client, cmd: KeyCmd) -> Result<(), Failure> {
    match cmd {
        KeyCmd::List { tenant } => {
            let body = c
                .get(&format!("/tenants/{}/keys", segment(&tenant)), &[])
                .await?;
            show_list(c, &body, "keys", KEY_COLUMNS);
        }
        KeyCmd::Create {
            tenant,
            name,
            scopes,
            expires_in,
            expires_at,
        } => {
            let mut req = json!({ "name": name });
            if !scopes.is_empty() {
                req["scopes"] = json!(scopes);
            }
            if let Some(d) = expires_in {
                req["expires_in_secs"] = json!(parse_duration(&d)?);
            }
            if let Some(at) = expires_at {
                req["expires_at"] = json!(at);
            }
            let body = c
                .post(&format!("/tenants/{}/keys", segment(&tenant)), req)
                .await?;
            if c.output == Output::Json {
                println!("{body}");
            } else {
                show_one(c, &body, KEY_COLUMNS);
                println!();
                println!("key: {}", cell(&body["key"]));
                eprintln!("Store this key now: it is not shown again.");
            }
        }
        KeyCmd::Revoke { prefix } => {
            let body = c
                .post(&format!("/keys/{}/revoke", segment(&prefix)), json!({}))
                .await?;
            show_one(c, &body, KEY_COLUMNS);
        }
    }
    Ok(())
}

pub(crate) async fn base_models(c: &Client, cmd: BaseCmd) -> Result<(), Failure> {
    let columns = &["name", "architecture", "base_hash", "created_at"];
    match cmd {
        BaseCmd::List => {
            let body = c.get("/base-models", &[]).await?;
            show_list(c, &body, "base_models", columns);
        }
        BaseCmd::Register {
            name,
            architecture,
            base_hash,
            model_dir,
        } => {
            let hash = match (base_hash, model_dir) {
                (Some(h), _) => h,
                (None, Some(dir)) => hash_model_dir(&dir)?,
                (None, None) => return Err(fail(USAGE, "--base-hash or --model-dir: required")),
            };
            let body = c
                .post(
                    "/base-models",
                    json!({"name": name, "architecture": architecture, "base_hash": hash}),
                )
                .await?;
            show_one(c, &body, columns);
        }
        BaseCmd::Hash { .. } => unreachable!("handled before connecting"),
    }
    Ok(())
}

pub(crate) const ADAPTER_COLUMNS: &[&str] = &[
    "lora_int_id",
    "name",
    "version",
    "base_model",
    "tenant",
    "rank",
    "target_modules",
    "state",
    "artifact_uri",
];

pub(crate) async fn adapters(c: &Client, cmd: AdapterCmd) -> Result<(), Failure> {
    match cmd {
        AdapterCmd::List { name, base_model } => {
            let mut q = Vec::new();
            if let Some(n) = name {
                q.push(("name", n));
            }
            if let Some(b) = base_model {
                q.push(("base_model", b));
            }
            let body = c.get("/adapters", &q).await?;
            show_list(c, &body, "adapters", ADAPTER_COLUMNS);
        }
        AdapterCmd::Register {
            name,
            base_model,
            artifact_uri,
            version,
            tenant,
        } => {
            let body = c
                .post(
                    "/adapters",
                    json!({"name": name, "base_model": base_model, "artifact_uri": artifact_uri,
                           "version": version, "tenant": tenant}),
                )
                .await?;
            show_one(
                c,
                &body,
                &[
                    "lora_int_id",
                    "name",
                    "version",
                    "base_model",
                    "tenant",
                    "rank",
                    "alpha",
                    "use_rslora",
                    "target_modules",
                    "artifact_uri",
                    "artifact_sha256",
                ],
            );
        }
        AdapterCmd::Retire { lora_int_id } => {
            let body = c
                .post(&format!("/adapters/{lora_int_id}/retire"), json!({}))
                .await?;
            show_one(c, &body, ADAPTER_COLUMNS);
        }
        AdapterCmd::Digest { .. } => unreachable!("handled before connecting"),
    }
    Ok(())
}
