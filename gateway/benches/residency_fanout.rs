//! Residency fan-out: what the workers' Watch streams cost a gateway, and
//! what they would cost at 64 workers × 16 gateways. Run with:
//!
//!     cargo build --release --bins && cargo bench -p lorafleet-gateway --bench residency_fanout
//!
//! 64 SIMULATED workers (benchmarks only: in-process gRPC servers speaking
//! `lorafleet.worker.v1`'s Watch, no model) each report every adapter
//! their pool holds — `FANOUT_ADAPTERS` (default 256): 32 on the device,
//! the rest in host memory, with fresh counts and times in every report —
//! `FANOUT_RATE` (default 10) times a second, as a busy worker whose
//! residency keeps changing does (a real worker reports on every change
//! and at least every interval). They stream to ONE real release
//! `lorafleet-gateway serve` (its own throwaway registry database) for
//! 10 s; the bench counts the reports and bytes sent and reads the
//! gateway's CPU time from `/proc`, and its own (the 64 simulated
//! workers' encoding and sending).
//!
//! Each gateway holds its own stream to each worker, so a gateway's cost
//! does not depend on how many gateways there are; a worker's grows with
//! them (it sends every report once per gateway). The projection to 16
//! gateways follows from that.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use lorafleet_proto::worker::v1 as pb;
use sqlx::Connection;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

const WORKERS: usize = 64;
const DEVICE: usize = 32;
const SECONDS: u64 = 10;
const BASE_HASH: &str = "ab00000000000000000000000000000000000000000000000000000000000001";

#[derive(Clone)]
struct Simulated {
    id: String,
    adapters: usize,
    rate: u64,
    sent: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
}

type Events = ReceiverStream<Result<pb::GenerateEvent, Status>>;
type Reports = ReceiverStream<Result<pb::WorkerReport, Status>>;

impl Simulated {
    fn report(&self, sequence: u64) -> pb::WorkerReport {
        let now = SystemTime::now();
        let adapters = (0..self.adapters)
            .map(|i| pb::AdapterState {
                lora_int_id: i as u64 + 1,
                artifact_sha256: format!("{:064x}", i + 1),
                rank: 16,
                residency: if i < DEVICE {
                    pb::Residency::Device as i32
                } else {
                    pb::Residency::Host as i32
                },
                pinned: false,
                active_requests: ((sequence + i as u64) % 3) as u32,
                queued_requests: ((sequence + i as u64) % 2) as u32,
                last_used: Some(now.into()),
                display_name: format!("tenant-{}/adapter-{i}@1", i % 16),
            })
            .collect();
        pb::WorkerReport {
            worker_id: self.id.clone(),
            sequence,
            produced_at: Some(now.into()),
            status: pb::ServingStatus::Serving as i32,
            base_model: Some(pb::BaseModel {
                name: "standin".into(),
                base_hash: BASE_HASH.into(),
                ..Default::default()
            }),
            load: Some(pb::Load {
                running_sequences: (sequence % 32) as u32,
                waiting_sequences: (sequence % 5) as u32,
                kv_blocks_used: (sequence % 1000) as u32,
            }),
            adapters,
            instance_id: format!("{}-instance", self.id),
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl pb::worker_server::Worker for Simulated {
    type GenerateStream = Events;
    type WatchStream = Reports;

    async fn generate(&self, _: Request<pb::GenerateRequest>) -> Result<Response<Events>, Status> {
        Err(Status::unimplemented("simulated worker"))
    }

    async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Reports>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        let me = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / me.rate));
            for sequence in 1.. {
                tick.tick().await;
                let report = me.report(sequence);
                me.bytes.fetch_add(
                    lorafleet_proto::encoded_len(&report) as u64,
                    Ordering::Relaxed,
                );
                if tx.send(Ok(report)).await.is_err() {
                    return;
                }
                me.sent.fetch_add(1, Ordering::Relaxed);
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn load_adapter(
        &self,
        _: Request<pb::LoadAdapterRequest>,
    ) -> Result<Response<pb::LoadAdapterResponse>, Status> {
        Err(Status::unimplemented("simulated worker"))
    }
    async fn unload_adapter(
        &self,
        _: Request<pb::UnloadAdapterRequest>,
    ) -> Result<Response<pb::UnloadAdapterResponse>, Status> {
        Err(Status::unimplemented("simulated worker"))
    }
    async fn list_adapters(
        &self,
        _: Request<pb::ListAdaptersRequest>,
    ) -> Result<Response<pb::ListAdaptersResponse>, Status> {
        Err(Status::unimplemented("simulated worker"))
    }
    async fn info(
        &self,
        _: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        Err(Status::unimplemented("simulated worker"))
    }
}

/// CPU seconds (user + system) of process `pid` so far.
fn cpu_secs(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc stat");
    // Fields after the command's closing parenthesis; utime and stime are
    // the 14th and 15th of the line.
    let rest = &stat[stat.rfind(')').expect("a stat line") + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    // USER_HZ is 100 on Linux.
    ticks / 100.0
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let adapters = env_or("FANOUT_ADAPTERS", 256) as usize;
        let rate = env_or("FANOUT_RATE", 10).max(1);
        let (sent, bytes) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let mut addrs = Vec::new();
        for w in 0..WORKERS {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            addrs.push(listener.local_addr().unwrap().to_string());
            let worker = Simulated {
                id: format!("sim-{w}"),
                adapters,
                rate,
                sent: sent.clone(),
                bytes: bytes.clone(),
            };
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(pb::worker_server::WorkerServer::new(worker))
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
            );
        }

        let db = format!("lorafleet_fanout_{}", std::process::id());
        let admin = "postgres://postgres@127.0.0.1:5432/postgres";
        let mut c = sqlx::PgConnection::connect(admin).await.unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&mut c)
            .await
            .unwrap();
        let url = format!("postgres://postgres@127.0.0.1:5432/{db}");
        let gateway_bin = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../target/release/lorafleet-gateway");
        assert!(
            gateway_bin.is_file(),
            "run `cargo build --release --bins` first"
        );
        let out = Command::new(&gateway_bin)
            .args(["migrate", "--database-url", &url])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let spool = tempfile::tempdir().unwrap();
        let mut gw = Command::new(&gateway_bin)
            .args(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .args(["--database-url", &url, "--insecure-plaintext"])
            .args(["--workers", &addrs.join(",")])
            .arg("--audit-spool")
            .arg(spool.path())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let _ready = BufReader::new(gw.stdout.take().unwrap())
            .lines()
            .map_while(Result::ok)
            .find(|l| l.starts_with("lorafleet-gateway listening "))
            .expect("the gateway's ready line");
        let pid = gw.id().to_string();
        // Every stream open and flowing first.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let (gw0, me0) = (cpu_secs(&pid), cpu_secs("self"));
        let (sent0, bytes0) = (sent.load(Ordering::Relaxed), bytes.load(Ordering::Relaxed));
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs(SECONDS)).await;
        let wall = started.elapsed().as_secs_f64();
        let (gw_cpu, me_cpu) = (cpu_secs(&pid) - gw0, cpu_secs("self") - me0);
        let reports = (sent.load(Ordering::Relaxed) - sent0) as f64;
        let sent_bytes = (bytes.load(Ordering::Relaxed) - bytes0) as f64;
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        let _ = gw.wait();
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
        )))
        .execute(&mut c)
        .await
        .unwrap();

        let per_s = reports / wall;
        let report_kib = sent_bytes / reports / 1024.0;
        let gw_share = gw_cpu / wall;
        let us_per_report = gw_cpu / reports * 1e6;
        let worker_us = me_cpu / reports * 1e6;
        println!(
            "residency fan-out: {WORKERS} SIMULATED workers x {adapters} adapters ({DEVICE} on \
             the device) reporting {rate}/s each to one real gateway, {SECONDS} s, {} cores",
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
        println!("| measured (one gateway) | value |");
        println!("|---|---:|");
        println!("| reports received | {per_s:.0}/s ({report_kib:.1} KiB each, {:.1} MiB/s) |", per_s * report_kib / 1024.0);
        println!("| gateway CPU | {:.1}% of one core ({us_per_report:.0} µs a report) |", gw_share * 100.0);
        println!("| simulated workers' CPU (encode, send) | {worker_us:.0} µs a report sent |");
        println!("| projected to 64 workers × 16 gateways | value |");
        println!("|---|---:|");
        println!("| each gateway: reports, CPU | {per_s:.0}/s, {:.1}% of one core (as measured: a gateway's streams are its own) |", gw_share * 100.0);
        println!(
            "| each worker: reports sent, CPU | {:.0}/s, {:.1}% of one core (16 × one gateway's) |",
            rate as f64 * 16.0,
            rate as f64 * 16.0 * worker_us / 1e6 * 100.0
        );
        println!(
            "| fleet: reports on the network | {:.0}/s, {:.0} MiB/s |",
            per_s * 16.0,
            per_s * 16.0 * report_kib / 1024.0
        );
    });
}
