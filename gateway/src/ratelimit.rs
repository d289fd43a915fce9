//! Per-tenant limits in requests per minute and tokens per minute, shared
//! by every gateway replica through Redis fixed one-minute windows.
//!
//! When Redis does not answer within [`REDIS_TIMEOUT`], this replica falls
//! back to its own windows with the limit divided by the number of replicas
//! it was told about, and keeps serving.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use uuid::Uuid;

/// How long a limit check may wait for Redis before the local fallback.
const REDIS_TIMEOUT: Duration = Duration::from_millis(100);

/// Over the limit: how long until the window resets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    pub retry_after_secs: u64,
    pub what: &'static str,
}

/// (tenant, kind, minute) -> count, for the fallback.
type LocalWindows = HashMap<(Uuid, &'static str, u64), u64>;

#[derive(Debug, Clone)]
pub struct RateLimiter {
    redis: Option<redis::aio::ConnectionManager>,
    prefix: String,
    replicas: u32,
    local: Arc<Mutex<LocalWindows>>,
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl RateLimiter {
    /// The shared Redis connection, if any.
    pub fn redis(&self) -> Option<redis::aio::ConnectionManager> {
        self.redis.clone()
    }

    /// `redis`: None when no Redis is configured (local limits only).
    pub fn new(
        redis: Option<redis::aio::ConnectionManager>,
        prefix: String,
        replicas: u32,
    ) -> RateLimiter {
        RateLimiter {
            redis,
            prefix,
            replicas: replicas.max(1),
            local: Arc::default(),
        }
    }

    /// Counts one request against `rpm` and checks `tpm` tokens so far.
    pub async fn admit(
        &self,
        tenant: Uuid,
        rpm: Option<u32>,
        tpm: Option<u64>,
    ) -> Result<(), Limited> {
        let now = now_secs();
        let minute = now / 60;
        let retry_after_secs = 60 - now % 60;
        if let Some(limit) = rpm {
            let n = self.add(tenant, "rpm", minute, 1).await;
            if n.count > n.scale(u64::from(limit)) {
                return Err(Limited {
                    retry_after_secs,
                    what: "requests per minute",
                });
            }
        }
        if let Some(limit) = tpm {
            let n = self.add(tenant, "tpm", minute, 0).await;
            if n.count >= n.scale(limit) {
                return Err(Limited {
                    retry_after_secs,
                    what: "tokens per minute",
                });
            }
        }
        Ok(())
    }

    /// Charges a finished request's tokens to the tenant's minute.
    pub async fn charge_tokens(&self, tenant: Uuid, tokens: u64) {
        if tokens > 0 {
            self.add(tenant, "tpm", now_secs() / 60, tokens).await;
        }
    }

    async fn add(&self, tenant: Uuid, kind: &'static str, minute: u64, by: u64) -> Count {
        if let Some(redis) = &self.redis {
            let key = format!("{}rl:{tenant}:{kind}:{minute}", self.prefix);
            let mut conn = redis.clone();
            let op = async move {
                redis::pipe()
                    .atomic()
                    .cmd("INCRBY")
                    .arg(&key)
                    .arg(by)
                    .cmd("EXPIRE")
                    .arg(&key)
                    .arg(120)
                    .ignore()
                    .query_async::<(u64,)>(&mut conn)
                    .await
            };
            match tokio::time::timeout(REDIS_TIMEOUT, op).await {
                Ok(Ok((count,))) => {
                    return Count { count, replicas: 1 };
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "rate limit: Redis failed; local fallback");
                }
                Err(_) => tracing::debug!("rate limit: Redis timed out; local fallback"),
            }
            metrics::counter!("lorafleet_gateway_ratelimit_fallbacks_total").increment(1);
        }
        let mut local = self.local.lock().expect("local limits");
        local.retain(|(_, _, m), _| *m + 1 >= minute);
        let count = local.entry((tenant, kind, minute)).or_default();
        *count += by;
        Count {
            count: *count,
            replicas: self.replicas,
        }
    }
}

struct Count {
    count: u64,
    /// The shared limit is split this many ways.
    replicas: u32,
}

impl Count {
    fn scale(&self, limit: u64) -> u64 {
        (limit / u64::from(self.replicas)).max(1)
    }
}
