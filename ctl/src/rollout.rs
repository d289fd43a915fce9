//! Progressive rollouts on a route.

use super::*;
use lorafleet_admin_types::*;

fn show_rollout(c: &Client, r: &RolloutView) {
    let body = as_json(r);
    if c.output == Output::Json {
        println!("{body}");
        return;
    }
    let step = r.steps.get(r.step_index as usize).copied().unwrap_or(0);
    println!("route        {}/{}", r.tenant, r.model);
    println!("state        {}", r.state);
    println!(
        "versions     stable {} -> candidate {}",
        r.stable_lora_int_id, r.candidate_lora_int_id
    );
    println!(
        "step         {} of {} (candidate at {step} bp; steps {:?}; hold {} s)",
        r.step_index + 1,
        r.steps.len(),
        r.steps,
        r.hold_secs
    );
    println!(
        "gates        min {} requests; error rate +{:.2} points; p95 TTFT x{}; p95 TPOT x{}",
        r.min_requests,
        100.0 * r.max_error_rate_increase,
        r.max_ttft_p95_ratio,
        r.max_tpot_p95_ratio
    );
    if let Some(e) = &r.evaluation {
        show_evaluation(e);
    }
    if let Some(reason) = &r.reason {
        println!("reason       {reason}");
    }
    println!();
    let rows: Vec<Vec<String>> = r
        .decisions
        .iter()
        .map(|d| {
            let fig = |who: &str| {
                d.figures.as_ref().map_or("-".into(), |f| {
                    if let Some(score) = f.get(format!("{who}_score")) {
                        return format!("score {}", cell(score));
                    }
                    let f = &f[who];
                    format!(
                        "{} req, {} err, ttft {} ms, tpot {} ms",
                        cell(&f["requests"]),
                        cell(&f["errors"]),
                        cell(&f["ttft_p95_ms"]),
                        cell(&f["tpot_p95_ms"])
                    )
                })
            };
            vec![
                d.at.to_rfc3339(),
                d.decision.clone(),
                d.step_index.to_string(),
                d.revision.map_or("-".into(), |r| r.to_string()),
                d.actor.clone(),
                fig("candidate"),
                fig("stable"),
                d.reason.clone().unwrap_or_default(),
            ]
        })
        .collect();
    table(
        &[
            "at",
            "decision",
            "step",
            "revision",
            "actor",
            "candidate",
            "stable",
            "reason",
        ],
        &rows,
    );
}

fn show_evaluation(e: &EvaluationView) {
    let score = |s: Option<f64>| s.map_or("-".into(), |s| format!("{s:.4}"));
    println!(
        "evaluation   {} ({} items, sha256 {}…); seed {}; min score delta {:+}",
        e.set,
        e.items,
        &e.sha256[..12.min(e.sha256.len())],
        e.seed,
        e.min_score_delta
    );
    println!(
        "scores       stable {} ({}/{} items scored), candidate {} ({}/{} items scored)",
        score(e.stable_score),
        e.stable_done,
        e.items,
        score(e.candidate_score),
        e.candidate_done,
        e.items
    );
    if !e.changed.is_empty() {
        let rows: Vec<Vec<String>> = e
            .changed
            .iter()
            .map(|c| {
                let right = |r: bool| if r { "right" } else { "wrong" }.to_owned();
                vec![
                    c.item_index.to_string(),
                    right(c.stable_correct),
                    right(c.candidate_correct),
                ]
            })
            .collect();
        println!("changed items:");
        table(&["item", "stable", "candidate"], &rows);
    }
}

pub(crate) async fn rollout(c: &Client, cmd: RolloutCmd) -> Result<(), Failure> {
    let path =
        |tenant: &str, model: &str, op: &str| format!("{}/rollout{op}", route_path(tenant, model));
    let view: RolloutView = match cmd {
        RolloutCmd::Start {
            tenant,
            model,
            candidate,
            steps,
            hold_secs,
            min_requests,
            max_error_rate_increase,
            max_ttft_p95_ratio,
            max_tpot_p95_ratio,
            eval,
            min_score_delta,
            eval_seed,
            etag,
        } => {
            let spec = RolloutSpec {
                candidate_lora_int_id: candidate,
                steps: Some(steps),
                hold_secs: Some(hold_secs),
                min_requests: Some(min_requests),
                max_error_rate_increase: Some(max_error_rate_increase),
                max_ttft_p95_ratio: Some(max_ttft_p95_ratio),
                max_tpot_p95_ratio: Some(max_tpot_p95_ratio),
                eval,
                min_score_delta,
                eval_seed,
            };
            c.call_as(
                reqwest::Method::POST,
                &path(&tenant, &model, ""),
                Some(&spec),
                Some(&etag),
            )
            .await?
        }
        RolloutCmd::Status { tenant, model } => c.get_as(&path(&tenant, &model, ""), &[]).await?,
        RolloutCmd::Pause { tenant, model } => post(c, &path(&tenant, &model, "/pause")).await?,
        RolloutCmd::Resume { tenant, model } => post(c, &path(&tenant, &model, "/resume")).await?,
        RolloutCmd::Abort { tenant, model } => post(c, &path(&tenant, &model, "/abort")).await?,
    };
    show_rollout(c, &view);
    Ok(())
}

async fn post(c: &Client, path: &str) -> Result<RolloutView, Failure> {
    c.call_as(reqwest::Method::POST, path, None::<&Value>, None)
        .await
}
