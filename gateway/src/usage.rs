//! Usage reports, read from the rollups (`usage_hourly` and `usage_daily`,
//! kept by a trigger as audit rows land) and never from the log, so a
//! report's cost follows the tenant's adapters and the span's days, not
//! the log's size: whole days without a price change are read a row per
//! day, the rest an hour at a time. The admin plane (`GET /admin/v1/usage`,
//! every tenant) and the OpenAI API (`GET /v1/usage`, the caller's own
//! tenant) both ask through [`UsageQuery`]; each maps a [`UsageError`] to
//! its own refusal. Each hour of usage is priced at the prices in effect at
//! that hour (migration 0027): its base model's per device-hour, its
//! route's per million prompt and completion tokens.

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
    /// Read in one repeatable-read transaction: the days [`stretches`]
    /// reads from the daily rollup are chosen from the prices the report
    /// prices them with.
    pub async fn rows(&self, pool: &PgPool) -> Result<Vec<UsageRow>, UsageError> {
        let g = self.grouping;
        let mut tx = pool.begin().await.map_err(UsageError::Db)?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await
            .map_err(UsageError::Db)?;
        // A report is one short scan: compiling it (JIT, which a month's
        // estimated rows turn on) costs more than it saves.
        sqlx::query("SET LOCAL jit = off")
            .execute(&mut *tx)
            .await
            .map_err(UsageError::Db)?;
        let stretches = self.stretches(&mut tx).await?;
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
               FROM (",
            column(g.tenant, "u.tenant_id", "UUID"),
            column(g.route, "u.route_id", "UUID"),
            column(g.adapter, "u.lora_int_id", "BIGINT"),
            // Names beside the ids, for people (each id has one).
            column(g.tenant, "min(tn.name)", "TEXT"),
            column(g.adapter, "min(ad.name || ':v' || ad.version)", "TEXT"),
        ));
        push_rollups(&mut q, &stretches, self.tenant);
        q.push(
            ") u
               LEFT JOIN base_prices dp ON dp.base_hash = u.base_hash
                    AND u.hour >= dp.since AND u.hour < dp.until
               LEFT JOIN route_prices rp ON rp.route_id = u.route_id
                    AND u.hour >= rp.since AND u.hour < rp.until
               LEFT JOIN tenants tn ON tn.id = u.tenant_id
               LEFT JOIN adapters ad ON ad.lora_int_id = u.lora_int_id
              GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2, 3, 4, 5",
        );
        let rows = q
            .build_query_as()
            .fetch_all(&mut *tx)
            .await
            .map_err(UsageError::Db)?;
        tx.commit().await.map_err(UsageError::Db)?;
        Ok(rows)
    }

    /// The report's span cut into [`stretches`], with the days whose
    /// prices change inside them read from the prices.
    async fn stretches(
        &self,
        tx: &mut sqlx::PgConnection,
    ) -> Result<Vec<(Rollup, DateTime<Utc>, DateTime<Utc>)>, UsageError> {
        let by_hour = self.grouping.period == Some("hour");
        let (first, last) = whole_days(self.from, self.to);
        let changed: Vec<DateTime<Utc>> = if by_hour || first >= last {
            Vec::new()
        } else {
            sqlx::query_scalar(
                "SELECT DISTINCT date_trunc('day', effective_at, 'UTC') FROM prices
                  WHERE effective_at > $1 AND effective_at < $2
                    AND effective_at <> date_trunc('day', effective_at, 'UTC')",
            )
            .bind(first)
            .bind(last)
            .fetch_all(tx)
            .await
            .map_err(UsageError::Db)?
        };
        Ok(stretches(self.from, self.to, by_hour, &changed))
    }
}

/// The rows of each stretch from its rollup, as one `UNION ALL` with the
/// hourly rollup's column names (`hour` for a day's start too).
fn push_rollups(
    q: &mut sqlx::QueryBuilder<sqlx::Postgres>,
    stretches: &[(Rollup, DateTime<Utc>, DateTime<Utc>)],
    tenant: Option<Uuid>,
) {
    for (i, &(rollup, lo, hi)) in stretches.iter().enumerate() {
        let (table, time) = match rollup {
            Rollup::Hourly => ("usage_hourly", "hour"),
            Rollup::Daily => ("usage_daily", "day"),
        };
        if i > 0 {
            q.push(" UNION ALL ");
        }
        q.push(format!(
            "SELECT {time} AS hour, tenant_id, route_id, lora_int_id, base_hash, evaluation,
                    status, requests, prompt_tokens, completion_tokens, cached_tokens,
                    device_us, load_us
               FROM {table} WHERE {time} >= "
        ))
        .push_bind(lo)
        .push(format!(" AND {time} < "))
        .push_bind(hi);
        if let Some(t) = tenant {
            q.push(" AND tenant_id = ").push_bind(t);
        }
    }
}

/// Which rollup a stretch of a report's span is read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rollup {
    Hourly,
    Daily,
}

/// The whole UTC days inside `[from, to)`, as `[first, last)`; empty
/// (`first >= last`) when there is none.
fn whole_days(from: DateTime<Utc>, to: DateTime<Utc>) -> (DateTime<Utc>, DateTime<Utc>) {
    let day = chrono::TimeDelta::days(1);
    let floor = |t: DateTime<Utc>| {
        DateTime::from_timestamp(t.timestamp().div_euclid(86_400) * 86_400, 0).unwrap_or(t)
    };
    let first = if floor(from) == from {
        from
    } else {
        floor(from) + day
    };
    (first, floor(to))
}

/// `[from, to)` cut into stretches, each read from one rollup, together
/// every hour of the span once: whole UTC days with no price starting
/// inside them (`changed` holds those that have one) from the daily rollup,
/// the rest (a partial first or last day, a day with a change, every hour
/// of a report by hour) from the hourly one. Neighbours from one rollup
/// are merged.
fn stretches(
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    by_hour: bool,
    changed: &[DateTime<Utc>],
) -> Vec<(Rollup, DateTime<Utc>, DateTime<Utc>)> {
    let (first, last) = whole_days(from, to);
    if by_hour || first >= last {
        return vec![(Rollup::Hourly, from, to)];
    }
    let mut out: Vec<(Rollup, DateTime<Utc>, DateTime<Utc>)> = Vec::new();
    let mut push = |rollup: Rollup, lo: DateTime<Utc>, hi: DateTime<Utc>| {
        if lo >= hi {
            return;
        }
        match out.last_mut() {
            Some((r, _, end)) if *r == rollup && *end == lo => *end = hi,
            _ => out.push((rollup, lo, hi)),
        }
    };
    push(Rollup::Hourly, from, first);
    let day = chrono::TimeDelta::days(1);
    let mut d = first;
    while d < last {
        let rollup = if changed.contains(&d) {
            Rollup::Hourly
        } else {
            Rollup::Daily
        };
        push(rollup, d, d + day);
        d += day;
    }
    push(Rollup::Hourly, last, to);
    out
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
    fn a_span_reads_its_whole_unchanged_days_daily_and_every_other_hour_hourly() {
        let t = |d: i64, h: i64| {
            DateTime::from_timestamp(1_800_000_000 / 86_400 * 86_400 + d * 86_400 + h * 3600, 0)
                .unwrap()
        };
        use Rollup::{Daily, Hourly};
        // Partial first and last days hourly; day 2 has a price change.
        assert_eq!(
            stretches(t(0, 7), t(5, 5), false, &[t(2, 0)]),
            vec![
                (Hourly, t(0, 7), t(1, 0)),
                (Daily, t(1, 0), t(2, 0)),
                (Hourly, t(2, 0), t(3, 0)),
                (Daily, t(3, 0), t(5, 0)),
                (Hourly, t(5, 0), t(5, 5)),
            ]
        );
        // Whole days at both ends: no hourly stretch; neighbours merged.
        assert_eq!(
            stretches(t(0, 0), t(3, 0), false, &[]),
            vec![(Daily, t(0, 0), t(3, 0))]
        );
        assert_eq!(
            stretches(t(0, 0), t(3, 0), false, &[t(0, 0), t(1, 0)]),
            vec![(Hourly, t(0, 0), t(2, 0)), (Daily, t(2, 0), t(3, 0))]
        );
        // No whole day inside, or a report by hour: the hourly rollup alone.
        assert_eq!(
            stretches(t(0, 7), t(1, 5), false, &[]),
            vec![(Hourly, t(0, 7), t(1, 5))]
        );
        assert_eq!(
            stretches(t(0, 0), t(3, 0), true, &[]),
            vec![(Hourly, t(0, 0), t(3, 0))]
        );
        // A time inside a second is not a day's start.
        let late = t(0, 0) + chrono::TimeDelta::milliseconds(1);
        assert_eq!(whole_days(late, t(2, 0)), (t(1, 0), t(2, 0)));
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
