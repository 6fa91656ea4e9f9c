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

/// Whether the object's writer has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteState {
    /// PutStart happened at this instant; PutEnd has not.
    Processing {
        /// When the write began.
        started: Instant,
    },
    /// PutEnd happened: readable.
    Complete,
}

/// Metadata of one object.
#[derive(Debug)]
pub struct ObjectEntry {
    /// Size in bytes.
    pub size: u64,
    /// Where its replicas live.
    pub replicas: Vec<StoredReplica>,
    /// Write progress.
    pub state: WriteState,
    /// Removal (unless forced) is refused until this instant; it doubles as the LRU stamp.
    pub lease_until: Instant,
}

impl ObjectEntry {
    /// True once PutEnd has made the object readable.
    pub fn is_complete(&self) -> bool {
        self.state == WriteState::Complete
    }

    /// Extends the read lease to at least `until`.
    pub fn grant_lease(&mut self, until: Instant) {
        if until > self.lease_until {
            self.lease_until = until;
        }
    }

    /// True while a read lease is active at `now`.
    pub fn has_lease(&self, now: Instant) -> bool {
        self.lease_until > now
    }

    /// The replicas as handed to clients.
    pub fn descriptors(&self) -> Vec<ReplicaDescriptor> {
        let status = if self.is_complete() {
            ReplicaStatus::Complete
        } else {
            ReplicaStatus::Processing
        };
        self.replicas
            .iter()
            .map(|r| ReplicaDescriptor {
                location: ReplicaLocation::Memory {
                    segment: r.segment.id,
                    segment_name: r.segment.name.clone(),
                    offset: r.allocation.offset,
                },
                size: self.size,
                status,
            })
            .collect()
    }
}
