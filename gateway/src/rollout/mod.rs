//! Progressive rollouts: the controller that moves a candidate adapter
//! version through a route's steps, or rolls it back, on what the audit
//! log shows. Every gateway replica runs [`run`]; the one holding the lease
//! row `controller_leases.rollouts` acts, the others wait to take over
//! when it stops renewing. The decisions themselves are written by the
//! admin plane ([`crate::admin::drive_rollouts`]), as route revisions with
//! their `admin_changes` rows.

pub mod gates;

use std::time::Duration;

use sqlx::PgPool;

use crate::admin::{AdminState, ROLLOUT_LEASE, drive_rollouts};

/// Takes or renews the lease `name` for `holder` until `ttl` from now;
/// true when `holder` has it.
pub async fn hold_lease(
    pool: &PgPool,
    name: &str,
    holder: &str,
    ttl: Duration,
) -> Result<bool, sqlx::Error> {
    let got: Option<String> = sqlx::query_scalar(
        "INSERT INTO controller_leases (name, holder, expires_at)
         VALUES ($1, $2, now() + make_interval(secs => $3))
         ON CONFLICT (name) DO UPDATE SET holder = EXCLUDED.holder, expires_at = EXCLUDED.expires_at
         WHERE controller_leases.holder = EXCLUDED.holder OR controller_leases.expires_at < now()
         RETURNING holder",
    )
    .bind(name)
    .bind(holder)
    .bind(ttl.as_secs_f64())
    .fetch_optional(pool)
    .await?;
    Ok(got.is_some())
}

/// Settings of the controller (the `--rollout-*` flags).
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// This process's name in the lease: unique among live replicas.
    pub holder: String,
    /// How often the holder judges the running rollouts and renews.
    pub tick: Duration,
    /// How long a lease lasts without renewal: a replica that stops
    /// renewing is replaced after at most this.
    pub lease: Duration,
}

/// The controller loop; runs until the task is dropped.
pub async fn run(state: AdminState, config: ControllerConfig) {
    let mut leading = false;
    loop {
        let held = match hold_lease(&state.pool, ROLLOUT_LEASE, &config.holder, config.lease).await
        {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(error = %e, "rollout lease not renewed");
                false
            }
        };
        if held != leading {
            tracing::info!(holder = %config.holder, leading = held, "rollout controller lease");
            leading = held;
        }
        metrics::gauge!("lorafleet_gateway_rollout_leader").set(if held { 1.0 } else { 0.0 });
        if held && let Err(e) = drive_rollouts(&state, &config.holder).await {
            tracing::warn!(error = %e, "rollout controller turn failed");
        }
        tokio::time::sleep(config.tick).await;
    }
}
