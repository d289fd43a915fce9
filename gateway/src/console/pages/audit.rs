//! The audit log: `lorafleetctl audit`'s filters, keyset pages, CSV and
//! JSONL export, and one request's row in full.

use std::collections::HashMap;

use super::*;

/// The filters the admin API takes, in the order the form shows them.
const FILTERS: &[&str] = &[
    "tenant",
    "api_key",
    "model",
    "adapter",
    "lora_int_id",
    "worker",
    "status",
    "request_id",
    "since",
    "until",
];

/// The non-blank filters (and `extra` keys) as a query string.
fn query(q: &HashMap<String, String>, extra: &[&str]) -> String {
    FILTERS
        .iter()
        .chain(extra)
        .filter_map(|k| Some((k, non_blank(q.get(*k)?)?)))
        .map(|(k, v)| format!("{k}={}", seg(v)))
        .collect::<Vec<_>>()
        .join("&")
}

pub(super) async fn page(
    State(c): State<Console>,
    s: Session,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let data = async {
        let page: Value = c
            .api(
                &s,
                Call::get(format!(
                    "/admin/v1/audit?{}",
                    query(&q, &["limit", "cursor"])
                )),
            )
            .await?;
        let filters = query(&q, &[]);
        let next = page["next_cursor"].as_str().map(|cursor| {
            let mut next = filters.clone();
            if let Some(l) = q.get("limit").and_then(|l| non_blank(l)) {
                next.push_str(&format!("&limit={}", seg(l)));
            }
            format!("{next}&cursor={}", seg(cursor))
        });
        let echo: HashMap<&str, &str> = FILTERS
            .iter()
            .chain(&["limit"])
            .filter_map(|k| Some((*k, q.get(*k)?.as_str())))
            .collect();
        Ok(json!({
            "rows": page["rows"],
            "filters": echo,
            "query": filters,
            "next": next,
        }))
    }
    .await;
    show(&c, &s, "audit.html", "audit", Outcome::default(), data)
}

pub(super) async fn row(
    State(c): State<Console>,
    s: Session,
    Path(request_id): Path<String>,
) -> Response {
    let data = async {
        let page: Value = c
            .api(
                &s,
                Call::get(format!("/admin/v1/audit?request_id={}", seg(&request_id))),
            )
            .await?;
        let row = page["rows"].get(0).cloned().ok_or_else(|| {
            ApiError::local(
                StatusCode::NOT_FOUND,
                Some("request_id"),
                &format!("no audit row for request {request_id}"),
            )
        })?;
        Ok(json!({ "row": row }))
    }
    .await;
    show(&c, &s, "audit_row.html", "audit", Outcome::default(), data)
}

/// Every matching row, as the admin API streams it, as a download.
pub(super) async fn export(
    State(c): State<Console>,
    s: Session,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let format = match q.get("format").map(String::as_str) {
        Some(f @ ("csv" | "jsonl")) => f,
        other => {
            return c.error_page(
                Some(&s),
                &ApiError::field("format", &format!("{other:?} is not csv or jsonl")),
            );
        }
    };
    let filters = query(&q, &[]);
    let sep = if filters.is_empty() { "" } else { "&" };
    let r = c
        .send(
            &s,
            Call::get(format!("/admin/v1/audit?{filters}{sep}format={format}")),
        )
        .await;
    let (mut parts, body) = r.into_parts();
    if parts.status.is_success()
        && let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"audit.{format}\""))
    {
        parts.headers.insert(header::CONTENT_DISPOSITION, v);
    }
    passthrough(parts.status, parts.headers, body)
}
