//! Tenants: create, list, show, disable and enable.

use super::*;

pub(super) const TENANT_COLUMNS: &str = "name, display_name, rpm_limit::INT8 AS rpm_limit, \
    tpm_limit, max_concurrent::INT8 AS max_concurrent, weight, created_at, disabled_at";

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

/// One tenant, by name.
#[derive(Debug)]
pub struct GetTenant {
    pub tenant: String,
}

impl Query for GetTenant {
    type Output = TenantRow;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<TenantRow, AdminError> {
        let row: Option<TenantRow> =
            sqlx::query_as(sql!("SELECT {TENANT_COLUMNS} FROM tenants WHERE name = $1"))
                .bind(&self.tenant)
                .fetch_optional(&s.pool)
                .await
                .map_err(db_error)?;
        row.ok_or_else(|| AdminError::not_found("tenant", format!("tenant {:?}", self.tenant)))
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

/// A tenant's limits, weight or display name changed; absent fields stay.
#[derive(Debug)]
pub struct UpdateTenant {
    pub tenant: String,
    pub patch: TenantPatch,
}

impl Command for UpdateTenant {
    type Output = TenantRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<TenantRow, AdminError> {
        let UpdateTenant {
            tenant: name,
            patch: p,
        } = self;
        if let Some(w) = p.weight
            && !(w.is_finite() && w > 0.0 && w <= 1000.0)
        {
            return Err(AdminError::field(
                "weight",
                format!("{w} is not in (0, 1000]"),
            ));
        }
        let rpm = p
            .rpm_limit
            .map(|l| column(l, "rpm_limit", i64::from(i32::MAX)))
            .transpose()?;
        let tpm = p
            .tpm_limit
            .map(|l| column(l, "tpm_limit", i64::MAX))
            .transpose()?;
        let concurrent = p
            .max_concurrent
            .map(|l| column(l, "max_concurrent", i64::from(i32::MAX)))
            .transpose()?;
        if p.display_name.is_none()
            && rpm.is_none()
            && tpm.is_none()
            && concurrent.is_none()
            && p.weight.is_none()
        {
            return Err(AdminError::field(
                "body",
                "names nothing to change: give display_name, rpm_limit, tpm_limit, max_concurrent or weight",
            ));
        }
        let tx = cx.db().await?;
        let before: Option<TenantRow> = sqlx::query_as(sql!(
            "SELECT {TENANT_COLUMNS} FROM tenants WHERE name = $1 FOR UPDATE"
        ))
        .bind(&name)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db_error)?;
        let before =
            before.ok_or_else(|| AdminError::not_found("tenant", format!("tenant {name:?}")))?;
        // A present field is written, even as NULL (the gateway's default).
        let after: TenantRow = sqlx::query_as(sql!(
            "UPDATE tenants SET
                 display_name = CASE WHEN $2 THEN $3 ELSE display_name END,
                 rpm_limit = CASE WHEN $4 THEN $5::INT4 ELSE rpm_limit END,
                 tpm_limit = CASE WHEN $6 THEN $7::INT8 ELSE tpm_limit END,
                 max_concurrent = CASE WHEN $8 THEN $9::INT4 ELSE max_concurrent END,
                 weight = coalesce($10, weight)
             WHERE name = $1
             RETURNING {TENANT_COLUMNS}"
        ))
        .bind(&name)
        .bind(p.display_name.is_some())
        .bind(p.display_name.clone().unwrap_or_default())
        .bind(rpm.is_some())
        .bind(rpm.flatten())
        .bind(tpm.is_some())
        .bind(tpm.flatten())
        .bind(concurrent.is_some())
        .bind(concurrent.flatten())
        .bind(p.weight)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
        // Values equal to the current ones change nothing and record nothing.
        if to_json(&before) == to_json(&after) {
            return Ok(after);
        }
        cx.record(
            "tenant.update",
            ("tenant", &name),
            Some(to_json(&before)),
            Some(to_json(&after)),
        );
        Ok(after)
    }
}

/// A limit as its column stores it, refused by field when too large.
fn column(l: Limit, param: &str, max: i64) -> Result<Option<i64>, AdminError> {
    match l.to_column() {
        Some(v) if v > max => Err(AdminError::field(
            param,
            format!("{v} is too large (at most {max})"),
        )),
        v => Ok(v),
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
