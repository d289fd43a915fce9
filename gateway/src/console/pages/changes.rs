//! The admin change log: who changed what, with before and after.

use std::collections::HashMap;

use super::*;
use crate::admin::ListChanges;

pub(super) async fn page(
    State(c): State<Console>,
    s: Session,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let data = async {
        let given = |k: &str| q.get(k).and_then(|v| non_blank(v)).map(str::to_owned);
        let query = ListChanges {
            object_type: given("object_type"),
            object_id: given("object_id"),
            limit: Some(200),
        };
        let changes = c.read(&s, query).await?;
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
                    "changed": changed(ch.before.as_ref(), ch.after.as_ref()),
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

/// The top-level fields a change altered, each with its value before and
/// after (compact JSON); empty for a creation, which has no before.
fn changed(before: Option<&Value>, after: Option<&Value>) -> Vec<Value> {
    let (Some(Value::Object(b)), Some(Value::Object(a))) = (before, after) else {
        return Vec::new();
    };
    let mut keys: Vec<&String> = b.keys().chain(a.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        // Bookkeeping that every change moves.
        .filter(|k| !matches!(k.as_str(), "updated_at" | "etag"))
        .filter(|k| b.get(*k) != a.get(*k))
        .map(|k| {
            let show = |v: Option<&Value>| v.map_or_else(|| "–".to_owned(), Value::to_string);
            json!({ "field": k, "before": show(b.get(k)), "after": show(a.get(k)) })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_lists_the_fields_it_altered() {
        let before = json!({"revision": 1, "etag": "\"1\"", "weights": [1], "tenant": "acme"});
        let after = json!({"revision": 2, "etag": "\"2\"", "weights": [2], "tenant": "acme", "rollout": {}});
        let fields: Vec<String> = changed(Some(&before), Some(&after))
            .iter()
            .map(|c| c["field"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(fields, ["revision", "rollout", "weights"]);
        assert!(changed(None, Some(&after)).is_empty());
    }
}
