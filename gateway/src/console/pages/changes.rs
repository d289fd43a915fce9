//! The admin change log: who changed what, with before and after.

use std::collections::HashMap;

use super::*;
use crate::admin::types::ChangeList;

pub(super) async fn page(
    State(c): State<Console>,
    s: Session,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let data = async {
        let mut path = "/admin/v1/changes?limit=200".to_owned();
        for k in ["object_type", "object_id"] {
            if let Some(v) = q.get(k).and_then(|v| non_blank(v)) {
                path.push_str(&format!("&{k}={}", seg(v)));
            }
        }
        let changes: ChangeList = c.api(&s, Call::get(path)).await?;
        let pretty = |v: &Option<Value>| {
            v.as_ref()
                .map(|v| serde_json::to_string_pretty(v).unwrap_or_default())
        };
        let rows: Vec<Value> = changes
            .changes
            .iter()
            .map(|ch| {
                json!({
                    "id": ch.id,
                    "at": ch.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                    "actor": ch.actor,
                    "role": ch.role,
                    "action": ch.action,
                    "object_type": ch.object_type,
                    "object_id": ch.object_id,
                    "before": pretty(&ch.before),
                    "after": pretty(&ch.after),
                    "request_id": ch.request_id,
                })
            })
            .collect();
        Ok(json!({
            "changes": rows,
            "filters": { "object_type": q.get("object_type"), "object_id": q.get("object_id") },
        }))
    }
    .await;
    show(&c, &s, "changes.html", "changes", Outcome::default(), data)
}
