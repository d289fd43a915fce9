//! Prices for chargeback (migration 0027): a base model's per hour of its
//! workers' device time, a route's per million prompt and completion
//! tokens, each from a whole UTC hour on until the next. A change is a new
//! row; the usage report ([`crate::usage`]) prices each hour of usage at
//! the price in effect then.

use super::*;

/// A price set from its effective time on.
#[derive(Debug)]
pub struct SetPrice(pub NewPrice);

/// Every price, oldest first, by base model or by route.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListPrices {
    pub base_model: Option<String>,
    pub tenant: Option<String>,
}

/// The columns a price row `p` is read with, and the joins that name its
/// route.
const COLUMNS: &str = "p.id, p.base_model, t.name AS tenant, r.model_name AS route, p.effective_at,
    p.device_hour::FLOAT8 AS device_hour, p.prompt_per_million::FLOAT8 AS prompt_per_million,
    p.completion_per_million::FLOAT8 AS completion_per_million, p.created_at, p.created_by";
const JOINS: &str =
    "LEFT JOIN routes r ON r.id = p.route_id LEFT JOIN tenants t ON t.id = r.tenant_id";

impl Command for SetPrice {
    type Output = PriceRow;

    async fn run(self, cx: &mut Cx<'_>) -> Result<PriceRow, AdminError> {
        let p = self.0;
        check(&p)?;
        let by = cx.caller.subject.clone();
        // The subject: a registered base model, or a tenant's route.
        let (base_model, route_id, object) = match (&p.base_model, &p.tenant, &p.route) {
            (Some(name), None, None) => {
                let known: Option<String> =
                    sqlx::query_scalar("SELECT name FROM base_models WHERE name = $1")
                        .bind(name)
                        .fetch_optional(cx.db().await?)
                        .await
                        .map_err(db_error)?;
                if known.is_none() {
                    return Err(AdminError::not_found(
                        "base_model",
                        format!("base_model: {name:?} is not registered"),
                    ));
                }
                (Some(name.clone()), None, format!("base_model:{name}"))
            }
            (None, Some(tenant), Some(route)) => {
                let id: Option<Uuid> = sqlx::query_scalar(
                    "SELECT r.id FROM routes r JOIN tenants t ON t.id = r.tenant_id
                      WHERE t.name = $1 AND r.model_name = $2",
                )
                .bind(tenant)
                .bind(route)
                .fetch_optional(cx.db().await?)
                .await
                .map_err(db_error)?;
                let id = id.ok_or_else(|| {
                    AdminError::not_found(
                        "route",
                        format!("route: tenant {tenant:?} has no route {route:?}"),
                    )
                })?;
                (None, Some(id), format!("route:{tenant}/{route}"))
            }
            _ => {
                return Err(AdminError::field(
                    "base_model",
                    "give either base_model (a device-hour price) or tenant and route (token prices)",
                ));
            }
        };
        let sql = sql!(
            "WITH p AS (
                INSERT INTO prices (base_model, route_id, effective_at, device_hour,
                                    prompt_per_million, completion_per_million, created_by)
                VALUES ($1, $2, $3, $4::FLOAT8::NUMERIC, $5::FLOAT8::NUMERIC,
                        $6::FLOAT8::NUMERIC, $7)
                ON CONFLICT ON CONSTRAINT prices_one_per_time DO NOTHING
                RETURNING *)
             SELECT {COLUMNS} FROM p {JOINS}"
        );
        let row: Option<PriceRow> = sqlx::query_as(sql)
            .bind(&base_model)
            .bind(route_id)
            .bind(p.effective_at)
            .bind(p.device_hour)
            .bind(p.prompt_per_million)
            .bind(p.completion_per_million)
            .bind(&by)
            .fetch_optional(cx.db().await?)
            .await
            .map_err(db_error)?;
        let row = row.ok_or_else(|| {
            AdminError::conflict(
                AdminCode::Duplicate,
                "effective_at",
                format!(
                    "effective_at: {object} already has a price from {}; prices are history, set one from another hour",
                    p.effective_at
                ),
            )
        })?;
        let id = format!("{object}@{}", p.effective_at.to_rfc3339());
        cx.record("price.set", ("price", &id), None, Some(to_json(&row)));
        Ok(row)
    }
}

/// A price's own fields: its time a whole UTC hour, and each amount the
/// subject takes, finite and not negative.
fn check(p: &NewPrice) -> Result<(), AdminError> {
    use chrono::Timelike;
    let t = p.effective_at;
    if t.minute() != 0 || t.second() != 0 || t.nanosecond() != 0 {
        return Err(AdminError::field(
            "effective_at",
            format!("{t} is not a whole hour (usage is priced by the UTC hour)"),
        ));
    }
    let amounts = [
        ("device_hour", p.device_hour),
        ("prompt_per_million", p.prompt_per_million),
        ("completion_per_million", p.completion_per_million),
    ];
    for (field, v) in amounts {
        if let Some(v) = v
            && !(v.is_finite() && v >= 0.0)
        {
            return Err(AdminError::field(
                field,
                format!("{v} must be a finite amount, 0 or more"),
            ));
        }
    }
    if p.base_model.is_some() {
        if p.device_hour.is_none() {
            return Err(AdminError::field(
                "device_hour",
                "is required for a base model's price",
            ));
        }
        for (field, v) in &amounts[1..] {
            if v.is_some() {
                return Err(AdminError::field(
                    field,
                    "prices a route's tokens; a base model's price is per device-hour",
                ));
            }
        }
    } else {
        if p.device_hour.is_some() {
            return Err(AdminError::field(
                "device_hour",
                "prices a base model's device time; a route's price is per million tokens",
            ));
        }
        if p.prompt_per_million.is_none() && p.completion_per_million.is_none() {
            return Err(AdminError::field(
                "prompt_per_million",
                "a route's price needs prompt_per_million, completion_per_million or both",
            ));
        }
    }
    if p.tenant.is_some() != p.route.is_some() {
        let missing = if p.tenant.is_none() {
            "tenant"
        } else {
            "route"
        };
        return Err(AdminError::field(
            missing,
            "a route's price names its tenant and route",
        ));
    }
    Ok(())
}

impl Query for ListPrices {
    type Output = PriceList;
    const NEED: Need = Need::Audit;

    async fn run(self, s: &AdminState) -> Result<PriceList, AdminError> {
        let prices: Vec<PriceRow> = sqlx::query_as(sql!(
            "SELECT {COLUMNS} FROM prices p {JOINS}
              WHERE ($1::TEXT IS NULL OR p.base_model = $1) AND ($2::TEXT IS NULL OR t.name = $2)
              ORDER BY p.base_model NULLS LAST, t.name, r.model_name, p.effective_at"
        ))
        .bind(self.base_model)
        .bind(self.tenant)
        .fetch_all(&s.pool)
        .await
        .map_err(db_error)?;
        Ok(PriceList { prices })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn price() -> NewPrice {
        NewPrice {
            base_model: Some("m".into()),
            tenant: None,
            route: None,
            effective_at: DateTime::from_timestamp(1_800_000_000 / 3600 * 3600, 0).unwrap(),
            device_hour: Some(2.5),
            prompt_per_million: None,
            completion_per_million: None,
        }
    }

    #[test]
    fn a_price_is_refused_by_the_field_at_fault() {
        assert!(check(&price()).is_ok());
        let route = NewPrice {
            base_model: None,
            tenant: Some("acme".into()),
            route: Some("support".into()),
            device_hour: None,
            prompt_per_million: Some(0.5),
            ..price()
        };
        assert!(check(&route).is_ok());
        let cases: Vec<(NewPrice, &str)> = vec![
            (
                NewPrice {
                    effective_at: price().effective_at + chrono::Duration::minutes(30),
                    ..price()
                },
                "effective_at",
            ),
            (
                NewPrice {
                    device_hour: Some(-1.0),
                    ..price()
                },
                "device_hour",
            ),
            (
                NewPrice {
                    device_hour: Some(f64::NAN),
                    ..price()
                },
                "device_hour",
            ),
            (
                NewPrice {
                    device_hour: None,
                    ..price()
                },
                "device_hour",
            ),
            (
                NewPrice {
                    completion_per_million: Some(1.0),
                    ..price()
                },
                "completion_per_million",
            ),
            (
                NewPrice {
                    device_hour: Some(1.0),
                    ..route.clone()
                },
                "device_hour",
            ),
            (
                NewPrice {
                    prompt_per_million: None,
                    ..route.clone()
                },
                "prompt_per_million",
            ),
            (
                NewPrice {
                    route: None,
                    ..route.clone()
                },
                "route",
            ),
        ];
        for (p, field) in cases {
            let e = check(&p).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{p:?}: {e:?}");
        }
    }
}
