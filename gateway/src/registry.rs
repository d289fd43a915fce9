//! The registry, cached in memory as one immutable snapshot so that the
//! request path never waits on Postgres.
//!
//! A snapshot is read in one repeatable-read transaction, so it is always a
//! consistent cut of the registry. It is rebuilt when a change is announced
//! on Redis (`<prefix>registry` channel), and every refresh interval as a
//! backstop for lost announcements. When a rebuild fails (Postgres down),
//! the previous snapshot keeps serving.
//!
//! Rebuilds may overlap (an announcement's and an admin command's own), and
//! the one that started first may finish last: each takes a ticket before
//! it reads, and a snapshot never replaces one from a later ticket, so a
//! rebuild begun after a commit always leaves that commit in force.

use lorafleet_domain::AdapterId;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwap;
use std::time::{Duration, Instant};

use lorafleet_domain::digest::Sha256Hex;

use crate::ids::{KeyId, RouteId, TenantId};
use chrono::{DateTime, Utc};
use sqlx::PgPool;

pub use lorafleet_admin_types::Limit;

/// Canary weights are in basis points: 10000 is the whole route.
pub const WEIGHT_TOTAL: u32 = 10_000;

#[derive(Debug, Clone)]
pub struct Tenant {
    pub id: TenantId,
    pub name: String,
    pub rpm_limit: Limit,
    pub tpm_limit: Limit,
    /// Requests in flight at once, across the gateways.
    pub max_concurrent: Limit,
    pub disabled: bool,
    /// The tenant's weight in every worker's fair admission (default 1).
    pub weight: f64,
}

#[derive(Debug, Clone)]
pub struct ApiKey {
    pub id: KeyId,
    pub tenant_id: TenantId,
    pub secret_sha256: [u8; 32],
    pub scopes: Vec<String>,
    pub expires_at: Option<DateTime<Utc>>,
    pub revoked: bool,
}

/// One adapter version, everything a worker needs to load it.
#[derive(Debug, Clone)]
pub struct Adapter {
    pub lora_int_id: AdapterId,
    pub name: String,
    pub version: u32,
    pub rank: u32,
    pub artifact_uri: String,
    pub artifact_sha256: Sha256Hex,
    pub base_hash: Sha256Hex,
    /// What the artifact held at registration (bytes, files); None for a
    /// version registered before sizes were recorded.
    pub artifact_size: Option<(u64, u32)>,
}

/// The columns [`StoredAdapter`] reads, of `adapters a` joined to
/// `base_models b`.
pub const STORED_ADAPTER_COLUMNS: &str = "a.lora_int_id, a.name, a.version, a.rank, \
     a.artifact_uri, a.artifact_sha256, b.base_hash, a.artifact_bytes, a.artifact_files";

/// An adapter version as the registry stores it ([`STORED_ADAPTER_COLUMNS`]).
#[derive(Debug, sqlx::FromRow)]
pub struct StoredAdapter {
    pub lora_int_id: i64,
    pub name: String,
    pub version: i32,
    pub rank: i32,
    pub artifact_uri: String,
    pub artifact_sha256: String,
    pub base_hash: String,
    pub artifact_bytes: Option<i64>,
    pub artifact_files: Option<i32>,
}

impl StoredAdapter {
    /// The adapter, or the column holding a value the schema cannot have.
    pub fn into_adapter(self) -> Result<Adapter, &'static str> {
        Ok(Adapter {
            // The schema hands ids out from a sequence: never 0 or less.
            lora_int_id: AdapterId::from_registry(self.lora_int_id).ok_or("lora_int_id")?,
            name: self.name,
            version: self.version as u32,
            rank: self.rank as u32,
            artifact_uri: self.artifact_uri,
            // The schema keeps both as 64 hexadecimal digits.
            artifact_sha256: Sha256Hex::parse(&self.artifact_sha256).ok_or("artifact_sha256")?,
            base_hash: Sha256Hex::parse(&self.base_hash).ok_or("base_hash")?,
            artifact_size: self
                .artifact_bytes
                .zip(self.artifact_files)
                .map(|(b, f)| (b as u64, f as u32)),
        })
    }
}

#[derive(Debug, Clone)]
pub enum Target {
    /// The base model alone.
    Base,
    /// Adapter versions with their weights (basis points, summing to
    /// [`WEIGHT_TOTAL`]), ordered by `lora_int_id`.
    Adapters(Vec<(u32, Arc<Adapter>)>),
}

#[derive(Debug, Clone)]
pub struct Route {
    pub id: RouteId,
    pub tenant_id: TenantId,
    pub model_name: String,
    pub revision: i32,
    pub base_model: String,
    pub base_hash: Sha256Hex,
    pub target: Target,
    pub created_at: DateTime<Utc>,
}

/// What a request resolved to.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub route: Arc<Route>,
    /// None: the base model.
    pub adapter: Option<Arc<Adapter>>,
}

/// A consistent cut of the registry.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub tenants: HashMap<TenantId, Tenant>,
    pub api_keys: HashMap<String, ApiKey>,
    tenant_names: HashMap<String, TenantId>,
    /// (tenant, model name) -> route.
    routes: HashMap<(TenantId, String), Arc<Route>>,
    /// The `jti` of every admin token revoked before its expiry.
    revoked_admin_tokens: std::collections::HashSet<String>,
    /// Tenant JWTs revoked by their `jti`, until their expiry.
    revoked_tenant_tokens: std::collections::HashSet<String>,
}

impl Snapshot {
    /// Adds a tenant (for snapshots built in code, such as tests').
    pub fn insert_tenant(&mut self, t: Tenant) {
        self.tenant_names.insert(t.name.clone(), t.id);
        self.tenants.insert(t.id, t);
    }

    /// Was the admin token with this `jti` revoked?
    pub fn tenant_token_revoked(&self, jti: &str) -> bool {
        self.revoked_tenant_tokens.contains(jti)
    }

    pub fn admin_token_revoked(&self, jti: &str) -> bool {
        self.revoked_admin_tokens.contains(jti)
    }

    pub fn tenant(&self, id: &TenantId) -> Option<&Tenant> {
        self.tenants.get(id)
    }

    pub fn tenant_by_name(&self, name: &str) -> Option<&Tenant> {
        self.tenant_names
            .get(name)
            .and_then(|id| self.tenants.get(id))
    }

    /// The route (tenant name, model), whatever its weights.
    pub fn route(&self, tenant: &str, model: &str) -> Option<Arc<Route>> {
        let id = self.tenant_names.get(tenant)?;
        self.routes.get(&(*id, model.to_owned())).cloned()
    }

    /// The tenant's routes, by model name.
    pub fn routes_of(&self, tenant: &TenantId) -> Vec<Arc<Route>> {
        let mut v: Vec<_> = self
            .routes
            .iter()
            .filter(|((t, _), _)| t == tenant)
            .map(|(_, r)| r.clone())
            .collect();
        v.sort_by(|a, b| a.model_name.cmp(&b.model_name));
        v
    }

    /// (tenant, model) -> one adapter version. The version is picked by the
    /// canary weights from a stable hash of `stickiness` (the request's
    /// `user`, else its request id), so a user stays on one version and a
    /// retry lands where the first try did. None: no such route for this
    /// tenant, which callers must not tell apart from another tenant's.
    pub fn resolve(&self, tenant: &TenantId, model: &str, stickiness: &str) -> Option<Resolved> {
        let route = self.routes.get(&(*tenant, model.to_owned()))?.clone();
        let adapter = match &route.target {
            Target::Base => None,
            Target::Adapters(weights) => Some(pick(&route.id, weights, stickiness)),
        };
        Some(Resolved { route, adapter })
    }

    /// Reads the whole registry in one repeatable-read transaction.
    pub async fn load(pool: &PgPool) -> Result<Snapshot, sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .execute(&mut *tx)
            .await?;
        let mut s = Snapshot::default();
        // One read-only transaction at one point in time for all of it.
        s.load_principals(&mut tx).await?;
        s.load_routes(&mut tx).await?;
        s.revoked_admin_tokens =
            sqlx::query_scalar("SELECT jti FROM admin_token_revocations WHERE expires_at > now()")
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .collect();
        s.revoked_tenant_tokens =
            sqlx::query_scalar("SELECT jti FROM tenant_token_revocations WHERE expires_at > now()")
                .fetch_all(&mut *tx)
                .await?
                .into_iter()
                .collect();
        tx.commit().await?;
        Ok(s)
    }

    /// Tenants and their API keys.
    async fn load_principals(&mut self, tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        let s = self;
        type TenantRow = (
            TenantId,
            String,
            Option<i64>,
            Option<i64>,
            Option<i64>,
            bool,
            f64,
        );
        let tenants: Vec<TenantRow> = sqlx::query_as(
            "SELECT id, name, rpm_limit::INT8, tpm_limit, max_concurrent::INT8,
                    disabled_at IS NOT NULL, weight
             FROM tenants",
        )
        .fetch_all(&mut *tx)
        .await?;
        for (id, name, rpm, tpm, concurrent, disabled, weight) in tenants {
            s.tenant_names.insert(name.clone(), id);
            s.tenants.insert(
                id,
                Tenant {
                    id,
                    name,
                    rpm_limit: Limit::from_column(rpm),
                    tpm_limit: Limit::from_column(tpm),
                    max_concurrent: Limit::from_column(concurrent),
                    disabled,
                    weight,
                },
            );
        }
        type KeyRow = (
            KeyId,
            TenantId,
            String,
            Vec<u8>,
            Vec<String>,
            Option<DateTime<Utc>>,
            bool,
        );
        let keys: Vec<KeyRow> = sqlx::query_as(
            "SELECT id, tenant_id, prefix, secret_hash, scopes, expires_at, revoked_at IS NOT NULL
             FROM api_keys",
        )
        .fetch_all(&mut *tx)
        .await?;
        for (id, tenant_id, prefix, hash, scopes, expires_at, revoked) in keys {
            let Ok(secret_sha256) = <[u8; 32]>::try_from(hash.as_slice()) else {
                continue; // the schema guarantees 32 bytes
            };
            s.api_keys.insert(
                prefix,
                ApiKey {
                    id,
                    tenant_id,
                    secret_sha256,
                    scopes,
                    expires_at,
                    revoked,
                },
            );
        }
        Ok(())
    }

    /// Routes with their current revision's weights and adapters.
    async fn load_routes(&mut self, tx: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
        let s = self;
        type RouteRow = (
            RouteId,
            TenantId,
            String,
            i32,
            String,
            String,
            String,
            DateTime<Utc>,
        );
        let routes: Vec<RouteRow> = sqlx::query_as(
            "SELECT r.id, r.tenant_id, r.model_name, r.current_revision, b.name, b.base_hash,
                    rr.target::TEXT, r.created_at
             FROM routes r
             JOIN route_revisions rr ON rr.route_id = r.id AND rr.revision = r.current_revision
             JOIN base_models b ON b.id = rr.base_model_id",
        )
        .fetch_all(&mut *tx)
        .await?;
        #[derive(sqlx::FromRow)]
        struct WeightRow {
            route_id: RouteId,
            weight_bp: i32,
            #[sqlx(flatten)]
            adapter: StoredAdapter,
        }
        // Built from this module's own column list, never from input.
        let weights: Vec<WeightRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT w.route_id, w.weight_bp, {STORED_ADAPTER_COLUMNS}
             FROM routes r
             JOIN route_weights w ON w.route_id = r.id AND w.revision = r.current_revision
             JOIN adapters a ON a.lora_int_id = w.lora_int_id AND a.state = 'active'
             JOIN base_models b ON b.id = a.base_model_id
             ORDER BY w.route_id, a.lora_int_id"
        )))
        .fetch_all(&mut *tx)
        .await?;
        let mut by_route: HashMap<RouteId, Vec<(u32, Arc<Adapter>)>> = HashMap::new();
        for row in weights {
            let id = row.adapter.lora_int_id;
            match row.adapter.into_adapter() {
                Ok(adapter) => by_route
                    .entry(row.route_id)
                    .or_default()
                    .push((row.weight_bp as u32, Arc::new(adapter))),
                // The schema cannot hold one: logged and skipped.
                Err(column) => tracing::error!(
                    lora_int_id = id,
                    column,
                    "a value the registry cannot have; adapter skipped"
                ),
            }
        }
        for (id, tenant_id, model_name, revision, base_model, base_hash, target, created_at) in
            routes
        {
            let Some(base_hash) = Sha256Hex::parse(&base_hash) else {
                tracing::error!(route = %id, "a base hash the registry cannot have; skipped");
                continue;
            };
            let target = if target == "base" {
                Target::Base
            } else {
                // The admin API refuses to retire a routed version; should
                // one be retired behind its back, the route loses it, and a
                // route left with none is not served rather than served
                // by something else.
                match by_route.remove(&id) {
                    Some(weights) if !weights.is_empty() => Target::Adapters(weights),
                    _ => continue,
                }
            };
            s.routes.insert(
                (tenant_id, model_name.clone()),
                Arc::new(Route {
                    id,
                    tenant_id,
                    model_name,
                    revision,
                    base_model,
                    base_hash,
                    target,
                    created_at,
                }),
            );
        }
        Ok(())
    }
}

/// The canary bucket of `stickiness` on `route`, in [0, WEIGHT_TOTAL):
/// SHA-256 of the route id and the key, so buckets are uniform whatever the
/// keys look like, and the same in every gateway replica and release.
pub fn bucket(route: &RouteId, stickiness: &str) -> u32 {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new()
        .chain_update(route.0.as_bytes())
        .chain_update(stickiness.as_bytes())
        .finalize();
    let head = u64::from_le_bytes(digest[..8].try_into().expect("8 bytes"));
    (head % u64::from(WEIGHT_TOTAL)) as u32
}

fn pick(route: &RouteId, weights: &[(u32, Arc<Adapter>)], stickiness: &str) -> Arc<Adapter> {
    let b = bucket(route, stickiness);
    let mut acc = 0;
    for (w, a) in weights {
        acc += w;
        if b < acc {
            return a.clone();
        }
    }
    // The schema keeps the sum at WEIGHT_TOTAL; the last version covers any
    // rounding.
    weights.last().expect("a route has weights").1.clone()
}

/// The current snapshot, shared by every request.
#[derive(Debug, Clone)]
pub struct Registry {
    /// The snapshot in use and when it was loaded, swapped as one: a
    /// request reads both with one load and no lock.
    current: Arc<ArcSwap<Current>>,
    /// The next rebuild's ticket: rebuilds are ordered by when they began.
    tickets: Arc<AtomicU64>,
}

/// A snapshot and when it was loaded. Derefs to the [`Snapshot`].
#[derive(Debug)]
pub struct Current {
    snapshot: Snapshot,
    loaded_at: Instant,
    /// The ticket of the rebuild that read it (0: the first snapshot).
    ticket: u64,
}

impl Current {
    /// How old this snapshot is.
    pub fn age(&self) -> Duration {
        self.loaded_at.elapsed()
    }
}

impl std::ops::Deref for Current {
    type Target = Snapshot;

    fn deref(&self) -> &Snapshot {
        &self.snapshot
    }
}

impl Registry {
    pub fn new(snapshot: Snapshot) -> Registry {
        Registry {
            current: Arc::new(ArcSwap::from_pointee(Current {
                snapshot,
                loaded_at: Instant::now(),
                ticket: 0,
            })),
            tickets: Arc::new(AtomicU64::new(1)),
        }
    }

    /// The snapshot in use, with its age: read once per request.
    pub fn snapshot(&self) -> Arc<Current> {
        self.current.load_full()
    }

    /// Age of the snapshot in use.
    pub fn age(&self) -> Duration {
        self.current.load().age()
    }

    /// Puts in `snapshot`, read by the rebuild holding `ticket`, unless a
    /// rebuild that began later has already put in its own.
    fn replace(&self, snapshot: Snapshot, ticket: u64) {
        let fresh = Arc::new(Current {
            snapshot,
            loaded_at: Instant::now(),
            ticket,
        });
        self.current.rcu(|cur| {
            if cur.ticket > ticket {
                Arc::clone(cur)
            } else {
                Arc::clone(&fresh)
            }
        });
    }

    /// Rebuilds the snapshot; on failure keeps the old one. When it
    /// returns, the snapshot in use was read no earlier than this call
    /// began, whatever other rebuilds were under way.
    pub async fn reload(&self, pool: &PgPool) -> Result<(), sqlx::Error> {
        let ticket = self.tickets.fetch_add(1, Ordering::SeqCst);
        match Snapshot::load(pool).await {
            Ok(s) => {
                self.replace(s, ticket);
                metrics::counter!("lorafleet_gateway_registry_reloads_total", "outcome" => "ok")
                    .increment(1);
                Ok(())
            }
            Err(e) => {
                metrics::counter!("lorafleet_gateway_registry_reloads_total", "outcome" => "error")
                    .increment(1);
                tracing::warn!(error = %e, "registry reload failed; serving the previous snapshot");
                Err(e)
            }
        }
    }

    /// Keeps the snapshot fresh: reloads on each announcement on the Redis
    /// channel, and every `interval` whatever happens. Redis being down only
    /// loses the fast path; the interval still applies.
    pub fn spawn_refresher(
        &self,
        pool: PgPool,
        redis_url: Option<String>,
        channel: String,
        interval: Duration,
    ) {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
        if let Some(url) = redis_url {
            tokio::spawn(listen_for_changes(url, channel, tx));
        }
        let registry = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(interval);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    Some(()) = rx.recv() => {}
                }
                let _ = registry.reload(&pool).await;
            }
        });
    }
}

/// Subscribes to the change channel, reconnecting with backoff; each message
/// asks for a reload.
async fn listen_for_changes(url: String, channel: String, tx: tokio::sync::mpsc::Sender<()>) {
    use futures::StreamExt;
    let mut backoff = Duration::from_millis(200);
    loop {
        let result: redis::RedisResult<()> = async {
            let client = redis::Client::open(url.as_str())?;
            let mut pubsub = client.get_async_pubsub().await?;
            pubsub.subscribe(&channel).await?;
            // A change may have been announced while we were not listening.
            let _ = tx.try_send(());
            let mut messages = pubsub.on_message();
            while messages.next().await.is_some() {
                let _ = tx.try_send(());
            }
            Ok(())
        }
        .await;
        if let Err(e) = result {
            tracing::debug!(error = %e, "registry change channel unavailable");
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(10));
    }
}

/// Announces a registry change to every gateway listening on `channel`.
pub async fn announce_change(
    redis: &mut redis::aio::ConnectionManager,
    channel: &str,
) -> redis::RedisResult<()> {
    redis::cmd("PUBLISH")
        .arg(channel)
        .arg("changed")
        .query_async::<i64>(redis)
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn adapter(id: u64) -> Arc<Adapter> {
        Arc::new(Adapter {
            lora_int_id: AdapterId::new(id).unwrap(),
            name: format!("a{id}"),
            version: 1,
            rank: 8,
            artifact_uri: format!("a{id}"),
            artifact_sha256: Sha256Hex::parse(&"0".repeat(64)).unwrap(),
            base_hash: Sha256Hex::parse(&"0".repeat(64)).unwrap(),
            artifact_size: None,
        })
    }

    #[test]
    fn a_canary_split_over_10000_requests_is_within_one_percent_and_sticky() {
        let route = RouteId(Uuid::from_u128(0x1234_5678_9abc_def0_1234_5678_9abc_def0));
        for split in [
            [7_000u32, 3_000, 0],
            [9_000, 900, 100],
            [3_334, 3_333, 3_333],
        ] {
            let weights: Vec<(u32, Arc<Adapter>)> = split
                .iter()
                .enumerate()
                .filter(|(_, w)| **w > 0)
                .map(|(i, w)| (*w, adapter(i as u64 + 1)))
                .collect();
            let mut counts = [0u32; 3];
            for i in 0..10_000 {
                let request_id = Uuid::from_u128(i as u128 * 0x9e37_79b9).to_string();
                let a = pick(&route, &weights, &request_id);
                counts[a.lora_int_id.get() as usize - 1] += 1;
                // The same stickiness key always lands on the same version.
                assert_eq!(
                    pick(&route, &weights, &request_id).lora_int_id,
                    a.lora_int_id
                );
            }
            for (got, want) in counts.iter().zip(split) {
                let (got, want) = (f64::from(*got) / 10_000.0, f64::from(want) / 10_000.0);
                assert!((got - want).abs() <= 0.01, "{split:?}: got {counts:?}");
            }
        }
    }

    #[test]
    fn moving_weight_moves_only_the_users_it_must() {
        let route = RouteId(Uuid::from_u128(42));
        let before = vec![(9_000, adapter(1)), (1_000, adapter(2))];
        let after = vec![(8_000, adapter(1)), (2_000, adapter(2))];
        let mut moved_back = 0;
        for i in 0..10_000 {
            let user = format!("user-{i}");
            let (b, a) = (pick(&route, &before, &user), pick(&route, &after, &user));
            if b.lora_int_id.get() == 2 && a.lora_int_id.get() == 1 {
                moved_back += 1;
            }
        }
        assert_eq!(
            moved_back, 0,
            "raising the canary never moves its users off it"
        );
    }
}
