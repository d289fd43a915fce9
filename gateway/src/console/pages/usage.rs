//! Usage and cost, from the rollups (the admin plane's usage report):
//! device-hours per tenant by day as a stacked chart, each tenant's tokens
//! against its device time (a scatter and a table) and cost, the adapters
//! that cost the most (bars and a table), and rollouts' evaluation traffic
//! apart. Filters: the
//! last N days, one tenant.

use std::collections::{BTreeMap, HashMap};

use super::*;
use crate::admin::UsageReport;
use crate::console::chart;
use chrono::Utc;
use lorafleet_admin_types::UsageRow;

/// Adapters the page lists, costliest first.
const TOP_ADAPTERS: usize = 10;

pub(super) async fn page(
    State(c): State<Console>,
    s: Session,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let data = async {
        let days = days(&q)?;
        let tenant = q
            .get("tenant")
            .and_then(|t| non_blank(t))
            .map(str::to_owned);
        // Whole UTC days, this one included.
        let today = Utc::now().date_naive();
        let from = (today - chrono::Days::new(days as u64 - 1))
            .and_hms_opt(0, 0, 0)
            .unwrap_or_default()
            .and_utc();
        let to = (today + chrono::Days::new(1))
            .and_hms_opt(0, 0, 0)
            .unwrap_or_default()
            .and_utc();
        let report = |group_by: &str| UsageReport {
            from,
            to,
            group_by: Some(group_by.to_owned()),
            tenant: None,
        };
        let mine = |rows: Vec<UsageRow>| -> Vec<UsageRow> {
            rows.into_iter()
                .filter(|r| tenant.is_none() || r.tenant == tenant)
                .collect()
        };
        let by_day = mine(c.read(&s, report("tenant,day")).await?.rows);
        let by_adapter = c.read(&s, report("tenant,adapter")).await?.rows;
        let by_adapter = mine(by_adapter);

        let (svg, unit) = device_chart(&by_day, from, days);

        // Each tenant's totals over the span: tokens against device time.
        let mut tenants: BTreeMap<String, Totals> = BTreeMap::new();
        for r in &by_day {
            tenants.entry(series_name(r)).or_default().add(r);
        }
        let tenant_rows: Vec<Value> = tenants
            .iter()
            .map(|(name, t)| t.json(name, "tenant"))
            .collect();
        let mut adapters: Vec<(String, Totals)> = Vec::new();
        for r in by_adapter.iter().filter(|r| !r.evaluation) {
            let name = match (&r.adapter, &r.tenant) {
                (Some(a), Some(t)) => format!("{t} / {a}"),
                (Some(a), None) => a.clone(),
                (None, Some(t)) => format!("{t} / base model"),
                (None, None) => "base model".into(),
            };
            let mut t = Totals::default();
            t.add(r);
            adapters.push((name, t));
        }
        adapters.sort_by(|a, b| {
            b.1.cost
                .unwrap_or(0.0)
                .total_cmp(&a.1.cost.unwrap_or(0.0))
                .then(b.1.device_seconds.total_cmp(&a.1.device_seconds))
        });
        let adapter_rows: Vec<Value> = adapters
            .iter()
            .take(TOP_ADAPTERS)
            .map(|(name, t)| t.json(name, "adapter"))
            .collect();
        let points: Vec<(String, f64, f64)> = tenants
            .iter()
            .map(|(name, t)| {
                let tokens = (t.prompt_tokens + t.completion_tokens) as f64;
                (name.clone(), t.device_seconds, tokens)
            })
            .collect();
        let tokens_chart = chart::scatter(&points, "device-seconds", "tokens");
        let (cost_chart, cost_unit) = cost_chart(&adapters[..adapters.len().min(TOP_ADAPTERS)]);
        Ok(json!({
            "chart": svg,
            "unit": unit,
            "tokens_chart": tokens_chart,
            "cost_chart": cost_chart,
            "cost_unit": cost_unit,
            "tenants": tenant_rows,
            "adapters": adapter_rows,
            "filters": { "days": days, "tenant": tenant },
            "span": { "from": from.date_naive().to_string(), "to": today.to_string() },
        }))
    }
    .await;
    show(&c, &s, "usage.html", "usage", Outcome::default(), data)
}

/// `days` of the query: 1 to 366, 30 when absent.
fn days(q: &HashMap<String, String>) -> Result<i64, ApiError> {
    match q.get("days").map(|d| d.trim()).filter(|d| !d.is_empty()) {
        None => Ok(30),
        Some(d) => d
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=366).contains(n))
            .ok_or_else(|| {
                ApiError::field(
                    "days",
                    &format!("{d:?} is not a whole number from 1 to 366"),
                )
            }),
    }
}

/// The chart: device time per tenant (evaluation traffic one series of
/// its own) by day from `from`, and the unit it is drawn in.
fn device_chart(
    by_day: &[UsageRow],
    from: chrono::DateTime<Utc>,
    days: i64,
) -> (String, &'static str) {
    let columns: Vec<String> = (0..days)
        .map(|d| (from.date_naive() + chrono::Days::new(d as u64)).to_string())
        .collect();
    let mut series: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for r in by_day {
        let name = series_name(r);
        let day = r.period.map(|p| p.date_naive().to_string());
        if let Some(i) = day.and_then(|d| columns.iter().position(|c| *c == d)) {
            series
                .entry(name)
                .or_insert_with(|| vec![0.0; columns.len()])[i] += r.device_seconds / 3600.0;
        }
    }
    let mut series: Vec<(String, Vec<f64>)> = series.into_iter().collect();
    // Under a minute of device time on the busiest day reads better
    // in seconds.
    let busiest = (0..columns.len())
        .map(|c| series.iter().map(|(_, v)| v[c]).sum::<f64>())
        .fold(0.0, f64::max);
    let unit = if busiest < 1.0 / 60.0 {
        for (_, v) in &mut series {
            for x in v.iter_mut() {
                *x *= 3600.0;
            }
        }
        "device-seconds"
    } else {
        "device-hours"
    };
    let svg = chart::stacked_bars(&columns, &series, unit);
    (svg, unit)
}

/// The costliest adapters as bars: by cost where any of them had a price,
/// else by device time; and the unit drawn.
fn cost_chart(adapters: &[(String, Totals)]) -> (String, &'static str) {
    let priced = adapters.iter().any(|(_, t)| t.cost.is_some());
    let items: Vec<(String, f64)> = adapters
        .iter()
        .map(|(name, t)| {
            let v = if priced {
                t.cost.unwrap_or(0.0)
            } else {
                t.device_seconds
            };
            (name.clone(), v)
        })
        .collect();
    let unit = if priced { "cost" } else { "device-seconds" };
    (chart::bars(&items, unit), unit)
}

/// A row's series: its tenant, or the evaluation traffic of rollouts.
fn series_name(r: &UsageRow) -> String {
    if r.evaluation {
        return "rollout evaluations".into();
    }
    r.tenant.clone().unwrap_or_else(|| "(no tenant)".into())
}

/// A group's usage added up over the span.
#[derive(Debug, Default)]
struct Totals {
    requests: i64,
    prompt_tokens: i64,
    completion_tokens: i64,
    device_seconds: f64,
    load_seconds: f64,
    cost: Option<f64>,
}

impl Totals {
    fn add(&mut self, r: &UsageRow) {
        self.requests += r.requests;
        self.prompt_tokens += r.prompt_tokens;
        self.completion_tokens += r.completion_tokens;
        self.device_seconds += r.device_seconds;
        self.load_seconds += r.load_seconds;
        if let Some(c) = r.cost {
            self.cost = Some(self.cost.unwrap_or(0.0) + c);
        }
    }

    fn json(&self, name: &str, key: &str) -> Value {
        let tokens = self.prompt_tokens + self.completion_tokens;
        json!({
            key: name,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "device_seconds": format!("{:.3}", self.device_seconds),
            "load_seconds": format!("{:.3}", self.load_seconds),
            "tokens_per_device_second": (self.device_seconds > 0.0)
                .then(|| format!("{:.0}", tokens as f64 / self.device_seconds)),
            "cost": self.cost.map(|c| format!("{c:.4}")),
        })
    }
}
