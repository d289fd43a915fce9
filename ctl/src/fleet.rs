//! The fleet view.

use super::*;

pub(crate) async fn fleet(c: &Client) -> Result<(), Failure> {
    let body = c.get("/fleet", &[]).await?;
    if c.output == Output::Json {
        println!("{body}");
        return Ok(());
    }
    let rows: Vec<Vec<String>> = body["workers"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|w| {
                    let tier = |t: &str| cell(&w["adapters"][t]);
                    let hash = cell(&w["base_hash"]);
                    vec![
                        cell(&w["worker_id"]),
                        cell(&w["addr"]),
                        cell(&w["status"]),
                        cell(&w["base_model"]),
                        hash.chars().take(12).collect(),
                        weights(w),
                        cell(&w["load"]),
                        format!(
                            "{}/{}",
                            cell(&w["kv_blocks_used"]),
                            cell(&w["kv_blocks_total"])
                        ),
                        tier("device"),
                        tier("host"),
                        tier("loading"),
                    ]
                })
                .collect()
        })
        .unwrap_or_default();
    table(
        &[
            "worker_id",
            "addr",
            "state",
            "base_model",
            "base_hash",
            "weights",
            "load",
            "kv_blocks",
            "device",
            "host",
            "loading",
        ],
        &rows,
    );
    Ok(())
}

/// A worker's weights as held: "89.5 MB" or "89.5 MB int4, groups of 128".
fn weights(w: &serde_json::Value) -> String {
    let Some(bytes) = w["weights_bytes"].as_u64().filter(|b| *b > 0) else {
        return "-".into();
    };
    let size = if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / f64::from(1u32 << 30))
    } else {
        format!("{:.1} MiB", bytes as f64 / f64::from(1u32 << 20))
    };
    match w["quantization"].as_str().filter(|q| !q.is_empty()) {
        Some(q) => format!("{size} {q}"),
        None => size,
    }
}
