//! The audit fault suite: real gateway and worker processes, real Postgres
//! (behind a proxy the test cuts), and an exact count at the end: the set of
//! request ids answered to clients against the rows in `audit_log`.
//!
//! Every scenario interleaves traffic from two tenants. The gateways log in
//! as a member of `lorafleet_runtime`, so the suite also proves that the
//! least-privileged role is enough to serve.

#[path = "support/audit_env.rs"]
mod audit_env;

use std::collections::{BTreeMap, HashSet};
use std::time::{Duration, Instant};

use audit_env::*;
use lorafleet_tests::{rss_kib, signal};
use serde_json::json;
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_is_refused_by_field_and_never_blocks_good_rows() {
    let e = env("audit_poison").await;
    let gw = e.gateway(&["--max-body-bytes", "4194304"]).await;
    let mib = "a".repeat(1 << 20);
    // (raw body, the field the 400 must name)
    let poisons: Vec<(Vec<u8>, &str)> = vec![
        (br#"{"model": "x\u0000y", "prompt": "p"}"#.to_vec(), "model"),
        (
            br#"{"model": "chat", "prompt": "p", "user": "a\u0000b"}"#.to_vec(),
            "user",
        ),
        (
            br#"{"model": "chat\u0007", "prompt": "p"}"#.to_vec(),
            "model",
        ),
        (
            br#"{"model": "chat", "prompt": "p", "user": "line\nbreak\u001b[31m"}"#.to_vec(),
            "user",
        ),
        (br#"{"model": "x\ud800y", "prompt": "p"}"#.to_vec(), "model"),
        (
            br#"{"model": "chat", "prompt": "p", "user": "\udfff"}"#.to_vec(),
            "user",
        ),
        (
            json!({"model": mib, "prompt": "p"})
                .to_string()
                .into_bytes(),
            "model",
        ),
        (
            json!({"model": "chat", "prompt": "p", "user": mib})
                .to_string()
                .into_bytes(),
            "user",
        ),
    ];
    let total = 1000 + poisons.len() * 10;
    let mut answered = HashSet::new();
    let mut poisoned = BTreeMap::new();
    let mut i = 0;
    let mut batch = Vec::new();
    while i < total {
        let http = e.http.clone();
        let url = gw.url.clone();
        let key = KEYS[i % 2];
        // Every 101st request is poison, the rest normal.
        let (body, field) = if i % 101 == 100 {
            let (b, f) = &poisons[(i / 101) % poisons.len()];
            (b.clone(), Some(*f))
        } else {
            (normal(i), None)
        };
        batch.push(tokio::spawn(async move {
            (post(&http, &url, key, body).await, field)
        }));
        i += 1;
        if batch.len() == 16 || i == total {
            for h in batch.drain(..) {
                let (a, field) = h.await.unwrap();
                answered.insert(a.id);
                match field {
                    None => assert_eq!(a.status, 200, "{}", a.body),
                    Some(f) => {
                        assert_eq!(a.status, 400, "{f}: {}", a.body);
                        assert_eq!(a.body["error"]["param"], f, "{}", a.body);
                        poisoned.insert(a.id, f);
                    }
                }
            }
        }
    }
    assert!(poisoned.len() >= 9, "{}", poisoned.len());
    e.expect_rows(&answered, &gw).await;
    // Poisoned rows record the refusal, with a safe rendering.
    type Row = (Uuid, String, Option<String>, String, Option<String>);
    let rows: Vec<Row> = sqlx::query_as(
        "SELECT request_id, model_name, end_user, status::text, error_code FROM audit_log",
    )
    .fetch_all(&e.pool)
    .await
    .unwrap();
    for (id, model, user, status, code) in rows {
        let text = format!("{model} {}", user.clone().unwrap_or_default());
        assert!(!text.chars().any(char::is_control), "{id}: {text:?}");
        assert!(model.len() <= 600 && user.as_ref().is_none_or(|u| u.len() <= 600));
        if poisoned.contains_key(&id) {
            assert_eq!(status, "rejected");
            assert_eq!(code.as_deref(), Some("invalid_request"));
        } else {
            assert_eq!(status, "ok", "{id}");
            assert!(user.unwrap().starts_with("user-"));
        }
    }
    assert!(
        e.dead_letters().await.is_empty(),
        "nothing needed quarantine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_loses_no_row_and_memory_stays_bounded() {
    let e = env("audit_outage").await;
    let gw = e.gateway(&[]).await;
    let pid = gw.server.child.id();
    let run = |secs: u64| {
        let (http, url) = (e.http.clone(), gw.url.clone());
        async move {
            let stop = Instant::now() + Duration::from_secs(secs);
            let mut tasks = Vec::new();
            for c in 0..4 {
                let (http, url) = (http.clone(), url.clone());
                tasks.push(tokio::spawn(async move {
                    let mut out = Vec::new();
                    let mut i = c;
                    while Instant::now() < stop {
                        let t = Instant::now();
                        let a = post(&http, &url, KEYS[i % 2], normal(i)).await;
                        out.push((a, t.elapsed()));
                        i += 4;
                    }
                    out
                }));
            }
            let mut all = Vec::new();
            for t in tasks {
                all.extend(t.await.unwrap());
            }
            all
        }
    };
    let mut answered = HashSet::new();
    let before = run(3).await;
    let mut before_lat: Vec<Duration> = before.iter().map(|(_, d)| *d).collect();
    answered.extend(before.iter().map(|(a, _)| a.id));

    e.pg.cut();
    let sampler = tokio::spawn(async move {
        let mut peak = 0;
        for _ in 0..70 {
            peak = peak.max(rss_kib(pid));
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        peak
    });
    let during = run(30).await;
    e.pg.restore();
    let peak_kib = sampler.await.unwrap();
    for (a, _) in &during {
        assert_eq!(a.status, 200, "{}", a.body);
    }
    let mut during_lat: Vec<Duration> = during.iter().map(|(_, d)| *d).collect();
    answered.extend(during.iter().map(|(a, _)| a.id));
    assert!(during.len() > 100, "steady load: {} requests", during.len());
    e.expect_rows(&answered, &gw).await;
    println!(
        "outage: {} requests before (p50 {:?}, p99 {:?}), {} during the 30 s outage \
         (p50 {:?}, p99 {:?}); peak RSS {} MiB",
        before.len(),
        percentile(&mut before_lat, 0.5),
        percentile(&mut before_lat, 0.99),
        during.len(),
        percentile(&mut during_lat, 0.5),
        percentile(&mut during_lat, 0.99),
        peak_kib / 1024
    );
    // The bound: the queue's 64 MiB of bytes can never be reached by rows
    // this small, so the process stays near its idle size.
    assert!(peak_kib < 256 * 1024, "peak RSS {} MiB", peak_kib / 1024);
    // The spool was used, and is empty again.
    let deadline = Instant::now() + Duration::from_secs(30);
    while segments(e.spool.path()) > 0 {
        assert!(Instant::now() < deadline, "the spool was never emptied");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_during_an_outage_loses_no_answered_row() {
    let e = env("audit_crash").await;
    let mut gw = e.gateway(&[]).await;
    let mut answered = HashSet::new();
    for i in 0..20 {
        let a = post(&e.http, &gw.url, KEYS[i % 2], normal(i)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        answered.insert(a.id);
    }
    e.pg.cut();
    // Load in flight while the process dies: some requests get no answer.
    let mut tasks = Vec::new();
    for c in 0..6 {
        let (http, url) = (e.http.clone(), gw.url.clone());
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            for i in 0.. {
                let r = http
                    .post(format!("{url}/v1/completions"))
                    .bearer_auth(KEYS[(c + i) % 2])
                    .body(normal(i))
                    .header("content-type", "application/json")
                    .send()
                    .await;
                match r {
                    Ok(r) if r.status() == 200 => {
                        let id: Uuid = r.headers()["x-request-id"]
                            .to_str()
                            .unwrap()
                            .parse()
                            .unwrap();
                        // The body must arrive whole for it to count as answered.
                        if r.text().await.is_ok() {
                            got.push(id);
                        }
                    }
                    Ok(r) => panic!("status {}", r.status()),
                    Err(_) => break,
                }
            }
            got
        }));
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    gw.server.child.kill().unwrap();
    gw.server.child.wait().unwrap();
    let mut during = 0;
    for t in tasks {
        let got = t.await.unwrap();
        during += got.len();
        answered.extend(got);
    }
    assert!(during > 20, "{during} answered during the outage");
    e.pg.restore();
    let spooled = segments(e.spool.path());
    assert!(spooled > 0, "the outage's rows were spooled");
    // Restarted on the same spool: it replays the dead process's rows.
    let gw = e.gateway(&[]).await;
    // Rows of requests that never got an answer may or may not be there.
    e.expect_rows_of(&answered, &gw, true).await;
    let total = e.rows().await.len();
    println!(
        "crash: {} answered, {} rows ({} of requests cut off by the kill)",
        answered.len(),
        total,
        total - answered.len()
    );
}

/// With `--audit-durability journal` an answer waits for its row's fsync
/// in the journal, not for Postgres: while Postgres hangs, answers keep
/// coming, their rows are not in `audit_log` yet, and a SIGKILL before any
/// insert commits loses none of them (the restarted gateway replays the
/// journal, each row once). In calm water the journal leaves no segment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journaled_answers_survive_a_kill_before_their_insert() {
    let e = env("audit_journal").await;
    let journal = ["--audit-durability", "journal"];
    let mut gw = e.gateway(&journal).await;
    let mut answered = HashSet::new();
    for i in 0..10 {
        let a = post(&e.http, &gw.url, KEYS[i % 2], normal(i)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        answered.insert(a.id);
    }
    e.expect_rows(&answered, &gw).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while segments(e.spool.path()) > 0 {
        assert!(
            Instant::now() < deadline,
            "journal segments whose rows are all in Postgres were never removed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    e.pg.stall();
    let mut during = HashSet::new();
    for i in 10..30 {
        let a = post(&e.http, &gw.url, KEYS[i % 2], normal(i)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        during.insert(a.id);
    }
    let landed: HashSet<Uuid> = e.rows().await.into_iter().map(|r| r.0).collect();
    assert!(
        landed.is_disjoint(&during),
        "rows answered while Postgres hangs cannot have been committed"
    );
    let metrics = e
        .http
        .get(format!("http://{}/metrics", gw.server.addr("metrics")))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let journaled: f64 = metrics
        .lines()
        .find(|l| l.starts_with("lorafleet_gateway_audit_rows_total{to=\"journal\"}"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no journal counter in {metrics}"));
    // The warm-up's rows, and at least the first of the stall's (the
    // breaker may open once an insert fails; later rows are then spooled,
    // as in any outage).
    assert!(
        journaled >= 11.0,
        "{journaled} rows journaled: {metrics}\n{}",
        gw.server.log_text()
    );
    gw.server.child.kill().unwrap();
    gw.server.child.wait().unwrap();
    assert!(segments(e.spool.path()) > 0, "the journal holds the rows");
    e.pg.restore();
    answered.extend(during);
    let gw = e.gateway(&journal).await;
    e.expect_rows(&answered, &gw).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_spool_is_quarantined_line_by_line() {
    let e = env("audit_corrupt").await;
    // A gone gateway's spool: good rows around a non-UTF-8 line, a line
    // that is not a row, and a torn last line.
    let dead = e.spool.path().join("gw-gone-7f9c");
    std::fs::create_dir_all(&dead).unwrap();
    let row = |i: u32| {
        let now = chrono::Utc::now();
        json!({"request_id": Uuid::now_v7(), "received_at": now, "completed_at": now,
               "tenant_id": null, "api_key_id": null, "subject": null,
               "model_name": format!("spooled {i}"), "route_id": null, "route_revision": null,
               "lora_int_id": null, "adapter_name": null, "adapter_version": null,
               "base_hash": null, "worker_id": null, "adapter_residency": null,
               "status": "rejected", "http_status": 401, "error_code": "invalid_api_key",
               "finish_reason": null, "prompt_tokens": 0, "completion_tokens": 0,
               "latency_us": 5, "ttft_us": null, "attempts": 0})
    };
    let mut good = HashSet::new();
    let mut seg = Vec::new();
    for i in 0..700u32 {
        let r = row(i);
        good.insert(r["request_id"].as_str().unwrap().parse::<Uuid>().unwrap());
        seg.extend_from_slice(r.to_string().as_bytes());
        seg.push(b'\n');
        if i == 10 {
            seg.extend_from_slice(b"{\"request_id\": \"\xff\xfe not utf-8\"}\n");
        }
        if i == 600 {
            seg.extend_from_slice(b"{\"not\": \"a row\"}\n");
        }
    }
    seg.extend_from_slice(br#"{"request_id": "0190e7c2-torn"#);
    std::fs::write(dead.join("0000000000000001-000001.jsonl"), &seg).unwrap();
    std::fs::write(dead.join("LOCK"), b"").unwrap();

    let gw = e.gateway(&[]).await;
    e.expect_rows(&good, &gw).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while dead.exists() {
        assert!(
            Instant::now() < deadline,
            "the adopted spool was never removed"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let bad = e.dead_letters().await;
    assert_eq!(bad.len(), 3, "{bad:?}");
    assert!(bad.iter().all(|(s, _, _)| s == "spool"));
    assert!(bad[0].1.contains("not UTF-8"), "{}", bad[0].1);
    assert_eq!(bad[0].2, b"{\"request_id\": \"\xff\xfe not utf-8\"}");
    assert!(bad[1].1.contains("not an audit row"), "{}", bad[1].1);
    assert!(bad[2].1.contains("torn line"), "{}", bad[2].1);
    assert_eq!(bad[2].2, br#"{"request_id": "0190e7c2-torn"#);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_open_streams_ends_them_and_writes_every_row() {
    let e = env("audit_sigterm").await;
    let mut gw = e
        .gateway(&["--drain-deadline-secs", "2", "--audit-flush-secs", "5"])
        .await;
    let mut answered = HashSet::new();
    // Plain requests first, then streams that have begun.
    for i in 0..10 {
        let a = post(&e.http, &gw.url, KEYS[i % 2], normal(i)).await;
        assert_eq!(a.status, 200, "{}", a.body);
        answered.insert(a.id);
    }
    let mut streams = Vec::new();
    for i in 0..6 {
        let mut r = e
            .http
            .post(format!("{}/v1/chat/completions", gw.url))
            .bearer_auth(KEYS[i % 2])
            .json(
                &json!({"model": "chat", "messages": [{"role": "user", "content": "a story"}],
                          "max_tokens": 400, "stream": true, "ignore_eos": true}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        answered.insert(
            r.headers()["x-request-id"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap(),
        );
        let first = r.chunk().await.unwrap().unwrap();
        streams.push((r, String::from_utf8_lossy(&first).into_owned()));
    }
    // The worker stalls, so only the drain deadline can end the streams.
    let worker_pid = e.worker.child.id();
    signal(worker_pid, "STOP");
    let started = Instant::now();
    let pid = gw.server.child.id();
    signal(pid, "TERM");
    let exit = gw.server.child.wait().unwrap();
    let took = started.elapsed();
    signal(worker_pid, "CONT");
    assert!(exit.success(), "{exit}: {}", gw.server.log_text());
    // Drain 2 s + settle 5 s + flush 5 s is the most it may take.
    assert!(took < Duration::from_secs(12), "exit took {took:?}");
    assert!(
        took >= Duration::from_secs(2),
        "exit took {took:?}: before the drain deadline"
    );
    // Every stream ends with an error event that says why.
    for (mut r, mut text) in streams {
        while let Ok(Some(c)) = r.chunk().await {
            text.push_str(&String::from_utf8_lossy(&c));
        }
        assert!(text.contains("\"code\":\"gateway_shutdown\""), "{text}");
        assert!(!text.contains("[DONE]"), "{text}");
    }
    e.expect_rows(&answered, &gw).await;
    let rows = e.rows().await;
    let cut = rows
        .iter()
        .filter(|r| r.1 == "cancelled" && r.3.as_deref() == Some("gateway_shutdown"))
        .count();
    let ok = rows.iter().filter(|r| r.1 == "ok").count();
    assert_eq!((ok, cut), (10, 6), "{rows:?}");
    println!("sigterm: exited in {took:?}; {ok} rows ok, {cut} streams cut at the deadline");
}
