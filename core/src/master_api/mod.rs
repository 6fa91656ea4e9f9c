//! The master seam: [`Master`] is the whole surface of a master as one async trait.
//!
//! Two implementations answer it alike (the conformance suite in the `mooncake-master`
//! crate checks that they do): the in-process `MasterService` of the master crate
//! (embedded in `mooncake_client`, or behind `mooncake_master`'s RPC server) and
//! [`RemoteMaster`], a `mooncake_master` reached over tarpc. Code that needs a master
//! holds an `Arc<dyn Master>` and does not care which it has.
//!
//! Keys are the master's own names (tenant-scoped already, see [`crate::tenant`]);
//! batch calls answer one result per item, in order, and a transport failure fails every
//! item of the call with `RPC_FAIL` or `RPC_TIMEOUT`.

mod remote;
pub mod replication;
mod wire;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use crate::error::CodeResult;
use crate::protocol::master_rpc::MasterHello;
use crate::protocol::rpc::WriteMode;
use crate::tenant::Tenant;
use crate::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

pub use remote::{RemoteMaster, as_caller_thread};
pub use wire::{
    ClientStatus, HaStatus, LOCAL_OWNER, MasterStats, OffloadWork, PutStarted, RESERVED_PREFIX,
    SegmentUsage, StandbyStatus, TaskInfo, TaskKind, TaskStatus, TaskWork, is_reservation,
};

/// The future a [`Master`] call returns.
pub type MasterFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A readable object's replicas and the read lease granted with them.
pub type LeasedReplicas = (Vec<ReplicaDescriptor>, Duration);

/// How an existence check spends its lease budget: the objects found are leased in
/// order while the bytes leased before them stay below the budget; the rest are
/// answered without a lease. `None` leases every object found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseBudget(pub Option<u64>);

impl LeaseBudget {
    /// Whether the next object found, of `size` bytes, is leased; counts it when it is.
    pub fn take(&mut self, size: u64) -> bool {
        match &mut self.0 {
            None => true,
            Some(0) => false,
            Some(left) => {
                *left = left.saturating_sub(size);
                true
            }
        }
    }
}

/// Everything a real client (or the master's RPC server) asks of a master.
///
/// Writes are two-phase: [`put_start`](Master::put_start) allocates space and records
/// the object as *processing*, the writer copies the bytes, then
/// [`put_end`](Master::put_end) makes it readable (or [`put_revoke`](Master::put_revoke)
/// undoes it). A put never overwrites an existing key; an upsert replaces it once its
/// new version is complete. Reads grant a lease during which a non-forced remove is
/// refused with `OBJECT_HAS_LEASE`.
pub trait Master: Send + Sync + std::fmt::Debug {
    /// The master's identity and read lease; a remote master also checks that it speaks
    /// our protocol version (`INVALID_VERSION` otherwise).
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>>;

    /// True when the master is another process (it expects heartbeats, and it can be
    /// unreachable).
    fn is_remote(&self) -> bool;

    /// Mounts a segment of `capacity` bytes owned by real client `client`, whose
    /// transfer engine listens at `endpoint`. A name another live client mounted is
    /// taken over (that client is told `Displaced`).
    fn mount_segment(
        &self,
        client: u128,
        name: String,
        capacity: u64,
        endpoint: String,
    ) -> MasterFuture<'_, CodeResult<SegmentId>>;

    /// Unmounts every segment of `client` (its clean shutdown).
    fn unmount_client(&self, client: u128) -> MasterFuture<'_, CodeResult<()>>;

    /// Liveness of `client`: `NeedRemount` when the master does not know it.
    fn heartbeat(&self, client: u128) -> MasterFuture<'_, CodeResult<ClientStatus>>;

    /// Starts writes (puts or upserts) of `(key, size)` items.
    fn put_start(
        &self,
        items: Vec<(String, u64)>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> MasterFuture<'_, Vec<CodeResult<PutStarted>>>;

    /// Completes writes, each named by `(key, write id)`.
    fn put_end(&self, items: Vec<(String, u64)>) -> MasterFuture<'_, Vec<CodeResult<()>>>;

    /// Abandons writes, each named by `(key, write id)`: their space is freed.
    fn put_revoke(&self, items: Vec<(String, u64)>) -> MasterFuture<'_, Vec<CodeResult<()>>>;

    /// Completes writes started under another name (a client's reservation), each named
    /// by `(reserved name, write id, key)`: the write becomes the readable object `key`.
    /// `OBJECT_ALREADY_EXISTS` when `key` exists (the reservation is left as it was).
    fn put_commit(
        &self,
        items: Vec<(String, u64, String)>,
    ) -> MasterFuture<'_, Vec<CodeResult<()>>>;

    /// [`put_commit`](Master::put_commit), running `work` (exactly once, whatever the
    /// outcome) while the request travels to a remote master and its answer comes back.
    /// The master may show the keys readable before `work` returns: a caller that copies
    /// their bytes in `work` keeps readers of those bytes waiting until it has. By
    /// default `work` runs first, then the commit is sent.
    fn put_commit_during<'a>(
        &'a self,
        items: Vec<(String, u64, String)>,
        work: Box<dyn FnOnce() + Send + 'a>,
    ) -> MasterFuture<'a, Vec<CodeResult<()>>> {
        work();
        self.put_commit(items)
    }

    /// The replicas of each readable object, with a read lease of `lease` (`None`: the
    /// master's default; a longer one than the default is cut to it).
    fn get_replica_list(
        &self,
        keys: Vec<String>,
        lease: Option<Duration>,
    ) -> MasterFuture<'_, Vec<CodeResult<LeasedReplicas>>>;

    /// The size of each readable key (`None`: not stored); the objects found are leased
    /// for the master's read lease within `budget` (see [`LeaseBudget`]).
    fn exist(
        &self,
        keys: Vec<String>,
        budget: LeaseBudget,
    ) -> MasterFuture<'_, Vec<CodeResult<Option<u64>>>>;

    /// The size of a readable object.
    fn object_size(&self, key: String) -> MasterFuture<'_, CodeResult<u64>>;

    /// The replica descriptors of each key, without a lease.
    fn replica_desc(
        &self,
        keys: Vec<String>,
    ) -> MasterFuture<'_, Vec<CodeResult<Vec<ReplicaDescriptor>>>>;

    /// Removes objects (`force`: even while leased).
    fn remove(&self, keys: Vec<String>, force: bool) -> MasterFuture<'_, Vec<CodeResult<()>>>;

    /// Clears objects nobody read or wrote for one lease TTL: their memory replicas on
    /// the segment named `segment`, or (`None`) the whole objects (upstream's
    /// `BatchReplicaClear`). One result per key: `OBJECT_HAS_LEASE` when it was used
    /// within the TTL, `OBJECT_NOT_FOUND` when it has no replica to clear.
    fn clear_replicas(
        &self,
        keys: Vec<String>,
        segment: Option<String>,
    ) -> MasterFuture<'_, Vec<CodeResult<()>>>;

    /// Removes the objects of `tenant` whose key (without the tenant's prefix) matches
    /// `pattern`; answers how many were removed.
    fn remove_by_regex(
        &self,
        tenant: Tenant,
        pattern: String,
        force: bool,
    ) -> MasterFuture<'_, CodeResult<u64>>;

    /// Removes every object of `tenant`; answers how many were removed.
    fn remove_all(&self, tenant: Tenant, force: bool) -> MasterFuture<'_, CodeResult<u64>>;

    /// Creates task `id`: copy `key` to the segments named `targets`.
    fn create_copy_task(
        &self,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> MasterFuture<'_, CodeResult<u128>>;

    /// Creates task `id`: move `key`'s replica from segment `source` to `target`.
    fn create_move_task(
        &self,
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> MasterFuture<'_, CodeResult<u128>>;

    /// The state of a task.
    fn query_task(&self, id: u128) -> MasterFuture<'_, CodeResult<TaskInfo>>;

    /// Up to `max` tasks for `client` to execute (space on the targets allocated).
    fn fetch_tasks(&self, client: u128, max: u32) -> MasterFuture<'_, CodeResult<Vec<TaskWork>>>;

    /// Reports the outcome of a task `client` executed (`Err(code)`: it failed).
    fn finish_task(
        &self,
        client: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> MasterFuture<'_, CodeResult<()>>;

    /// Registers the SSD tier of `client` (`UNABLE_OFFLOAD` when the master runs
    /// without offload).
    fn enable_offload(&self, client: u128) -> MasterFuture<'_, CodeResult<()>>;

    /// Work queued for `client`'s SSD tier (at most `max` objects to write).
    fn offload_fetch(&self, client: u128, max: u32) -> MasterFuture<'_, CodeResult<OffloadWork>>;

    /// Objects `client` has on disk, as `(key, size)` (written, or found at startup).
    fn offload_done(
        &self,
        client: u128,
        objects: Vec<(String, u64)>,
    ) -> MasterFuture<'_, CodeResult<()>>;

    /// Disk copies `client` is about to delete.
    fn disk_evicted(&self, client: u128, keys: Vec<String>) -> MasterFuture<'_, CodeResult<()>>;

    /// Object counts and segment usage.
    fn stats(&self) -> MasterFuture<'_, CodeResult<MasterStats>>;
}
