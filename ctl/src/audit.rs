//! Audit queries and exports.

use super::*;

pub(crate) async fn audit(c: &Client, a: AuditArgs) -> Result<(), Failure> {
    let mut q: Vec<(&str, String)> = Vec::new();
    let pairs: [(&str, Option<String>); 11] = [
        ("tenant", a.tenant),
        ("api_key", a.api_key),
        ("model", a.model),
        ("adapter", a.adapter),
        ("lora_int_id", a.lora_int_id.map(|v| v.to_string())),
        ("worker", a.worker),
        ("status", a.status),
        ("request_id", a.request_id),
        ("client", a.client),
        ("since", a.since),
        ("until", a.until),
    ];
    for (k, v) in pairs {
        if let Some(v) = v {
            q.push((k, v));
        }
    }
    q.push(("limit", a.limit.to_string()));
    if let Some(export) = a.export {
        if let Some(cur) = a.cursor {
            q.push(("cursor", cur));
        }
        let format = match export {
            Export::Jsonl => "jsonl",
            Export::Csv => "csv",
        };
        q.push(("format", format.into()));
        let mut resp = c
            .send(reqwest::Method::GET, "/audit", &q, None, None)
            .await?;
        let mut out = std::io::stdout().lock();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| fail(1, format!("the export was cut short: {e}")))?
        {
            out.write_all(&chunk)
                .map_err(|e| fail(1, format!("writing the export: {e}")))?;
        }
        return Ok(());
    }
    let mut cursor = a.cursor;
    let mut all_rows: Vec<Value> = Vec::new();
    let mut next: Option<String>;
    loop {
        let mut page_q = q.clone();
        if let Some(cur) = &cursor {
            page_q.push(("cursor", cur.clone()));
        }
        let body = c.get("/audit", &page_q).await?;
        all_rows.extend(body["rows"].as_array().cloned().unwrap_or_default());
        next = body["next_cursor"].as_str().map(str::to_owned);
        if !a.all || next.is_none() {
            break;
        }
        cursor = next.clone();
    }
    if c.output == Output::Json {
        println!("{}", json!({ "rows": all_rows, "next_cursor": next }));
        return Ok(());
    }
    let rows: Vec<Vec<String>> = all_rows
        .iter()
        .map(|r| {
            let adapter = match (&r["adapter_name"], &r["adapter_version"]) {
                (Value::String(n), v) => format!("{n}:{}", cell(v)),
                _ => "-".into(),
            };
            vec![
                cell(&r["received_at"]),
                cell(&r["request_id"]),
                cell(&r["tenant"]),
                cell(&r["model"]),
                cell(&r["lora_int_id"]),
                adapter,
                cell(&r["worker_id"]),
                cell(&r["status"]),
                cell(&r["http_status"]),
                format!(
                    "{}+{}",
                    cell(&r["prompt_tokens"]),
                    cell(&r["completion_tokens"])
                ),
            ]
        })
        .collect();
    table(
        &[
            "received_at",
            "request_id",
            "tenant",
            "model",
            "lora_int_id",
            "adapter",
            "worker",
            "status",
            "http",
            "tokens",
        ],
        &rows,
    );
    if let Some(n) = next {
        eprintln!("more rows: --cursor {n}");
    }
    Ok(())
}
