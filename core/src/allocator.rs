//! A best-fit allocator of byte ranges inside one fixed-size region.
//!
//! It hands out offsets, never memory: the master uses it for space inside mounted
//! segments, the dummy client for its shared-memory pool. Every allocation starts at a
//! multiple of [`ALIGNMENT`] and its length is rounded up to one, so that copies run on
//! cache-line-aligned addresses and neighbouring objects never share a cache line.
//!
//! Free space is kept twice: by offset (to merge neighbours on free) and by
//! `(length, offset)` (to find the smallest block that fits). Both operations are
//! O(log n) in the number of free blocks.

use std::collections::{BTreeMap, BTreeSet};

/// Alignment, in bytes, of every allocation's offset and length.
pub const ALIGNMENT: u64 = 64;

/// Why an allocation could not be made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// A zero-byte request.
    #[error("cannot allocate zero bytes")]
    ZeroSize,
    /// No free block is large enough.
    #[error(
        "no free block of {requested} bytes ({free} bytes free in total, largest block {largest})"
    )]
    OutOfSpace {
        /// Bytes asked for (after rounding).
        requested: u64,
        /// Total free bytes.
        free: u64,
        /// The largest single free block.
        largest: u64,
    },
}

/// One allocated range: `offset..offset + len` (len already rounded to [`ALIGNMENT`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Allocation {
    /// Start of the range.
    pub offset: u64,
    /// Length of the range, a multiple of [`ALIGNMENT`].
    pub len: u64,
}

/// Best-fit range allocator over `0..capacity`.
#[derive(Debug)]
pub struct RangeAllocator {
    capacity: u64,
    free_bytes: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
}

/// Rounds `len` up to the allocation alignment, or `None` on overflow.
pub fn align_up(len: u64) -> Option<u64> {
    len.checked_add(ALIGNMENT - 1).map(|v| v & !(ALIGNMENT - 1))
}

impl RangeAllocator {
    /// An allocator whose whole `capacity` (rounded down to the alignment) is free.
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity & !(ALIGNMENT - 1);
        let mut allocator = RangeAllocator {
            capacity,
            free_bytes: 0,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        if capacity > 0 {
            allocator.insert_free(0, capacity);
        }
        allocator
    }

    /// Usable bytes in total.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes not currently allocated.
    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    /// Bytes currently allocated.
    pub fn used_bytes(&self) -> u64 {
        self.capacity - self.free_bytes
    }

    /// The largest block that a single allocation could get.
    pub fn largest_free_block(&self) -> u64 {
        self.by_size.last().map_or(0, |(len, _)| *len)
    }

    /// Allocates `len` bytes (rounded up to [`ALIGNMENT`]) from the smallest block that fits.
    pub fn allocate(&mut self, len: u64) -> Result<Allocation, AllocError> {
        if len == 0 {
            return Err(AllocError::ZeroSize);
        }
        let out_of_space = |requested| AllocError::OutOfSpace {
            requested,
            free: self.free_bytes,
            largest: self.largest_free_block(),
        };
        let len = align_up(len).ok_or_else(|| out_of_space(len))?;
        let &(block_len, offset) = self
            .by_size
            .range((len, 0)..)
            .next()
            .ok_or_else(|| out_of_space(len))?;
        self.remove_free(offset, block_len);
        if block_len > len {
            self.insert_free(offset + len, block_len - len);
        }
        Ok(Allocation { offset, len })
    }

    /// Returns a range previously handed out by [`allocate`](Self::allocate).
    ///
    /// Freeing a range that overlaps free space is a caller bug; it is ignored (and
    /// reported as `false`) rather than corrupting the free lists.
    pub fn free(&mut self, allocation: Allocation) -> bool {
        let Allocation {
            mut offset,
            mut len,
        } = allocation;
        let end = match offset.checked_add(len) {
            Some(end) if end <= self.capacity && len > 0 => end,
            _ => return false,
        };
        if self.overlaps_free(offset, end) {
            return false;
        }
        if let Some((&prev_off, &prev_len)) = self.by_offset.range(..offset).next_back()
            && prev_off + prev_len == offset
        {
            self.remove_free(prev_off, prev_len);
            offset = prev_off;
            len += prev_len;
        }
        if let Some(&next_len) = self.by_offset.get(&end) {
            self.remove_free(end, next_len);
            len += next_len;
        }
        self.insert_free(offset, len);
        true
    }

    /// Takes exactly `allocation`'s range out of free space (a standby master copying
    /// its leader's allocations). False, and nothing changes, when part of the range is
    /// not free or it lies outside the region.
    pub fn reserve(&mut self, allocation: Allocation) -> bool {
        let Allocation { offset, len } = allocation;
        let end = match offset.checked_add(len) {
            Some(end) if end <= self.capacity && len > 0 => end,
            _ => return false,
        };
        let Some((&block, &block_len)) = self.by_offset.range(..=offset).next_back() else {
            return false;
        };
        if block + block_len < end {
            return false;
        }
        self.remove_free(block, block_len);
        if block < offset {
            self.insert_free(block, offset - block);
        }
        if end < block + block_len {
            self.insert_free(end, block + block_len - end);
        }
        true
    }

    /// The free blocks as `(offset, len)`, by offset (for a snapshot of the allocator).
    pub fn free_blocks(&self) -> Vec<(u64, u64)> {
        self.by_offset.iter().map(|(&o, &l)| (o, l)).collect()
    }

    /// An allocator of `capacity` whose free space is exactly `blocks` (as
    /// [`free_blocks`](Self::free_blocks) reported them). Blocks that overlap, lie
    /// outside the region or are misaligned are refused (`None`).
    pub fn with_free_blocks(capacity: u64, blocks: &[(u64, u64)]) -> Option<Self> {
        let mut allocator = RangeAllocator {
            capacity: capacity & !(ALIGNMENT - 1),
            free_bytes: 0,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
        };
        let mut end_of_last = 0u64;
        for &(offset, len) in blocks {
            let end = offset.checked_add(len)?;
            let aligned = offset % ALIGNMENT == 0 && len % ALIGNMENT == 0;
            if !aligned || len == 0 || offset < end_of_last || end > allocator.capacity {
                return None;
            }
            allocator.insert_free(offset, len);
            end_of_last = end;
        }
        Some(allocator)
    }

    fn overlaps_free(&self, start: u64, end: u64) -> bool {
        self.by_offset
            .range(..end)
            .next_back()
            .is_some_and(|(&off, &len)| off + len > start)
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn allocates_aligned_and_reuses() {
        let mut allocator = RangeAllocator::new(1 << 20);
        let a = allocator.allocate(100).expect("fits");
        assert_eq!(
            a,
            Allocation {
                offset: 0,
                len: 128
            }
        );
        let b = allocator.allocate(1).expect("fits");
        assert_eq!(b.offset, 128);
        assert!(allocator.free(a));
        assert!(!allocator.free(a), "double free is refused");
        let c = allocator.allocate(64).expect("fits");
        assert_eq!(c.offset, 0, "best fit reuses the hole");
        assert_eq!(allocator.allocate(0), Err(AllocError::ZeroSize));
    }

    #[test]
    fn reserve_copies_an_allocation_and_snapshots_round_trip() {
        let mut leader = RangeAllocator::new(1 << 16);
        let mut standby = RangeAllocator::new(1 << 16);
        let a = leader.allocate(100).expect("fits");
        let b = leader.allocate(5000).expect("fits");
        assert!(standby.reserve(a) && standby.reserve(b));
        assert!(
            !standby.reserve(a),
            "an allocated range cannot be reserved twice"
        );
        assert!(leader.free(a) && standby.free(a));
        assert_eq!(leader.free_blocks(), standby.free_blocks());
        let copy = RangeAllocator::with_free_blocks(1 << 16, &leader.free_blocks())
            .expect("a valid snapshot");
        assert_eq!(copy.free_bytes(), leader.free_bytes());
        assert!(RangeAllocator::with_free_blocks(1 << 16, &[(0, 128), (64, 128)]).is_none());
        assert!(RangeAllocator::with_free_blocks(1 << 16, &[(1, 64)]).is_none());
        assert!(RangeAllocator::with_free_blocks(1 << 16, &[(0, 1 << 17)]).is_none());
    }

    #[test]
    fn reports_out_of_space() {
        let mut allocator = RangeAllocator::new(1024);
        let _a = allocator.allocate(1000).expect("fits");
        assert!(matches!(
            allocator.allocate(64),
            Err(AllocError::OutOfSpace { free: 0, .. })
        ));
        assert!(matches!(
            allocator.allocate(u64::MAX),
            Err(AllocError::OutOfSpace { .. })
        ));
    }

    proptest! {
        #[test]
        fn never_overlaps_and_frees_everything(ops in proptest::collection::vec((1u64..5000, any::<bool>()), 1..200)) {
            let mut allocator = RangeAllocator::new(64 * 1024);
            let mut live: Vec<Allocation> = Vec::new();
            for (len, free_one) in ops {
                if free_one && !live.is_empty() {
                    let a = live.swap_remove(0);
                    prop_assert!(allocator.free(a));
                } else if let Ok(a) = allocator.allocate(len) {
                    prop_assert_eq!(a.offset % ALIGNMENT, 0);
                    prop_assert!(a.offset + a.len <= allocator.capacity());
                    for b in &live {
                        prop_assert!(a.offset + a.len <= b.offset || b.offset + b.len <= a.offset);
                    }
                    live.push(a);
                }
            }
            for a in live.drain(..) {
                prop_assert!(allocator.free(a));
            }
            prop_assert_eq!(allocator.free_bytes(), allocator.capacity());
            prop_assert_eq!(allocator.largest_free_block(), allocator.capacity());
        }
    }
}
