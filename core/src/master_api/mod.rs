//! The master seam: [`Master`] is the whole surface of a master as one async call,
//! taking a [`MasterRequest`] (every call declared once, in `call.rs`) and answering
//! its [`MasterResponse`]; [`MasterExt`] gives callers one typed helper per call.
//!
//! Implementations answer alike (the conformance suite in the `mooncake-master` crate
//! checks that they do): the in-process `MasterService` of the master crate (embedded
//! in `mooncake_client`, or behind `mooncake_master`'s RPC server), the remote client
//! in [`crate::protocol::master_client`] (a `mooncake_master` reached over tarpc), and
//! the high-availability wrappers of the master crate. Code that needs a master holds
//! an `Arc<dyn Master>` and does not care which it has.
//!
//! Keys are the master's own names (tenant-scoped already, see [`crate::tenant`]);
//! batch calls answer one result per item, in order, and a transport failure fails every
//! item of the call with `RPC_FAIL` or `RPC_TIMEOUT`.

mod call;
mod ext;
pub mod replication;
mod wire;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::CodeResult;
use crate::types::ReplicaDescriptor;

pub use call::{Answer, CallKind, CallShape, MasterCall, MasterRequest, MasterResponse};
pub use ext::MasterExt;
pub use wire::{
    ClientStatus, HaStatus, LOCAL_OWNER, MasterHello, MasterStats, OffloadWork, PutStarted,
    RESERVED_PREFIX, SegmentUsage, StandbyStatus, TaskInfo, TaskKind, TaskStatus, TaskWork,
    is_reservation,
};

/// Version of the master protocol; clients and master must agree exactly.
pub const MASTER_PROTOCOL_VERSION: u32 = 15;

/// Most items one batch call may carry; a larger batch is refused with
/// `INVALID_PARAMS` for every item (the [`MasterExt`] helpers split their batches at
/// this size).
pub const MAX_MASTER_BATCH: usize = 4096;

/// The future a [`Master`] call returns.
pub type MasterFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A readable object's replicas and the read lease granted with them.
pub type LeasedReplicas = (Vec<ReplicaDescriptor>, Duration);

/// How an existence check spends its lease budget: the objects found are leased in
/// order while the bytes leased before them stay below the budget; the rest are
/// answered without a lease. `None` leases every object found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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

/// A master: everything a real client (or the master's RPC server) asks of one, as
/// one call taking a [`MasterRequest`] and answering the [`MasterResponse`] of the same
/// variant. Callers use the typed helpers of [`MasterExt`].
///
/// Writes are two-phase: `put_start` allocates space and records the object as
/// *processing*, the writer copies the bytes, then `put_end` makes it readable (or
/// `put_revoke` undoes it). A put never overwrites an existing key; an upsert replaces
/// it once its new version is complete. Reads grant a lease during which a non-forced
/// remove is refused with `OBJECT_HAS_LEASE`.
pub trait Master: Send + Sync + std::fmt::Debug {
    /// The master's identity and read lease; a remote master also checks that it speaks
    /// our protocol version (`INVALID_VERSION` otherwise).
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>>;

    /// True when the master is another process (it expects heartbeats, and it can be
    /// unreachable).
    fn is_remote(&self) -> bool;

    /// Answers `request` with the response of the same variant, one result per item of
    /// a batch (a transport failure fails every item with `RPC_FAIL` or `RPC_TIMEOUT`).
    /// Batches are at most [`MAX_MASTER_BATCH`] items (the helpers split larger ones).
    fn call(&self, request: MasterRequest) -> MasterFuture<'_, MasterResponse>;

    /// [`call`](Master::call), running `work` (exactly once, whatever the outcome)
    /// while the request travels to a remote master and its answer comes back. The
    /// master may apply the request before `work` returns: a caller that copies bytes
    /// in `work` keeps readers of those bytes waiting until it has. By default `work`
    /// runs first, then the request is sent.
    fn call_during<'a>(
        &'a self,
        request: MasterRequest,
        work: Box<dyn FnOnce() + Send + 'a>,
    ) -> MasterFuture<'a, MasterResponse> {
        work();
        self.call(request)
    }
}
