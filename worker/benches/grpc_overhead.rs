//! Benchmark: tokens/s through the gRPC service against the engine
//! in-process, on the same workload, on the STAND-IN ~100M Llama shared with
//! the engine's benchmarks. Prints a table. Run with:
//!
//!     cargo bench -p lorafleet-worker --bench grpc_overhead
//!
//! Workload: 128 requests (8 prompt tokens, 16 generated, greedy, EOS
//! ignored) over 8 rank-16 adapters, all submitted at once. Rows:
//! - engine: `Engine::step` in a loop on this thread (no runtime, no channels);
//! - handle: the worker's engine thread behind `EngineHandle`, in-process;
//! - gRPC: the real `WorkerService` on a loopback port, called by a tonic
//!   client in this process, one stream per request.
//!
//! A warm-up run loads the adapters onto the device first, so every row
//! measures steady serving. The three paths then run in five interleaved
//! rounds (this machine's speed drifts by more than the effect measured);
//! the table gives the median round and the best.

#[path = "../engine/benches/standin/mod.rs"]
mod standin;

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use lorafleet_engine::artifact::{self, ArtifactRoots};
use lorafleet_engine::{AdapterSource, Engine, EngineSettings, Event, Prompt, Request, Sampling};
use lorafleet_proto::worker::v1 as pb;
use lorafleet_worker::info::WorkerInfo;
use lorafleet_worker::runtime::EngineHandle;
use lorafleet_worker::service::WorkerService;

const REQUESTS: usize = 128;
const ROUNDS: usize = 5;
const ADAPTERS: usize = 8;
const PROMPT: usize = 8;
const NEW: usize = 16;

fn settings() -> EngineSettings {
    EngineSettings {
        max_loras: 8,
        max_lora_rank: 16,
        max_cpu_loras: 16,
        max_cpu_lora_bytes: None,
        kv_blocks: 1024,
        block_size: 16,
        max_num_seqs: 32,
        max_batched_tokens: 512,
        max_waiting: 4096,
        max_pinned: None,
        prefix_caching: true,
        fair_admission: true,
        eviction: Default::default(),
        memory_budget_bytes: None,
    }
}

fn prompt(r: usize) -> Vec<u32> {
    (0..PROMPT)
        .map(|k| ((r * 31 + k * 7) % 380 + 3) as u32)
        .collect()
}

fn engine_request(r: usize) -> Request {
    Request {
        id: format!("r{r}").into(),
        adapter: lorafleet_engine::AdapterId::new((r % ADAPTERS) as u64 + 1),
        prompt: Prompt::TokenIds(prompt(r)),
        params: Sampling {
            max_tokens: NEW,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        }
        .validate()
        .unwrap(),
    }
}

fn source(i: usize, dir: &std::path::Path) -> AdapterSource {
    AdapterSource {
        name: format!("a{i}"),
        dir: dir.to_owned(),
        declared_base_hash: None,
        digest: None,
    }
}

/// Runs the workload on a bare engine; returns generated tokens.
fn run_engine(e: &mut Engine) -> usize {
    for r in 0..REQUESTS {
        e.submit(engine_request(r)).unwrap();
    }
    let mut generated = 0;
    while e.has_work() {
        for (_, ev) in e.step().unwrap() {
            if let Event::Delta { token_ids, .. } = ev {
                generated += token_ids.len();
            }
        }
    }
    generated
}

async fn run_handle(h: &EngineHandle) -> usize {
    let mut tasks = Vec::new();
    for r in 0..REQUESTS {
        // One task per request, as the gRPC service has: submitting them one
        // after another would admit one request per engine step.
        let h = h.clone();
        tasks.push(tokio::spawn(async move {
            let (_, mut stream) = h.submit(engine_request(r)).await.unwrap();
            let mut n = 0;
            while let Some(ev) = stream.next().await {
                if let Event::Delta { token_ids, .. } = ev {
                    n += token_ids.len();
                }
            }
            n
        }));
    }
    let mut generated = 0;
    for t in tasks {
        generated += t.await.unwrap();
    }
    generated
}

async fn run_grpc(
    client: &pb::worker_client::WorkerClient<tonic::transport::Channel>,
    descriptors: &[pb::AdapterDescriptor],
) -> usize {
    let mut tasks = Vec::new();
    for r in 0..REQUESTS {
        let mut c = client.clone();
        let request = pb::GenerateRequest {
            request_id: format!("r{r}"),
            adapter: Some(descriptors[r % ADAPTERS].clone()),
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds {
                ids: prompt(r),
            })),
            sampling: Some(pb::SamplingParams {
                max_tokens: NEW as u32,
                temperature: Some(0.0),
                ignore_eos: true,
                ..Default::default()
            }),
            trace_context: None,
            fairness_key: String::new(),
            fairness_weight: 0.0,
        };
        tasks.push(tokio::spawn(async move {
            let mut stream = c.generate(request).await.unwrap().into_inner();
            let mut n = 0;
            while let Some(ev) = stream.message().await.unwrap() {
                if let Some(pb::generate_event::Event::Delta(d)) = ev.event {
                    n += d.token_ids.len();
                }
            }
            n
        }));
    }
    let mut generated = 0;
    for t in tasks {
        generated += t.await.unwrap();
    }
    generated
}

fn main() {
    let model = standin::model();
    let dirs = standin::adapters(ADAPTERS);
    let rt = tokio::runtime::Runtime::new().unwrap();
    println!(
        "gRPC overhead, STAND-IN ~100M Llama (h={}, L={}), {REQUESTS} requests x {NEW} new tokens over {ADAPTERS} rank-{} adapters, {} threads",
        standin::HIDDEN,
        standin::LAYERS,
        standin::RANK,
        rayon::current_num_threads()
    );
    println!(
        "| path | generated tokens / round | median seconds | median tokens/s | best tokens/s | median vs engine |"
    );
    println!("|---|---:|---:|---:|---:|---:|");

    // Three copies of the engine, each warmed up (adapters on the device),
    // then timed in interleaved rounds so that drift in the machine's speed
    // hits every path alike.
    let load = || {
        let mut e = Engine::load_cpu(&model, settings()).unwrap();
        for (i, d) in dirs.iter().enumerate() {
            e.register_adapter(
                lorafleet_engine::AdapterId::new(i as u64 + 1).unwrap(),
                source(i, d),
            )
            .unwrap();
        }
        e
    };
    let mut bare = load();
    run_engine(&mut bare);

    let handle = EngineHandle::spawn(load(), Duration::from_millis(250));
    rt.block_on(run_handle(&handle));

    let served = load();
    let info = WorkerInfo::describe(&served, "bench", "standin".into(), &settings());
    let base_hash = served.base_hash().to_owned();
    let served = EngineHandle::spawn(served, Duration::from_millis(250));
    let adapters_root = standin::root().join("adapters");
    let roots = ArtifactRoots::new(std::slice::from_ref(&adapters_root)).unwrap();
    let descriptors: Vec<pb::AdapterDescriptor> = dirs
        .iter()
        .enumerate()
        .map(|(i, d)| pb::AdapterDescriptor {
            lora_int_id: i as u64 + 1,
            artifact_uri: d.file_name().unwrap().to_string_lossy().into_owned(),
            artifact_sha256: artifact::digest(d).unwrap(),
            base_hash: base_hash.to_string(),
            rank: standin::RANK as u32,
            display_name: format!("a{i}"),
            ..Default::default()
        })
        .collect();
    let cache = tempfile::tempdir().unwrap();
    let service = WorkerService::new(
        served.clone(),
        roots,
        cache.path().to_owned(),
        info,
        Arc::new(AtomicBool::new(false)),
    );
    let client = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(pb::worker_server::WorkerServer::new(service))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let client = pb::worker_client::WorkerClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        run_grpc(&client, &descriptors).await;
        client
    });

    // Per path: (tokens, best seconds, all seconds).
    let mut times: [Vec<f64>; 3] = Default::default();
    let mut tokens = [0usize; 3];
    for _ in 0..ROUNDS {
        let t = Instant::now();
        tokens[0] = run_engine(&mut bare);
        times[0].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        tokens[1] = rt.block_on(run_handle(&handle));
        times[1].push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        tokens[2] = rt.block_on(run_grpc(&client, &descriptors));
        times[2].push(t.elapsed().as_secs_f64());
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let engine_tps = tokens[0] as f64 / median(&times[0]);
    let names = [
        "engine, in-process",
        "EngineHandle, in-process",
        "gRPC service, loopback",
    ];
    for (i, name) in names.iter().enumerate() {
        let tps = tokens[i] as f64 / median(&times[i]);
        let best = tokens[i] as f64 / times[i].iter().copied().fold(f64::MAX, f64::min);
        println!(
            "| {name} | {} | {:.2} | {tps:.1} | {best:.1} | {:.1}% |",
            tokens[i],
            median(&times[i]),
            tps / engine_tps * 100.0
        );
    }
    handle.shutdown();
    served.shutdown();
}
