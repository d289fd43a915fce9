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

    /// Tells the budget how many slots hold an adapter.
    pub(super) fn report(&self) {
        if let Some(b) = &self.budget {
            b.set_slots(self.slots.iter().filter(|s| s.is_some()).count());
        }
    }

    /// Whether the budget (if any) has room for one more filled slot.
    fn room_for_a_slot(&self) -> bool {
        self.budget.as_ref().is_none_or(|b| b.slot_room() > 0)
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

    /// Filled slots that [`AdapterPool::shed_slots`] could empty now.
    pub fn sheddable_slots(&self, keep: &[usize]) -> usize {
        self.evictable(keep).len()
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
        self.counters.device_evictions += 1;
    }

    /// Empties up to `count` slots that no sequence leases, none pinned
    /// nor in `keep`, least valued first, so their bytes go to the KV
    /// cache. The adapters stay in the host tier. Returns how many.
    pub fn shed_slots(
        &mut self,
        count: usize,
        keep: &[usize],
        backend: &mut dyn Backend,
    ) -> Result<usize> {
        let victims: Vec<(usize, AdapterId)> =
            self.evictable(keep).into_iter().take(count).collect();
        for &(slot, holder) in &victims {
            backend.clear_slot(slot)?;
            self.vacate(slot, holder);
            self.generation += 1;
        }
        self.report();
        Ok(victims.len())
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
        let free = self
            .slots
            .iter()
            .position(Option::is_none)
            .filter(|_| self.room_for_a_slot());
        let slot = match free {
            Some(free) => free,
            None => {
                let Some(&(slot, holder)) = self.evictable(busy).first() else {
                    return Ok(None);
                };
                self.vacate(slot, holder);
                slot
            }
        };
        let started = std::time::Instant::now();
        backend.write_slot(slot, &host)?;
        let took = started.elapsed();
        if self.upload_times.len() < MAX_UPLOAD_TIMES {
            self.upload_times.push(took);
        }
        self.load_charges.push((id, took));
        self.slots[slot] = Some(id);
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

    /// Whether an adapter could take an empty slot but for the budget's
    /// room: then dropping idle KV blocks would let it in.
    pub fn slot_waits_for_budget(&self) -> bool {
        self.slots.iter().any(Option::is_none) && !self.room_for_a_slot()
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
