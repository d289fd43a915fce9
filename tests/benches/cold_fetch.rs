//! The cold path of an adapter artifact: a worker's first use of an
//! adapter copies it into its verified cache, from the artifact root on
//! local disk (`ArtifactRoots::copy_verified`) or from an S3-compatible
//! bucket (`ObjectStores::fetch_verified`), hashing every byte either way.
//! That copy is the only part of a cold request's time-to-first-token that
//! differs between the two (parsing the adapter, the slot load and the
//! prefill are the same code on the same local copy), so the table gives
//! it: one fetch at a time (median of 10), and 32 adapters fetched at once.
//! The bucket is a real S3 server (`s3s-fs`, as in the tests) on loopback,
//! over this machine's disk: what remains is the S3 protocol, HTTP, the
//! listing and the streaming, not a network's latency. Run with:
//!
//!     cargo bench -p lorafleet-tests --bench cold_fetch
//!
//! `LORAFLEET_BENCH_ARTIFACT_MB` sets the weight file's size (default 13.6
//! MB: a rank-16 q/k/v/o adapter of Llama-3.2-1B's shape in f32).

use std::path::{Path, PathBuf};
use std::time::Instant;

use lorafleet_artifact::roots::ArtifactRoots;
use lorafleet_store::{FetchOptions, ObjectStores, StoreSpec};
use lorafleet_tests::s3::S3Server;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn write_adapter(dir: &Path, bytes: usize, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("adapter_config.json"),
        format!("{{\"r\": 16, \"seed\": {seed}}}"),
    )
    .unwrap();
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    let data: Vec<u8> = (0..bytes)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect();
    std::fs::write(dir.join("adapter_model.safetensors"), data).unwrap();
}

#[allow(unsafe_code)]
fn main() {
    let mb: f64 = std::env::var("LORAFLEET_BENCH_ARTIFACT_MB")
        .map(|v| {
            v.parse()
                .expect("LORAFLEET_BENCH_ARTIFACT_MB: a size in MB")
        })
        .unwrap_or(13.6);
    let bytes = (mb * 1e6) as usize;
    let s3 = S3Server::start(&["bench"]);
    for (k, v) in s3.client_env() {
        // SAFETY: set before any other thread of this process starts.
        unsafe { std::env::set_var(k, v) };
    }
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("root");
    let n = 32;
    for i in 0..n {
        write_adapter(&root.join(format!("a{i:02}")), bytes, i as u64);
    }
    let roots = ArtifactRoots::new(std::slice::from_ref(&root)).unwrap();
    let spec: StoreSpec = "bench=s3://bench/prod".parse().unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let stores = |concurrency: usize| {
        ObjectStores::new(
            std::slice::from_ref(&spec),
            FetchOptions {
                endpoint: Some(s3.endpoint.clone()),
                concurrency,
                ..Default::default()
            },
        )
        .unwrap()
    };
    let store = stores(8);
    let digests: Vec<String> = (0..n)
        .map(|i| {
            let uri = format!("s3://bench/prod/a{i:02}");
            rt.block_on(lorafleet_store::push_dir(
                &store,
                &root.join(format!("a{i:02}")),
                &uri,
                &mut |_| {},
            ))
            .unwrap()
        })
        .collect();
    let dest = |tag: &str, i: usize| -> PathBuf { work.path().join(format!("cache-{tag}-{i}")) };
    println!(
        "cold artifact copy: {n} adapters of {:.1} MB (adapter_config.json + weights), {} threads",
        bytes as f64 / 1e6,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let (mut disk, mut bucket) = (Vec::new(), Vec::new());
    for rep in 0..10 {
        let i = rep % n;
        let t = Instant::now();
        roots
            .copy_verified(&format!("a{i:02}"), &digests[i], &dest("disk", rep))
            .unwrap();
        disk.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        rt.block_on(store.fetch_verified(
            &format!("s3://bench/prod/a{i:02}"),
            Some(&digests[i]),
            &dest("s3", rep),
        ))
        .unwrap();
        bucket.push(t.elapsed().as_secs_f64() * 1e3);
    }
    println!("| path | one adapter, median of 10 (ms) | each (ms) |");
    println!("|---|---:|---|");
    for (name, v) in [
        ("local disk (copy_verified)", &mut disk),
        ("S3 bucket (fetch_verified)", &mut bucket),
    ] {
        let each = v
            .iter()
            .map(|x| format!("{x:.1}"))
            .collect::<Vec<_>>()
            .join(" / ");
        println!("| {name} | {:.1} | {each} |", median(v));
    }
    println!();
    println!("| {n} adapters at once | wall (s) | MB/s |");
    println!("|---|---:|---:|");
    for concurrency in [8, 32] {
        let store = stores(concurrency);
        let t = Instant::now();
        rt.block_on(async {
            let fetches = (0..n).map(|i| {
                let (store, d) = (store.clone(), dest(&format!("c{concurrency}"), i));
                let (uri, want) = (format!("s3://bench/prod/a{i:02}"), digests[i].clone());
                async move { store.fetch_verified(&uri, Some(&want), &d).await }
            });
            for r in futures::future::join_all(fetches).await {
                r.unwrap();
            }
        });
        let wall = t.elapsed().as_secs_f64();
        println!(
            "| S3, --artifact-fetch-concurrency {concurrency} | {wall:.2} | {:.0} |",
            (n * bytes) as f64 / 1e6 / wall
        );
    }
    let t = Instant::now();
    std::thread::scope(|s| {
        for (i, want) in digests.iter().enumerate() {
            let (roots, d) = (&roots, dest("disk-all", i));
            s.spawn(move || roots.copy_verified(&format!("a{i:02}"), want, &d).unwrap());
        }
    });
    let wall = t.elapsed().as_secs_f64();
    println!(
        "| local disk, {n} threads | {wall:.2} | {:.0} |",
        (n * bytes) as f64 / 1e6 / wall
    );
}
