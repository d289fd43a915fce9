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

/// One statement text for every batch size: the rows travel as one array
/// per column, so Postgres parses and plans it once per connection instead
/// of once per distinct row count.
const INSERT: &str = "INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id,
     api_key_id, subject, model_name, route_id, route_revision, lora_int_id, adapter_name,
     adapter_version, base_hash, worker_id, adapter_residency, status, http_status, error_code,
     finish_reason, prompt_tokens, completion_tokens, latency_us, ttft_us, attempts)
   SELECT * FROM UNNEST($1::uuid[], $2::timestamptz[], $3::timestamptz[], $4::uuid[],
     $5::uuid[], $6::text[], $7::text[], $8::uuid[], $9::int4[], $10::int8[], $11::text[],
     $12::int4[], $13::text[], $14::text[], $15::text[], $16::text[]::audit_status[],
     $17::int2[], $18::text[], $19::text[], $20::int4[], $21::int4[], $22::int8[],
     $23::int8[], $24::int2[])
   ON CONFLICT (request_id) DO NOTHING";

async fn insert(pool: &PgPool, rows: &[AuditRecord]) -> Result<(), sqlx::Error> {
    fn col<T>(rows: &[AuditRecord], f: impl Fn(&AuditRecord) -> T) -> Vec<T> {
        rows.iter().map(f).collect()
    }
    let q = sqlx::query(INSERT)
        .bind(col(rows, |r| r.request_id))
        .bind(col(rows, |r| r.received_at))
        .bind(col(rows, |r| r.completed_at))
        .bind(col(rows, |r| r.tenant_id))
        .bind(col(rows, |r| r.api_key_id))
        .bind(col(rows, |r| r.subject.clone()))
        .bind(col(rows, |r| r.model_name.clone()))
        .bind(col(rows, |r| r.route_id))
        .bind(col(rows, |r| r.route_revision))
        .bind(col(rows, |r| r.lora_int_id))
        .bind(col(rows, |r| r.adapter_name.clone()))
        .bind(col(rows, |r| r.adapter_version))
        .bind(col(rows, |r| r.base_hash.clone()))
        .bind(col(rows, |r| r.worker_id.clone()))
        .bind(col(rows, |r| r.adapter_residency.clone()))
        .bind(col(rows, |r| r.status.clone()))
        .bind(col(rows, |r| r.http_status))
        .bind(col(rows, |r| r.error_code.clone()))
        .bind(col(rows, |r| r.finish_reason.clone()))
        .bind(col(rows, |r| r.prompt_tokens))
        .bind(col(rows, |r| r.completion_tokens))
        .bind(col(rows, |r| r.latency_us))
        .bind(col(rows, |r| r.ttft_us))
        .bind(col(rows, |r| r.attempts));
    let timeout = Duration::from_secs(5);
    tokio::time::timeout(timeout, q.execute(pool))
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
