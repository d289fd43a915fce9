//! The usage report: requests, tokens and device seconds from the hourly
//! rollups, as a table, JSON (`--output json`) or CSV (`--csv`).

use super::*;

const COLUMNS: [&str; 11] = [
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
];

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
