//! The audit log: one row per completion, successful or not.
//!
//! Requests hand their row to a channel and move on; a writer task inserts
//! rows in batches. When Postgres refuses a batch, the batch is appended to
//! a local spool file (JSON lines, fsynced) and replayed once Postgres is
//! back. Inserts are idempotent on `request_id`, so a replay after a partial
//! failure never duplicates a row. On shutdown the writer drains the channel
//! into Postgres or, failing that, the spool: no row is lost.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use tokio::sync::mpsc;
use uuid::Uuid;

/// Most rows per INSERT.
const BATCH: usize = 500;
/// Longest a row waits for its batch.
const LINGER: Duration = Duration::from_millis(200);
/// How often the spool is retried while it holds rows.
const REPLAY_EVERY: Duration = Duration::from_secs(1);

/// One row of `audit_log`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AuditRecord {
    pub request_id: Uuid,
    pub received_at: DateTime<Utc>,
    pub completed_at: DateTime<Utc>,
    pub tenant_id: Option<Uuid>,
    pub api_key_id: Option<Uuid>,
    pub subject: Option<String>,
    pub model_name: String,
    pub route_id: Option<Uuid>,
    pub route_revision: Option<i32>,
    pub lora_int_id: Option<i64>,
    pub adapter_name: Option<String>,
    pub adapter_version: Option<i32>,
    pub base_hash: Option<String>,
    pub worker_id: Option<String>,
    pub adapter_residency: Option<String>,
    /// ok, cancelled, rejected or error.
    pub status: String,
    pub http_status: i16,
    pub error_code: Option<String>,
    /// stop or length; set exactly when status is ok.
    pub finish_reason: Option<String>,
    pub prompt_tokens: i32,
    pub completion_tokens: i32,
    pub latency_us: i64,
    pub ttft_us: Option<i64>,
    pub attempts: i16,
}

/// The request side: cheap to clone, never blocks.
#[derive(Debug, Clone)]
pub struct AuditLog {
    tx: mpsc::UnboundedSender<AuditRecord>,
}

impl AuditLog {
    pub fn record(&self, r: AuditRecord) {
        if self.tx.send(r).is_err() {
            // Only after shutdown began; the writer has already drained.
            tracing::error!("audit row after the audit writer stopped");
        }
    }
}

/// Starts the writer. Await the returned handle after dropping every
/// [`AuditLog`] clone to flush on shutdown.
pub fn start(pool: PgPool, spool: PathBuf) -> (AuditLog, tokio::task::JoinHandle<()>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let handle = tokio::spawn(writer(pool, spool, rx));
    (AuditLog { tx }, handle)
}

async fn writer(pool: PgPool, spool: PathBuf, mut rx: mpsc::UnboundedReceiver<AuditRecord>) {
    let mut spooled = spool_len(&spool) > 0;
    let mut replay = tokio::time::interval(REPLAY_EVERY);
    loop {
        let mut batch = Vec::new();
        tokio::select! {
            got = rx.recv() => match got {
                Some(r) => batch.push(r),
                None => break,
            },
            _ = replay.tick(), if spooled => {
                spooled = !replay_spool(&pool, &spool).await;
                continue;
            }
        }
        let deadline = tokio::time::Instant::now() + LINGER;
        while batch.len() < BATCH {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(r)) => batch.push(r),
                Ok(None) | Err(_) => break,
            }
        }
        if !write_or_spool(&pool, &spool, &batch).await {
            spooled = true;
        }
    }
    // Shutdown: everything still queued goes to Postgres or the spool.
    let mut rest = Vec::new();
    while let Ok(r) = rx.try_recv() {
        rest.push(r);
    }
    for chunk in rest.chunks(BATCH) {
        write_or_spool(&pool, &spool, chunk).await;
    }
    if spooled || spool_len(&spool) > 0 {
        replay_spool(&pool, &spool).await;
    }
}

/// True when the rows reached Postgres; false when they were spooled.
async fn write_or_spool(pool: &PgPool, spool: &PathBuf, rows: &[AuditRecord]) -> bool {
    if rows.is_empty() {
        return true;
    }
    match insert(pool, rows).await {
        Ok(()) => {
            metrics::counter!("lorafleet_gateway_audit_rows_total", "to" => "postgres")
                .increment(rows.len() as u64);
            true
        }
        Err(e) => {
            tracing::warn!(error = %e, rows = rows.len(), "audit insert failed; spooling");
            if let Err(e) = append_spool(spool, rows) {
                // Nowhere left to put them: say so loudly, with the rows.
                for r in rows {
                    tracing::error!(error = %e, row = ?r, "audit row lost: spool unwritable");
                }
            } else {
                metrics::counter!("lorafleet_gateway_audit_rows_total", "to" => "spool")
                    .increment(rows.len() as u64);
            }
            false
        }
    }
}

async fn insert(pool: &PgPool, rows: &[AuditRecord]) -> Result<(), sqlx::Error> {
    let mut q = sqlx::QueryBuilder::new(
        "INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id, api_key_id,
         subject, model_name, route_id, route_revision, lora_int_id, adapter_name,
         adapter_version, base_hash, worker_id, adapter_residency, status, http_status,
         error_code, finish_reason, prompt_tokens, completion_tokens, latency_us, ttft_us,
         attempts) ",
    );
    q.push_values(rows, |mut b, r| {
        b.push_bind(r.request_id)
            .push_bind(r.received_at)
            .push_bind(r.completed_at)
            .push_bind(r.tenant_id)
            .push_bind(r.api_key_id)
            .push_bind(&r.subject)
            .push_bind(&r.model_name)
            .push_bind(r.route_id)
            .push_bind(r.route_revision)
            .push_bind(r.lora_int_id)
            .push_bind(&r.adapter_name)
            .push_bind(r.adapter_version)
            .push_bind(&r.base_hash)
            .push_bind(&r.worker_id)
            .push_bind(&r.adapter_residency)
            .push_bind(&r.status)
            .push_unseparated("::audit_status")
            .push_bind(r.http_status)
            .push_bind(&r.error_code)
            .push_bind(&r.finish_reason)
            .push_bind(r.prompt_tokens)
            .push_bind(r.completion_tokens)
            .push_bind(r.latency_us)
            .push_bind(r.ttft_us)
            .push_bind(r.attempts);
    });
    q.push(" ON CONFLICT (request_id) DO NOTHING");
    let timeout = Duration::from_secs(5);
    tokio::time::timeout(timeout, q.build().execute(pool))
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
    Ok(())
}

fn append_spool(spool: &PathBuf, rows: &[AuditRecord]) -> std::io::Result<()> {
    if let Some(dir) = spool.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(spool)?;
    let mut buf = Vec::new();
    for r in rows {
        serde_json::to_writer(&mut buf, r).map_err(std::io::Error::other)?;
        buf.push(b'\n');
    }
    f.write_all(&buf)?;
    f.sync_data()
}

fn spool_len(spool: &PathBuf) -> u64 {
    std::fs::metadata(spool).map_or(0, |m| m.len())
}

/// Sends the spool to Postgres; removes it once every row is in. True when
/// the spool is empty afterwards.
async fn replay_spool(pool: &PgPool, spool: &PathBuf) -> bool {
    let rows: Vec<AuditRecord> = match std::fs::File::open(spool) {
        Ok(f) => std::io::BufReader::new(f)
            .lines()
            .map_while(Result::ok)
            .filter(|l| !l.trim().is_empty())
            .filter_map(|l| match serde_json::from_str(&l) {
                Ok(r) => Some(r),
                Err(e) => {
                    // A torn last line from a crash mid-write.
                    tracing::error!(error = %e, line = %l, "unreadable audit spool line skipped");
                    None
                }
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return true,
        Err(e) => {
            tracing::error!(error = %e, "audit spool unreadable");
            return false;
        }
    };
    for chunk in rows.chunks(BATCH) {
        if let Err(e) = insert(pool, chunk).await {
            tracing::debug!(error = %e, "audit spool replay waits for Postgres");
            return false;
        }
    }
    // Every row is in (or was already: inserts are idempotent).
    if let Err(e) = std::fs::remove_file(spool) {
        tracing::error!(error = %e, "audit spool replayed but not removed");
        return false;
    }
    metrics::counter!("lorafleet_gateway_audit_rows_total", "to" => "replayed")
        .increment(rows.len() as u64);
    tracing::info!(rows = rows.len(), "audit spool replayed into Postgres");
    true
}
