//! The command line's shape: flags, subcommands and their help.

use super::*;
use lorafleet_admin_types::Limit;

pub(crate) const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  the server failed (5xx) or another unexpected error
  2  usage: a flag or argument is wrong (nothing was sent)
  3  authentication or permission refused (401, 403)
  4  not found (404)
  5  conflict: duplicate, stale etag, or a state that forbids it (409, 412, 428)
  6  invalid input refused by the server (400, 413, 422)
  7  the admin API is unreachable or the registry database is down (503)";

/// Administers a lorafleet deployment through the gateway's admin API.
#[derive(Debug, Parser)]
#[command(name = "lorafleetctl", version, about, after_help = EXIT_CODES)]
pub(crate) struct Cli {
    /// The admin API's base URL.
    #[arg(
        long,
        global = true,
        env = "LORAFLEET_ADMIN_URL",
        default_value = "http://127.0.0.1:8081"
    )]
    pub(crate) server: String,
    /// An admin JWT (see `lorafleetctl token`).
    #[arg(
        long,
        global = true,
        env = "LORAFLEET_ADMIN_TOKEN",
        hide_env_values = true
    )]
    pub(crate) token: Option<String>,
    /// table for people, json for scripts.
    #[arg(long, short, global = true, value_enum, default_value_t = Output::Table)]
    pub(crate) output: Output,
    /// Seconds to wait for the admin API.
    #[arg(long, global = true, default_value_t = 120)]
    pub(crate) timeout_secs: u64,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Tenants: list, create, disable, enable.
    #[command(subcommand)]
    Tenants(TenantCmd),
    /// Tenants' API keys: list, create (the secret is shown once), revoke.
    #[command(subcommand)]
    Keys(KeyCmd),
    /// Base models: list, register, compute a model directory's base hash.
    #[command(subcommand, name = "base-models")]
    BaseModels(BaseCmd),
    /// Adapter versions: list, register, retire, compute an artifact digest.
    #[command(subcommand)]
    Adapters(AdapterCmd),
    /// Routes and canaries: list, get, set, promote, rollback.
    #[command(subcommand)]
    Routes(RouteCmd),
    /// A route's evaluation sets: register (a JSON Lines file; a name's
    /// next version) and list. `routes rollout start --eval` scores a
    /// candidate on one before it takes traffic.
    #[command(subcommand)]
    Evals(EvalCmd),
    /// Workers as this gateway sees them: base hash, load, residency by tier.
    Fleet,
    /// Queries the audit log (one row per completion), or exports it.
    Audit(AuditArgs),
    /// The audit log's day partitions (estimated rows each) and the
    /// gateway replica that makes them ahead and retires them.
    AuditPartitions,
    /// Usage over a span, from the hourly rollups: requests, tokens and
    /// the workers' device seconds by tenant, route, adapter and day or
    /// hour, evaluation traffic apart.
    Usage(UsageArgs),
    /// Prices for chargeback: set a base model's per device-hour or a
    /// route's per million tokens from a whole hour on; list them.
    #[command(subcommand)]
    Prices(PriceCmd),
    /// The admin change log: who changed what, when, before and after.
    Changes {
        #[arg(long)]
        object_type: Option<String>,
        #[arg(long)]
        object_id: Option<String>,
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Mints an admin JWT signed with an HMAC secret (for bootstrap and
    /// automation; use your identity provider where there is one).
    Token(TokenArgs),
    /// Generates a fleet CA and the certificates for mutual TLS between
    /// gateways and workers (for a local fleet or a test; in Kubernetes,
    /// use cert-manager as deploy/README.md shows).
    Certs(CertsArgs),
}

#[derive(Debug, Subcommand)]
pub(crate) enum EvalCmd {
    /// Registers FILE, one item a line: `{"prompt", "choices", "answer"}`
    /// (multiple choice, scored by loglikelihood as lm-evaluation-harness
    /// does) or `{"prompt" or "messages", "expected"}` (the greedy answer,
    /// exact match, or with `"match": "regex"` a pattern found in it;
    /// `max_tokens` default 32, `stop` default a newline).
    Register {
        tenant: String,
        model: String,
        file: PathBuf,
        /// The set's name [default: the file's name without its extension].
        #[arg(long)]
        name: Option<String>,
    },
    /// The route's sets, every version.
    List { tenant: String, model: String },
}

#[derive(Debug, clap::Args)]
pub(crate) struct CertsArgs {
    /// The directory to write ca.pem, worker.pem, worker-key.pem,
    /// gateway.pem and gateway-key.pem into (created; existing files are
    /// refused, never overwritten).
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// A DNS name or IP address the workers' certificate carries; repeat.
    #[arg(long = "worker-name", required = true)]
    pub(crate) worker_names: Vec<String>,
    /// The gateways' certificate's common name.
    #[arg(long, default_value = "lorafleet-gateway")]
    pub(crate) gateway_name: String,
    /// Days the worker and gateway certificates are valid (the CA: ten
    /// times as long).
    #[arg(long, default_value_t = 90)]
    pub(crate) days: u32,
}

#[derive(Debug, Subcommand)]
pub(crate) enum TenantCmd {
    List,
    Create {
        name: String,
        #[arg(long, default_value = "")]
        display_name: String,
        /// Requests per minute.
        #[arg(long)]
        rpm_limit: Option<u32>,
        /// Tokens per minute.
        #[arg(long)]
        tpm_limit: Option<u64>,
        /// The tenant's weight in the workers' fair admission (default 1).
        #[arg(long)]
        weight: Option<f64>,
    },
    /// Changes a tenant's limits, weight or display name; what is not
    /// given stays. A limit is a positive number, `unlimited`, or `default`
    /// (the gateway's flag).
    Update {
        name: String,
        #[arg(long)]
        display_name: Option<String>,
        /// Requests per minute, across the gateways.
        #[arg(long)]
        rpm_limit: Option<Limit>,
        /// Tokens per minute, across the gateways.
        #[arg(long)]
        tpm_limit: Option<Limit>,
        /// Requests in flight at once, across the gateways.
        #[arg(long)]
        max_concurrent: Option<Limit>,
        /// The tenant's weight in the workers' fair admission.
        #[arg(long)]
        weight: Option<f64>,
    },
    /// Refuses the tenant's requests with 403 from now on.
    Disable {
        name: String,
    },
    Enable {
        name: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum KeyCmd {
    List {
        tenant: String,
    },
    Create {
        tenant: String,
        #[arg(long, default_value = "")]
        name: String,
        /// Comma-separated: inference, models:read. Default: both.
        #[arg(long, value_delimiter = ',')]
        scopes: Vec<String>,
        /// Lifetime such as 90d, 12h, 30m or 3600s.
        #[arg(long, conflicts_with = "expires_at")]
        expires_in: Option<String>,
        /// Expiry as RFC 3339, e.g. 2027-01-01T00:00:00Z.
        #[arg(long)]
        expires_at: Option<String>,
    },
    Revoke {
        prefix: String,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum BaseCmd {
    List,
    Register {
        name: String,
        /// llama, mistral or qwen2.
        #[arg(long)]
        architecture: String,
        /// The base hash, as `lorafleetctl base-models hash` prints it.
        #[arg(
            long,
            required_unless_present = "model_dir",
            conflicts_with = "model_dir"
        )]
        base_hash: Option<String>,
        /// Computes the base hash from this Hugging Face model directory.
        #[arg(long)]
        model_dir: Option<PathBuf>,
    },
    /// Prints the base hash of a model directory, exactly as workers compute it.
    Hash {
        model_dir: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum AdapterCmd {
    List {
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        base_model: Option<String>,
    },
    /// Registers a new immutable version from an artifact under the
    /// gateway's artifact root, and prints its lora_int_id.
    Register {
        name: String,
        #[arg(long)]
        base_model: String,
        /// Relative to the artifact root, e.g. acme/support/v3.
        #[arg(long)]
        artifact_uri: String,
        /// Default: one above the highest existing version.
        #[arg(long)]
        version: Option<u32>,
        /// The owning tenant; omit for a platform-wide adapter.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Uploads a PEFT adapter directory to an object store (an artifact is
    /// immutable: the prefix must be empty) and registers it in one step,
    /// with a progress bar; credentials from the AWS chain.
    Push {
        dir: PathBuf,
        /// The artifact's URI, s3://bucket/prefix/..., inside one of the
        /// gateway's --artifact-store entries.
        #[arg(long)]
        to: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        base_model: String,
        #[arg(long)]
        version: Option<u32>,
        #[arg(long)]
        tenant: Option<String>,
        /// An S3-compatible server's URL (default: AWS, or AWS_ENDPOINT_URL).
        #[arg(long, env = "LORAFLEET_ARTIFACT_STORE_ENDPOINT")]
        endpoint: Option<String>,
    },
    /// Stops routing to a version; requests already running finish.
    Retire { lora_int_id: i64 },
    /// Prints the artifact digest of a local adapter directory, as the
    /// registry records it and workers verify it.
    Digest { dir: PathBuf },
}

#[derive(Debug, Subcommand)]
pub(crate) enum RouteCmd {
    List {
        #[arg(long)]
        tenant: Option<String>,
    },
    Get {
        tenant: String,
        model: String,
    },
    /// Creates a route or replaces its weights atomically.
    Set {
        tenant: String,
        model: String,
        /// LORA_INT_ID=BASIS_POINTS pairs summing to 10000, e.g. 7=9000,8=1000.
        #[arg(long, value_delimiter = ',', required_unless_present = "base")]
        weights: Vec<String>,
        /// Route to the base model itself (needs --base-model).
        #[arg(long, conflicts_with = "weights", requires = "base_model")]
        base: bool,
        #[arg(long)]
        base_model: Option<String>,
        /// The route's current etag (from `routes get`); required to change
        /// an existing route.
        #[arg(long)]
        etag: Option<String>,
    },
    /// Sends 100% of the route to one version.
    Promote {
        tenant: String,
        model: String,
        lora_int_id: i64,
        #[arg(long)]
        etag: String,
    },
    /// Restores the route's previous weights.
    Rollback {
        tenant: String,
        model: String,
        #[arg(long)]
        etag: String,
    },
    /// Progressive rollouts: a candidate version takes the route step by
    /// step, advanced or rolled back by the gateway on error rate and
    /// latency.
    #[command(subcommand)]
    Rollout(RolloutCmd),
}

#[derive(Debug, Subcommand)]
pub(crate) enum RolloutCmd {
    /// Starts a rollout of CANDIDATE on a route that sends all its traffic
    /// to one version (the stable one).
    Start {
        tenant: String,
        model: String,
        /// The candidate's lora_int_id.
        candidate: i64,
        /// The candidate's share at each step, in basis points, rising to
        /// 10000.
        #[arg(long, value_delimiter = ',', default_value = "100,1000,5000,10000")]
        steps: Vec<u32>,
        /// Seconds each step is held before it may advance.
        #[arg(long, default_value_t = 300)]
        hold_secs: u32,
        /// Requests each version needs in a step's window before any decision.
        #[arg(long, default_value_t = 20)]
        min_requests: u32,
        /// How far the candidate's error rate may exceed the stable's (0.01:
        /// one percentage point).
        #[arg(long, default_value_t = 0.01)]
        max_error_rate_increase: f64,
        /// The candidate's p95 time to first token at most this multiple of
        /// the stable's.
        #[arg(long, default_value_t = 1.5)]
        max_ttft_p95_ratio: f64,
        /// The same for the p95 time per output token.
        #[arg(long, default_value_t = 1.5)]
        max_tpot_p95_ratio: f64,
        /// An evaluation set of the route (NAME or NAME@VERSION; see `evals`):
        /// both versions are scored on it first, and the candidate takes
        /// traffic only if its score reaches the stable's plus
        /// --min-score-delta; otherwise the rollout ends `rejected`.
        #[arg(long)]
        eval: Option<String>,
        /// With --eval: the score difference (a fraction of the items, -1
        /// to 1) the candidate must reach over the stable version; -0.01
        /// lets it be one item in a hundred worse [default: 0].
        #[arg(long, allow_hyphen_values = true, requires = "eval")]
        min_score_delta: Option<f64>,
        /// With --eval: the seed of the evaluation's requests [default: 0].
        #[arg(long, requires = "eval")]
        eval_seed: Option<u64>,
        /// The route's current etag (from `routes get`).
        #[arg(long)]
        etag: String,
    },
    /// The route's latest rollout: its evaluation, step, gates and every
    /// decision with its figures.
    Status { tenant: String, model: String },
    /// Holds the current step: no decision until resumed.
    Pause { tenant: String, model: String },
    /// Resumes a paused rollout; the step's window starts again.
    Resume { tenant: String, model: String },
    /// Ends the rollout and sends all traffic back to the stable version.
    Abort { tenant: String, model: String },
}

#[derive(Debug, clap::Args)]
pub(crate) struct AuditArgs {
    #[arg(long)]
    pub(crate) tenant: Option<String>,
    /// An API key prefix.
    #[arg(long)]
    pub(crate) api_key: Option<String>,
    #[arg(long)]
    pub(crate) model: Option<String>,
    /// NAME or NAME:VERSION.
    #[arg(long)]
    pub(crate) adapter: Option<String>,
    #[arg(long)]
    pub(crate) lora_int_id: Option<i64>,
    #[arg(long)]
    pub(crate) worker: Option<String>,
    /// ok, cancelled, rejected or error.
    #[arg(long)]
    pub(crate) status: Option<String>,
    #[arg(long)]
    pub(crate) request_id: Option<String>,
    /// A client address: its requests and its failed authentications.
    #[arg(long)]
    pub(crate) client: Option<String>,
    /// RFC 3339, inclusive.
    #[arg(long)]
    pub(crate) since: Option<String>,
    /// RFC 3339, exclusive.
    #[arg(long)]
    pub(crate) until: Option<String>,
    /// Rows per page (1-1000).
    #[arg(long, default_value_t = 100)]
    pub(crate) limit: u32,
    /// Continue after a previous page's next_cursor.
    #[arg(long)]
    pub(crate) cursor: Option<String>,
    /// Follow cursors to the last page.
    #[arg(long)]
    pub(crate) all: bool,
    /// Export every matching row as JSON lines or CSV on stdout.
    #[arg(long, value_enum)]
    pub(crate) export: Option<Export>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub(crate) enum Export {
    Jsonl,
    Csv,
}

#[derive(Debug, clap::Args)]
pub(crate) struct UsageArgs {
    /// The span's start (RFC 3339), included.
    #[arg(long)]
    pub from: String,
    /// The span's end (RFC 3339), excluded; at most 366 days after --from.
    #[arg(long)]
    pub to: String,
    /// Comma-separated: tenant, route, adapter, and day or hour.
    #[arg(long)]
    pub group_by: Option<String>,
    /// One tenant's usage (its id).
    #[arg(long)]
    pub tenant: Option<String>,
    /// Comma-separated values with a header line, instead of a table.
    #[arg(long)]
    pub csv: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum PriceCmd {
    /// Every price set, by base model, then by tenant and route.
    List {
        #[arg(long)]
        base_model: Option<String>,
        /// One tenant's routes (its name).
        #[arg(long)]
        tenant: Option<String>,
    },
    /// A price from --from (a whole UTC hour, RFC 3339) until the next:
    /// --base-model with --device-hour, or --tenant and --route with
    /// --prompt-per-million and/or --completion-per-million.
    Set {
        #[arg(long)]
        from: String,
        #[arg(long)]
        base_model: Option<String>,
        #[arg(long)]
        tenant: Option<String>,
        /// The route's model name.
        #[arg(long)]
        route: Option<String>,
        #[arg(long)]
        device_hour: Option<f64>,
        #[arg(long)]
        prompt_per_million: Option<f64>,
        #[arg(long)]
        completion_per_million: Option<f64>,
    },
}

/// `token` mints an admin token; `token revoke TOKEN` revokes one, and
/// `token revoke-tenant TOKEN` a tenant's JWT.
#[derive(Debug, clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
pub(crate) struct TokenArgs {
    #[command(subcommand)]
    pub(crate) action: Option<TokenAction>,
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_HMAC_SECRET_FILE")]
    pub(crate) hmac_secret_file: Option<PathBuf>,
    /// Who the token speaks for; recorded in the admin change log.
    #[arg(long)]
    pub(crate) subject: Option<String>,
    /// admin, auditor or viewer.
    #[arg(long)]
    pub(crate) role: Option<String>,
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_ISSUER")]
    pub(crate) issuer: Option<String>,
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_AUDIENCE")]
    pub(crate) audience: Option<String>,
    #[arg(long, default_value_t = 3600)]
    pub(crate) ttl_secs: u64,
    /// HS256, HS384 or HS512.
    #[arg(long, default_value = "HS256")]
    pub(crate) algorithm: String,
}

#[derive(Debug, Subcommand)]
pub(crate) enum TokenAction {
    /// Revokes an admin token before it expires (by its jti, read from the
    /// token): every gateway refuses it within about a second.
    Revoke {
        /// The token itself, as `lorafleetctl token` printed it.
        #[arg(value_name = "TOKEN")]
        revoked: String,
    },
    /// Revokes a tenant's JWT before it expires (by its jti, read from the
    /// token): every gateway refuses it within about a second.
    RevokeTenant {
        /// The tenant's JWT, as its identity provider issued it.
        #[arg(value_name = "TOKEN")]
        revoked: String,
    },
}
