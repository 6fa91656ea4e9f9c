//! Mounted segments and the space allocated inside them.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use parking_lot::{Mutex, RwLock};

use mooncake_core::allocator::{Allocation, RangeAllocator};
use mooncake_core::error::ErrorCode;
use mooncake_core::master_api::SegmentUsage;
use mooncake_core::master_api::replication::{Change, ReplicaSpace, SegmentImage, SegmentState};
use mooncake_core::types::SegmentId;

use super::config::AllocationStrategy;
use crate::journal::Journal;

/// Where a leader's metadata changes go (empty unless this master leads under high
/// availability); shared by the segment table, every segment and the object table.
pub type JournalSlot = Arc<OnceLock<Arc<Journal>>>;

/// One mounted segment: a region of a real client's memory that the master allocates in.
#[derive(Debug)]
pub struct MountedSegment {
    /// Identifier used in replica descriptors.
    pub id: SegmentId,
    /// Human-readable name (the owner's `host:port`).
    pub name: String,
    /// Where the owner's transfer engine listens (`host:port`; empty when the owner is
    /// in the master's process and no transfer is needed).
    pub endpoint: String,
    /// The real client that owns the segment.
    pub owner: u128,
    /// Nonzero when the segment lives in a file that outlives its owner's process (a
    /// restarted owner presenting the same value takes the segment back).
    pub generation: u128,
    /// Set while its owner is presumed crashed and may come back (`--remount_grace`):
    /// nothing new is placed on it.
    awaiting_owner: std::sync::atomic::AtomicBool,
    /// Free-space bookkeeping; one lock per segment.
    allocator: Mutex<RangeAllocator>,
    /// Allocations and frees are journaled here (high availability).
    journal: JournalSlot,
    /// The segment that replaced this one when its restarted owner took it back
    /// ([`SegmentTable::remount`]): it holds the space now, so a free arriving through
    /// an old reference (a deferred free, a replaced write) goes there.
    successor: OnceLock<Arc<MountedSegment>>,
}

/// A cheap 64-bit mix (splitmix64) used to randomize placement.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl MountedSegment {
    /// Allocates `len` bytes, or `None` when no block is large enough.
    pub fn allocate(&self, len: u64) -> Option<Allocation> {
        let mut allocator = self.allocator.lock();
        let allocation = allocator.allocate(len).ok()?;
        self.journal_space(Change::Allocated, allocation);
        Some(allocation)
    }

    /// Returns space to the segment.
    pub fn free(&self, allocation: Allocation) {
        let mut allocator = self.allocator.lock();
        if let Some(successor) = self.successor.get() {
            drop(allocator);
            return successor.free(allocation);
        }
        if allocator.free(allocation) {
            self.journal_space(Change::Freed, allocation);
        } else {
            tracing::error!(segment = %self.name, ?allocation, "ignored free of a range that is not allocated");
        }
    }

    /// Journals an allocation or a free (called with the allocator locked, so the
    /// journal orders them as the allocator saw them).
    fn journal_space(&self, change: fn(ReplicaSpace) -> Change, allocation: Allocation) {
        if let Some(journal) = self.journal.get() {
            journal.record(change(ReplicaSpace {
                segment: self.id,
                offset: allocation.offset,
                len: allocation.len,
            }));
        }
    }

    /// Takes exactly `allocation` (a standby copying its leader); false when the
    /// range is not free.
    pub fn reserve(&self, allocation: Allocation) -> bool {
        self.allocator.lock().reserve(allocation)
    }

    /// The segment as a snapshot records it.
    pub fn state(&self) -> SegmentState {
        SegmentState {
            segment: self.image(),
            free: self.allocator.lock().free_blocks(),
        }
    }

    /// The segment's identity.
    pub fn image(&self) -> SegmentImage {
        SegmentImage {
            id: self.id,
            name: self.name.clone(),
            capacity: self.allocator.lock().capacity(),
            owner: self.owner,
            endpoint: self.endpoint.clone(),
            generation: self.generation,
        }
    }

    /// Its identity with `capacity` (when its allocator is not at hand).
    fn image_with_capacity(&self, capacity: u64) -> SegmentImage {
        SegmentImage {
            id: self.id,
            name: self.name.clone(),
            capacity,
            owner: self.owner,
            endpoint: self.endpoint.clone(),
            generation: self.generation,
        }
    }

    /// True while its owner is presumed crashed and may come back (no placements).
    pub fn is_awaiting_owner(&self) -> bool {
        self.awaiting_owner
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks the segment as waiting for its crashed owner to come back.
    pub fn await_owner(&self) {
        self.awaiting_owner
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Current capacity and usage.
    pub fn usage(&self) -> SegmentUsage {
        let allocator = self.allocator.lock();
        SegmentUsage {
            id: self.id,
            name: self.name.clone(),
            capacity: allocator.capacity(),
            used: allocator.used_bytes(),
            endpoint: self.endpoint.clone(),
        }
    }
}

/// Every mounted segment, by id.
#[derive(Debug, Default)]
pub struct SegmentTable {
    segments: RwLock<HashMap<SegmentId, Arc<MountedSegment>>>,
    next_id: Mutex<SegmentId>,
    journal: JournalSlot,
}

impl SegmentTable {
    /// Mounts a segment of `capacity` bytes named `name` (names are unique), owned by
    /// `owner` and reachable at `endpoint`.
    pub fn mount(
        &self,
        name: &str,
        capacity: u64,
        owner: u128,
        endpoint: &str,
        generation: u128,
    ) -> Result<SegmentId, ErrorCode> {
        if capacity == 0 || name.is_empty() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let mut segments = self.segments.write();
        if segments.values().any(|s| s.name == name) {
            return Err(ErrorCode::SEGMENT_ALREADY_EXISTS);
        }
        let id = {
            let mut next = self.next_id.lock();
            *next += 1;
            *next
        };
        let image = SegmentImage {
            id,
            name: name.to_string(),
            capacity,
            owner,
            endpoint: endpoint.to_string(),
            generation,
        };
        let segment = self.segment(&image, RangeAllocator::new(capacity));
        if let Some(journal) = self.journal() {
            journal.record(Change::Mounted(segment.image()));
        }
        segments.insert(id, segment);
        Ok(id)
    }

    fn segment(&self, image: &SegmentImage, allocator: RangeAllocator) -> Arc<MountedSegment> {
        Arc::new(MountedSegment {
            id: image.id,
            name: image.name.clone(),
            endpoint: image.endpoint.clone(),
            owner: image.owner,
            generation: image.generation,
            awaiting_owner: Default::default(),
            successor: OnceLock::new(),
            allocator: Mutex::new(allocator),
            journal: Arc::clone(&self.journal),
        })
    }

    /// Mounts a segment exactly as the leader has it (a standby): same id, and the
    /// free space `free` (`None`: all of it). False when the free list is invalid.
    pub fn mount_copy(&self, image: &SegmentImage, free: Option<&[(u64, u64)]>) -> bool {
        let allocator = match free {
            Some(blocks) => match RangeAllocator::with_free_blocks(image.capacity, blocks) {
                Some(allocator) => allocator,
                None => return false,
            },
            None => RangeAllocator::new(image.capacity),
        };
        let segment = self.segment(image, allocator);
        let mut next = self.next_id.lock();
        *next = (*next).max(image.id);
        self.segments.write().insert(image.id, segment);
        true
    }

    /// Gives segment `id` to a new owner reachable at `endpoint` (its restarted real
    /// client), keeping its id, its space and so its objects; answers the segment as
    /// it is now, or `None` when it is not mounted. `image` describes the change for
    /// the journal (a standby applies the leader's own).
    pub fn remount(
        &self,
        id: SegmentId,
        owner: u128,
        endpoint: &str,
    ) -> Option<Arc<MountedSegment>> {
        let mut segments = self.segments.write();
        let old = segments.get(&id)?;
        // Held until the successor is set: a free meanwhile waits, then goes there.
        let mut old_allocator = old.allocator.lock();
        let allocator = std::mem::replace(&mut *old_allocator, RangeAllocator::new(0));
        let image = SegmentImage {
            owner,
            endpoint: endpoint.to_string(),
            ..old.image_with_capacity(allocator.capacity())
        };
        let segment = self.segment(&image, allocator);
        let _ = old.successor.set(Arc::clone(&segment));
        drop(old_allocator);
        if let Some(journal) = self.journal() {
            journal.record(Change::Remounted(image));
        }
        segments.insert(id, Arc::clone(&segment));
        Some(segment)
    }

    /// Unmounts every segment (a standby installing a snapshot).
    pub fn clear(&self) {
        self.segments.write().clear();
    }

    /// Every segment with its free space (for a snapshot).
    pub fn states(&self) -> Vec<SegmentState> {
        self.segments.read().values().map(|s| s.state()).collect()
    }

    /// Every mounted segment.
    pub fn all(&self) -> Vec<Arc<MountedSegment>> {
        self.segments.read().values().cloned().collect()
    }

    /// Where this master's changes are journaled (high availability leader only).
    pub fn journal(&self) -> Option<&Arc<Journal>> {
        self.journal.get()
    }

    /// Starts journaling every change to `journal` (once, when this master leads).
    pub fn start_journal(&self, journal: Arc<Journal>) -> bool {
        self.journal.set(journal).is_ok()
    }

    /// Removes a segment from the table, returning it.
    pub fn unmount(&self, id: SegmentId) -> Result<Arc<MountedSegment>, ErrorCode> {
        let segment = self
            .segments
            .write()
            .remove(&id)
            .ok_or(ErrorCode::SEGMENT_NOT_FOUND)?;
        if let Some(journal) = self.journal() {
            journal.record(Change::Unmounted { id });
        }
        Ok(segment)
    }

    /// The segment with this name, if mounted.
    pub fn find_by_name(&self, name: &str) -> Option<Arc<MountedSegment>> {
        self.segments
            .read()
            .values()
            .find(|s| s.name == name)
            .cloned()
    }

    /// True when a segment with this name is mounted.
    pub fn has_name(&self, name: &str) -> bool {
        self.segments.read().values().any(|s| s.name == name)
    }

    /// The segment with this id, if mounted.
    pub fn get(&self, id: SegmentId) -> Option<Arc<MountedSegment>> {
        self.segments.read().get(&id).cloned()
    }

    /// Allocates `len` bytes on up to `count` distinct segments, trying `preferred` names
    /// first, then the others in the order of `strategy` (`seed` randomizes the random
    /// order). Returns at least one allocation or `NO_AVAILABLE_HANDLE`.
    pub fn allocate_replicas(
        &self,
        len: u64,
        count: usize,
        preferred: &[&str],
        strategy: AllocationStrategy,
        seed: u64,
    ) -> Result<Vec<(Arc<MountedSegment>, Allocation)>, ErrorCode> {
        let segments = self.segments.read();
        let mut candidates: Vec<(&Arc<MountedSegment>, u64)> = segments
            .values()
            .filter(|s| !s.is_awaiting_owner())
            .map(|s| {
                let order = match strategy {
                    AllocationStrategy::Random => mix(seed ^ s.id),
                    AllocationStrategy::FreeRatioFirst => {
                        let usage = s.usage();
                        // Lower is earlier: the used fraction, in parts per billion.
                        usage.used.saturating_mul(1_000_000_000) / usage.capacity.max(1)
                    }
                };
                (s, order)
            })
            .collect();
        candidates.sort_by_key(|(s, order)| {
            let rank = preferred.iter().position(|p| *p == s.name);
            (rank.unwrap_or(usize::MAX), *order)
        });
        let mut chosen = Vec::with_capacity(count);
        for (segment, _) in candidates {
            if chosen.len() == count {
                break;
            }
            if let Some(allocation) = segment.allocate(len) {
                chosen.push((Arc::clone(segment), allocation));
            }
        }
        if chosen.is_empty() {
            Err(ErrorCode::NO_AVAILABLE_HANDLE)
        } else {
            Ok(chosen)
        }
    }

    /// Ids of the segments owned by `owner`.
    pub fn owned_by(&self, owner: u128) -> Vec<SegmentId> {
        self.segments
            .read()
            .values()
            .filter(|s| s.owner == owner)
            .map(|s| s.id)
            .collect()
    }

    /// Allocated and total bytes over all segments.
    pub fn totals(&self) -> (u64, u64) {
        self.usage().iter().fold((0, 0), |(used, capacity), u| {
            (used + u.used, capacity + u.capacity)
        })
    }

    /// Usage of every segment, sorted by id.
    pub fn usage(&self) -> Vec<SegmentUsage> {
        let mut usage: Vec<SegmentUsage> =
            self.segments.read().values().map(|s| s.usage()).collect();
        usage.sort_by_key(|u| u.id);
        usage
    }
}
