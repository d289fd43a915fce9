//! The admin API's request and response bodies. The gateway's handlers read
//! and write exactly these types, and `lorafleetctl` sends and reads the
//! same ones, so the server and its client cannot drift apart. Wire names
//! are the field names.
//!
//! A crate of its own, so the CLI links no server code: the `sqlx` feature
//! (the gateway's) adds the row mappings the server reads them with.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use uuid::Uuid;

/// `POST /tenants`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewTenant {
    pub name: String,
    #[serde(default)]
    pub display_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rpm_limit: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpm_limit: Option<u64>,
    /// The tenant's weight in the workers' fair admission; default 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// One of a tenant's limits: the gateway's default (`null` on the wire),
/// explicitly `"unlimited"`, or a positive number. The registry stores
/// NULL, 0 and the number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Limit {
    #[default]
    Default,
    Unlimited,
    Max(u64),
}

impl Limit {
    /// As the registry stores it.
    pub fn to_column(self) -> Option<i64> {
        match self {
            Limit::Default => None,
            Limit::Unlimited => Some(0),
            Limit::Max(n) => Some(i64::try_from(n).unwrap_or(i64::MAX)),
        }
    }

    /// As the registry stores it (a negative value is refused there).
    pub fn from_column(v: Option<i64>) -> Limit {
        match v {
            None => Limit::Default,
            Some(n) if n <= 0 => Limit::Unlimited,
            Some(n) => Limit::Max(n as u64),
        }
    }

    /// The limit in force, given the gateway's default (`None`: unlimited).
    pub fn resolve(self, default: Option<u64>) -> Option<u64> {
        match self {
            Limit::Default => default,
            Limit::Unlimited => None,
            Limit::Max(n) => Some(n),
        }
    }
}

impl From<Option<i64>> for Limit {
    fn from(v: Option<i64>) -> Limit {
        Limit::from_column(v)
    }
}

impl Serialize for Limit {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Limit::Default => s.serialize_none(),
            Limit::Unlimited => s.serialize_str("unlimited"),
            Limit::Max(n) => s.serialize_u64(*n),
        }
    }
}

impl<'de> Deserialize<'de> for Limit {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Limit, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Wire {
            Number(u64),
            Word(String),
        }
        match Option::<Wire>::deserialize(d)? {
            None => Ok(Limit::Default),
            Some(Wire::Number(0)) => Err(serde::de::Error::custom(
                "0 is not a limit: give a positive number, \"unlimited\", or null for the gateway's default",
            )),
            Some(Wire::Number(n)) => Ok(Limit::Max(n)),
            Some(Wire::Word(w)) if w == "unlimited" => Ok(Limit::Unlimited),
            Some(Wire::Word(w)) => Err(serde::de::Error::custom(format!(
                "{w:?} is not a limit: give a positive number, \"unlimited\", or null for the gateway's default"
            ))),
        }
    }
}

/// A limit written as something else.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotALimit(pub String);

impl std::fmt::Display for NotALimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} is not a limit: give a positive number, unlimited or default",
            self.0
        )
    }
}

impl std::error::Error for NotALimit {}

impl std::str::FromStr for Limit {
    type Err = NotALimit;

    /// `default`, `unlimited` or a positive number, as the CLI takes it.
    fn from_str(s: &str) -> Result<Limit, NotALimit> {
        match s {
            "default" => Ok(Limit::Default),
            "unlimited" => Ok(Limit::Unlimited),
            _ => match s.parse::<u64>() {
                Ok(n) if n > 0 => Ok(Limit::Max(n)),
                _ => Err(NotALimit(s.to_owned())),
            },
        }
    }
}

/// A tenant, as every tenant endpoint answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct TenantRow {
    pub name: String,
    pub display_name: String,
    #[cfg_attr(feature = "sqlx", sqlx(try_from = "Option<i64>"))]
    pub rpm_limit: Limit,
    #[cfg_attr(feature = "sqlx", sqlx(try_from = "Option<i64>"))]
    pub tpm_limit: Limit,
    /// Requests in flight at once, across the gateways.
    #[cfg_attr(feature = "sqlx", sqlx(try_from = "Option<i64>"))]
    pub max_concurrent: Limit,
    pub weight: f64,
    pub created_at: DateTime<Utc>,
    pub disabled_at: Option<DateTime<Utc>>,
}

/// `PATCH /tenants/{tenant}`: only the fields present change; a limit set
/// to `null` goes back to the gateway's default.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantPatch {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub display_name: Option<String>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub rpm_limit: Option<Limit>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub tpm_limit: Option<Limit>,
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub max_concurrent: Option<Limit>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
}

/// A field that is present, even as `null` (absent stays `None`).
fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<T>, D::Error> {
    T::deserialize(d).map(Some)
}

/// `GET /tenants`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TenantList {
    pub tenants: Vec<TenantRow>,
}

/// `POST /tenants/{tenant}/keys`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewKey {
    #[serde(default)]
    pub name: String,
    /// Default: `inference` and `models:read`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub scopes: Option<Vec<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<DateTime<Utc>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_in_secs: Option<u64>,
}

/// An API key without its secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct KeyRow {
    pub prefix: String,
    pub tenant: String,
    pub name: String,
    pub scopes: Vec<String>,
    pub created_at: DateTime<Utc>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked_at: Option<DateTime<Utc>>,
}

/// A key just created: the only answer that carries its secret.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CreatedKey {
    #[serde(flatten)]
    pub row: KeyRow,
    /// The whole key, `lf_<prefix>.<secret>`: shown once.
    pub key: String,
}

/// `GET /tenants/{tenant}/keys`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KeyList {
    pub keys: Vec<KeyRow>,
}

/// `POST /base-models`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewBaseModel {
    pub name: String,
    pub architecture: String,
    pub base_hash: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct BaseModelRow {
    pub name: String,
    pub architecture: String,
    pub base_hash: String,
    pub created_at: DateTime<Utc>,
}

/// `GET /base-models`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BaseModelList {
    pub base_models: Vec<BaseModelRow>,
}

/// `POST /adapters`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewAdapter {
    pub name: String,
    /// Default: one above the highest version of this name.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub version: Option<u32>,
    pub base_model: String,
    /// The owning tenant; absent for a platform-wide adapter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    pub artifact_uri: String,
}

/// An adapter version.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct AdapterRow {
    pub lora_int_id: i64,
    pub name: String,
    pub version: i32,
    pub base_model: String,
    pub tenant: Option<String>,
    pub rank: i32,
    pub alpha: f64,
    pub use_rslora: bool,
    pub target_modules: Vec<String>,
    pub artifact_uri: String,
    pub artifact_sha256: String,
    /// What the artifact held at registration (None for a version
    /// registered before sizes were recorded): a worker refuses to fetch
    /// more.
    #[serde(default)]
    pub artifact_bytes: Option<i64>,
    #[serde(default)]
    pub artifact_files: Option<i32>,
    /// What the version does beyond plain LoRA (`dora`, `lora_bias`,
    /// `embed_tokens`, `lm_head`, `modules_to_save`, `trainable_tokens`);
    /// a worker that cannot serve one refuses the adapter by name.
    #[serde(default)]
    pub features: Vec<String>,
    /// The vocabulary the version's saved embedding layers have (their
    /// rows; `modules_to_save`); None where it uses the base model's.
    #[serde(default)]
    pub vocab_size: Option<i32>,
    pub state: String,
    pub created_at: DateTime<Utc>,
    pub retired_at: Option<DateTime<Utc>>,
}

/// `GET /adapters`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdapterList {
    pub adapters: Vec<AdapterRow>,
}

/// One version's share of a route, in basis points.
#[derive(Debug, Serialize, Deserialize, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Weight {
    pub lora_int_id: i64,
    pub weight_bp: u32,
}

/// `PUT /routes/{tenant}/{model}`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSpec {
    /// Required for a base-model route; for adapter weights it defaults to
    /// the adapters' base model.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub base_model: Option<String>,
    /// Empty or absent: the route serves the base model itself.
    #[serde(default)]
    pub weights: Vec<Weight>,
}

/// `POST /routes/{tenant}/{model}/promote`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromoteSpec {
    pub lora_int_id: i64,
}

/// A route at its current revision.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteView {
    pub tenant: String,
    pub model: String,
    pub revision: i32,
    pub etag: String,
    pub base_model: String,
    /// "base" or "adapters".
    pub target: String,
    pub weights: Vec<WeightView>,
    pub updated_at: DateTime<Utc>,
    pub created_by: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct WeightView {
    pub lora_int_id: i64,
    pub adapter: String,
    pub version: i32,
    pub weight_bp: i32,
}

/// `GET /routes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RouteList {
    pub routes: Vec<RouteView>,
}

/// One row of the admin change log.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct ChangeRow {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub role: String,
    pub action: String,
    pub object_type: String,
    pub object_id: String,
    pub before: Option<Value>,
    pub after: Option<Value>,
    pub request_id: Uuid,
}

/// One day (or the legacy range) of the audit log.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct AuditPartition {
    pub name: String,
    /// None for `audit_log_legacy`: every time before the cutover.
    pub from_time: Option<DateTime<Utc>>,
    pub to_time: DateTime<Utc>,
    /// Postgres's estimate, not a count.
    pub estimated_rows: i64,
}

/// `GET /audit/partitions`: the audit log's partitions, oldest first, and
/// the gateway replica that maintains them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AuditPartitions {
    pub partitions: Vec<AuditPartition>,
    /// The holder of the lease `audit_partitions` and when it lapses
    /// unrenewed; None when no replica has held it.
    pub maintainer: Option<String>,
    pub maintainer_lease_expires_at: Option<DateTime<Utc>>,
}

/// One group of `GET /usage`: its usage over the report's span.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct UsageRow {
    /// The period's start, when grouped by day or hour.
    pub period: Option<DateTime<Utc>>,
    pub tenant_id: Option<Uuid>,
    pub route_id: Option<Uuid>,
    pub lora_int_id: Option<i64>,
    /// Traffic a rollout's evaluation sent, kept apart from tenants'.
    pub evaluation: bool,
    /// The tenant's name, when grouped by tenant.
    pub tenant: Option<String>,
    /// The adapter version as `name:vN`, when grouped by adapter.
    pub adapter: Option<String>,
    pub requests: i64,
    /// Of `requests`, those that completed.
    pub completed: i64,
    pub prompt_tokens: i64,
    pub completion_tokens: i64,
    pub cached_tokens: i64,
    /// The workers' forward-pass time.
    pub device_seconds: f64,
    /// The copies of the group's adapters into device slots charged to
    /// its requests (not priced: a device-hour price covers
    /// `device_seconds`).
    #[serde(default)]
    pub load_seconds: f64,
    /// `device_seconds` at each hour's price for its base model (`POST
    /// /prices`); None where no hour of the group had one.
    pub device_cost: Option<f64>,
    /// Prompt and completion tokens at each hour's price for their route;
    /// None where no hour of the group had one.
    pub token_cost: Option<f64>,
    /// The two together; None where neither applied.
    pub cost: Option<f64>,
}

/// `POST /prices`: a price from `effective_at` (a whole UTC hour) on, until
/// the next for the same base model or route. Either a base model's, per
/// hour of its workers' device time (`device_hour`), or a tenant's route's,
/// per million prompt and per million completion tokens (one left out
/// costs nothing).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewPrice {
    pub base_model: Option<String>,
    /// The route's tenant (name) and model name, with `route`.
    pub tenant: Option<String>,
    pub route: Option<String>,
    pub effective_at: DateTime<Utc>,
    pub device_hour: Option<f64>,
    pub prompt_per_million: Option<f64>,
    pub completion_per_million: Option<f64>,
}

/// One price, as set.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct PriceRow {
    pub id: Uuid,
    pub base_model: Option<String>,
    pub tenant: Option<String>,
    pub route: Option<String>,
    pub effective_at: DateTime<Utc>,
    pub device_hour: Option<f64>,
    pub prompt_per_million: Option<f64>,
    pub completion_per_million: Option<f64>,
    pub created_at: DateTime<Utc>,
    pub created_by: String,
}

/// `GET /prices`: every price, by base model or route, oldest first.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PriceList {
    pub prices: Vec<PriceRow>,
}

/// `GET /usage`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct UsageList {
    pub rows: Vec<UsageRow>,
}

/// `GET /changes`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChangeList {
    pub changes: Vec<ChangeRow>,
}

/// `POST /routes/{tenant}/{model}/rollout`: a candidate version takes the
/// route step by step. Absent fields take the defaults shown by
/// `lorafleetctl routes rollout start --help`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutSpec {
    pub candidate_lora_int_id: i64,
    /// The candidate's share at each step, in basis points, rising to
    /// 10000 (default 100, 1000, 5000, 10000).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steps: Option<Vec<u32>>,
    /// How long each step is held before it may advance (default 300).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hold_secs: Option<u32>,
    /// Requests each version needs in a step's window before any decision
    /// (default 20).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_requests: Option<u32>,
    /// How far the candidate's error rate may exceed the stable's, as a
    /// fraction (default 0.01).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_error_rate_increase: Option<f64>,
    /// The candidate's p95 time to first token at most this multiple of the
    /// stable's (default 1.5).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_ttft_p95_ratio: Option<f64>,
    /// The same for the p95 time per output token (default 1.5).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tpot_p95_ratio: Option<f64>,
    /// An evaluation set of the route (`NAME`, its latest version, or
    /// `NAME@VERSION`): before any step, both versions are scored on it and
    /// the rollout starts only if the candidate's score reaches the
    /// stable's plus `min_score_delta`; otherwise it ends `rejected`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval: Option<String>,
    /// The score difference (a fraction of the items, -1 to 1) the
    /// candidate must reach over the stable version (default 0; -0.01 lets
    /// it be up to one item in a hundred worse). Only with `eval`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_score_delta: Option<f64>,
    /// The seed of the evaluation's requests (default 0). Only with `eval`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_seed: Option<u64>,
}

/// `POST /routes/{tenant}/{model}/evals`: an evaluation set for a route,
/// the JSON Lines file's text in `jsonl`. Registering a name again makes
/// its next version.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewEvalSet {
    pub name: String,
    pub jsonl: String,
}

/// An evaluation set, as registered.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalSetView {
    pub id: Uuid,
    pub tenant: String,
    pub model: String,
    pub name: String,
    pub version: i32,
    /// SHA-256 of the file as registered.
    pub sha256: String,
    pub items: i32,
    pub multiple_choice: i32,
    pub generation: i32,
    pub bytes: i32,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
}

/// `GET /routes/{tenant}/{model}/evals`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalSetList {
    pub sets: Vec<EvalSetView>,
}

/// An item whose outcome differs between the two versions.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvalItemChange {
    pub item_index: i32,
    pub stable_correct: bool,
    pub candidate_correct: bool,
    /// What each version did (loglikelihoods and choice, or the answer).
    pub stable: Value,
    pub candidate: Value,
}

/// A rollout's evaluation, as far as it has gone.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EvaluationView {
    /// `NAME@VERSION`.
    pub set: String,
    pub sha256: String,
    pub items: i32,
    pub min_score_delta: f64,
    pub seed: u64,
    /// Items scored so far, per version.
    pub stable_done: i32,
    pub candidate_done: i32,
    /// Fractions of the items right, once every item is scored.
    pub stable_score: Option<f64>,
    pub candidate_score: Option<f64>,
    /// The items the two versions disagree on, in order.
    pub changed: Vec<EvalItemChange>,
}

/// One decision of a rollout, with the figures it was taken on.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct RolloutDecision {
    pub at: DateTime<Utc>,
    /// evaluate, start, reject, advance, succeed, roll_back, pause, resume
    /// or abort.
    pub decision: String,
    pub step_index: i32,
    pub revision: Option<i32>,
    pub actor: String,
    pub figures: Option<Value>,
    pub reason: Option<String>,
}

/// A rollout as `GET /routes/{tenant}/{model}/rollout` answers (the route's
/// latest).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RolloutView {
    pub id: Uuid,
    pub tenant: String,
    pub model: String,
    /// evaluating, running, paused, succeeded, rolled_back, aborted or
    /// rejected.
    pub state: String,
    pub stable_lora_int_id: i64,
    pub candidate_lora_int_id: i64,
    pub steps: Vec<u32>,
    pub step_index: u32,
    pub step_started_at: DateTime<Utc>,
    pub hold_secs: u32,
    pub min_requests: u32,
    pub max_error_rate_increase: f64,
    pub max_ttft_p95_ratio: f64,
    pub max_tpot_p95_ratio: f64,
    pub reason: Option<String>,
    pub created_by: String,
    pub decisions: Vec<RolloutDecision>,
    /// Its evaluation, if it names a set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationView>,
}

/// `POST /tokens/revoke`: an admin token revoked by its `jti` until its
/// expiry (`lorafleetctl token revoke TOKEN` reads both from the token).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenRevocation {
    pub jti: String,
    pub expires_at: DateTime<Utc>,
}

/// A revoked admin token.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[cfg_attr(feature = "sqlx", derive(sqlx::FromRow))]
pub struct TokenRevoked {
    pub jti: String,
    pub expires_at: DateTime<Utc>,
    pub revoked_at: DateTime<Utc>,
    pub revoked_by: String,
}
