//! The fleet view: workers, their adapters' residency, and each adapter's
//! recent request and device-hit rates.

use super::*;

/// The window the per-adapter rates are measured over.
const RATE_WINDOW_SECS: i64 = 300;

#[derive(Debug, sqlx::FromRow)]
struct AdapterTraffic {
    lora_int_id: i64,
    requests: i64,
    device_hits: i64,
}

/// The fleet as this replica sees it, with the whole fleet's per-adapter
/// rates from the audit log (the wire shape `GET /admin/v1/fleet` answers).
#[derive(Debug)]
pub struct FleetView;

impl Query for FleetView {
    type Output = Value;
    const NEED: Need = Need::Read;

    async fn run(self, s: &AdminState) -> Result<Value, AdminError> {
        let mut workers = Vec::new();
        for w in s.fleet.workers() {
            let st = w.state();
            let mut tiers: BTreeMap<&'static str, Vec<u64>> = BTreeMap::new();
            for (id, r) in st.adapters.iter() {
                tiers.entry(r.label()).or_default().push(id.get());
            }
            for v in tiers.values_mut() {
                v.sort_unstable();
            }
            let up = w.up();
            let status = if st.draining && st.connected {
                "draining"
            } else if up {
                "serving"
            } else {
                "down"
            };
            workers.push(json!({
                "addr": w.addr,
                "worker_id": st.worker_id.as_str(),
                "up": up,
                "status": status,
                "base_model": st.base_name,
                "base_hash": st.base_hash.as_deref(),
                "quantization": st.quantization,
                "weights_bytes": st.weights_bytes,
                "load": st.load,
                "kv_blocks_used": st.kv_blocks_used,
                "kv_blocks_total": st.kv_blocks_total,
                "in_flight": w.in_flight.load(std::sync::atomic::Ordering::Relaxed),
                "adapters": tiers,
                "last_report_ms_ago": st.last_report.map(|t| t.elapsed().as_millis() as u64),
            }));
        }
        // From the audit log, so the rates are the whole fleet's (every
        // gateway replica's requests), not this replica's alone.
        let traffic: Vec<AdapterTraffic> = sqlx::query_as(TRAFFIC_SQL)
            .bind(RATE_WINDOW_SECS as f64)
            .fetch_all(&s.pool)
            .await
            .map_err(db_error)?;
        let adapters: Vec<Value> = traffic
            .iter()
            .map(|t| {
                json!({
                    "lora_int_id": t.lora_int_id,
                    "requests": t.requests,
                    "requests_per_min": t.requests as f64 * 60.0 / RATE_WINDOW_SECS as f64,
                    "device_hit_rate": t.device_hits as f64 / t.requests.max(1) as f64,
                })
            })
            .collect();
        Ok(
            json!({ "workers": workers, "adapters": adapters, "rate_window_secs": RATE_WINDOW_SECS }),
        )
    }
}

/// The fleet view's adapter traffic over the last `$1` seconds of the audit
/// log (its partitions of those seconds alone).
pub const TRAFFIC_SQL: &str = "SELECT lora_int_id, count(*) AS requests,
        count(*) FILTER (WHERE adapter_residency = 'device') AS device_hits
     FROM audit_log
     WHERE lora_int_id IS NOT NULL AND received_at > now() - make_interval(secs => $1)
     GROUP BY lora_int_id ORDER BY lora_int_id";
