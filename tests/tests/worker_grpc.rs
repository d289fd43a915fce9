//! The real `lorafleet-worker serve` on the fixture model, over gRPC on a
//! loopback port the OS picks.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use lorafleet_proto::worker::v1 as pb;
use lorafleet_proto::worker::v1::worker_client::WorkerClient;
use lorafleet_tests::{
    Server, binary, engine_fixtures, fixture_worker, worker_channel, worker_command,
};
use serde_json::Value;
use tonic::Code;
use tonic::transport::Channel;

type Worker = Server;

fn start(extra_root: &Path) -> Worker {
    start_with(extra_root, "2")
}

fn start_with(extra_root: &Path, max_loras: &str) -> Worker {
    let fixtures = engine_fixtures();
    let mut cmd = worker_command();
    cmd.args(["--worker-id", "w0", "--max-loras", max_loras])
        .arg("--model")
        .arg(fixtures.join("llama-gqa"))
        .arg("--artifact-root")
        .arg(fixtures.join("adapters"))
        .arg("--artifact-root")
        .arg(extra_root);
    Server::start(cmd, "lorafleet-worker listening ")
}

async fn client(w: &Worker) -> WorkerClient<Channel> {
    WorkerClient::new(worker_channel(w.addr("grpc")).await.expect("connect"))
}

/// `GET /metrics`, as (series with labels -> value).
fn scrape(addr: &str) -> std::collections::BTreeMap<String, f64> {
    use std::io::{Read, Write};
    let mut conn = std::net::TcpStream::connect(addr).expect("connect to /metrics");
    conn.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut body = String::new();
    conn.read_to_string(&mut body).unwrap();
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            l.rsplit_once(' ')
                .and_then(|(k, v)| v.parse().ok().map(|v| (k.to_owned(), v)))
        })
        .collect()
}

fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(engine_fixtures().join(name)).unwrap()).unwrap()
}

fn descriptor(adapter: &str, id: u64) -> pb::AdapterDescriptor {
    pb::AdapterDescriptor {
        lora_int_id: id,
        artifact_uri: format!("llama-gqa/{adapter}"),
        artifact_sha256: json("artifact_digests.json")[format!("llama-gqa/{adapter}")]
            .as_str()
            .unwrap()
            .into(),
        base_hash: json("base_hashes.json")["llama-gqa"]
            .as_str()
            .unwrap()
            .into(),
        rank: 16,
        display_name: adapter.into(),
        ..Default::default()
    }
}

fn request(
    id: &str,
    adapter: Option<pb::AdapterDescriptor>,
    ids: Vec<u32>,
    max_tokens: u32,
) -> pb::GenerateRequest {
    pb::GenerateRequest {
        request_id: id.into(),
        adapter,
        prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids })),
        sampling: Some(pb::SamplingParams {
            max_tokens,
            temperature: Some(0.0),
            ..Default::default()
        }),
        trace_context: None,
        fairness_key: String::new(),
        fairness_weight: 0.0,
    }
}

/// Runs a Generate call to the end: (tokens, finished event).
async fn generate(
    c: &mut WorkerClient<Channel>,
    r: pb::GenerateRequest,
) -> Result<(Vec<u32>, pb::Finished), tonic::Status> {
    let mut stream = c.generate(r).await?.into_inner();
    let mut tokens = Vec::new();
    let mut accepted = false;
    while let Some(event) = stream.message().await? {
        match event.event.unwrap() {
            pb::generate_event::Event::Accepted(_) => accepted = true,
            pb::generate_event::Event::PromptLogprobs(_) => {}
            pb::generate_event::Event::Delta(d) => tokens.extend(d.token_ids),
            pb::generate_event::Event::Finished(f) => {
                assert!(accepted, "Accepted comes first");
                return Ok((tokens, f));
            }
        }
    }
    panic!("the stream ended without Finished");
}

#[tokio::test]
async fn concurrent_adapter_streams_match_the_goldens_and_bad_artifacts_are_refused() {
    let extra = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(outside.path(), extra.path().join("escape")).unwrap();
    let w = start(extra.path());
    let mut c = client(&w).await;

    let info = c.info(pb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(
        info.base_model.as_ref().unwrap().base_hash,
        json("base_hashes.json")["llama-gqa"].as_str().unwrap()
    );
    // On a GPU, Info carries the device memory plan; the CPU backend has
    // no memory of its own to plan.
    let plan = info.memory_plan;
    match info.backend.as_str() {
        "cuda" => {
            let p = plan.expect("a memory plan on the cuda backend");
            let parts = [
                p.weights_bytes,
                p.kv_cache_bytes,
                p.adapter_slots_bytes,
                p.workspace_bytes,
                p.margin_bytes,
            ];
            assert!(parts.iter().all(|&b| b > 0), "{p:?}");
            assert!(parts.iter().sum::<u64>() < p.device_total_bytes, "{p:?}");
        }
        other => assert_eq!(plan, None, "{other}"),
    }

    let golden = json("golden.json");
    let max_new = golden["max_new_tokens"].as_u64().unwrap() as u32;
    let names = ["qv-r8", "patterns", "layer1-mlp"];
    let cases: Vec<&Value> = golden["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| {
            c["model"] == "llama-gqa"
                && (c["adapter"].is_null() || names.contains(&c["adapter"].as_str().unwrap()))
        })
        .collect();
    let cases_len = cases.len();
    let mut generated = 0;
    let mut calls = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let adapter = case["adapter"]
            .as_str()
            .map(|a| descriptor(a, names.iter().position(|n| *n == a).unwrap() as u64 + 1));
        let ids: Vec<u32> = serde_json::from_value(case["prompt_ids"].clone()).unwrap();
        let mut c = c.clone();
        calls.push(tokio::spawn(async move {
            generate(&mut c, request(&format!("g{i}"), adapter, ids, max_new)).await
        }));
    }
    let (mut device_seconds, mut load_seconds) = (0.0, 0.0);
    // Per adapter, the requests charged for its copy into a device slot.
    let mut charged: std::collections::BTreeMap<String, usize> = Default::default();
    for (call, case) in calls.into_iter().zip(&cases) {
        let (tokens, finished) = call.await.unwrap().expect("the stream succeeds");
        generated += tokens.len();
        let want: Vec<u32> = serde_json::from_value(case["greedy"].clone()).unwrap();
        assert_eq!(tokens, want, "{} / {}", case["adapter"], case["prompt"]);
        assert_eq!(
            finished.usage.unwrap().completion_tokens as usize,
            want.len()
        );
        let seconds = |d: Option<_>| {
            d.and_then(|d| Duration::try_from(d).ok())
                .map_or(0.0, |d: Duration| d.as_secs_f64())
        };
        device_seconds += seconds(finished.device_time);
        let load = seconds(finished.load_time);
        load_seconds += load;
        match case["adapter"].as_str() {
            Some(a) => *charged.entry(a.to_owned()).or_default() += usize::from(load > 0.0),
            None => assert_eq!(load, 0.0, "the base model copies no adapter"),
        }
    }
    // Each adapter was copied in on demand while its first requests
    // waited: some of them carry the copy's time.
    assert_eq!(charged.len(), names.len(), "{charged:?}");
    assert!(charged.values().all(|&n| n > 0), "{charged:?}");

    // Refusals, each with its status; the worker keeps serving.
    let bad = |f: fn(&mut pb::AdapterDescriptor)| {
        let mut d = descriptor("qv-r8", 50);
        f(&mut d);
        request("bad", Some(d), vec![1, 2, 3], 2)
    };
    let cases: Vec<(pb::GenerateRequest, Code, &str)> = vec![
        (
            bad(|d| d.artifact_uri = "../llama-gqa/qv-r8".into()),
            Code::InvalidArgument,
            "\"..\"",
        ),
        (
            bad(|d| d.artifact_uri = "escape".into()),
            Code::InvalidArgument,
            "outside the artifact roots",
        ),
        (
            bad(|d| d.artifact_uri = "s3://bucket/qv-r8".into()),
            Code::InvalidArgument,
            "--artifact-store",
        ),
        (
            bad(|d| d.artifact_uri = "ftp://host/qv-r8".into()),
            Code::InvalidArgument,
            "file: URIs",
        ),
        (
            bad(|d| d.artifact_uri = "llama-gqa/nope".into()),
            Code::NotFound,
            "not found",
        ),
        (
            bad(|d| d.artifact_sha256 = "0".repeat(64)),
            Code::FailedPrecondition,
            "adapter.artifact_sha256",
        ),
        (
            bad(|d| d.base_hash = "f".repeat(64)),
            Code::FailedPrecondition,
            "adapter.base_hash",
        ),
        (bad(|d| d.rank = 64), Code::InvalidArgument, "adapter.rank"),
        (
            bad(|d| d.artifact_sha256 = "xyz".into()),
            Code::InvalidArgument,
            "adapter.artifact_sha256",
        ),
        (
            request("", None, vec![1], 2),
            Code::InvalidArgument,
            "request_id",
        ),
        (
            request("r", None, vec![1], 0),
            Code::InvalidArgument,
            "sampling.max_tokens",
        ),
        (
            request("r", None, vec![100000], 2),
            Code::InvalidArgument,
            "token_ids",
        ),
        // Longer than max_model_len (512): refused before the engine, the
        // prompt being at fault (it leaves no room for a single token).
        (
            request("r", None, vec![5; 600], 2),
            Code::InvalidArgument,
            "prompt: the prompt (600 tokens)",
        ),
        (
            pb::GenerateRequest {
                fairness_weight: -1.0,
                ..request("r", None, vec![5], 2)
            },
            Code::InvalidArgument,
            "fairness_weight",
        ),
        (
            pb::GenerateRequest {
                fairness_key: "k".repeat(129),
                ..request("r", None, vec![5], 2)
            },
            Code::InvalidArgument,
            "fairness_key",
        ),
    ];
    // No refusal is an oracle: none shows the artifact's actual digest or
    // a path on the worker's machine.
    let actual_digest = json("artifact_digests.json")["llama-gqa/qv-r8"]
        .as_str()
        .unwrap()
        .to_owned();
    let fixtures = engine_fixtures().canonicalize().unwrap();
    for (r, code, text) in cases {
        let err = generate(&mut c, r).await.expect_err("refused");
        assert_eq!(err.code(), code, "{}", err.message());
        assert!(
            err.message().contains(text),
            "expected {text:?} in {}",
            err.message()
        );
        assert!(!err.message().contains(&actual_digest), "{}", err.message());
        assert!(
            !err.message().contains(fixtures.to_str().unwrap()),
            "{}",
            err.message()
        );
        // The machine-readable parts travel in the status details: a
        // reason code always, and the field where one is at fault.
        use lorafleet_proto::tonic_types::StatusExt;
        let info = err.get_details_error_info().expect("an ErrorInfo");
        assert_eq!(info.domain, "lorafleet.worker");
        assert!(!info.reason.is_empty());
        let names_a_field = text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
        if code == Code::InvalidArgument && names_a_field {
            let field = err
                .get_details_bad_request()
                .and_then(|b| b.field_violations.into_iter().next())
                .map(|v| v.field)
                .unwrap_or_default();
            assert!(field.contains(text), "field {field:?} for {text:?}");
        }
    }
    let (tokens, _) = generate(
        &mut c,
        request("after", Some(descriptor("qv-r8", 1)), vec![1, 2, 3], 3),
    )
    .await
    .unwrap();
    assert_eq!(tokens.len(), 3, "still serving");

    // The counters moved. Pool counters are published with each report, so
    // wait for one that has them.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = scrape(w.addr("metrics"));
        let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
        if get("lorafleet_adapter_loads_total{tier=\"host\"}") >= 3.0 {
            assert!(
                get("lorafleet_generated_tokens_total") >= generated as f64,
                "{m:?}"
            );
            assert!(
                get("lorafleet_time_to_first_token_seconds_count") >= cases_len as f64,
                "{m:?}"
            );
            assert!(
                get("lorafleet_inter_token_latency_seconds_count") > 0.0,
                "{m:?}"
            );
            // Every prompt was tokenized and checked off the engine thread.
            assert!(
                get("lorafleet_tokenize_seconds_count") >= cases_len as f64,
                "{m:?}"
            );
            assert!(
                get("lorafleet_requests_total{outcome=\"ok\"}") >= cases_len as f64,
                "{m:?}"
            );
            assert!(
                get("lorafleet_requests_total{outcome=\"invalid_argument\"}") >= 5.0,
                "{m:?}"
            );
            assert!(
                get("lorafleet_requests_total{outcome=\"failed_precondition\"}") >= 2.0,
                "{m:?}"
            );
            assert!(
                get("lorafleet_batch_size_count") > 0.0
                    && get("lorafleet_batch_distinct_adapters_count") > 0.0
            );
            // Every copy into a device slot was timed, and on a GPU the
            // memory plan and the memory in use are published.
            // The engine's device time, cumulative: at least what the
            // requests above were charged (their shares add up to it).
            let base = info.base_model.as_ref().unwrap().name.clone();
            let busy = get(&format!(
                "lorafleet_device_seconds_total{{base_model=\"{base}\"}}"
            ));
            let copies = get(&format!(
                "lorafleet_adapter_load_seconds_total{{base_model=\"{base}\"}}"
            ));
            assert!(busy >= device_seconds * 0.99 && busy > 0.0, "{busy} {m:?}");
            assert!(
                copies >= load_seconds * 0.99 && copies > 0.0,
                "{copies} {m:?}"
            );
            let uploads = get("lorafleet_slot_upload_seconds_count");
            assert!(uploads >= 1.0, "{m:?}");
            // Each adapter request's wait for its adapter.
            assert!(get("lorafleet_adapter_wait_seconds_count") >= 1.0, "{m:?}");
            assert_eq!(
                uploads,
                get("lorafleet_adapter_loads_total{tier=\"device\"}"),
                "{m:?}"
            );
            if let Some(p) = plan {
                assert_eq!(
                    get("lorafleet_device_memory_plan_bytes{part=\"weights\"}"),
                    p.weights_bytes as f64,
                    "{m:?}"
                );
                assert_eq!(
                    get("lorafleet_device_memory_plan_bytes{part=\"kv_cache\"}"),
                    p.kv_cache_bytes as f64,
                    "{m:?}"
                );
                let used = get("lorafleet_device_memory_used_bytes");
                assert!(used > p.weights_bytes as f64, "{m:?}");
                assert_eq!(
                    get("lorafleet_device_memory_total_bytes"),
                    p.device_total_bytes as f64
                );
            }
            assert!(
                m.contains_key("lorafleet_kv_utilization")
                    && m.contains_key("lorafleet_queue_depth")
            );
            // Step latency by phase and batch heterogeneity, and residency
            // by tier, as the dashboard reads them.
            let steps: f64 = m
                .iter()
                .filter(|(k, _)| {
                    k.starts_with("lorafleet_step_duration_seconds_count{")
                        && k.contains("adapters=\"1\"")
                })
                .map(|(_, v)| v)
                .sum();
            assert!(steps > 0.0, "{m:?}");
            assert!(
                get("lorafleet_adapters_resident{tier=\"device\"}")
                    + get("lorafleet_adapters_resident{tier=\"host\"}")
                    >= 1.0,
                "{m:?}"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the adapter loads never showed in /metrics: {m:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn sigterm_lets_running_streams_finish_refuses_new_ones_and_exits_zero() {
    let extra = tempfile::tempdir().unwrap();
    let mut w = start(extra.path());
    let mut c = client(&w).await;
    let mut long = request("long", None, vec![1, 2, 3], 500);
    long.sampling.as_mut().unwrap().ignore_eos = true;
    let mut stream = c.generate(long).await.unwrap().into_inner();
    stream.message().await.unwrap().expect("Accepted");
    stream.message().await.unwrap().expect("a first token");
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(w.child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());

    // The running stream still ends with all its tokens, not an error.
    let mut tokens = 1;
    let mut finished = false;
    while let Some(event) = stream.message().await.expect("the stream is not cut") {
        match event.event.unwrap() {
            pb::generate_event::Event::Delta(d) => tokens += d.token_ids.len(),
            pb::generate_event::Event::Finished(_) => finished = true,
            pb::generate_event::Event::Accepted(_)
            | pb::generate_event::Event::PromptLogprobs(_) => {}
        }
    }
    assert!(
        finished && tokens == 500,
        "the stream completed: {tokens} tokens"
    );

    // A new request is refused: UNAVAILABLE while draining, or no
    // connection once the worker has gone.
    let refused = match worker_channel(w.addr("grpc")).await.map(WorkerClient::new) {
        Err(_) => true,
        Ok(mut fresh) => match generate(&mut fresh, request("new", None, vec![1], 2)).await {
            Err(e) => {
                e.code() == Code::Unavailable
                    || e.code() == Code::Unknown
                    || e.code() == Code::Cancelled
            }
            Ok(_) => false,
        },
    };
    assert!(refused, "a request after SIGTERM must not be served");
    drop(stream);
    drop(c);

    let deadline = Instant::now() + Duration::from_secs(60);
    let exit = loop {
        if let Some(exit) = w.child.try_wait().unwrap() {
            break exit;
        }
        assert!(
            Instant::now() < deadline,
            "the worker did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(exit.success(), "exit 0 after draining: {exit}");
}

#[test]
fn serve_refuses_bad_flags_by_name() {
    let fixtures = engine_fixtures();
    let model = fixtures.join("llama-gqa");
    let roots = fixtures.join("adapters");
    // Every check of the flags' values is a unit test of
    // `ServeArgs::validate` (worker/src/server/flags.rs); here, that the
    // process reports them, and what clap refuses before them.
    let cases: &[(&[&str], &str)] = &[
        (&["--max-loras", "0"], "--max-loras: must be at least 1"),
        (
            &["--no-cuda-graphs"],
            "--no-cuda-graphs: the cpu backend has no CUDA graphs",
        ),
        (&["--grpc-listen", "not-an-address"], "--grpc-listen"),
    ];
    // Without an NVIDIA driver, asking for the GPU is a refusal that says so.
    let no_gpu: &[(&[&str], &str)] = &[(
        &["--backend", "cuda"],
        "--backend cuda: the NVIDIA driver library (libcuda.so) was not found",
    )];
    let has_driver = std::path::Path::new("/proc/driver/nvidia").exists();
    let cases = cases
        .iter()
        .chain(if has_driver { &[][..] } else { no_gpu });
    for (flags, expected) in cases {
        let out = Command::new(binary("lorafleet-worker"))
            .args(["serve", "--metrics-listen", "127.0.0.1:0"])
            .args(["--health-listen", "127.0.0.1:0"])
            // Defaults through the environment, so a case can override them by flag.
            .env("LORAFLEET_INSECURE_PLAINTEXT", "true")
            .env("LORAFLEET_WORKER_ID", "w")
            .env("LORAFLEET_GRPC_LISTEN", "127.0.0.1:0")
            .arg("--model")
            .arg(&model)
            .arg("--artifact-root")
            .arg(&roots)
            .args(flags.iter())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flags:?}");
        assert!(
            stderr.contains(expected),
            "{flags:?}: expected {expected:?} in {stderr}"
        );
    }
}

/// The next Watch report that satisfies `want`, within 30 s.
async fn next_report(
    watch: &mut tonic::Streaming<pb::WorkerReport>,
    what: &str,
    want: impl Fn(&pb::WorkerReport) -> bool,
) -> pb::WorkerReport {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let wait = deadline.saturating_duration_since(Instant::now());
        let report = tokio::time::timeout(wait, watch.message())
            .await
            .unwrap_or_else(|_| panic!("no Watch report showed {what}"))
            .expect("the Watch stream stays up")
            .expect("the Watch stream does not end");
        if want(&report) {
            return report;
        }
    }
}

fn state(report: &pb::WorkerReport, id: u64) -> Option<&pb::AdapterState> {
    report.adapters.iter().find(|a| a.lora_int_id == id)
}

#[tokio::test]
async fn a_cancelled_stream_frees_its_kv_blocks_and_carries_its_trace_id() {
    let extra = tempfile::tempdir().unwrap();
    let w = start(extra.path());
    let mut c = client(&w).await;
    let mut watch = c
        .watch(pb::WatchRequest {
            subscriber: "test".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = next_report(&mut watch, "a first report", |_| true).await;
    assert_eq!(first.load.unwrap().kv_blocks_used, 0);

    // A (adapter 1) would outlive B (the base model) by 100 tokens if it ran
    // to the end; it is cancelled after 100 tokens.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut a = request("A", Some(descriptor("qv-r8", 1)), vec![1, 2, 3], 500);
    a.sampling.as_mut().unwrap().ignore_eos = true;
    a.trace_context = Some(pb::TraceContext {
        traceparent: format!("00-{trace_id}-00f067aa0ba902b7-01"),
        tracestate: String::new(),
    });
    let mut b = request("B", None, vec![4, 5, 6], 400);
    b.sampling.as_mut().unwrap().ignore_eos = true;
    let mut a_stream = c.generate(a).await.unwrap().into_inner();
    let mut b_stream = c.clone().generate(b).await.unwrap().into_inner();
    // Both hold many blocks (16 tokens each) before A is cancelled.
    let mut a_tokens = 0;
    while a_tokens < 100 {
        if let Some(pb::generate_event::Event::Delta(d)) =
            a_stream.message().await.unwrap().expect("A streams").event
        {
            a_tokens += d.token_ids.len();
        }
    }
    b_stream.message().await.unwrap().expect("B's Accepted");
    let both = next_report(&mut watch, "both sequences running", |r| {
        let load = r.load.unwrap();
        load.running_sequences == 2 && load.kv_blocks_used >= 12
    })
    .await;
    let both_kv = both.load.unwrap().kv_blocks_used;
    assert_eq!(state(&both, 1).unwrap().active_requests, 1);
    let b_done = tokio::spawn(async move {
        let mut n = 0;
        while let Some(e) = b_stream.message().await.unwrap() {
            if let Some(pb::generate_event::Event::Delta(d)) = e.event {
                n += d.token_ids.len();
            }
        }
        n
    });

    drop(a_stream);
    // Freed at once: A is gone while B still runs, with fewer blocks in use.
    let after = next_report(&mut watch, "A freed while B runs", |r| {
        state(r, 1).is_some_and(|s| s.active_requests == 0)
    })
    .await;
    let load = after.load.unwrap();
    assert_eq!(
        load.running_sequences, 1,
        "B still runs when A's sequence is gone: {load:?}"
    );
    assert!(
        load.kv_blocks_used < both_kv,
        "A's blocks were freed: {} then {}",
        both_kv,
        load.kv_blocks_used
    );
    assert_eq!(b_done.await.unwrap(), 400, "B is unaffected");
    let idle = next_report(&mut watch, "no blocks in use", |r| {
        r.load.unwrap().kv_blocks_used == 0
    })
    .await;
    assert_eq!(idle.load.unwrap().running_sequences, 0);

    // The worker's structured log continues the caller's trace.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = w.log.lock().unwrap().clone();
        let accepted = lines.iter().find_map(|l| {
            let v: Value = serde_json::from_str(l).ok()?;
            (v["fields"]["message"] == "accepted" && v["span"]["request_id"] == "A").then_some(v)
        });
        if let Some(v) = accepted {
            assert_eq!(v["span"]["trace_id"], trace_id, "{v}");
            assert_eq!(v["span"]["lora_int_id"], 1, "{v}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no JSON \"accepted\" log line for A: {lines:#?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn watch_shows_an_adapter_load_then_its_eviction_past_the_device_slots() {
    let extra = tempfile::tempdir().unwrap();
    let w = start(extra.path()); // --max-loras 2
    let mut c = client(&w).await;
    let mut watch = c
        .watch(pb::WatchRequest {
            subscriber: "test".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = next_report(&mut watch, "a first report", |_| true).await;
    assert!(first.adapters.is_empty(), "{:?}", first.adapters);
    assert_eq!(first.capacity.unwrap().device_slots, 2);

    let device = pb::Residency::Device as i32;
    generate(
        &mut c,
        request("one", Some(descriptor("qv-r8", 1)), vec![1, 2, 3], 2),
    )
    .await
    .unwrap();
    let loaded = next_report(&mut watch, "adapter 1 on the device", |r| {
        state(r, 1).is_some_and(|s| s.residency == device)
    })
    .await;
    assert!(loaded.counters.unwrap().device_loads >= 1);

    for (id, name) in [(2, "patterns"), (3, "layer1-mlp")] {
        generate(
            &mut c,
            request(name, Some(descriptor(name, id)), vec![1, 2, 3], 2),
        )
        .await
        .unwrap();
    }
    let evicted = next_report(&mut watch, "adapter 1 evicted from the device", |r| {
        state(r, 1).is_some_and(|s| s.residency != device)
    })
    .await;
    assert_eq!(
        state(&evicted, 1).unwrap().residency,
        pb::Residency::Host as i32,
        "evicted to the host cache, not forgotten"
    );
    assert_eq!(state(&evicted, 3).unwrap().residency, device);
    assert!(evicted.counters.unwrap().device_evictions >= 1);
    let on_device = evicted
        .adapters
        .iter()
        .filter(|a| a.residency == device)
        .count();
    assert!(on_device <= 2, "never more than the slots: {evicted:?}");
}

/// With `max_loras = 4`, a fourth pin is refused, so one slot always serves
/// unpinned traffic; an unpinned adapter's request still completes.
#[tokio::test]
async fn pins_are_capped_and_unpinned_traffic_still_runs() {
    let extra = tempfile::tempdir().unwrap();
    let w = start_with(extra.path(), "4");
    let mut c = client(&w).await;
    let pin = |name: &str, id: u64| pb::LoadAdapterRequest {
        adapter: Some(descriptor(name, id)),
        target: pb::Residency::Device as i32,
        pin: Some(true),
    };
    for (id, name) in [(1, "qv-r8"), (2, "patterns"), (3, "layer1-mlp")] {
        c.load_adapter(pin(name, id)).await.unwrap();
    }
    let err = c.load_adapter(pin("o-r2", 4)).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
    assert!(err.message().contains("max_pinned"), "{}", err.message());
    for (id, name) in [(4, "o-r2"), (5, "k-r16"), (4, "o-r2")] {
        let (tokens, _) = generate(
            &mut c,
            request("free", Some(descriptor(name, id)), vec![1, 2, 3], 3),
        )
        .await
        .unwrap();
        assert_eq!(tokens.len(), 3);
    }
}

/// An artifact changed on disk after it was verified is never served: the
/// pool reads only the worker's verified copy (even after a host-tier
/// eviction), and once the adapter is unloaded the next use verifies the
/// root again and is refused by name.
#[tokio::test]
async fn a_changed_artifact_is_never_served_and_is_refused_after_an_unload() {
    let extra = tempfile::tempdir().unwrap();
    let changed = extra.path().join("changed");
    std::fs::create_dir_all(&changed).unwrap();
    let source = engine_fixtures().join("adapters/llama-gqa/qv-r8");
    for f in std::fs::read_dir(&source).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), changed.join(f.file_name())).unwrap();
    }
    let root = extra.path().to_str().unwrap().to_owned();
    let w = fixture_worker(
        "w0",
        &[
            "--max-loras",
            "2",
            "--max-cpu-loras",
            "2",
            "--artifact-root",
            &root,
        ],
    );
    let mut c = client(&w).await;
    let mut d = descriptor("qv-r8", 7);
    d.artifact_uri = "changed".into();
    let run = |id: &str, d: pb::AdapterDescriptor| request(id, Some(d), vec![1, 2, 3], 6);
    let (first, _) = generate(&mut c, run("first", d.clone())).await.unwrap();

    // Same shape, other weights.
    let weights = changed.join("adapter_model.safetensors");
    let mut bytes = std::fs::read(&weights).unwrap();
    let n = bytes.len();
    for b in &mut bytes[n - 256..] {
        *b ^= 0x40;
    }
    std::fs::write(&weights, &bytes).unwrap();

    // Other adapters push it out of both tiers; it comes back from the copy.
    for (id, name) in [(10, "patterns"), (11, "layer1-mlp"), (12, "o-r2")] {
        generate(&mut c, run("other", descriptor(name, id)))
            .await
            .unwrap();
    }
    let (again, _) = generate(&mut c, run("again", d.clone())).await.unwrap();
    assert_eq!(
        again, first,
        "served from the verified copy, not the changed file"
    );

    c.unload_adapter(pb::UnloadAdapterRequest { lora_int_id: 7 })
        .await
        .unwrap();
    let err = generate(&mut c, run("after", d)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    {
        use lorafleet_proto::tonic_types::StatusExt;
        assert_eq!(
            err.get_details_error_info().map(|i| i.reason).as_deref(),
            Some("artifact_digest_mismatch")
        );
        let field = err
            .get_details_bad_request()
            .and_then(|b| b.field_violations.into_iter().next())
            .map(|v| v.field);
        assert_eq!(field.as_deref(), Some("adapter.artifact_sha256"));
    }
    assert!(
        err.message().contains("adapter.artifact_sha256"),
        "{}",
        err.message()
    );
    let m = scrape(w.addr("metrics"));
    assert!(
        m.get("lorafleet_adapter_digest_mismatches_total")
            .is_some_and(|v| *v >= 1.0),
        "{m:?}"
    );
}

/// A killed worker cannot remove its default adapter cache, but its lock
/// ends with it: the next worker to start removes the directory, and leaves
/// a running worker's alone.
#[test]
fn a_killed_workers_cache_is_removed_by_the_next_start() {
    let cache_of = |w: &lorafleet_tests::Server, id: &str| {
        std::env::temp_dir().join(format!("lorafleet-adapter-cache-{id}-{}", w.child.id()))
    };
    let mut killed = lorafleet_tests::fixture_worker("cache-killed", &[]);
    let killed_cache = cache_of(&killed, "cache-killed");
    assert!(
        killed_cache.join(".lock").exists(),
        "{}",
        killed_cache.display()
    );
    killed.child.kill().unwrap();
    killed.child.wait().unwrap();
    assert!(
        killed_cache.exists(),
        "a killed worker leaves its cache behind"
    );
    let running = lorafleet_tests::fixture_worker("cache-running", &[]);
    let running_cache = cache_of(&running, "cache-running");
    let next = lorafleet_tests::fixture_worker("cache-next", &[]);
    assert!(
        !killed_cache.exists(),
        "the next start removes {}",
        killed_cache.display()
    );
    assert!(running_cache.exists(), "a running worker's cache stays");
    drop((running, next));
}
