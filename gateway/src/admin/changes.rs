//! The admin change log.

use super::*;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ChangeFilter {
    pub(super) object_type: Option<String>,
    pub(super) object_id: Option<String>,
    pub(super) limit: Option<u32>,
}

pub(super) async fn list_changes(
    State(s): State<AdminState>,
    headers: HeaderMap,
    query: Result<Query<ChangeFilter>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Audit)?;
    let Query(f) = query.map_err(|e| AdminError::field("query", e.body_text()))?;
    let limit = f.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(AdminError::field(
            "limit",
            format!("{limit} must be between 1 and 1000"),
        ));
    }
    let rows: Vec<ChangeRow> = sqlx::query_as(
        "SELECT id, at, actor, role, action, object_type, object_id, before, after, request_id
         FROM admin_changes
         WHERE ($1::TEXT IS NULL OR object_type = $1) AND ($2::TEXT IS NULL OR object_id = $2)
         ORDER BY at DESC, id DESC LIMIT $3",
    )
    .bind(f.object_type)
    .bind(f.object_id)
    .bind(i64::from(limit))
    .fetch_all(&s.pool)
    .await
    .map_err(db_error)?;
    Ok(reply(
        StatusCode::OK,
        &actor,
        to_json(&ChangeList { changes: rows }),
    ))
}
