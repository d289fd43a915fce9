//! The device tier of the adapter pool: filling slots (evicting the one
//! the policy values least), prefetching into free ones, and, under a
//! shared memory budget, filling only within its room and emptying slots
//! no sequence leases to give their bytes to the KV cache.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::{AdapterId, AdapterPool, MAX_UPLOAD_TIMES};
use crate::backend::Backend;
use crate::budget::MemoryBudget;
use crate::error::Result;
use crate::eviction::victim_key;

impl AdapterPool {
    /// Counts this pool's filled slots against `budget`, shared with the
    /// KV cache.
    pub fn set_budget(&mut self, budget: Arc<MemoryBudget>) {
        self.budget = Some(budget);
        self.report();
    }

    /// Tells the budget how many slots hold an adapter, and what those
    /// adapters hold beyond their slots.
    pub(super) fn report(&self) {
        if let Some(b) = &self.budget {
            let filled = self.slots.iter().filter(|s| s.is_some()).count();
            b.set_slots(filled, self.slot_extra.iter().sum());
        }
    }

    /// Whether the budget (if any) has room for one more filled slot whose
    /// adapter holds `extra` bytes beyond it.
    fn room_for_a_slot(&self, extra: u64) -> bool {
        self.budget.as_ref().is_none_or(|b| b.room_for(extra))
    }

    /// What `id`'s adapter would hold beyond a slot (see
    /// [`crate::lora::HostAdapter::slot_extra_bytes`]); 0 when it is not in
    /// the host tier.
    pub fn slot_extra_of(&self, id: AdapterId) -> u64 {
        self.entries
            .get(&id)
            .and_then(|e| e.host.as_ref())
            .map_or(0, |h| h.slot_extra_bytes())
    }

    /// Slots that may be emptied now: filled, not pinned, not leased, not
    /// in `keep`; by the eviction policy, least valued first.
    fn evictable(&self, keep: &[usize]) -> Vec<(usize, AdapterId)> {
        let mut out: Vec<(usize, AdapterId)> = self
            .slots
            .iter()
            .enumerate()
            .filter(|(slot, _)| !keep.contains(slot))
            .filter_map(|(slot, holder)| holder.map(|h| (slot, h)))
            .filter(|(_, h)| {
                let e = &self.entries[h];
                !e.pinned && e.leases.load(Ordering::Acquire) == 0
            })
            .collect();
        // An adapter that requests wait for goes last: evicting it would
        // only load it again. It still can go, or a flooded adapter could
        // starve every other one. Then the policy: by value or by recency.
        out.sort_by_key(|(_, h)| {
            let e = &self.entries[h];
            let rate = e.rate.at(self.arrivals);
            (
                victim_key(self.eviction, e.queued > 0, rate, e.last_used),
                *h,
            )
        });
        out
    }

    /// Budget bytes a filled slot gives back when emptied: the slot and
    /// what its adapter packs beside it.
    fn held_by(&self, slot: usize) -> u64 {
        self.budget.as_ref().map_or(0, |b| b.slot_bytes()) + self.slot_extra[slot]
    }

    /// Bytes the slots [`AdapterPool::shed_bytes`] could empty now give back.
    pub fn sheddable_bytes(&self, keep: &[usize]) -> u64 {
        self.evictable(keep)
            .iter()
            .map(|&(slot, _)| self.held_by(slot))
            .sum()
    }

    /// Empties slots no sequence leases (none pinned nor in `keep`), least
    /// valued first, until they give back at least `bytes` of the budget,
    /// so their bytes go to the KV cache (the adapters stay in the host
    /// tier). Returns the bytes given back.
    pub fn shed_bytes(
        &mut self,
        bytes: u64,
        keep: &[usize],
        backend: &mut dyn Backend,
    ) -> Result<u64> {
        let mut freed = 0;
        for (slot, holder) in self.evictable(keep) {
            if freed >= bytes {
                break;
            }
            freed += self.held_by(slot);
            backend.clear_slot(slot)?;
            self.vacate(slot, holder);
            self.generation += 1;
        }
        self.report();
        Ok(freed)
    }

    /// Under a budget, the bytes `id`'s adapter still lacks for a slot
    /// after the free bytes and every slot that could give way (none in
    /// `keep`); None when no slot could be had at all, whatever the bytes.
    pub fn bytes_lacking(&self, id: AdapterId, keep: &[usize]) -> Option<u64> {
        let b = self.budget.as_ref()?;
        let victims = self.evictable(keep);
        if victims.is_empty() && !self.slots.iter().any(Option::is_none) {
            return None;
        }
        let have = b.split().free()
            + victims
                .iter()
                .map(|&(slot, _)| self.held_by(slot))
                .sum::<u64>();
        Some((b.slot_bytes() + self.slot_extra_of(id)).saturating_sub(have))
    }

    /// Takes `holder`'s adapter out of `slot` (an eviction).
    fn vacate(&mut self, slot: usize, holder: AdapterId) {
        let e = self
            .entries
            .get_mut(&holder)
            .expect("slot holder is registered");
        e.slot = None;
        e.prefetched = false;
        self.slots[slot] = None;
        self.slot_extra[slot] = 0;
        self.counters.device_evictions += 1;
    }

    /// Puts an adapter in a device slot, evicting the slot the policy
    /// values least (see [`crate::eviction`]) that is neither leased,
    /// pinned nor in `busy` (slots the current step already uses). Returns
    /// None when no slot can be had now.
    pub fn ensure_device(
        &mut self,
        id: AdapterId,
        busy: &[usize],
        backend: &mut dyn Backend,
    ) -> Result<Option<usize>> {
        let Some(entry) = self.entries.get(&id) else {
            return Ok(None);
        };
        if let Some(slot) = entry.slot {
            return Ok(Some(slot));
        }
        let Some(host) = entry.host.clone() else {
            return Ok(None);
        };
        let extra = host.slot_extra_bytes();
        let free = self
            .slots
            .iter()
            .position(Option::is_none)
            .filter(|_| self.room_for_a_slot(extra));
        let slot = match free {
            Some(free) => free,
            None => {
                let victims = self.evictable(busy);
                let Some(&(slot, holder)) = victims.first() else {
                    return Ok(None);
                };
                // Under a budget, an adapter with layers of its own may need
                // more than one slot's bytes: the victims after the first
                // are emptied too, least valued first, until it fits; if all
                // of them would not make room, none is.
                let mut more = Vec::new();
                if let Some(b) = &self.budget {
                    let mut free = b.split().free() + self.held_by(slot);
                    let need = b.slot_bytes() + extra;
                    for &(s, h) in &victims[1..] {
                        if free >= need {
                            break;
                        }
                        free += self.held_by(s);
                        more.push((s, h));
                    }
                    if free < need {
                        return Ok(None);
                    }
                }
                for (s, h) in more {
                    if let Err(e) = backend.clear_slot(s) {
                        self.report();
                        return Err(e);
                    }
                    self.vacate(s, h);
                }
                self.vacate(slot, holder);
                slot
            }
        };
        let started = std::time::Instant::now();
        if let Err(e) = backend.write_slot(slot, &host) {
            // The slots emptied for it stay empty: the budget hears so.
            self.report();
            return Err(e);
        }
        let took = started.elapsed();
        if self.upload_times.len() < MAX_UPLOAD_TIMES {
            self.upload_times.push(took);
        }
        self.load_charges.push((id, took));
        self.slots[slot] = Some(id);
        self.slot_extra[slot] = extra;
        let now = self.tick();
        let e = self.entries.get_mut(&id).expect("checked above");
        if std::mem::take(&mut e.prefetchable) {
            self.counters.late_loads += 1;
        }
        e.slot = Some(slot);
        e.last_used = now;
        self.counters.device_loads += 1;
        self.generation += 1;
        self.report();
        self.evict_host_over_capacity();
        Ok(Some(slot))
    }

    /// Device slots that hold no adapter (under a budget, as many as it
    /// has room to fill).
    pub fn free_slots(&self) -> usize {
        let empty = self.slots.iter().filter(|s| s.is_none()).count();
        match &self.budget {
            Some(b) => empty.min(b.slot_room()),
            None => empty,
        }
    }

    /// Whether an adapter holding `extra` bytes beyond a slot could take an
    /// empty slot but for the budget's room: then dropping idle KV blocks
    /// would let it in.
    pub fn slot_waits_for_budget(&self, extra: u64) -> bool {
        self.slots.iter().any(Option::is_none) && !self.room_for_a_slot(extra)
    }

    /// Starts copying an adapter a waiting request needs into a free slot,
    /// so the copy runs before its admission; never evicts. True when a
    /// copy started.
    pub fn prefetch_device(&mut self, id: AdapterId, backend: &mut dyn Backend) -> Result<bool> {
        let ready = self
            .entries
            .get(&id)
            .is_some_and(|e| e.slot.is_none() && e.host.is_some() && !e.unload_pending);
        if !ready || self.free_slots() == 0 {
            return Ok(false);
        }
        let every_slot: Vec<usize> = (0..self.slots.len()).collect();
        if self.ensure_device(id, &every_slot, backend)?.is_none() {
            return Ok(false);
        }
        self.entries.get_mut(&id).expect("checked above").prefetched = true;
        self.counters.prefetches += 1;
        Ok(true)
    }

    /// Marks, after a step's prefetches, the wanted adapters (in queue
    /// order) a prefetch could still have started: in the host tier, not
    /// on the device, one per free slot. A later load of one at admission
    /// counts as late.
    pub fn mark_prefetchable(&mut self, wanted: &[AdapterId]) {
        for e in self.entries.values_mut() {
            e.prefetchable = false;
        }
        let mut free = self.free_slots();
        for id in wanted {
            if free == 0 {
                break;
            }
            if let Some(e) = self.entries.get_mut(id)
                && e.slot.is_none()
                && e.host.is_some()
                && !e.unload_pending
                && !e.prefetchable
            {
                e.prefetchable = true;
                free -= 1;
            }
        }
    }
}
