//! The workers: where they are, and what each one last reported.
//!
//! Workers come from a static address list or from a DNS name (a Kubernetes
//! headless service) re-resolved periodically. Each one gets a task that
//! holds a Watch stream open and folds every `WorkerReport` into its state.
//! A worker is routable only while its stream is up, its last report is
//! fresh and says SERVING; a dropped stream or a stale report takes it out of
//! the ring at once, and it rejoins with its next report.
//!
//! Requests read an immutable [`Table`]: the ring over the routable workers,
//! what each last reported, and each base's context length. A Watch task
//! rebuilds it after each report or change of state and swaps it in, so
//! the request path (`route`, `max_model_len`, a candidate's worker id) is
//! one snapshot load plus atomic in-flight counts: it takes no lock, not
//! the member list's nor any worker's state (a test holds them all for
//! writing while a request routes).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;

use super::policy::{self, Decision, Ring, WorkerView};
pub use crate::upstream::Transport;
use crate::upstream::{AdapterId, Report, Residency, WorkerClient, WorkerId};
use lorafleet_domain::digest::Sha256Hex;

/// A report older than this means the worker is gone (it reports at least
/// every 500 ms).
const STALE_AFTER: Duration = Duration::from_secs(3);

/// What the gateway knows of one worker.
#[derive(Debug)]
pub struct Worker {
    pub addr: String,
    pub client: WorkerClient,
    state: RwLock<WorkerState>,
    /// Requests this gateway has in flight there.
    pub in_flight: AtomicU32,
    task: Mutex<Option<tokio::task::AbortHandle>>,
}

#[derive(Debug, Clone, Default)]
pub struct WorkerState {
    pub worker_id: WorkerId,
    pub connected: bool,
    pub serving: bool,
    pub draining: bool,
    pub base_name: String,
    pub base_hash: Option<Sha256Hex>,
    /// 0 until the worker has reported.
    pub max_model_len: u32,
    /// How the base's weights are quantized (empty: dense), and the bytes
    /// they take in the worker's backend.
    pub quantization: String,
    pub weights_bytes: u64,
    pub load: u32,
    pub kv_blocks_used: u32,
    pub kv_blocks_total: u32,
    /// Shared with the routing snapshots built from this report.
    pub adapters: Arc<HashMap<AdapterId, Residency>>,
    pub last_report: Option<Instant>,
}

impl WorkerState {
    /// Routable at `now`: stream up, report fresh, SERVING.
    fn up_at(&self, now: Instant) -> bool {
        self.connected
            && self.serving
            && self
                .last_report
                .is_some_and(|t| now.saturating_duration_since(t) < STALE_AFTER)
    }
}

impl Worker {
    pub fn state(&self) -> WorkerState {
        self.state.read().expect("worker state").clone()
    }

    /// Routable: stream up, report fresh, SERVING.
    pub fn up(&self) -> bool {
        self.state
            .read()
            .expect("worker state")
            .up_at(Instant::now())
    }

    fn mark_down(&self) {
        let mut s = self.state.write().expect("worker state");
        if s.connected {
            tracing::warn!(worker = %self.addr, worker_id = %s.worker_id, "worker left the ring");
        }
        s.connected = false;
    }

    fn apply(&self, r: Report) {
        let mut s = self.state.write().expect("worker state");
        if !s.connected {
            tracing::info!(worker = %self.addr, worker_id = %r.worker_id, "worker joined the ring");
        }
        s.connected = true;
        s.worker_id = r.worker_id;
        s.serving = r.serving;
        s.draining = r.draining;
        s.base_name = r.base_name;
        s.base_hash = r.base_hash;
        s.max_model_len = r.max_model_len;
        s.quantization = r.quantization;
        s.weights_bytes = r.weights_bytes;
        s.load = r.load;
        s.kv_blocks_used = r.kv_blocks_used;
        s.kv_blocks_total = r.kv_blocks_total;
        s.adapters = Arc::new(r.adapters);
        s.last_report = Some(Instant::now());
    }
}

/// Where the fleet's members come from.
#[derive(Debug, Clone)]
pub enum Discovery {
    Static(Vec<String>),
    /// `host:port`, re-resolved every interval.
    Dns(String, Duration),
}

/// The members, the routing snapshot over them, and the per-adapter loads.
#[derive(Debug, Clone)]
pub struct Fleet {
    transport: Transport,
    policy: policy::Policy,
    /// Every member, routable or not; changed only by discovery.
    workers: Arc<RwLock<Vec<Arc<Worker>>>>,
    /// What requests route on; rebuilt and swapped, never changed in place.
    table: Arc<ArcSwap<Table>>,
    /// Held while a snapshot is built, so a slower rebuild that read older
    /// states never replaces a newer snapshot (never on the request path).
    rebuilding: Arc<Mutex<()>>,
}

/// A routing snapshot: the ring over the workers routable when it was
/// built, each one's last report (its index is its place in the ring),
/// and the context each base accepts on every member that reported it.
#[derive(Debug, Default)]
pub struct Table {
    ring: Arc<Ring>,
    entries: Vec<Entry>,
    /// Base hash to the smallest `max_model_len` of the members reporting
    /// it, routable or not (see [`Fleet::max_model_len`]).
    max_model_len: HashMap<Sha256Hex, u32>,
}

#[derive(Debug)]
struct Entry {
    worker: Arc<Worker>,
    state: WorkerState,
}

/// A routing decision resolved to workers.
#[derive(Debug)]
pub struct Route {
    pub candidates: Vec<Candidate>,
    pub reason: policy::Reason,
    /// Whether the first candidate had the adapter on its device.
    pub device_hit: bool,
}

/// A worker a request may go to, with the id its last report gave (read
/// from the snapshot, not the worker's live state).
#[derive(Debug)]
pub struct Candidate {
    pub worker: Arc<Worker>,
    pub worker_id: WorkerId,
}

impl Fleet {
    pub fn new(policy: policy::Policy, transport: Transport) -> Fleet {
        Fleet {
            transport,
            policy,
            workers: Arc::default(),
            table: Arc::default(),
            rebuilding: Arc::default(),
        }
    }

    /// Builds the routing snapshot from every member's current state and
    /// swaps it in. The ring is reused while the routable set is unchanged.
    fn rebuild(&self) {
        let _one_at_a_time = self.rebuilding.lock().expect("rebuild");
        let now = Instant::now();
        let mut max_model_len: HashMap<Sha256Hex, u32> = HashMap::new();
        let entries: Vec<Entry> = self
            .workers()
            .into_iter()
            .filter_map(|worker| {
                let state = worker.state();
                if let Some(base) = state.base_hash.as_ref().filter(|_| state.max_model_len > 0) {
                    max_model_len
                        .entry(base.clone())
                        .and_modify(|m| *m = (*m).min(state.max_model_len))
                        .or_insert(state.max_model_len);
                }
                state.up_at(now).then_some(Entry { worker, state })
            })
            .collect();
        let ids: Vec<&str> = entries.iter().map(|e| e.state.worker_id.as_str()).collect();
        let old = self.table.load();
        let ring = if old.ring.is_over(&ids) {
            old.ring.clone()
        } else {
            Arc::new(Ring::new(&ids))
        };
        self.table.store(Arc::new(Table {
            ring,
            entries,
            max_model_len,
        }));
    }

    /// The context every reporting worker on `base_hash` accepts (the
    /// smallest of theirs); None while none has reported. Read from the
    /// snapshot: it runs once per request.
    pub fn max_model_len(&self, base_hash: &Sha256Hex) -> Option<u32> {
        self.table.load().max_model_len.get(base_hash).copied()
    }

    pub fn workers(&self) -> Vec<Arc<Worker>> {
        self.workers.read().expect("fleet").clone()
    }

    /// Starts discovery and the Watch tasks.
    pub fn start(&self, discovery: Discovery) {
        match discovery {
            Discovery::Static(addrs) => self.set_members(&addrs),
            Discovery::Dns(name, every) => {
                let fleet = self.clone();
                tokio::spawn(async move {
                    loop {
                        match tokio::net::lookup_host(&name).await {
                            Ok(addrs) => {
                                let mut v: Vec<String> = addrs.map(|a| a.to_string()).collect();
                                v.sort();
                                v.dedup();
                                fleet.set_members(&v);
                            }
                            Err(e) => {
                                tracing::warn!(name = %name, error = %e, "worker DNS lookup failed; keeping the current members");
                            }
                        }
                        tokio::time::sleep(every).await;
                    }
                });
            }
        }
    }

    /// Adds workers at new addresses and stops watching removed ones.
    pub fn set_members(&self, addrs: &[String]) {
        let mut workers = self.workers.write().expect("fleet");
        workers.retain(|w| {
            let keep = addrs.contains(&w.addr);
            if !keep && let Some(task) = w.task.lock().expect("task").take() {
                task.abort();
            }
            keep
        });
        for addr in addrs {
            if workers.iter().any(|w| &w.addr == addr) {
                continue;
            }
            let client = match WorkerClient::connect_lazy(addr, &self.transport) {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(worker = %addr, error = %e, "cannot call this worker");
                    continue;
                }
            };
            let worker = Arc::new(Worker {
                addr: addr.clone(),
                client,
                state: RwLock::default(),
                in_flight: AtomicU32::new(0),
                task: Mutex::new(None),
            });
            let task = tokio::spawn(watch(self.clone(), worker.clone()));
            *worker.task.lock().expect("task") = Some(task.abort_handle());
            workers.push(worker);
        }
        drop(workers);
        self.rebuild();
    }

    /// Workers routable now, as requests see them (the routing snapshot),
    /// so readiness never runs ahead of routing.
    pub fn routable(&self) -> usize {
        let now = Instant::now();
        self.table
            .load()
            .entries
            .iter()
            .filter(|e| e.state.up_at(now))
            .count()
    }

    /// Chooses workers for a request on `adapter` (None: the base model)
    /// among those serving `base_hash`. None: no such worker is up.
    pub fn route(&self, adapter: Option<AdapterId>, base_hash: &Sha256Hex) -> Option<Route> {
        let table = self.table.load();
        let now = Instant::now();
        let views: Vec<WorkerView<'_>> = table
            .entries
            .iter()
            .map(|e| {
                let residency = match adapter.and_then(|id| e.state.adapters.get(&id)) {
                    Some(Residency::Device) => policy::Tier::Device,
                    Some(Residency::Host) => policy::Tier::Host,
                    _ => policy::Tier::Absent,
                };
                WorkerView {
                    id: e.state.worker_id.as_str(),
                    load: e.state.load.max(e.worker.in_flight.load(Ordering::Relaxed)),
                    residency,
                    // A report gone stale since the snapshot was built
                    // (its Watch task will rebuild it) counts as down.
                    eligible: e.state.base_hash.as_ref() == Some(base_hash) && e.state.up_at(now),
                }
            })
            .collect();
        let Decision { order, reason } =
            policy::decide(self.policy, &table.ring, ring_key(adapter), &views)?;
        let device_hit = views[order[0]].residency == policy::Tier::Device;
        Some(Route {
            candidates: order
                .into_iter()
                .map(|i| Candidate {
                    worker: table.entries[i].worker.clone(),
                    worker_id: table.entries[i].state.worker_id.clone(),
                })
                .collect(),
            reason,
            device_hit,
        })
    }

    /// Counts a request in flight on `worker` until the guard drops.
    pub fn track(&self, worker: &Arc<Worker>) -> InFlight {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            worker: worker.clone(),
        }
    }
}

/// See [`Fleet::track`].
#[derive(Debug)]
pub struct InFlight {
    worker: Arc<Worker>,
}

/// The ring key of a request: its adapter id, or 0 for the base model
/// (which no adapter id is).
fn ring_key(adapter: Option<AdapterId>) -> u64 {
    adapter.map_or(0, AdapterId::get)
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Holds one Watch stream open for `worker`, reconnecting with backoff.
async fn watch(fleet: Fleet, worker: Arc<Worker>) {
    let mut backoff = Duration::from_millis(100);
    // Why the last call failed: each new reason is logged once (a worker
    // that refuses this gateway's certificate says so at every retry).
    let mut last_failure = String::new();
    loop {
        let subscriber = format!("gateway-{}", std::process::id());
        match worker.client.watch(subscriber).await {
            Ok(mut stream) => loop {
                match tokio::time::timeout(STALE_AFTER, stream.next()).await {
                    Ok(Ok(Some(report))) => {
                        worker.apply(report);
                        fleet.rebuild();
                        backoff = Duration::from_millis(100);
                        last_failure.clear();
                    }
                    Ok(Ok(None)) => break,
                    Ok(Err(e)) => {
                        tracing::debug!(worker = %worker.addr, error = %e.detail, "Watch stream failed");
                        break;
                    }
                    Err(_) => {
                        tracing::warn!(worker = %worker.addr, "no Watch report in {STALE_AFTER:?}");
                        break;
                    }
                }
            },
            Err(e) => {
                let why = e.detail;
                if why != last_failure {
                    tracing::warn!(worker = %worker.addr, error = %why, "cannot reach the worker");
                    last_failure = why;
                }
            }
        }
        worker.mark_down();
        fleet.rebuild();
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(c: char) -> Sha256Hex {
        Sha256Hex::parse(&c.to_string().repeat(64)).unwrap()
    }

    fn member(fleet: &Fleet, i: u16, max_model_len: u32) -> Arc<Worker> {
        let addr = format!("127.0.0.1:{}", 9 + i);
        let worker = Arc::new(Worker {
            client: WorkerClient::connect_lazy(&addr, &Transport::Plaintext).unwrap(),
            addr,
            state: RwLock::default(),
            in_flight: AtomicU32::new(0),
            task: Mutex::new(None),
        });
        worker.apply(Report {
            worker_id: WorkerId::new(format!("w{i}")),
            serving: true,
            draining: false,
            base_name: "base".into(),
            base_hash: Some(hash('a')),
            max_model_len,
            quantization: String::new(),
            weights_bytes: 0,
            load: 0,
            kv_blocks_used: 0,
            kv_blocks_total: 0,
            adapters: HashMap::new(),
        });
        // No Watch task: the reports above are all the state there is.
        fleet.workers.write().unwrap().push(worker.clone());
        worker
    }

    /// The request path reads the snapshot alone: with the member list
    /// and every worker's state held for writing (as discovery and the
    /// Watch tasks take them), a request still routes and reads its
    /// context length. Taking either lock on that path blocks it here.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_routes_while_every_fleet_lock_is_held_for_writing() {
        let fleet = Fleet::new(policy::Policy::default(), Transport::Plaintext);
        let workers = [member(&fleet, 0, 4096), member(&fleet, 1, 2048)];
        fleet.rebuild();
        let members = fleet.workers.write().unwrap();
        let states: Vec<_> = workers.iter().map(|w| w.state.write().unwrap()).collect();
        let f = fleet.clone();
        let request = std::thread::spawn(move || {
            let (base, other) = (hash('a'), hash('b'));
            let route = f.route(Some(AdapterId::new(7).unwrap()), &base).unwrap();
            let ids: Vec<String> = route
                .candidates
                .into_iter()
                .map(|c| c.worker_id.into_string())
                .collect();
            (f.max_model_len(&base), f.max_model_len(&other), ids)
        });
        let deadline = Instant::now() + Duration::from_secs(5);
        while !request.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let finished = request.is_finished();
        drop(states);
        drop(members);
        assert!(
            finished,
            "the request path waited for a lock the fleet's writers hold"
        );
        let (len, other, mut ids) = request.join().unwrap();
        assert_eq!(
            len,
            Some(2048),
            "the smallest context of the members on the base"
        );
        assert_eq!(other, None);
        ids.sort();
        assert_eq!(ids, ["w0", "w1"]);
    }
}
