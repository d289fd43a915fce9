//! Each tenant's requests in flight, capped across every gateway replica
//! through Redis.
//!
//! A request holds a slot from admission (before its body is read) until
//! it ends, however it ends. In Redis a tenant's slots are one sorted set:
//! a member per request, scored by the moment its lease runs out. Taking a
//! slot is one script (drop the expired leases, count, add if under the
//! cap), so two replicas can never both take the last slot. A running
//! request renews its lease every third of [`LEASE`]; a replica that dies
//! leaves its slots until their leases run out.
//!
//! Without Redis, or when it does not answer within [`REDIS_TIMEOUT`], this
//! replica falls back to its own semaphores with each cap divided by
//! `--gateway-replicas` (at least one slot), as the rate limits do: with
//! fewer replicas up the fleet admits fewer requests at once than the cap,
//! never more.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use uuid::Uuid;

use crate::ids::TenantId;

/// How long a slot's lease lasts unless renewed.
pub const LEASE: Duration = Duration::from_secs(30);

/// How long taking a slot may wait for Redis before the local fallback.
const REDIS_TIMEOUT: Duration = Duration::from_millis(100);

/// Drops the expired leases, then adds `ARGV[3]` with its lease if fewer
/// than `ARGV[1]` remain. 1: taken, 0: full.
const TAKE: &str = r"
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
  return 1
end
return 0
";

/// A tenant's local semaphore and the cap it was made for.
type Local = (usize, Arc<Semaphore>);

/// Every tenant's slots, shared by the replicas. Cheap to clone.
#[derive(Clone)]
pub struct TenantSlots {
    redis: Option<redis::aio::ConnectionManager>,
    prefix: String,
    replicas: usize,
    take: Arc<redis::Script>,
    local: Arc<RwLock<HashMap<TenantId, Local>>>,
}

impl std::fmt::Debug for TenantSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantSlots")
            .field("shared", &self.redis.is_some())
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}

/// A request's slot, given back when it drops.
#[derive(Debug)]
pub enum Slot {
    Shared {
        redis: redis::aio::ConnectionManager,
        key: String,
        member: String,
        renew: tokio::task::JoinHandle<()>,
    },
    Local(OwnedSemaphorePermit),
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Slot::Shared {
            redis,
            key,
            member,
            renew,
        } = self
        {
            renew.abort();
            let (redis, key, member) = (redis.clone(), std::mem::take(key), std::mem::take(member));
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(give_back(redis, key, member));
            }
        }
    }
}

/// Why the shared slots could not be used.
#[derive(Debug)]
enum Unshared {
    Failed(redis::RedisError),
    TimedOut,
}

impl std::fmt::Display for Unshared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unshared::Failed(e) => write!(f, "{e}"),
            Unshared::TimedOut => write!(f, "no answer within {REDIS_TIMEOUT:?}"),
        }
    }
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl TenantSlots {
    /// `redis`: None when no Redis is configured (this replica's share of
    /// each cap only).
    pub fn new(
        redis: Option<redis::aio::ConnectionManager>,
        prefix: String,
        replicas: u32,
    ) -> TenantSlots {
        TenantSlots {
            redis,
            prefix,
            replicas: replicas.max(1) as usize,
            take: Arc::new(redis::Script::new(TAKE)),
            local: Arc::default(),
        }
    }

    /// A slot for `tenant` under `cap`, or None when it has `cap` requests
    /// in flight across the fleet (or its share here while Redis is away).
    pub async fn try_acquire(&self, tenant: TenantId, cap: usize) -> Option<Slot> {
        if let Some(redis) = &self.redis {
            match self.take_shared(redis, tenant, cap).await {
                Ok(slot) => return slot,
                Err(e) => {
                    tracing::debug!(error = %e, "tenant slots: Redis failed; local fallback");
                    metrics::counter!("lorafleet_gateway_concurrency_fallbacks_total").increment(1);
                }
            }
        }
        self.take_local(tenant, (cap / self.replicas).max(1))
    }

    async fn take_shared(
        &self,
        redis: &redis::aio::ConnectionManager,
        tenant: TenantId,
        cap: usize,
    ) -> Result<Option<Slot>, Unshared> {
        let key = format!("{}cc:{tenant}", self.prefix);
        let member = Uuid::now_v7().to_string();
        let now = now_ms();
        let lease = LEASE.as_millis() as u64;
        let mut conn = redis.clone();
        let mut call = self.take.key(&key);
        call.arg(cap)
            .arg(now)
            .arg(&member)
            .arg(now + lease)
            .arg(2 * lease);
        let answer = tokio::time::timeout(REDIS_TIMEOUT, call.invoke_async(&mut conn)).await;
        let taken: i64 = match answer {
            Ok(Ok(v)) => v,
            // The script may have run without its answer arriving (a slow
            // reconnect, a loaded Redis): take back the slot it may have
            // added, or it would hold a place of the cap until its lease
            // runs out while this request runs on the local fallback.
            Ok(Err(e)) => {
                take_back(redis.clone(), key, member);
                return Err(Unshared::Failed(e));
            }
            Err(_) => {
                take_back(redis.clone(), key, member);
                return Err(Unshared::TimedOut);
            }
        };
        if taken == 0 {
            return Ok(None);
        }
        let renew = tokio::spawn(renew(redis.clone(), key.clone(), member.clone()));
        Ok(Some(Slot::Shared {
            redis: redis.clone(),
            key,
            member,
            renew,
        }))
    }

    fn take_local(&self, tenant: TenantId, cap: usize) -> Option<Slot> {
        let cap = cap.min(Semaphore::MAX_PERMITS);
        let existing = self
            .local
            .read()
            .expect("tenant slots")
            .get(&tenant)
            .filter(|(c, _)| *c == cap)
            .map(|(_, sem)| sem.clone());
        // A changed cap takes a new semaphore: requests already in flight
        // finish under the old one.
        let sem = existing.unwrap_or_else(|| {
            let mut local = self.local.write().expect("tenant slots");
            let entry = local
                .entry(tenant)
                .or_insert_with(|| (cap, Arc::new(Semaphore::new(cap))));
            if entry.0 != cap {
                *entry = (cap, Arc::new(Semaphore::new(cap)));
            }
            entry.1.clone()
        });
        sem.try_acquire_owned().ok().map(Slot::Local)
    }
}

/// Removes `member` from `key` in the background (see [`give_back`]).
fn take_back(redis: redis::aio::ConnectionManager, key: String, member: String) {
    tokio::spawn(give_back(redis, key, member));
}

/// Removes `member` from `key`, trying again while Redis is away, until
/// its lease would have run out anyway: a slot given back during a Redis
/// blip must not hold a place of the tenant's cap for a whole lease once
/// Redis returns.
async fn give_back(mut redis: redis::aio::ConnectionManager, key: String, member: String) {
    let until = tokio::time::Instant::now() + LEASE;
    let mut pause = Duration::from_millis(100);
    loop {
        let zrem = redis::cmd("ZREM").arg(&key).arg(&member).to_owned();
        let r: Result<redis::RedisResult<i64>, _> =
            tokio::time::timeout(Duration::from_secs(1), zrem.query_async(&mut redis)).await;
        if matches!(r, Ok(Ok(_))) {
            return;
        }
        if tokio::time::Instant::now() + pause >= until {
            tracing::debug!("a tenant slot was not given back; its lease runs out");
            return;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// Renews a slot's lease while its request runs.
async fn renew(mut redis: redis::aio::ConnectionManager, key: String, member: String) {
    let lease = LEASE.as_millis() as u64;
    loop {
        tokio::time::sleep(LEASE / 3).await;
        let r: redis::RedisResult<i64> = redis::cmd("ZADD")
            .arg(&key)
            .arg("XX")
            .arg(now_ms() + lease)
            .arg(&member)
            .query_async(&mut redis)
            .await;
        if let Err(e) = r {
            tracing::debug!(error = %e, "a tenant slot's lease was not renewed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TENANT: TenantId = TenantId(Uuid::from_u128(9));

    #[tokio::test]
    async fn local_slots_hold_the_cap_and_come_back() {
        let slots = TenantSlots::new(None, String::new(), 1);
        let a = slots.try_acquire(TENANT, 2).await.expect("one");
        let _b = slots.try_acquire(TENANT, 2).await.expect("two");
        assert!(slots.try_acquire(TENANT, 2).await.is_none(), "the cap is 2");
        drop(a);
        assert!(
            slots.try_acquire(TENANT, 2).await.is_some(),
            "a slot came back"
        );
        // A raised cap applies to the next request at once.
        assert!(slots.try_acquire(TENANT, 5).await.is_some());
        // Four replicas without Redis: each takes a quarter.
        let quarter = TenantSlots::new(None, String::new(), 4);
        let _a = quarter.try_acquire(TENANT, 8).await.expect("1 of 2");
        let _b = quarter.try_acquire(TENANT, 8).await.expect("2 of 2");
        assert!(quarter.try_acquire(TENANT, 8).await.is_none());
    }

    #[tokio::test]
    async fn shared_slots_hold_across_replicas_and_without_redis_each_takes_its_share() {
        let Ok(client) = redis::Client::open("redis://127.0.0.1:6379") else {
            panic!("a Redis URL");
        };
        let conn = redis::aio::ConnectionManager::new(client)
            .await
            .expect("Redis on 127.0.0.1:6379 (the tests' shared server)");
        let prefix = format!("test-cc-{}:", Uuid::now_v7());
        // Two replicas sharing Redis: a cap of 3 holds across both.
        let one = TenantSlots::new(Some(conn.clone()), prefix.clone(), 2);
        let two = TenantSlots::new(Some(conn.clone()), prefix.clone(), 2);
        let a = one.try_acquire(TENANT, 3).await.expect("1");
        let _b = two.try_acquire(TENANT, 3).await.expect("2");
        let _c = one.try_acquire(TENANT, 3).await.expect("3");
        assert!(two.try_acquire(TENANT, 3).await.is_none());
        assert!(one.try_acquire(TENANT, 3).await.is_none());
        drop(a);
        // The slot is given back in the background.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while two.try_acquire(TENANT, 3).await.is_none() {
            assert!(std::time::Instant::now() < deadline, "the slot came back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // A Redis that fails (here the tenant's key holds a string, so the
        // script errors): each replica falls back to cap / replicas.
        let other = TenantId(Uuid::from_u128(10));
        let mut c = conn.clone();
        let _: () = redis::cmd("SET")
            .arg(format!("{prefix}cc:{other}"))
            .arg("not a sorted set")
            .query_async(&mut c)
            .await
            .unwrap();
        let _x = one.try_acquire(other, 4).await.expect("1 of 2");
        let _y = one.try_acquire(other, 4).await.expect("2 of 2");
        assert!(one.try_acquire(other, 4).await.is_none(), "a half share");
    }
}
