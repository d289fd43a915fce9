//! One memory budget for the KV cache and the adapter slots (S-LoRA's
//! unified paging, by bytes).
//!
//! Without a budget the KV cache has `kv_blocks` blocks and the device
//! tier `max_loras` slots, each fixed at start. With one
//! (`--memory-budget-bytes`), both come out of the same bytes: a KV block
//! with contents (held by a sequence, or idle in the prefix cache) costs
//! [`MemoryBudget::block_bytes`], a slot holding an adapter
//! [`MemoryBudget::slot_bytes`] and what that adapter packs beside it (an
//! lm_head of its own: [`crate::lora::HostAdapter::slot_extra_bytes`]), and
//! the two together never pass the budget. Free bytes go to whichever side asks first, and each side can
//! take back what the other does not use:
//!
//! - an adapter that needs a slot may drop idle prefix-cache blocks (never
//!   a block a sequence holds);
//! - a sequence that needs KV may evict adapters that no sequence leases
//!   and that are not pinned (never the adapter of a live sequence).
//!
//! So a fleet with few adapters gets most of the budget as KV, and one
//! with many gets more resident adapters, without a restart. The
//! [`crate::kv::BlockAllocator`] and the [`crate::pool::AdapterPool`] each
//! report their side here after every change; the scheduler decides when
//! one side gives way to the other.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// The shared byte budget and what each side holds of it.
#[derive(Debug)]
pub struct MemoryBudget {
    bytes: u64,
    block_bytes: u64,
    slot_bytes: u64,
    /// KV blocks with contents: held by sequences or idle in the cache.
    kv_blocks: AtomicUsize,
    /// Device slots holding an adapter.
    slots: AtomicUsize,
    /// What the filled slots' adapters hold beyond a slot: layers of their
    /// own packed beside it (an lm_head saved whole), in bytes.
    extra: AtomicU64,
    /// The most of each there has been (the adapters' in bytes).
    peak_kv_blocks: AtomicUsize,
    peak_adapters: AtomicU64,
}

/// How the budget is divided at one moment, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySplit {
    pub budget: u64,
    /// KV blocks with contents.
    pub kv: u64,
    /// Device slots holding adapters.
    pub adapters: u64,
    /// The most bytes of KV blocks, and of filled slots, there have been
    /// (each at its own moment).
    pub peak_kv: u64,
    pub peak_adapters: u64,
}

impl MemorySplit {
    pub fn free(&self) -> u64 {
        self.budget.saturating_sub(self.kv + self.adapters)
    }
}

/// The sizes a backend's KV blocks and adapter slots take, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryUnits {
    /// One KV block: keys and values of `block_size` positions, every layer.
    pub block_bytes: u64,
    /// One adapter slot, sized for `max_lora_rank` on every module.
    pub slot_bytes: u64,
}

impl MemoryBudget {
    /// A budget of `bytes`, refused (by the setting's name) when it cannot
    /// hold one slot and one block.
    pub fn new(bytes: u64, units: MemoryUnits) -> crate::error::Result<MemoryBudget> {
        let least = units.slot_bytes + units.block_bytes;
        if bytes < least {
            return Err(crate::error::EngineError::setting(
                "memory_budget_bytes",
                format!(
                    "{bytes} cannot hold one adapter slot ({} bytes) and one KV block ({} bytes): at least {least}",
                    units.slot_bytes, units.block_bytes
                ),
            ));
        }
        Ok(MemoryBudget {
            bytes,
            block_bytes: units.block_bytes.max(1),
            slot_bytes: units.slot_bytes.max(1),
            kv_blocks: AtomicUsize::new(0),
            slots: AtomicUsize::new(0),
            extra: AtomicU64::new(0),
            peak_kv_blocks: AtomicUsize::new(0),
            peak_adapters: AtomicU64::new(0),
        })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// The most KV blocks there can be: the budget less one adapter slot,
    /// so a sequence that fits alone always has its adapter too.
    pub fn max_kv_blocks(&self) -> usize {
        ((self.bytes - self.slot_bytes) / self.block_bytes) as usize
    }

    /// The most slots that fit with `kv_blocks` blocks held.
    pub fn slots_beside(&self, kv_blocks: usize) -> usize {
        (self
            .bytes
            .saturating_sub(kv_blocks as u64 * self.block_bytes)
            / self.slot_bytes) as usize
    }

    pub fn split(&self) -> MemorySplit {
        MemorySplit {
            budget: self.bytes,
            kv: self.kv_blocks.load(Ordering::Relaxed) as u64 * self.block_bytes,
            adapters: self.slots.load(Ordering::Relaxed) as u64 * self.slot_bytes
                + self.extra.load(Ordering::Relaxed),
            peak_kv: self.peak_kv_blocks.load(Ordering::Relaxed) as u64 * self.block_bytes,
            peak_adapters: self.peak_adapters.load(Ordering::Relaxed),
        }
    }

    fn free_bytes(&self) -> u64 {
        self.split().free()
    }

    /// KV blocks that fit in the free bytes now.
    pub fn kv_room(&self) -> usize {
        (self.free_bytes() / self.block_bytes) as usize
    }

    /// Adapter slots that fit in the free bytes now.
    pub fn slot_room(&self) -> usize {
        (self.free_bytes() / self.slot_bytes) as usize
    }

    /// Whether one more filled slot fits, its adapter holding `extra`
    /// bytes beyond it.
    pub fn room_for(&self, extra: u64) -> bool {
        self.free_bytes() >= self.slot_bytes + extra
    }

    /// KV blocks that must be dropped for one more slot to fit, its
    /// adapter holding `extra` bytes beyond it.
    pub fn blocks_short_of_a_slot(&self, extra: u64) -> usize {
        (self.slot_bytes + extra)
            .saturating_sub(self.free_bytes())
            .div_ceil(self.block_bytes) as usize
    }

    /// Slots that must be emptied for `blocks` more KV blocks to fit.
    pub fn slots_short_of(&self, blocks: usize) -> usize {
        (blocks as u64 * self.block_bytes)
            .saturating_sub(self.free_bytes())
            .div_ceil(self.slot_bytes) as usize
    }

    pub(crate) fn set_kv_blocks(&self, blocks: usize) {
        self.kv_blocks.store(blocks, Ordering::Relaxed);
        self.peak_kv_blocks.fetch_max(blocks, Ordering::Relaxed);
    }

    /// The filled slots, and what their adapters hold beyond them.
    pub(crate) fn set_slots(&self, slots: usize, extra: u64) {
        self.slots.store(slots, Ordering::Relaxed);
        self.extra.store(extra, Ordering::Relaxed);
        self.peak_adapters
            .fetch_max(slots as u64 * self.slot_bytes + extra, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(bytes: u64) -> MemoryBudget {
        MemoryBudget::new(
            bytes,
            MemoryUnits {
                block_bytes: 10,
                slot_bytes: 35,
            },
        )
        .unwrap()
    }

    #[test]
    fn both_sides_draw_from_one_budget() {
        let b = budget(100);
        assert_eq!((b.kv_room(), b.slot_room()), (10, 2));
        assert_eq!(b.max_kv_blocks(), 6, "one slot is always left room");
        b.set_slots(1, 0);
        assert_eq!((b.kv_room(), b.slot_room()), (6, 1));
        b.set_kv_blocks(4);
        assert_eq!(b.split().free(), 25);
        assert_eq!((b.kv_room(), b.slot_room()), (2, 0));
        assert_eq!(
            b.blocks_short_of_a_slot(0),
            1,
            "35 - 25 = 10 bytes: one block"
        );
        assert_eq!(
            b.blocks_short_of_a_slot(12),
            3,
            "35 + 12 - 25 = 22 bytes: three blocks"
        );
        assert_eq!(b.slots_short_of(2), 0);
        assert_eq!(b.slots_short_of(3), 1);
        assert_eq!(b.slots_beside(4), 1);
        b.set_kv_blocks(1);
        let m = b.split();
        assert_eq!((m.kv, m.peak_kv, m.peak_adapters), (10, 40, 35));
    }

    #[test]
    fn an_adapter_s_own_layers_count_beside_its_slot() {
        let b = budget(100);
        // A slot whose adapter packs 20 bytes of its own lm_head beside it.
        b.set_slots(1, 20);
        let m = b.split();
        assert_eq!((m.adapters, m.free(), m.peak_adapters), (55, 45, 55));
        assert!(b.room_for(10) && !b.room_for(11), "45 free: 35 + 10 fit");
        assert_eq!(b.kv_room(), 4);
        b.set_kv_blocks(2);
        assert!(!b.room_for(0), "25 free cannot hold a plain slot");
        b.set_slots(0, 0);
        assert_eq!(b.split().peak_adapters, 55);
    }

    #[test]
    fn a_budget_too_small_for_a_slot_and_a_block_is_refused_by_name() {
        let err = MemoryBudget::new(
            44,
            MemoryUnits {
                block_bytes: 10,
                slot_bytes: 35,
            },
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("memory_budget_bytes"), "{text}");
        assert!(text.contains("at least 45"), "{text}");
    }
}
