//! The audit log's daily partitions: made ahead, retired after the
//! retention, and the online preparation that lets migration 0014 turn an
//! existing unpartitioned log into a partitioned one without blocking
//! writes.
//!
//! - [`prepare_online`] runs before the migrations (`lorafleet-gateway
//!   migrate`): on an unpartitioned log it builds the unique index on
//!   `(request_id, received_at)` concurrently and adds and validates the
//!   CHECK that bounds the old rows, so that the migration's own lock lasts
//!   milliseconds whatever the table's size.
//! - [`run`] is the maintainer: every gateway with an admin plane runs it;
//!   the one holding the lease row `controller_leases.audit_partitions`
//!   makes the coming days' partitions and, with a retention, retires the
//!   days past it (each retirement an `admin_changes` row, written in the
//!   same transaction by the SQL function). Both go through the SECURITY
//!   DEFINER functions of migration 0014, which only `lorafleet_admin` may
//!   call: no serving process can drop a partition.

use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use sqlx::PgPool;

use crate::rollout::hold_lease;

/// The lease row that names the replica maintaining partitions.
pub const LEASE: &str = "audit_partitions";
/// The actor of retirements in `admin_changes`.
pub const MAINTAINER: &str = "audit-partition-maintainer";
/// Days of partitions kept ready after today.
pub const DAYS_AHEAD: i32 = 7;
/// How often the lease holder looks.
const TICK: Duration = Duration::from_secs(60);
/// How long its lease lasts unrenewed.
const LEASE_TTL: Duration = Duration::from_secs(180);
/// The migration's cutover is at least this far ahead when it runs; a
/// prepared cutover closer than this is moved.
const CUTOVER_MARGIN: chrono::Duration = chrono::Duration::days(1);
/// The first cutover chosen: this many days from today (UTC).
const CUTOVER_DAYS: i64 = 2;

/// One partition of the log.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Partition {
    pub name: String,
    /// None for `audit_log_legacy` (every time before the cutover).
    pub from_time: Option<DateTime<Utc>>,
    pub to_time: DateTime<Utc>,
    /// Postgres's estimate (`reltuples`), not a count.
    pub estimated_rows: i64,
}

/// The log's partitions, oldest first.
pub async fn list(pool: &PgPool) -> Result<Vec<Partition>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM audit_log_partitions()")
        .fetch_all(pool)
        .await
}

/// Makes the partitions up to `days_ahead` days after today; the names
/// made.
pub async fn prepare(pool: &PgPool, days_ahead: i32) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT * FROM audit_log_prepare_partitions($1)")
        .bind(days_ahead)
        .fetch_all(pool)
        .await
}

/// Retires every partition wholly older than `keep_days` days before
/// today, recording each in `admin_changes` as `actor`'s change.
pub async fn retire(
    pool: &PgPool,
    keep_days: u32,
    actor: &str,
) -> Result<Vec<Partition>, sqlx::Error> {
    sqlx::query_as("SELECT * FROM audit_log_retire_partitions($1, $2, $3)")
        .bind(i32::try_from(keep_days).unwrap_or(i32::MAX))
        .bind(actor)
        .bind(uuid::Uuid::now_v7())
        .fetch_all(pool)
        .await
}

/// Settings of the maintainer.
#[derive(Debug, Clone)]
pub struct MaintainerConfig {
    /// This process's name in the lease.
    pub holder: String,
    /// `--audit-retention-days`: None keeps every row.
    pub retention_days: Option<u32>,
}

/// The maintainer loop (on the admin role's pool); runs until dropped.
pub async fn run(pool: PgPool, config: MaintainerConfig) {
    let mut leading = false;
    loop {
        let held = match hold_lease(&pool, LEASE, &config.holder, LEASE_TTL).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "audit partition lease not renewed");
                false
            }
        };
        if held != leading {
            tracing::info!(holder = %config.holder, leading = held, "audit partition maintainer lease");
            leading = held;
        }
        if held {
            turn(&pool, &config).await;
        }
        tokio::time::sleep(TICK).await;
    }
}

/// One look: make the coming days, retire the past ones, export the
/// figures. Failures are logged and retried next tick (the rows of a day
/// with no partition go to `audit_dead_letter`, never lost).
async fn turn(pool: &PgPool, config: &MaintainerConfig) {
    match prepare(pool, DAYS_AHEAD).await {
        Ok(made) => {
            for name in &made {
                tracing::info!(partition = %name, "audit partition made");
            }
        }
        Err(e) => tracing::warn!(error = %e, "making audit partitions failed"),
    }
    if let Some(days) = config.retention_days {
        match retire(pool, days, MAINTAINER).await {
            Ok(gone) => {
                for p in &gone {
                    tracing::info!(
                        partition = %p.name,
                        to = %p.to_time,
                        estimated_rows = p.estimated_rows,
                        retention_days = days,
                        "audit partition retired"
                    );
                }
                metrics::counter!("lorafleet_audit_partitions_retired_total")
                    .increment(gone.len() as u64);
            }
            Err(e) => tracing::warn!(error = %e, "retiring audit partitions failed"),
        }
    }
    match list(pool).await {
        Ok(parts) => {
            metrics::gauge!("lorafleet_audit_partitions").set(parts.len() as f64);
            if let Some(last) = parts.last() {
                let ahead = (last.to_time - Utc::now()).num_seconds() as f64 / 86_400.0;
                metrics::gauge!("lorafleet_audit_partition_days_ahead").set(ahead);
            }
        }
        Err(e) => tracing::warn!(error = %e, "listing audit partitions failed"),
    }
}

/// What [`prepare_online`] did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Prepared {
    /// The CHECK's bound: rows before it stay in the old table.
    pub cutover: Option<DateTime<Utc>>,
    /// Time spent building the unique index (writes continued).
    pub index_build: Option<Duration>,
    /// Time spent validating the CHECK (writes continued).
    pub validation: Option<Duration>,
}

/// Before migration 0014, on an unpartitioned `audit_log`: the slow steps,
/// done without blocking writes. Does nothing on a partitioned log or a
/// database without one. Safe to rerun after a failure: an index left
/// invalid by an interrupted build is dropped and built again.
/// Runs under a Postgres advisory lock held on a connection of its own,
/// so two `migrate` processes started together take turns: the second
/// finds the work done instead of building the same index beside the
/// first. The second waits by trying again every 200 ms, never inside a
/// statement: a session blocked in `pg_advisory_lock` holds a snapshot,
/// which the first's `CREATE INDEX CONCURRENTLY` would wait for forever.
pub async fn prepare_online(pool: &PgPool) -> Result<Prepared, sqlx::Error> {
    use sqlx::Connection;
    let mut lock = sqlx::PgConnection::connect_with(&pool.connect_options()).await?;
    let mut said = false;
    loop {
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
            .bind(PREPARE_LOCK)
            .fetch_one(&mut lock)
            .await?;
        if got {
            break;
        }
        if !said {
            tracing::info!("another migration is preparing the audit log; waiting for it");
            said = true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    let done = prepare_locked(pool).await;
    // Closing the session releases the lock whatever happened.
    let _ = lock.close().await;
    done
}

/// The advisory lock key of [`prepare_online`] (sqlx's migrations use a
/// key derived from the database name; this one is fixed and distinct).
const PREPARE_LOCK: i64 = 0x6c66_5f61_7564_6974; // "lf_audit"

async fn prepare_locked(pool: &PgPool) -> Result<Prepared, sqlx::Error> {
    let kind: Option<String> = sqlx::query_scalar(
        "SELECT relkind::TEXT FROM pg_class WHERE oid = to_regclass('audit_log')",
    )
    .fetch_optional(pool)
    .await?;
    if kind.as_deref() != Some("r") {
        return Ok(Prepared::default());
    }
    let mut done = Prepared::default();

    let index_valid: Option<bool> = sqlx::query_scalar(
        "SELECT i.indisvalid FROM pg_index i
          WHERE i.indexrelid = to_regclass('audit_log_request_id_received_at')",
    )
    .fetch_optional(pool)
    .await?;
    if index_valid == Some(false) {
        tracing::warn!("dropping the unique index an interrupted preparation left invalid");
        sqlx::query("DROP INDEX CONCURRENTLY audit_log_request_id_received_at")
            .execute(pool)
            .await?;
    }
    if index_valid != Some(true) {
        tracing::info!("building the audit log's (request_id, received_at) index; writes continue");
        let t = Instant::now();
        sqlx::query(
            "CREATE UNIQUE INDEX CONCURRENTLY audit_log_request_id_received_at
             ON audit_log (request_id, received_at)",
        )
        .execute(pool)
        .await?;
        done.index_build = Some(t.elapsed());
        tracing::info!(ms = t.elapsed().as_millis() as u64, "index built");
    }
    let has_constraint: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'audit_log'::regclass
                          AND conname = 'audit_log_request_id_received_at')",
    )
    .fetch_one(pool)
    .await?;
    if !has_constraint {
        in_short_lock(
            pool,
            "ALTER TABLE audit_log ADD CONSTRAINT audit_log_request_id_received_at
             UNIQUE USING INDEX audit_log_request_id_received_at",
        )
        .await?;
    }

    let (def, valid): (Option<String>, bool) = sqlx::query_as(
        "SELECT pg_get_constraintdef(oid), convalidated FROM pg_constraint
          WHERE conrelid = 'audit_log'::regclass AND conname = 'audit_log_before_partitions'
         UNION ALL SELECT NULL, false LIMIT 1",
    )
    .fetch_one(pool)
    .await?;
    let existing = def.as_deref().and_then(cutover_of);
    let now = Utc::now();
    let cutover = match existing {
        Some(c) if c - now >= CUTOVER_MARGIN => c,
        _ => {
            if def.is_some() {
                in_short_lock(
                    pool,
                    "ALTER TABLE audit_log DROP CONSTRAINT audit_log_before_partitions",
                )
                .await?;
            }
            let c = now
                .date_naive()
                .and_hms_opt(0, 0, 0)
                .expect("midnight")
                .and_utc()
                + chrono::Duration::days(CUTOVER_DAYS);
            in_short_lock(
                pool,
                &format!(
                    "ALTER TABLE audit_log ADD CONSTRAINT audit_log_before_partitions
                     CHECK (received_at < '{}'::timestamptz) NOT VALID",
                    c.to_rfc3339()
                ),
            )
            .await?;
            c
        }
    };
    done.cutover = Some(cutover);
    if !(valid && existing == Some(cutover)) {
        tracing::info!(%cutover, "validating the audit log's cutover bound; writes continue");
        let t = Instant::now();
        sqlx::query("ALTER TABLE audit_log VALIDATE CONSTRAINT audit_log_before_partitions")
            .execute(pool)
            .await?;
        done.validation = Some(t.elapsed());
        tracing::info!(
            ms = t.elapsed().as_millis() as u64,
            "cutover bound validated"
        );
    }
    Ok(done)
}

/// A catalog change that takes the log's exclusive lock: it waits for that
/// lock at most 5 s (then fails, to be rerun) so that the inserts queued
/// behind it are never held longer.
async fn in_short_lock(pool: &PgPool, ddl: &str) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET LOCAL lock_timeout = '5s'")
        .execute(&mut *tx)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(ddl.to_owned()))
        .execute(&mut *tx)
        .await?;
    tx.commit().await
}

/// The bound of `CHECK ((received_at < '…'::timestamp with time zone))`.
fn cutover_of(def: &str) -> Option<DateTime<Utc>> {
    let start = def.find('\'')? + 1;
    let len = def[start..].find('\'')?;
    let text = &def[start..start + len];
    DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%#z")
        .ok()
        .map(|t| t.with_timezone(&Utc))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cutover_is_read_back_from_the_constraint() {
        let def = "CHECK ((received_at < '2026-11-28 00:00:00+00'::timestamp with time zone))";
        assert_eq!(
            cutover_of(def),
            Some("2026-11-28T00:00:00Z".parse().unwrap())
        );
        let def = "CHECK ((received_at < '2026-11-28 01:00:00+01'::timestamp with time zone))";
        assert_eq!(
            cutover_of(def),
            Some("2026-11-28T00:00:00Z".parse().unwrap())
        );
        assert_eq!(cutover_of("CHECK (true)"), None);
    }
}
