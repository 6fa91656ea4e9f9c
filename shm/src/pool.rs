//! The dummy-side allocator behind `alloc_from_mem_pool` / `free_to_mem_pool` (and the
//! staging buffer): sub-allocates blocks of registered shared memory in-process, without
//! an RPC, using the same range allocator as the master.

use std::collections::BTreeMap;
use std::sync::Arc;

use mooncake_core::allocator::{Allocation, RangeAllocator};

use crate::shared_memory::SharedMemory;

struct PoolSegment {
    mem: Arc<SharedMemory>,
    allocator: RangeAllocator,
}

/// A block handed out: which segment, the allocator's range, and the size asked for.
#[derive(Debug, Clone, Copy)]
struct LiveBlock {
    segment: usize,
    allocation: Allocation,
    requested: u64,
}

/// Allocates blocks from a growing set of shared-memory segments.
pub struct PoolAllocator {
    segments: Vec<PoolSegment>,
    live: BTreeMap<u64, LiveBlock>,
}

impl std::fmt::Debug for PoolAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolAllocator")
            .field("segments", &self.segments.len())
            .field("live", &self.live.len())
            .finish()
    }
}

impl PoolAllocator {
    /// An allocator over one initial segment.
    pub fn new(first: Arc<SharedMemory>) -> Self {
        let mut pool = PoolAllocator {
            segments: Vec::new(),
            live: BTreeMap::new(),
        };
        pool.add_segment(first);
        pool
    }

    /// Adds a segment (when the pool grows).
    pub fn add_segment(&mut self, mem: Arc<SharedMemory>) {
        let allocator = RangeAllocator::new(mem.len() as u64);
        self.segments.push(PoolSegment { mem, allocator });
    }

    /// Every segment, in the order added.
    pub fn segments(&self) -> impl Iterator<Item = &Arc<SharedMemory>> {
        self.segments.iter().map(|s| &s.mem)
    }

    /// Allocates `len` bytes; returns the block's address, or `None` when no segment has room.
    pub fn allocate(&mut self, len: u64) -> Option<u64> {
        self.segments
            .iter_mut()
            .enumerate()
            .find_map(|(index, segment)| {
                let allocation = segment.allocator.allocate(len).ok()?;
                let addr = segment.mem.base() + allocation.offset;
                let block = LiveBlock {
                    segment: index,
                    allocation,
                    requested: len,
                };
                self.live.insert(addr, block);
                Some(addr)
            })
    }

    /// Frees a block returned by [`allocate`](Self::allocate); false for unknown addresses.
    pub fn free(&mut self, addr: u64) -> bool {
        match self.live.remove(&addr) {
            Some(block) => self.segments[block.segment]
                .allocator
                .free(block.allocation),
            None => false,
        }
    }

    /// True unless `addr..addr+len` starts inside a live block and runs past its end
    /// (a range outside every block is not this allocator's to judge).
    pub fn within_block(&self, addr: u64, len: u64) -> bool {
        match self.live.range(..=addr).next_back() {
            Some((&start, block)) if addr < start + block.allocation.len => addr
                .checked_add(len)
                .is_some_and(|end| end <= start + block.requested),
            _ => true,
        }
    }

    /// The size asked for when the block starting at `addr` was allocated.
    pub fn block_len(&self, addr: u64) -> Option<u64> {
        self.live.get(&addr).map(|b| b.requested)
    }

    /// Bytes from `addr` to the end of the segment containing it (0 when outside).
    pub fn room_after(&self, addr: u64) -> u64 {
        self.segments
            .iter()
            .find_map(|s| {
                let base = s.mem.base();
                let end = base + s.mem.len() as u64;
                (addr >= base && addr < end).then_some(end - addr)
            })
            .unwrap_or(0)
    }

    /// True when `addr..addr+len` lies inside one of the pool's segments.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        self.segments.iter().any(|s| {
            let base = s.mem.base();
            addr >= base
                && addr
                    .checked_add(len)
                    .is_some_and(|end| end <= base + s.mem.len() as u64)
        })
    }

    /// Total bytes of all segments.
    pub fn capacity(&self) -> u64 {
        self.segments.iter().map(|s| s.allocator.capacity()).sum()
    }

    /// Bytes currently allocated.
    pub fn used(&self) -> u64 {
        self.segments.iter().map(|s| s.allocator.used_bytes()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_memory::PageSize;

    #[test]
    fn allocates_frees_and_grows() {
        let first = Arc::new(SharedMemory::create("pool", 4096, PageSize::Normal).expect("create"));
        let base = first.base();
        let mut pool = PoolAllocator::new(first);
        let a = pool.allocate(4000).expect("fits");
        assert_eq!(a, base);
        assert!(pool.contains(a, 4000));
        assert!(!pool.contains(a, 5000));
        assert_eq!(pool.allocate(4096), None, "full");
        pool.add_segment(Arc::new(
            SharedMemory::create("pool2", 8192, PageSize::Normal).expect("create"),
        ));
        let b = pool.allocate(4096).expect("grown");
        assert!(pool.contains(b, 4096));
        assert!(pool.free(a));
        assert!(!pool.free(a), "double free refused");
        assert!(!pool.free(12345));
        assert_eq!(pool.used(), 4096);
        assert_eq!(pool.capacity(), 4096 + 8192);
    }
}
