//! A rollout's evaluation on the admin side: the set a start names, the
//! work the controller's evaluator reads, each item's outcome it records,
//! the view, and the conclusion (the first step, or `rejected`), written
//! as the lease holder.

use std::collections::{BTreeMap, HashSet};

use super::controller::lock_as_judged;
use super::*;
use crate::evaluation::score::{self, Outcome};
use crate::evaluation::set::Item;
use crate::registry::Adapter;

/// What a start's `eval`, `min_score_delta` and `eval_seed` come to.
pub(super) struct EvalPlan {
    pub set_id: Uuid,
    pub min_score_delta: f64,
    pub seed: i64,
    /// `NAME@VERSION`.
    pub label: String,
}

/// The evaluation a start asks for, each field refused by name; None when
/// it names no set.
pub(super) async fn plan(
    tx: &mut sqlx::PgConnection,
    route_id: Uuid,
    spec: &RolloutSpec,
) -> Result<Option<EvalPlan>, AdminError> {
    let Some(eval) = &spec.eval else {
        for (field, given) in [
            ("min_score_delta", spec.min_score_delta.is_some()),
            ("eval_seed", spec.eval_seed.is_some()),
        ] {
            if given {
                return Err(AdminError::field(
                    field,
                    "applies only to a rollout with an evaluation set (`eval`)",
                ));
            }
        }
        return Ok(None);
    };
    let min_score_delta = spec.min_score_delta.unwrap_or(0.0);
    if !(min_score_delta.is_finite() && (-1.0..=1.0).contains(&min_score_delta)) {
        return Err(AdminError::field(
            "min_score_delta",
            format!("{min_score_delta} must be between -1 and 1 (a fraction of the items)"),
        ));
    }
    let seed = spec.eval_seed.unwrap_or(0);
    let seed = i64::try_from(seed)
        .map_err(|_| AdminError::field("eval_seed", format!("{seed} is above {}", i64::MAX)))?;
    let (name, version) = match eval.split_once('@') {
        None => (eval.as_str(), None),
        Some((n, v)) => (
            n,
            Some(v.parse::<i32>().ok().filter(|v| *v > 0).ok_or_else(|| {
                AdminError::field("eval", format!("{v:?} is not a version (1, 2, …)"))
            })?),
        ),
    };
    let found: Option<(Uuid, i32)> = sqlx::query_as(
        "SELECT id, version FROM eval_sets
         WHERE route_id = $1 AND name = $2 AND ($3::INTEGER IS NULL OR version = $3)
         ORDER BY version DESC LIMIT 1",
    )
    .bind(route_id)
    .bind(name)
    .bind(version)
    .fetch_optional(&mut *tx)
    .await
    .map_err(db_error)?;
    let (set_id, version) = found.ok_or_else(|| {
        AdminError::not_found("eval", format!("evaluation set {eval} of this route"))
    })?;
    Ok(Some(EvalPlan {
        set_id,
        min_score_delta,
        seed,
        label: format!("{name}@{version}"),
    }))
}

/// Each version's outcomes so far, by item.
type Outcomes = BTreeMap<i64, BTreeMap<i32, (bool, Value)>>;

async fn outcomes(ex: &mut sqlx::PgConnection, rollout: Uuid) -> Result<Outcomes, AdminError> {
    let rows: Vec<(i64, i32, bool, Value)> = sqlx::query_as(
        "SELECT lora_int_id, item_index, correct, outcome FROM rollout_eval_results
         WHERE rollout_id = $1 ORDER BY item_index",
    )
    .bind(rollout)
    .fetch_all(&mut *ex)
    .await
    .map_err(db_error)?;
    let mut out = Outcomes::new();
    for (id, item, correct, outcome) in rows {
        out.entry(id).or_default().insert(item, (correct, outcome));
    }
    Ok(out)
}

/// A rollout's evaluation as far as it has gone; None without a set.
pub(super) async fn view(
    ex: &mut sqlx::PgConnection,
    r: &Rollout,
) -> Result<Option<EvaluationView>, AdminError> {
    let Some(set_id) = r.eval_set_id else {
        return Ok(None);
    };
    let (name, version, sha256, items): (String, i32, String, i32) =
        sqlx::query_as("SELECT name, version, sha256, item_count FROM eval_sets WHERE id = $1")
            .bind(set_id)
            .fetch_one(&mut *ex)
            .await
            .map_err(db_error)?;
    let all = outcomes(ex, r.id.get()).await?;
    let empty = BTreeMap::new();
    let stable = all.get(&r.stable_lora_int_id).unwrap_or(&empty);
    let candidate = all.get(&r.candidate_lora_int_id).unwrap_or(&empty);
    let changed = stable
        .iter()
        .filter_map(|(i, (sc, so))| {
            let (cc, co) = candidate.get(i)?;
            (sc != cc).then(|| EvalItemChange {
                item_index: *i,
                stable_correct: *sc,
                candidate_correct: *cc,
                stable: so.clone(),
                candidate: co.clone(),
            })
        })
        .collect();
    Ok(Some(EvaluationView {
        set: format!("{name}@{version}"),
        sha256,
        items,
        min_score_delta: r.min_score_delta.unwrap_or(0.0),
        seed: r.eval_seed.unwrap_or(0) as u64,
        stable_done: stable.len() as i32,
        candidate_done: candidate.len() as i32,
        stable_score: r.stable_score,
        candidate_score: r.candidate_score,
        changed,
    }))
}

/// One rollout the evaluator has to score: the set, both versions as a
/// worker loads them, and the items already scored.
#[derive(Debug, Clone)]
pub struct EvaluationWork {
    pub rollout: Uuid,
    pub route_id: Uuid,
    pub tenant: String,
    pub model: String,
    pub items: Vec<Item>,
    pub seed: u64,
    pub stable: Arc<Adapter>,
    pub candidate: Arc<Adapter>,
    /// (lora_int_id, item) already recorded.
    pub done: HashSet<(i64, i32)>,
}

impl EvaluationWork {
    /// Every rollout being evaluated, oldest first, but those in `skip`
    /// (already in hand).
    pub async fn load(
        s: &AdminState,
        skip: &HashSet<Uuid>,
    ) -> Result<Vec<EvaluationWork>, AdminError> {
        let mut conn = s.pool.acquire().await.map_err(db_error)?;
        let running: Vec<Rollout> = sqlx::query_as(sql!(
            "SELECT {COLUMNS} FROM rollouts WHERE state = 'evaluating' ORDER BY created_at"
        ))
        .fetch_all(&mut *conn)
        .await
        .map_err(db_error)?;
        let mut work = Vec::with_capacity(running.len());
        for r in running.into_iter().filter(|r| !skip.contains(&r.id.get())) {
            let (tenant, model, items): (String, String, Value) = sqlx::query_as(
                "SELECT t.name, ro.model_name, e.items
                 FROM rollouts r JOIN routes ro ON ro.id = r.route_id
                 JOIN tenants t ON t.id = ro.tenant_id JOIN eval_sets e ON e.id = r.eval_set_id
                 WHERE r.id = $1",
            )
            .bind(r.id)
            .fetch_one(&mut *conn)
            .await
            .map_err(db_error)?;
            let items: Vec<Item> = serde_json::from_value(items)
                .map_err(|e| AdminError::internal(format!("a stored evaluation set: {e}")))?;
            let done = outcomes(&mut conn, r.id.get())
                .await?
                .into_iter()
                .flat_map(|(id, items)| items.into_keys().map(move |i| (id, i)))
                .collect();
            work.push(EvaluationWork {
                rollout: r.id.get(),
                route_id: r.route_id.get(),
                tenant,
                model,
                items,
                seed: r.eval_seed.unwrap_or(0) as u64,
                stable: Arc::new(adapter(&mut conn, r.stable_lora_int_id).await?),
                candidate: Arc::new(adapter(&mut conn, r.candidate_lora_int_id).await?),
                done,
            });
        }
        Ok(work)
    }
}

/// The start of a rollout with an evaluation: its `evaluate` decision and
/// change row; no route revision, since no traffic moves yet.
pub(super) async fn begin(
    cx: &mut Cx<'_>,
    r: &Rollout,
    e: &EvalPlan,
    tenant: &str,
    model: &str,
) -> Result<RolloutView, AdminError> {
    let subject = cx.caller.subject.clone();
    let tx = cx.db().await?;
    let d = DecisionRow {
        what: Decision::Evaluate,
        step_index: 0,
        revision: None,
        actor: &subject,
        figures: None,
        reason: None,
    };
    decision(&mut *tx, r, d).await?;
    let v = super::view(&mut *tx, tenant, model, r.route_id.get())
        .await?
        .ok_or_else(|| AdminError::internal("the rollout vanished inside its transaction"))?;
    cx.record(
        &Decision::Evaluate.change_action(),
        ("route", &format!("{tenant}/{model}")),
        None,
        Some(json!({"rollout": r.id, "state": r.state.as_str(),
                    "candidate_lora_int_id": r.candidate_lora_int_id,
                    "eval_set": e.label, "min_score_delta": e.min_score_delta,
                    "eval_seed": e.seed})),
    );
    Ok(v)
}

/// An adapter version as a worker loads it.
async fn adapter(ex: &mut sqlx::PgConnection, id: i64) -> Result<Adapter, AdminError> {
    let stored: crate::registry::StoredAdapter = sqlx::query_as(sql!(
        "SELECT {} FROM adapters a JOIN base_models b ON b.id = a.base_model_id
         WHERE a.lora_int_id = $1",
        crate::registry::STORED_ADAPTER_COLUMNS
    ))
    .bind(id)
    .fetch_one(&mut *ex)
    .await
    .map_err(db_error)?;
    stored
        .into_adapter()
        .map_err(|column| AdminError::internal(format!("adapter {id}: a stored {column}")))
}

/// Records what `lora_int_id` did on one item, as the lease holder and
/// while the rollout is still evaluating; false when either no longer
/// holds (nothing is written). Recording an item twice keeps the first.
pub async fn record_outcome(
    s: &AdminState,
    holder: &str,
    rollout: Uuid,
    lora_int_id: i64,
    item: i32,
    outcome: &Outcome,
    request_ids: &[Uuid],
) -> Result<bool, AdminError> {
    // One statement: the conditions and the insert see one snapshot.
    let ours: bool = sqlx::query_scalar(
        "WITH ours AS (
             SELECT EXISTS (SELECT 1 FROM controller_leases
                            WHERE name = $1 AND holder = $2 AND expires_at > now())
                AND EXISTS (SELECT 1 FROM rollouts WHERE id = $3 AND state = 'evaluating') AS ours),
         written AS (
             INSERT INTO rollout_eval_results
                 (rollout_id, lora_int_id, item_index, correct, outcome, request_ids)
             SELECT $3, $4, $5, $6, $7, $8 FROM ours WHERE ours.ours
             ON CONFLICT DO NOTHING)
         SELECT ours FROM ours",
    )
    .bind(LEASE)
    .bind(holder)
    .bind(rollout)
    .bind(lora_int_id)
    .bind(item)
    .bind(outcome.correct())
    .bind(serde_json::to_value(outcome).map_err(AdminError::internal)?)
    .bind(request_ids)
    .fetch_one(&s.pool)
    .await
    .map_err(db_error)?;
    if !ours {
        return Ok(false);
    }
    metrics::counter!("lorafleet_gateway_rollout_eval_items_total",
        "correct" => if outcome.correct() { "true" } else { "false" })
    .increment(1);
    Ok(true)
}

/// A rejection: the rollout ends `rejected` with both scores, its
/// decision and change row.
async fn reject(
    cx: &mut Cx<'_>,
    r: &Rollout,
    object: &str,
    (stable, candidate): (f64, f64),
    reason: String,
    figures: Value,
) -> Result<(), AdminError> {
    let tx = cx.db().await?;
    sqlx::query(
        "UPDATE rollouts SET state = 'rejected', reason = $2, stable_score = $3,
                 candidate_score = $4, updated_at = now()
             WHERE id = $1",
    )
    .bind(r.id)
    .bind(&reason)
    .bind(stable)
    .bind(candidate)
    .execute(&mut *tx)
    .await
    .map_err(db_error)?;
    let d = DecisionRow {
        what: Decision::Reject,
        step_index: 0,
        revision: None,
        actor: CONTROLLER,
        figures: Some(figures.clone()),
        reason: Some(&reason),
    };
    decision(&mut *tx, r, d).await?;
    cx.record(
        &Decision::Reject.change_action(),
        ("route", object),
        Some(json!({"rollout": r.id, "state": RolloutState::Evaluating.as_str()})),
        Some(
            json!({"rollout": r.id, "state": RolloutState::Rejected.as_str(),
                        "figures": figures, "reason": reason}),
        ),
    );
    tracing::warn!(rollout = %r.id, route = %object, %reason, "rollout rejected");
    Ok(())
}

/// The controller's conclusion once both versions have every item
/// scored: the first step (a route revision, `route.rollout_start`) if the
/// candidate passes, else `rejected` (`route.rollout_reject`). None when
/// the lease is lost, the rollout is no longer evaluating, or an item is
/// still unscored.
#[derive(Debug)]
pub struct ConcludeEvaluation {
    pub holder: String,
    pub rollout: Uuid,
}

impl Command for ConcludeEvaluation {
    type Output = Option<Decision>;

    async fn run(self, cx: &mut Cx<'_>) -> Result<Option<Decision>, AdminError> {
        let tx = cx.db().await?;
        let r: Rollout = sqlx::query_as(sql!("SELECT {COLUMNS} FROM rollouts WHERE id = $1"))
            .bind(self.rollout)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
        let evaluating = |n: &Rollout| n.state == RolloutState::Evaluating;
        let Some((tenant, tenant_uuid, model, current)) =
            lock_as_judged(tx, &self.holder, &r, evaluating).await?
        else {
            return Ok(None);
        };
        let (set, items): (String, i32) = sqlx::query_as(
            "SELECT name || '@' || version, item_count FROM eval_sets WHERE id = $1",
        )
        .bind(r.eval_set_id)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
        let all = outcomes(tx, r.id.get()).await?;
        let right = |id: i64| -> Option<usize> {
            let o = all.get(&id)?;
            (o.len() == items as usize).then(|| o.values().filter(|(c, _)| *c).count())
        };
        let (Some(stable_right), Some(candidate_right)) =
            (right(r.stable_lora_int_id), right(r.candidate_lora_int_id))
        else {
            return Ok(None);
        };
        let n = items as usize;
        let (stable, candidate) = (
            score::score(stable_right, n),
            score::score(candidate_right, n),
        );
        let delta = r.min_score_delta.unwrap_or(0.0);
        let passed = score::passes(candidate, stable, delta, n);
        let figures = json!({"eval_set": set, "items": n, "stable_score": stable,
                             "candidate_score": candidate, "min_score_delta": delta});
        for (version, v) in [("stable", stable), ("candidate", candidate)] {
            metrics::gauge!("lorafleet_gateway_rollout_eval_score",
                "rollout" => r.id.to_string(), "version" => version)
            .set(v);
        }
        let object = format!("{tenant}/{model}");
        let scored = format!(
            "the candidate scored {candidate_right}/{n} on {set} against the stable version's \
             {stable_right}/{n}"
        );
        if !passed {
            let reason = format!("{scored}; it needed at least the stable's score {delta:+}");
            reject(cx, &r, &object, (stable, candidate), reason, figures).await?;
            return Ok(Some(Decision::Reject));
        }
        let weights = r.weights(r.share(0));
        let base_id = match check_weights(&mut *tx, &weights, None, tenant_uuid).await {
            Ok(id) => id,
            // Retired (say) while it was scored: it passed, but cannot
            // take traffic.
            Err(e) => {
                let reason = format!(
                    "{scored}, but it can no longer take traffic: {}",
                    e.message()
                );
                reject(cx, &r, &object, (stable, candidate), reason, figures).await?;
                return Ok(Some(Decision::Reject));
            }
        };
        let note = json!({"rollout": r.id, "decision": Decision::Start.as_str(), "step_index": 0,
                          "candidate_share_bp": r.share(0), "figures": figures});
        let route = write_revision(
            cx,
            &Decision::Start.change_action(),
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
            "UPDATE rollouts SET state = 'running', step_index = 0, step_started_at = now(),
                 stable_score = $2, candidate_score = $3, updated_at = now()
             WHERE id = $1",
        )
        .bind(r.id)
        .bind(stable)
        .bind(candidate)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        let d = DecisionRow {
            what: Decision::Start,
            step_index: 0,
            revision: Some(route.revision),
            actor: CONTROLLER,
            figures: Some(figures),
            reason: None,
        };
        decision(&mut *tx, &r, d).await?;
        tracing::info!(rollout = %r.id, route = %object, stable, candidate, "rollout passed its evaluation");
        Ok(Some(Decision::Start))
    }
}
