//! The audit log: one row per completion request, successful or not, and
//! never lost.
//!
//! - **Admission.** A request first takes a [`Ticket`]: a reserved place in
//!   the bounded queue (rows and bytes). When none is left, because
//!   Postgres is unreachable and the spool is at its disk limit, the
//!   request is refused with 503 `audit_unavailable` before any work.
//! - **Durability before the answer.** [`Ticket::record`] queues the row
//!   and returns a [`Durable`] that resolves once the row is committed in
//!   Postgres or fsynced in the spool (with [`Durability::Journal`], always
//!   the spool's journal first); the API answers only then, so no client is
//!   served a completion whose row could still be lost.
//! - **The writer** ([`writer`]) group-commits whatever is queued. A batch
//!   Postgres refuses as data (SQLSTATE classes 22 and 23) is split until
//!   the bad rows are alone; those go to `audit_dead_letter`. Anything else
//!   is an outage: a circuit breaker opens, rows go straight to the
//!   [`spool`] until a probe succeeds, then the spool is replayed in
//!   chunks.
//! - **Safe values.** Every text field is made safe ([`sanitize::safe`])
//!   before it is queued, so no client string can poison a batch.

pub mod partitions;
pub mod sanitize;
pub mod spool;
mod writer;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use uuid::Uuid;

use crate::ids::{KeyId, RouteId, TenantId};

pub use spool::{Spool, SpoolError};
/// Audit batches inserted at once (the writer's connections).
pub use writer::IN_FLIGHT as INSERTS_IN_FLIGHT;

/// How a request ended, as its audit row says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuditStatus {
    /// Answered in full.
    Ok,
    /// The client went away, or the drain deadline cut it.
    Cancelled,
    /// Refused before any worker was asked (authentication, limits, a bad
    /// body).
    Rejected,
    /// Failed after it was admitted.
    Error,
}

impl AuditStatus {
    pub const ALL: [AuditStatus; 4] = [
        AuditStatus::Ok,
        AuditStatus::Cancelled,
        AuditStatus::Rejected,
        AuditStatus::Error,
    ];

    /// The `status` column's text.
    pub const fn as_str(self) -> &'static str {
        match self {
            AuditStatus::Ok => "ok",
            AuditStatus::Cancelled => "cancelled",
            AuditStatus::Rejected => "rejected",
            AuditStatus::Error => "error",
        }
    }

    /// The status a column's text names.
    pub fn parse(text: &str) -> Option<AuditStatus> {
        AuditStatus::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

/// One row of `audit_log`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AuditRecord {
    pub request_id: Uuid,
    pub received_at: DateTime<Utc>,
    pub completed_at: DateTime<Utc>,
    pub tenant_id: Option<TenantId>,
    pub api_key_id: Option<KeyId>,
    /// The API key's prefix; None for a JWT.
    #[serde(default)]
    pub api_key_prefix: Option<String>,
    /// The JWT's `sub`; None for an API key.
    pub subject: Option<String>,
    /// The OpenAI `user` field.
    #[serde(default)]
    pub end_user: Option<String>,
    pub model_name: String,
    pub route_id: Option<RouteId>,
    pub route_revision: Option<i32>,
    pub lora_int_id: Option<i64>,
    pub adapter_name: Option<String>,
    pub adapter_version: Option<i32>,
    pub base_hash: Option<String>,
    pub worker_id: Option<String>,
    pub adapter_residency: Option<String>,
    pub status: AuditStatus,
    pub http_status: i16,
    pub error_code: Option<String>,
    /// stop or length; set exactly when status is ok.
    pub finish_reason: Option<String>,
    pub prompt_tokens: i32,
    pub completion_tokens: i32,
    /// Of the prompt tokens, those the worker's prefix cache served.
    #[serde(default)]
    pub cached_tokens: i32,
    /// The API features the request used, comma-separated in a fixed
    /// order (see `api::features`); empty for a plain request.
    #[serde(default)]
    pub features: String,
    pub latency_us: i64,
    pub ttft_us: Option<i64>,
    pub attempts: i16,
    /// The client's address (the gateway's `sources`); None for a request
    /// that came through no socket, and for rows from before it was kept.
    #[serde(default)]
    pub client_addr: Option<String>,
    /// The requests this row stands for: 1, or the failed authentications
    /// of one source in one window.
    #[serde(default = "one")]
    pub occurrences: i32,
    /// Of an aggregated row, the last API key prefix seen (the first is in
    /// `api_key_prefix`).
    #[serde(default)]
    pub last_key_prefix: Option<String>,
    /// The worker's forward-pass time the request used, in microseconds
    /// (its choices' shares of the steps they ran in); None where no
    /// choice finished on a worker.
    #[serde(default)]
    pub device_us: Option<i64>,
    /// The copies of the request's adapter into a device slot charged to
    /// it, in microseconds (its choices' shares); None as for `device_us`.
    #[serde(default)]
    pub load_us: Option<i64>,
}

/// A duration in whole microseconds, as the audit row keeps times.
pub fn micros(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_micros()).unwrap_or(i64::MAX)
}

fn one() -> i32 {
    1
}

/// A row's fixed part as a spool line (keys, ids, times, numbers), in bytes,
/// with room to spare: the weight bounds the line it becomes.
const FIXED_ROW_BYTES: usize = 1024;
/// Text fields of a row.
const TEXT_FIELDS: usize = 14;
/// The most a row can weigh once made safe: its fixed part and every text
/// field at its cap (and the cap's marker), twice over for JSON escapes.
pub const MAX_ROW_BYTES: usize =
    FIXED_ROW_BYTES + 2 * TEXT_FIELDS * (sanitize::MAX_FIELD_BYTES + 32);

impl AuditRecord {
    /// A `rejected` row received at `at`, with nothing known yet: the
    /// request fills it in as it goes.
    pub fn refused(request_id: Uuid, at: DateTime<Utc>) -> AuditRecord {
        AuditRecord {
            request_id,
            received_at: at,
            completed_at: at,
            tenant_id: None,
            api_key_id: None,
            api_key_prefix: None,
            subject: None,
            end_user: None,
            model_name: String::new(),
            route_id: None,
            route_revision: None,
            lora_int_id: None,
            adapter_name: None,
            adapter_version: None,
            base_hash: None,
            worker_id: None,
            adapter_residency: None,
            status: AuditStatus::Rejected,
            http_status: 0,
            error_code: None,
            finish_reason: None,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            features: String::new(),
            latency_us: 0,
            ttft_us: None,
            attempts: 0,
            client_addr: None,
            occurrences: 1,
            last_key_prefix: None,
            device_us: None,
            load_us: None,
        }
    }

    /// Makes every text field safe for any text column and bounded.
    fn make_safe(&mut self) {
        use sanitize::{MAX_FIELD_BYTES as M, safe, safe_opt};
        self.model_name = safe(&self.model_name, M);
        for f in [
            &mut self.api_key_prefix,
            &mut self.subject,
            &mut self.end_user,
            &mut self.adapter_name,
            &mut self.base_hash,
            &mut self.worker_id,
            &mut self.adapter_residency,
            &mut self.error_code,
            &mut self.finish_reason,
            &mut self.client_addr,
            &mut self.last_key_prefix,
        ] {
            *f = safe_opt(f, M);
        }
        self.features = safe(&self.features, M);
    }

    /// At least the bytes of its spool line (a JSON escape doubles a
    /// character at most, once control characters are gone).
    fn weight(&self) -> usize {
        let opt = |s: &Option<String>| s.as_ref().map_or(0, String::len);
        FIXED_ROW_BYTES
            + 2 * self.model_name.len()
            + 2 * self.status.as_str().len()
            + 2 * self.features.len()
            + [
                &self.api_key_prefix,
                &self.subject,
                &self.end_user,
                &self.adapter_name,
                &self.base_hash,
                &self.worker_id,
                &self.adapter_residency,
                &self.error_code,
                &self.finish_reason,
            ]
            .into_iter()
            .map(|s| 2 * opt(s))
            .sum::<usize>()
    }
}

/// The audit log's settings (the `--audit-*` flags).
#[derive(Debug, Clone)]
pub struct AuditConfig {
    /// The spool's root, shared by every gateway that may adopt another's rows.
    pub spool_dir: PathBuf,
    /// This process's directory under the root: unique among live gateways.
    pub spool_owner: String,
    /// Disk limit of the whole spool root, in bytes.
    pub spool_max_bytes: u64,
    /// Size at which a spool segment is closed and a new one begun.
    pub segment_bytes: u64,
    /// Rows the queue holds (requests in flight hold one each).
    pub queue_rows: usize,
    /// Bytes the queue holds.
    pub queue_bytes: usize,
    /// Longest a response waits for its row to be durable.
    pub ack_timeout: Duration,
    /// What a response waits for.
    pub durability: Durability,
}

/// What makes a row durable before its response is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Its commit in Postgres (or, while Postgres is unreachable, its
    /// fsync in the spool). Rows are in `audit_log` before the answer.
    #[default]
    Commit,
    /// Its fsync in the spool's journal, before the insert starts: a local
    /// write instead of a database round trip on every answer. Rows reach
    /// `audit_log` just after the answer; after a crash the journal is
    /// replayed by the same gateway or adopted by another.
    Journal,
}

impl std::str::FromStr for Durability {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "commit" => Ok(Durability::Commit),
            "journal" => Ok(Durability::Journal),
            other => Err(format!("{other:?} is neither \"commit\" nor \"journal\"")),
        }
    }
}

/// Why a request cannot be admitted: its row would have nowhere to go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Unavailable {
    #[error("the audit queue is full (Postgres is unreachable or slow); retry shortly")]
    QueueFull,
    #[error(
        "Postgres is unreachable and the audit spool is at its disk limit; retry when it is back"
    )]
    SpoolFull,
}

impl Unavailable {
    pub fn reason(self) -> &'static str {
        match self {
            Unavailable::QueueFull => "queue_full",
            Unavailable::SpoolFull => "spool_full",
        }
    }
}

/// State the writer shares with admission.
#[derive(Debug)]
struct Shared {
    breaker_open: AtomicBool,
    spool_used: Arc<AtomicU64>,
    spool_max: u64,
    queue_bytes: usize,
}

/// A queued row with what it holds of the queue, and who waits for it.
#[derive(Debug)]
struct Queued {
    record: AuditRecord,
    _bytes: Option<OwnedSemaphorePermit>,
    ack: Option<oneshot::Sender<()>>,
}

/// The request side: cheap to clone.
#[derive(Debug, Clone)]
pub struct AuditLog {
    tx: mpsc::Sender<Queued>,
    bytes: Arc<Semaphore>,
    shared: Arc<Shared>,
    ack_timeout: Duration,
    closing: Arc<tokio::sync::Notify>,
}

impl AuditLog {
    /// Reserves the place of one row, or says why there is none.
    pub fn admit(&self) -> Result<Ticket, Unavailable> {
        let s = &self.shared;
        // Admission stops while a full queue could no longer be spooled, so
        // every admitted row has room on disk if Postgres goes away.
        if s.spool_used.load(Ordering::Relaxed) + s.queue_bytes as u64 > s.spool_max {
            return Err(refused(Unavailable::SpoolFull));
        }
        let bytes = self
            .bytes
            .clone()
            .try_acquire_many_owned(MAX_ROW_BYTES as u32)
            .map_err(|_| refused(Unavailable::QueueFull))?;
        let slot = self
            .tx
            .clone()
            .try_reserve_owned()
            .map_err(|_| refused(Unavailable::QueueFull))?;
        Ok(Ticket {
            slot: Some(slot),
            bytes: Some(bytes),
            ack_timeout: self.ack_timeout,
        })
    }

    /// Shutdown: no new admissions; the writer stops once every admitted
    /// row is placed, however many handles (idle connections) remain.
    pub fn close(&self) {
        self.closing.notify_one();
    }
}

fn refused(u: Unavailable) -> Unavailable {
    metrics::counter!("lorafleet_gateway_audit_refused_total", "reason" => u.reason()).increment(1);
    u
}

/// One admitted request's row, to be recorded exactly once.
#[derive(Debug)]
pub struct Ticket {
    slot: Option<mpsc::OwnedPermit<Queued>>,
    bytes: Option<OwnedSemaphorePermit>,
    ack_timeout: Duration,
}

impl Ticket {
    /// Queues the row (made safe first); the result resolves once it is
    /// durable.
    pub fn record(mut self, mut record: AuditRecord) -> Durable {
        record.make_safe();
        let (ack, waiter) = oneshot::channel();
        let mut bytes = self.bytes.take();
        // Keep only what the row weighs; the rest of the reservation goes back.
        if let Some(b) = bytes.as_mut() {
            let keep = record.weight().min(MAX_ROW_BYTES) as u32;
            drop(b.split(b.num_permits().saturating_sub(keep as usize)));
        }
        if let Some(slot) = self.slot.take() {
            slot.send(Queued {
                record,
                _bytes: bytes,
                ack: Some(ack),
            });
        }
        Durable {
            waiter,
            timeout: self.ack_timeout,
        }
    }
}

/// Resolves when a row is in Postgres or fsynced in the spool.
#[derive(Debug)]
pub struct Durable {
    waiter: oneshot::Receiver<()>,
    timeout: Duration,
}

impl Durable {
    /// True once the row is durable; false if that did not happen within
    /// the ack timeout (the row stays queued and is written when it can be).
    pub async fn wait(self) -> bool {
        matches!(
            tokio::time::timeout(self.timeout, self.waiter).await,
            Ok(Ok(()))
        )
    }
}

/// Opens the spool and starts the writer. Await the returned handle after
/// every [`AuditLog`] clone and [`Ticket`] is gone to flush on shutdown.
pub fn start(
    pool: PgPool,
    config: &AuditConfig,
) -> Result<(AuditLog, tokio::task::JoinHandle<()>), SpoolError> {
    let spool = Spool::open(
        &config.spool_dir,
        &config.spool_owner,
        config.segment_bytes,
        config.spool_max_bytes,
    )?;
    let closing = Arc::new(tokio::sync::Notify::new());
    let shared = Arc::new(Shared {
        breaker_open: AtomicBool::new(false),
        spool_used: spool.used(),
        spool_max: spool.max_bytes(),
        queue_bytes: config.queue_bytes,
    });
    let (tx, rx) = mpsc::channel(config.queue_rows);
    let handle = tokio::spawn(writer::run(
        pool,
        spool,
        rx,
        shared.clone(),
        config.durability,
        closing.clone(),
    ));
    Ok((
        AuditLog {
            tx,
            bytes: Arc::new(Semaphore::new(config.queue_bytes)),
            shared,
            ack_timeout: config.ack_timeout,
            closing,
        },
        handle,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A spool line and the `status` column both carry the status's text:
    /// one name each, read back as the same status (spool lines written
    /// before the enum say the same words).
    #[test]
    fn a_status_is_its_column_text_in_the_spool_too() {
        for s in AuditStatus::ALL {
            assert_eq!(AuditStatus::parse(s.as_str()), Some(s));
            let line = serde_json::to_string(&s).unwrap();
            assert_eq!(line, format!("\"{}\"", s.as_str()));
            assert_eq!(serde_json::from_str::<AuditStatus>(&line).unwrap(), s);
        }
        assert_eq!(AuditStatus::parse("done"), None);
        assert!(serde_json::from_str::<AuditStatus>("\"Ok\"").is_err());
    }
}
