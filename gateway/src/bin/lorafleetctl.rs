//! `lorafleetctl`: the platform admins' command line over the gateway's
//! admin API (`/admin/v1`). Tables for people, `--output json` for scripts,
//! and exit codes scripts can rely on (see `--help`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};

const EXIT_CODES: &str = "\
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
struct Cli {
    /// The admin API's base URL.
    #[arg(
        long,
        global = true,
        env = "LORAFLEET_ADMIN_URL",
        default_value = "http://127.0.0.1:8081"
    )]
    server: String,
    /// An admin JWT (see `lorafleetctl token`).
    #[arg(
        long,
        global = true,
        env = "LORAFLEET_ADMIN_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    /// table for people, json for scripts.
    #[arg(long, short, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    /// Seconds to wait for the admin API.
    #[arg(long, global = true, default_value_t = 120)]
    timeout_secs: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
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
    /// Workers as this gateway sees them: base hash, load, residency by tier.
    Fleet,
    /// Queries the audit log (one row per completion), or exports it.
    Audit(AuditArgs),
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
}

#[derive(Debug, Subcommand)]
enum TenantCmd {
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
enum KeyCmd {
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
enum BaseCmd {
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
enum AdapterCmd {
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
    /// Stops routing to a version; requests already running finish.
    Retire { lora_int_id: i64 },
    /// Prints the artifact digest of a local adapter directory, as the
    /// registry records it and workers verify it.
    Digest { dir: PathBuf },
}

#[derive(Debug, Subcommand)]
enum RouteCmd {
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
}

#[derive(Debug, clap::Args)]
struct AuditArgs {
    #[arg(long)]
    tenant: Option<String>,
    /// An API key prefix.
    #[arg(long)]
    api_key: Option<String>,
    #[arg(long)]
    model: Option<String>,
    /// NAME or NAME:VERSION.
    #[arg(long)]
    adapter: Option<String>,
    #[arg(long)]
    lora_int_id: Option<i64>,
    #[arg(long)]
    worker: Option<String>,
    /// ok, cancelled, rejected or error.
    #[arg(long)]
    status: Option<String>,
    #[arg(long)]
    request_id: Option<String>,
    /// RFC 3339, inclusive.
    #[arg(long)]
    since: Option<String>,
    /// RFC 3339, exclusive.
    #[arg(long)]
    until: Option<String>,
    /// Rows per page (1-1000).
    #[arg(long, default_value_t = 100)]
    limit: u32,
    /// Continue after a previous page's next_cursor.
    #[arg(long)]
    cursor: Option<String>,
    /// Follow cursors to the last page.
    #[arg(long)]
    all: bool,
    /// Export every matching row as JSON lines or CSV on stdout.
    #[arg(long, value_enum)]
    export: Option<Export>,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Export {
    Jsonl,
    Csv,
}

#[derive(Debug, clap::Args)]
struct TokenArgs {
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_HMAC_SECRET_FILE")]
    hmac_secret_file: PathBuf,
    /// Who the token speaks for; recorded in the admin change log.
    #[arg(long)]
    subject: String,
    /// admin, auditor or viewer.
    #[arg(long)]
    role: String,
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_ISSUER")]
    issuer: String,
    #[arg(long, env = "LORAFLEET_ADMIN_JWT_AUDIENCE")]
    audience: String,
    #[arg(long, default_value_t = 3600)]
    ttl_secs: u64,
    /// HS256, HS384 or HS512.
    #[arg(long, default_value = "HS256")]
    algorithm: String,
}

/// A failure with the exit code it maps to.
#[derive(Debug)]
struct Failure {
    code: u8,
    message: String,
}

fn fail(code: u8, message: impl Into<String>) -> Failure {
    Failure {
        code,
        message: message.into(),
    }
}

const USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}

struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    output: Output,
}

/// Encodes one path segment (model names may hold '/').
fn segment(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    fn url(&self, path: &str) -> String {
        format!("{}/admin/v1{path}", self.base.trim_end_matches('/'))
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
        if_match: Option<&str>,
    ) -> Result<reqwest::Response, Failure> {
        let token = self.token.as_deref().ok_or_else(|| {
            fail(
                USAGE,
                "--token: required (or LORAFLEET_ADMIN_TOKEN); mint one with `lorafleetctl token`",
            )
        })?;
        let mut req = self
            .http
            .request(method, self.url(path))
            .bearer_auth(token)
            .query(query);
        if let Some(b) = body {
            req = req.json(&b);
        }
        if let Some(e) = if_match {
            let e = e.trim_matches('"');
            req = req.header("If-Match", format!("\"{e}\""));
        }
        let resp = req.send().await.map_err(|e| {
            fail(
                7,
                format!("cannot reach the admin API at {}: {e}", self.base),
            )
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap_or_default();
        let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        let message = body["error"]["message"]
            .as_str()
            .map(str::to_owned)
            .unwrap_or_else(|| format!("HTTP {status}: {text}"));
        if self.output == Output::Json && !body.is_null() {
            println!("{body}");
        }
        let code = match status {
            401 | 403 => 3,
            404 => 4,
            409 | 412 | 428 => 5,
            400 | 413 | 422 => 6,
            503 => 7,
            _ => 1,
        };
        Err(fail(code, message))
    }

    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        query: &[(&str, String)],
        body: Option<Value>,
        if_match: Option<&str>,
    ) -> Result<Value, Failure> {
        let resp = self.send(method, path, query, body, if_match).await?;
        resp.json().await.map_err(|e| {
            fail(
                1,
                format!("the admin API sent a body that is not JSON: {e}"),
            )
        })
    }

    async fn get(&self, path: &str, query: &[(&str, String)]) -> Result<Value, Failure> {
        self.call(reqwest::Method::GET, path, query, None, None)
            .await
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value, Failure> {
        self.call(reqwest::Method::POST, path, &[], Some(body), None)
            .await
    }
}

/// Prints a table: a header line, then aligned columns.
fn table(headers: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        println!("{}", s.trim_end());
    };
    line(headers.iter().map(|h| h.to_uppercase()).collect());
    for r in rows {
        line(r.clone());
    }
}

/// A JSON value as a table cell.
fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().map(cell).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}

fn rows_of(list: &Value, columns: &[&str]) -> Vec<Vec<String>> {
    list.as_array()
        .map(|a| {
            a.iter()
                .map(|item| columns.iter().map(|c| cell(&item[*c])).collect())
                .collect()
        })
        .unwrap_or_default()
}

fn show_list(c: &Client, body: &Value, key: &str, columns: &[&str]) {
    if c.output == Output::Json {
        println!("{body}");
    } else {
        table(columns, &rows_of(&body[key], columns));
    }
}

fn show_one(c: &Client, body: &Value, columns: &[&str]) {
    if c.output == Output::Json {
        println!("{body}");
    } else {
        for col in columns {
            println!("{col:<16} {}", cell(&body[*col]));
        }
    }
}

fn progress_bar(what: &str) -> indicatif::ProgressBar {
    // Drawn on stderr only when it is a terminal, so scripts see clean output.
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} ({bytes_per_sec}, {eta})",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar.set_message(what.to_owned());
    bar
}

fn hash_model_dir(dir: &Path) -> Result<String, Failure> {
    let bar = progress_bar("hashing base weights");
    let result = lorafleet_engine::model::weights::base_hash(dir, &mut |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    });
    bar.finish_and_clear();
    result.map_err(|e| fail(USAGE, format!("--model-dir {}: {e}", dir.display())))
}

fn parse_duration(s: &str) -> Result<u64, Failure> {
    let bad = || {
        fail(
            USAGE,
            format!("--expires-in: {s:?} is not a duration such as 90d, 12h, 30m or 3600s"),
        )
    };
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().map_err(|_| bad())?;
    let mult = match unit {
        "s" | "" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).filter(|v| *v > 0).ok_or_else(bad)
}

async fn run(cli: Cli) -> Result<(), Failure> {
    if let Command::Token(t) = &cli.command {
        return mint_token(t);
    }
    if let Command::BaseModels(BaseCmd::Hash { model_dir }) = &cli.command {
        let hash = hash_model_dir(model_dir)?;
        match cli.output {
            Output::Json => println!("{}", json!({ "base_hash": hash })),
            Output::Table => println!("{hash}"),
        }
        return Ok(());
    }
    if let Command::Adapters(AdapterCmd::Digest { dir }) = &cli.command {
        let bar = progress_bar("hashing artifact");
        let digest = lorafleet_engine::artifact::digest_with_progress(dir, &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        });
        bar.finish_and_clear();
        let digest = digest.map_err(|e| fail(USAGE, e.to_string()))?;
        match cli.output {
            Output::Json => println!("{}", json!({ "artifact_sha256": digest })),
            Output::Table => println!("{digest}"),
        }
        return Ok(());
    }
    if cli.timeout_secs == 0 {
        return Err(fail(USAGE, "--timeout-secs: must be at least 1"));
    }
    if !(cli.server.starts_with("http://") || cli.server.starts_with("https://")) {
        return Err(fail(
            USAGE,
            format!(
                "--server: {:?} must start with http:// or https://",
                cli.server
            ),
        ));
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(cli.timeout_secs))
        .build()
        .map_err(|e| fail(1, e.to_string()))?;
    let c = Client {
        http,
        base: cli.server.clone(),
        token: cli.token.clone(),
        output: cli.output,
    };
    match cli.command {
        Command::Tenants(cmd) => tenants(&c, cmd).await,
        Command::Keys(cmd) => keys(&c, cmd).await,
        Command::BaseModels(cmd) => base_models(&c, cmd).await,
        Command::Adapters(cmd) => adapters(&c, cmd).await,
        Command::Routes(cmd) => routes(&c, cmd).await,
        Command::Fleet => fleet(&c).await,
        Command::Audit(a) => audit(&c, a).await,
        Command::Changes {
            object_type,
            object_id,
            limit,
        } => {
            let mut q = vec![("limit", limit.to_string())];
            if let Some(t) = object_type {
                q.push(("object_type", t));
            }
            if let Some(i) = object_id {
                q.push(("object_id", i));
            }
            let body = c.get("/changes", &q).await?;
            show_list(
                &c,
                &body,
                "changes",
                &["at", "actor", "role", "action", "object_type", "object_id"],
            );
            Ok(())
        }
        Command::Token(_) => unreachable!("handled above"),
    }
}

const TENANT_COLUMNS: &[&str] = &[
    "name",
    "display_name",
    "rpm_limit",
    "tpm_limit",
    "created_at",
    "disabled_at",
];

async fn tenants(c: &Client, cmd: TenantCmd) -> Result<(), Failure> {
    match cmd {
        TenantCmd::List => {
            let body = c.get("/tenants", &[]).await?;
            show_list(c, &body, "tenants", TENANT_COLUMNS);
        }
        TenantCmd::Create {
            name,
            display_name,
            rpm_limit,
            tpm_limit,
        } => {
            let body = c
                .post(
                    "/tenants",
                    json!({"name": name, "display_name": display_name,
                           "rpm_limit": rpm_limit, "tpm_limit": tpm_limit}),
                )
                .await?;
            show_one(c, &body, TENANT_COLUMNS);
        }
        TenantCmd::Disable { name } => {
            let body = c
                .post(&format!("/tenants/{}/disable", segment(&name)), json!({}))
                .await?;
            show_one(c, &body, TENANT_COLUMNS);
        }
        TenantCmd::Enable { name } => {
            let body = c
                .post(&format!("/tenants/{}/enable", segment(&name)), json!({}))
                .await?;
            show_one(c, &body, TENANT_COLUMNS);
        }
    }
    Ok(())
}

const KEY_COLUMNS: &[&str] = &[
    "prefix",
    "tenant",
    "name",
    "scopes",
    "created_at",
    "expires_at",
    "revoked_at",
];

async fn keys(c: &Client, cmd: KeyCmd) -> Result<(), Failure> {
    match cmd {
        KeyCmd::List { tenant } => {
            let body = c
                .get(&format!("/tenants/{}/keys", segment(&tenant)), &[])
                .await?;
            show_list(c, &body, "keys", KEY_COLUMNS);
        }
        KeyCmd::Create {
            tenant,
            name,
            scopes,
            expires_in,
            expires_at,
        } => {
            let mut req = json!({ "name": name });
            if !scopes.is_empty() {
                req["scopes"] = json!(scopes);
            }
            if let Some(d) = expires_in {
                req["expires_in_secs"] = json!(parse_duration(&d)?);
            }
            if let Some(at) = expires_at {
                req["expires_at"] = json!(at);
            }
            let body = c
                .post(&format!("/tenants/{}/keys", segment(&tenant)), req)
                .await?;
            if c.output == Output::Json {
                println!("{body}");
            } else {
                show_one(c, &body, KEY_COLUMNS);
                println!();
                println!("key: {}", cell(&body["key"]));
                eprintln!("Store this key now: it is not shown again.");
            }
        }
        KeyCmd::Revoke { prefix } => {
            let body = c
                .post(&format!("/keys/{}/revoke", segment(&prefix)), json!({}))
                .await?;
            show_one(c, &body, KEY_COLUMNS);
        }
    }
    Ok(())
}

async fn base_models(c: &Client, cmd: BaseCmd) -> Result<(), Failure> {
    let columns = &["name", "architecture", "base_hash", "created_at"];
    match cmd {
        BaseCmd::List => {
            let body = c.get("/base-models", &[]).await?;
            show_list(c, &body, "base_models", columns);
        }
        BaseCmd::Register {
            name,
            architecture,
            base_hash,
            model_dir,
        } => {
            let hash = match (base_hash, model_dir) {
                (Some(h), _) => h,
                (None, Some(dir)) => hash_model_dir(&dir)?,
                (None, None) => return Err(fail(USAGE, "--base-hash or --model-dir: required")),
            };
            let body = c
                .post(
                    "/base-models",
                    json!({"name": name, "architecture": architecture, "base_hash": hash}),
                )
                .await?;
            show_one(c, &body, columns);
        }
        BaseCmd::Hash { .. } => unreachable!("handled before connecting"),
    }
    Ok(())
}

const ADAPTER_COLUMNS: &[&str] = &[
    "lora_int_id",
    "name",
    "version",
    "base_model",
    "tenant",
    "rank",
    "target_modules",
    "state",
    "artifact_uri",
];

async fn adapters(c: &Client, cmd: AdapterCmd) -> Result<(), Failure> {
    match cmd {
        AdapterCmd::List { name, base_model } => {
            let mut q = Vec::new();
            if let Some(n) = name {
                q.push(("name", n));
            }
            if let Some(b) = base_model {
                q.push(("base_model", b));
            }
            let body = c.get("/adapters", &q).await?;
            show_list(c, &body, "adapters", ADAPTER_COLUMNS);
        }
        AdapterCmd::Register {
            name,
            base_model,
            artifact_uri,
            version,
            tenant,
        } => {
            let body = c
                .post(
                    "/adapters",
                    json!({"name": name, "base_model": base_model, "artifact_uri": artifact_uri,
                           "version": version, "tenant": tenant}),
                )
                .await?;
            show_one(
                c,
                &body,
                &[
                    "lora_int_id",
                    "name",
                    "version",
                    "base_model",
                    "tenant",
                    "rank",
                    "alpha",
                    "use_rslora",
                    "target_modules",
                    "artifact_uri",
                    "artifact_sha256",
                ],
            );
        }
        AdapterCmd::Retire { lora_int_id } => {
            let body = c
                .post(&format!("/adapters/{lora_int_id}/retire"), json!({}))
                .await?;
            show_one(c, &body, ADAPTER_COLUMNS);
        }
        AdapterCmd::Digest { .. } => unreachable!("handled before connecting"),
    }
    Ok(())
}

fn show_route(c: &Client, r: &Value) {
    if c.output == Output::Json {
        println!("{r}");
        return;
    }
    for col in [
        "tenant",
        "model",
        "etag",
        "base_model",
        "target",
        "updated_at",
        "created_by",
    ] {
        println!("{col:<12} {}", cell(&r[col]));
    }
    let weights = rows_of(
        &r["weights"],
        &["lora_int_id", "adapter", "version", "weight_bp"],
    );
    if !weights.is_empty() {
        println!();
        table(
            &["lora_int_id", "adapter", "version", "weight_bp"],
            &weights,
        );
    }
}

fn route_path(tenant: &str, model: &str) -> String {
    format!("/routes/{}/{}", segment(tenant), segment(model))
}

async fn routes(c: &Client, cmd: RouteCmd) -> Result<(), Failure> {
    match cmd {
        RouteCmd::List { tenant } => {
            let q: Vec<(&str, String)> = tenant.into_iter().map(|t| ("tenant", t)).collect();
            let body = c.get("/routes", &q).await?;
            if c.output == Output::Json {
                println!("{body}");
            } else {
                let rows: Vec<Vec<String>> = body["routes"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .map(|r| {
                                let split = r["weights"]
                                    .as_array()
                                    .map(|w| {
                                        w.iter()
                                            .map(|w| {
                                                format!(
                                                    "{}={}",
                                                    cell(&w["lora_int_id"]),
                                                    cell(&w["weight_bp"])
                                                )
                                            })
                                            .collect::<Vec<_>>()
                                            .join(",")
                                    })
                                    .unwrap_or_default();
                                vec![
                                    cell(&r["tenant"]),
                                    cell(&r["model"]),
                                    cell(&r["etag"]),
                                    cell(&r["base_model"]),
                                    cell(&r["target"]),
                                    if split.is_empty() { "-".into() } else { split },
                                ]
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                table(
                    &["tenant", "model", "etag", "base_model", "target", "weights"],
                    &rows,
                );
            }
        }
        RouteCmd::Get { tenant, model } => {
            let body = c.get(&route_path(&tenant, &model), &[]).await?;
            show_route(c, &body);
        }
        RouteCmd::Set {
            tenant,
            model,
            weights,
            base,
            base_model,
            etag,
        } => {
            let mut list = Vec::new();
            if !base {
                for (i, w) in weights.iter().enumerate() {
                    let parsed = w.split_once('=').and_then(|(id, bp)| {
                        Some((
                            id.trim().parse::<i64>().ok()?,
                            bp.trim().parse::<u32>().ok()?,
                        ))
                    });
                    let (id, bp) = parsed.ok_or_else(|| {
                        fail(
                            USAGE,
                            format!(
                                "--weights: item {} {w:?} is not LORA_INT_ID=BASIS_POINTS",
                                i + 1
                            ),
                        )
                    })?;
                    list.push(json!({"lora_int_id": id, "weight_bp": bp}));
                }
            }
            let body = c
                .call(
                    reqwest::Method::PUT,
                    &route_path(&tenant, &model),
                    &[],
                    Some(json!({"base_model": base_model, "weights": list})),
                    etag.as_deref(),
                )
                .await?;
            show_route(c, &body);
        }
        RouteCmd::Promote {
            tenant,
            model,
            lora_int_id,
            etag,
        } => {
            let body = c
                .call(
                    reqwest::Method::POST,
                    &format!("{}/promote", route_path(&tenant, &model)),
                    &[],
                    Some(json!({ "lora_int_id": lora_int_id })),
                    Some(&etag),
                )
                .await?;
            show_route(c, &body);
        }
        RouteCmd::Rollback {
            tenant,
            model,
            etag,
        } => {
            let body = c
                .call(
                    reqwest::Method::POST,
                    &format!("{}/rollback", route_path(&tenant, &model)),
                    &[],
                    None,
                    Some(&etag),
                )
                .await?;
            show_route(c, &body);
        }
    }
    Ok(())
}

async fn fleet(c: &Client) -> Result<(), Failure> {
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
                        if w["up"] == json!(true) { "up" } else { "down" }.into(),
                        hash.chars().take(12).collect(),
                        cell(&w["load"]),
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
            "base_hash",
            "load",
            "device",
            "host",
            "loading",
        ],
        &rows,
    );
    Ok(())
}

async fn audit(c: &Client, a: AuditArgs) -> Result<(), Failure> {
    let mut q: Vec<(&str, String)> = Vec::new();
    let pairs: [(&str, Option<String>); 10] = [
        ("tenant", a.tenant),
        ("api_key", a.api_key),
        ("model", a.model),
        ("adapter", a.adapter),
        ("lora_int_id", a.lora_int_id.map(|v| v.to_string())),
        ("worker", a.worker),
        ("status", a.status),
        ("request_id", a.request_id),
        ("since", a.since),
        ("until", a.until),
    ];
    for (k, v) in pairs {
        if let Some(v) = v {
            q.push((k, v));
        }
    }
    q.push(("limit", a.limit.to_string()));
    if let Some(export) = a.export {
        if let Some(cur) = a.cursor {
            q.push(("cursor", cur));
        }
        let format = match export {
            Export::Jsonl => "jsonl",
            Export::Csv => "csv",
        };
        q.push(("format", format.into()));
        let mut resp = c
            .send(reqwest::Method::GET, "/audit", &q, None, None)
            .await?;
        let mut out = std::io::stdout().lock();
        while let Some(chunk) = resp
            .chunk()
            .await
            .map_err(|e| fail(1, format!("the export was cut short: {e}")))?
        {
            out.write_all(&chunk)
                .map_err(|e| fail(1, format!("writing the export: {e}")))?;
        }
        return Ok(());
    }
    let mut cursor = a.cursor;
    let mut all_rows: Vec<Value> = Vec::new();
    let mut next: Option<String>;
    loop {
        let mut page_q = q.clone();
        if let Some(cur) = &cursor {
            page_q.push(("cursor", cur.clone()));
        }
        let body = c.get("/audit", &page_q).await?;
        all_rows.extend(body["rows"].as_array().cloned().unwrap_or_default());
        next = body["next_cursor"].as_str().map(str::to_owned);
        if !a.all || next.is_none() {
            break;
        }
        cursor = next.clone();
    }
    if c.output == Output::Json {
        println!("{}", json!({ "rows": all_rows, "next_cursor": next }));
        return Ok(());
    }
    let rows: Vec<Vec<String>> = all_rows
        .iter()
        .map(|r| {
            let adapter = match (&r["adapter_name"], &r["adapter_version"]) {
                (Value::String(n), v) => format!("{n}:{}", cell(v)),
                _ => "-".into(),
            };
            vec![
                cell(&r["received_at"]),
                cell(&r["request_id"]),
                cell(&r["tenant"]),
                cell(&r["model"]),
                cell(&r["lora_int_id"]),
                adapter,
                cell(&r["worker_id"]),
                cell(&r["status"]),
                cell(&r["http_status"]),
                format!(
                    "{}+{}",
                    cell(&r["prompt_tokens"]),
                    cell(&r["completion_tokens"])
                ),
            ]
        })
        .collect();
    table(
        &[
            "received_at",
            "request_id",
            "tenant",
            "model",
            "lora_int_id",
            "adapter",
            "worker",
            "status",
            "http",
            "tokens",
        ],
        &rows,
    );
    if let Some(n) = next {
        eprintln!("more rows: --cursor {n}");
    }
    Ok(())
}

fn mint_token(t: &TokenArgs) -> Result<(), Failure> {
    use jsonwebtoken::{Algorithm, EncodingKey, Header};
    if !["admin", "auditor", "viewer"].contains(&t.role.as_str()) {
        return Err(fail(
            USAGE,
            format!("--role: {:?} is not admin, auditor or viewer", t.role),
        ));
    }
    let alg = match t.algorithm.as_str() {
        "HS256" => Algorithm::HS256,
        "HS384" => Algorithm::HS384,
        "HS512" => Algorithm::HS512,
        other => {
            return Err(fail(
                USAGE,
                format!("--algorithm: {other:?} is not HS256, HS384 or HS512"),
            ));
        }
    };
    if t.subject.trim().is_empty() {
        return Err(fail(USAGE, "--subject: must not be empty"));
    }
    if t.ttl_secs == 0 {
        return Err(fail(USAGE, "--ttl-secs: must be at least 1"));
    }
    let secret = std::fs::read(&t.hmac_secret_file).map_err(|e| {
        fail(
            USAGE,
            format!("--hmac-secret-file {}: {e}", t.hmac_secret_file.display()),
        )
    })?;
    let secret = secret.trim_ascii();
    if secret.len() < 32 {
        return Err(fail(
            USAGE,
            "--hmac-secret-file: the secret must be at least 32 bytes",
        ));
    }
    let now = chrono::Utc::now().timestamp();
    let claims = json!({
        "sub": t.subject, "role": t.role, "iss": t.issuer, "aud": t.audience,
        "iat": now, "nbf": now, "exp": now + t.ttl_secs as i64,
    });
    let token = jsonwebtoken::encode(
        &Header::new(alg),
        &claims,
        &EncodingKey::from_secret(secret),
    )
    .map_err(|e| fail(1, format!("signing the token: {e}")))?;
    println!("{token}");
    Ok(())
}
