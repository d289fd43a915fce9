//! Usage reports, read from the hourly rollups (`usage_hourly`, kept by a
//! trigger as audit rows land) and never from the log, so a month's report
//! reads a few hundred rows per tenant however large the log is.

use super::*;

/// `GET /admin/v1/usage?from&to&group_by&tenant`: usage over `[from, to)`
/// (RFC 3339; at most 366 days), grouped by any of `tenant`, `route`,
/// `adapter` and one period, `day` or `hour` (UTC); evaluation traffic is
/// always a group of its own.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageReport {
    pub from: DateTime<Utc>,
    pub to: DateTime<Utc>,
    /// Comma-separated; none: one row per kind of traffic.
    pub group_by: Option<String>,
    pub tenant: Option<Uuid>,
}

/// The longest span a report may cover.
const MAX_SPAN_DAYS: i64 = 366;

/// What a report groups by, parsed from `group_by`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Grouping {
    tenant: bool,
    route: bool,
    adapter: bool,
    /// `date_trunc`'s unit: "day" or "hour".
    period: Option<&'static str>,
}

impl Grouping {
    fn parse(text: Option<&str>) -> Result<Grouping, AdminError> {
        let mut g = Grouping::default();
        for part in text.unwrap_or("").split(',').map(str::trim) {
            match part {
                "" => {}
                "tenant" => g.tenant = true,
                "route" => g.route = true,
                "adapter" => g.adapter = true,
                "day" | "hour" => {
                    if g.period.is_some() {
                        return Err(AdminError::field(
                            "group_by",
                            "names two periods; choose day or hour",
                        ));
                    }
                    g.period = Some(if part == "day" { "day" } else { "hour" });
                }
                other => {
                    return Err(AdminError::field(
                        "group_by",
                        format!("{other:?} is not tenant, route, adapter, day or hour"),
                    ));
                }
            }
        }
        Ok(g)
    }
}

/// `to` after `from`, and at most [`MAX_SPAN_DAYS`] after it.
fn check_span(from: DateTime<Utc>, to: DateTime<Utc>) -> Result<(), AdminError> {
    if to <= from {
        return Err(AdminError::field("to", "must be after from"));
    }
    if to - from > chrono::TimeDelta::days(MAX_SPAN_DAYS) {
        return Err(AdminError::field(
            "to",
            format!("the span from `from` is over {MAX_SPAN_DAYS} days"),
        ));
    }
    Ok(())
}

impl Query for UsageReport {
    type Output = UsageList;
    const NEED: Need = Need::Audit;

    async fn run(self, s: &AdminState) -> Result<UsageList, AdminError> {
        check_span(self.from, self.to)?;
        let g = Grouping::parse(self.group_by.as_deref())?;
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
        let mut q = sqlx::QueryBuilder::<sqlx::Postgres>::new(format!(
            "SELECT {period} AS period, {} AS tenant_id, {} AS route_id, {} AS lora_int_id,
                    evaluation, sum(requests)::BIGINT AS requests,
                    coalesce(sum(requests) FILTER (WHERE status = 'ok'), 0)::BIGINT AS completed,
                    sum(prompt_tokens)::BIGINT AS prompt_tokens,
                    sum(completion_tokens)::BIGINT AS completion_tokens,
                    sum(cached_tokens)::BIGINT AS cached_tokens,
                    sum(device_us)::FLOAT8 / 1e6 AS device_seconds
               FROM usage_hourly WHERE hour >= ",
            column(g.tenant, "tenant_id", "UUID"),
            column(g.route, "route_id", "UUID"),
            column(g.adapter, "lora_int_id", "BIGINT"),
        ));
        q.push_bind(self.from)
            .push(" AND hour < ")
            .push_bind(self.to);
        if let Some(t) = self.tenant {
            q.push(" AND tenant_id = ").push_bind(t);
        }
        q.push(" GROUP BY 1, 2, 3, 4, 5 ORDER BY 1, 2, 3, 4, 5");
        let rows: Vec<UsageRow> = q
            .build_query_as()
            .fetch_all(&s.pool)
            .await
            .map_err(db_error)?;
        Ok(UsageList { rows })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_backwards_or_over_a_year_is_refused_by_field() {
        let from = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let day = chrono::TimeDelta::days(1);
        assert!(check_span(from, from + day).is_ok());
        assert!(check_span(from, from + day * 366).is_ok());
        for to in [from, from - day, from + day * 367] {
            let e = check_span(from, to).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("to"), "{to}: {e:?}");
        }
    }

    #[test]
    fn group_by_is_read_by_name_and_refused_by_field() {
        let g = Grouping::parse(Some("tenant, adapter,day")).unwrap();
        assert_eq!(
            g,
            Grouping {
                tenant: true,
                route: false,
                adapter: true,
                period: Some("day")
            }
        );
        assert_eq!(Grouping::parse(None).unwrap(), Grouping::default());
        for bad in ["tenant,model", "day,hour"] {
            let e = Grouping::parse(Some(bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("group_by"), "{bad}: {e:?}");
        }
    }
}
