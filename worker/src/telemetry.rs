//! Prometheus metrics: the recorder, the `/metrics` endpoint, and the names
//! every part of the worker records under.

use std::time::Duration;

use lorafleet_engine::pool::Residency;
use lorafleet_engine::{EngineStats, StepStats};
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Buckets for latencies, in seconds.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];
/// Buckets for an adapter's copy into a device slot, in seconds: from a
/// small adapter over PCIe to a large one from pageable memory.
const UPLOAD_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];
/// Buckets for batch sizes and distinct adapters per batch.
const COUNT_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0];

/// Installs the global recorder and serves `GET /metrics` on `listener`.
pub fn install(listener: TcpListener) -> Result<(), metrics_exporter_prometheus::BuildError> {
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full("lorafleet_slot_upload_seconds".into()),
            UPLOAD_BUCKETS,
        )?
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            LATENCY_BUCKETS,
        )?
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Prefix("lorafleet_batch_".into()),
            COUNT_BUCKETS,
        )?
        .install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    tokio::spawn(serve(listener, handle));
    Ok(())
}

/// A deliberately small HTTP/1.1 responder: one request per connection,
/// `GET /metrics` or 404.
async fn serve(listener: TcpListener, handle: PrometheusHandle) {
    loop {
        let Ok((mut conn, _)) = listener.accept().await else {
            continue;
        };
        let handle = handle.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            let mut read = 0;
            while read < buf.len() {
                match conn.read(&mut buf[read..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => read += n,
                }
                if buf[..read].windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            let head = String::from_utf8_lossy(&buf[..read]);
            let (status, body) = if head.starts_with("GET /metrics ") {
                ("200 OK", handle.render())
            } else {
                ("404 Not Found", "not found\n".to_owned())
            };
            let response = format!(
                "HTTP/1.1 {status}\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(response.as_bytes()).await;
            let _ = conn.shutdown().await;
        });
    }
}

/// The batch-heterogeneity label of a step: how many distinct adapters it
/// ran, in a few buckets so the label set stays small.
pub fn heterogeneity(distinct_adapters: usize) -> &'static str {
    match distinct_adapters {
        0 => "0",
        1 => "1",
        2..=4 => "2-4",
        5..=16 => "5-16",
        _ => "17+",
    }
}

/// After each engine step.
pub fn record_step(step: &StepStats, generated: usize, took: Duration) {
    if step.sequences > 0 {
        histogram!("lorafleet_batch_size").record(step.sequences as f64);
        histogram!("lorafleet_batch_distinct_adapters").record(step.distinct_adapters as f64);
        // A pure decode step runs one token per sequence; anything more
        // carries prefill work.
        let phase = if step.tokens == step.sequences {
            "decode"
        } else {
            "prefill"
        };
        histogram!(
            "lorafleet_step_duration_seconds",
            "phase" => phase,
            "adapters" => heterogeneity(step.distinct_adapters)
        )
        .record(took.as_secs_f64());
    }
    counter!("lorafleet_generated_tokens_total").increment(generated as u64);
    counter!("lorafleet_preemptions_total").increment(step.preempted as u64);
    counter!("lorafleet_late_masks_total").increment(step.late_masks as u64);
}

/// Once, at start: how the backend divided device memory (absent on the
/// CPU backend, which has no memory of its own).
pub fn record_memory_plan(plan: &lorafleet_engine::backend::cuda::plan::MemoryPlan) {
    for (part, bytes) in plan.parts() {
        gauge!("lorafleet_device_memory_plan_bytes", "part" => part).set(bytes as f64);
    }
}

/// Whenever the engine publishes a report: device memory in use (the
/// device's own account, other processes included) and how long each slot
/// write since the last report held the engine thread (on the GPU the
/// copy itself then runs on its own stream).
pub fn record_device(
    memory: Option<lorafleet_engine::backend::DeviceMemory>,
    uploads: &[std::time::Duration],
) {
    if let Some(m) = memory {
        gauge!("lorafleet_device_memory_used_bytes").set(m.used as f64);
        gauge!("lorafleet_device_memory_total_bytes").set(m.total as f64);
    }
    let h = histogram!("lorafleet_slot_upload_seconds");
    for d in uploads {
        h.record(d.as_secs_f64());
    }
}

/// The base model's name, the label of the device-time series.
static BASE_MODEL: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Names the base model this worker serves, once at start.
pub fn set_base_model(name: &str) {
    let _ = BASE_MODEL.set(name.to_owned());
}

/// Whenever the engine publishes a report.
pub fn record_stats(stats: &EngineStats) {
    // Device time, for chargeback beside the audit log's per-request
    // shares: the forward passes' time (what the requests' device_time
    // adds up to) and the adapter copies into device slots. Cumulative
    // seconds that only grow (`rate()` reads them as counters); gauges,
    // because the recorder's counters hold whole numbers.
    let base_model = BASE_MODEL.get().cloned().unwrap_or_default();
    gauge!("lorafleet_device_seconds_total", "base_model" => base_model.clone())
        .set(stats.run.busy.as_secs_f64());
    gauge!("lorafleet_adapter_load_seconds_total", "base_model" => base_model)
        .set(stats.run.loads.as_secs_f64());
    gauge!("lorafleet_running_sequences").set(stats.running as f64);
    gauge!("lorafleet_queue_depth").set(stats.waiting as f64);
    gauge!("lorafleet_kv_blocks_used").set(stats.kv_blocks_used as f64);
    // The prefix cache: blocks kept for reuse, and prompt positions looked
    // up and found (their ratio is the hit rate in tokens).
    gauge!("lorafleet_prefix_cache_blocks").set(stats.kv_blocks_cached as f64);
    // Fair admission, per fairness key (the gateway sends the tenant's id).
    for share in &stats.fair_shares {
        let key = if share.key.is_empty() {
            "default".to_owned()
        } else {
            share.key.clone()
        };
        gauge!("lorafleet_fair_waiting_requests", "key" => key.clone()).set(share.waiting as f64);
        gauge!("lorafleet_fair_served_tokens", "key" => key).set(share.served);
    }
    counter!("lorafleet_prefix_cache_queried_tokens_total").absolute(stats.prefix.queried_tokens);
    counter!("lorafleet_prefix_cache_hit_tokens_total").absolute(stats.prefix.hit_tokens);
    gauge!("lorafleet_kv_utilization")
        .set(stats.kv_blocks_used as f64 / stats.kv_blocks_total.max(1) as f64);
    // The memory budget shared by KV blocks and adapter slots: how it is
    // divided now (KV blocks with contents, filled slots, free).
    if let Some(m) = stats.memory {
        for (part, bytes) in [("kv", m.kv), ("adapters", m.adapters), ("free", m.free())] {
            gauge!("lorafleet_memory_budget_bytes", "part" => part).set(bytes as f64);
        }
    }
    let mut resident = [0usize; 3];
    for a in &stats.adapters {
        match a.residency {
            Residency::Device => resident[0] += 1,
            Residency::Host => resident[1] += 1,
            Residency::Loading => resident[2] += 1,
            Residency::NotLoaded => {}
        }
    }
    for (tier, n) in ["device", "host", "loading"].iter().zip(resident) {
        gauge!("lorafleet_adapters_resident", "tier" => *tier).set(n as f64);
    }
    let p = stats.pool;
    counter!("lorafleet_adapter_hits_total", "tier" => "device").absolute(p.device_hits);
    counter!("lorafleet_adapter_hits_total", "tier" => "host").absolute(p.host_hits);
    counter!("lorafleet_adapter_misses_total").absolute(p.misses);
    counter!("lorafleet_adapter_loads_total", "tier" => "host").absolute(p.host_loads);
    counter!("lorafleet_adapter_loads_total", "tier" => "device").absolute(p.device_loads);
    counter!("lorafleet_adapter_evictions_total", "tier" => "host").absolute(p.host_evictions);
    counter!("lorafleet_adapter_evictions_total", "tier" => "device").absolute(p.device_evictions);
    counter!("lorafleet_adapter_load_failures_total").absolute(p.load_failures);
    // Copies into free slots started for waiting requests, and the
    // admissions that found their adapter there.
    counter!("lorafleet_adapter_prefetches_total", "outcome" => "started").absolute(p.prefetches);
    counter!("lorafleet_adapter_prefetches_total", "outcome" => "hit").absolute(p.prefetch_hits);
    // Loads at admission that a prefetch could have started a step before.
    counter!("lorafleet_adapter_late_loads_total").absolute(p.late_loads);
}

/// A Generate call's outcome: "ok", or the gRPC code's name.
pub fn record_request(outcome: &'static str) {
    counter!("lorafleet_requests_total", "outcome" => outcome).increment(1);
}

pub fn record_ttft(d: Duration) {
    histogram!("lorafleet_time_to_first_token_seconds").record(d.as_secs_f64());
}

/// How long a request waited for its adapter to be in a ready device slot.
pub fn record_adapter_wait(d: Duration) {
    histogram!("lorafleet_adapter_wait_seconds").record(d.as_secs_f64());
}

pub fn record_inter_token(d: Duration) {
    histogram!("lorafleet_inter_token_latency_seconds").record(d.as_secs_f64());
}

/// Time to compile (or find compiled) one request's constraint, on a
/// blocking thread.
pub fn record_constraint_compile(d: Duration) {
    histogram!("lorafleet_constraint_compile_seconds").record(d.as_secs_f64());
}

/// Time to tokenize and check one prompt, on a blocking thread.
pub fn record_tokenize(d: Duration) {
    histogram!("lorafleet_tokenize_seconds").record(d.as_secs_f64());
}
