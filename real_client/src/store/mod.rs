//! The object store as seen from one real client: writes and reads through the master,
//! this node's segment (memcpy) and peers' segments (the transfer engine). The RPC
//! handlers and the in-process (embedded) API both call it with already-translated
//! memory: [`Region`]s of a dummy's shared memory (mapped here) or of its declared
//! ordinary memory (copied once across processes, straight to or from the segment; a
//! peer's segment is reached through a private bounce buffer, because the transfer
//! engine sends from and receives into mappings of this process).
//!
//! * [`write`]: the write path (puts, upserts, reservations, copies to peers), with its
//!   invariants at the top;
//! * [`read`]: the read path (single, scattered, ranged and batched reads), with its
//!   invariants at the top;
//! * here: where a replica is seen from this node ([`Place`]), what a payload is, and
//!   copy and move tasks.

mod read;
mod write;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::TaskWork;
use mooncake_core::protocol::grant::{Grant, GrantedRange};
use mooncake_core::types::{ReplicaDescriptor, ReplicaLocation, SegmentId};
use mooncake_device::DeviceApi;
use mooncake_shm::MemSlice;

use crate::bounce::BouncePool;
use crate::disk::DiskTier;
use crate::master_link::MasterLink;
use crate::region::Region;
use crate::transfer::server::ServedSegment;
use crate::transfer::{TransferClient, Transport};

/// Bytes to write: ranges of a dummy's memory (concatenated) or bytes of this process.
#[derive(Debug)]
pub enum Payload<'a> {
    /// Ranges of the dummy's shared or declared memory, in order.
    Regions(Vec<Region>),
    /// Bytes in this process.
    Bytes(&'a [u8]),
}

impl Payload<'_> {
    /// Total length, or `None` if it overflows.
    pub fn total_len(&self) -> Option<u64> {
        match self {
            Payload::Regions(regions) => regions
                .iter()
                .try_fold(0u64, |acc, r| acc.checked_add(r.len())),
            Payload::Bytes(bytes) => Some(bytes.len() as u64),
        }
    }

    /// True when the transfer engine can send every byte from where it is (bytes of
    /// this process and declared memory of a dummy must be bounced first).
    fn is_mapped(&self) -> bool {
        match self {
            Payload::Regions(regions) => regions.iter().all(|r| r.mapped().is_some()),
            Payload::Bytes(_) => false,
        }
    }

    /// The GPU interface of the first device range of the payload, if any.
    fn device_api(&self) -> Option<DeviceApi> {
        match self {
            Payload::Regions(regions) => regions.iter().find_map(Region::device_api),
            Payload::Bytes(_) => None,
        }
    }

    /// The whole payload copied into one bounce buffer of `pool` (for peers).
    fn bounce(&self, pool: &BouncePool) -> CodeResult<MemSlice> {
        let len = self.total_len().ok_or(ErrorCode::INVALID_PARAMS)?;
        let staged = pool.take(len, self.device_api())?;
        match self {
            Payload::Bytes(bytes) => {
                staged.write_from(bytes);
            }
            Payload::Regions(regions) => {
                let mut offset = 0u64;
                for region in regions {
                    let part = staged
                        .sub(offset, region.len())
                        .ok_or(ErrorCode::INTERNAL_ERROR)?;
                    region.copy_into(&part)?;
                    offset += region.len();
                }
            }
        }
        Ok(staged)
    }
}

/// Where one replica's bytes are, seen from this node.
enum Place<'a> {
    /// In this node's segment.
    Local(MemSlice),
    /// In a peer's segment.
    Remote {
        endpoint: &'a str,
        segment: u64,
        offset: u64,
        /// The master's grant for the replica's whole range.
        grant: Option<GrantedRange>,
    },
    /// On this node's SSD tier.
    LocalDisk,
    /// On a peer's SSD tier (its transfer engine reads it for us).
    RemoteDisk {
        endpoint: &'a str,
        grant: Option<Grant>,
    },
}

/// Reads and writes objects through the master, the local segment and peers.
#[derive(Debug)]
pub struct Store {
    master: MasterLink,
    segment: Arc<ServedSegment>,
    /// Moves bytes to and from peers' segments (TCP or RDMA).
    transport: Arc<dyn Transport>,
    /// Reaches peers' transfer engines over TCP (their SSD tiers).
    peers: Arc<TransferClient>,
    /// This node's SSD tier, when enabled.
    disk: Option<Arc<DiskTier>>,
    /// This node's segment name (disk replicas name their owner by it).
    segment_name: String,
    /// Reads served from another node's SSD tier (upstream's offload RPC reads).
    remote_disk_reads: std::sync::atomic::AtomicU64,
    /// Buffers that carry to and from peers what is not mapped here.
    bounce: BouncePool,
}

fn transfer_blocking<T>(work: impl FnOnce() -> T) -> T {
    // Peer transfers are blocking socket I/O on a multi-threaded runtime: let the
    // runtime move other tasks off this worker meanwhile.
    tokio::task::block_in_place(work)
}

impl Store {
    /// A store over `master` with `segment` mounted, moving bytes to and from peers'
    /// segments with `transport` and reading their SSD tiers through `peers`.
    pub fn new(
        master: MasterLink,
        segment: Arc<ServedSegment>,
        segment_name: String,
        disk: Option<Arc<DiskTier>>,
        transport: Arc<dyn Transport>,
        peers: Arc<TransferClient>,
    ) -> Self {
        Store {
            master,
            segment,
            transport,
            peers,
            disk,
            segment_name,
            remote_disk_reads: std::sync::atomic::AtomicU64::new(0),
            bounce: BouncePool::default(),
        }
    }

    /// Number of reads served from another node's SSD tier since start.
    pub fn remote_disk_reads(&self) -> u64 {
        self.remote_disk_reads
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This node's SSD tier, when enabled.
    pub fn disk(&self) -> Option<&Arc<DiskTier>> {
        self.disk.as_ref()
    }

    /// The master this store talks to.
    pub fn master(&self) -> &MasterLink {
        &self.master
    }

    /// The local segment.
    pub fn segment(&self) -> &Arc<ServedSegment> {
        &self.segment
    }

    /// The bytes of the replica among `replicas` that lies in this node's own segment.
    pub fn own_replica(&self, replicas: &[ReplicaDescriptor]) -> Option<MemSlice> {
        replicas
            .iter()
            .find_map(|replica| match self.place_to_read(replica) {
                Ok(Place::Local(bytes)) => Some(bytes),
                _ => None,
            })
    }

    /// [`place`](Self::place) for reading `replica`: a replica in this node's segment
    /// once no write in flight covers its bytes (see [`crate::writes_in_flight`]).
    fn place_to_read<'a>(&self, replica: &'a ReplicaDescriptor) -> CodeResult<Place<'a>> {
        let place = self.place(replica)?;
        if let (Place::Local(_), ReplicaLocation::Memory { offset, .. }) =
            (&place, &replica.location)
        {
            self.segment.writes.settle(*offset, replica.size)?;
        }
        Ok(place)
    }

    fn place<'a>(&self, replica: &'a ReplicaDescriptor) -> CodeResult<Place<'a>> {
        let (segment, segment_name, offset, endpoint) = match &replica.location {
            ReplicaLocation::Memory {
                segment,
                segment_name,
                offset,
                endpoint,
            } => (segment, segment_name, offset, endpoint),
            ReplicaLocation::Disk {
                segment_name,
                endpoint,
            } => {
                return Ok(if *segment_name == self.segment_name {
                    Place::LocalDisk
                } else {
                    Place::RemoteDisk {
                        endpoint,
                        grant: replica.grant,
                    }
                });
            }
        };
        let own = (
            self.segment.id.load(Ordering::Acquire),
            self.segment_name.as_str(),
        );
        if is_own_segment((*segment, segment_name.as_str()), own) {
            return self
                .segment
                .memory
                .slice(*offset, replica.size)
                .map(Place::Local)
                .ok_or(ErrorCode::INVALID_REPLICA);
        }
        if endpoint.is_empty() {
            return Err(ErrorCode::TRANSFER_FAIL);
        }
        Ok(Place::Remote {
            endpoint,
            segment: *segment,
            offset: *offset,
            grant: replica.grant.map(|grant| GrantedRange {
                offset: *offset,
                len: replica.size,
                grant,
            }),
        })
    }

    /// Executes a copy or move task: copies its source replica, which must be in this
    /// node's segment, into every target.
    pub fn replicate(&self, task: &TaskWork) -> CodeResult<()> {
        let Place::Local(source) = self.place_to_read(&task.source)? else {
            return Err(ErrorCode::INVALID_REPLICA);
        };
        let payload = Payload::Regions(vec![Region::Mapped(source)]);
        task.targets
            .iter()
            .try_for_each(|target| self.write_replica(target, &payload))
    }
}

/// The `(offset, len)` of a replica in memory.
fn memory_range(replica: &ReplicaDescriptor) -> Option<(u64, u64)> {
    match &replica.location {
        ReplicaLocation::Memory { offset, .. } => Some((*offset, replica.size)),
        ReplicaLocation::Disk { .. } => None,
    }
}

/// True when every replica is in memory of the segment `own` (id and name).
fn all_in_segment(replicas: &[ReplicaDescriptor], own: (SegmentId, &str)) -> bool {
    !replicas.is_empty()
        && replicas.iter().all(|replica| match &replica.location {
            ReplicaLocation::Memory {
                segment,
                segment_name,
                ..
            } => is_own_segment((*segment, segment_name.as_str()), own),
            ReplicaLocation::Disk { .. } => false,
        })
}

/// True when a replica in segment `replica` (id, name) lives in this node's segment
/// `own` (id, name). The name must match too: a restarted master hands out ids again,
/// so until the next heartbeat another node's segment may carry this node's old id.
fn is_own_segment(replica: (SegmentId, &str), own: (SegmentId, &str)) -> bool {
    replica.0 == own.0 && replica.1 == own.1
}

#[cfg(test)]
mod locality_tests {
    use super::*;

    #[test]
    fn a_replica_is_local_only_when_both_id_and_name_are_this_nodes() {
        let own = (1, "10.0.0.1:50052");
        assert!(is_own_segment((1, "10.0.0.1:50052"), own));
        assert!(
            !is_own_segment((1, "10.0.0.2:50052"), own),
            "another node's segment under this node's old id (a restarted master)"
        );
        assert!(!is_own_segment((2, "10.0.0.1:50052"), own));
    }
}
