//! Tenants, API keys, base models and adapter versions.

use super::*;
use lorafleet_admin_types::*;

pub(crate) const TENANT_COLUMNS: &[&str] = &[
    "name",
    "display_name",
    "rpm_limit",
    "tpm_limit",
    "max_concurrent",
    "weight",
    "created_at",
    "disabled_at",
];

pub(crate) async fn tenants(c: &Client, cmd: TenantCmd) -> Result<(), Failure> {
    match cmd {
        TenantCmd::List => {
            let list: TenantList = c.get_as("/tenants", &[]).await?;
            show_list(c, &as_json(&list), "tenants", TENANT_COLUMNS);
        }
        TenantCmd::Create {
            name,
            display_name,
            rpm_limit,
            tpm_limit,
            weight,
        } => {
            let new = NewTenant {
                name,
                display_name,
                rpm_limit,
                tpm_limit,
                weight,
            };
            let tenant: TenantRow = c.post_as("/tenants", &new).await?;
            show_one(c, &as_json(&tenant), TENANT_COLUMNS);
        }
        TenantCmd::Update {
            name,
            display_name,
            rpm_limit,
            tpm_limit,
            max_concurrent,
            weight,
        } => {
            let patch = TenantPatch {
                display_name,
                rpm_limit,
                tpm_limit,
                max_concurrent,
                weight,
            };
            let path = format!("/tenants/{}", segment(&name));
            let tenant: TenantRow = c.patch_as(&path, &patch).await?;
            show_one(c, &as_json(&tenant), TENANT_COLUMNS);
        }
        TenantCmd::Disable { name } => {
            let path = format!("/tenants/{}/disable", segment(&name));
            let tenant: TenantRow = c.post_as(&path, &json!({})).await?;
            show_one(c, &as_json(&tenant), TENANT_COLUMNS);
        }
        TenantCmd::Enable { name } => {
            let path = format!("/tenants/{}/enable", segment(&name));
            let tenant: TenantRow = c.post_as(&path, &json!({})).await?;
            show_one(c, &as_json(&tenant), TENANT_COLUMNS);
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
            let list: KeyList = c
                .get_as(&format!("/tenants/{}/keys", segment(&tenant)), &[])
                .await?;
            show_list(c, &as_json(&list), "keys", KEY_COLUMNS);
        }
        KeyCmd::Create {
            tenant,
            name,
            scopes,
            expires_in,
            expires_at,
        } => {
            let new = NewKey {
                name,
                scopes: (!scopes.is_empty()).then_some(scopes),
                expires_in_secs: expires_in.map(|d| parse_duration(&d)).transpose()?,
                expires_at: expires_at
                    .map(|at| {
                        chrono::DateTime::parse_from_rfc3339(&at)
                            .map(|t| t.with_timezone(&chrono::Utc))
                            .map_err(|e| fail(USAGE, format!("--expires-at: {at:?}: {e}")))
                    })
                    .transpose()?,
            };
            let created: CreatedKey = c
                .post_as(&format!("/tenants/{}/keys", segment(&tenant)), &new)
                .await?;
            let body = as_json(&created);
            if c.output == Output::Json {
                println!("{body}");
            } else {
                show_one(c, &body, KEY_COLUMNS);
                println!();
                println!("key: {}", created.key);
                eprintln!("Store this key now: it is not shown again.");
            }
        }
        KeyCmd::Revoke { prefix } => {
            let key: KeyRow = c
                .post_as(&format!("/keys/{}/revoke", segment(&prefix)), &json!({}))
                .await?;
            show_one(c, &as_json(&key), KEY_COLUMNS);
        }
    }
    Ok(())
}

pub(crate) async fn base_models(c: &Client, cmd: BaseCmd) -> Result<(), Failure> {
    let columns = &["name", "architecture", "base_hash", "created_at"];
    match cmd {
        BaseCmd::List => {
            let list: BaseModelList = c.get_as("/base-models", &[]).await?;
            show_list(c, &as_json(&list), "base_models", columns);
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
            let new = NewBaseModel {
                name,
                architecture,
                base_hash: hash,
            };
            let base: BaseModelRow = c.post_as("/base-models", &new).await?;
            show_one(c, &as_json(&base), columns);
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

/// Uploads `dir` to the object at `uri` with a progress bar; its digest.
async fn push(dir: &Path, uri: &str, endpoint: Option<String>) -> Result<String, Failure> {
    let bucket = uri
        .strip_prefix("s3://")
        .and_then(|rest| rest.split('/').next())
        .filter(|b| !b.is_empty())
        .ok_or_else(|| {
            fail(
                USAGE,
                format!("--to: {uri:?} must be s3://bucket/prefix/..."),
            )
        })?;
    let spec: lorafleet_store::StoreSpec = format!("push=s3://{bucket}")
        .parse()
        .map_err(|e: lorafleet_store::StoreError| fail(USAGE, format!("--to: {e}")))?;
    let stores = lorafleet_store::ObjectStores::new(
        &[spec],
        lorafleet_store::FetchOptions {
            endpoint,
            ..Default::default()
        },
    )
    .map_err(|e| fail(USAGE, e.to_string()))?;
    let bar = progress_bar("uploading artifact");
    let pushed = lorafleet_store::push_dir(&stores, dir, uri, &mut |p| {
        bar.set_length(p.total);
        bar.set_position(p.sent);
    })
    .await;
    bar.finish_and_clear();
    pushed.map_err(|e| fail(1, format!("--to {uri}: {e}")))
}

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
            let list: AdapterList = c.get_as("/adapters", &q).await?;
            show_list(c, &as_json(&list), "adapters", ADAPTER_COLUMNS);
        }
        AdapterCmd::Register {
            name,
            base_model,
            artifact_uri,
            version,
            tenant,
        } => {
            let new = NewAdapter {
                name,
                version,
                base_model,
                tenant,
                artifact_uri,
            };
            let adapter: AdapterRow = c.post_as("/adapters", &new).await?;
            show_one(
                c,
                &as_json(&adapter),
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
                    "features",
                    "artifact_uri",
                    "artifact_sha256",
                ],
            );
        }
        AdapterCmd::Push {
            dir,
            to,
            name,
            base_model,
            version,
            tenant,
            endpoint,
        } => {
            let digest = push(&dir, &to, endpoint).await?;
            let new = NewAdapter {
                name,
                version,
                base_model,
                tenant,
                artifact_uri: to,
            };
            let adapter: AdapterRow = c.post_as("/adapters", &new).await?;
            // The registry hashed what it fetched back: the bytes sent.
            if adapter.artifact_sha256 != digest {
                return Err(fail(
                    1,
                    format!(
                        "the registered digest {} is not the pushed directory's {digest}: the objects changed after the upload",
                        adapter.artifact_sha256
                    ),
                ));
            }
            show_one(c, &as_json(&adapter), ADAPTER_COLUMNS);
        }
        AdapterCmd::Retire { lora_int_id } => {
            let adapter: AdapterRow = c
                .post_as(&format!("/adapters/{lora_int_id}/retire"), &json!({}))
                .await?;
            show_one(c, &as_json(&adapter), ADAPTER_COLUMNS);
        }
        AdapterCmd::Digest { .. } => unreachable!("handled before connecting"),
    }
    Ok(())
}
