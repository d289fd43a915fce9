//! The usage report: requests, tokens, device seconds and their cost from
//! the hourly rollups, as a table, JSON (`--output json`) or CSV (`--csv`);
//! and the prices it is costed at.

use super::*;

const COLUMNS: [&str; 15] = [
    "period",
    "tenant_id",
    "route_id",
    "lora_int_id",
    "evaluation",
    "requests",
    "completed",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "device_seconds",
    "load_seconds",
    "device_cost",
    "token_cost",
    "cost",
];

const PRICE_COLUMNS: [&str; 7] = [
    "base_model",
    "tenant",
    "route",
    "effective_at",
    "device_hour",
    "prompt_per_million",
    "completion_per_million",
];

pub(crate) async fn prices(c: &Client, cmd: PriceCmd) -> Result<(), Failure> {
    match cmd {
        PriceCmd::List { base_model, tenant } => {
            let mut q = Vec::new();
            if let Some(b) = base_model {
                q.push(("base_model", b));
            }
            if let Some(t) = tenant {
                q.push(("tenant", t));
            }
            let list: lorafleet_admin_types::PriceList = c.get_as("/prices", &q).await?;
            show_list(c, &as_json(&list), "prices", &PRICE_COLUMNS);
        }
        PriceCmd::Set {
            from,
            base_model,
            tenant,
            route,
            device_hour,
            prompt_per_million,
            completion_per_million,
        } => {
            let effective_at = chrono::DateTime::parse_from_rfc3339(&from)
                .map_err(|e| fail(USAGE, format!("--from: {from:?} is not RFC 3339: {e}")))?
                .with_timezone(&chrono::Utc);
            let new = lorafleet_admin_types::NewPrice {
                base_model,
                tenant,
                route,
                effective_at,
                device_hour,
                prompt_per_million,
                completion_per_million,
            };
            let row: lorafleet_admin_types::PriceRow = c.post_as("/prices", &new).await?;
            show_one(c, &as_json(&row), &PRICE_COLUMNS);
        }
    }
    Ok(())
}

pub(crate) async fn usage(c: &Client, a: UsageArgs) -> Result<(), Failure> {
    let mut q = vec![("from", a.from), ("to", a.to)];
    if let Some(g) = a.group_by {
        q.push(("group_by", g));
    }
    if let Some(t) = a.tenant {
        q.push(("tenant", t));
    }
    let list: lorafleet_admin_types::UsageList = c.get_as("/usage", &q).await?;
    let body = as_json(&list);
    if a.csv {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", COLUMNS.join(","));
        for row in body["rows"].as_array().into_iter().flatten() {
            let cells: Vec<String> = COLUMNS.iter().map(|k| cell(&row[*k])).collect();
            let _ = writeln!(out, "{}", cells.join(","));
        }
        return Ok(());
    }
    show_list(c, &body, "rows", &COLUMNS);
    Ok(())
}
