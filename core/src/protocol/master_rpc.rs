//! The RPC service of the master, spoken by real clients (and standbys) over TCP: a
//! version handshake, then every master call as one [`MasterRequest`] (see
//! [`crate::master_api`]), plus the two calls a standby makes to its leader.

use crate::error::CodeResult;
use crate::master_api::replication::{ChangeBatch, SnapshotPart};
use crate::master_api::{MasterHello, MasterRequest, MasterResponse};

pub use crate::master_api::{MASTER_PROTOCOL_VERSION, MAX_MASTER_BATCH};

/// Calls a real client makes to the master.
#[tarpc::service]
pub trait MasterRpc {
    /// Version handshake: `INVALID_VERSION` when the versions differ.
    async fn hello(version: u32) -> CodeResult<MasterHello>;
    /// One master call; a batch of more than [`MAX_MASTER_BATCH`] items fails every
    /// item with `INVALID_PARAMS`.
    async fn call(request: MasterRequest) -> MasterResponse;
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
}
