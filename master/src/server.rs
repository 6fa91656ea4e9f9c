//! Serving the master over TCP (tarpc + postcard), and its maintenance loop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::net::SocketAddr;
use tarpc::context::Context;
use tarpc::server::BaseChannel;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::failpoint;
use mooncake_core::master_api::{
    CallKind, MASTER_PROTOCOL_VERSION, MAX_MASTER_BATCH, Master, MasterCall, MasterHello,
    MasterRequest, MasterResponse,
};
use mooncake_core::op_metrics::OpMetrics;
use mooncake_core::protocol::auth::{self, ClusterSecret};
use mooncake_core::protocol::codec;
use mooncake_core::protocol::master_rpc::{MasterRpc, MasterRpcRequest};
use mooncake_core::protocol::serving::serve_connection;

use super::MasterService;
use crate::ha::node::HaNode;
use mooncake_core::master_api::replication::{ChangeBatch, SnapshotPart};

/// How often maintenance (liveness, eviction, expired holds) runs.
pub const MAINTENANCE_INTERVAL: Duration = Duration::from_millis(50);

/// Serves one connection's requests against a master: any [`Master`], in this process
/// or (for a relay) another one.
#[derive(Clone, Debug)]
pub struct MasterHandler {
    /// The master.
    pub master: Arc<dyn Master>,
    /// Where each call is counted (the `mooncake_master_*` metrics).
    pub metrics: Arc<OpMetrics>,
    /// The master under high availability, which also serves its standbys.
    pub ha: Option<Arc<HaNode>>,
}

/// The master calls that are counted in `mooncake_master_*` metrics.
#[derive(Clone, Copy, Debug)]
enum RpcOp {
    PutStart,
    PutEnd,
    PutRevoke,
    GetReplicaList,
    Exist,
    Remove,
    MountSegment,
    Heartbeat,
    Task,
}

/// Metric label of each [`RpcOp`], in declaration order.
pub const RPC_NAMES: &[&str] = &[
    "put_start",
    "put_end",
    "put_revoke",
    "get_replica_list",
    "exist",
    "remove",
    "mount_segment",
    "heartbeat",
    "task",
];

impl RpcOp {
    /// The metric `call` is counted under (`None`: not counted).
    fn of(call: MasterCall) -> Option<RpcOp> {
        Some(match call {
            MasterCall::PutStart => RpcOp::PutStart,
            MasterCall::PutEnd | MasterCall::PutCommit => RpcOp::PutEnd,
            MasterCall::PutRevoke => RpcOp::PutRevoke,
            MasterCall::GetReplicaList => RpcOp::GetReplicaList,
            MasterCall::Exist => RpcOp::Exist,
            MasterCall::Remove | MasterCall::ClearReplicas => RpcOp::Remove,
            MasterCall::MountSegment => RpcOp::MountSegment,
            MasterCall::Heartbeat => RpcOp::Heartbeat,
            MasterCall::CreateCopyTask | MasterCall::CreateMoveTask => RpcOp::Task,
            _ => return None,
        })
    }
}

/// The bytes each item of `request` counts when it succeeds: the sizes of the writes a
/// `put_start` starts, the capacity a `mount_segment` adds.
fn item_bytes(request: &MasterRequest) -> Vec<u64> {
    match request {
        MasterRequest::PutStart { items, .. } => items.iter().map(|(_, size)| *size).collect(),
        MasterRequest::MountSegment { capacity, .. } => vec![*capacity],
        _ => Vec::new(),
    }
}

impl MasterHandler {
    /// A handler serving `master` that counts calls in `metrics`.
    pub fn new(master: Arc<dyn Master>, metrics: Arc<OpMetrics>) -> Self {
        MasterHandler {
            master,
            metrics,
            ha: None,
        }
    }

    /// A handler serving a master under high availability.
    pub fn highly_available(node: Arc<HaNode>) -> Self {
        let metrics = Arc::clone(node.master().rpc_metrics());
        MasterHandler {
            master: Arc::clone(&node) as Arc<dyn Master>,
            metrics,
            ha: Some(node),
        }
    }

    /// Counts each result of `response` under `op`.
    fn count(&self, op: RpcOp, elapsed: Duration, bytes: &[u64], response: &MasterResponse) {
        let mut index = 0;
        response.for_each_outcome(|outcome| {
            let counted = match outcome {
                Ok(()) => bytes.get(index).copied().unwrap_or(0),
                Err(_) => 0,
            };
            self.metrics.record(op as usize, elapsed, counted, &outcome);
            index += 1;
        });
    }
}

impl MasterRpc for MasterHandler {
    async fn hello(self, _: Context, version: u32) -> CodeResult<MasterHello> {
        if version != MASTER_PROTOCOL_VERSION {
            return Err(ErrorCode::INVALID_VERSION);
        }
        self.master.hello().await
    }

    async fn call(self, _: Context, request: MasterRequest) -> MasterResponse {
        let shape = request.shape();
        if shape.items > MAX_MASTER_BATCH {
            return shape.failed(ErrorCode::INVALID_PARAMS);
        }
        let Some(op) = RpcOp::of(shape.call) else {
            return self.master.call(request).await;
        };
        let bytes = item_bytes(&request);
        let started = Instant::now();
        let response = self.master.call(request).await;
        self.count(op, started.elapsed(), &bytes, &response);
        if failpoint::ENABLED
            && failpoint::hit(&format!("{FAILPOINT_ANSWER_PREFIX}{:?}", shape.call)).is_some()
        {
            return shape.failed(ErrorCode::RPC_FAIL);
        }
        response
    }

    async fn ha_pull(
        self,
        _: Context,
        standby: u128,
        address: String,
        epoch: u64,
        from: u64,
        wait_ms: u32,
    ) -> CodeResult<ChangeBatch> {
        let node = self.ha.ok_or(ErrorCode::UNAVAILABLE_IN_CURRENT_MODE)?;
        let wait = Duration::from_millis(u64::from(wait_ms));
        node.pull((standby, address), epoch, from, wait).await
    }

    async fn ha_snapshot(self, _: Context, standby: u128, part: u32) -> CodeResult<SnapshotPart> {
        let node = self.ha.ok_or(ErrorCode::UNAVAILABLE_IN_CURRENT_MODE)?;
        node.snapshot(standby, part).await
    }
}

/// Prefix of the failpoints of the master's answers, one per call
/// (`master.answer.PutEnd`, `master.answer.Remove`, ... : the names of
/// [`MasterCall`](mooncake_core::master_api::MasterCall)): when one fires, the call is
/// carried out and its answer replaced by `RPC_FAIL`, as when the connection drops
/// after the master made the change.
pub const FAILPOINT_ANSWER_PREFIX: &str = "master.answer.";

/// Connections that may be authenticating at once; further ones are closed at once.
pub const MAX_PENDING_AUTH: usize = 64;

/// Accepts real clients on `listener` until `shutdown` turns true. With `secret`, each
/// connection first proves cluster membership ([`auth`]); one that does not is closed
/// with a log line naming the peer. A connection whose frames do not decode is closed;
/// the others are not affected.
pub async fn serve(
    listener: TcpListener,
    handler: MasterHandler,
    secret: Option<Arc<ClusterSecret>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let pending = Arc::new(Semaphore::new(MAX_PENDING_AUTH));
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let _ = stream.set_nodelay(true);
                    tracing::debug!(%peer, "master connection");
                    let Ok(permit) = Arc::clone(&pending).try_acquire_owned() else {
                        tracing::warn!(%peer, "refusing a master connection: {MAX_PENDING_AUTH} connections are already authenticating");
                        continue;
                    };
                    tokio::spawn(admit(stream, peer, secret.clone(), permit, handler.clone()));
                }
                Err(error) => {
                    tracing::warn!(%error, "master accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            () = mooncake_core::process::stop_requested(&mut shutdown) => break,
        }
    }
}

/// Authenticates one connection (when the master has a secret), then serves it.
async fn admit(
    mut stream: TcpStream,
    peer: SocketAddr,
    secret: Option<Arc<ClusterSecret>>,
    permit: OwnedSemaphorePermit,
    handler: MasterHandler,
) {
    if let Some(secret) = secret
        && let Err(error) =
            auth::authenticate_server_async(&mut stream, &secret, auth::Channel::Master).await
    {
        tracing::warn!(%peer, %error, "refused a master connection that did not prove cluster membership");
        return;
    }
    drop(permit);
    let inline = if handler.ha.is_some() {
        is_quick_read
    } else {
        is_quick
    };
    serve_connection(
        BaseChannel::with_defaults(codec::serving_transport(stream)),
        handler.serve(),
        inline,
        |request, serve| {
            tokio::spawn(request.execute(serve));
        },
    )
    .await;
}

/// Every master call answers from memory at once, except the scans of the whole index
/// and a standby's pulls and snapshots.
fn is_quick(request: &MasterRpcRequest) -> bool {
    match request {
        MasterRpcRequest::Hello { .. } => true,
        MasterRpcRequest::Call { request } => request.shape().call.kind() != CallKind::IndexScan,
        _ => false,
    }
}

/// Under high availability a write waits for its replication: only reads answer at
/// once.
fn is_quick_read(request: &MasterRpcRequest) -> bool {
    match request {
        MasterRpcRequest::Hello { .. } => true,
        MasterRpcRequest::Call { request } => request.shape().call.kind() == CallKind::Read,
        _ => false,
    }
}

/// Runs [`MasterService::maintenance`] every [`MAINTENANCE_INTERVAL`] until `shutdown`.
pub async fn maintain(master: Arc<MasterService>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(MAINTENANCE_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                let master = Arc::clone(&master);
                let _ = tokio::task::spawn_blocking(move || master.maintenance()).await;
            }
            () = mooncake_core::process::stop_requested(&mut shutdown) => break,
        }
    }
}
