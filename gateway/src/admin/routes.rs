//! Routes and canaries: etag-checked revisions, weights, promote and rollback.

use super::*;

pub(super) fn etag(revision: i32) -> String {
    format!("\"{revision}\"")
}

pub(super) async fn load_route(
    ex: &mut sqlx::PgConnection,
    tenant: &str,
    model: &str,
    lock: bool,
) -> Result<Option<(Uuid, RouteView)>, AdminError> {
    type Row = (
        Uuid,
        String,
        String,
        i32,
        String,
        String,
        DateTime<Utc>,
        String,
    );
    if lock {
        // The route row alone first: locked through the join below, a row
        // another transaction changed meanwhile would be re-checked against
        // its old revision's join and missed. The next statement sees the
        // committed change.
        sqlx::query(
            "SELECT r.id FROM routes r JOIN tenants t ON t.id = r.tenant_id
             WHERE t.name = $1 AND r.model_name = $2 FOR UPDATE OF r",
        )
        .bind(tenant)
        .bind(model)
        .fetch_optional(&mut *ex)
        .await
        .map_err(db_error)?;
    }
    let row: Option<Row> = sqlx::query_as(
        "SELECT r.id, t.name, r.model_name, r.current_revision, b.name, rr.target::TEXT,
                r.updated_at, rr.created_by
         FROM routes r JOIN tenants t ON t.id = r.tenant_id
         JOIN route_revisions rr ON rr.route_id = r.id AND rr.revision = r.current_revision
         JOIN base_models b ON b.id = rr.base_model_id
         WHERE t.name = $1 AND r.model_name = $2",
    )
    .bind(tenant)
    .bind(model)
    .fetch_optional(&mut *ex)
    .await
    .map_err(db_error)?;
    let Some((id, tenant, model, revision, base_model, target, updated_at, created_by)) = row
    else {
        return Ok(None);
    };
    let weights = revision_weights(ex, id, revision).await?;
    Ok(Some((
        id,
        RouteView {
            tenant,
            model,
            revision,
            etag: etag(revision),
            base_model,
            target,
            weights,
            updated_at,
            created_by,
        },
    )))
}

pub(super) async fn revision_weights(
    ex: &mut sqlx::PgConnection,
    route: Uuid,
    revision: i32,
) -> Result<Vec<WeightView>, AdminError> {
    sqlx::query_as(
        "SELECT w.lora_int_id, a.name AS adapter, a.version, w.weight_bp
         FROM route_weights w JOIN adapters a ON a.lora_int_id = w.lora_int_id
         WHERE w.route_id = $1 AND w.revision = $2 ORDER BY w.lora_int_id",
    )
    .bind(route)
    .bind(revision)
    .fetch_all(&mut *ex)
    .await
    .map_err(db_error)
}

/// Every route (of one tenant, if given) at its current revision.
#[derive(Debug, Default, Deserialize)]
pub struct ListRoutes {
    pub tenant: Option<String>,
}

impl Query for ListRoutes {
    type Output = RouteList;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<RouteList, AdminError> {
        let f = self;
        let mut conn = s.pool.acquire().await.map_err(db_error)?;
        let names: Vec<(String, String)> = sqlx::query_as(
            "SELECT t.name, r.model_name FROM routes r JOIN tenants t ON t.id = r.tenant_id
         WHERE ($1::TEXT IS NULL OR t.name = $1) ORDER BY t.name, r.model_name",
        )
        .bind(&f.tenant)
        .fetch_all(&mut *conn)
        .await
        .map_err(db_error)?;
        let mut routes = Vec::new();
        for (t, m) in names {
            if let Some((_, view)) = load_route(&mut conn, &t, &m, false).await? {
                routes.push(view);
            }
        }
        Ok(RouteList { routes })
    }
}

/// One route at its current revision.
#[derive(Debug)]
pub struct GetRoute {
    pub tenant: String,
    pub model: String,
}

impl Query for GetRoute {
    type Output = RouteView;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<RouteView, AdminError> {
        let GetRoute { tenant, model } = self;
        let mut conn = s.pool.acquire().await.map_err(db_error)?;
        let (_, view) = load_route(&mut conn, &tenant, &model, false)
            .await?
            .ok_or_else(|| AdminError::not_found("model", format!("route {tenant}/{model}")))?;
        Ok(view)
    }
}

/// The revision the client last saw, from an `If-Match` value.
pub fn parse_etag(value: Option<&str>) -> Result<Option<i32>, AdminError> {
    let Some(s) = value else {
        return Ok(None);
    };
    let s = s.trim();
    let s = s.strip_prefix("W/").unwrap_or(s);
    s.trim_matches('"').parse::<i32>().map(Some).map_err(|_| {
        AdminError::field(
            "If-Match",
            format!("{s:?} is not a route etag such as \"3\""),
        )
    })
}

/// Checks `If-Match` against the route's current revision.
pub(super) fn check_etag(
    sent: Option<i32>,
    current: Option<i32>,
    tenant: &str,
    model: &str,
) -> Result<(), AdminError> {
    match (sent, current) {
        (None, None) => Ok(()),
        (Some(s), Some(c)) if s == c => Ok(()),
        (None, Some(c)) => Err(AdminError::new(
            AdminCode::EtagRequired,
            Some("If-Match"),
            format!(
                "If-Match: route {tenant}/{model} exists (etag \"{c}\"); send its etag to change it"
            ),
        )),
        (Some(s), Some(c)) => Err(AdminError::new(
            AdminCode::StaleEtag,
            Some("If-Match"),
            format!(
                "If-Match: etag \"{s}\" is stale; route {tenant}/{model} is at \"{c}\" since someone else changed it. Re-read the route and retry"
            ),
        )),
        (Some(s), None) => Err(AdminError::new(
            AdminCode::StaleEtag,
            Some("If-Match"),
            format!("If-Match: etag \"{s}\" given, but route {tenant}/{model} does not exist"),
        )),
    }
}

/// The route an operator's change applies to, locked: its tenant's id,
/// its id and its current revision, once the etag the caller sent matches
/// and no rollout drives it.
pub(super) async fn route_to_change(
    tx: &mut sqlx::PgConnection,
    tenant: &str,
    model: &str,
    sent: Option<i32>,
) -> Result<(Uuid, Uuid, RouteView), AdminError> {
    let tenant_uuid = tenant_id(&mut *tx, tenant, "tenant").await?;
    let (route_id, current) = load_route(&mut *tx, tenant, model, true)
        .await?
        .ok_or_else(|| AdminError::not_found("model", format!("route {tenant}/{model}")))?;
    check_etag(sent, Some(current.revision), tenant, model)?;
    refuse_during_rollout(&mut *tx, route_id, tenant, model).await?;
    Ok((tenant_uuid, route_id, current))
}

/// Validates weights against the registry: every version exists, is
/// active, belongs to this tenant or the platform, and all share one base
/// model. Returns that base model's id.
pub(super) async fn check_weights(
    ex: &mut sqlx::PgConnection,
    weights: &[Weight],
    base_model: Option<&str>,
    tenant: Uuid,
) -> Result<i64, AdminError> {
    let mut seen = std::collections::HashSet::new();
    let mut sum: u64 = 0;
    for (i, w) in weights.iter().enumerate() {
        if !(1..=registry::WEIGHT_TOTAL).contains(&w.weight_bp) {
            return Err(AdminError::field(
                &format!("weights[{i}].weight_bp"),
                format!("{} must be between 1 and 10000 basis points", w.weight_bp),
            ));
        }
        if !seen.insert(w.lora_int_id) {
            return Err(AdminError::field(
                &format!("weights[{i}].lora_int_id"),
                format!("adapter {} is listed twice", w.lora_int_id),
            ));
        }
        sum += u64::from(w.weight_bp);
    }
    if sum != u64::from(registry::WEIGHT_TOTAL) {
        return Err(AdminError::unprocessable(
            AdminCode::WeightsSum,
            "weights",
            format!("the weights sum to {sum} basis points; they must sum to exactly 10000"),
        ));
    }
    let mut base: Option<(i64, String, usize)> = None;
    if let Some(name) = base_model {
        let id = base_model_id(&mut *ex, name).await?;
        base = Some((id, name.to_owned(), usize::MAX));
    }
    for (i, w) in weights.iter().enumerate() {
        let param = format!("weights[{i}].lora_int_id");
        type Row = (i64, String, String, i32, Option<Uuid>, String);
        let row: Option<Row> = sqlx::query_as(
            "SELECT a.base_model_id, b.name, a.name, a.version, a.tenant_id, a.state::TEXT
             FROM adapters a JOIN base_models b ON b.id = a.base_model_id WHERE a.lora_int_id = $1",
        )
        .bind(w.lora_int_id)
        .fetch_optional(&mut *ex)
        .await
        .map_err(db_error)?;
        let (base_id, base_name, name, version, owner, state) = row.ok_or_else(|| {
            AdminError::unprocessable(
                AdminCode::UnknownAdapter,
                &param,
                format!("adapter {} does not exist", w.lora_int_id),
            )
        })?;
        if state == "retired" {
            return Err(AdminError::unprocessable(
                AdminCode::AdapterRetired,
                &param,
                format!(
                    "adapter {} ({name} v{version}) is retired and cannot receive traffic",
                    w.lora_int_id
                ),
            ));
        }
        if owner.is_some_and(|o| o != tenant) {
            return Err(AdminError::unprocessable(
                AdminCode::AdapterOfAnotherTenant,
                &param,
                format!(
                    "adapter {} ({name} v{version}) belongs to another tenant",
                    w.lora_int_id
                ),
            ));
        }
        match &base {
            None => base = Some((base_id, base_name, i)),
            Some((id, other, at)) if *id != base_id => {
                let whose = if *at == usize::MAX {
                    "the route's base_model".to_owned()
                } else {
                    format!("weights[{at}]")
                };
                return Err(AdminError::unprocessable(
                    AdminCode::MixedBaseModels,
                    &param,
                    format!(
                        "adapter {} is on base model {base_name:?} but {whose} is on {other:?}; one route serves one base model",
                        w.lora_int_id
                    ),
                ));
            }
            Some(_) => {}
        }
    }
    base.map(|(id, _, _)| id)
        .ok_or_else(|| AdminError::field("base_model", "is required for a route to the base model"))
}

/// Writes a new revision of a route (creating the route at revision 1) and
/// records the change. The caller has checked the etag.
#[allow(clippy::too_many_arguments)]
pub(super) async fn write_revision(
    cx: &mut Cx<'_>,
    action: &str,
    tenant_name: &str,
    model: &str,
    existing: Option<(Uuid, RouteView)>,
    base_id: i64,
    weights: &[Weight],
    rollout: Option<Value>,
) -> Result<RouteView, AdminError> {
    let created_by = cx.caller.subject.clone();
    let tx = cx.db().await?;
    let tenant = tenant_id(&mut *tx, tenant_name, "tenant").await?;
    let (route_id, revision, before) = match existing {
        Some((id, view)) => (id, view.revision + 1, Some(view)),
        None => {
            check_model_name(model, "model")?;
            let id: Uuid = sqlx::query_scalar(
                "INSERT INTO routes (tenant_id, model_name, current_revision) VALUES ($1, $2, 1) RETURNING id",
            )
            .bind(tenant)
            .bind(model)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
            (id, 1, None)
        }
    };
    let target = if weights.is_empty() {
        "base"
    } else {
        "adapters"
    };
    sqlx::query(
        "INSERT INTO route_revisions (route_id, revision, base_model_id, target, created_by)
         VALUES ($1, $2, $3, $4::route_target, $5)",
    )
    .bind(route_id)
    .bind(revision)
    .bind(base_id)
    .bind(target)
    .bind(&created_by)
    .execute(&mut *tx)
    .await
    .map_err(db_error)?;
    for w in weights {
        sqlx::query(
            "INSERT INTO route_weights (route_id, revision, base_model_id, lora_int_id, weight_bp)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(route_id)
        .bind(revision)
        .bind(base_id)
        .bind(w.lora_int_id)
        .bind(w.weight_bp as i32)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    }
    sqlx::query("UPDATE routes SET current_revision = $2, updated_at = now() WHERE id = $1")
        .bind(route_id)
        .bind(revision)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    // The deferred checks (weights sum, revision references) run now, so
    // their violations are reported as this request's errors.
    sqlx::query("SET CONSTRAINTS ALL IMMEDIATE")
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
    let (_, after) = load_route(tx, tenant_name, model, false)
        .await?
        .ok_or_else(|| AdminError::internal("the route vanished inside its transaction"))?;
    let object = format!("{tenant_name}/{model}");
    let mut after_json = to_json(&after);
    if let Some(r) = rollout {
        // A rollout's step: what decided it, with its figures.
        after_json["rollout"] = r;
    }
    cx.record(
        action,
        ("route", &object),
        before.as_ref().map(to_json),
        Some(after_json),
    );
    Ok(after)
}

/// A route written as a new revision, or created at revision 1.
#[derive(Debug)]
pub struct PutRoute {
    pub tenant: String,
    pub model: String,
    /// The revision the caller last saw (`If-Match`); required once the
    /// route exists.
    pub if_match: Option<i32>,
    pub spec: RouteSpec,
}

/// A route as a change left it.
#[derive(Debug)]
pub struct RouteWritten {
    pub route: RouteView,
    pub created: bool,
}

impl Command for PutRoute {
    type Output = RouteWritten;

    async fn run(self, cx: &mut Cx<'_>) -> Result<RouteWritten, AdminError> {
        let PutRoute {
            tenant,
            model,
            if_match: sent,
            spec,
        } = self;
        let tx = cx.db().await?;
        let tenant_uuid = tenant_id(&mut *tx, &tenant, "tenant").await?;
        let existing = load_route(&mut *tx, &tenant, &model, true).await?;
        check_etag(
            sent,
            existing.as_ref().map(|(_, v)| v.revision),
            &tenant,
            &model,
        )?;
        if let Some((route_id, _)) = &existing {
            refuse_during_rollout(&mut *tx, *route_id, &tenant, &model).await?;
        }
        let base_id = if spec.weights.is_empty() {
            let name = spec.base_model.as_deref().ok_or_else(|| {
            AdminError::field(
                "weights",
                "give adapter weights, or base_model alone for a route to the base model itself",
            )
        })?;
            base_model_id(&mut *tx, name).await?
        } else {
            check_weights(
                &mut *tx,
                &spec.weights,
                spec.base_model.as_deref(),
                tenant_uuid,
            )
            .await?
        };
        let action = if existing.is_some() {
            "route.update"
        } else {
            "route.create"
        };
        let created = existing.is_none();
        let route = write_revision(
            cx,
            action,
            &tenant,
            &model,
            existing,
            base_id,
            &spec.weights,
            None,
        )
        .await?;
        Ok(RouteWritten { route, created })
    }
}

/// One adapter version given all of a route's traffic.
#[derive(Debug)]
pub struct Promote {
    pub tenant: String,
    pub model: String,
    pub if_match: Option<i32>,
    pub lora_int_id: i64,
}

impl Command for Promote {
    type Output = RouteView;

    async fn run(self, cx: &mut Cx<'_>) -> Result<RouteView, AdminError> {
        let Promote {
            tenant,
            model,
            if_match: sent,
            lora_int_id,
        } = self;
        let tx = cx.db().await?;
        let (tenant_uuid, route_id, current) = route_to_change(tx, &tenant, &model, sent).await?;
        let weights = [Weight {
            lora_int_id,
            weight_bp: registry::WEIGHT_TOTAL,
        }];
        let base_id = check_weights(&mut *tx, &weights, None, tenant_uuid)
            .await
            .map_err(|mut e| {
                if e.param.as_deref() == Some("weights[0].lora_int_id") {
                    e.param = Some("lora_int_id".into());
                }
                e
            })?;
        write_revision(
            cx,
            "route.promote",
            &tenant,
            &model,
            Some((route_id, current)),
            base_id,
            &weights,
            None,
        )
        .await
    }
}

/// A route back at its previous revision's weights, as a new revision.
#[derive(Debug)]
pub struct Rollback {
    pub tenant: String,
    pub model: String,
    pub if_match: Option<i32>,
}

impl Command for Rollback {
    type Output = RouteView;

    async fn run(self, cx: &mut Cx<'_>) -> Result<RouteView, AdminError> {
        let Rollback {
            tenant,
            model,
            if_match: sent,
        } = self;
        let tx = cx.db().await?;
        let (tenant_uuid, route_id, current) = route_to_change(tx, &tenant, &model, sent).await?;
        if current.revision <= 1 {
            return Err(AdminError::conflict(
                AdminCode::NoPreviousRevision,
                "model",
                format!("route {tenant}/{model} has no earlier revision to roll back to"),
            ));
        }
        let previous = current.revision - 1;
        let base_id: i64 = sqlx::query_scalar(
            "SELECT base_model_id FROM route_revisions WHERE route_id = $1 AND revision = $2",
        )
        .bind(route_id)
        .bind(previous)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
        let weights: Vec<Weight> = revision_weights(&mut *tx, route_id, previous)
            .await?
            .into_iter()
            .map(|w| Weight {
                lora_int_id: w.lora_int_id,
                weight_bp: w.weight_bp as u32,
            })
            .collect();
        if !weights.is_empty() {
            check_weights(&mut *tx, &weights, None, tenant_uuid)
                .await
                .map_err(|e| {
                    AdminError::new(
                        e.code,
                        Some("model"),
                        format!("cannot roll back to revision {previous}: {}", e.message),
                    )
                })?;
        }
        write_revision(
            cx,
            "route.rollback",
            &tenant,
            &model,
            Some((route_id, current)),
            base_id,
            &weights,
            None,
        )
        .await
    }
}
