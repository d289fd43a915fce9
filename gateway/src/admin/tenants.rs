//! Tenants: create, list, show, disable and enable.

use super::*;

pub(super) const TENANT_COLUMNS: &str =
    "name, display_name, rpm_limit, tpm_limit, weight, created_at, disabled_at";

pub(super) fn to_json<T: Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

/// Every tenant.
#[derive(Debug)]
pub struct ListTenants;

impl Query for ListTenants {
    type Output = TenantList;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<TenantList, AdminError> {
        let tenants: Vec<TenantRow> =
            sqlx::query_as(sql!("SELECT {TENANT_COLUMNS} FROM tenants ORDER BY name"))
                .fetch_all(&s.pool)
                .await
                .map_err(db_error)?;
        Ok(TenantList { tenants })
    }
}

pub(super) fn check_tenant_name(name: &str, param: &str) -> Result<(), AdminError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(AdminError::field(
            param,
            format!("{name:?} must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'"),
        ))
    }
}

/// A new tenant.
#[derive(Debug)]
pub struct CreateTenant(pub NewTenant);

impl Command for CreateTenant {
    type Output = TenantRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<TenantRow, AdminError> {
        let t = self.0;
        check_tenant_name(&t.name, "name")?;
        if t.rpm_limit == Some(0) {
            return Err(AdminError::field("rpm_limit", "must be at least 1"));
        }
        if t.tpm_limit == Some(0) {
            return Err(AdminError::field("tpm_limit", "must be at least 1"));
        }
        let weight = t.weight.unwrap_or(1.0);
        if !(weight.is_finite() && weight > 0.0 && weight <= 1000.0) {
            return Err(AdminError::field(
                "weight",
                format!("{weight} is not in (0, 1000]"),
            ));
        }
        let rpm = t
            .rpm_limit
            .map(|v| i32::try_from(v).map_err(|_| AdminError::field("rpm_limit", "is too large")))
            .transpose()?;
        let tpm = t
            .tpm_limit
            .map(|v| i64::try_from(v).map_err(|_| AdminError::field("tpm_limit", "is too large")))
            .transpose()?;
        let row: TenantRow = sqlx::query_as(sql!(
            "INSERT INTO tenants (name, display_name, rpm_limit, tpm_limit, weight)
         VALUES ($1, $2, $3, $4, $5)
         RETURNING {TENANT_COLUMNS}"
        ))
        .bind(&t.name)
        .bind(&t.display_name)
        .bind(rpm)
        .bind(tpm)
        .bind(weight)
        .fetch_one(cx.db().await?)
        .await
        .map_err(|e| match db_error(e) {
            e if e.code == AdminCode::Duplicate => AdminError::conflict(
                AdminCode::Duplicate,
                "name",
                format!("tenant {:?} already exists", t.name),
            ),
            e => e,
        })?;
        cx.record(
            "tenant.create",
            ("tenant", &row.name),
            None,
            Some(to_json(&row)),
        );
        Ok(row)
    }
}

/// A tenant disabled (every key refused) or enabled again.
#[derive(Debug)]
pub struct SetTenantDisabled {
    pub tenant: String,
    pub disabled: bool,
}

impl Command for SetTenantDisabled {
    type Output = TenantRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<TenantRow, AdminError> {
        let (name, disable) = (self.tenant, self.disabled);
        let before: Option<TenantRow> = sqlx::query_as(sql!(
            "SELECT {TENANT_COLUMNS} FROM tenants WHERE name = $1 FOR UPDATE"
        ))
        .bind(&name)
        .fetch_optional(cx.db().await?)
        .await
        .map_err(db_error)?;
        let before =
            before.ok_or_else(|| AdminError::not_found("tenant", format!("tenant {name:?}")))?;
        if before.disabled_at.is_some() == disable {
            let state = if disable { "disabled" } else { "enabled" };
            return Err(AdminError::conflict(
                AdminCode::NoChange,
                "tenant",
                format!("tenant {name:?} is already {state}"),
            ));
        }
        let after: TenantRow = sqlx::query_as(sql!(
            "UPDATE tenants SET disabled_at = CASE WHEN $2 THEN now() ELSE NULL END WHERE name = $1
         RETURNING {TENANT_COLUMNS}"
        ))
        .bind(&name)
        .bind(disable)
        .fetch_one(cx.db().await?)
        .await
        .map_err(db_error)?;
        let action = if disable {
            "tenant.disable"
        } else {
            "tenant.enable"
        };
        cx.record(
            action,
            ("tenant", &name),
            Some(to_json(&before)),
            Some(to_json(&after)),
        );
        Ok(after)
    }
}

pub(super) async fn base_model_id(
    ex: impl sqlx::PgExecutor<'_>,
    name: &str,
) -> Result<i64, AdminError> {
    sqlx::query_scalar("SELECT id FROM base_models WHERE name = $1")
        .bind(name)
        .fetch_optional(ex)
        .await
        .map_err(db_error)?
        .ok_or_else(|| AdminError::not_found("base_model", format!("base model {name:?}")))
}

pub(super) async fn tenant_id(
    ex: impl sqlx::PgExecutor<'_>,
    name: &str,
    param: &str,
) -> Result<Uuid, AdminError> {
    sqlx::query_scalar("SELECT id FROM tenants WHERE name = $1")
        .bind(name)
        .fetch_optional(ex)
        .await
        .map_err(db_error)?
        .ok_or_else(|| AdminError::not_found(param, format!("tenant {name:?}")))
}
