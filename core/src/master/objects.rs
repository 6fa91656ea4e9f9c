//! Per-object metadata kept by the master.

use std::sync::Arc;
use std::time::Instant;

use crate::allocator::Allocation;
use crate::types::{ReplicaDescriptor, ReplicaLocation, ReplicaStatus};

use super::segments::MountedSegment;

/// One replica's space inside a segment.
#[derive(Debug, Clone)]
pub struct StoredReplica {
    /// The segment holding the bytes.
    pub segment: Arc<MountedSegment>,
    /// The range allocated inside it.
    pub allocation: Allocation,
}

/// A version of the object's bytes: its size and where its replicas are.
#[derive(Debug)]
pub struct Version {
    /// Size in bytes.
    pub size: u64,
    /// Where its replicas live.
    pub replicas: Vec<StoredReplica>,
}

impl Version {
    /// The replicas as handed to clients.
    pub fn descriptors(&self, status: ReplicaStatus) -> Vec<ReplicaDescriptor> {
        self.replicas
            .iter()
            .map(|r| ReplicaDescriptor {
                location: ReplicaLocation::Memory {
                    segment: r.segment.id,
                    segment_name: r.segment.name.clone(),
                    offset: r.allocation.offset,
                    endpoint: r.segment.endpoint.clone(),
                },
                size: self.size,
                status,
            })
            .collect()
    }
}

/// A write in progress: space allocated, bytes being copied.
#[derive(Debug)]
pub struct PendingWrite {
    /// The new version being written.
    pub version: Version,
    /// When the write began (for zombie-write cleanup).
    pub started: Instant,
    /// Soft-pin change applied when the write completes: `None` keeps the object's
    /// pin, `Some(None)` clears it, `Some(Some(ttl))` pins for `ttl` from completion.
    pub soft_pin: Option<Option<std::time::Duration>>,
    /// Identifies the writer (see `PutStarted::write_id`).
    pub write_id: u64,
}

/// Metadata of one object: the readable version (if any) and a write in progress (if
/// any). An upsert writes its new version beside the readable one and swaps at the end,
/// so readers never see a half-written value.
#[derive(Debug)]
pub struct ObjectEntry {
    /// The version readers get.
    pub readable: Option<Version>,
    /// A write in progress (boxed: rare, and it keeps idle entries small).
    pub pending: Option<Box<PendingWrite>>,
    /// Removal (unless forced) is refused until this instant; it doubles as the LRU stamp.
    pub lease_until: Instant,
    /// Eviction skips the object (in its first pass) until this instant.
    pub soft_pin_until: Option<Instant>,
    /// Never evicted.
    pub hard_pinned: bool,
}

impl ObjectEntry {
    /// True once a version is readable.
    pub fn is_readable(&self) -> bool {
        self.readable.is_some()
    }

    /// Extends the read lease to at least `until`.
    pub fn grant_lease(&mut self, until: Instant) {
        if until > self.lease_until {
            self.lease_until = until;
        }
    }

    /// True while a soft pin is active at `now`.
    pub fn is_soft_pinned(&self, now: Instant) -> bool {
        self.soft_pin_until.is_some_and(|t| t > now)
    }

    /// True while a read lease is active at `now`.
    pub fn has_lease(&self, now: Instant) -> bool {
        self.lease_until > now
    }
}
