//! Per-tenant limits in requests per minute and tokens per minute, shared
//! by every gateway replica through Redis fixed one-minute windows.
//!
//! Tokens are reserved at admission: the request's prompt (estimated) plus
//! its `max_tokens` are added to the minute's count, and a request that
//! would take the count over the limit is refused and its reservation
//! taken back. Adding and checking is one atomic `INCRBY`, so concurrent
//! requests can never overshoot the minute's budget together. When the
//! request ends, however it ends (success, cancel, timeout, error), its
//! [`Reservation`] is settled to the tokens it actually used. A request's
//! tokens count in the minute it was admitted in.
//!
//! When Redis does not answer within [`REDIS_TIMEOUT`], this replica falls
//! back to its own windows with each limit divided by `--gateway-replicas`,
//! which deployments set to the most replicas the autoscaler may run (the
//! HPA's `maxReplicas`): with fewer replicas up the fleet admits less than
//! the limit, never more.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::ids::TenantId;

/// How long a limit check may wait for Redis before the local fallback.
const REDIS_TIMEOUT: Duration = Duration::from_millis(100);

/// Over the limit: how long until the window resets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    pub retry_after_secs: u64,
    pub what: &'static str,
}

/// (tenant, kind, minute) -> count, for the fallback.
type LocalWindows = HashMap<(TenantId, &'static str, u64), i64>;

#[derive(Debug, Clone)]
pub struct RateLimiter {
    redis: Option<redis::aio::ConnectionManager>,
    prefix: String,
    replicas: u32,
    local: Arc<Mutex<LocalWindows>>,
}

/// Tokens held for a request in its minute's count until it ends.
#[derive(Debug)]
#[must_use = "a reservation is settled to the tokens used when the request ends"]
pub struct Reservation {
    limiter: RateLimiter,
    tenant: TenantId,
    minute: u64,
    reserved: u64,
}

impl Reservation {
    /// The tokens held.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Replaces the reservation with the tokens the request used, in the
    /// background: a Redis round trip the client need not wait for.
    pub fn settle(self, used: u64) {
        let delta = used as i64 - self.reserved as i64;
        if delta == 0 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(tenant = %self.tenant, "a token reservation was not settled: no runtime");
            return;
        };
        runtime.spawn(async move {
            self.limiter
                .add(self.tenant, self.minute, &[("tpm", delta)])
                .await;
        });
    }
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

    /// Counts one request against `rpm` and, under `tpm`, reserves `tokens`
    /// (the prompt's estimate plus `max_tokens`), in one round trip. The
    /// reservation is None when the tenant has no tokens-per-minute limit.
    pub async fn admit(
        &self,
        tenant: TenantId,
        rpm: Option<u32>,
        tpm: Option<u64>,
        tokens: u64,
    ) -> Result<Option<Reservation>, Limited> {
        let now = now_secs();
        let minute = now / 60;
        let retry_after_secs = 60 - now % 60;
        let by = i64::try_from(tokens).unwrap_or(i64::MAX);
        let mut adds = Vec::with_capacity(2);
        if rpm.is_some() {
            adds.push(("rpm", 1));
        }
        if tpm.is_some() {
            adds.push(("tpm", by));
        }
        if adds.is_empty() {
            return Ok(None);
        }
        let counts = self.add(tenant, minute, &adds).await;
        let mut next = counts.counts.iter();
        let over_rpm = rpm.is_some_and(|limit| {
            next.next()
                .is_some_and(|&n| n > counts.scale(u64::from(limit)))
        });
        let over_tpm =
            tpm.is_some_and(|limit| next.next().is_some_and(|&n| n > counts.scale(limit)));
        if over_rpm || over_tpm {
            // The reservation is taken back at once: a refusal costs no
            // tokens. (The request still counts against `rpm`.)
            if tpm.is_some() {
                self.add(tenant, minute, &[("tpm", -by)]).await;
            }
            let whole = tpm.is_some_and(|limit| tokens > counts.scale_u64(limit));
            return Err(Limited {
                retry_after_secs,
                what: if over_rpm {
                    "requests per minute"
                } else if whole {
                    "tokens per minute: the prompt and max_tokens of this one request exceed the \
                     limit; lower max_tokens"
                } else {
                    "tokens per minute"
                },
            });
        }
        Ok(tpm.map(|_| Reservation {
            limiter: self.clone(),
            tenant,
            minute,
            reserved: tokens,
        }))
    }

    /// Adds each `(kind, by)` to the tenant's minute, returning the counts.
    async fn add(&self, tenant: TenantId, minute: u64, adds: &[(&'static str, i64)]) -> Counts {
        if let Some(redis) = &self.redis {
            let mut pipe = redis::pipe();
            pipe.atomic();
            for (kind, by) in adds {
                let key = format!("{}rl:{tenant}:{kind}:{minute}", self.prefix);
                pipe.cmd("INCRBY")
                    .arg(&key)
                    .arg(by)
                    .cmd("EXPIRE")
                    .arg(&key)
                    .arg(120)
                    .ignore();
            }
            let mut conn = redis.clone();
            let op = async move { pipe.query_async::<Vec<i64>>(&mut conn).await };
            match tokio::time::timeout(REDIS_TIMEOUT, op).await {
                Ok(Ok(counts)) if counts.len() == adds.len() => {
                    return Counts {
                        counts,
                        replicas: 1,
                    };
                }
                Ok(Ok(counts)) => tracing::warn!(
                    answers = counts.len(),
                    "rate limit: Redis gave the wrong number of answers; local fallback"
                ),
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "rate limit: Redis failed; local fallback");
                }
                Err(_) => tracing::debug!("rate limit: Redis timed out; local fallback"),
            }
            metrics::counter!("lorafleet_gateway_ratelimit_fallbacks_total").increment(1);
        }
        let mut local = self.local.lock().expect("local limits");
        local.retain(|(_, _, m), _| *m + 1 >= minute);
        let counts = adds
            .iter()
            .map(|&(kind, by)| {
                let count = local.entry((tenant, kind, minute)).or_default();
                *count += by;
                *count
            })
            .collect();
        Counts {
            counts,
            replicas: self.replicas,
        }
    }
}

struct Counts {
    counts: Vec<i64>,
    /// The shared limit is split this many ways.
    replicas: u32,
}

impl Counts {
    fn scale_u64(&self, limit: u64) -> u64 {
        (limit / u64::from(self.replicas)).max(1)
    }

    fn scale(&self, limit: u64) -> i64 {
        i64::try_from(self.scale_u64(limit)).unwrap_or(i64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    const TENANT: TenantId = TenantId(Uuid::from_u128(7));

    /// Waits out the last seconds of a minute, so a test's windows do not
    /// reset under it.
    async fn clear_of_the_minute_boundary() {
        let into = now_secs() % 60;
        if into >= 57 {
            tokio::time::sleep(Duration::from_secs(61 - into)).await;
        }
    }

    #[tokio::test]
    async fn concurrent_reservations_never_overshoot_and_settle_to_use() {
        clear_of_the_minute_boundary().await;
        let limiter = RateLimiter::new(None, String::new(), 1);
        // 20 requests at once, 200 tokens each, under 1000 a minute.
        let tries: Vec<_> = (0..20)
            .map(|_| {
                let l = limiter.clone();
                tokio::spawn(async move { l.admit(TENANT, None, Some(1000), 200).await })
            })
            .collect();
        let mut admitted = Vec::new();
        for t in tries {
            if let Ok(r) = t.await.unwrap() {
                admitted.push(r.expect("a tokens-per-minute limit reserves"));
            }
        }
        assert_eq!(admitted.len(), 5, "1000 / 200");
        // Ending early gives back what was not used.
        let first = admitted.pop().unwrap();
        first.settle(40);
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        let more = limiter.admit(TENANT, None, Some(1000), 160).await;
        assert!(more.is_ok(), "160 tokens came back");
        let none = limiter.admit(TENANT, None, Some(1000), 1).await;
        assert_eq!(none.unwrap_err().what, "tokens per minute");
    }

    #[tokio::test]
    async fn a_request_larger_than_the_limit_is_told_so_and_costs_nothing() {
        clear_of_the_minute_boundary().await;
        let limiter = RateLimiter::new(None, String::new(), 1);
        let e = limiter
            .admit(TENANT, None, Some(100), 101)
            .await
            .unwrap_err();
        assert!(e.what.contains("lower max_tokens"), "{e:?}");
        // The refused reservation was taken back.
        assert!(limiter.admit(TENANT, None, Some(100), 100).await.is_ok());
        // No limit: nothing is reserved.
        assert!(
            limiter
                .admit(TENANT, None, None, 1 << 40)
                .await
                .unwrap()
                .is_none()
        );
    }

    #[tokio::test]
    async fn without_redis_each_replica_takes_its_share() {
        // Ten replicas: each admits a tenth of the minute.
        clear_of_the_minute_boundary().await;
        let limiter = RateLimiter::new(None, String::new(), 10);
        assert!(limiter.admit(TENANT, Some(20), None, 0).await.is_ok());
        assert!(limiter.admit(TENANT, Some(20), None, 0).await.is_ok());
        assert!(limiter.admit(TENANT, Some(20), None, 0).await.is_err());
        let reserved = limiter.admit(TENANT, None, Some(1000), 100).await.unwrap();
        assert_eq!(reserved.unwrap().reserved(), 100);
        assert!(limiter.admit(TENANT, None, Some(1000), 1).await.is_err());
    }
}
