//! API keys: create (the secret shown once), list and revoke.

use super::*;

pub(super) const KEY_SELECT: &str =
    "SELECT k.prefix, t.name AS tenant, k.name, k.scopes, k.created_at, k.expires_at, k.revoked_at
     FROM api_keys k JOIN tenants t ON t.id = k.tenant_id";

/// A tenant's API keys, without their secrets.
#[derive(Debug)]
pub struct ListKeys {
    pub tenant: String,
}

impl Query for ListKeys {
    type Output = KeyList;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<KeyList, AdminError> {
        let id = tenant_id(&s.pool, &self.tenant, "tenant").await?;
        let keys: Vec<KeyRow> = sqlx::query_as(sql!(
            "{KEY_SELECT} WHERE k.tenant_id = $1 ORDER BY k.created_at, k.prefix"
        ))
        .bind(id)
        .fetch_all(&s.pool)
        .await
        .map_err(db_error)?;
        Ok(KeyList { keys })
    }
}

/// A new API key for a tenant; its secret is in the answer, and nowhere
/// else ever again.
#[derive(Debug)]
pub struct CreateKey {
    pub tenant: String,
    pub spec: NewKey,
}

impl Command for CreateKey {
    type Output = CreatedKey;

    async fn run(self, cx: &mut Cx<'_>) -> Result<CreatedKey, AdminError> {
        let (tenant, k) = (self.tenant, self.spec);
        let scopes = k.scopes.unwrap_or_else(|| {
            vec![
                auth::SCOPE_INFERENCE.to_owned(),
                auth::SCOPE_MODELS_READ.to_owned(),
            ]
        });
        if scopes.is_empty() {
            return Err(AdminError::field("scopes", "must name at least one scope"));
        }
        for (i, scope) in scopes.iter().enumerate() {
            if scope != auth::SCOPE_INFERENCE && scope != auth::SCOPE_MODELS_READ {
                return Err(AdminError::field(
                    &format!("scopes[{i}]"),
                    format!("{scope:?} is not a scope; expected inference or models:read"),
                ));
            }
        }
        let expires_at = match (k.expires_at, k.expires_in_secs) {
            (Some(_), Some(_)) => {
                return Err(AdminError::field(
                    "expires_in_secs",
                    "give expires_at or expires_in_secs, not both",
                ));
            }
            (Some(at), None) => Some(at),
            (None, Some(secs)) => {
                let secs = i64::try_from(secs)
                    .ok()
                    .filter(|s| *s > 0 && *s <= 100 * 365 * 86_400)
                    .ok_or_else(|| {
                        AdminError::field("expires_in_secs", "must be between 1 and 100 years")
                    })?;
                Some(Utc::now() + chrono::Duration::seconds(secs))
            }
            (None, None) => None,
        };
        if let Some(at) = expires_at
            && at <= Utc::now()
        {
            return Err(AdminError::field(
                "expires_at",
                format!("{} is not in the future", at.to_rfc3339()),
            ));
        }
        let tx = cx.db().await?;
        let id = tenant_id(&mut *tx, &tenant, "tenant").await?;
        let (prefix, full_key, hash) = auth::new_api_key();
        sqlx::query(
            "INSERT INTO api_keys (tenant_id, prefix, secret_hash, name, scopes, expires_at)
         VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(id)
        .bind(&prefix)
        .bind(&hash[..])
        .bind(&k.name)
        .bind(&scopes)
        .bind(expires_at)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        let row: KeyRow = sqlx::query_as(sql!("{KEY_SELECT} WHERE k.prefix = $1"))
            .bind(&prefix)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        cx.record(
            "api_key.create",
            ("api_key", &prefix),
            None,
            Some(to_json(&row)),
        );
        // The only time the secret leaves the gateway.
        Ok(CreatedKey { row, key: full_key })
    }
}

/// An API key revoked, by its prefix.
#[derive(Debug)]
pub struct RevokeKey {
    pub prefix: String,
}

impl Command for RevokeKey {
    type Output = KeyRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<KeyRow, AdminError> {
        let prefix = self.prefix;
        let tx = cx.db().await?;
        let before: Option<KeyRow> =
            sqlx::query_as(sql!("{KEY_SELECT} WHERE k.prefix = $1 FOR UPDATE OF k"))
                .bind(&prefix)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db_error)?;
        let before =
            before.ok_or_else(|| AdminError::not_found("prefix", format!("API key {prefix:?}")))?;
        if before.revoked_at.is_some() {
            return Err(AdminError::conflict(
                AdminCode::NoChange,
                "prefix",
                format!("API key {prefix:?} is already revoked"),
            ));
        }
        sqlx::query("UPDATE api_keys SET revoked_at = now() WHERE prefix = $1")
            .bind(&prefix)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        let after: KeyRow = sqlx::query_as(sql!("{KEY_SELECT} WHERE k.prefix = $1"))
            .bind(&prefix)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        cx.record(
            "api_key.revoke",
            ("api_key", &prefix),
            Some(to_json(&before)),
            Some(to_json(&after)),
        );
        Ok(after)
    }
}
