//! Progressive rollouts on a route: start, status, pause, resume and abort
//! from the admin API, and the controller's decisions (advance, succeed,
//! roll back). Every change of weights is a route revision written with its
//! `admin_changes` row; a decision's row carries the figures it was taken
//! on. While a rollout is in progress, manual weight changes are refused.

use super::*;
use crate::ids::{RolloutId, RouteId};
use crate::rollout::gates::{self, Figures, Gates};
use crate::rollout::{
    self, Action, CONTROLLER, Decision, INCONCLUSIVE_HOLDS, LEASE, State as RolloutState,
};

const DEFAULT_STEPS: [u32; 4] = [100, 1000, 5000, 10000];
const DEFAULT_HOLD_SECS: u32 = 300;
const MAX_HOLD_SECS: u32 = 7 * 24 * 3600;

#[derive(Debug, Clone, sqlx::FromRow)]
struct Rollout {
    id: RolloutId,
    route_id: RouteId,
    stable_lora_int_id: i64,
    candidate_lora_int_id: i64,
    steps_bp: Vec<i32>,
    hold_secs: i32,
    min_requests: i32,
    max_error_rate_increase: f64,
    max_ttft_p95_ratio: f64,
    max_tpot_p95_ratio: f64,
    step_index: i32,
    step_started_at: DateTime<Utc>,
    #[sqlx(try_from = "String")]
    state: RolloutState,
    reason: Option<String>,
    created_by: String,
    eval_set_id: Option<Uuid>,
    min_score_delta: Option<f64>,
    eval_seed: Option<i64>,
    stable_score: Option<f64>,
    candidate_score: Option<f64>,
    /// Seconds since the step began, by the database's clock (the one that
    /// set `step_started_at`), not this replica's.
    elapsed_secs: f64,
}

const COLUMNS: &str = "id, route_id, stable_lora_int_id, candidate_lora_int_id, steps_bp, \
    hold_secs, min_requests, max_error_rate_increase, max_ttft_p95_ratio, max_tpot_p95_ratio, \
    step_index, step_started_at, state::TEXT AS state, reason, created_by, eval_set_id, \
    min_score_delta, eval_seed, stable_score, candidate_score, \
    EXTRACT(EPOCH FROM now() - step_started_at)::FLOAT8 AS elapsed_secs";

impl Rollout {
    fn gates(&self) -> Gates {
        Gates {
            min_requests: self.min_requests as u64,
            max_error_rate_increase: self.max_error_rate_increase,
            max_ttft_p95_ratio: self.max_ttft_p95_ratio,
            max_tpot_p95_ratio: self.max_tpot_p95_ratio,
        }
    }

    fn share(&self, step: i32) -> u32 {
        self.steps_bp[step as usize] as u32
    }

    /// The route's weights with the candidate at `share` basis points.
    fn weights(&self, share: u32) -> Vec<Weight> {
        let mut w = vec![Weight {
            lora_int_id: self.candidate_lora_int_id,
            weight_bp: share,
        }];
        if share < registry::WEIGHT_TOTAL {
            w.push(Weight {
                lora_int_id: self.stable_lora_int_id,
                weight_bp: registry::WEIGHT_TOTAL - share,
            });
        }
        w.sort_by_key(|w| w.lora_int_id);
        w
    }

    fn stable_only(&self) -> Vec<Weight> {
        vec![Weight {
            lora_int_id: self.stable_lora_int_id,
            weight_bp: registry::WEIGHT_TOTAL,
        }]
    }
}

/// The rollout in progress on a route, if any.
async fn active(
    ex: &mut sqlx::PgConnection,
    route_id: Uuid,
    lock: bool,
) -> Result<Option<Rollout>, AdminError> {
    sqlx::query_as(sql!(
        "SELECT {COLUMNS} FROM rollouts WHERE route_id = $1 AND state IN ('evaluating', 'running', 'paused') {}",
        if lock { "FOR UPDATE" } else { "" }
    ))
    .bind(route_id)
    .fetch_optional(ex)
    .await
    .map_err(db_error)
}

/// Refuses a manual change of a route's weights while a rollout drives it.
pub(super) async fn refuse_during_rollout(
    ex: &mut sqlx::PgConnection,
    route_id: Uuid,
    tenant: &str,
    model: &str,
) -> Result<(), AdminError> {
    if active(ex, route_id, false).await?.is_some() {
        return Err(AdminError::conflict(
            AdminCode::RolloutActive,
            "model",
            format!(
                "route {tenant}/{model} has a rollout in progress; abort it first \
                 (lorafleetctl routes rollout abort {tenant} {model})"
            ),
        ));
    }
    Ok(())
}

/// One row of `rollout_decisions`.
struct DecisionRow<'a> {
    what: Decision,
    step_index: i32,
    revision: Option<i32>,
    actor: &'a str,
    figures: Option<Value>,
    reason: Option<&'a str>,
}

async fn decision(
    tx: &mut sqlx::PgConnection,
    r: &Rollout,
    d: DecisionRow<'_>,
) -> Result<(), AdminError> {
    sqlx::query(
        "INSERT INTO rollout_decisions (rollout_id, decision, step_index, revision, actor, figures, reason)
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(r.id)
    .bind(d.what.as_str())
    .bind(d.step_index)
    .bind(d.revision)
    .bind(d.actor)
    .bind(d.figures)
    .bind(d.reason)
    .execute(&mut *tx)
    .await
    .map_err(db_error)?;
    metrics::counter!("lorafleet_gateway_rollout_decisions_total", "decision" => d.what.as_str())
        .increment(1);
    Ok(())
}

/// The route's latest rollout with its decisions.
async fn view(
    ex: &mut sqlx::PgConnection,
    tenant: &str,
    model: &str,
    route_id: Uuid,
) -> Result<Option<RolloutView>, AdminError> {
    let r: Option<Rollout> = sqlx::query_as(sql!(
        "SELECT {COLUMNS} FROM rollouts WHERE route_id = $1 ORDER BY created_at DESC, id LIMIT 1"
    ))
    .bind(route_id)
    .fetch_optional(&mut *ex)
    .await
    .map_err(db_error)?;
    let Some(r) = r else { return Ok(None) };
    let evaluation = evaluation::view(&mut *ex, &r).await?;
    let decisions: Vec<RolloutDecision> = sqlx::query_as(
        "SELECT at, decision, step_index, revision, actor, figures, reason
         FROM rollout_decisions WHERE rollout_id = $1 ORDER BY id",
    )
    .bind(r.id)
    .fetch_all(&mut *ex)
    .await
    .map_err(db_error)?;
    Ok(Some(RolloutView {
        id: r.id.get(),
        tenant: tenant.to_owned(),
        model: model.to_owned(),
        state: r.state.as_str().to_owned(),
        stable_lora_int_id: r.stable_lora_int_id,
        candidate_lora_int_id: r.candidate_lora_int_id,
        steps: r.steps_bp.iter().map(|&s| s as u32).collect(),
        step_index: r.step_index as u32,
        step_started_at: r.step_started_at,
        hold_secs: r.hold_secs as u32,
        min_requests: r.min_requests as u32,
        max_error_rate_increase: r.max_error_rate_increase,
        max_ttft_p95_ratio: r.max_ttft_p95_ratio,
        max_tpot_p95_ratio: r.max_tpot_p95_ratio,
        reason: r.reason,
        evaluation,
        created_by: r.created_by,
        decisions,
    }))
}

fn no_route(tenant: &str, model: &str) -> AdminError {
    AdminError::not_found("model", format!("route {tenant}/{model}"))
}

/// A rollout's steps, gates and hold time from its spec, defaults filled
/// in, each refused by field.
fn plan(spec: &RolloutSpec) -> Result<(Vec<u32>, Gates, u32), AdminError> {
    let steps = spec.steps.clone().unwrap_or_else(|| DEFAULT_STEPS.to_vec());
    gates::check_steps(&steps).map_err(|(f, m)| AdminError::field(f, m))?;
    let defaults = Gates::default();
    let g = Gates {
        min_requests: spec.min_requests.map_or(defaults.min_requests, u64::from),
        max_error_rate_increase: spec
            .max_error_rate_increase
            .unwrap_or(defaults.max_error_rate_increase),
        max_ttft_p95_ratio: spec
            .max_ttft_p95_ratio
            .unwrap_or(defaults.max_ttft_p95_ratio),
        max_tpot_p95_ratio: spec
            .max_tpot_p95_ratio
            .unwrap_or(defaults.max_tpot_p95_ratio),
    };
    gates::check_gates(&g).map_err(|(f, m)| AdminError::field(f, m))?;
    let hold = spec.hold_secs.unwrap_or(DEFAULT_HOLD_SECS);
    if hold == 0 || hold > MAX_HOLD_SECS {
        return Err(AdminError::field(
            "hold_secs",
            format!("{hold} must be between 1 and {MAX_HOLD_SECS}"),
        ));
    }
    Ok((steps, g, hold))
}

/// A progressive rollout started on a route that sends all its traffic to
/// one version: the candidate takes the first step's share at once.
#[derive(Debug)]
pub struct StartRollout {
    pub tenant: String,
    pub model: String,
    pub if_match: Option<i32>,
    pub spec: RolloutSpec,
}

impl Command for StartRollout {
    type Output = RolloutView;

    async fn run(self, cx: &mut Cx<'_>) -> Result<RolloutView, AdminError> {
        let StartRollout {
            tenant,
            model,
            if_match: sent,
            spec,
        } = self;
        let (steps, g, hold) = plan(&spec)?;
        let subject = cx.caller.subject.clone();
        let tx = cx.db().await?;
        let (tenant_uuid, route_id, current) = route_to_change(tx, &tenant, &model, sent).await?;
        let stable = match current.weights.as_slice() {
            [w] if w.weight_bp == registry::WEIGHT_TOTAL as i32 => w.lora_int_id,
            other => {
                return Err(AdminError::conflict(
                    AdminCode::RolloutNeedsOneVersion,
                    "model",
                    format!(
                        "route {tenant}/{model} sends its traffic to {} adapter versions; a rollout starts \
                     from a route on exactly one (promote one first)",
                        other.len()
                    ),
                ));
            }
        };
        if spec.candidate_lora_int_id == stable {
            return Err(AdminError::field(
                "candidate_lora_int_id",
                format!("{stable} already takes all of route {tenant}/{model}"),
            ));
        }
        let eval = evaluation::plan(&mut *tx, route_id, &spec).await?;
        let mut r = Rollout {
            id: RolloutId(Uuid::nil()),
            route_id: RouteId(route_id),
            stable_lora_int_id: stable,
            candidate_lora_int_id: spec.candidate_lora_int_id,
            steps_bp: steps.iter().map(|&s| s as i32).collect(),
            hold_secs: hold as i32,
            min_requests: g.min_requests as i32,
            max_error_rate_increase: g.max_error_rate_increase,
            max_ttft_p95_ratio: g.max_ttft_p95_ratio,
            max_tpot_p95_ratio: g.max_tpot_p95_ratio,
            step_index: 0,
            step_started_at: Utc::now(),
            state: if eval.is_some() {
                RolloutState::Evaluating
            } else {
                RolloutState::Running
            },
            reason: None,
            created_by: subject.clone(),
            eval_set_id: eval.as_ref().map(|e| e.set_id),
            min_score_delta: eval.as_ref().map(|e| e.min_score_delta),
            eval_seed: eval.as_ref().map(|e| e.seed),
            stable_score: None,
            candidate_score: None,
            elapsed_secs: 0.0,
        };
        // The candidate is checked as the first step would send it traffic,
        // also when an evaluation comes first.
        let weights = r.weights(steps[0]);
        let base_id = check_weights(&mut *tx, &weights, None, tenant_uuid)
            .await
            .map_err(|mut e| {
                if e.param
                    .as_deref()
                    .is_some_and(|p| p.starts_with("weights["))
                {
                    e.param = Some("candidate_lora_int_id".into());
                }
                e
            })?;
        r.id = insert(&mut *tx, &r).await?;
        if let Some(e) = &eval {
            // No traffic moves yet: the controller scores both versions
            // first, then starts the steps or rejects the candidate.
            return evaluation::begin(cx, &r, e, &tenant, &model).await;
        }
        let note = json!({"rollout": r.id, "decision": Decision::Start.as_str(), "step_index": 0,
                      "candidate_share_bp": steps[0]});
        let route = write_revision(
            cx,
            &Decision::Start.change_action(),
            &tenant,
            &model,
            Some((route_id, current)),
            base_id,
            &weights,
            Some(note),
        )
        .await?;
        let start = DecisionRow {
            what: Decision::Start,
            step_index: 0,
            revision: Some(route.revision),
            actor: &subject,
            figures: None,
            reason: None,
        };
        let tx = cx.db().await?;
        decision(&mut *tx, &r, start).await?;
        view(&mut *tx, &tenant, &model, route_id)
            .await?
            .ok_or_else(|| AdminError::internal("the rollout vanished inside its transaction"))
    }
}

/// Inserts a new rollout; its id.
async fn insert(tx: &mut sqlx::PgConnection, r: &Rollout) -> Result<RolloutId, AdminError> {
    sqlx::query_scalar(
        "INSERT INTO rollouts (route_id, stable_lora_int_id, candidate_lora_int_id, steps_bp,
             hold_secs, min_requests, max_error_rate_increase, max_ttft_p95_ratio,
             max_tpot_p95_ratio, created_by, state, eval_set_id, min_score_delta, eval_seed)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::rollout_state, $12, $13, $14)
         RETURNING id",
    )
    .bind(r.route_id)
    .bind(r.stable_lora_int_id)
    .bind(r.candidate_lora_int_id)
    .bind(&r.steps_bp)
    .bind(r.hold_secs)
    .bind(r.min_requests)
    .bind(r.max_error_rate_increase)
    .bind(r.max_ttft_p95_ratio)
    .bind(r.max_tpot_p95_ratio)
    .bind(&r.created_by)
    .bind(r.state.as_str())
    .bind(r.eval_set_id)
    .bind(r.min_score_delta)
    .bind(r.eval_seed)
    .fetch_one(&mut *tx)
    .await
    .map_err(db_error)
}

/// A route's latest rollout, with its decisions.
#[derive(Debug)]
pub struct GetRollout {
    pub tenant: String,
    pub model: String,
}

impl Query for GetRollout {
    type Output = RolloutView;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<RolloutView, AdminError> {
        let GetRollout { tenant, model } = self;
        let mut conn = s.pool.acquire().await.map_err(db_error)?;
        let (route_id, _) = load_route(&mut conn, &tenant, &model, false)
            .await?
            .ok_or_else(|| no_route(&tenant, &model))?;
        view(&mut conn, &tenant, &model, route_id)
            .await?
            .ok_or_else(|| AdminError::not_found("model", format!("a rollout on {tenant}/{model}")))
    }
}

/// An operator's pause, resume or abort of the rollout in progress.
#[derive(Debug)]
pub struct ChangeRollout {
    pub tenant: String,
    pub model: String,
    pub action: Action,
}

impl Command for ChangeRollout {
    type Output = RolloutView;

    async fn run(self, cx: &mut Cx<'_>) -> Result<RolloutView, AdminError> {
        let ChangeRollout {
            tenant,
            model,
            action,
        } = self;
        let subject = cx.caller.subject.clone();
        let tx = cx.db().await?;
        let tenant_uuid = tenant_id(&mut *tx, &tenant, "tenant").await?;
        let (route_id, current) = load_route(&mut *tx, &tenant, &model, true)
            .await?
            .ok_or_else(|| no_route(&tenant, &model))?;
        let r = active(&mut *tx, route_id, true).await?.ok_or_else(|| {
            AdminError::conflict(
                AdminCode::NoActiveRollout,
                "model",
                format!("route {tenant}/{model} has no rollout in progress"),
            )
        })?;
        let what = action.decision_from(r.state).ok_or_else(|| {
            AdminError::conflict(
                AdminCode::NoActiveRollout,
                "model",
                format!(
                    "the rollout on {tenant}/{model} is {}; it cannot {action}",
                    r.state
                ),
            )
        })?;
        let before = json!({"state": r.state.as_str(), "step_index": r.step_index});
        let object = format!("{tenant}/{model}");
        let revision = match what {
            // An evaluation moved no traffic: there is none to send back.
            Decision::Abort if r.state != RolloutState::Evaluating => {
                let weights = r.stable_only();
                let base_id = check_weights(&mut *tx, &weights, None, tenant_uuid).await?;
                let note =
                    json!({"rollout": r.id, "decision": what.as_str(), "step_index": r.step_index});
                let route = write_revision(
                    cx,
                    &what.change_action(),
                    &tenant,
                    &model,
                    Some((route_id, current)),
                    base_id,
                    &weights,
                    Some(note),
                )
                .await?;
                Some(route.revision)
            }
            _ => None,
        };
        let state = what.state_after();
        let reason = (what == Decision::Abort).then(|| format!("aborted by {subject}"));
        let tx = cx.db().await?;
        sqlx::query(
            "UPDATE rollouts SET state = $2::rollout_state, reason = coalesce($3, reason),
             step_started_at = CASE WHEN $4 THEN now() ELSE step_started_at END,
             updated_at = now()
         WHERE id = $1",
        )
        .bind(r.id)
        .bind(state.as_str())
        .bind(&reason)
        // A resumed step's window starts again: figures from before the pause
        // are not the step's.
        .bind(what == Decision::Resume)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        let d = DecisionRow {
            what,
            step_index: r.step_index,
            revision,
            actor: &subject,
            figures: None,
            reason: reason.as_deref(),
        };
        decision(&mut *tx, &r, d).await?;
        let v = view(&mut *tx, &tenant, &model, route_id)
            .await?
            .ok_or_else(|| AdminError::internal("the rollout vanished inside its transaction"))?;
        if revision.is_none() {
            let after = json!({"state": state.as_str(), "step_index": r.step_index});
            cx.record(
                &what.change_action(),
                ("route", &object),
                Some(before),
                Some(after),
            );
        }
        Ok(v)
    }
}

mod controller;
mod evaluation;

pub use controller::WINDOW_SQL;
pub use evaluation::{ConcludeEvaluation, EvaluationWork, record_outcome};
