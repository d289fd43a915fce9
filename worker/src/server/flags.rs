//! The flags of `lorafleet-worker serve` and of the engine (shared with
//! `generate`), each with an environment fallback, and their checks into a
//! [`WorkerConfig`] or a [`FlagError`] that names the flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use lorafleet_domain::flag::{FlagError, ensure};
use lorafleet_engine::artifact::ArtifactRoots;
use lorafleet_engine::backend::cuda::Dtype;
use lorafleet_engine::{BackendChoice, EngineSettings};

use super::{ConfigError, WorkerConfig};

/// Flags of `serve`; each has an environment fallback.
#[derive(Debug, clap::Args)]
pub struct ServeArgs {
    /// The base model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long, env = "LORAFLEET_MODEL")]
    pub model: PathBuf,
    /// A directory adapter artifact URIs resolve in; repeat for more (env:
    /// comma-separated). Optional when `--artifact-store` is given.
    #[arg(
        long = "artifact-root",
        env = "LORAFLEET_ARTIFACT_ROOTS",
        value_delimiter = ',',
        required_unless_present = "artifact_stores"
    )]
    pub artifact_roots: Vec<PathBuf>,
    #[command(flatten)]
    pub stores: lorafleet_store::StoreFlags,
    /// The deadline of one artifact fetch from a store, listing and every
    /// object, in seconds.
    #[arg(
        long,
        env = "LORAFLEET_ARTIFACT_FETCH_TIMEOUT_SECS",
        default_value_t = 300
    )]
    pub artifact_fetch_timeout_secs: u64,
    /// Artifact fetches from stores at once; more wait their turn.
    #[arg(
        long,
        env = "LORAFLEET_ARTIFACT_FETCH_CONCURRENCY",
        default_value_t = 8
    )]
    pub artifact_fetch_concurrency: usize,
    /// Where to serve gRPC. Port 0 picks a free port, printed on stdout.
    #[arg(long, env = "LORAFLEET_GRPC_LISTEN", default_value = "0.0.0.0:50051")]
    pub grpc_listen: SocketAddr,
    /// Where to serve Prometheus metrics (`GET /metrics`). Port 0 picks a
    /// free port, printed on stdout.
    #[arg(long, env = "LORAFLEET_METRICS_LISTEN", default_value = "0.0.0.0:9090")]
    pub metrics_listen: SocketAddr,
    /// This worker's id on the hash ring (in Kubernetes, the pod name).
    #[arg(long, env = "LORAFLEET_WORKER_ID")]
    pub worker_id: String,
    #[command(flatten)]
    pub engine: EngineFlags,
    /// On SIGTERM, how long running streams may take to finish, in seconds.
    #[arg(long, env = "LORAFLEET_DRAIN_DEADLINE_SECS", default_value_t = 30)]
    pub drain_deadline_secs: u64,
    /// Where this worker keeps its private copies of verified adapter
    /// artifacts (emptied at start; the pool reads adapters only from
    /// here). Default: a directory named after the worker id and process
    /// under the system's temporary directory, removed on a clean exit.
    #[arg(long, env = "LORAFLEET_ADAPTER_CACHE")]
    pub adapter_cache: Option<PathBuf>,
    #[command(flatten)]
    pub tls: TlsFlags,
    /// Where to serve grpc.health.v1 alone, in plain text, for probes that
    /// cannot present a client certificate (the kubelet's). It tells only
    /// SERVING or NOT_SERVING. Port 0 picks a free port, printed on stdout.
    #[arg(long, env = "LORAFLEET_HEALTH_LISTEN", default_value = "0.0.0.0:50052")]
    pub health_listen: SocketAddr,
}

/// Mutual TLS on the gRPC port: only clients whose certificate the fleet's
/// CA signed (the gateways) may call this worker.
#[derive(Debug, clap::Args)]
pub struct TlsFlags {
    /// This worker's certificate chain (PEM), naming its DNS names.
    #[arg(long, env = "LORAFLEET_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, env = "LORAFLEET_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// The CA bundle (PEM) that clients' certificates must chain to.
    #[arg(long, env = "LORAFLEET_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Serve gRPC in plain text, to anyone who can reach the port. Only for
    /// a trusted network; required when no TLS flags are given.
    #[arg(long, env = "LORAFLEET_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: bool,
    /// How often the TLS files are checked for a change, in seconds; a
    /// change applies to new connections without a restart.
    #[arg(long, env = "LORAFLEET_TLS_RELOAD_SECS", default_value_t = 10)]
    pub tls_reload_secs: u64,
}

/// Engine sizes and limits; each flag has an environment fallback.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineFlags {
    /// The compute backend: "cpu" (the f32 reference) or "cuda".
    #[arg(long, env = "LORAFLEET_BACKEND", default_value = "cpu")]
    backend: String,
    /// The type base weights are held in on the cuda backend: "bf16",
    /// "f16" or "f32" (default bf16). The cpu backend computes in f32 only.
    #[arg(long, env = "LORAFLEET_DTYPE")]
    dtype: Option<String>,
    /// The CUDA device ordinal.
    #[arg(long, env = "LORAFLEET_CUDA_DEVICE", default_value_t = 0)]
    cuda_device: usize,
    /// The type the cuda backend's adapter slots hold: "f32" (default:
    /// an f32 adapter's exact values, as PEFT computes) or "bf16"/"f16"
    /// (half the bytes a slot load copies).
    #[arg(long, env = "LORAFLEET_LORA_DTYPE")]
    lora_dtype: Option<String>,
    /// Launches every kernel of a decode step one by one on the cuda
    /// backend, instead of replaying the step from a captured CUDA graph
    /// (vLLM's --enforce-eager).
    #[arg(long, env = "LORAFLEET_NO_CUDA_GRAPHS")]
    no_cuda_graphs: bool,
    /// Launches the cuda backend's kernels with programmatic dependent
    /// launch (compute 9.0 and newer; ignored on older devices): each
    /// kernel is scheduled while the one before it drains, which hides
    /// launch latency. Off by default until measured on more devices.
    #[arg(long, env = "LORAFLEET_CUDA_PDL")]
    cuda_pdl: bool,
    /// Device slots: the most distinct adapters in one step.
    #[arg(long, env = "LORAFLEET_MAX_LORAS", default_value_t = 4)]
    max_loras: usize,
    /// The largest adapter rank accepted.
    #[arg(long, env = "LORAFLEET_MAX_LORA_RANK", default_value_t = 16)]
    max_lora_rank: usize,
    /// Adapters kept in the host tier.
    #[arg(long, env = "LORAFLEET_MAX_CPU_LORAS", default_value_t = 32)]
    max_cpu_loras: usize,
    /// Bytes of adapter weights kept in the host tier, as well as the
    /// count: an adapter counts its real size (LoRA on every expert of a
    /// Mixture-of-Experts model weighs many attention-only ones). Default:
    /// the count alone.
    #[arg(long, env = "LORAFLEET_MAX_CPU_LORA_BYTES")]
    max_cpu_lora_bytes: Option<usize>,
    /// KV cache blocks.
    #[arg(long, env = "LORAFLEET_KV_BLOCKS", default_value_t = 2048)]
    kv_blocks: usize,
    /// One byte budget for the KV cache and the adapter slots together
    /// (cpu backend): KV blocks and filled slots draw from it as the work
    /// needs, so few adapters get more KV and many get more resident
    /// adapters. The KV blocks then follow from it; `--max-loras` is the
    /// most slots.
    #[arg(
        long,
        env = "LORAFLEET_MEMORY_BUDGET_BYTES",
        conflicts_with = "kv_blocks"
    )]
    memory_budget_bytes: Option<u64>,
    /// Tokens per KV block.
    #[arg(long, env = "LORAFLEET_BLOCK_SIZE", default_value_t = 16)]
    block_size: usize,
    /// The most sequences in one step.
    #[arg(long, env = "LORAFLEET_MAX_NUM_SEQS", default_value_t = 64)]
    max_num_seqs: usize,
    /// The most tokens in one step; longer prompts are prefilled in chunks.
    #[arg(long, env = "LORAFLEET_MAX_BATCHED_TOKENS", default_value_t = 512)]
    max_batched_tokens: usize,
    /// The most waiting requests before new ones are refused.
    #[arg(long, env = "LORAFLEET_MAX_WAITING", default_value_t = 1024)]
    max_waiting: usize,
    /// The most adapters pinned at once (default: --max-loras minus one, so
    /// one slot always serves unpinned traffic).
    #[arg(long, env = "LORAFLEET_MAX_PINNED")]
    max_pinned: Option<usize>,
    /// Turns off prefix caching: computed KV blocks are then never kept
    /// and shared between requests with the same prefix and weights.
    #[arg(long, env = "LORAFLEET_NO_PREFIX_CACHING")]
    no_prefix_caching: bool,
    /// Admits waiting requests in arrival order instead of by fair shares
    /// between tenants.
    #[arg(long, env = "LORAFLEET_NO_FAIR_ADMISSION")]
    no_fair_admission: bool,
    /// Which device slot gives way to an adapter that needs one: `value`
    /// (no queued requests, then the lowest recent request rate, then the
    /// least recently used) or `lru` (no queued requests, then the least
    /// recently used).
    #[arg(long, env = "LORAFLEET_ADAPTER_EVICTION", default_value = "value")]
    adapter_eviction: String,
}

impl EngineFlags {
    /// The checked backend choice; an error names the flag.
    pub fn backend(&self) -> Result<BackendChoice, FlagError> {
        let dtype = self
            .dtype
            .as_deref()
            .map(|d| {
                d.parse::<Dtype>()
                    .map_err(|e| FlagError::new("--dtype", e.to_string()))
            })
            .transpose()?;
        let lora_dtype = self
            .lora_dtype
            .as_deref()
            .map(|d| {
                d.parse::<Dtype>()
                    .map_err(|e| FlagError::new("--lora-dtype", e.to_string()))
            })
            .transpose()?;
        match self.backend.as_str() {
            "cpu" => match dtype {
                _ if lora_dtype.is_some() => Err(FlagError::new(
                    "--lora-dtype",
                    "the cpu backend holds adapters in f32; it applies to --backend cuda",
                )),
                _ if self.no_cuda_graphs => Err(FlagError::new(
                    "--no-cuda-graphs",
                    "the cpu backend has no CUDA graphs; it applies to --backend cuda",
                )),
                _ if self.cuda_pdl => Err(FlagError::new(
                    "--cuda-pdl",
                    "the cpu backend launches no kernels; it applies to --backend cuda",
                )),
                None | Some(Dtype::F32) => Ok(BackendChoice::Cpu),
                Some(other) => Err(FlagError::new(
                    "--dtype",
                    format!(
                        "{} is not available on the cpu backend, which computes in f32",
                        other.name()
                    ),
                )),
            },
            "cuda" => {
                // Before anything else is read, so a machine without a GPU
                // stack says so at once.
                lorafleet_engine::backend::cuda::probe().map_err(|e| match e {
                    lorafleet_engine::EngineError::Backend(why) => {
                        FlagError::new("--backend cuda", why)
                    }
                    other => FlagError::new("--backend cuda", other.to_string()),
                })?;
                Ok(BackendChoice::Cuda {
                    device: self.cuda_device,
                    dtype: dtype.unwrap_or(Dtype::Bf16),
                    lora_dtype: lora_dtype.unwrap_or(Dtype::F32),
                    graphs: !self.no_cuda_graphs,
                    pdl: self.cuda_pdl,
                })
            }
            other => Err(FlagError::new(
                "--backend",
                format!("{other:?} is not available; expected \"cpu\" or \"cuda\""),
            )),
        }
    }

    /// The checked settings; an error names the flag, as `--max-loras: …`.
    pub fn settings(&self) -> Result<EngineSettings, FlagError> {
        let eviction = self
            .adapter_eviction
            .parse()
            .map_err(|e: String| FlagError::new("--adapter-eviction", e))?;
        let settings = EngineSettings {
            max_loras: self.max_loras,
            max_lora_rank: self.max_lora_rank,
            max_cpu_loras: self.max_cpu_loras,
            max_cpu_lora_bytes: self.max_cpu_lora_bytes,
            kv_blocks: self.kv_blocks,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            max_waiting: self.max_waiting,
            max_pinned: self.max_pinned,
            prefix_caching: !self.no_prefix_caching,
            fair_admission: !self.no_fair_admission,
            eviction,
            memory_budget_bytes: self.memory_budget_bytes,
        };
        if self.memory_budget_bytes.is_some() && self.backend != "cpu" {
            return Err(FlagError::new(
                "--memory-budget-bytes",
                "is for the cpu backend; the cuda backend divides device memory by its memory plan",
            ));
        }
        settings.validate().map_err(|e| {
            let text = e.to_string().replace('_', "-");
            match text.split_once(": ") {
                Some((flag, reason)) => FlagError::new(format!("--{flag}"), reason),
                None => FlagError::new("--max-loras", text),
            }
        })?;
        Ok(settings)
    }
}

impl ServeArgs {
    /// Every check of the flags; the first refusal names its flag. Probes
    /// the GPU stack for `--backend cuda` and resolves the artifact roots;
    /// reads no model and binds nothing.
    pub fn validate(&self) -> Result<WorkerConfig, ConfigError> {
        ensure(
            !self.worker_id.trim().is_empty(),
            "--worker-id",
            "must not be empty",
        )?;
        let tls = lorafleet_tls::choose(
            self.tls.tls_cert.clone(),
            self.tls.tls_key.clone(),
            self.tls.tls_client_ca.clone(),
            self.tls.insecure_plaintext,
            [
                "--tls-cert",
                "--tls-key",
                "--tls-client-ca",
                "--insecure-plaintext",
            ],
        )?;
        ensure(
            self.tls.tls_reload_secs > 0,
            "--tls-reload-secs",
            "must be at least 1",
        )?;
        let settings = self.engine.settings()?;
        let backend = self.engine.backend()?;
        let artifact_roots = if self.artifact_roots.is_empty() {
            ArtifactRoots::none()
        } else {
            ArtifactRoots::new(&self.artifact_roots)
                .map_err(|e| FlagError::new("--artifact-root", e.to_string()))?
        };
        ensure(
            self.artifact_fetch_timeout_secs > 0,
            "--artifact-fetch-timeout-secs",
            "must be at least 1",
        )?;
        ensure(
            self.artifact_fetch_concurrency > 0,
            "--artifact-fetch-concurrency",
            "must be at least 1",
        )?;
        let artifact_stores = self
            .stores
            .stores(lorafleet_store::FetchOptions {
                concurrency: self.artifact_fetch_concurrency,
                timeout: Duration::from_secs(self.artifact_fetch_timeout_secs),
                ..Default::default()
            })
            .map_err(|e| FlagError::new(e.flag(), e.to_string()))?;
        Ok(WorkerConfig {
            model: self.model.clone(),
            artifact_roots,
            artifact_stores,
            grpc_listen: self.grpc_listen,
            metrics_listen: self.metrics_listen,
            health_listen: self.health_listen,
            worker_id: self.worker_id.clone(),
            settings,
            backend,
            drain_deadline: Duration::from_secs(self.drain_deadline_secs),
            adapter_cache: self.adapter_cache.clone(),
            tls,
            tls_reload: Duration::from_secs(self.tls.tls_reload_secs),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    #[command(args_override_self = true)]
    struct Cli {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(flags: &[&str]) -> ServeArgs {
        let roots = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/engine/tests/fixtures/adapters"
        );
        let base = [
            "serve",
            "--insecure-plaintext",
            "--worker-id",
            "w",
            "--model",
            "/unused-model",
            "--artifact-root",
            roots,
        ];
        Cli::try_parse_from(base.iter().chain(flags)).unwrap().serve
    }

    /// A worker that reads artifacts from object stores only needs no
    /// artifact root; one with neither is refused.
    #[test]
    fn an_object_store_makes_the_artifact_root_optional() {
        let base = [
            "serve",
            "--insecure-plaintext",
            "--worker-id",
            "w",
            "--model",
            "/m",
        ];
        let stores = ["--artifact-store", "fleet=s3://adapters/prod"];
        let args = Cli::try_parse_from(base.iter().chain(&stores))
            .unwrap()
            .serve;
        assert!(args.artifact_roots.is_empty());
        assert_eq!(args.stores.artifact_stores[0].bucket, "adapters");
        let e = Cli::try_parse_from(base.iter()).unwrap_err().to_string();
        assert!(e.contains("--artifact-root"), "{e}");
        let e = Cli::try_parse_from(base.iter().chain(&["--artifact-store", "fleet=s3://A/x"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a valid bucket name"), "{e}");
    }

    #[test]
    fn every_bad_flag_is_refused_by_name() {
        let cases: &[(&[&str], &str)] = &[
            (&["--max-loras", "0"], "--max-loras: must be at least 1"),
            (
                &["--max-loras", "2", "--max-pinned", "2"],
                "--max-pinned: 2 must be below max-loras (2)",
            ),
            (&["--backend", "tpu"], "--backend: \"tpu\" is not available"),
            (
                &["--dtype", "bf16"],
                "--dtype: bf16 is not available on the cpu backend",
            ),
            (
                &["--backend", "cuda", "--dtype", "f8"],
                "--dtype: \"f8\" is not one of f32, bf16, f16",
            ),
            (
                &["--backend", "cuda", "--lora-dtype", "f8"],
                "--lora-dtype: \"f8\" is not one of f32, bf16, f16",
            ),
            (
                &["--lora-dtype", "bf16"],
                "--lora-dtype: the cpu backend holds adapters in f32",
            ),
            (
                &["--no-cuda-graphs"],
                "--no-cuda-graphs: the cpu backend has no CUDA graphs",
            ),
            (
                &["--cuda-pdl"],
                "--cuda-pdl: the cpu backend launches no kernels",
            ),
            (
                &["--artifact-max-bytes", "0"],
                "--artifact-max-bytes: must be at least 1",
            ),
            (
                &["--artifact-max-objects", "0"],
                "--artifact-max-objects: must be at least 1",
            ),
            (
                &["--backend", "cuda", "--memory-budget-bytes", "1000000"],
                "--memory-budget-bytes: is for the cpu backend",
            ),
            (&["--worker-id", " "], "--worker-id: must not be empty"),
            (
                &["--artifact-root", "/nonexistent-artifact-root"],
                "--artifact-root: artifact root /nonexistent-artifact-root",
            ),
            (
                &["--tls-reload-secs", "0"],
                "--tls-reload-secs: must be at least 1",
            ),
            (
                &["--tls-cert", "/cert.pem"],
                "--insecure-plaintext: cannot be combined with --tls-cert",
            ),
        ];
        for (flags, expected) in cases {
            let message = parse(flags)
                .validate()
                .map(|_| ())
                .expect_err(&format!("{flags:?} was accepted"))
                .to_string();
            assert!(
                message.starts_with(expected),
                "{flags:?}: expected {expected:?}, got {message:?}"
            );
        }
    }

    #[test]
    fn good_flags_become_the_config_they_say() {
        let c = parse(&["--max-loras", "8", "--drain-deadline-secs", "5"])
            .validate()
            .unwrap();
        assert_eq!(c.settings.max_loras, 8);
        assert_eq!(c.drain_deadline, Duration::from_secs(5));
        assert_eq!(c.backend, BackendChoice::Cpu);
        assert!(c.tls.is_none());
        assert!(c.adapter_cache.is_none());
        let c = parse(&["--memory-budget-bytes", "1000000"])
            .validate()
            .unwrap();
        assert_eq!(c.settings.memory_budget_bytes, Some(1_000_000));
    }

    /// The KV blocks follow from a memory budget, so both are not taken.
    #[test]
    fn a_memory_budget_and_kv_blocks_conflict() {
        let e = Cli::try_parse_from([
            "serve",
            "--insecure-plaintext",
            "--worker-id",
            "w",
            "--model",
            "/m",
            "--artifact-root",
            "/r",
            "--memory-budget-bytes",
            "1000000",
            "--kv-blocks",
            "64",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("--memory-budget-bytes") && e.contains("--kv-blocks"),
            "{e}"
        );
    }
}
