//! The fleet view: workers and their adapters' residency.

use super::*;

pub(super) async fn fleet_view(
    State(s): State<AdminState>,
    headers: HeaderMap,
) -> Result<Response, AdminError> {
    let actor = authorize(&s, &headers, Need::Read)?;
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
        workers.push(json!({
            "addr": w.addr,
            "worker_id": st.worker_id,
            "up": w.up(),
            "base_hash": st.base_hash,
            "load": st.load,
            "in_flight": w.in_flight.load(std::sync::atomic::Ordering::Relaxed),
            "adapters": tiers,
            "last_report_ms_ago": st.last_report.map(|t| t.elapsed().as_millis() as u64),
        }));
    }
    Ok(reply(StatusCode::OK, &actor, json!({ "workers": workers })))
}
