//! Gateway overhead: the latency the real gateway adds (p50, p99) at a fixed
//! request rate, and its maximum requests per second, against calling the
//! worker directly; each both in plain text and with mutual TLS between
//! gateway and worker, so the table also shows what mTLS costs. Run with:
//!
//!     cargo build --release --bins && cargo bench -p lorafleet-gateway --bench gateway_overhead
//!
//! The gateway is the real release binary `lorafleet-gateway serve`, with a
//! real Postgres registry (a throwaway database) and Redis rate limits. The
//! worker is a STAND-IN (benchmarks only): an in-process gRPC server
//! speaking `lorafleet.worker.v1` that answers every Generate at once with
//! one token, so that what is measured is the gateway, not a model. Direct
//! calls go to the same stand-in over gRPC. Two stand-ins and three
//! gateways run side by side: one pair in plain text
//! (`--insecure-plaintext`), one with mutual TLS (certificates generated
//! for the run), and a third gateway on the plain-text stand-in with
//! `--audit-durability journal` (answers wait for the audit row's fsync in
//! the local journal instead of its Postgres commit).
//!
//! `GATEWAY_OVERHEAD_ALONE=commit` (or `journal`) runs one gateway on one
//! stand-in instead, with nothing else of the bench beside it.
//! `GATEWAY_OVERHEAD_GATEWAY_THREADS=N` gives each gateway N runtime
//! threads (tokio's default is one per core).
//! `GATEWAY_OVERHEAD_FLOOD=1` runs one gateway and measures the tenant's
//! latency alone and beside a flood of bad API keys from one address at
//! the same rate (10,000 in all), and how many audit rows the flood cost;
//! `GATEWAY_OVERHEAD_FLOOD=healthz` floods `GET /healthz` instead, the
//! cheapest request there is, for comparison.
//! `GATEWAY_OVERHEAD_CPU=1` runs one gateway per durability mode (commit,
//! then journal; at `GATEWAY_OVERHEAD_RATE` requests a second, default
//! 1,000) and reports its CPU time per request (user + system from
//! `/proc`, over the measured rounds only) beside the latency it added.
//!
//! Needs Postgres at 127.0.0.1:5432 (user postgres, trust) and Redis at
//! 127.0.0.1:6379, like the tests.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use lorafleet_proto::worker::v1 as pb;

#[path = "support/cpu.rs"]
mod cpu;
use sqlx::Connection;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

const BASE_HASH: &str = "ab00000000000000000000000000000000000000000000000000000000000001";
const KEY: &str = "lf_benchkey01.bench-secret-0123456789";
const RATE: u64 = 1000;

/// The CPU mode's rate: `GATEWAY_OVERHEAD_RATE` (default [`RATE`]), so the
/// cost per request can be read at more than one load.
fn cpu_rate() -> u64 {
    std::env::var("GATEWAY_OVERHEAD_RATE")
        .ok()
        .map(|v| v.parse().expect("GATEWAY_OVERHEAD_RATE: requests a second"))
        .unwrap_or(RATE)
}
/// Open-loop rounds per path, alternating which path goes first, so that
/// drift on this shared machine hits both paths alike.
const ROUNDS: u64 = 5;
const ROUND_SECS: u64 = 2;

/// STAND-IN worker: one token per request, no model.
#[derive(Debug, Clone)]
struct StandIn;

type Events = ReceiverStream<Result<pb::GenerateEvent, Status>>;
type Reports = ReceiverStream<Result<pb::WorkerReport, Status>>;

#[tonic::async_trait]
impl pb::worker_server::Worker for StandIn {
    type GenerateStream = Events;
    type WatchStream = Reports;

    async fn generate(&self, _: Request<pb::GenerateRequest>) -> Result<Response<Events>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        for event in [
            pb::generate_event::Event::Accepted(pb::Accepted {
                prompt_tokens: 4,
                adapter_residency: pb::Residency::Device as i32,
            }),
            pb::generate_event::Event::Delta(pb::TokenDelta {
                token_ids: vec![7],
                text: "x".into(),
                logprobs: vec![],
                channel: None,
                device_time: None,
                load_time: None,
            }),
            pb::generate_event::Event::Finished(pb::Finished {
                finish_reason: pb::FinishReason::Length as i32,
                usage: Some(pb::Usage {
                    prompt_tokens: 4,
                    completion_tokens: 1,
                    cached_prompt_tokens: 0,
                }),
                ..Default::default()
            }),
        ] {
            let _ = tx.try_send(Ok(pb::GenerateEvent { event: Some(event) }));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Reports>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            for sequence in 1.. {
                let report = pb::WorkerReport {
                    worker_id: "standin-0".into(),
                    sequence,
                    produced_at: Some(SystemTime::now().into()),
                    status: pb::ServingStatus::Serving as i32,
                    base_model: Some(pb::BaseModel {
                        name: "standin".into(),
                        base_hash: BASE_HASH.into(),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                if tx.send(Ok(report)).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn load_adapter(
        &self,
        _: Request<pb::LoadAdapterRequest>,
    ) -> Result<Response<pb::LoadAdapterResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
    async fn unload_adapter(
        &self,
        _: Request<pb::UnloadAdapterRequest>,
    ) -> Result<Response<pb::UnloadAdapterResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
    async fn list_adapters(
        &self,
        _: Request<pb::ListAdaptersRequest>,
    ) -> Result<Response<pb::ListAdaptersResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
    async fn info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
}

fn release_binary(name: &str) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let p = root.join("target/release").join(name);
    assert!(
        p.is_file(),
        "{} is missing: run `cargo build --release --bins` first",
        p.display()
    );
    p
}

async fn seed(url: &str) {
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    for q in [
        "INSERT INTO tenants (name) VALUES ('bench')",
        "INSERT INTO api_keys (tenant_id, prefix, secret_hash, scopes)
         SELECT id, 'lf_benchkey01', sha256(convert_to('bench-secret-0123456789', 'UTF8')),
                ARRAY['inference'] FROM tenants",
    ] {
        sqlx::query(q).execute(&mut c).await.unwrap();
    }
    sqlx::query(
        "INSERT INTO base_models (name, base_hash, architecture) VALUES ('standin', $1, 'llama')",
    )
    .bind(BASE_HASH)
    .execute(&mut c)
    .await
    .unwrap();
    let mut tx = c.begin().await.unwrap();
    for q in [
        "INSERT INTO adapters (name, version, base_model_id, tenant_id, rank, alpha, target_modules,
                               artifact_uri, artifact_sha256)
         SELECT 'a', 1, b.id, t.id, 8, 16, ARRAY['q_proj'], 'a', repeat('0', 64)
         FROM base_models b, tenants t",
        "INSERT INTO routes (id, tenant_id, model_name, current_revision)
         SELECT '00000000-0000-4000-8000-0000000000aa', id, 'm', 1 FROM tenants",
        "INSERT INTO route_revisions (route_id, revision, base_model_id, target)
         SELECT '00000000-0000-4000-8000-0000000000aa', 1, id, 'adapters' FROM base_models",
        "INSERT INTO route_weights (route_id, revision, base_model_id, lora_int_id, weight_bp)
         SELECT '00000000-0000-4000-8000-0000000000aa', 1, base_model_id, lora_int_id, 10000
         FROM adapters",
    ] {
        sqlx::query(q).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

/// Open loop: one call every 1/RATE s for ROUND_SECS, whatever the latency.
async fn open_loop<F, Fut>(call: F) -> (Vec<Duration>, usize)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    open_loop_at(RATE, call).await
}

/// [`open_loop`] at `rate` calls a second.
async fn open_loop_at<F, Fut>(rate: u64, call: F) -> (Vec<Duration>, usize)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    for _ in 0..rate * ROUND_SECS {
        tick.tick().await;
        let fut = call();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let ok = fut.await;
            (t.elapsed(), ok)
        }));
    }
    let mut lat = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let (d, ok) = t.await.unwrap();
        if ok {
            lat.push(d);
        } else {
            failed += 1;
        }
    }
    (lat, failed)
}

/// Closed loop: `concurrency` callers as fast as they can for 5 s.
async fn max_rps<F, Fut>(call: F, concurrency: usize) -> f64
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    let end = Instant::now() + Duration::from_secs(5);
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let call = call.clone();
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < end {
                if call().await {
                    n += 1;
                }
            }
            n
        }));
    }
    let mut n = 0;
    for t in tasks {
        n += t.await.unwrap();
    }
    n as f64 / 5.0
}

/// A stand-in worker on a loopback port, served with mutual TLS when
/// `tls` is given.
async fn stand_in(tls: Option<&lorafleet_tls::PemFiles>) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = tonic::transport::Server::builder()
        .add_service(pb::worker_server::WorkerServer::new(StandIn));
    match tls {
        Some(files) => {
            let config = lorafleet_tls::Reloading::start(
                files.clone(),
                Duration::from_secs(3600),
                lorafleet_tls::server::config,
            )
            .unwrap();
            let incoming =
                lorafleet_tls::server::incoming(listener, config, Duration::from_secs(10));
            tokio::spawn(router.serve_with_incoming(incoming));
        }
        None => {
            // Nagle off, as the worker (and the TLS acceptor) set it.
            let incoming = tokio_stream::StreamExt::map(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                |conn| {
                    conn.inspect(|c| {
                        let _ = c.set_nodelay(true);
                    })
                },
            );
            tokio::spawn(router.serve_with_incoming(incoming));
        }
    }
    addr
}

/// The real gateway on `worker`, in plain text or with the TLS files in
/// `certs`; returns the process and its HTTP address.
fn gateway(
    url: &str,
    prefix: &str,
    worker: std::net::SocketAddr,
    spool: &std::path::Path,
    certs: Option<&std::path::Path>,
    durability: &str,
) -> (std::process::Child, String) {
    let mut cmd = Command::new(release_binary("lorafleet-gateway"));
    cmd.args([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
    ])
    .args([
        "--database-url",
        url,
        "--redis-url",
        "redis://127.0.0.1:6379",
    ])
    .args(["--redis-prefix", prefix])
    .args(["--workers", &worker.to_string()])
    // No per-tenant rate limit: the bench sends 1,000 requests/s as one
    // tenant, and measures the gateway, not the limiter refusing.
    .args(["--default-rpm-limit", "0", "--default-tpm-limit", "0"])
    .args(["--audit-durability", durability])
    .arg("--audit-spool")
    .arg(spool);
    match certs {
        Some(dir) => cmd
            .arg("--worker-tls-cert")
            .arg(dir.join("gateway.pem"))
            .arg("--worker-tls-key")
            .arg(dir.join("gateway-key.pem"))
            .arg("--worker-tls-ca")
            .arg(dir.join("ca.pem")),
        None => cmd.arg("--insecure-plaintext"),
    };
    // The gateway's runtime threads, for comparing settings (tokio's
    // default is one per core).
    if let Ok(threads) = std::env::var("GATEWAY_OVERHEAD_GATEWAY_THREADS") {
        cmd.env("TOKIO_WORKER_THREADS", threads);
    }
    let mut child = cmd
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let line = BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
        .find(|l| l.starts_with("lorafleet-gateway listening "))
        .expect("the gateway's ready line");
    let http_addr = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("http="))
        .unwrap()
        .to_owned();
    (child, http_addr)
}

/// A fleet CA with a worker certificate for 127.0.0.1 and a gateway one.
fn certificates(dir: &std::path::Path) -> lorafleet_tls::PemFiles {
    use lorafleet_tls::issue::{Ca, Role};
    let ca = Ca::generate("bench CA", 1).unwrap();
    let worker = ca.issue(Role::Worker, &["127.0.0.1".into()], 1).unwrap();
    let gateway = ca
        .issue(Role::Gateway, &["lorafleet-gateway".into()], 1)
        .unwrap();
    for (name, text) in [
        ("ca.pem", &ca.pem().cert),
        ("worker.pem", &worker.cert),
        ("worker-key.pem", &worker.key),
        ("gateway.pem", &gateway.cert),
        ("gateway-key.pem", &gateway.key),
    ] {
        std::fs::write(dir.join(name), text).unwrap();
    }
    lorafleet_tls::PemFiles {
        cert: dir.join("worker.pem"),
        key: dir.join("worker-key.pem"),
        ca: dir.join("ca.pem"),
        flags: ["cert", "key", "ca"],
    }
}

type Call = std::sync::Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = bool> + Send>> + Send + Sync,
>;

fn via_gateway(http: &reqwest::Client, http_addr: &str) -> Call {
    let url = format!("http://{http_addr}/v1/completions");
    let body = serde_json::json!({"model": "m", "prompt": "hello", "max_tokens": 1});
    let http = http.clone();
    std::sync::Arc::new(move || {
        let (http, url, body) = (http.clone(), url.clone(), body.clone());
        Box::pin(async move {
            match http.post(&url).bearer_auth(KEY).json(&body).send().await {
                Ok(r) => r.status() == 200 && r.bytes().await.is_ok(),
                Err(_) => false,
            }
        })
    })
}

fn direct(grpc: pb::worker_client::WorkerClient<tonic::transport::Channel>) -> Call {
    std::sync::Arc::new(move || {
        let mut c = grpc.clone();
        Box::pin(async move {
            let request = pb::GenerateRequest {
                request_id: "bench".into(),
                prompt: Some(pb::generate_request::Prompt::Text("hello".into())),
                sampling: Some(pb::SamplingParams {
                    max_tokens: 1,
                    ..Default::default()
                }),
                ..Default::default()
            };
            let Ok(r) = c.generate(request).await else {
                return false;
            };
            let mut s = r.into_inner();
            while let Ok(Some(_)) = s.message().await {}
            true
        })
    })
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .build()
        .unwrap()
}

/// Waits (up to 10 s) until the gateway at `addr` answers /readyz with 200.
async fn wait_ready(http: &reqwest::Client, addr: &str) {
    for _ in 0..100 {
        if http
            .get(format!("http://{addr}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Warms every path, measures each open loop in interleaved rounds and its
/// maximum rate, and prints the table; `added` names differences (b - a).
async fn measure(paths: &[(&str, Call)], added: &[(&str, usize, usize)]) {
    // Warm every path.
    for _ in 0..200 {
        for (_, call) in paths {
            assert!(call().await, "a warm-up call failed");
        }
    }

    println!(
        "gateway overhead, STAND-IN worker (one token, no model), {RATE} req/s open loop, \
         {ROUNDS} interleaved rounds of {ROUND_SECS} s per path, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| path | ok | failed | p50 | p99 | max req/s (64 callers, 5 s) |");
    println!("|---|---:|---:|---:|---:|---:|");
    let mut lat: Vec<Vec<Duration>> = vec![Vec::new(); paths.len()];
    let mut failed = vec![0; paths.len()];
    for round in 0..ROUNDS as usize {
        // Rotate which path goes first, so drift hits all alike.
        for k in 0..paths.len() {
            let i = (round + k) % paths.len();
            let call = paths[i].1.clone();
            let (l, f) = open_loop(move || call()).await;
            lat[i].extend(l);
            failed[i] += f;
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut p = Vec::new();
    for (i, (name, call)) in paths.iter().enumerate() {
        lat[i].sort();
        let call = call.clone();
        let max = max_rps(move || call(), 64).await;
        let (p50, p99) = (ms(percentile(&lat[i], 0.50)), ms(percentile(&lat[i], 0.99)));
        p.push((p50, p99));
        println!(
            "| {name} | {} | {} | {p50:.3} ms | {p99:.3} ms | {max:.0} |",
            lat[i].len(),
            failed[i],
        );
    }
    for &(name, a, b) in added {
        println!(
            "| {name} | | | {:.3} ms | {:.3} ms | |",
            p[b].0 - p[a].0,
            p[b].1 - p[a].1
        );
    }
}

/// Bad-key requests at RATE for ROUND_SECS: (401s, 429s, other).
/// With `healthz`, the flood is `GET /healthz` instead: what any request
/// costs the shared cores, against which the bad keys' own cost shows.
async fn flood_loop(http: reqwest::Client, url: String, healthz: bool) -> (usize, usize, usize) {
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / RATE));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut tasks = Vec::new();
    for i in 0..RATE * ROUND_SECS {
        tick.tick().await;
        let req = if healthz {
            http.get(url.replace("/v1/completions", "/healthz"))
        } else {
            http.post(&url)
                .bearer_auth(format!("lf_flood{i:06}.wrong"))
                .json(&serde_json::json!({"model": "m", "prompt": "hello", "max_tokens": 1}))
        };
        tasks.push(tokio::spawn(async move {
            req.send().await.map_or(0, |r| r.status().as_u16())
        }));
    }
    let mut n = (0, 0, 0);
    for t in tasks {
        match t.await.unwrap() {
            401 | 200 => n.0 += 1,
            429 => n.1 += 1,
            _ => n.2 += 1,
        }
    }
    n
}

/// The tenant alone and beside a bad-key flood, in alternating rounds.
async fn flood(url: &str, gw_http: &str, gw: &mut std::process::Child, healthz: bool) {
    let http = client();
    let tenant = via_gateway(&http, gw_http);
    for _ in 0..200 {
        assert!(tenant().await, "a warm-up call failed");
    }
    let flood_url = format!("http://{gw_http}/v1/completions");
    let (mut quiet, mut loud) = (Vec::new(), Vec::new());
    let mut failed = [0usize; 2];
    let mut answers = (0, 0, 0);
    for round in 0..ROUNDS {
        for k in 0..2 {
            let flooded = (round + k) % 2 == 1;
            let call = tenant.clone();
            if flooded {
                let ((l, f), (a, b, c)) = tokio::join!(
                    open_loop(move || call()),
                    flood_loop(client(), flood_url.clone(), healthz)
                );
                loud.extend(l);
                failed[1] += f;
                answers = (answers.0 + a, answers.1 + b, answers.2 + c);
            } else {
                let (l, f) = open_loop(move || call()).await;
                quiet.extend(l);
                failed[0] += f;
            }
        }
    }
    // The flood's rows reach Postgres when their window (60 s) ends, or
    // at the gateway's drain.
    let _ = Command::new("kill")
        .args(["-TERM", &gw.id().to_string()])
        .status();
    let _ = gw.wait();
    let mut c = sqlx::PgConnection::connect(url).await.unwrap();
    let (rows, counted): (i64, i64) = sqlx::query_as(
        "SELECT count(*), coalesce(sum(occurrences), 0)::int8 FROM audit_log
         WHERE tenant_id IS NULL",
    )
    .fetch_one(&mut c)
    .await
    .unwrap();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    quiet.sort();
    loud.sort();
    let what = if healthz { "GET /healthz" } else { "bad-key" };
    println!(
        "a tenant at {RATE} req/s, alone and beside {RATE} {what} req/s from one address, \
         {ROUNDS} interleaved rounds of {ROUND_SECS} s, STAND-IN worker, {} cores",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!("| tenant traffic | ok | failed | p50 | p99 |");
    println!("|---|---:|---:|---:|---:|");
    for (name, lat, f) in [
        ("alone", &quiet, failed[0]),
        ("beside the flood", &loud, failed[1]),
    ] {
        println!(
            "| {name} | {} | {f} | {:.3} ms | {:.3} ms |",
            lat.len(),
            ms(percentile(lat, 0.5)),
            ms(percentile(lat, 0.99))
        );
    }
    let (p99a, p99b) = (percentile(&quiet, 0.99), percentile(&loud, 0.99));
    println!(
        "p99 change: {:+.1}%; the flood: {} × 401 (200 for /healthz), {} × 429, {} other; \
         {rows} audit rows counting {counted} requests",
        (p99b.as_secs_f64() / p99a.as_secs_f64() - 1.0) * 100.0,
        answers.0,
        answers.1,
        answers.2
    );
}

/// Drops the bench's throwaway database.
async fn drop_db(c: &mut sqlx::PgConnection, db: &str) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(c)
    .await
    .unwrap();
}

fn main() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let scratch = tempfile::tempdir().unwrap();
        let tls_files = certificates(scratch.path());
        let plain_worker = stand_in(None).await;
        let tls_worker = stand_in(Some(&tls_files)).await;

        // A throwaway registry.
        let db = format!("lorafleet_bench_{}", std::process::id());
        let admin = "postgres://postgres@127.0.0.1:5432/postgres";
        let mut c = sqlx::PgConnection::connect(admin).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&mut c)
            .await
            .unwrap();
        let url = format!("postgres://postgres@127.0.0.1:5432/{db}");
        let out = Command::new(release_binary("lorafleet-gateway"))
            .args(["migrate", "--database-url", &url])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        seed(&url).await;

        let prefix = format!("{db}:");
        if let Ok(flood_of) = std::env::var("GATEWAY_OVERHEAD_FLOOD") {
            let spool = scratch.path().join("spool-flood");
            let (mut gw, gw_http) = gateway(&url, &prefix, plain_worker, &spool, None, "commit");
            wait_ready(&client(), &gw_http).await;
            flood(&url, &gw_http, &mut gw, flood_of == "healthz").await;
            drop_db(&mut c, &db).await;
            return;
        }
        if std::env::var("GATEWAY_OVERHEAD_CPU").is_ok() {
            let grpc = pb::worker_client::WorkerClient::connect(format!("http://{plain_worker}"))
                .await
                .unwrap();
            println!(
                "gateway CPU per request, STAND-IN worker (one token, no model), {} req/s \
                 open loop, {ROUNDS} rounds of {ROUND_SECS} s per mode, {} cores",
                cpu_rate(),
                std::thread::available_parallelism().map_or(0, |n| n.get())
            );
            println!(
                "| --audit-durability | requests | gateway CPU | CPU per request | \
                 (scheduler's count) | added p50 | added p99 |"
            );
            println!("|---|---:|---:|---:|---:|---:|---:|");
            for mode in ["commit", "journal"] {
                let spool = scratch.path().join(format!("spool-cpu-{mode}"));
                let (mut gw, gw_http) = gateway(&url, &prefix, plain_worker, &spool, None, mode);
                let http = client();
                wait_ready(&http, &gw_http).await;
                let via = via_gateway(&http, &gw_http);
                let direct = direct(grpc.clone());
                for _ in 0..500 {
                    assert!(via().await && direct().await, "a warm-up call failed");
                }
                let (mut through, mut alone, mut cpu, mut sched, mut n) =
                    (Vec::new(), Vec::new(), Duration::ZERO, Duration::ZERO, 0);
                for _ in 0..ROUNDS {
                    let d = direct.clone();
                    alone.extend(open_loop_at(cpu_rate(), move || d()).await.0);
                    let (before, sched_before) = (cpu::used(gw.id()), cpu::scheduled(gw.id()));
                    let v = via.clone();
                    let (lat, failed) = open_loop_at(cpu_rate(), move || v()).await;
                    cpu += cpu::used(gw.id()) - before;
                    sched += cpu::scheduled(gw.id()).saturating_sub(sched_before);
                    n += lat.len() + failed;
                    through.extend(lat);
                }
                through.sort();
                alone.sort();
                let ms = |a: &[Duration], p| percentile(a, p).as_secs_f64() * 1e3;
                println!(
                    "| {mode} | {n} | {:.2} s | **{:.0} µs** | {:.0} µs | {:.3} ms | {:.3} ms |",
                    cpu.as_secs_f64(),
                    cpu.as_secs_f64() * 1e6 / n as f64,
                    sched.as_secs_f64() * 1e6 / n as f64,
                    ms(&through, 0.50) - ms(&alone, 0.50),
                    ms(&through, 0.99) - ms(&alone, 0.99),
                );
                let _ = Command::new("kill")
                    .args(["-TERM", &gw.id().to_string()])
                    .status();
                let _ = gw.wait();
            }
            drop_db(&mut c, &db).await;
            return;
        }
        if let Ok(mode) = std::env::var("GATEWAY_OVERHEAD_ALONE") {
            // One gateway and one stand-in: what the gateway adds with
            // nothing else of the bench's running beside it.
            assert!(
                mode == "commit" || mode == "journal",
                "GATEWAY_OVERHEAD_ALONE: {mode:?} is neither commit nor journal"
            );
            let (mut gw, gw_http) = gateway(
                &url,
                &prefix,
                plain_worker,
                &scratch.path().join("spool-alone"),
                None,
                &mode,
            );
            let http = client();
            wait_ready(&http, &gw_http).await;
            let grpc = pb::worker_client::WorkerClient::connect(format!("http://{plain_worker}"))
                .await
                .unwrap();
            let through =
                format!("through the gateway alone (plain text, --audit-durability {mode})");
            let added = format!("added by the gateway alone ({mode})");
            measure(
                &[
                    ("worker directly (gRPC, plain text)", direct(grpc)),
                    (&through, via_gateway(&http, &gw_http)),
                ],
                &[(&added, 0, 1)],
            )
            .await;
            let _ = Command::new("kill")
                .args(["-TERM", &gw.id().to_string()])
                .status();
            let _ = gw.wait();
            drop_db(&mut c, &db).await;
            return;
        }
        let (mut plain_gw, plain_http) = gateway(
            &url,
            &prefix,
            plain_worker,
            &scratch.path().join("spool-plain"),
            None,
            "commit",
        );
        let (mut journal_gw, journal_http) = gateway(
            &url,
            &prefix,
            plain_worker,
            &scratch.path().join("spool-journal"),
            None,
            "journal",
        );
        let (mut tls_gw, tls_http) = gateway(
            &url,
            &prefix,
            tls_worker,
            &scratch.path().join("spool-tls"),
            Some(scratch.path()),
            "commit",
        );
        let http = client();
        for addr in [&plain_http, &tls_http, &journal_http] {
            wait_ready(&http, addr).await;
        }
        let plain_grpc = pb::worker_client::WorkerClient::connect(format!("http://{plain_worker}"))
            .await
            .unwrap();
        let client_config = lorafleet_tls::PemFiles {
            cert: scratch.path().join("gateway.pem"),
            key: scratch.path().join("gateway-key.pem"),
            ca: scratch.path().join("ca.pem"),
            flags: ["cert", "key", "ca"],
        }
        .load()
        .and_then(|l| lorafleet_tls::client::config(&l))
        .unwrap();
        let connector = lorafleet_tls::client::Connector::new(
            lorafleet_tls::Reloading::fixed(client_config),
            "127.0.0.1",
        )
        .unwrap();
        let tls_grpc = pb::worker_client::WorkerClient::new(
            tonic::transport::Endpoint::from_shared(format!("http://{tls_worker}"))
                .unwrap()
                .connect_with_connector(connector)
                .await
                .unwrap(),
        );
        let paths: [(&str, Call); 5] = [
            ("worker directly (gRPC, plain text)", direct(plain_grpc)),
            ("worker directly (gRPC, mTLS)", direct(tls_grpc)),
            (
                "through the gateway (plain text to the worker)",
                via_gateway(&http, &plain_http),
            ),
            (
                "through the gateway (mTLS to the worker)",
                via_gateway(&http, &tls_http),
            ),
            (
                "through the gateway (plain text, --audit-durability journal)",
                via_gateway(&http, &journal_http),
            ),
        ];
        measure(
            &paths,
            &[
                ("added by the gateway (plain text)", 0, 2),
                ("added by the gateway (mTLS)", 1, 3),
                ("added by mTLS, worker directly", 0, 1),
                ("added by mTLS, through the gateway", 2, 3),
                ("added by the gateway (plain text, journal)", 0, 4),
            ],
        )
        .await;

        for gw in [&mut plain_gw, &mut tls_gw, &mut journal_gw] {
            let _ = Command::new("kill")
                .args(["-TERM", &gw.id().to_string()])
                .status();
            let _ = gw.wait();
        }
        drop_db(&mut c, &db).await;
    });
}
