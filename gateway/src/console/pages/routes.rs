//! Routes: each tenant's routes with their weights as bars; one route's
//! revision history; set weights, promote and roll back, each sent with the
//! etag the page was rendered with, so a stale page shows the conflict
//! instead of overwriting someone else's change.

use super::*;
use crate::admin::types::{EvaluationView, RolloutSpec, RolloutView, RouteSpec, RouteView, Weight};
use crate::admin::{
    AdminCode, ChangeRollout, GetRollout, GetRoute, ListChanges, ListEvalSets, ListRoutes, Promote,
    PutRoute, Rollback, StartRollout, parse_etag,
};
use crate::rollout::Action;

pub(super) async fn list(State(c): State<Console>, s: Session) -> Response {
    let data = async {
        let routes = c.read(&s, ListRoutes::default()).await?;
        let mut routes: Vec<Value> = routes.routes.iter().map(view).collect();
        routes.sort_by(|a, b| {
            (a["tenant"].as_str(), a["model"].as_str())
                .cmp(&(b["tenant"].as_str(), b["model"].as_str()))
        });
        Ok(json!({ "routes": routes }))
    }
    .await;
    show(&c, &s, "routes.html", "routes", Outcome::default(), data)
}

/// Basis points as a percentage: "90%", or "0.25%".
fn share(bp: i64) -> String {
    if bp % 100 == 0 {
        format!("{}%", bp / 100)
    } else {
        format!("{:.2}%", bp as f64 / 100.0)
    }
}

/// A route with its weights laid out as bar segments.
fn view(r: &RouteView) -> Value {
    let mut offset = 0.0;
    let segments: Vec<Value> = r
        .weights
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let percent = f64::from(w.weight_bp) / 100.0;
            let seg = json!({
                "lora_int_id": w.lora_int_id,
                "label": format!("{}:v{}", w.adapter, w.version),
                "weight_bp": w.weight_bp,
                "percent": percent,
                "share": share(i64::from(w.weight_bp)),
                "offset": offset,
                "colour": i % 6,
            });
            offset += percent;
            seg
        })
        .collect();
    json!({
        "tenant": r.tenant,
        "model": r.model,
        "path": format!("{}/{}", seg(&r.tenant), seg(&r.model)),
        "revision": r.revision,
        "etag": r.etag.trim_matches('"'),
        "base_model": r.base_model,
        "target": r.target,
        "weights": segments,
        "updated_at": r.updated_at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        "created_by": r.created_by,
    })
}

pub(super) async fn page(
    State(c): State<Console>,
    s: Session,
    Path((tenant, model)): Path<(String, String)>,
) -> Response {
    render(&c, &s, &tenant, &model, Outcome::default()).await
}

async fn render(c: &Console, s: &Session, tenant: &str, model: &str, outcome: Outcome) -> Response {
    let data = async {
        let (tenant, model) = (tenant.to_owned(), model.to_owned());
        let route = c
            .read(
                s,
                GetRoute {
                    tenant: tenant.clone(),
                    model: model.clone(),
                },
            )
            .await?;
        // The history is the change log's, which auditors and admins read.
        let history = if s.identity.role.can_audit() {
            let q = ListChanges {
                object_type: Some("route".into()),
                object_id: Some(format!("{tenant}/{model}")),
                limit: Some(50),
            };
            let changes = c.read(s, q).await?;
            Some(
                changes
                    .changes
                    .iter()
                    .map(|ch| {
                        json!({
                            "at": ch.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                            "actor": ch.actor,
                            "action": ch.action,
                            "revision": ch.after.as_ref().and_then(|a| a.get("revision")).cloned(),
                            "weights": ch.after.as_ref().and_then(|a| a.get("weights")).cloned(),
                        })
                    })
                    .collect::<Vec<_>>(),
            )
        } else {
            None
        };
        // Its evaluation sets, every version.
        let evals = c
            .read(
                s,
                ListEvalSets {
                    tenant: tenant.clone(),
                    model: model.clone(),
                },
            )
            .await?
            .sets
            .iter()
            .map(|e| {
                json!({"set": format!("{}@{}", e.name, e.version), "items": e.items,
                       "multiple_choice": e.multiple_choice, "generation": e.generation,
                       "sha256": short(&e.sha256), "created_by": e.created_by})
            })
            .collect::<Vec<_>>();
        // The route's latest rollout, if it ever had one.
        let rollout = match c.read(s, GetRollout { tenant, model }).await {
            Ok(r) => Some(rollout_view(&r)),
            Err(e) if e.is(AdminCode::NotFound) => None,
            Err(e) => return Err(e),
        };
        Ok(
            json!({ "route": view(&route), "history": history, "rollout": rollout,
                   "evals": evals }),
        )
    }
    .await;
    show(c, s, "route.html", "routes", outcome, data)
}

/// A rollout as the route page shows it: its steps as shares, the current
/// one marked, and its latest decisions first.
fn rollout_view(r: &RolloutView) -> Value {
    let steps: Vec<Value> = r
        .steps
        .iter()
        .enumerate()
        .map(|(i, &bp)| json!({ "share": share(i64::from(bp)), "current": i as u32 == r.step_index }))
        .collect();
    let decisions: Vec<Value> = r
        .decisions
        .iter()
        .rev()
        .take(10)
        .map(|d| {
            json!({
                "at": d.at.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
                "decision": d.decision,
                "step": d.step_index,
                "actor": d.actor,
                "reason": d.reason,
            })
        })
        .collect();
    json!({
        "state": r.state,
        "active": matches!(r.state.as_str(), "evaluating" | "running" | "paused"),
        "evaluation": r.evaluation.as_ref().map(evaluation_view),
        "stable": r.stable_lora_int_id,
        "candidate": r.candidate_lora_int_id,
        "steps": steps,
        "hold_secs": r.hold_secs,
        "min_requests": r.min_requests,
        "max_error_rate_increase": r.max_error_rate_increase,
        "max_ttft_p95_ratio": r.max_ttft_p95_ratio,
        "max_tpot_p95_ratio": r.max_tpot_p95_ratio,
        "reason": r.reason,
        "created_by": r.created_by,
        "decisions": decisions,
    })
}

/// A rollout's evaluation as the route page shows it: the set, both
/// scores (or how far scoring has gone), and the items whose verdict the
/// candidate changed.
fn evaluation_view(e: &EvaluationView) -> Value {
    let verdict = |right: bool| if right { "right" } else { "wrong" };
    let score = |s: Option<f64>, done: i32| match s {
        Some(s) => format!("{:.1}%", 100.0 * s),
        None => format!("{done} of {} items scored", e.items),
    };
    let changed: Vec<Value> = e
        .changed
        .iter()
        .map(|c| {
            json!({
                "item": c.item_index,
                "stable": verdict(c.stable_correct),
                "candidate": verdict(c.candidate_correct),
                "detail": c.candidate.get("answer").and_then(Value::as_str).map(str::to_owned)
                    .or_else(|| c.candidate.get("chosen").map(|v| format!("chose {v}"))),
            })
        })
        .collect();
    json!({
        "set": e.set,
        "sha256": short(&e.sha256),
        "items": e.items,
        "min_score_delta": e.min_score_delta,
        "seed": e.seed,
        "stable_score": score(e.stable_score, e.stable_done),
        "candidate_score": score(e.candidate_score, e.candidate_done),
        "changed": changed,
    })
}

/// The etag the form was rendered with.
fn etag(fields: &Fields) -> Result<Option<i32>, ApiError> {
    Ok(parse_etag(non_blank(fields.get("etag")))?)
}

/// After a write: back to the route, or the route again with the refusal.
async fn finish(
    c: &Console,
    s: &Session,
    tenant: &str,
    model: &str,
    form: &'static str,
    fields: &Fields,
    result: Result<(), ApiError>,
) -> Response {
    match result {
        Ok(_) => {
            Redirect::to(&format!("/console/routes/{}/{}", seg(tenant), seg(model))).into_response()
        }
        Err(e) => render(c, s, tenant, model, Outcome::refused(form, e, Some(fields))).await,
    }
}

pub(super) async fn set_weights(
    State(c): State<Console>,
    Path((tenant, model)): Path<(String, String)>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let ids = fields.all("lora_int_id");
        let bps = fields.all("weight_bp");
        let mut weights = Vec::new();
        for (i, (id, bp)) in ids.iter().zip(bps.iter()).enumerate() {
            if id.is_empty() && bp.is_empty() {
                continue;
            }
            let n = weights.len();
            let id: i64 = id.parse().map_err(|_| {
                ApiError::field(
                    &format!("weights[{n}].lora_int_id"),
                    &format!("row {}: {id:?} is not an adapter id", i + 1),
                )
            })?;
            let bp: u32 = bp.parse().map_err(|_| {
                ApiError::field(
                    &format!("weights[{n}].weight_bp"),
                    &format!("row {}: {bp:?} is not a number of basis points", i + 1),
                )
            })?;
            weights.push(Weight {
                lora_int_id: id,
                weight_bp: bp,
            });
        }
        let spec = RouteSpec {
            base_model: non_blank(fields.get("base_model")).map(str::to_owned),
            weights,
        };
        let command = PutRoute {
            tenant: tenant.clone(),
            model: model.clone(),
            if_match: etag(&fields)?,
            spec,
        };
        c.exec(&s, command).await.map(drop)
    }
    .await;
    finish(&c, &s, &tenant, &model, "weights", &fields, result).await
}

pub(super) async fn promote(
    State(c): State<Console>,
    Path((tenant, model)): Path<(String, String)>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let id = number::<i64>(&fields, "lora_int_id")?
            .ok_or_else(|| ApiError::field("lora_int_id", "choose the version to promote"))?;
        let command = Promote {
            tenant: tenant.clone(),
            model: model.clone(),
            if_match: etag(&fields)?,
            lora_int_id: id,
        };
        c.exec(&s, command).await.map(drop)
    }
    .await;
    finish(&c, &s, &tenant, &model, "promote", &fields, result).await
}

pub(super) async fn rollback(
    State(c): State<Console>,
    Path((tenant, model)): Path<(String, String)>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let command = Rollback {
            tenant: tenant.clone(),
            model: model.clone(),
            if_match: etag(&fields)?,
        };
        c.exec(&s, command).await.map(drop)
    }
    .await;
    finish(&c, &s, &tenant, &model, "rollback", &fields, result).await
}

/// `POST …/rollout`: starts a progressive rollout of a candidate version.
pub(super) async fn start_rollout(
    State(c): State<Console>,
    Path((tenant, model)): Path<(String, String)>,
    Write { session: s, fields }: Write,
) -> Response {
    let result = async {
        let candidate = number::<i64>(&fields, "candidate_lora_int_id")?.ok_or_else(|| {
            ApiError::field("candidate_lora_int_id", "name the candidate version")
        })?;
        let steps = match non_blank(fields.get("steps")) {
            None => None,
            Some(steps) => Some(
                steps
                    .split(',')
                    .map(|p| p.trim().parse::<u32>())
                    .collect::<Result<Vec<u32>, _>>()
                    .map_err(|_| {
                        ApiError::field(
                            "steps",
                            &format!(
                                "{steps:?} is not a list of basis points such as 100,1000,10000"
                            ),
                        )
                    })?,
            ),
        };
        let spec = RolloutSpec {
            candidate_lora_int_id: candidate,
            steps,
            hold_secs: number(&fields, "hold_secs")?,
            min_requests: number(&fields, "min_requests")?,
            max_error_rate_increase: number(&fields, "max_error_rate_increase")?,
            max_ttft_p95_ratio: number(&fields, "max_ttft_p95_ratio")?,
            max_tpot_p95_ratio: number(&fields, "max_tpot_p95_ratio")?,
            eval: non_blank(fields.get("eval")).map(str::to_owned),
            min_score_delta: number(&fields, "min_score_delta")?,
            eval_seed: number(&fields, "eval_seed")?,
        };
        let command = StartRollout {
            tenant: tenant.clone(),
            model: model.clone(),
            if_match: etag(&fields)?,
            spec,
        };
        c.exec(&s, command).await.map(drop)
    }
    .await;
    finish(&c, &s, &tenant, &model, "rollout", &fields, result).await
}

/// `POST …/rollout/{pause,resume,abort}`.
pub(super) async fn change_rollout(
    State(c): State<Console>,
    Path((tenant, model, action)): Path<(String, String, String)>,
    Write { session: s, fields }: Write,
) -> Response {
    let action = match action.as_str() {
        "pause" => Some(Action::Pause),
        "resume" => Some(Action::Resume),
        "abort" => Some(Action::Abort),
        _ => None,
    };
    let result = match action {
        Some(action) => {
            let command = ChangeRollout {
                tenant: tenant.clone(),
                model: model.clone(),
                action,
            };
            c.exec(&s, command).await.map(drop)
        }
        None => Err(ApiError::local(
            StatusCode::NOT_FOUND,
            None,
            "the rollout action is not pause, resume or abort",
        )),
    };
    finish(&c, &s, &tenant, &model, "rollout", &fields, result).await
}
