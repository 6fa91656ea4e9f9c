//! Mounted segments and the space allocated inside them.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};

use crate::allocator::{Allocation, RangeAllocator};
use crate::error::ErrorCode;
use crate::types::SegmentId;

/// One mounted segment: a region of a real client's memory that the master allocates in.
#[derive(Debug)]
pub struct MountedSegment {
    /// Identifier used in replica descriptors.
    pub id: SegmentId,
    /// Human-readable name (the owner's `host:port`).
    pub name: String,
    /// Free-space bookkeeping; one lock per segment.
    allocator: Mutex<RangeAllocator>,
}

/// Capacity and usage of one segment, for status reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentUsage {
    /// Segment identifier.
    pub id: SegmentId,
    /// Segment name.
    pub name: String,
    /// Usable bytes.
    pub capacity: u64,
    /// Allocated bytes.
    pub used: u64,
}

impl MountedSegment {
    /// Allocates `len` bytes, or `None` when no block is large enough.
    pub fn allocate(&self, len: u64) -> Option<Allocation> {
        self.allocator.lock().allocate(len).ok()
    }

    /// Returns space to the segment.
    pub fn free(&self, allocation: Allocation) {
        if !self.allocator.lock().free(allocation) {
            tracing::error!(segment = %self.name, ?allocation, "ignored free of a range that is not allocated");
        }
    }

    /// Current capacity and usage.
    pub fn usage(&self) -> SegmentUsage {
        let allocator = self.allocator.lock();
        SegmentUsage {
            id: self.id,
            name: self.name.clone(),
            capacity: allocator.capacity(),
            used: allocator.used_bytes(),
        }
    }
}

/// Every mounted segment, by id.
#[derive(Debug, Default)]
pub struct SegmentTable {
    segments: RwLock<HashMap<SegmentId, Arc<MountedSegment>>>,
    next_id: Mutex<SegmentId>,
}

impl SegmentTable {
    /// Mounts a segment of `capacity` bytes named `name`; names are unique.
    pub fn mount(&self, name: &str, capacity: u64) -> Result<SegmentId, ErrorCode> {
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
        segments.insert(
            id,
            Arc::new(MountedSegment {
                id,
                name: name.to_string(),
                allocator: Mutex::new(RangeAllocator::new(capacity)),
            }),
        );
        Ok(id)
    }

    /// Removes a segment from the table, returning it.
    pub fn unmount(&self, id: SegmentId) -> Result<Arc<MountedSegment>, ErrorCode> {
        self.segments
            .write()
            .remove(&id)
            .ok_or(ErrorCode::SEGMENT_NOT_FOUND)
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
    /// first. Returns at least one allocation or `NO_AVAILABLE_HANDLE`.
    pub fn allocate_replicas(
        &self,
        len: u64,
        count: usize,
        preferred: &[&str],
    ) -> Result<Vec<(Arc<MountedSegment>, Allocation)>, ErrorCode> {
        let segments = self.segments.read();
        let mut candidates: Vec<&Arc<MountedSegment>> = segments.values().collect();
        candidates.sort_by_key(|s| {
            let rank = preferred.iter().position(|p| *p == s.name);
            (rank.unwrap_or(usize::MAX), s.id)
        });
        let mut chosen = Vec::with_capacity(count);
        for segment in candidates {
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

    /// Usage of every segment, sorted by id.
    pub fn usage(&self) -> Vec<SegmentUsage> {
        let mut usage: Vec<SegmentUsage> =
            self.segments.read().values().map(|s| s.usage()).collect();
        usage.sort_by_key(|u| u.id);
        usage
    }
}
