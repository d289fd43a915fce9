//! Audit soak: the real release gateway and worker (fixture model) under a
//! steady open-loop load while Postgres is unreachable for minutes, then
//! back. Prints a table: latency and outcomes per phase, the gateway's peak
//! resident memory and spool size, how long the replay took, and the exact
//! count of answered requests against rows in `audit_log`. Run with:
//!
//!     cargo build --release --bins && cargo bench -p lorafleet-tests --bench audit_soak
//!
//! `LORAFLEET_SOAK_RATE` (requests/s, default 200) and
//! `LORAFLEET_SOAK_OUTAGE_SECS` (default 120) change the load and the outage.
//! Needs Postgres at 127.0.0.1:5432 and the release binaries.

use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use lorafleet_tests::{
    Proxy, Server, files_under, fixture_worker, gateway_command, login_member_of, migrated_db,
    rss_kib, seed_base_routes,
};
use uuid::Uuid;

const KEYS: [&str; 2] = [
    "lf_soakacme01.acme-secret-0123456789",
    "lf_soakglobx1.globex-secret-0123456789",
];

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: {v:?} is not a number"))
        })
        .unwrap_or(default)
}

fn dir_bytes(dir: &Path) -> u64 {
    files_under(dir)
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum()
}

struct Phase {
    name: &'static str,
    latencies: Vec<Duration>,
    ok: Vec<Uuid>,
    other: usize,
    failed: usize,
}

/// One request every 1/rate s for `secs`, whatever the latency.
async fn open_loop(
    name: &'static str,
    http: &reqwest::Client,
    url: &str,
    rate: u64,
    secs: u64,
) -> Phase {
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    for i in 0..rate * secs {
        tick.tick().await;
        let (http, url) = (http.clone(), url.to_owned());
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let body = serde_json::json!({"model": "chat", "prompt": format!("soak {i}"),
                                          "max_tokens": 1, "user": format!("u{}", i % 50)});
            let r = http
                .post(&url)
                .bearer_auth(KEYS[i as usize % 2])
                .json(&body)
                .send()
                .await;
            let out = match r {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let id = r
                        .headers()
                        .get("x-request-id")
                        .and_then(|v| v.to_str().ok().and_then(|s| s.parse::<Uuid>().ok()));
                    let whole = r.bytes().await.is_ok();
                    Some((status, id, whole))
                }
                Err(_) => None,
            };
            (t.elapsed(), out)
        }));
    }
    let mut phase = Phase {
        name,
        latencies: Vec::new(),
        ok: Vec::new(),
        other: 0,
        failed: 0,
    };
    for t in tasks {
        let (d, out) = t.await.unwrap();
        match out {
            Some((200, Some(id), true)) => {
                phase.latencies.push(d);
                phase.ok.push(id);
            }
            Some(_) => phase.other += 1,
            None => phase.failed += 1,
        }
    }
    phase.latencies.sort();
    phase
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)].as_secs_f64() * 1e3
}

fn main() {
    let rate = env_u64("LORAFLEET_SOAK_RATE", 200);
    let outage = env_u64("LORAFLEET_SOAK_OUTAGE_SECS", 120);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        let db = migrated_db("audit_soak").await;
        let pool = db.pool().await;
        seed_base_routes(&pool, &[("acme", KEYS[0]), ("globex", KEYS[1])], "chat").await;
        let user = login_member_of(&pool, "lorafleet_runtime").await;
        let pg = Proxy::start("127.0.0.1:5432");
        let worker = fixture_worker("w0", &[]);
        let spool = tempfile::tempdir().unwrap();
        let mut cmd = gateway_command();
        cmd.args([
            "--database-url",
            &format!("postgres://{user}@{}/{}", pg.addr, db.name()),
        ])
        .args(["--workers", worker.addr("grpc")])
        // The soak's load is one tenant's; the limiter is not under test.
        .args(["--default-rpm-limit", "0", "--default-tpm-limit", "0"])
        .arg("--audit-spool")
        .arg(spool.path())
        .env("RUST_LOG", "warn");
        let gateway = Server::start(cmd, "lorafleet-gateway listening ");
        let base = format!("http://{}", gateway.addr("http"));
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(512)
            .build()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !http
            .get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            assert!(
                Instant::now() < deadline,
                "never ready: {}",
                gateway.log_text()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let url = format!("{base}/v1/completions");
        let pid = gateway.child.id();
        let idle_kib = rss_kib(pid);

        let before = open_loop("Postgres up", &http, &url, rate, 10).await;
        pg.cut();
        let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let sampler = {
            let (sampling, dir) = (sampling.clone(), spool.path().to_owned());
            tokio::spawn(async move {
                let (mut rss, mut bytes) = (0, 0);
                while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                    rss = rss.max(rss_kib(pid));
                    bytes = bytes.max(dir_bytes(&dir));
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                (rss, bytes)
            })
        };
        let during = open_loop("Postgres unreachable", &http, &url, rate, outage).await;
        pg.restore();
        let restored = Instant::now();
        let emptied = {
            let dir = spool.path().to_owned();
            tokio::spawn(async move {
                while dir_bytes(&dir) > 0 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                restored.elapsed()
            })
        };
        let after = open_loop("Postgres back, replaying", &http, &url, rate, 10).await;
        sampling.store(false, std::sync::atomic::Ordering::Relaxed);
        let (peak_kib, peak_spool) = sampler.await.unwrap();

        let answered: HashSet<Uuid> = [&before, &during, &after]
            .iter()
            .flat_map(|p| p.ok.iter().copied())
            .collect();
        let deadline = Instant::now() + Duration::from_secs(600);
        let (rows, distinct) = loop {
            let ids: Vec<Uuid> = sqlx::query_scalar("SELECT request_id FROM audit_log")
                .fetch_all(&pool)
                .await
                .unwrap();
            let set: HashSet<Uuid> = ids.iter().copied().collect();
            if answered.is_subset(&set) || Instant::now() > deadline {
                break (ids.len(), set);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let emptied = emptied.await.unwrap();
        let missing = answered.difference(&distinct).count();

        println!(
            "audit soak: {rate} req/s open loop, max_tokens 1, fixture model; Postgres cut for \
             {outage} s; {} cores",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!("| phase | s | 200 with row key | other status | no answer | p50 | p99 |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for (p, secs) in [(&before, 10), (&during, outage), (&after, 10)] {
            println!(
                "| {} | {secs} | {} | {} | {} | {:.2} ms | {:.2} ms |",
                p.name,
                p.ok.len(),
                p.other,
                p.failed,
                pct(&p.latencies, 0.5),
                pct(&p.latencies, 0.99)
            );
        }
        println!();
        println!("| measure | value |");
        println!("|---|---:|");
        println!("| gateway RSS idle | {} MiB |", idle_kib / 1024);
        println!(
            "| gateway RSS peak during the outage | {} MiB |",
            peak_kib / 1024
        );
        println!(
            "| spool peak | {:.1} MiB |",
            peak_spool as f64 / (1 << 20) as f64
        );
        println!(
            "| from restore to an empty spool (replayed under load) | {:.1} s |",
            emptied.as_secs_f64()
        );
        println!("| answered requests | {} |", answered.len());
        println!("| rows | {rows} |");
        println!("| answered without a row | {missing} |");
        println!("| duplicated rows | {} |", rows - distinct.len());
        drop(gateway);
        drop(worker);
    });
}
