//! The paged adapter pool: an artifact store on disk, a host tier of
//! validated adapters (`max_cpu_loras`, least recently used evicted first)
//! and a device tier of `max_loras` slots in the backend.
//!
//! Tiers are inclusive: an adapter in a device slot is also in the host
//! tier. Every running sequence holds a [`Lease`] on its adapter; a leased
//! or pinned adapter is never evicted from either tier. Loads from disk run
//! on a loader thread, so the engine keeps stepping while they happen.
//!
//! Under a shared [`MemoryBudget`] a slot holding an adapter counts against
//! the budget (with what its adapter packs beside it): an empty slot is
//! filled only while the budget has room, and [`AdapterPool::shed_bytes`]
//! empties slots no sequence leases to give their bytes to the KV cache.

mod device;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use crate::backend::Backend;
use crate::budget::MemoryBudget;
use crate::error::Result;
use crate::eviction::{EvictionPolicy, RequestRate};
use crate::lora::{AdapterError, AdapterLimits, HostAdapter};
use crate::model::ModelConfig;

pub use lorafleet_domain::digest::BaseHash;
pub use lorafleet_domain::{AdapterId, Residency};

/// Where an adapter's files are, and what it claims to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterSource {
    /// A name for logs and errors.
    pub name: String,
    pub dir: PathBuf,
    /// The base hash the adapter was registered against, when known.
    pub declared_base_hash: Option<BaseHash>,
    /// The artifact digest of `dir` (as `lorafleet_artifact::roots::digest`
    /// computes it), when the caller has verified it; otherwise the pool
    /// computes it at registration. It is the identity prefix-cached KV
    /// blocks are keyed by.
    pub digest: Option<String>,
}

/// Why an adapter cannot be registered. No paths in the messages: they
/// may reach a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("lora_int_id {id} is already registered for other files")]
    OtherFiles { id: AdapterId },
    #[error("the files of adapter {name:?} cannot be read to identify its weights")]
    Unreadable { name: String },
}

/// Cumulative pool counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolCounters {
    /// Requests whose adapter was in a device slot when they arrived.
    pub device_hits: u64,
    /// Requests whose adapter was in the host tier (not on the device).
    pub host_hits: u64,
    /// Requests whose adapter had to be read from disk.
    pub misses: u64,
    /// Loads from disk into the host tier.
    pub host_loads: u64,
    /// Copies from the host tier into a device slot.
    pub device_loads: u64,
    pub device_evictions: u64,
    pub host_evictions: u64,
    pub load_failures: u64,
    /// Copies into a free slot started for a waiting request before its
    /// admission (part of `device_loads`).
    pub prefetches: u64,
    /// Admissions that found their adapter where a prefetch put it.
    pub prefetch_hits: u64,
    /// Device loads made at admission, on the step's path, for an adapter
    /// that a prefetch could have started a step earlier: it was in the
    /// host tier while a slot was free (with room in the budget) and
    /// requests waited for it, but the step's prefetches went elsewhere.
    pub late_loads: u64,
}

/// Keeps an adapter resident while held. Dropping it releases the hold.
#[derive(Debug)]
pub struct Lease {
    count: Arc<AtomicU32>,
    id: AdapterId,
}

impl Lease {
    pub fn adapter(&self) -> AdapterId {
        self.id
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One adapter as the pool sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct AdapterStatus {
    pub id: AdapterId,
    pub name: String,
    pub rank: usize,
    pub residency: Residency,
    pub slot: Option<usize>,
    pub pinned: bool,
    pub active: u32,
    pub queued: u32,
    /// The pool's logical clock at last use; larger is more recent.
    pub last_used: u64,
}

#[derive(Debug)]
struct Entry {
    source: AdapterSource,
    host: Option<Arc<HostAdapter>>,
    slot: Option<usize>,
    pinned: bool,
    leases: Arc<AtomicU32>,
    queued: u32,
    last_used: u64,
    /// Its recent request rate, for eviction by value.
    rate: RequestRate,
    loading: bool,
    /// Set by `unload` while leases remain; the adapter leaves when they end.
    unload_pending: bool,
    /// In its slot by a prefetch no admission has used yet.
    prefetched: bool,
    /// At the end of the last step it was in the host tier, wanted, and a
    /// slot was free for it, but no prefetch started.
    prefetchable: bool,
    /// The number of the latest load asked for. A result carrying another
    /// number is stale (an unload or a fresher parse came since) and is
    /// dropped, so an unload is never undone by a load finishing after it.
    load_seq: u64,
    /// The logits per position its requests were admitted with (the
    /// model's, or its own grown vocabulary as registered): a load whose
    /// layers say otherwise is refused, not served at the wrong width.
    vocab: usize,
}

type LoadResult = (
    AdapterId,
    u64,
    std::result::Result<HostAdapter, AdapterError>,
);

/// The adapter pool. Owned and driven by the engine's thread.
#[derive(Debug)]
pub struct AdapterPool {
    entries: HashMap<AdapterId, Entry>,
    slots: Vec<Option<AdapterId>>,
    max_cpu_loras: usize,
    /// The host tier's budget in bytes of adapter weights, if any: an
    /// adapter costs its real size (one with expert weights many times an
    /// attention-only one), not one place of `max_cpu_loras`.
    max_cpu_bytes: Option<usize>,
    clock: u64,
    counters: PoolCounters,
    jobs: mpsc::Sender<(AdapterId, u64, AdapterSource)>,
    results: mpsc::Receiver<LoadResult>,
    /// Incremented on every residency change, so watchers can tell.
    generation: u64,
    /// The most adapters pinned at once.
    max_pinned: usize,
    /// How long each slot write took, since they were last taken.
    upload_times: Vec<Duration>,
    /// Each slot write's adapter and time, until the engine charges it to
    /// the requests that wait for that adapter.
    load_charges: Vec<(AdapterId, Duration)>,
    /// How a device slot is chosen for eviction.
    eviction: EvictionPolicy,
    /// Requests that arrived: the clock of request rates.
    arrivals: u64,
    /// The byte budget shared with the KV cache, if any.
    budget: Option<Arc<MemoryBudget>>,
    /// What each slot's adapter holds beyond the slot (an lm_head of its
    /// own, packed beside it), in bytes: counted against the budget.
    slot_extra: Vec<u64>,
    /// The model's vocabulary: an entry's until it is told its own.
    model_vocab: usize,
}

/// Slot write times kept between two takes; older ones are dropped.
const MAX_UPLOAD_TIMES: usize = 4096;

impl AdapterPool {
    /// A pool with `slots` device slots and a host tier of `max_cpu_loras`.
    /// `base_hash` is the served model's, checked against what adapters declare.
    pub fn new(
        config: ModelConfig,
        max_lora_rank: usize,
        slots: usize,
        max_cpu_loras: usize,
        base_hash: BaseHash,
    ) -> Self {
        let model_vocab = config.vocab_size;
        let (jobs, job_rx) = mpsc::channel::<(AdapterId, u64, AdapterSource)>();
        let (result_tx, results) = mpsc::channel();
        std::thread::Builder::new()
            .name("adapter-loader".into())
            .spawn(move || {
                for (id, seq, source) in job_rx {
                    let limits = AdapterLimits {
                        model: &config,
                        max_lora_rank,
                        base_hash_check: source
                            .declared_base_hash
                            .as_ref()
                            .map(|d| (base_hash.as_str(), d.as_str())),
                    };
                    let loaded =
                        HostAdapter::load(&source.name, &source.dir, limits).map(|mut a| {
                            a.digest = source.digest.clone();
                            a
                        });
                    if result_tx.send((id, seq, loaded)).is_err() {
                        break;
                    }
                }
            })
            .expect("spawn the adapter loader thread");
        AdapterPool {
            entries: HashMap::new(),
            slots: vec![None; slots],
            slot_extra: vec![0; slots],
            model_vocab,
            max_cpu_loras,
            max_cpu_bytes: None,
            clock: 0,
            counters: PoolCounters::default(),
            jobs,
            results,
            generation: 0,
            max_pinned: slots.saturating_sub(1),
            upload_times: Vec::new(),
            load_charges: Vec::new(),
            eviction: EvictionPolicy::default(),
            arrivals: 0,
            budget: None,
        }
    }

    /// How a device slot is chosen for eviction (default: by value).
    pub fn set_eviction(&mut self, policy: EvictionPolicy) {
        self.eviction = policy;
    }

    /// Caps pins (default: one slot fewer than there are).
    pub fn set_max_pinned(&mut self, max: usize) {
        self.max_pinned = max;
    }

    /// Caps the host tier's adapter weights at `bytes` as well as at
    /// `max_cpu_loras` adapters (None: the count alone).
    pub fn set_host_byte_budget(&mut self, bytes: Option<usize>) {
        self.max_cpu_bytes = bytes;
        self.evict_host_over_capacity();
    }

    /// Bytes of adapter weights the host tier holds.
    pub fn host_bytes(&self) -> usize {
        self.entries
            .values()
            .filter_map(|e| e.host.as_ref())
            .map(|h| h.bytes)
            .sum()
    }

    /// How long each slot write (host tier to device slot) took since the
    /// last call.
    pub fn take_upload_times(&mut self) -> Vec<Duration> {
        std::mem::take(&mut self.upload_times)
    }

    /// Each slot write's adapter and time since the last call.
    pub(crate) fn take_load_charges(&mut self) -> Vec<(AdapterId, Duration)> {
        std::mem::take(&mut self.load_charges)
    }

    pub fn counters(&self) -> PoolCounters {
        self.counters
    }

    /// Changes with every residency change.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Makes an adapter known. The same id must always name the same files.
    pub fn register(
        &mut self,
        id: AdapterId,
        source: AdapterSource,
    ) -> std::result::Result<(), RegisterError> {
        self.register_loaded(id, source, None)
    }

    /// [`AdapterPool::register`], with the adapter already read and checked
    /// from those files (then it goes straight into the host tier, and is
    /// not read again until evicted).
    pub fn register_loaded(
        &mut self,
        id: AdapterId,
        source: AdapterSource,
        loaded: Option<HostAdapter>,
    ) -> std::result::Result<(), RegisterError> {
        let mut source = source;
        if source.digest.is_none() {
            let digest = lorafleet_artifact::roots::digest(&source.dir).map_err(|_| {
                RegisterError::Unreadable {
                    name: source.name.clone(),
                }
            })?;
            source.digest = Some(digest);
        }
        let now = self.tick();
        match self.entries.get_mut(&id) {
            // An idle entry (unloaded, nothing holds or wants it) may take
            // new files: the id's adapter was unloaded and registered again.
            Some(e)
                if e.source.dir != source.dir
                    && e.host.is_none()
                    && e.slot.is_none()
                    && !e.loading
                    && !e.unload_pending
                    && e.queued == 0
                    && e.leases.load(Ordering::Acquire) == 0 =>
            {
                e.source = source;
                if let Some(adapter) = loaded {
                    e.host = Some(Arc::new(adapter));
                    e.last_used = now;
                    self.counters.host_loads += 1;
                    self.evict_host_over_capacity();
                }
                self.generation += 1;
                Ok(())
            }
            Some(e) if e.source.dir != source.dir => Err(RegisterError::OtherFiles { id }),
            Some(e) => {
                if let Some(adapter) = loaded
                    && e.host.is_none()
                {
                    // A load in flight, if any, is superseded by this parse.
                    e.loading = false;
                    e.load_seq += 1;
                    e.host = Some(Arc::new(adapter));
                    e.last_used = now;
                    self.counters.host_loads += 1;
                    self.generation += 1;
                    self.evict_host_over_capacity();
                }
                Ok(())
            }
            None => {
                let host = loaded.map(Arc::new);
                if host.is_some() {
                    self.counters.host_loads += 1;
                    self.generation += 1;
                }
                self.entries.insert(
                    id,
                    Entry {
                        source,
                        host,
                        slot: None,
                        pinned: false,
                        leases: Arc::new(AtomicU32::new(0)),
                        queued: 0,
                        last_used: now,
                        rate: RequestRate::default(),
                        loading: false,
                        unload_pending: false,
                        prefetched: false,
                        prefetchable: false,
                        load_seq: 0,
                        vocab: self.model_vocab,
                    },
                );
                self.evict_host_over_capacity();
                Ok(())
            }
        }
    }

    /// The logits per position `id`'s requests are admitted with: its own
    /// grown vocabulary, as registered (see [`check_fits`]).
    pub fn set_vocab(&mut self, id: AdapterId, vocab: usize) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.vocab = vocab;
        }
    }

    /// The artifact digest of a registered adapter's weights: the identity
    /// its prefix-cached KV blocks are keyed by.
    pub fn weights_identity(&self, id: AdapterId) -> Option<&str> {
        self.entries.get(&id)?.source.digest.as_deref()
    }

    pub fn is_registered(&self, id: AdapterId) -> bool {
        self.entries.contains_key(&id)
    }

    pub fn residency(&self, id: AdapterId) -> Residency {
        match self.entries.get(&id) {
            Some(e) if e.slot.is_some() => Residency::Device,
            Some(e) if e.host.is_some() => Residency::Host,
            Some(e) if e.loading => Residency::Loading,
            _ => Residency::NotLoaded,
        }
    }

    pub fn slot_of(&self, id: AdapterId) -> Option<usize> {
        self.entries.get(&id).and_then(|e| e.slot)
    }

    pub fn host_adapter(&self, id: AdapterId) -> Option<&Arc<HostAdapter>> {
        self.entries.get(&id).and_then(|e| e.host.as_ref())
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// Records a request's arrival: counts the hit or miss, marks it queued,
    /// starts a load if needed, and returns the residency it found.
    pub fn on_arrival(&mut self, id: AdapterId) -> Residency {
        let residency = self.residency(id);
        match residency {
            Residency::Device => self.counters.device_hits += 1,
            Residency::Host => self.counters.host_hits += 1,
            Residency::Loading | Residency::NotLoaded => self.counters.misses += 1,
        }
        let now = self.tick();
        self.arrivals += 1;
        if let Some(e) = self.entries.get_mut(&id) {
            e.queued += 1;
            e.last_used = now;
            e.rate.arrive(self.arrivals);
            e.unload_pending = false;
        }
        self.request_load(id);
        residency
    }

    /// A preempted request went back to the queue.
    pub fn on_requeue(&mut self, id: AdapterId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.queued += 1;
        }
    }

    /// A queued request left the queue (admitted, failed or cancelled).
    pub fn on_dequeue(&mut self, id: AdapterId) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.queued = e.queued.saturating_sub(1);
        }
    }

    /// Starts reading an adapter from disk if it is not in the host tier.
    pub fn request_load(&mut self, id: AdapterId) {
        if let Some(e) = self.entries.get_mut(&id)
            && e.host.is_none()
            && !e.loading
        {
            e.loading = true;
            e.load_seq += 1;
            self.generation += 1;
            // The loader lives as long as the pool; a send cannot fail.
            let _ = self.jobs.send((id, e.load_seq, e.source.clone()));
        }
    }

    pub fn loads_in_flight(&self) -> usize {
        self.entries.values().filter(|e| e.loading).count()
    }

    /// Takes finished loads into the host tier. Returns the failures, so the
    /// engine can fail the requests waiting on them. With `wait`, blocks up
    /// to that long for the first result.
    pub fn poll_loads(&mut self, wait: Option<Duration>) -> Vec<(AdapterId, AdapterError)> {
        let mut failures = Vec::new();
        let mut first = wait.and_then(|w| self.results.recv_timeout(w).ok());
        let next = |results: &mpsc::Receiver<LoadResult>| match results.try_recv() {
            Ok(r) => Some(Ok(r)),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(())),
        };
        loop {
            let (id, seq, result) = match first.take().map(Ok).or_else(|| next(&self.results)) {
                None => break,
                Some(Ok(r)) => r,
                Some(Err(())) => {
                    // The loader thread is gone (it panicked): fail every
                    // load in flight rather than wait for it forever.
                    for (id, e) in self.entries.iter_mut().filter(|(_, e)| e.loading) {
                        e.loading = false;
                        self.counters.load_failures += 1;
                        failures.push((
                            *id,
                            AdapterError::Io {
                                adapter: e.source.name.clone(),
                                path: e.source.dir.display().to_string(),
                                source: std::io::Error::other("the adapter loader stopped"),
                            },
                        ));
                    }
                    break;
                }
            };
            let now = self.tick();
            let Some(e) = self.entries.get_mut(&id) else {
                continue;
            };
            if seq != e.load_seq || !e.loading {
                // Unloaded, or given a fresher parse, since: that stands.
                continue;
            }
            e.loading = false;
            self.generation += 1;
            let result = result.and_then(|adapter| {
                let vocab = e.vocab;
                check_fits(&adapter, vocab, self.model_vocab, self.budget.as_deref())
                    .map(|()| adapter)
            });
            match result {
                Ok(adapter) => {
                    e.host = Some(Arc::new(adapter));
                    e.last_used = now;
                    self.counters.host_loads += 1;
                    self.evict_host_over_capacity();
                }
                Err(err) => {
                    self.counters.load_failures += 1;
                    failures.push((id, err));
                }
            }
        }
        failures
    }

    fn evict_host_over_capacity(&mut self) {
        loop {
            let held = self.entries.values().filter(|e| e.host.is_some()).count();
            let over_bytes = self.max_cpu_bytes.is_some_and(|b| self.host_bytes() > b);
            if held <= self.max_cpu_loras && !over_bytes {
                return;
            }
            let victim = self
                .entries
                .iter()
                .filter(|(_, e)| {
                    e.host.is_some()
                        && e.slot.is_none()
                        && !e.pinned
                        && e.queued == 0
                        && e.leases.load(Ordering::Acquire) == 0
                })
                .min_by_key(|(id, e)| (e.last_used, **id))
                .map(|(id, _)| *id);
            // Everything is in use: stay over capacity until something frees.
            let Some(victim) = victim else { return };
            if let Some(e) = self.entries.get_mut(&victim) {
                e.host = None;
            }
            self.counters.host_evictions += 1;
            self.generation += 1;
        }
    }

    /// Takes a lease: the adapter cannot be evicted until it is dropped.
    pub fn lease(&mut self, id: AdapterId) -> Lease {
        let now = self.tick();
        let e = self
            .entries
            .get_mut(&id)
            .expect("lease on a registered adapter");
        e.last_used = now;
        e.leases.fetch_add(1, Ordering::AcqRel);
        if std::mem::take(&mut e.prefetched) {
            self.counters.prefetch_hits += 1;
        }
        Lease {
            count: e.leases.clone(),
            id,
        }
    }

    /// Marks an adapter used by the current step.
    pub fn touch(&mut self, id: AdapterId) {
        let now = self.tick();
        if let Some(e) = self.entries.get_mut(&id) {
            e.last_used = now;
        }
    }

    /// Pins or unpins an adapter's device slot. A pin beyond `max_pinned`
    /// is refused, so one slot always serves unpinned traffic.
    pub fn set_pinned(&mut self, id: AdapterId, pinned: bool) -> Result<()> {
        let others = self
            .entries
            .iter()
            .filter(|(other, e)| **other != id && e.pinned)
            .count();
        let Some(e) = self.entries.get_mut(&id) else {
            return Ok(());
        };
        if e.pinned != pinned {
            if pinned && others >= self.max_pinned {
                return Err(crate::error::EngineError::PinLimit { pinned: others });
            }
            e.pinned = pinned;
            self.generation += 1;
        }
        // A pin after an unload asks for the adapter again, as an arrival
        // does: the later request wins, and the pin holds. This holds too
        // when the pin was never dropped, because the unload waits for
        // leases to end before it takes the pin away.
        if pinned && e.unload_pending {
            e.unload_pending = false;
            self.generation += 1;
        }
        Ok(())
    }

    /// Removes an adapter from both tiers now, or once its leases end.
    /// Returns (residency before, requests still holding or waiting for
    /// it); 0 means it is gone now.
    pub fn unload(&mut self, id: AdapterId, backend: &mut dyn Backend) -> Result<(Residency, u32)> {
        let before = self.residency(id);
        let Some(e) = self.entries.get_mut(&id) else {
            return Ok((before, 0));
        };
        let held = e.leases.load(Ordering::Acquire);
        if held > 0 || e.queued > 0 {
            e.unload_pending = true;
            // Waiting requests count too: they will still read the adapter.
            return Ok((before, held + e.queued));
        }
        if e.loading {
            // The load in flight is stale from now on.
            e.loading = false;
            e.load_seq += 1;
        }
        self.drop_entry_now(id, backend)?;
        Ok((before, 0))
    }

    fn drop_entry_now(&mut self, id: AdapterId, backend: &mut dyn Backend) -> Result<()> {
        if let Some(e) = self.entries.get_mut(&id) {
            if let Some(slot) = e.slot.take() {
                self.slots[slot] = None;
                self.slot_extra[slot] = 0;
                backend.clear_slot(slot)?;
            }
            e.host = None;
            e.pinned = false;
            e.unload_pending = false;
            self.generation += 1;
        }
        self.report();
        Ok(())
    }

    /// Finishes unloads whose last lease has ended.
    pub fn settle_unloads(&mut self, backend: &mut dyn Backend) -> Result<()> {
        let ready: Vec<AdapterId> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.unload_pending && e.queued == 0 && e.leases.load(Ordering::Acquire) == 0
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ready {
            self.drop_entry_now(id, backend)?;
        }
        Ok(())
    }

    /// Every adapter held in a tier or loading, ordered by id.
    pub fn statuses(&self) -> Vec<AdapterStatus> {
        let mut out: Vec<AdapterStatus> = self
            .entries
            .iter()
            .filter(|(_, e)| e.host.is_some() || e.loading)
            .map(|(&id, e)| AdapterStatus {
                id,
                name: e.source.name.clone(),
                rank: e.host.as_ref().map_or(0, |h| h.rank),
                residency: self.residency(id),
                slot: e.slot,
                pinned: e.pinned,
                active: e.leases.load(Ordering::Acquire),
                queued: e.queued,
                last_used: e.last_used,
            })
            .collect();
        out.sort_by_key(|s| s.id);
        out
    }
}

/// Refuses an adapter read from its files that cannot be served as
/// registered: its own layers' vocabulary is not the `vocab` its requests
/// were admitted with (the files changed, or could not be read when it was
/// registered), or, under a shared memory budget, its slot and the layers
/// it packs beside it could never fit with one KV block.
pub(crate) fn check_fits(
    adapter: &HostAdapter,
    vocab: usize,
    model_vocab: usize,
    budget: Option<&MemoryBudget>,
) -> std::result::Result<(), AdapterError> {
    let rows = adapter
        .outer
        .saved
        .vocab()
        .unwrap_or(model_vocab)
        .max(model_vocab);
    if rows != vocab {
        return Err(AdapterError::Invalid {
            adapter: adapter.name.clone(),
            field: "modules_to_save".into(),
            reason: format!(
                "its saved layers have {rows} rows, but it was registered with a vocabulary of \
                 {vocab}: register it again"
            ),
        });
    }
    let extra = adapter.slot_extra_bytes();
    if let Some(b) = budget
        && b.slot_bytes() + extra + b.block_bytes() > b.bytes()
    {
        return Err(AdapterError::Invalid {
            adapter: adapter.name.clone(),
            field: "modules_to_save".into(),
            reason: format!(
                "its own lm_head takes {extra} bytes beside its slot of {}; the memory budget of \
                 {} bytes cannot hold both and one KV block",
                b.slot_bytes(),
                b.bytes()
            ),
        });
    }
    Ok(())
}
