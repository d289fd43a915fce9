//! `cuda_decode`'s chart: decode tokens/s against the number of distinct
//! adapters on the GPU, one bar series per recorded run and slot dtype.
//!
//! The runs live in `gpu_decode_adapters.json` and the chart in
//! `gpu_decode_adapters.svg`, both under `docs/plots` (see [`dir`]). Each
//! GPU run appends its series and keeps the last [`KEEP`];
//! `cuda_decode --plot-only` redraws the chart from the file on a machine
//! without a GPU. The file was seeded with the tables BENCHMARKS.md
//! records from earlier runs.

use std::path::PathBuf;

use super::svg;

/// How many series the file keeps (a run adds one per slot dtype).
pub const KEEP: usize = 6;
const NAME: &str = "gpu_decode_adapters";

/// One series: a run's tokens/s by distinct adapters (0: the base model
/// alone).
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub label: String,
    pub tokens_per_s: Vec<(usize, f64)>,
}

/// `LORAFLEET_PLOTS_DIR`, else `docs/plots` under the current directory
/// (the repository root, where `deploy/gpu-check.sh` runs the binary),
/// else the checkout's (`cargo bench` runs it from the crate's directory).
fn dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LORAFLEET_PLOTS_DIR") {
        return PathBuf::from(dir);
    }
    let here = PathBuf::from("docs/plots");
    if here.is_dir() {
        return here;
    }
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/plots"))
}

fn read() -> Vec<Series> {
    let path = dir().join(format!("{NAME}.json"));
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Vec::new();
    };
    let value: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows = value
        .as_array()
        .unwrap_or_else(|| panic!("{}: expected an array of series", path.display()));
    rows.iter()
        .map(|row| {
            let label = row["series"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: a series without a name", path.display()))
                .to_owned();
            let mut tokens_per_s: Vec<(usize, f64)> = row["tokens_per_s"]
                .as_object()
                .unwrap_or_else(|| panic!("{}: {label}: no tokens_per_s", path.display()))
                .iter()
                .map(|(k, v)| {
                    let n = k.parse().unwrap_or_else(|_| {
                        panic!("{}: {label}: {k:?} is not an adapter count", path.display())
                    });
                    (n, v.as_f64().unwrap_or(f64::NAN))
                })
                .collect();
            tokens_per_s.sort_by_key(|(n, _)| *n);
            Series {
                label,
                tokens_per_s,
            }
        })
        .collect()
}

fn write(series: &[Series]) {
    let rows: Vec<serde_json::Value> = series
        .iter()
        .map(|s| {
            let tps: serde_json::Map<String, serde_json::Value> = s
                .tokens_per_s
                .iter()
                .map(|(n, v)| (n.to_string(), serde_json::json!(v.round())))
                .collect();
            serde_json::json!({ "series": s.label, "tokens_per_s": tps })
        })
        .collect();
    let dir = dir();
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let path = dir.join(format!("{NAME}.json"));
    let text = serde_json::to_string_pretty(&rows).unwrap() + "\n";
    std::fs::write(&path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Appends this run's series (keeping the last [`KEEP`]) and redraws.
pub fn record(run: Vec<Series>) {
    let mut all = read();
    all.extend(run);
    let drop = all.len().saturating_sub(KEEP);
    all.drain(..drop);
    write(&all);
    draw_from(&all);
}

/// Redraws the chart from the file alone.
pub fn draw() {
    draw_from(&read());
}

fn draw_from(series: &[Series]) {
    let mut counts: Vec<usize> = series
        .iter()
        .flat_map(|s| s.tokens_per_s.iter().map(|(n, _)| *n))
        .collect();
    counts.sort_unstable();
    counts.dedup();
    let chart = svg::Bars {
        title: "Decode tokens/s against distinct adapters (CUDA backend, STAND-IN Llama-3.2-1B shape, bf16)",
        y_label: "tokens/s (512 requests x 8 new tokens, 32 a step)",
        groups: counts
            .iter()
            .map(|&n| match n {
                0 => "base only".to_owned(),
                1 => "1 adapter".to_owned(),
                n => format!("{n} adapters"),
            })
            .collect(),
        series: series
            .iter()
            .map(|s| {
                let values = counts
                    .iter()
                    .map(|n| {
                        s.tokens_per_s
                            .iter()
                            .find(|(m, _)| m == n)
                            .map_or(f64::NAN, |(_, v)| *v)
                    })
                    .collect();
                (s.label.clone(), values)
            })
            .collect(),
    };
    chart.write(&dir().join(format!("{NAME}.svg")));
}
