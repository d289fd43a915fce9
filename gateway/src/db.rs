//! The registry database: connection settings and the embedded migrations.

use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};

/// The migrations in the repository's `migrations/` folder, embedded at
/// build time so that a gateway binary can migrate the database it expects.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Why the database could not be reached or migrated. Each variant says
/// which setting or step failed.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("{flag}: {reason}")]
    InvalidUrl { flag: &'static str, reason: String },
    #[error("cannot connect to the registry database at {target}: {source}")]
    Connect {
        target: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("applying migrations failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("preparing the audit log for partitioning (rerun `lorafleet-gateway migrate`): {0}")]
    PrepareAudit(#[source] sqlx::Error),
}

/// Parses and checks a Postgres URL. `flag` names the setting it came from,
/// so the error tells the operator what to fix.
pub fn parse_database_url(flag: &'static str, url: &str) -> Result<PgConnectOptions, DbError> {
    let invalid = |reason: String| DbError::InvalidUrl { flag, reason };
    if url.trim().is_empty() {
        return Err(invalid(
            "is empty; expected postgres://USER@HOST:PORT/DATABASE".into(),
        ));
    }
    if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
        return Err(invalid(format!(
            "must start with postgres:// or postgresql://, got {:?}",
            redact_url(url)
        )));
    }
    url.parse::<PgConnectOptions>()
        .map_err(|e| invalid(format!("is not a valid Postgres URL ({e})")))
}

/// Opens a small pool, failing after `timeout` rather than hanging.
pub async fn connect(
    options: PgConnectOptions,
    max_connections: u32,
    timeout: Duration,
) -> Result<PgPool, DbError> {
    connect_warm(options, 0, max_connections, timeout).await
}

/// [`connect`], keeping `min_connections` open, so that a burst does not
/// wait for new connections (the audit writer's inserts in flight).
pub async fn connect_warm(
    options: PgConnectOptions,
    min_connections: u32,
    max_connections: u32,
    timeout: Duration,
) -> Result<PgPool, DbError> {
    let target = format!(
        "{}:{}/{}",
        options.get_host(),
        options.get_port(),
        options.get_database().unwrap_or("")
    );
    PgPoolOptions::new()
        .min_connections(min_connections)
        .max_connections(max_connections)
        .acquire_timeout(timeout)
        .connect_with(options)
        .await
        .map_err(|source| DbError::Connect { target, source })
}

/// Applies every pending migration. Safe to run from several processes at
/// once: sqlx serialises them with a Postgres advisory lock. An
/// unpartitioned audit log is first prepared online
/// ([`prepare_online`](crate::audit::partitions::prepare_online)), so that
/// partitioning it blocks writes for milliseconds whatever its size.
pub async fn migrate(pool: &PgPool) -> Result<usize, DbError> {
    crate::audit::partitions::prepare_online(pool)
        .await
        .map_err(DbError::PrepareAudit)?;
    let before = applied_versions(pool).await;
    MIGRATOR.run(pool).await?;
    let after = applied_versions(pool).await;
    Ok(after.saturating_sub(before))
}

async fn applied_versions(pool: &PgPool) -> usize {
    // The table does not exist before the first migration; that counts as zero.
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM _sqlx_migrations WHERE success")
        .fetch_one(pool)
        .await
        .map(|n| n as usize)
        .unwrap_or(0)
}

/// Hides the password in a connection URL, for messages and logs.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_url_errors_name_the_flag_and_hide_the_password() {
        let err = parse_database_url("--database-url", "mysql://u:hunter2@h/db").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.starts_with("--database-url: must start with postgres://"),
            "{msg}"
        );
        assert!(!msg.contains("hunter2"), "{msg}");

        let err = parse_database_url("--database-url", "  ").unwrap_err();
        assert!(err.to_string().contains("--database-url: is empty"));

        let ok = parse_database_url("--database-url", "postgres://u:p@127.0.0.1:5432/reg").unwrap();
        assert_eq!(ok.get_database(), Some("reg"));
    }

    #[test]
    fn redaction_keeps_user_and_host() {
        assert_eq!(
            redact_url("postgres://u:secret@h:1/d"),
            "postgres://u:***@h:1/d"
        );
        assert_eq!(redact_url("postgres://u@h/d"), "postgres://u@h/d");
    }
}
