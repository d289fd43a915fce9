//! The fleet: one row per worker, and the residency heatmap of adapters ×
//! workers with each adapter's request and device-hit rates. The page
//! refreshes its live part from `/console/fleet/live`.

use std::collections::BTreeMap;

use super::*;
use crate::admin::{FleetView, ListAdapters};

pub(super) async fn page(State(c): State<Console>, s: Session) -> Response {
    let data = load(&c, &s).await;
    show(&c, &s, "fleet.html", "fleet", Outcome::default(), data)
}

/// The live part alone, for the page's script to swap in.
pub(super) async fn live(State(c): State<Console>, s: Session) -> Response {
    match load(&c, &s).await {
        Ok(data) => c.render(Some(&s), "fleet_live.html", StatusCode::OK, data),
        Err(e) => c.error_page(Some(&s), &e),
    }
}

async fn load(c: &Console, s: &Session) -> Result<Value, ApiError> {
    let fleet = c.read(s, FleetView).await?;
    let adapters = c.read(s, ListAdapters::default()).await?;
    let mut workers: Vec<&Value> = fleet["workers"].as_array().into_iter().flatten().collect();
    let name = |w: &Value| {
        w["worker_id"]
            .as_str()
            .filter(|id| !id.is_empty())
            .or(w["addr"].as_str())
            .unwrap_or_default()
            .to_owned()
    };
    workers.sort_by_key(|w| name(w));
    // Per worker: adapter id -> tier.
    let mut tiers: Vec<BTreeMap<i64, String>> = Vec::new();
    let mut worker_rows = Vec::new();
    for w in &workers {
        let mut t = BTreeMap::new();
        if let Some(by_tier) = w["adapters"].as_object() {
            for (tier, ids) in by_tier {
                for id in ids
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_i64)
                {
                    let label = if tier == "not_loaded" { "absent" } else { tier };
                    t.insert(id, label.to_owned());
                }
            }
        }
        let used = w["kv_blocks_used"].as_u64().unwrap_or(0);
        let total = w["kv_blocks_total"].as_u64().unwrap_or(0);
        worker_rows.push(json!({
            "name": name(w),
            "addr": w["addr"],
            "status": w["status"],
            "base_model": w["base_model"],
            "base_hash": short(w["base_hash"].as_str().unwrap_or_default()),
            "load": w["load"],
            "in_flight": w["in_flight"],
            "kv_used": used,
            "kv_total": total,
            "kv_percent": (used * 100).checked_div(total).unwrap_or(0),
            "resident": t.values().filter(|v| v.as_str() == "device").count(),
        }));
        tiers.push(t);
    }
    let rates: BTreeMap<i64, &Value> = fleet["adapters"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|a| Some((a["lora_int_id"].as_i64()?, a)))
        .collect();
    let mut rows = Vec::new();
    for a in &adapters.adapters {
        let resident = tiers.iter().any(|t| t.contains_key(&a.lora_int_id));
        if a.state == "retired" && !resident {
            continue;
        }
        let cells: Vec<Value> = worker_rows
            .iter()
            .zip(&tiers)
            .map(|(w, t)| {
                json!({
                    "worker": w["name"],
                    "tier": t.get(&a.lora_int_id).map_or("absent", String::as_str),
                })
            })
            .collect();
        let rate = rates.get(&a.lora_int_id);
        rows.push(json!({
            "lora_int_id": a.lora_int_id,
            "label": format!("{}:v{}", a.name, a.version),
            "tenant": a.tenant,
            "state": a.state,
            "cells": cells,
            "requests_per_min": rate.and_then(|r| r["requests_per_min"].as_f64()).unwrap_or(0.0),
            "device_hit_percent": rate
                .and_then(|r| r["device_hit_rate"].as_f64())
                .map(|h| (h * 100.0).round()),
        }));
    }
    Ok(json!({
        "workers": worker_rows,
        "adapters": rows,
        "rate_window_secs": fleet["rate_window_secs"],
    }))
}
