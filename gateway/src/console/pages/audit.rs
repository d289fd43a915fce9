//! The audit log: `lorafleetctl audit`'s filters, keyset pages, CSV and
//! JSONL export, and one request's row in full.

use std::collections::HashMap;

use axum::extract::Query as Params;
use axum::http::Uri;

use super::*;
use crate::admin::{AuditFilter, ExportAudit, SearchAudit};

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

/// The typed filter the page's non-blank values (and `extra` keys) make,
/// read as the admin API reads its query string.
fn filter(q: &HashMap<String, String>, extra: &[&str]) -> Result<AuditFilter, ApiError> {
    let uri: Uri = format!("/?{}", query(q, extra))
        .parse()
        .map_err(|_| ApiError::field("query", "is not a valid query string"))?;
    Params::<AuditFilter>::try_from_uri(&uri)
        .map(|Params(f)| f)
        .map_err(|e| ApiError::field("query", &e.body_text()))
}

pub(super) async fn page(
    State(c): State<Console>,
    s: Session,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let data = async {
        let page = c
            .read(&s, SearchAudit(filter(&q, &["limit", "cursor"])?))
            .await?;
        let filters = query(&q, &[]);
        let next = page.next_cursor.as_deref().map(|cursor| {
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
            "rows": serde_json::to_value(&page.rows).unwrap_or_default(),
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
        let id = request_id.parse().map_err(|_| {
            ApiError::field("request_id", &format!("{request_id:?} is not a request id"))
        })?;
        let one = AuditFilter {
            request_id: Some(id),
            ..AuditFilter::default()
        };
        let page = c.read(&s, SearchAudit(one)).await?;
        let row = page
            .rows
            .first()
            .map(|r| serde_json::to_value(r).unwrap_or_default())
            .ok_or_else(|| {
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
    let result = async {
        let filter = filter(&q, &[])?;
        let csv = format == "csv";
        c.read(&s, ExportAudit { filter, csv }).await
    }
    .await;
    match result {
        Ok(stream) => {
            let mut headers = HeaderMap::new();
            let content_type = if format == "csv" {
                "text/csv; charset=utf-8"
            } else {
                "application/x-ndjson"
            };
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
            if let Ok(v) =
                HeaderValue::from_str(&format!("attachment; filename=\"audit.{format}\""))
            {
                headers.insert(header::CONTENT_DISPOSITION, v);
            }
            passthrough(StatusCode::OK, headers, Body::from_stream(stream))
        }
        Err(e) => c.error_page(Some(&s), &e),
    }
}
