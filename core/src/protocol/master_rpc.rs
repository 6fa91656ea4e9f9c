//! The RPC service of the master, spoken by real clients over TCP.

use serde::{Deserialize, Serialize};

use crate::error::CodeResult;
use crate::master_api::replication::{ChangeBatch, SnapshotPart};
use crate::master_api::{ClientStatus, MasterStats, OffloadWork, PutStarted, TaskInfo, TaskWork};
use crate::protocol::rpc::WriteMode;
use crate::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

/// Version of the master protocol; clients and master must agree exactly.
pub const MASTER_PROTOCOL_VERSION: u32 = 11;

/// Most items one batch call may carry; a larger batch is refused with
/// `INVALID_PARAMS` for every item (clients split their batches at this size).
pub const MAX_MASTER_BATCH: usize = 4096;

/// Answer to [`MasterRpc::hello`].
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

/// Calls a real client makes to the master.
#[tarpc::service]
pub trait MasterRpc {
    /// Version handshake: `INVALID_VERSION` when the versions differ.
    async fn hello(version: u32) -> CodeResult<MasterHello>;
    /// Mounts a segment owned by `client`, reachable at `endpoint`.
    async fn mount_segment(
        client: u128,
        name: String,
        capacity: u64,
        endpoint: String,
    ) -> CodeResult<SegmentId>;
    /// Unmounts every segment of `client` (clean shutdown).
    async fn unmount_client(client: u128) -> CodeResult<()>;
    /// Liveness; `NeedRemount` when the master does not know the client.
    async fn heartbeat(client: u128) -> CodeResult<ClientStatus>;
    /// Starts writes (puts or upserts) of `(key, size)` items: one result per item, in
    /// order.
    async fn put_start(
        items: Vec<(String, u64)>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<PutStarted>>;
    /// Completes writes, each named by `(key, write id)`.
    async fn put_end(items: Vec<(String, u64)>) -> Vec<CodeResult<()>>;
    /// Abandons writes, each named by `(key, write id)`.
    async fn put_revoke(items: Vec<(String, u64)>) -> Vec<CodeResult<()>>;
    /// For each key: the replicas of the readable object and the lease length in ms;
    /// grants a lease. `lease_ms` asks for a shorter lease than the default (`None`:
    /// the default).
    async fn get_replica_list(
        keys: Vec<String>,
        lease_ms: Option<u64>,
    ) -> Vec<CodeResult<(Vec<ReplicaDescriptor>, u64)>>;
    /// The size of each readable key (`None`: not stored). The objects found are leased
    /// in order while the bytes leased before them stay below `max_leased_bytes`
    /// (`None`: every one).
    async fn exist(
        keys: Vec<String>,
        max_leased_bytes: Option<u64>,
    ) -> Vec<CodeResult<Option<u64>>>;
    /// Size of an object.
    async fn object_size(key: String) -> CodeResult<u64>;
    /// Replica descriptors per key, without a lease.
    async fn replica_desc(keys: Vec<String>) -> Vec<CodeResult<Vec<ReplicaDescriptor>>>;
    /// Removes objects.
    async fn remove(keys: Vec<String>, force: bool) -> Vec<CodeResult<()>>;
    /// Clears objects unused for one lease TTL: their replicas on `segment`, or whole.
    async fn clear_replicas(keys: Vec<String>, segment: Option<String>) -> Vec<CodeResult<()>>;
    /// Removes the objects of `tenant` whose key matches a regex.
    async fn remove_by_regex(tenant: String, pattern: String, force: bool) -> CodeResult<u64>;
    /// Removes every object of `tenant`.
    async fn remove_all(tenant: String, force: bool) -> CodeResult<u64>;
    /// Creates a copy task.
    async fn create_copy_task(key: String, targets: Vec<String>, id: u128) -> CodeResult<u128>;
    /// Creates a move task.
    async fn create_move_task(
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> CodeResult<u128>;
    /// The state of a task.
    async fn query_task(id: u128) -> CodeResult<TaskInfo>;
    /// Up to `max` tasks for real client `client` to execute (space on the targets
    /// allocated).
    async fn fetch_tasks(client: u128, max: u32) -> CodeResult<Vec<TaskWork>>;
    /// Reports the outcome of a task (`Err(code)` when it failed).
    async fn finish_task(client: u128, id: u128, outcome: Result<(), i32>) -> CodeResult<()>;
    /// Registers the SSD tier of real client `client` (`UNABLE_OFFLOAD` when the
    /// master runs without `--enable_offload`).
    async fn enable_offload(client: u128) -> CodeResult<()>;
    /// Work queued for `client`'s SSD tier (at most `max` objects to write).
    async fn offload_fetch(client: u128, max: u32) -> CodeResult<OffloadWork>;
    /// Objects `client` has on disk (written, or found at startup).
    async fn offload_done(client: u128, objects: Vec<(String, u64)>) -> CodeResult<()>;
    /// Disk copies `client` is about to delete.
    async fn disk_evicted(client: u128, keys: Vec<String>) -> CodeResult<()>;
    /// Object counts and segment usage.
    async fn stats() -> CodeResult<MasterStats>;
    /// High availability, a standby (its id and RPC address) to its leader: the changes
    /// from sequence number `from` of term `epoch` on (acknowledging everything before
    /// `from`), waiting up to `wait_ms` for one. `OPLOG_ENTRY_NOT_FOUND` when they are
    /// not kept any more (or the term differs): install a snapshot first.
    async fn ha_pull(
        standby: u128,
        address: String,
        epoch: u64,
        from: u64,
        wait_ms: u32,
    ) -> CodeResult<ChangeBatch>;
    /// High availability, a standby to its leader: part `part` of a snapshot (part 0
    /// takes a new one).
    async fn ha_snapshot(standby: u128, part: u32) -> CodeResult<SnapshotPart>;
    /// Completes writes started under another name, each named by `(reserved name,
    /// write id, key)` (see `Master::put_commit`).
    async fn put_commit(items: Vec<(String, u64, String)>) -> Vec<CodeResult<()>>;
}
