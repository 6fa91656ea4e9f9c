//! What a leader master streams to its hot standbys (high availability): every change
//! of its metadata, as absolute states where it can (an object's whole entry, a key's
//! disk copy), and the allocations inside each segment as they happen, so a standby's
//! allocators match the leader's range for range.
//!
//! A standby first installs a [`SnapshotPart`] sequence, then pulls [`ChangeBatch`]es
//! from the snapshot's sequence number on. Sequence numbers count within one leader's
//! term (its `epoch`); a standby that pulls from another term gets a snapshot.

use serde::{Deserialize, Serialize};

use super::TaskInfo;
use crate::types::SegmentId;

/// Space one replica takes inside a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSpace {
    /// The segment.
    pub segment: SegmentId,
    /// Start of the range.
    pub offset: u64,
    /// Length of the range (aligned, as allocated).
    pub len: u64,
}

/// A version of an object's bytes: its size and where its replicas are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionImage {
    /// Size in bytes.
    pub size: u64,
    /// One entry per replica.
    pub replicas: Vec<ReplicaSpace>,
}

/// A write in progress.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingImage {
    /// The version being written.
    pub version: VersionImage,
    /// The writer's id (`PutStarted::write_id`).
    pub write_id: u64,
    /// How long ago the write began, in milliseconds.
    pub age_ms: u64,
    /// Soft-pin change applied when it completes: `None` keeps the pin, `Some(None)`
    /// clears it, `Some(Some(ms))` pins for `ms` from completion.
    pub soft_pin_ms: Option<Option<u64>>,
}

/// An object's whole entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ObjectImage {
    /// The version readers get.
    pub readable: Option<VersionImage>,
    /// A write in progress.
    pub pending: Option<PendingImage>,
    /// Never evicted.
    pub hard_pinned: bool,
    /// Milliseconds left of its soft pin (0: not pinned).
    pub soft_pin_left_ms: u32,
}

/// A mounted segment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentImage {
    /// Its id.
    pub id: SegmentId,
    /// Its name.
    pub name: String,
    /// Usable bytes.
    pub capacity: u64,
    /// The real client that owns it.
    pub owner: u128,
    /// Where the owner's transfer engine listens.
    pub endpoint: String,
    /// Nonzero for a segment in a file that outlives its owner's process.
    pub generation: u128,
}

/// A copy or move task and what the master holds for it (high availability: tasks
/// survive a failover).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskImage {
    /// The task as `query_task` reports it.
    pub info: TaskInfo,
    /// The real client that executes it.
    pub executor: u128,
    /// The segment whose replica is copied.
    pub source: SegmentId,
    /// Space allocated on the targets while it runs.
    pub allocated: Vec<ReplicaSpace>,
}

/// One change of a leader's metadata.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// The entry of `key` is now `image` (`None`: the key is gone).
    Object {
        /// The key.
        key: String,
        /// Its entry.
        image: Option<ObjectImage>,
    },
    /// The SSD-tier copy of `key` is now on `owner`'s disk with `size` bytes (`None`:
    /// it has none).
    Disk {
        /// The key.
        key: String,
        /// `(owner, size)` of its disk copy.
        copy: Option<(u128, u64)>,
    },
    /// Every disk copy of `client` is forgotten (it went away).
    DiskClientGone {
        /// The real client.
        client: u128,
    },
    /// Every disk copy of `old` is `new`'s (`old` restarted as `new` on the same node
    /// and took its segment back).
    DiskHandedOver {
        /// The real client that went away.
        old: u128,
        /// The one that took its place.
        new: u128,
    },
    /// The file of `key` on `client`'s disk is to be deleted (its object was removed
    /// or replaced).
    DiskDeleteQueued {
        /// The real client.
        client: u128,
        /// The key.
        key: String,
    },
    /// `client` took these deletions (it deletes the files now).
    DiskDeletesFetched {
        /// The real client.
        client: u128,
        /// The keys whose files it deletes.
        keys: Vec<String>,
    },
    /// `client` registered its SSD tier.
    OffloadEnabled {
        /// The real client.
        client: u128,
    },
    /// A segment was mounted.
    Mounted(SegmentImage),
    /// A restarted owner took its segment back (same id and space, new owner and
    /// endpoint).
    Remounted(SegmentImage),
    /// A segment was unmounted (its replicas are gone).
    Unmounted {
        /// The segment.
        id: SegmentId,
    },
    /// Space was allocated.
    Allocated(ReplicaSpace),
    /// Space was freed.
    Freed(ReplicaSpace),
    /// A task was created or changed state.
    Task(TaskImage),
    /// Space no object uses any more whose free waits for readers' leases (or for a
    /// discarded writer) for `release_in_ms`; a later `Freed` of the same space ends
    /// the wait. A standby that takes over frees what is still waiting when it is due.
    Deferred {
        /// The space.
        spaces: Vec<ReplicaSpace>,
        /// Milliseconds until it may be reused.
        release_in_ms: u64,
    },
}

/// Changes a standby pulled, and where the stream stands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChangeBatch {
    /// Changes from the requested sequence number on, in order.
    pub changes: Vec<Change>,
    /// The leader's next sequence number when the batch was cut.
    pub head: u64,
    /// True when the leader counts this standby among the in-sync ones (its writes
    /// wait for this standby's acknowledgement): only such a standby may take over.
    pub in_sync: bool,
    /// The leader's term.
    pub epoch: u64,
}

/// One piece of a leader's snapshot: postcard-encoded [`SnapshotState`] split in parts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotPart {
    /// The leader's term.
    pub epoch: u64,
    /// Changes from this sequence number on follow the snapshot.
    pub sequence: u64,
    /// How many parts there are.
    pub parts: u32,
    /// This part's bytes.
    #[serde(with = "serde_bytes")]
    pub bytes: Vec<u8>,
}

/// A segment in a snapshot, with its allocator's free space.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentState {
    /// The segment.
    pub segment: SegmentImage,
    /// Free blocks as `(offset, len)`.
    pub free: Vec<(u64, u64)>,
}

/// A leader's whole metadata at one sequence number.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotState {
    /// Mounted segments.
    pub segments: Vec<SegmentState>,
    /// Every object.
    pub objects: Vec<(String, ObjectImage)>,
    /// Every disk copy: key, owner, size.
    pub disk: Vec<(String, u128, u64)>,
    /// Real clients with an SSD tier.
    pub offload_clients: Vec<u128>,
    /// Files each of them is yet to delete (keys).
    pub disk_deletes: Vec<(u128, Vec<String>)>,
    /// Copy and move tasks, finished ones included.
    pub tasks: Vec<TaskImage>,
    /// Space waiting to be freed, with the milliseconds left until it may be.
    pub deferred: Vec<(ReplicaSpace, u64)>,
}
