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
