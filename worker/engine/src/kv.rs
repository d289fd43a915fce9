//! The paged KV cache's bookkeeping: fixed-size blocks handed out from a
//! free list. The backend holds the memory; this allocator decides who owns
//! which block.

/// Hands out KV block ids from a free list.
#[derive(Debug, Clone)]
pub struct BlockAllocator {
    free: Vec<u32>,
    total: usize,
    block_size: usize,
}

impl BlockAllocator {
    pub fn new(total: usize, block_size: usize) -> Self {
        // Pop from the end: low ids first, which keeps tests readable.
        BlockAllocator {
            free: (0..total as u32).rev().collect(),
            total,
            block_size,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn total(&self) -> usize {
        self.total
    }

    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn used_blocks(&self) -> usize {
        self.total - self.free.len()
    }

    /// Blocks needed to hold `tokens` positions.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Grows `table` to hold `tokens` positions. All or nothing: on failure
    /// the table is unchanged.
    pub fn grow(&mut self, table: &mut Vec<u32>, tokens: usize) -> bool {
        let needed = self.blocks_for(tokens).saturating_sub(table.len());
        if needed > self.free.len() {
            return false;
        }
        for _ in 0..needed {
            table.push(self.free.pop().expect("checked above"));
        }
        true
    }

    /// Returns every block of `table` to the free list.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.append(table);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
