//! Iteration-level scheduling: which sequences run in the next step, and how
//! many of their tokens.
//!
//! Each step:
//! 1. Running sequences go first, oldest first: a decode token each, or the
//!    next chunk of a prefill. When KV blocks run out, the newest running
//!    sequence is preempted (its blocks freed, to be recomputed later).
//! 2. If nothing was preempted, waiting requests are admitted while the
//!    token budget, the KV blocks and the adapter slots allow. The next one
//!    is taken from the least-served fairness key (with fair shares) or
//!    from the whole queue, and within that, **residency first**: the
//!    oldest request whose adapter already has a device slot (or that
//!    needs none), else the oldest. So on a GPU a step's admissions reuse
//!    the adapters that are resident instead of evicting the ones the next
//!    requests need (S-LoRA's observation: with more adapters than slots,
//!    arrival order turns every request into a device load).
//! 3. A request whose adapter is still loading from disk, or cannot get a
//!    slot, is skipped rather than blocking the queue; so is one whose
//!    slot's copy to the device is still in flight while the step is at
//!    least half full (the copy overlaps this step and the request joins
//!    the next), which makes each slot write a prefetch instead of a
//!    stall. A step under half full waits for the copy instead.
//! 4. Anti-starvation: a waiting request is *overtaken* in a step when a
//!    younger request of its own key is admitted before it (the residency
//!    order), or when it was passed over for want of a slot and anyone
//!    behind it got in. Once a request has been overtaken in
//!    [`STARVATION_STEPS`] steps, only it may be admitted until it is:
//!    running sequences finish, their leases end, and a slot frees up for
//!    it. So no request waits more than [`STARVATION_STEPS`] overtaking
//!    steps plus the time for a slot to free, whatever the residency order
//!    prefers. Waiting for the disk is not counted; neither is being
//!    behind another key under fair shares, which has its own bound.
//! 5. Prefetch: after admission, free device slots take the adapters the
//!    waiting requests need, in queue order, so their copies overlap this
//!    step and the requests are resident when admitted. Only free slots are
//!    used: a guess never evicts a resident adapter; at most
//!    [`PREFETCH_PER_STEP`] copies start per step.
//! 6. Under a shared memory budget ([`crate::budget`]): an adapter that
//!    needs a slot the budget has no room for first drops idle prefix-cache
//!    blocks; a sequence that needs KV blocks first recycles idle cached
//!    blocks, then empties adapter slots no sequence leases (least valued
//!    first), and only then preempts. When even the oldest running
//!    sequence would have to preempt itself, or nothing runs and the
//!    oldest waiting request cannot be admitted, the leases of preempted
//!    (waiting) sequences are given back so their slots can go to KV; they
//!    take new ones when admitted again.

use std::collections::{HashMap, VecDeque};

use crate::backend::Backend;
use crate::budget::MemoryBudget;
use crate::error::Result;
use crate::kv::BlockAllocator;
use crate::pool::{AdapterPool, Residency};
use crate::sequence::Sequence;

/// Steps the oldest waiting request may be passed over before the queue
/// behind it stops taking new slots.
pub const STARVATION_STEPS: u32 = 16;

/// The most slot copies one step starts ahead of admission.
pub const PREFETCH_PER_STEP: usize = 2;

/// Internal sequence handle.
pub(crate) type SeqId = u64;

/// The scheduling limits.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    pub max_loras: usize,
}

/// One step's plan: (sequence, tokens to feed), plus whether a preemption
/// happened.
#[derive(Debug, Default)]
pub(crate) struct Plan {
    pub scheduled: Vec<(SeqId, usize)>,
    pub preempted: Vec<SeqId>,
}

#[derive(Debug, Default)]
pub(crate) struct Queues {
    pub waiting: VecDeque<SeqId>,
    pub running: Vec<SeqId>,
}

pub(crate) struct Scheduler<'a> {
    pub queues: &'a mut Queues,
    pub seqs: &'a mut HashMap<SeqId, Sequence>,
    pub pool: &'a mut AdapterPool,
    pub kv: &'a mut BlockAllocator,
    /// The sliding layers' ring blocks (`BackendShape::ring_len` a
    /// sequence), for a model with both kinds of layers.
    pub ring: &'a mut BlockAllocator,
    pub backend: &'a mut dyn Backend,
    pub limits: Limits,
    /// Fair shares between keys (tenants), or None for arrival order.
    pub fair: Option<&'a mut FairShares>,
    /// The byte budget the KV cache and the slots share, if any.
    pub budget: Option<&'a MemoryBudget>,
}

/// Each fairness key's service so far: the tokens its requests were fed
/// (prefill and decode), divided by the key's weight.
#[derive(Debug, Default)]
pub(crate) struct FairShares {
    served: HashMap<std::sync::Arc<str>, f64>,
}

impl FairShares {
    pub fn served(&self, key: &str) -> f64 {
        self.served.get(key).copied().unwrap_or(0.0)
    }

    /// Every key served so far, with its service.
    pub fn keys(&self) -> impl Iterator<Item = (&str, f64)> {
        self.served.iter().map(|(k, v)| (&**k, *v))
    }

    fn serve(&mut self, key: &std::sync::Arc<str>, amount: f64) {
        *self.served.entry(key.clone()).or_default() += amount;
    }

    /// A key that becomes active starts at the least service among the
    /// keys already active (`active`), so idle time is not banked: a
    /// tenant that was away does not come back owed the whole interval.
    pub fn activate<'k>(
        &mut self,
        key: &std::sync::Arc<str>,
        active: impl Iterator<Item = &'k str>,
    ) {
        let floor = active.map(|k| self.served(k)).fold(f64::INFINITY, f64::min);
        let entry = self.served.entry(key.clone()).or_default();
        if floor.is_finite() && *entry < floor {
            *entry = floor;
        }
    }
}

impl Scheduler<'_> {
    pub fn schedule(&mut self) -> Result<Plan> {
        let plan = self.plan()?;
        // Each scheduled sequence's ring covers the positions this step
        // reads and writes: up to `ring_len` blocks, reused as it moves.
        let ring_len = self.backend.shape().ring_len;
        if ring_len > 0 {
            let bs = self.ring.block_size();
            for &(id, chunk) in &plan.scheduled {
                let seq = self.seqs.get_mut(&id).expect("scheduled sequence exists");
                let target = (seq.num_computed + chunk).min(ring_len * bs);
                if !self.ring.grow(&mut seq.ring, target) {
                    return Err(crate::error::EngineError::Backend(format!(
                        "the sliding layers' rings are exhausted ({} blocks)",
                        self.ring.total()
                    )));
                }
            }
        }
        Ok(plan)
    }

    fn plan(&mut self) -> Result<Plan> {
        let mut plan = Plan::default();
        let mut budget = self.limits.max_batched_tokens;
        let mut busy_slots: Vec<usize> = Vec::new();

        // 1. Running sequences, oldest first.
        let mut i = 0;
        while i < self.queues.running.len() && budget > 0 {
            let id = self.queues.running[i];
            if self.seqs[&id].pending.is_some() {
                // Its token waits for its mask, from logits it has: no
                // forward pass this step.
                i += 1;
                continue;
            }
            self.switch_rope_if_past(id);
            self.release_behind_window(id);
            let seq = &self.seqs[&id];
            let scoring =
                seq.params.prompt_logprobs.is_some() && seq.prompt_scored < seq.prompt_ids.len();
            let mut chunk = (seq.total_len() - seq.num_computed).min(budget);
            if scoring {
                // Each scored position is a row of logits on the host.
                chunk = chunk.min(crate::logprobs::MAX_SCORED_POSITIONS_PER_STEP);
            }
            let target = seq.num_computed + chunk;
            let mut preempted_self = false;
            let (mut shed_tried, mut revoked) = (false, false);
            loop {
                let seq = self.seqs.get_mut(&id).expect("running sequence exists");
                if self.kv.grow(&mut seq.blocks, target) {
                    break;
                }
                let more = self.kv.blocks_for(target) - seq.blocks.len();
                if !shed_tried {
                    shed_tried = true;
                    if self.make_kv_room(more, &busy_slots)? {
                        continue;
                    }
                }
                let victim = *self.queues.running.last().expect("running is not empty");
                if victim == id && !revoked && self.budget.is_some() {
                    revoked = true;
                    if self.revoke_waiting_leases(None) {
                        shed_tried = false;
                        continue;
                    }
                }
                self.preempt(victim);
                plan.preempted.push(victim);
                if victim == id {
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                break;
            }
            if let Some(slot) = self.seqs[&id].adapter.and_then(|a| self.pool.slot_of(a)) {
                busy_slots.push(slot);
            }
            plan.scheduled.push((id, chunk));
            budget -= chunk;
            i += 1;
        }
        if !plan.preempted.is_empty() {
            return Ok(plan);
        }

        // 2. Waiting requests. Positions in the queue say who is younger.
        let position: HashMap<SeqId, usize> = self
            .queues
            .waiting
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i))
            .collect();
        let starving = self
            .queues
            .waiting
            .iter()
            .copied()
            .find(|id| self.seqs[id].skipped >= STARVATION_STEPS);
        // Requests passed over for want of a slot, with the admissions made
        // before them; those made after overtake them.
        let mut passed_over: Vec<(SeqId, usize)> = Vec::new();
        // Each admission's queue position and key.
        let mut admissions: Vec<(usize, std::sync::Arc<str>)> = Vec::new();
        let mut candidates: Vec<SeqId> = match starving {
            // Only the starving request may be admitted until it is.
            Some(id) => vec![id],
            None => self.queues.waiting.iter().copied().collect(),
        };
        let mut virtual_service: HashMap<std::sync::Arc<str>, f64> = HashMap::new();
        // Slots whose copy this step started (or found in flight) for a
        // request that joins a later step: no admission after it in this
        // step may evict them.
        let mut reserved: Vec<usize> = Vec::new();
        while !candidates.is_empty()
            && budget > 0
            && self.queues.running.len() < self.limits.max_num_seqs
        {
            let k = self.pick(&candidates, &virtual_service);
            let id = candidates.remove(k);
            let adapter = self.seqs[&id].adapter;
            let mut slot = None;
            if let Some(a) = adapter {
                let resident_slot = self.pool.slot_of(a);
                let new_distinct = resident_slot.is_none_or(|s| !busy_slots.contains(&s));
                let distinct_now = {
                    let mut s = busy_slots.clone();
                    s.sort_unstable();
                    s.dedup();
                    s.len()
                };
                if new_distinct && distinct_now >= self.limits.max_loras {
                    passed_over.push((id, admissions.len()));
                    continue;
                }
                if self.pool.residency(a) == Residency::NotLoaded {
                    // Evicted from the host tier while it waited: read it again.
                    self.pool.request_load(a);
                }
                let keep: Vec<usize> = busy_slots.iter().chain(&reserved).copied().collect();
                if self.pool.slot_of(a).is_none() && self.pool.host_adapter(a).is_some() {
                    self.make_slot_room(a, &keep);
                }
                slot = self.pool.ensure_device(a, &keep, self.backend)?;
                match slot {
                    None => {
                        // Waiting for the disk is not starvation; waiting for a slot is.
                        if self.pool.host_adapter(a).is_some() {
                            passed_over.push((id, admissions.len()));
                        }
                        continue;
                    }
                    // Its copy runs while this step does; it joins the next.
                    // A step under half full waits for it instead: a
                    // decode step costs about the same whatever its size,
                    // so a near-empty one would waste the wait it saves.
                    Some(s)
                        if 2 * plan.scheduled.len() >= self.limits.max_num_seqs
                            && !self.backend.slot_ready(s) =>
                    {
                        reserved.push(s);
                        continue;
                    }
                    Some(_) => {
                        // Ready now (or waited for within this step).
                        let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
                        seq.adapter_ready
                            .get_or_insert_with(std::time::Instant::now);
                    }
                }
            }
            self.switch_rope_if_past(id);
            let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
            // A request scoring its prompt computes every position of it.
            let scoring =
                seq.params.prompt_logprobs.is_some() && seq.prompt_scored < seq.prompt_ids.len();
            if seq.blocks.is_empty() && self.kv.caching() && !scoring {
                // Cached blocks of the same weights and prefix skip their
                // prefill. The last position is always computed: its logits
                // choose the next token.
                let bs = self.kv.block_size();
                let reusable = (seq.total_len() - 1) / bs;
                let hashes = seq.hashes_upto(reusable, bs).to_vec();
                let taken = self.kv.take_cached(&hashes, seq.total_len());
                seq.num_computed = taken.len() * bs;
                seq.registered = taken.len();
                if seq.preemptions == 0 {
                    seq.cached_tokens = seq.num_computed.min(seq.prompt_ids.len());
                }
                seq.blocks = taken;
            }
            // A prefix found cached may reach past the window already.
            self.release_behind_window(id);
            let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
            let mut chunk = (seq.total_len() - seq.num_computed).min(budget);
            if scoring {
                // Each scored position is a row of logits on the host.
                chunk = chunk.min(crate::logprobs::MAX_SCORED_POSITIONS_PER_STEP);
            }
            let target = seq.num_computed + chunk;
            if !self.kv.grow(&mut seq.blocks, target)
                && !self.admit_with_room(id, target, slot, &busy_slots, &reserved)?
            {
                // The KV cache is full: nobody behind can be admitted either.
                let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
                self.kv.release(&mut seq.blocks);
                self.ring.release(&mut seq.ring);
                seq.num_computed = 0;
                seq.registered = 0;
                break;
            }
            let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
            if seq.first_scheduled.is_none() {
                seq.first_scheduled = Some(std::time::Instant::now());
            }
            seq.skipped = 0;
            if let Some(a) = adapter {
                seq.lease = Some(self.pool.lease(a));
                self.pool.on_dequeue(a);
            }
            if let Some(s) = slot {
                busy_slots.push(s);
            }
            let seq = &self.seqs[&id];
            let served = chunk as f64 / seq.fair_weight;
            let key = seq.fair_key.clone();
            if let Some(fair) = &self.fair {
                let now = virtual_service
                    .get(&key)
                    .copied()
                    .unwrap_or_else(|| fair.served(&key));
                virtual_service.insert(key.clone(), now + served);
            }
            admissions.push((position[&id], key));
            self.queues.waiting.retain(|&w| w != id);
            self.queues.running.push(id);
            plan.scheduled.push((id, chunk));
            budget -= chunk;
        }
        // Every token this step feeds counts as service to its key.
        if let Some(fair) = self.fair.as_deref_mut() {
            for &(id, chunk) in &plan.scheduled {
                let seq = &self.seqs[&id];
                fair.serve(&seq.fair_key, chunk as f64 / seq.fair_weight);
            }
        }
        self.count_overtakes(&position, &admissions, &passed_over);
        self.prefetch()?;
        Ok(plan)
    }

    /// Under a shared budget, gives a waiting request's KV blocks the room
    /// that adapter slots nobody leases hold (not `slot`, the request's
    /// own, nor the step's), and, when nothing runs, the slots that
    /// preempted sequences lease; then grows its table to `target`
    /// positions. True when it grew.
    fn admit_with_room(
        &mut self,
        id: SeqId,
        target: usize,
        slot: Option<usize>,
        busy: &[usize],
        reserved: &[usize],
    ) -> Result<bool> {
        if self.budget.is_none() {
            return Ok(false);
        }
        let keep: Vec<usize> = busy.iter().chain(reserved).chain(&slot).copied().collect();
        for last_resort in [false, true] {
            if last_resort
                && !(self.queues.running.is_empty() && self.revoke_waiting_leases(Some(id)))
            {
                return Ok(false);
            }
            let more = {
                let seq = &self.seqs[&id];
                self.kv.blocks_for(target).saturating_sub(seq.blocks.len())
            };
            if self.make_kv_room(more, &keep)? {
                let seq = self.seqs.get_mut(&id).expect("waiting sequence exists");
                if self.kv.grow(&mut seq.blocks, target) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Under a shared budget, empties adapter slots that no sequence
    /// leases (none pinned nor in `keep`) until `blocks` more KV blocks
    /// fit. Empties nothing when that would not be enough. True when the
    /// blocks fit now.
    fn make_kv_room(&mut self, blocks: usize, keep: &[usize]) -> Result<bool> {
        let Some(budget) = self.budget else {
            return Ok(false);
        };
        // Idle cached blocks are recycled before fresh ones are needed.
        let fresh = blocks.saturating_sub(self.kv.idle_blocks());
        if fresh > self.kv.unused_blocks() {
            return Ok(false);
        }
        // The bytes the slots must give back: each gives its own (a slot,
        // and what its adapter packs beside it).
        let bytes = (fresh as u64 * budget.block_bytes()).saturating_sub(budget.split().free());
        if bytes > self.pool.sheddable_bytes(keep) {
            return Ok(false);
        }
        if bytes > 0 {
            self.pool.shed_bytes(bytes, keep, self.backend)?;
        }
        Ok(true)
    }

    /// Under a shared budget, drops idle prefix-cache blocks when adapter
    /// `a` could take an empty slot but for the budget's room; or, for an
    /// adapter that packs layers of its own beside its slot (an lm_head),
    /// as many as it still lacks after every slot that could give way (none
    /// in `keep`), so an idle cache never keeps it out for good.
    fn make_slot_room(&mut self, a: crate::pool::AdapterId, keep: &[usize]) {
        let Some(budget) = self.budget else { return };
        let extra = self.pool.slot_extra_of(a);
        if self.pool.slot_waits_for_budget(extra) {
            let short = budget.blocks_short_of_a_slot(extra);
            if short <= self.kv.idle_blocks() {
                self.kv.shed_idle(short);
                return;
            }
        }
        if extra > 0
            && let Some(lacking) = self.pool.bytes_lacking(a, keep)
        {
            let short = lacking.div_ceil(budget.block_bytes()) as usize;
            if short > 0 && short <= self.kv.idle_blocks() {
                self.kv.shed_idle(short);
            }
        }
    }

    /// Gives back the leases of waiting (preempted) sequences, except
    /// `except`'s: they hold no KV, and their slots' bytes are needed for
    /// the KV of a sequence that runs. True when any was given back.
    fn revoke_waiting_leases(&mut self, except: Option<SeqId>) -> bool {
        let mut any = false;
        for id in &self.queues.waiting {
            if Some(*id) == except {
                continue;
            }
            let seq = self.seqs.get_mut(id).expect("waiting sequence exists");
            any |= seq.lease.take().is_some();
        }
        any
    }

    /// Free device slots take the adapters the waiting requests need, in
    /// queue order, so their copies run while this step computes and the
    /// requests find them resident when admitted (SGLang's overlap
    /// loading). Only free slots: nothing resident is evicted for a guess.
    ///
    /// At most [`PREFETCH_PER_STEP`] copies start per step: the CUDA
    /// backend stages slot copies through two page-locked buffers, and a
    /// third write in one step would wait on the engine thread for the
    /// first copy to end.
    fn prefetch(&mut self) -> Result<()> {
        let mut started = 0;
        for &id in &self.queues.waiting {
            if started == PREFETCH_PER_STEP || self.pool.free_slots() == 0 {
                break;
            }
            if let Some(a) = self.seqs[&id].adapter
                && self.pool.prefetch_device(a, self.backend)?
            {
                started += 1;
            }
        }
        // What is still wanted and could have been started: a load of it at
        // the next admission is late (counted).
        let wanted: Vec<_> = self
            .queues
            .waiting
            .iter()
            .filter_map(|id| self.seqs[id].adapter)
            .collect();
        self.pool.mark_prefetchable(&wanted);
        Ok(())
    }

    /// The candidate to try next: among the least-served keys' requests
    /// (all of them without fair shares), the oldest whose adapter has a
    /// device slot or that needs none, else the oldest.
    fn pick(
        &self,
        candidates: &[SeqId],
        virtual_service: &HashMap<std::sync::Arc<str>, f64>,
    ) -> usize {
        let eligible: Vec<usize> = match &self.fair {
            Some(fair) => {
                let service = |id: &SeqId| {
                    let key = &self.seqs[id].fair_key;
                    virtual_service
                        .get(key)
                        .copied()
                        .unwrap_or_else(|| fair.served(key))
                };
                let least = candidates.iter().map(service).fold(f64::INFINITY, f64::min);
                (0..candidates.len())
                    .filter(|&i| service(&candidates[i]) <= least)
                    .collect()
            }
            None => (0..candidates.len()).collect(),
        };
        let resident = |i: &usize| {
            self.seqs[&candidates[*i]]
                .adapter
                .is_none_or(|a| self.pool.slot_of(a).is_some())
        };
        eligible
            .iter()
            .copied()
            .find(resident)
            .unwrap_or(eligible[0])
    }

    /// Ages the requests still waiting that this step overtook (see the
    /// module's rule 4).
    fn count_overtakes(
        &mut self,
        position: &HashMap<SeqId, usize>,
        admissions: &[(usize, std::sync::Arc<str>)],
        passed_over: &[(SeqId, usize)],
    ) {
        if admissions.is_empty() {
            return;
        }
        for &id in &self.queues.waiting {
            let seq = &self.seqs[&id];
            let waits_for_disk = seq.adapter.is_some_and(|a| {
                matches!(
                    self.pool.residency(a),
                    Residency::Loading | Residency::NotLoaded
                )
            });
            if waits_for_disk {
                continue;
            }
            let at = position[&id];
            let by_own_key = admissions
                .iter()
                .any(|(p, key)| *p > at && *key == seq.fair_key);
            let for_a_slot = passed_over
                .iter()
                .any(|&(p, before)| p == id && admissions.len() > before);
            if by_own_key || for_a_slot {
                self.seqs
                    .get_mut(&id)
                    .expect("waiting sequence exists")
                    .skipped += 1;
            }
        }
    }

    /// Frees a running sequence's KV and puts it at the head of the waiting
    /// queue, to be recomputed from its tokens. It keeps its lease: a live
    /// sequence's adapter is never evicted, so it resumes without a load.
    /// A sequence grown past LongRoPE's pretraining context rotates by the
    /// long frequencies from then on, every position recomputed so (as
    /// transformers' Phi-3 recomputes its cache): its blocks are released
    /// (they stay cached for sequences still within the context).
    fn switch_rope_if_past(&mut self, id: SeqId) {
        let long_after = self.backend.config().rope.long_after();
        let seq = self.seqs.get_mut(&id).expect("sequence exists");
        if seq.switch_to_long_rope(long_after) {
            self.kv.release(&mut seq.blocks);
            self.ring.release(&mut seq.ring);
            seq.num_computed = 0;
            seq.registered = 0;
        }
    }

    /// Under a window every layer slides by, the blocks wholly behind
    /// the window of the sequence's next position go back: that token
    /// reads from `num_computed + 1 - window` on, and every later one from
    /// further on. (Their cache entries stay, for sequences that share the
    /// prefix.)
    fn release_behind_window(&mut self, id: SeqId) {
        let Some(window) = self.backend.config().uniform_window() else {
            return;
        };
        let bs = self.kv.block_size();
        let seq = self.seqs.get_mut(&id).expect("sequence exists");
        let behind = (seq.num_computed + 1).saturating_sub(window) / bs;
        self.kv.release_behind(&mut seq.blocks, behind);
    }

    fn preempt(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("preempted sequence exists");
        // Recomputed from its tokens: the logits it kept are computed again.
        seq.pending = None;
        self.kv.release(&mut seq.blocks);
        self.ring.release(&mut seq.ring);
        seq.num_computed = 0;
        seq.registered = 0;
        seq.preemptions += 1;
        if let Some(lease) = &seq.lease {
            self.pool.on_requeue(lease.adapter());
        }
        self.queues.running.retain(|&r| r != id);
        self.queues.waiting.push_front(id);
    }
}
