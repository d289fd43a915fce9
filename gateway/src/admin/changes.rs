//! The admin change log.

use super::*;

/// The change log's newest rows, filtered by object.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListChanges {
    pub object_type: Option<String>,
    pub object_id: Option<String>,
    pub limit: Option<u32>,
}

impl Query for ListChanges {
    type Output = ChangeList;
    const NEED: Need = Need::Audit;

    async fn run(self, s: &AdminState) -> Result<ChangeList, AdminError> {
        let f = self;
        let limit = f.limit.unwrap_or(100);
        if !(1..=1000).contains(&limit) {
            return Err(AdminError::field(
                "limit",
                format!("{limit} must be between 1 and 1000"),
            ));
        }
        let changes: Vec<ChangeRow> = sqlx::query_as(
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
        Ok(ChangeList { changes })
    }
}
