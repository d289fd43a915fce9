//! Evaluation sets of a route: register (a name's next version, immutable,
//! with the file's digest) and list. A rollout names one to be scored on
//! before its first step (see [`crate::evaluation`]).

use super::*;
use crate::evaluation::set;

const COLUMNS: &str = "e.id, t.name AS tenant, r.model_name AS model, e.name, e.version, e.sha256, \
    e.item_count AS items, \
    (SELECT count(*) FROM jsonb_array_elements(e.items) i WHERE i->>'kind' = 'choice')::INTEGER \
        AS multiple_choice, \
    (SELECT count(*) FROM jsonb_array_elements(e.items) i WHERE i->>'kind' = 'generate')::INTEGER \
        AS generation, \
    e.bytes, e.created_by, e.created_at";

#[derive(sqlx::FromRow)]
struct Row {
    id: Uuid,
    tenant: String,
    model: String,
    name: String,
    version: i32,
    sha256: String,
    items: i32,
    multiple_choice: i32,
    generation: i32,
    bytes: i32,
    created_by: String,
    created_at: DateTime<Utc>,
}

impl From<Row> for EvalSetView {
    fn from(r: Row) -> EvalSetView {
        EvalSetView {
            id: r.id,
            tenant: r.tenant,
            model: r.model,
            name: r.name,
            version: r.version,
            sha256: r.sha256,
            items: r.items,
            multiple_choice: r.multiple_choice,
            generation: r.generation,
            bytes: r.bytes,
            created_by: r.created_by,
            created_at: r.created_at,
        }
    }
}

fn check_name(name: &str) -> Result<(), AdminError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(AdminError::field(
            "name",
            format!(
                "{name:?} must be 1-64 characters of lowercase letters, digits and . _ -, \
                 starting with a letter or digit"
            ),
        ))
    }
}

/// An evaluation set registered for a route: the next version of its name.
#[derive(Debug)]
pub struct RegisterEvalSet {
    pub tenant: String,
    pub model: String,
    pub set: NewEvalSet,
}

impl Command for RegisterEvalSet {
    type Output = EvalSetView;

    async fn run(self, cx: &mut Cx<'_>) -> Result<EvalSetView, AdminError> {
        let RegisterEvalSet { tenant, model, set } = self;
        check_name(&set.name)?;
        let parsed = set::parse(set.jsonl.as_bytes())
            .map_err(|e| AdminError::field(&format!("jsonl.{}", e.field), e.message.clone()))?;
        let subject = cx.caller.subject.clone();
        let tx = cx.db().await?;
        // Locked, so that two registrations of a name take two versions.
        let (route_id, _) = load_route(&mut *tx, &tenant, &model, true)
            .await?
            .ok_or_else(|| AdminError::not_found("model", format!("route {tenant}/{model}")))?;
        let items = serde_json::to_value(&parsed.items).map_err(AdminError::internal)?;
        let id: Uuid = sqlx::query_scalar(
            "INSERT INTO eval_sets (route_id, name, version, sha256, items, item_count, bytes, created_by)
             SELECT $1, $2, coalesce(max(version), 0) + 1, $3, $4, $5, $6, $7
             FROM eval_sets WHERE route_id = $1 AND name = $2
             RETURNING id",
        )
        .bind(route_id)
        .bind(&set.name)
        .bind(&parsed.sha256)
        .bind(items)
        .bind(parsed.items.len() as i32)
        .bind(set.jsonl.len() as i32)
        .bind(&subject)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
        let row: Row = sqlx::query_as(sql!(
            "SELECT {COLUMNS} FROM eval_sets e JOIN routes r ON r.id = e.route_id
             JOIN tenants t ON t.id = r.tenant_id WHERE e.id = $1"
        ))
        .bind(id)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
        let view = EvalSetView::from(row);
        cx.record(
            "eval_set.register",
            (
                "eval_set",
                &format!("{tenant}/{model}/{}@{}", view.name, view.version),
            ),
            None,
            Some(
                json!({"id": view.id, "sha256": view.sha256, "items": view.items,
                        "multiple_choice": view.multiple_choice, "generation": view.generation,
                        "bytes": view.bytes}),
            ),
        );
        Ok(view)
    }
}

/// A route's evaluation sets, every version, newest first by name.
#[derive(Debug)]
pub struct ListEvalSets {
    pub tenant: String,
    pub model: String,
}

impl Query for ListEvalSets {
    type Output = EvalSetList;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<EvalSetList, AdminError> {
        let mut conn = s.pool.acquire().await.map_err(db_error)?;
        let (route_id, _) = load_route(&mut conn, &self.tenant, &self.model, false)
            .await?
            .ok_or_else(|| {
                AdminError::not_found("model", format!("route {}/{}", self.tenant, self.model))
            })?;
        let rows: Vec<Row> = sqlx::query_as(sql!(
            "SELECT {COLUMNS} FROM eval_sets e JOIN routes r ON r.id = e.route_id
             JOIN tenants t ON t.id = r.tenant_id
             WHERE e.route_id = $1 ORDER BY e.name, e.version DESC"
        ))
        .bind(route_id)
        .fetch_all(&mut *conn)
        .await
        .map_err(db_error)?;
        Ok(EvalSetList {
            sets: rows.into_iter().map(EvalSetView::from).collect(),
        })
    }
}
