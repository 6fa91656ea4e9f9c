//! The values the master hands out and takes in: what both sides of the master seam
//! (the in-process service and the wire) agree on.

use serde::{Deserialize, Serialize};

use crate::types::{ReplicaDescriptor, SegmentId};

/// What a successful [`MasterExt::put_start`](super::MasterExt::put_start) hands the writer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutStarted {
    /// Where to copy the bytes (one entry per replica).
    pub replicas: Vec<ReplicaDescriptor>,
    /// Identifies this write in `put_end` / `put_revoke`, so a writer whose write was
    /// discarded (it was too slow) cannot complete or cancel a newer writer's.
    pub write_id: u64,
}

/// Prefix of the names under which real clients start writes ahead of their keys
/// (reservations, completed with `MasterExt::put_commit`).
pub const RESERVED_PREFIX: &str = "__mooncake_reserved__/";

/// True when `stored` (a key as the master stores it, tenant-scoped or not) names a
/// reservation.
pub fn is_reservation(stored: &str) -> bool {
    let key = stored
        .split_once(crate::tenant::TENANT_SEPARATOR)
        .map_or(stored, |(_, key)| key);
    key.starts_with(RESERVED_PREFIX)
}

/// Counters for status reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterStats {
    /// Readable objects.
    pub objects: u64,
    /// Objects whose write is in progress.
    pub writes_in_progress: u64,
    /// Space real clients reserved ahead of their keys: writes in progress under a
    /// name starting with [`RESERVED_PREFIX`] (not counted in `writes_in_progress`).
    pub reserved_writes: u64,
    /// Every mounted segment.
    pub segments: Vec<SegmentUsage>,
    /// Remote real clients heartbeating.
    pub clients: u64,
    /// Objects evicted since start.
    pub evicted_objects: u64,
    /// Objects with a copy on a real client's SSD tier.
    pub objects_on_disk: u64,
    /// Maintenance passes (eviction, lease and client expiry, task timeouts) run since
    /// start: one every 50 ms, by the master's one maintenance task.
    pub maintenance_rounds: u64,
    /// High availability: the leader's term and standbys (`None` without it).
    pub ha: Option<HaStatus>,
}

/// The masters of a highly available cluster, as the leader sees them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HaStatus {
    /// The leader's term.
    pub epoch: u64,
    /// The leader's RPC address.
    pub leader: String,
    /// The standbys pulling from it.
    pub standbys: Vec<StandbyStatus>,
}

/// One standby as its leader sees it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandbyStatus {
    /// Its RPC address.
    pub address: String,
    /// True when the leader's writes wait for it.
    pub in_sync: bool,
    /// Changes it has not acknowledged yet.
    pub behind: u64,
}

/// What a master says about itself when a real client connects.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterHello {
    /// The master's protocol version.
    pub version: u32,
    /// Random id of the master process (changes when it restarts).
    pub master_id: u128,
    /// The master's read lease, in milliseconds.
    pub lease_ttl_ms: u64,
    /// The leader's term under high availability (the etcd revision that elected it);
    /// 0 for a master without high availability.
    pub epoch: u64,
}

/// Owner id of segments mounted by the master's own process (never expire).
pub const LOCAL_OWNER: u128 = 0;

/// What a heartbeat tells the real client.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ClientStatus {
    /// Known and alive.
    Ok,
    /// Unknown to this master: mount your segments again.
    NeedRemount,
    /// Another instance mounted this client's segment name; it no longer owns a segment
    /// and must not mount it again.
    Displaced,
}

/// What a task does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskKind {
    /// Add replicas on the target segments.
    Copy,
    /// Move the replica from a source segment to a target segment.
    Move,
}

/// Progress of a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskStatus {
    /// Waiting for its executor.
    Pending,
    /// Being executed.
    Running,
    /// Done.
    Success,
    /// Failed with the given error code value.
    Failed(i32),
}

impl TaskStatus {
    /// True once the task succeeded or failed.
    pub fn is_finished(self) -> bool {
        matches!(self, TaskStatus::Success | TaskStatus::Failed(_))
    }
}

/// A task as reported by `query_task`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskInfo {
    /// Task id.
    pub id: u128,
    /// Copy or move.
    pub kind: TaskKind,
    /// The object.
    pub key: String,
    /// Target segment names.
    pub targets: Vec<String>,
    /// Progress.
    pub status: TaskStatus,
}

/// Work handed to the real client that executes a task: copy `source` (a replica in
/// its own segment) into every one of `targets` (space the master allocated), then
/// report with `finish_task`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskWork {
    /// Task id.
    pub id: u128,
    /// Copy or move.
    pub kind: TaskKind,
    /// The object.
    pub key: String,
    /// Where the bytes are now.
    pub source: ReplicaDescriptor,
    /// Where to copy them.
    pub targets: Vec<ReplicaDescriptor>,
}

/// Work for one real client's SSD tier.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct OffloadWork {
    /// Objects to write to disk: key and size.
    pub store: Vec<(String, u64)>,
    /// Keys whose files to delete (removed or replaced objects).
    pub delete: Vec<String>,
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
    /// Where its owner's transfer engine listens.
    pub endpoint: String,
}
