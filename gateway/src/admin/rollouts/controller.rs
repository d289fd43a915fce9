//! The controller's side of rollouts: each running step's window read
//! from the audit log, judged, and the decision written as the lease
//! holder (see [`crate::rollout::run`]).

use super::*;

/// What each version did since the step began, from the audit log. An
/// error is a worker failure or a 5xx, or a stream cut after its first
/// token (recorded `error` with the 200 it had started with); a client's
/// 4xx is neither a request nor an error of the version.
async fn window(pool: &PgPool, r: &Rollout) -> Result<(Figures, Figures), AdminError> {
    type Row = (i64, i64, i64, Option<f64>, Option<f64>);
    let rows: Vec<Row> = sqlx::query_as(WINDOW_SQL)
        .bind(r.route_id)
        .bind(r.step_started_at)
        .bind(vec![r.candidate_lora_int_id, r.stable_lora_int_id])
        .fetch_all(pool)
        .await
        .map_err(db_error)?;
    let mut out = (Figures::default(), Figures::default());
    for (id, requests, errors, ttft, tpot) in rows {
        let f = Figures {
            requests: requests as u64,
            errors: errors as u64,
            ttft_p95_ms: ttft.map(|us| us / 1000.0),
            tpot_p95_ms: tpot.map(|us| us / 1000.0),
        };
        if id == r.candidate_lora_int_id {
            out.0 = f;
        } else {
            out.1 = f;
        }
    }
    Ok(out)
}

/// The controller's turns (see [`crate::rollout::run`]), taken by the
/// replica that holds the lease: each running rollout's step judged, and
/// what is decided written as a route revision with its change row.
impl rollout::Turn for AdminState {
    async fn turn(&self, holder: &str) -> Result<usize, sqlx::Error> {
        let running: Vec<Rollout> = sqlx::query_as(sql!(
            "SELECT {COLUMNS} FROM rollouts WHERE state = 'running' ORDER BY created_at"
        ))
        .fetch_all(&self.pool)
        .await?;
        let mut written = 0;
        for r in running {
            match judge_step(self, holder, &r).await {
                Ok(true) => written += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(rollout = %r.id, error = %e.message, "rollout step not judged")
                }
            }
        }
        Ok(written)
    }
}

/// In a decision's transaction: the lease still held by `holder` (share-
/// locked, so it cannot change hands until the transaction ends), then the
/// route and the rollout locked, in the order the admin calls lock them in
/// (so the two never deadlock). `None` when the lease is lost or the
/// rollout is no longer as it was judged.
pub(super) async fn lock_as_judged(
    tx: &mut sqlx::PgConnection,
    holder: &str,
    r: &Rollout,
    unchanged: impl FnOnce(&Rollout) -> bool,
) -> Result<Option<(String, Uuid, String, (Uuid, RouteView))>, AdminError> {
    // Only the lease holder writes, and the lease cannot change hands
    // until this transaction ends (the row is share-locked).
    let leased: Option<String> = sqlx::query_scalar(
        "SELECT holder FROM controller_leases
         WHERE name = $1 AND holder = $2 AND expires_at > now() FOR SHARE",
    )
    .bind(LEASE)
    .bind(holder)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db_error)?;
    if leased.is_none() {
        return Ok(None);
    }
    // The route first, then the rollout: the order the admin calls lock
    // them in, so the two never deadlock.
    let (tenant, tenant_uuid, model): (String, Uuid, String) = sqlx::query_as(
        "SELECT t.name, t.id, r.model_name FROM routes r JOIN tenants t ON t.id = r.tenant_id
         WHERE r.id = $1",
    )
    .bind(r.route_id)
    .fetch_one(&mut *tx)
    .await
    .map_err(db_error)?;
    let current = load_route(tx, &tenant, &model, true)
        .await?
        .ok_or_else(|| no_route(&tenant, &model))?;
    // The rollout as it was judged (`unchanged`): a step another replica
    // took, or a pause (and resume, which restarts the window) since,
    // writes nothing.
    let now: Option<Rollout> = sqlx::query_as(sql!(
        "SELECT {COLUMNS} FROM rollouts WHERE id = $1 FOR UPDATE"
    ))
    .bind(r.id)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db_error)?;
    if !now.as_ref().is_some_and(unchanged) {
        return Ok(None);
    }
    Ok(Some((tenant, tenant_uuid, model, current)))
}

async fn judge_step(state: &AdminState, holder: &str, r: &Rollout) -> Result<bool, AdminError> {
    let (candidate, stable) = window(&state.pool, r).await?;
    let held = r.elapsed_secs >= f64::from(r.hold_secs);
    let inconclusive = r.elapsed_secs >= (INCONCLUSIVE_HOLDS * i64::from(r.hold_secs)) as f64;
    let verdict = gates::judge(&r.gates(), &candidate, &stable, held);
    export(r, &candidate, &stable);
    let last = r.share(r.step_index + 1) == registry::WEIGHT_TOTAL;
    let Some((what, next, reason)) = rollout::decide(&verdict, r.step_index, last, inconclusive)
    else {
        return Ok(false);
    };
    let step = Step {
        holder,
        rollout: r,
        what,
        next,
        reason: reason.clone(),
        figures: json!({"candidate": candidate, "stable": stable}),
    };
    let written = state.exec(&Caller::controller(), step).await?;
    if written {
        tracing::info!(rollout = %r.id, decision = what.as_str(), step_index = next,
                       reason = reason.as_deref().unwrap_or(""), "rollout decision");
    }
    Ok(written)
}

/// One decision of the controller, written as the lease holder: nothing
/// when the lease is lost or the rollout is no longer as it was judged.
struct Step<'a> {
    holder: &'a str,
    rollout: &'a Rollout,
    what: Decision,
    next: i32,
    reason: Option<String>,
    figures: Value,
}

impl Command for Step<'_> {
    type Output = bool;

    async fn run(self, cx: &mut Cx<'_>) -> Result<bool, AdminError> {
        let Step {
            holder,
            rollout: r,
            what,
            next,
            reason,
            figures,
        } = self;
        let tx = cx.db().await?;
        let same_step = |n: &Rollout| {
            n.state == RolloutState::Running
                && n.step_index == r.step_index
                && n.step_started_at == r.step_started_at
        };
        let Some((tenant, tenant_uuid, model, current)) =
            lock_as_judged(tx, holder, r, same_step).await?
        else {
            return Ok(false);
        };
        let object = format!("{tenant}/{model}");
        if what == Decision::Pause {
            // The weights stay; only the rollout waits for an operator.
            sqlx::query(
                "UPDATE rollouts SET state = 'paused', reason = $2, updated_at = now() WHERE id = $1",
            )
            .bind(r.id)
            .bind(&reason)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
            let d = DecisionRow {
                what,
                step_index: r.step_index,
                revision: None,
                actor: CONTROLLER,
                figures: Some(figures.clone()),
                reason: reason.as_deref(),
            };
            decision(&mut *tx, r, d).await?;
            cx.record(
                &what.change_action(),
                ("route", &object),
                Some(json!({"state": RolloutState::Running.as_str(), "step_index": r.step_index})),
                Some(
                    json!({"state": RolloutState::Paused.as_str(), "step_index": r.step_index,
                            "rollout": {"rollout": r.id, "decision": what.as_str(), "figures": figures,
                                        "reason": reason}}),
                ),
            );
            tracing::warn!(rollout = %r.id, route = %object,
                           reason = reason.as_deref().unwrap_or(""), "rollout paused");
            return Ok(true);
        }
        let weights = match what {
            Decision::RollBack => r.stable_only(),
            _ => r.weights(r.share(next)),
        };
        let base_id = check_weights(&mut *tx, &weights, None, tenant_uuid).await?;
        let note = json!({"rollout": r.id, "decision": what.as_str(), "step_index": next,
                          "candidate_share_bp": weights.iter()
                              .find(|w| w.lora_int_id == r.candidate_lora_int_id)
                              .map_or(0, |w| w.weight_bp),
                          "figures": figures, "reason": reason});
        let route = write_revision(
            cx,
            &what.change_action(),
            &tenant,
            &model,
            Some(current),
            base_id,
            &weights,
            Some(note),
        )
        .await?;
        let tx = cx.db().await?;
        sqlx::query(
            "UPDATE rollouts SET state = $2::rollout_state, step_index = $3, reason = $4,
                 step_started_at = now(), updated_at = now()
             WHERE id = $1",
        )
        .bind(r.id)
        .bind(what.state_after().as_str())
        .bind(next)
        .bind(&reason)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        let d = DecisionRow {
            what,
            step_index: next,
            revision: Some(route.revision),
            actor: CONTROLLER,
            figures: Some(figures),
            reason: reason.as_deref(),
        };
        decision(&mut *tx, r, d).await?;
        Ok(true)
    }
}

/// The rollout's step and gate figures at `/metrics`.
fn export(r: &Rollout, candidate: &Figures, stable: &Figures) {
    let id = r.id.to_string();
    metrics::gauge!("lorafleet_gateway_rollout_candidate_share_bp", "rollout" => id.clone())
        .set(f64::from(r.steps_bp[r.step_index as usize]));
    for (version, f) in [("candidate", candidate), ("stable", stable)] {
        let g = |figure: &'static str, v: f64| {
            metrics::gauge!("lorafleet_gateway_rollout_window", "rollout" => id.clone(),
                            "version" => version, "figure" => figure)
            .set(v);
        };
        g("requests", f.requests as f64);
        g("error_rate", f.error_rate());
        if let Some(v) = f.ttft_p95_ms {
            g("ttft_p95_ms", v);
        }
        if let Some(v) = f.tpot_p95_ms {
            g("tpot_p95_ms", v);
        }
    }
}

/// A rollout step's window in the audit log: each version's requests,
/// errors and p95s on route `$1` since `$2` (the step's start; only its
/// partitions are read) for the adapters `$3`: tenants' requests, not the
/// gateway's own evaluation traffic.
pub const WINDOW_SQL: &str = "SELECT lora_int_id,
                count(*) FILTER (WHERE status = 'ok'
                                 OR (status = 'error' AND http_status NOT BETWEEN 400 AND 499)),
                count(*) FILTER (WHERE status = 'error' AND http_status NOT BETWEEN 400 AND 499),
                percentile_cont(0.95) WITHIN GROUP (ORDER BY ttft_us)
                    FILTER (WHERE status = 'ok' AND ttft_us IS NOT NULL),
                percentile_cont(0.95) WITHIN GROUP
                    (ORDER BY (latency_us - ttft_us)::FLOAT8 / NULLIF(completion_tokens - 1, 0))
                    FILTER (WHERE status = 'ok' AND ttft_us IS NOT NULL AND completion_tokens > 1)
         FROM audit_log
         WHERE route_id = $1 AND received_at >= $2 AND lora_int_id = ANY($3)
               AND NOT ('evaluation' = ANY (string_to_array(features, ',')))
         GROUP BY lora_int_id";
