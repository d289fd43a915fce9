//! The paged KV cache's bookkeeping: fixed-size blocks handed out from a
//! free list, with a prefix cache. The backend holds the memory; this
//! allocator decides who owns which block.
//!
//! Prefix caching: a full block whose keys and values are computed is
//! registered under a [`BlockHash`], chained over every token up to the
//! block's end and seeded with the identity of the weights that produced
//! them (the adapter's artifact digest, or the base hash): never a name or
//! an id alone, so an adapter reloaded under the same name with other
//! weights never meets its old blocks. A sequence whose first blocks hash
//! the same takes those blocks (counted references) and skips their
//! prefill. A released block keeps its contents and its registration while
//! no one holds it, and is reused (least recently released first) only
//! when the free list is empty.
//!
//! Under a shared [`MemoryBudget`] a block with contents (held, or idle in
//! the cache) counts against the budget; a fresh block is handed out only
//! while the budget has room, and idle cached blocks can be dropped to give
//! their bytes to an adapter slot ([`BlockAllocator::shed_idle`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::budget::MemoryBudget;

use sha2::{Digest, Sha256};

/// A block's content key: SHA-256 over its parent's key (or the weights'
/// identity for the first block) and its token ids.
pub type BlockHash = [u8; 32];

/// The identity of the weights a sequence's KV comes from.
pub fn weights_seed(identity: &str) -> BlockHash {
    let mut h = Sha256::new();
    h.update(b"lorafleet-kv-v1\0");
    h.update(identity.as_bytes());
    h.finalize().into()
}

/// The key of a block holding `tokens` after the block keyed `parent`.
pub fn chain(parent: &BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// Cumulative prefix-cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCounters {
    /// Positions looked up at admission.
    pub queried_tokens: u64,
    /// Of those, positions found cached (their prefill skipped).
    pub hit_tokens: u64,
}

/// A block table's entry for a block given back while the sequence runs
/// on: behind a uniform sliding window, no layer reads it again
/// ([`BlockAllocator::release_behind`]). The backends never read it.
pub const RELEASED: u32 = u32::MAX;

/// Hands out KV block ids, and keeps computed blocks for reuse.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    /// Blocks with nothing worth keeping.
    free: Vec<u32>,
    total: usize,
    block_size: usize,
    caching: bool,
    refs: Vec<u32>,
    hash_of: Vec<Option<BlockHash>>,
    cached: HashMap<BlockHash, u32>,
    /// Registered blocks no one holds, by release order: reused oldest first.
    idle: BTreeMap<u64, u32>,
    idle_since: Vec<u64>,
    clock: u64,
    counters: PrefixCounters,
    /// The byte budget shared with the adapter slots, if any.
    budget: Option<Arc<MemoryBudget>>,
}

impl BlockAllocator {
    pub fn new(total: usize, block_size: usize) -> Self {
        BlockAllocator::with_caching(total, block_size, true)
    }

    /// `caching`: whether computed blocks are kept and shared.
    pub fn with_caching(total: usize, block_size: usize, caching: bool) -> Self {
        // Pop from the end: low ids first, which keeps tests readable.
        BlockAllocator {
            free: (0..total as u32).rev().collect(),
            total,
            block_size,
            caching,
            refs: vec![0; total],
            hash_of: vec![None; total],
            cached: HashMap::new(),
            idle: BTreeMap::new(),
            idle_since: vec![0; total],
            clock: 0,
            counters: PrefixCounters::default(),
            budget: None,
        }
    }

    /// Counts this cache's blocks against `budget`, shared with the
    /// adapter slots.
    pub fn set_budget(&mut self, budget: Arc<MemoryBudget>) {
        self.budget = Some(budget);
        self.report();
    }

    /// Tells the budget how many blocks have contents.
    fn report(&self) {
        if let Some(b) = &self.budget {
            b.set_kv_blocks(self.total - self.free.len());
        }
    }

    /// Blocks off the free list that may be handed out now: all of them,
    /// or under a budget as many as its free bytes hold.
    fn fresh_room(&self) -> usize {
        match &self.budget {
            Some(b) => self.free.len().min(b.kv_room()),
            None => self.free.len(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn caching(&self) -> bool {
        self.caching
    }

    /// Blocks a sequence could take now: free ones (under a budget, as
    /// many as it has room for) and idle cached ones.
    pub fn free_blocks(&self) -> usize {
        self.fresh_room() + self.idle.len()
    }

    /// Blocks held by sequences.
    pub fn used_blocks(&self) -> usize {
        self.total - self.free.len() - self.idle.len()
    }

    /// Blocks without contents (the free list), whether or not a budget
    /// has room for them.
    pub fn unused_blocks(&self) -> usize {
        self.free.len()
    }

    /// Registered blocks no one holds: a cache, dropped first when room
    /// is needed.
    pub fn idle_blocks(&self) -> usize {
        self.idle.len()
    }

    /// Blocks whose contents are registered for reuse (held or idle).
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    pub fn counters(&self) -> PrefixCounters {
        self.counters
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` to hold `tokens` positions. All or nothing: on failure
    /// the table is unchanged. Idle cached blocks are reused, least
    /// recently released first, only once the free list is empty.
    pub fn grow(&mut self, table: &mut Vec<u32>, tokens: usize) -> bool {
        let needed = self.blocks_for(tokens).saturating_sub(table.len());
        if needed > self.free_blocks() {
            return false;
        }
        for _ in 0..needed {
            let b = match self.fresh_room() {
                0 => self.pop_idle().expect("checked above"),
                _ => self.free.pop().expect("room is within the free list"),
            };
            self.refs[b as usize] = 1;
            table.push(b);
            self.report();
        }
        true
    }

    /// The least recently released idle block, unregistered.
    fn pop_idle(&mut self) -> Option<u32> {
        let (_, b) = self.idle.pop_first()?;
        if let Some(h) = self.hash_of[b as usize].take() {
            self.cached.remove(&h);
        }
        Some(b)
    }

    /// Drops up to `blocks` idle cached blocks, least recently released
    /// first, so their bytes go back to the budget. Returns how many.
    pub fn shed_idle(&mut self, blocks: usize) -> usize {
        let mut shed = 0;
        while shed < blocks {
            let Some(b) = self.pop_idle() else { break };
            self.free.push(b);
            shed += 1;
        }
        self.report();
        shed
    }

    /// Gives back every block of `table`. A registered block no one else
    /// holds stays cached, idle, until its space is needed.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        let blocks = std::mem::take(table);
        self.give_back(blocks);
    }

    /// Gives back the first `blocks` blocks of `table` (those it still
    /// holds), leaving [`RELEASED`] in their place so later positions keep
    /// their entries. Returns how many went back.
    pub fn release_behind(&mut self, table: &mut [u32], blocks: usize) -> usize {
        let mut back = Vec::new();
        for b in table.iter_mut().take(blocks) {
            if *b != RELEASED {
                back.push(std::mem::replace(b, RELEASED));
            }
        }
        let n = back.len();
        if n > 0 {
            self.give_back(back);
        }
        n
    }

    fn give_back(&mut self, blocks: Vec<u32>) {
        for b in blocks.into_iter().filter(|&b| b != RELEASED) {
            let i = b as usize;
            self.refs[i] = self.refs[i].saturating_sub(1);
            if self.refs[i] > 0 {
                continue;
            }
            if self.hash_of[i].is_some() {
                self.clock += 1;
                self.idle_since[i] = self.clock;
                self.idle.insert(self.clock, b);
            } else {
                self.free.push(b);
            }
        }
        self.report();
    }

    /// The cached blocks that hold the first of `hashes` in order, taken
    /// by the caller (one reference each). Counts `tokens` positions as
    /// looked up.
    pub fn take_cached(&mut self, hashes: &[BlockHash], tokens: usize) -> Vec<u32> {
        self.counters.queried_tokens += tokens as u64;
        if !self.caching {
            return Vec::new();
        }
        let mut taken = Vec::new();
        for h in hashes {
            let Some(&b) = self.cached.get(h) else {
                break;
            };
            let i = b as usize;
            if self.refs[i] == 0 {
                self.idle.remove(&self.idle_since[i]);
            }
            self.refs[i] += 1;
            taken.push(b);
        }
        self.counters.hit_tokens += (taken.len() * self.block_size).min(tokens) as u64;
        taken
    }

    /// Registers `block`, now full and computed, under `hash`. If another
    /// block already holds the same contents, this one stays unregistered
    /// (and is freed normally); reuse then finds the other.
    pub fn register(&mut self, block: u32, hash: BlockHash) {
        let i = block as usize;
        if !self.caching || self.hash_of[i].is_some() || self.cached.contains_key(&hash) {
            return;
        }
        self.cached.insert(hash, block);
        self.hash_of[i] = Some(hash);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_behind_a_window_go_back_and_keep_their_cache_entry() {
        let mut a = BlockAllocator::new(4, 4);
        let mut t = Vec::new();
        assert!(a.grow(&mut t, 12));
        let seed = weights_seed("base");
        let h0 = chain(&seed, &[1, 2, 3, 4]);
        a.register(t[0], h0);
        assert_eq!(a.release_behind(&mut t, 2), 2);
        assert_eq!(t, vec![RELEASED, RELEASED, 2]);
        assert_eq!(a.release_behind(&mut t, 2), 0, "already given back");
        // Three blocks are free again: the registered one idle, cached.
        assert_eq!(
            (a.free_blocks(), a.used_blocks(), a.cached_blocks()),
            (3, 1, 1)
        );
        assert_eq!(a.take_cached(&[h0], 4), vec![0]);
        // Growing keeps the released entries; releasing skips them.
        assert!(a.grow(&mut t, 16));
        assert_eq!(t.len(), 4);
        a.release(&mut t);
        assert_eq!(a.used_blocks(), 1, "the cached block taken above");
    }

    #[test]
    fn grows_all_or_nothing_and_releases() {
        let mut a = BlockAllocator::new(4, 16);
        let mut t1 = Vec::new();
        assert!(a.grow(&mut t1, 17));
        assert_eq!(t1, vec![0, 1]);
        assert!(a.grow(&mut t1, 32), "already enough blocks");
        assert_eq!(t1.len(), 2);
        let mut t2 = Vec::new();
        assert!(!a.grow(&mut t2, 48), "three blocks do not fit in two");
        assert!(t2.is_empty());
        assert_eq!(a.free_blocks(), 2);
        a.release(&mut t1);
        assert!(t1.is_empty());
        assert_eq!((a.free_blocks(), a.used_blocks()), (4, 0));
        assert!(a.grow(&mut t2, 64));
    }

    #[test]
    fn a_released_registered_block_is_shared_and_evicted_last_released_last() {
        let mut a = BlockAllocator::new(3, 4);
        let seed = weights_seed("base");
        let h0 = chain(&seed, &[1, 2, 3, 4]);
        let h1 = chain(&h0, &[5, 6, 7, 8]);
        let mut t = Vec::new();
        assert!(a.grow(&mut t, 8));
        a.register(t[0], h0);
        a.register(t[1], h1);
        let blocks = t.clone();
        a.release(&mut t);
        assert_eq!((a.free_blocks(), a.cached_blocks()), (3, 2));
        // Another sequence with the same first block takes it.
        let mut u = a.take_cached(&[h0, chain(&h0, &[9, 9, 9, 9])], 8);
        assert_eq!(u, vec![blocks[0]]);
        assert_eq!(a.counters().hit_tokens, 4);
        // Two more blocks: the free one, then the idle cached one (h1).
        assert!(a.grow(&mut u, 12));
        assert_eq!(a.cached_blocks(), 1, "h1's block was reused");
        assert!(a.take_cached(&[h1], 4).is_empty());
        // A different seed (another adapter's weights) never matches.
        let other = chain(&weights_seed("adapter-digest"), &[1, 2, 3, 4]);
        assert!(a.take_cached(&[other], 4).is_empty());
        a.release(&mut u);
        assert_eq!(a.used_blocks(), 0);
    }

    #[test]
    fn under_a_budget_fresh_blocks_stop_at_its_room_and_idle_ones_can_be_shed() {
        use crate::budget::{MemoryBudget, MemoryUnits};
        let units = MemoryUnits {
            block_bytes: 10,
            slot_bytes: 30,
        };
        // 100 bytes: a slot filled elsewhere leaves room for 7 blocks.
        let budget = Arc::new(MemoryBudget::new(100, units).unwrap());
        let mut a = BlockAllocator::new(budget.max_kv_blocks(), 4);
        a.set_budget(budget.clone());
        budget.set_slots(1, 0);
        assert_eq!((a.total(), a.free_blocks()), (7, 7));
        let mut t = Vec::new();
        assert!(a.grow(&mut t, 20), "five blocks");
        assert_eq!(budget.split().kv, 50);
        budget.set_slots(2, 0);
        assert_eq!(a.free_blocks(), 0, "the second slot took the last room");
        assert!(!a.grow(&mut t, 24));
        // Registered and released: idle, still counted, and reusable.
        let seed = weights_seed("base");
        let mut parent = seed;
        for (i, &b) in t.iter().enumerate() {
            parent = chain(&parent, &[i as u32; 4]);
            a.register(b, parent);
        }
        a.release(&mut t);
        assert_eq!((a.idle_blocks(), budget.split().kv), (5, 50));
        assert_eq!(
            a.free_blocks(),
            5,
            "idle blocks are reused within the budget"
        );
        // Shedding gives their bytes back, oldest released first.
        assert_eq!(a.shed_idle(3), 3);
        assert_eq!((a.idle_blocks(), budget.split().kv), (2, 20));
        assert_eq!(a.shed_idle(9), 2);
        assert_eq!((a.cached_blocks(), budget.split().free()), (0, 40));
    }

    #[test]
    fn without_caching_nothing_is_kept() {
        let mut a = BlockAllocator::with_caching(2, 4, false);
        let h = chain(&weights_seed("base"), &[1, 2, 3, 4]);
        let mut t = Vec::new();
        assert!(a.grow(&mut t, 4));
        a.register(t[0], h);
        a.release(&mut t);
        assert!(a.take_cached(&[h], 4).is_empty());
        assert_eq!(a.cached_blocks(), 0);
    }
}
