//! Progressive rollouts with real processes: two gateway replicas (each
//! running the controller, one holding the lease), a worker on the fixture
//! model, Postgres and Redis, driven through `lorafleetctl`.

#[path = "support/admin_plane.rs"]
mod admin_plane;

use std::time::{Duration, Instant};

use admin_plane::*;
use serde_json::Value;

/// Loads both versions on the worker before a rollout, so that no
/// window's p95 holds a cold adapter load: a short 50/50 split, then v1
/// alone again. Needs the route's etag to be "1" (just created).
async fn warm(p: &Plane, key: &str, v1: i64, v2: i64) {
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &format!("{v1}=5000,{v2}=5000"),
        "--etag",
        &etag(p),
    ]);
    for i in 0..12 {
        p.complete(0, key, "support", &format!("warm-{i}")).await;
    }
    p.ctl_json(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &format!("{v1}=10000"),
        "--etag",
        &etag(p),
    ]);
}

fn etag(p: &Plane) -> String {
    p.ctl_json(&["routes", "get", "acme", "support"])["etag"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Starts a rollout. `latency_ratio` is both p95 latency gates: generous
/// where a test is not about latency, since a p95 over a handful of
/// requests on a shared machine is noise.
fn start(
    p: &Plane,
    candidate: i64,
    steps: &str,
    hold: &str,
    min: &str,
    latency_ratio: &str,
) -> Value {
    let etag = etag(p);
    p.ctl_json(&[
        "routes",
        "rollout",
        "start",
        "acme",
        "support",
        &candidate.to_string(),
        "--steps",
        steps,
        "--hold-secs",
        hold,
        "--min-requests",
        min,
        "--max-ttft-p95-ratio",
        latency_ratio,
        "--max-tpot-p95-ratio",
        latency_ratio,
        "--etag",
        &etag,
    ])
}

fn status(p: &Plane) -> Value {
    p.ctl_json(&["routes", "rollout", "status", "acme", "support"])
}

/// Sends traffic through `replica` (a new `user` each time, so the split
/// spreads) until the rollout is no longer running; returns its status.
async fn traffic_until_done(p: &Plane, replica: usize, key: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut i = 0;
    loop {
        for _ in 0..8 {
            i += 1;
            p.complete(replica, key, "support", &format!("user-{i}"))
                .await;
        }
        let s = status(p);
        if s["state"] != "running" {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "the rollout never ended: {s}\n{}",
            p.gateways[0].log_text()
        );
    }
}

fn decisions(s: &Value) -> Vec<(String, i64, String)> {
    s["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            (
                d["decision"].as_str().unwrap().to_owned(),
                d["step_index"].as_i64().unwrap(),
                d["actor"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn route_weights(p: &Plane) -> Vec<(i64, i64)> {
    p.ctl_json(&["routes", "get", "acme", "support"])["weights"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| {
            (
                w["lora_int_id"].as_i64().unwrap(),
                w["weight_bp"].as_i64().unwrap(),
            )
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_candidate_advances_through_every_step_to_all_traffic() {
    let p = plane("rollout_healthy").await;
    let (key, v1, v2) = acme_support(&p, "llama-gqa/o-r2");
    warm(&p, &key, v1, v2).await;
    let started = start(&p, v2, "2000,5000,10000", "2", "8", "100");
    assert_eq!(started["state"], "running", "{started}");
    let end = traffic_until_done(&p, 0, &key).await;
    assert_eq!(end["state"], "succeeded", "{end}");
    let controller = "rollout-controller".to_owned();
    assert_eq!(
        decisions(&end),
        [
            ("start".into(), 0, "alice".into()),
            ("advance".into(), 1, controller.clone()),
            ("succeed".into(), 2, controller),
        ]
    );
    assert_eq!(route_weights(&p), [(v2, 10000)]);
    // One revision per decision, each with its admin_changes row carrying
    // the figures it was taken on.
    let changes = p.ctl_json(&[
        "changes",
        "--object-type",
        "route",
        "--object-id",
        "acme/support",
    ]);
    let by_controller: Vec<&Value> = changes["changes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["actor"] == "rollout-controller")
        .collect();
    assert_eq!(by_controller.len(), 2, "{changes}");
    for c in by_controller {
        let figures = &c["after"]["rollout"]["figures"];
        assert!(
            figures["candidate"]["requests"].as_u64().unwrap() >= 8
                && figures["stable"]["requests"].as_u64().unwrap() >= 8,
            "{c}"
        );
        assert!(
            figures["candidate"]["ttft_p95_ms"].as_f64().is_some(),
            "{c}"
        );
    }
    let revisions: Vec<i64> = end["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["revision"].as_i64().unwrap())
        .collect();
    assert!(
        revisions.windows(2).all(|w| w[1] == w[0] + 1),
        "{revisions:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_candidate_is_rolled_back_within_one_window() {
    let p = plane("rollout_broken").await;
    // A candidate the registry accepts and every worker then refuses: its
    // weights change after registration, so the digest no longer matches.
    copy_dir(
        &p.root.path().join("llama-gqa/o-r2"),
        &p.root.path().join("llama-gqa/broken"),
    );
    let (key, v1, v2) = acme_support(&p, "llama-gqa/broken");
    let weights = p
        .root
        .path()
        .join("llama-gqa/broken/adapter_model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&weights, bytes).unwrap();
    // A long hold: only a failed gate can end this step.
    start(&p, v2, "2000,10000", "600", "5", "100");
    let began = Instant::now();
    let end = traffic_until_done(&p, 0, &key).await;
    assert!(began.elapsed() < Duration::from_secs(600));
    assert_eq!(end["state"], "rolled_back", "{end}");
    let reason = end["reason"].as_str().unwrap();
    assert!(reason.contains("error rate"), "{reason}");
    assert_eq!(
        decisions(&end).last().unwrap(),
        &("roll_back".into(), 0, "rollout-controller".into())
    );
    assert_eq!(route_weights(&p), [(v1, 10000)]);
    // The candidate took about its step's share (20%) until then, far from
    // all of it.
    let (candidate, total): (i64, i64) =
        sqlx::query_as("SELECT count(*) FILTER (WHERE lora_int_id = $1), count(*) FROM audit_log")
            .bind(v2)
            .fetch_one(&p.pool)
            .await
            .unwrap();
    assert!(
        candidate >= 5 && 4 * candidate < 3 * total,
        "{candidate} of {total} requests hit the candidate"
    );
    // From the rollback on (once the change has reached this replica, by
    // announcement), the broken candidate takes no request: every one is
    // answered.
    p.until_status(0, &key, "support", 200).await;
    for i in 0..10 {
        let (status, body) = p.complete(0, &key, "support", &format!("after-{i}")).await;
        assert_eq!(status, 200, "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_replica_takes_over_a_rollout_when_the_leader_dies() {
    let mut p = plane("rollout_failover").await;
    let (key, v1, v2) = acme_support(&p, "llama-gqa/o-r2");
    warm(&p, &key, v1, v2).await;
    let lease = || async {
        sqlx::query_scalar::<_, String>(
            "SELECT holder FROM controller_leases WHERE name = 'rollouts'",
        )
        .fetch_optional(&p.pool)
        .await
        .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let first = loop {
        if let Some(h) = lease().await {
            break h;
        }
        assert!(Instant::now() < deadline, "no replica took the lease");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Which replica leads: the one whose metrics say so.
    let leader = rollout_leader(&p).await;
    start(&p, v2, "2000,5000,10000", "2", "8", "100");
    p.gateways[leader].child.kill().unwrap();
    p.gateways[leader].child.wait().unwrap();
    // lorafleetctl and the traffic go to replica 0: make it the survivor.
    if leader == 0 {
        p.gateways.swap(0, 1);
    }
    let end = traffic_until_done(&p, 0, &key).await;
    assert_eq!(end["state"], "succeeded", "{end}");
    let second = lease().await.unwrap();
    assert_ne!(first, second, "the survivor holds the lease");
    let steps: Vec<i64> = decisions(&end).iter().map(|d| d.1).collect();
    assert_eq!(steps, [0, 1, 2], "no step taken twice: {end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_and_abort_do_what_they_say_and_manual_changes_wait_for_the_end() {
    let p = plane("rollout_pause").await;
    let (key, v1, v2) = acme_support(&p, "llama-gqa/o-r2");
    let first = etag(&p);
    p.ctl(&[
        "routes",
        "rollout",
        "start",
        "acme",
        "support",
        &v1.to_string(),
        "--etag",
        &first,
    ])
    .refused(6, "candidate_lora_int_id");
    start(&p, v2, "5000,10000", "1", "3", "100");
    let tag = etag(&p);
    p.ctl(&[
        "routes",
        "promote",
        "acme",
        "support",
        &v2.to_string(),
        "--etag",
        &tag,
    ])
    .refused(5, "rollout in progress");
    p.ctl(&["routes", "rollback", "acme", "support", "--etag", &tag])
        .refused(5, "rollout in progress");
    p.ctl(&[
        "routes",
        "set",
        "acme",
        "support",
        "--weights",
        &format!("{v1}=10000"),
        "--etag",
        &tag,
    ])
    .refused(5, "rollout in progress");
    p.ctl(&[
        "routes",
        "rollout",
        "start",
        "acme",
        "support",
        &v2.to_string(),
        "--etag",
        &tag,
    ])
    .refused(5, "rollout in progress");

    // Bad settings are refused by field (exit 6) or by flag (exit 2).
    let refuse = |extra: &[&str], code: i32, needle: &str| {
        let mut args = vec![
            "routes", "rollout", "start", "acme", "support", "--etag", &tag,
        ];
        args.extend_from_slice(extra);
        p.ctl(&args).refused(code, needle);
    };
    let v2s = v2.to_string();
    refuse(
        &[&v2s, "--hold-secs", "0"],
        6,
        "hold_secs: 0 must be between 1",
    );
    refuse(
        &[&v2s, "--steps", "10000"],
        6,
        "steps: give between 2 and 20",
    );
    refuse(
        &[&v2s, "--steps", "500,200,10000"],
        6,
        "steps[1]: 200 does not rise",
    );
    refuse(
        &[&v2s, "--min-requests", "0"],
        6,
        "min_requests: 0 must be between",
    );
    refuse(
        &[&v2s, "--max-ttft-p95-ratio", "0.5"],
        6,
        "max_ttft_p95_ratio: 0.5 must be between 1 and 100",
    );
    refuse(&[&v2s, "--steps", "half"], 2, "--steps");
    let paused = p.ctl_json(&["routes", "rollout", "pause", "acme", "support"]);
    assert_eq!(paused["state"], "paused");
    // Enough traffic and time for a step, yet no decision while paused.
    for i in 0..24 {
        p.complete(0, &key, "support", &format!("user-{i}")).await;
    }
    // Within a step (here 50/50), a user keeps to one version.
    for _ in 0..6 {
        p.complete(0, &key, "support", "sticky").await;
    }
    let versions: i64 = sqlx::query_scalar(
        "SELECT count(DISTINCT lora_int_id) FROM audit_log WHERE end_user = 'sticky'",
    )
    .fetch_one(&p.pool)
    .await
    .unwrap();
    assert_eq!(versions, 1, "a user's requests split across versions");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = status(&p);
    assert_eq!(
        (still["state"].as_str(), still["step_index"].as_i64()),
        (Some("paused"), Some(0)),
        "{still}"
    );
    p.ctl(&["routes", "rollout", "pause", "acme", "support"])
        .refused(5, "paused");
    assert_eq!(
        p.ctl_json(&["routes", "rollout", "resume", "acme", "support"])["state"],
        "running"
    );
    let aborted = p.ctl_json(&["routes", "rollout", "abort", "acme", "support"]);
    assert_eq!(aborted["state"], "aborted");
    let kinds: Vec<String> = decisions(&aborted).into_iter().map(|d| d.0).collect();
    assert_eq!(kinds, ["start", "pause", "resume", "abort"]);
    assert_eq!(route_weights(&p), [(v1, 10000)]);
    p.ctl(&["routes", "rollout", "abort", "acme", "support"])
        .refused(5, "no rollout in progress");
    // Over: manual changes are allowed again.
    let promoted = p.ctl_json(&[
        "routes",
        "promote",
        "acme",
        "support",
        &v2.to_string(),
        "--etag",
        &etag(&p),
    ]);
    assert_eq!(promoted["weights"][0]["lora_int_id"], v2);
}

/// A step that never gets enough requests is inconclusive: after ten hold
/// times the controller pauses the rollout for an operator, the weights
/// unchanged, rather than keep the candidate's share forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inconclusive_step_pauses_for_an_operator() {
    let p = plane("rollout_inconclusive").await;
    let (key, v1, v2) = acme_support(&p, "llama-gqa/o-r2");
    start(&p, v2, "5000,10000", "1", "1000", "100");
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    let end = loop {
        i += 1;
        p.complete(0, &key, "support", &format!("user-{i}")).await;
        let s = status(&p);
        if s["state"] != "running" {
            break s;
        }
        assert!(Instant::now() < deadline, "never paused: {s}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(end["state"], "paused", "{end}");
    let reason = end["reason"].as_str().unwrap();
    assert!(
        reason.contains("inconclusive") && reason.contains("of 1000 requests"),
        "{reason}"
    );
    assert_eq!(
        decisions(&end).last().unwrap(),
        &("pause".into(), 0, "rollout-controller".into())
    );
    let mut weights = route_weights(&p);
    weights.sort();
    assert_eq!(weights, [(v1, 5000), (v2, 5000)], "the step's weights stay");
}
