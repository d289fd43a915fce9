//! Usage reports, read from the hourly rollups (`usage_hourly`, kept by a
//! trigger as audit rows land) and never from the log, so a month's report
//! reads a few hundred rows per tenant however large the log is. The admin
//! plane (`GET /admin/v1/usage`, every tenant) and the OpenAI API
//! (`GET /v1/usage`, the caller's own tenant) both ask through
//! [`UsageQuery`]; each maps a [`UsageError`] to its own refusal. Each
//! hour of usage is priced at the prices in effect at that hour (migration
//! 0027): its base model's per device-hour, its route's per million prompt
//! and completion tokens.

use chrono::{DateTime, Utc};
use lorafleet_admin_types::UsageRow;
use sqlx::PgPool;
use uuid::Uuid;

/// Tenants' reports one gateway runs at once, on the serving pool.
pub const REPORTS_AT_ONCE: usize = 2;

/// The longest span a report may cover.
pub const MAX_SPAN_DAYS: i64 = 366;

/// A refused report, by the query parameter at fault; or the database's
/// failure.
#[derive(Debug)]
pub enum UsageError {
    Field { field: &'static str, reason: String },
    Db(sqlx::Error),
}

impl UsageError {
    fn field(field: &'static str, reason: impl Into<String>) -> UsageError {
        UsageError::Field {
            field,
            reason: reason.into(),
        }
    }
}

/// What a report groups by, parsed from `group_by`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Grouping {
    pub tenant: bool,
    pub route: bool,
    pub adapter: bool,
    /// `date_trunc`'s unit: "day" or "hour".
    pub period: Option<&'static str>,
}

impl Grouping {
    /// `group_by`: comma-separated names among `allowed` (each of tenant,
    /// route, adapter, day and hour), at most one period.
    pub fn parse(text: Option<&str>, allowed: &[&str]) -> Result<Grouping, UsageError> {
        let mut g = Grouping::default();
        for part in text.unwrap_or("").split(',').map(str::trim) {
            if part.is_empty() {
                continue;
            }
            if !allowed.contains(&part) {
                return Err(UsageError::field(
                    "group_by",
                    format!("{part:?} is not one of {}", allowed.join(", ")),
                ));
            }
            match part {
                "tenant" => g.tenant = true,
                "route" => g.route = true,
                "adapter" => g.adapter = true,
                _ => {
                    if g.period.is_some() {
                        return Err(UsageError::field(
                            "group_by",
                            "names two periods; choose day or hour",
                        ));
                    }
                    g.period = Some(if part == "day" { "day" } else { "hour" });
                }
            }
        }
        Ok(g)
    }
}

/// One report: usage over `[from, to)`, grouped, for one tenant or all.
#[derive(Debug, Clone, PartialEq)]
pub struct UsageQuery {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    pub grouping: Grouping,
    pub tenant: Option<Uuid>,
}

impl UsageQuery {
    /// Checks the span: `to` after `from`, and at most [`MAX_SPAN_DAYS`]
    /// after it.
    pub fn new(
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        grouping: Grouping,
        tenant: Option<Uuid>,
    ) -> Result<UsageQuery, UsageError> {
        if to <= from {
            return Err(UsageError::field("to", "must be after from"));
        }
        if to - from > chrono::TimeDelta::days(MAX_SPAN_DAYS) {
            return Err(UsageError::field(
                "to",
                format!("the span from `from` is over {MAX_SPAN_DAYS} days"),
            ));
        }
        Ok(UsageQuery {
            from,
            to,
            grouping,
            tenant,
        })
    }

    /// The report's rows, evaluation traffic always a group of its own.
    pub async fn rows(&self, pool: &PgPool) -> Result<Vec<UsageRow>, UsageError> {
        let g = self.grouping;
        // A column the report does not group by reads as a typed NULL.
        let column = |on: bool, name: &str, ty: &str| {
            if on {
                name.to_owned()
            } else {
                format!("NULL::{ty}")
            }
        };
        let period = match g.period {
            Some(unit) => format!("date_trunc('{unit}', hour, 'UTC')"),
            None => "NULL::TIMESTAMPTZ".to_owned(),
        };
        // Each price holds from its hour until the subject's next one: as
        // ranges, the rollups meet them in one hash join each (a lookup per
        // rollup row cost half the report).
        let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new(format!(
            "WITH base_prices AS (
                 SELECT b.base_hash, p.effective_at AS since,
                        coalesce(lead(p.effective_at) OVER (PARTITION BY p.base_model
                                                            ORDER BY p.effective_at),
                                 'infinity') AS until,
                        p.device_hour
                   FROM prices p JOIN base_models b ON b.name = p.base_model),
             route_prices AS (
                 SELECT p.route_id, p.effective_at AS since,
                        coalesce(lead(p.effective_at) OVER (PARTITION BY p.route_id
                                                            ORDER BY p.effective_at),
                                 'infinity') AS until,
                        coalesce(p.prompt_per_million, 0) AS prompt,
                        coalesce(p.completion_per_million, 0) AS completion
                   FROM prices p WHERE p.route_id IS NOT NULL)
             SELECT {period} AS period, {} AS tenant_id, {} AS route_id, {} AS lora_int_id,
                    u.evaluation, {} AS tenant, {} AS adapter,
                    sum(requests)::BIGINT AS requests,
                    coalesce(sum(requests) FILTER (WHERE status = 'ok'), 0)::BIGINT AS completed,
                    sum(prompt_tokens)::BIGINT AS prompt_tokens,
                    sum(completion_tokens)::BIGINT AS completion_tokens,
                    sum(cached_tokens)::BIGINT AS cached_tokens,
                    sum(device_us)::FLOAT8 / 1e6 AS device_seconds,
                    sum(load_us)::FLOAT8 / 1e6 AS load_seconds,
                    (sum(device_us * dp.device_hour) / 3600e6)::FLOAT8 AS device_cost,
                    (sum(prompt_tokens * rp.prompt + completion_tokens * rp.completion)
                        / 1e6)::FLOAT8 AS token_cost,
                    CASE WHEN count(dp.device_hour) + count(rp.prompt) > 0 THEN
                        (coalesce(sum(device_us * dp.device_hour) / 3600e6, 0)
                         + coalesce(sum(prompt_tokens * rp.prompt
                                        + completion_tokens * rp.completion) / 1e6, 0))::FLOAT8
                    END AS cost
               FROM usage_hourly u
               LEFT JOIN base_prices dp ON dp.base_hash = u.base_hash
                    AND u.hour >= dp.since AND u.hour < dp.until
               LEFT JOIN route_prices rp ON rp.route_id = u.route_id
                    AND u.hour >= rp.since AND u.hour < rp.until
               LEFT JOIN tenants tn ON tn.id = u.tenant_id
               LEFT JOIN adapters ad ON ad.lora_int_id = u.lora_int_id
              WHERE hour >= ",
            column(g.tenant, "u.tenant_id", "UUID"),
            column(g.route, "u.route_id", "UUID"),
            column(g.adapter, "u.lora_int_id", "BIGINT"),
            // Names beside the ids, for people (each id has one).
            column(g.tenant, "min(tn.name)", "TEXT"),
            column(g.adapter, "min(ad.name || ':v' || ad.version)", "TEXT"),
        ));
        q.push_bind(self.from)
            .push(" AND hour < ")
            .push_bind(self.to);
        if let Some(t) = self.tenant {
            q.push(" AND u.tenant_id = ").push_bind(t);
        }
        q.push(" GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2, 3, 4, 5");
        // A report is one short scan: compiling it (JIT, which a month's
        // estimated rows turn on) costs more than it saves.
        let mut tx = pool.begin().await.map_err(UsageError::Db)?;
        sqlx::query("SET LOCAL jit = off")
            .execute(&mut *tx)
            .await
            .map_err(UsageError::Db)?;
        let rows = q
            .build_query_as()
            .fetch_all(&mut *tx)
            .await
            .map_err(UsageError::Db)?;
        tx.commit().await.map_err(UsageError::Db)?;
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [&str; 5] = ["tenant", "route", "adapter", "day", "hour"];

    #[test]
    fn a_span_backwards_or_over_a_year_is_refused_by_field() {
        let from = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let day = chrono::TimeDelta::days(1);
        let query = |to| UsageQuery::new(from, to, Grouping::default(), None);
        assert!(query(from + day).is_ok());
        assert!(query(from + day * 366).is_ok());
        for to in [from, from - day, from + day * 367] {
            let e = query(to).unwrap_err();
            assert!(
                matches!(e, UsageError::Field { field: "to", .. }),
                "{to}: {e:?}"
            );
        }
    }

    #[test]
    fn group_by_is_read_by_name_and_refused_by_field() {
        let g = Grouping::parse(Some("tenant, adapter,day"), &ALL).unwrap();
        assert_eq!(
            g,
            Grouping {
                tenant: true,
                route: false,
                adapter: true,
                period: Some("day")
            }
        );
        assert_eq!(Grouping::parse(None, &ALL).unwrap(), Grouping::default());
        for bad in ["tenant,model", "day,hour"] {
            let e = Grouping::parse(Some(bad), &ALL).unwrap_err();
            assert!(
                matches!(
                    e,
                    UsageError::Field {
                        field: "group_by",
                        ..
                    }
                ),
                "{bad}: {e:?}"
            );
        }
        // A tenant's own report has no tenant to group by.
        let e = Grouping::parse(Some("tenant"), &["route", "adapter", "day", "hour"]);
        assert!(matches!(
            e,
            Err(UsageError::Field {
                field: "group_by",
                ..
            })
        ));
    }
}
