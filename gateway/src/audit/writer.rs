//! The audit writer task: group commit into Postgres, the circuit breaker,
//! quarantine of rows Postgres refuses as data, and spool replay.
//!
//! Errors are of two kinds, and are never confused:
//! - **data** (SQLSTATE classes 22 and 23): the rows are at fault. The batch
//!   is split in halves until each bad row is alone; good rows are inserted
//!   and bad ones go to `audit_dead_letter` with Postgres's reason.
//! - **outage** (anything else: refused or dropped connections, timeouts,
//!   permissions): Postgres is at fault. The breaker opens and rows go
//!   straight to the spool, with no wait per batch, until a probe succeeds.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::PgPool;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use uuid::Uuid;

use super::spool::{BadLine, Spool};
use super::{AuditRecord, Durability, Queued, Shared, sanitize};

/// Most rows per INSERT.
const BATCH: usize = 500;
/// How often the breaker probes Postgres, and an idle writer looks for a
/// spool to replay.
const TICK: Duration = Duration::from_secs(1);
/// Longest one statement may take before the writer calls it an outage.
const STATEMENT: Duration = Duration::from_secs(5);
const PROBE: Duration = Duration::from_secs(1);
/// Spool chunks replayed before the writer looks at its queue again.
const REPLAY_CHUNKS_PER_TURN: usize = 1;
/// Batches inserted at once.
pub const IN_FLIGHT: usize = 8;

/// Postgres is unreachable or failing; the rows are not at fault.
#[derive(Debug)]
struct Outage(String);

pub(super) async fn run(
    pool: PgPool,
    mut spool: Spool,
    mut rx: mpsc::Receiver<Queued>,
    shared: Arc<Shared>,
    durability: Durability,
    closing: Arc<tokio::sync::Notify>,
) {
    let mut w = Writer {
        pool,
        shared,
        durability,
        next_probe: Instant::now(),
    };
    // Batches being inserted: while one waits for its commit the next
    // gathers, and Postgres commits them together.
    let mut inserts: JoinSet<Inserted> = JoinSet::new();
    let mut backlog = spool.has_backlog();
    let mut next_tick = Instant::now();
    let mut closed = false;
    loop {
        let wake = if backlog { Instant::now() } else { next_tick };
        tokio::select! {
            biased;
            Some(done) = inserts.join_next(), if !inserts.is_empty() => {
                backlog |= w.inserted(&mut spool, done).await;
            }
            got = rx.recv(), if inserts.len() < IN_FLIGHT => match got {
                Some(first) => {
                    let mut batch = vec![first];
                    while batch.len() < BATCH {
                        match rx.try_recv() {
                            Ok(q) => batch.push(q),
                            Err(_) => break,
                        }
                    }
                    if w.open() {
                        w.spool(&mut spool, batch).await;
                        backlog = true;
                    } else {
                        let journaled = match w.durability {
                            Durability::Journal => journal(&mut spool, &mut batch),
                            Durability::Commit => None,
                        };
                        let pool = w.pool.clone();
                        inserts.spawn(async move {
                            let rows: Vec<&AuditRecord> = batch.iter().map(|q| &q.record).collect();
                            let result = insert_resilient(&pool, &rows).await;
                            drop(rows);
                            Inserted { batch, journaled, result }
                        });
                    }
                }
                None => break,
            },
            () = closing.notified(), if !closed => {
                // No new admissions; recv ends once every ticket is spent.
                rx.close();
                closed = true;
            }
            _ = tokio::time::sleep_until(wake) => {
                next_tick = Instant::now() + TICK;
                if w.open() {
                    w.probe().await;
                }
                backlog = if w.open() {
                    false
                } else {
                    w.replay(&mut spool, REPLAY_CHUNKS_PER_TURN).await
                };
                metrics::gauge!("lorafleet_gateway_audit_spool_bytes")
                    .set(w.shared.spool_used.load(Ordering::Relaxed) as f64);
            }
        }
    }
    while let Some(done) = inserts.join_next().await {
        w.inserted(&mut spool, done).await;
    }
    // Shutdown: every queued row has been placed; a last replay empties
    // the spool if Postgres is there.
    if w.open() {
        w.probe().await;
    }
    if !w.open() {
        w.replay(&mut spool, usize::MAX).await;
    }
}

fn ack(batch: Vec<Queued>) {
    for q in batch {
        if let Some(ack) = q.ack {
            let _ = ack.send(());
        }
    }
}

/// An insert task's end: its rows, the journal segment that already holds
/// them (their waiters were answered then), and how Postgres took them.
struct Inserted {
    batch: Vec<Queued>,
    journaled: Option<PathBuf>,
    result: Result<(), Outage>,
}

/// Journals a batch before its insert and answers its waiters: the rows
/// are durable once fsynced there. None when the journal refused them
/// (full or failing); the waiters then wait for the commit.
fn journal(spool: &mut Spool, batch: &mut [Queued]) -> Option<PathBuf> {
    let rows: Vec<&AuditRecord> = batch.iter().map(|q| &q.record).collect();
    match spool.journal(&rows) {
        Ok(segment) => {
            counter("journal", rows.len());
            for q in batch.iter_mut() {
                if let Some(ack) = q.ack.take() {
                    let _ = ack.send(());
                }
            }
            Some(segment)
        }
        Err(e) => {
            tracing::warn!(error = %e, rows = rows.len(), "audit journal refused a batch; its answers wait for the commit");
            None
        }
    }
}

struct Writer {
    pool: PgPool,
    shared: Arc<Shared>,
    durability: Durability,
    next_probe: Instant,
}

impl Writer {
    fn open(&self) -> bool {
        self.shared.breaker_open.load(Ordering::Relaxed)
    }

    fn set_open(&mut self, open: bool, why: &str) {
        let was = self.shared.breaker_open.swap(open, Ordering::Relaxed);
        if was != open {
            if open {
                tracing::warn!(
                    reason = why,
                    "audit: Postgres unreachable; rows go to the spool until it is back"
                );
            } else {
                tracing::info!("audit: Postgres is back; replaying the spool");
            }
        }
        metrics::gauge!("lorafleet_gateway_audit_breaker_open").set(if open { 1.0 } else { 0.0 });
        self.next_probe = Instant::now() + TICK;
    }

    async fn probe(&mut self) {
        if Instant::now() < self.next_probe {
            return;
        }
        let ok = matches!(
            tokio::time::timeout(PROBE, sqlx::query("SELECT 1").execute(&self.pool)).await,
            Ok(Ok(_))
        );
        self.set_open(!ok, "probe failed");
    }

    /// A finished insert task: its rows are acknowledged, or spooled first
    /// when Postgres failed. True when rows went to the spool.
    async fn inserted(
        &mut self,
        spool: &mut Spool,
        done: Result<Inserted, tokio::task::JoinError>,
    ) -> bool {
        let Inserted {
            batch,
            journaled,
            result,
        } = match done {
            Ok(d) => d,
            Err(e) => {
                // The task owned the rows; a panic there loses them, loudly
                // (unless journaled: replay after a restart brings them).
                tracing::error!(error = %e, "audit insert task failed; its rows are lost");
                return false;
            }
        };
        match (result, journaled) {
            (Ok(()), journaled) => {
                counter("postgres", batch.len());
                if let Some(segment) = journaled {
                    spool.journal_done(&segment, true);
                }
                ack(batch);
                false
            }
            (Err(Outage(e)), Some(segment)) => {
                // Already durable in the journal: replay brings them.
                self.set_open(true, &e);
                spool.journal_done(&segment, false);
                true
            }
            (Err(Outage(e)), None) => {
                self.set_open(true, &e);
                self.spool(spool, batch).await;
                true
            }
        }
    }

    /// Appends a batch to the spool, then answers its waiters. Holds the
    /// batch (and so the queue's room) until it is durable somewhere.
    async fn spool(&mut self, spool: &mut Spool, batch: Vec<Queued>) {
        {
            let rows: Vec<&AuditRecord> = batch.iter().map(|q| &q.record).collect();
            loop {
                match spool.append(&rows) {
                    Ok(()) => {
                        counter("spool", rows.len());
                        break;
                    }
                    Err(e) => {
                        tracing::error!(error = %e, rows = rows.len(), "audit rows can be neither inserted nor spooled; holding them");
                        tokio::time::sleep(TICK).await;
                        self.probe().await;
                        if !self.open() && insert_resilient(&self.pool, &rows).await.is_ok() {
                            counter("postgres", rows.len());
                            break;
                        }
                    }
                }
            }
        }
        metrics::gauge!("lorafleet_gateway_audit_spool_bytes")
            .set(self.shared.spool_used.load(Ordering::Relaxed) as f64);
        ack(batch);
    }

    /// Replays up to `chunks` chunks; true when more waits.
    async fn replay(&mut self, spool: &mut Spool, chunks: usize) -> bool {
        // The segment being appended to becomes readable.
        spool.seal();
        for _ in 0..chunks {
            let chunk = match spool.next_chunk() {
                Ok(Some(c)) => c,
                Ok(None) => return false,
                Err(e) => {
                    tracing::error!(error = %e, "audit spool unreadable; will retry");
                    return false;
                }
            };
            let rows: Vec<&AuditRecord> = chunk.rows.iter().collect();
            let placed = async {
                insert_resilient(&self.pool, &rows).await?;
                for bad in &chunk.bad {
                    quarantine_line(&self.pool, bad).await?;
                }
                Ok(())
            }
            .await;
            if let Err(Outage(e)) = placed {
                // From the chunk's start next time; inserts are idempotent.
                spool.rewind(&chunk);
                self.set_open(true, &e);
                return true;
            }
            if let Err(e) = spool.commit(&chunk) {
                tracing::error!(error = %e, "audit spool replayed but not removed; will retry");
                return false;
            }
            counter("replayed", rows.len());
            if !chunk.bad.is_empty() {
                tracing::warn!(
                    lines = chunk.bad.len(),
                    "unreadable audit spool lines quarantined in audit_dead_letter"
                );
            }
        }
        true
    }
}

fn counter(to: &'static str, n: usize) {
    metrics::counter!("lorafleet_gateway_audit_rows_total", "to" => to).increment(n as u64);
}

fn is_data_error(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(db) => db
            .code()
            .is_some_and(|c| c.starts_with("22") || c.starts_with("23")),
        sqlx::Error::Encode(_) => true,
        _ => false,
    }
}

/// Inserts rows; a data error splits the batch until each bad row is alone
/// and quarantined. Err only for an outage.
async fn insert_resilient(pool: &PgPool, rows: &[&AuditRecord]) -> Result<(), Outage> {
    if rows.is_empty() {
        return Ok(());
    }
    match insert(pool, rows).await {
        Ok(()) => Ok(()),
        Err(e) if is_data_error(&e) => {
            if let [row] = rows {
                quarantine_row(pool, row, &e.to_string()).await
            } else {
                let (a, b) = rows.split_at(rows.len() / 2);
                Box::pin(insert_resilient(pool, a)).await?;
                Box::pin(insert_resilient(pool, b)).await
            }
        }
        Err(e) => Err(Outage(e.to_string())),
    }
}

/// Idempotent on `origin` (its unique constraint), so a retry after an
/// outage never doubles one. No conflict target: naming one would need
/// SELECT on the table, which the runtime role does not have.
const DEAD_LETTER: &str =
    "INSERT INTO audit_dead_letter (source, origin, request_id, reason, payload)
     VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING";

async fn dead_letter(
    pool: &PgPool,
    source: &str,
    origin: &str,
    request_id: Option<Uuid>,
    reason: &str,
    payload: &[u8],
) -> Result<(), Outage> {
    let q = sqlx::query(DEAD_LETTER)
        .bind(source)
        .bind(sanitize::safe(origin, 1024))
        .bind(request_id)
        .bind(sanitize::safe(reason, 4096))
        .bind(payload);
    match tokio::time::timeout(STATEMENT, q.execute(pool)).await {
        Ok(Ok(_)) => {
            metrics::counter!("lorafleet_gateway_audit_quarantined_total", "source" => source.to_owned())
                .increment(1);
            Ok(())
        }
        Ok(Err(e)) => Err(Outage(format!("audit_dead_letter: {e}"))),
        Err(_) => Err(Outage("audit_dead_letter: statement timeout".into())),
    }
}

async fn quarantine_row(pool: &PgPool, row: &AuditRecord, reason: &str) -> Result<(), Outage> {
    tracing::error!(request_id = %row.request_id, reason, "audit row refused by Postgres; quarantined in audit_dead_letter");
    let payload = serde_json::to_vec(row).unwrap_or_default();
    let origin = format!("insert:{}", row.request_id);
    dead_letter(
        pool,
        "insert",
        &origin,
        Some(row.request_id),
        reason,
        &payload,
    )
    .await
}

async fn quarantine_line(pool: &PgPool, bad: &BadLine) -> Result<(), Outage> {
    let origin = format!("spool:{}", bad.origin);
    dead_letter(pool, "spool", &origin, None, &bad.reason, &bad.bytes).await
}

/// One statement text for every batch size: the rows travel as one array
/// per column, so Postgres parses and plans it once per connection instead
/// of once per distinct row count.
const INSERT: &str = "INSERT INTO audit_log (request_id, received_at, completed_at, tenant_id,
     api_key_id, subject, model_name, route_id, route_revision, lora_int_id, adapter_name,
     adapter_version, base_hash, worker_id, adapter_residency, status, http_status, error_code,
     finish_reason, prompt_tokens, completion_tokens, latency_us, ttft_us, attempts,
     end_user, api_key_prefix, cached_tokens, features, client_addr, occurrences,
     last_key_prefix, device_us, load_us)
   SELECT * FROM UNNEST($1::uuid[], $2::timestamptz[], $3::timestamptz[], $4::uuid[],
     $5::uuid[], $6::text[], $7::text[], $8::uuid[], $9::int4[], $10::int8[], $11::text[],
     $12::int4[], $13::text[], $14::text[], $15::text[], $16::text[]::audit_status[],
     $17::int2[], $18::text[], $19::text[], $20::int4[], $21::int4[], $22::int8[],
     $23::int8[], $24::int2[], $25::text[], $26::text[], $27::int4[], $28::text[],
     $29::text[]::inet[], $30::int4[], $31::text[], $32::int8[], $33::int8[])
   ON CONFLICT (request_id, received_at) DO NOTHING";

async fn insert(pool: &PgPool, rows: &[&AuditRecord]) -> Result<(), sqlx::Error> {
    fn col<T>(rows: &[&AuditRecord], f: impl Fn(&AuditRecord) -> T) -> Vec<T> {
        rows.iter().map(|r| f(r)).collect()
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
        .bind(col(rows, |r| r.status.as_str().to_owned()))
        .bind(col(rows, |r| r.http_status))
        .bind(col(rows, |r| r.error_code.clone()))
        .bind(col(rows, |r| r.finish_reason.clone()))
        .bind(col(rows, |r| r.prompt_tokens))
        .bind(col(rows, |r| r.completion_tokens))
        .bind(col(rows, |r| r.latency_us))
        .bind(col(rows, |r| r.ttft_us))
        .bind(col(rows, |r| r.attempts))
        .bind(col(rows, |r| r.end_user.clone()))
        .bind(col(rows, |r| r.api_key_prefix.clone()))
        .bind(col(rows, |r| r.cached_tokens))
        .bind(col(rows, |r| r.features.clone()))
        .bind(col(rows, |r| r.client_addr.clone()))
        .bind(col(rows, |r| r.occurrences))
        .bind(col(rows, |r| r.last_key_prefix.clone()))
        .bind(col(rows, |r| r.device_us))
        .bind(col(rows, |r| r.load_us));
    tokio::time::timeout(STATEMENT, q.execute(pool))
        .await
        .map_err(|_| sqlx::Error::PoolTimedOut)??;
    Ok(())
}
