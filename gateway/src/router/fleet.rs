//! The workers: where they are, and what each one last reported.
//!
//! Workers come from a static address list or from a DNS name (a Kubernetes
//! headless service) re-resolved periodically. Each one gets a task that
//! holds a Watch stream open and folds every `WorkerReport` into its state.
//! A worker is routable only while its stream is up, its last report is
//! fresh and says SERVING; a dropped stream or a stale report takes it out of
//! the ring at once, and it rejoins with its next report.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use super::policy::{self, Decision, Router, WorkerView};
pub use crate::upstream::Transport;
use crate::upstream::{Report, Residency, WorkerClient};

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
    pub worker_id: String,
    pub connected: bool,
    pub serving: bool,
    pub base_hash: String,
    pub load: u32,
    pub adapters: HashMap<u64, Residency>,
    pub last_report: Option<Instant>,
}

impl Worker {
    pub fn state(&self) -> WorkerState {
        self.state.read().expect("worker state").clone()
    }

    /// Routable: stream up, report fresh, SERVING.
    pub fn up(&self) -> bool {
        let s = self.state.read().expect("worker state");
        s.connected && s.serving && s.last_report.is_some_and(|t| t.elapsed() < STALE_AFTER)
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
        s.base_hash = r.base_hash;
        s.load = r.load;
        s.adapters = r.adapters;
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

/// The routable view of every worker, and the router over it.
#[derive(Debug, Clone)]
pub struct Fleet {
    transport: Transport,
    workers: Arc<RwLock<Vec<Arc<Worker>>>>,
    router: Arc<Mutex<RouterState>>,
}

#[derive(Debug)]
struct RouterState {
    router: Router,
    /// Requests in flight per adapter through this gateway.
    adapter_load: HashMap<u64, u32>,
}

/// A routing decision resolved to workers.
#[derive(Debug)]
pub struct Route {
    pub candidates: Vec<Arc<Worker>>,
    pub reason: policy::Reason,
    /// Whether the first candidate had the adapter on its device.
    pub device_hit: bool,
}

impl Fleet {
    pub fn new(policy: policy::Policy, transport: Transport) -> Fleet {
        Fleet {
            transport,
            workers: Arc::default(),
            router: Arc::new(Mutex::new(RouterState {
                router: Router::new(policy),
                adapter_load: HashMap::new(),
            })),
        }
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
            let task = tokio::spawn(watch(worker.clone()));
            *worker.task.lock().expect("task") = Some(task.abort_handle());
            workers.push(worker);
        }
    }

    /// Chooses workers for a request on `lora_int_id` (0: the base model)
    /// among those serving `base_hash`. None: no such worker is up.
    pub fn route(&self, lora_int_id: u64, base_hash: &str) -> Option<Route> {
        let workers = self.workers();
        // Read under each worker's lock what this request needs, rather
        // than cloning every worker's adapter map on the request path.
        let up: Vec<(&Arc<Worker>, String, u32, policy::Residency, bool)> = workers
            .iter()
            .filter(|w| w.up())
            .map(|w| {
                let s = w.state.read().expect("worker state");
                let residency = match s.adapters.get(&lora_int_id) {
                    Some(Residency::Device) => policy::Residency::Device,
                    Some(Residency::Host) => policy::Residency::Host,
                    _ => policy::Residency::Absent,
                };
                let load = s.load.max(w.in_flight.load(Ordering::Relaxed));
                (
                    w,
                    s.worker_id.clone(),
                    load,
                    residency,
                    s.base_hash == base_hash,
                )
            })
            .collect();
        let ids: Vec<&str> = up.iter().map(|u| u.1.as_str()).collect();
        let views: Vec<WorkerView<'_>> = up
            .iter()
            .map(|(_, id, load, residency, eligible)| WorkerView {
                id,
                load: *load,
                residency: *residency,
                eligible: *eligible,
            })
            .collect();
        let mut r = self.router.lock().expect("router");
        r.router.set_workers(&ids);
        let adapter_load = r.adapter_load.get(&lora_int_id).copied().unwrap_or(0);
        let Decision { order, reason } = r.router.choose(lora_int_id, adapter_load, &views)?;
        let device_hit = views[order[0]].residency == policy::Residency::Device;
        Some(Route {
            candidates: order.into_iter().map(|i| up[i].0.clone()).collect(),
            reason,
            device_hit,
        })
    }

    /// Counts a request in flight on `worker` for `lora_int_id` until the
    /// guard drops.
    pub fn track(&self, worker: &Arc<Worker>, lora_int_id: u64) -> InFlight {
        worker.in_flight.fetch_add(1, Ordering::Relaxed);
        *self
            .router
            .lock()
            .expect("router")
            .adapter_load
            .entry(lora_int_id)
            .or_default() += 1;
        InFlight {
            fleet: self.clone(),
            worker: worker.clone(),
            lora_int_id,
        }
    }
}

/// See [`Fleet::track`].
#[derive(Debug)]
pub struct InFlight {
    fleet: Fleet,
    worker: Arc<Worker>,
    lora_int_id: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.worker.in_flight.fetch_sub(1, Ordering::Relaxed);
        let mut r = self.fleet.router.lock().expect("router");
        if let Some(n) = r.adapter_load.get_mut(&self.lora_int_id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                r.adapter_load.remove(&self.lora_int_id);
            }
        }
    }
}

/// Holds one Watch stream open for `worker`, reconnecting with backoff.
async fn watch(worker: Arc<Worker>) {
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
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
