//! Serving the master over TCP (tarpc + postcard), and its maintenance loop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use std::net::SocketAddr;
use tarpc::context::Context;
use tarpc::server::BaseChannel;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::auth::{self, ClusterSecret};
use mooncake_core::protocol::codec;
use mooncake_core::protocol::master_rpc::{
    MASTER_PROTOCOL_VERSION, MAX_MASTER_BATCH, MasterHello, MasterRpc, MasterRpcRequest,
};
use mooncake_core::protocol::rpc::WriteMode;
use mooncake_core::protocol::serving::serve_connection;
use mooncake_core::tenant::Tenant;
use mooncake_core::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

use mooncake_core::master_api::{
    ClientStatus, LeaseBudget, Master, MasterStats, OffloadWork, PutStarted, TaskInfo, TaskWork,
};
use mooncake_core::op_metrics::OpMetrics;

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

/// Every item of a batch larger than [`MAX_MASTER_BATCH`] fails with `INVALID_PARAMS`
/// (clients split their batches at that size).
fn oversized<T>(len: usize) -> Option<Vec<CodeResult<T>>> {
    (len > MAX_MASTER_BATCH).then(|| (0..len).map(|_| Err(ErrorCode::INVALID_PARAMS)).collect())
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

    /// Counts one call of `op` that started at `started` and returns its result.
    fn counted<T>(
        &self,
        op: RpcOp,
        started: Instant,
        bytes: u64,
        result: CodeResult<T>,
    ) -> CodeResult<T> {
        self.metrics
            .record(op as usize, started.elapsed(), bytes, &result);
        result
    }

    /// Counts each item of a batch call of `op`.
    fn counted_all<T>(
        &self,
        op: RpcOp,
        started: Instant,
        results: Vec<CodeResult<T>>,
    ) -> Vec<CodeResult<T>> {
        let elapsed = started.elapsed();
        for result in &results {
            self.metrics.record(op as usize, elapsed, 0, result);
        }
        results
    }
}

impl MasterRpc for MasterHandler {
    async fn hello(self, _: Context, version: u32) -> CodeResult<MasterHello> {
        if version != MASTER_PROTOCOL_VERSION {
            return Err(ErrorCode::INVALID_VERSION);
        }
        self.master.hello().await
    }

    async fn mount_segment(
        self,
        _: Context,
        client: u128,
        name: String,
        capacity: u64,
        endpoint: String,
    ) -> CodeResult<SegmentId> {
        let started = Instant::now();
        let result = self
            .master
            .mount_segment(client, name, capacity, endpoint)
            .await;
        self.counted(RpcOp::MountSegment, started, capacity, result)
    }

    async fn unmount_client(self, _: Context, client: u128) -> CodeResult<()> {
        self.master.unmount_client(client).await
    }

    async fn heartbeat(self, _: Context, client: u128) -> CodeResult<ClientStatus> {
        let started = Instant::now();
        let status = self.master.heartbeat(client).await;
        self.counted(RpcOp::Heartbeat, started, 0, status)
    }

    async fn put_start(
        self,
        _: Context,
        items: Vec<(String, u64)>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<PutStarted>> {
        if let Some(refused) = oversized(items.len()) {
            return refused;
        }
        let started = Instant::now();
        let sizes: Vec<u64> = items.iter().map(|(_, size)| *size).collect();
        let results = self.master.put_start(items, config, mode).await;
        let elapsed = started.elapsed();
        for (result, size) in results.iter().zip(sizes) {
            let bytes = if result.is_ok() { size } else { 0 };
            self.metrics
                .record(RpcOp::PutStart as usize, elapsed, bytes, result);
        }
        results
    }

    async fn put_end(self, _: Context, items: Vec<(String, u64)>) -> Vec<CodeResult<()>> {
        if let Some(refused) = oversized(items.len()) {
            return refused;
        }
        let started = Instant::now();
        let results = self.master.put_end(items).await;
        self.counted_all(RpcOp::PutEnd, started, results)
    }

    async fn put_commit(
        self,
        _: Context,
        items: Vec<(String, u64, String)>,
    ) -> Vec<CodeResult<()>> {
        if let Some(refused) = oversized(items.len()) {
            return refused;
        }
        let started = Instant::now();
        let results = self.master.put_commit(items).await;
        self.counted_all(RpcOp::PutEnd, started, results)
    }

    async fn put_revoke(self, _: Context, items: Vec<(String, u64)>) -> Vec<CodeResult<()>> {
        if let Some(refused) = oversized(items.len()) {
            return refused;
        }
        let started = Instant::now();
        let results = self.master.put_revoke(items).await;
        self.counted_all(RpcOp::PutRevoke, started, results)
    }

    async fn get_replica_list(
        self,
        _: Context,
        keys: Vec<String>,
        lease_ms: Option<u64>,
    ) -> Vec<CodeResult<(Vec<ReplicaDescriptor>, u64)>> {
        if let Some(refused) = oversized(keys.len()) {
            return refused;
        }
        let started = Instant::now();
        let lease = lease_ms.map(Duration::from_millis);
        let results = self.master.get_replica_list(keys, lease).await;
        let results = results
            .into_iter()
            .map(|result| {
                result.map(|(replicas, lease)| {
                    (
                        replicas,
                        u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
                    )
                })
            })
            .collect();
        self.counted_all(RpcOp::GetReplicaList, started, results)
    }

    async fn exist(
        self,
        _: Context,
        keys: Vec<String>,
        max_leased_bytes: Option<u64>,
    ) -> Vec<CodeResult<Option<u64>>> {
        if let Some(refused) = oversized(keys.len()) {
            return refused;
        }
        let started = Instant::now();
        let results = self.master.exist(keys, LeaseBudget(max_leased_bytes)).await;
        self.counted_all(RpcOp::Exist, started, results)
    }

    async fn object_size(self, _: Context, key: String) -> CodeResult<u64> {
        self.master.object_size(key).await
    }

    async fn replica_desc(
        self,
        _: Context,
        keys: Vec<String>,
    ) -> Vec<CodeResult<Vec<ReplicaDescriptor>>> {
        if let Some(refused) = oversized(keys.len()) {
            return refused;
        }
        self.master.replica_desc(keys).await
    }

    async fn remove(self, _: Context, keys: Vec<String>, force: bool) -> Vec<CodeResult<()>> {
        if let Some(refused) = oversized(keys.len()) {
            return refused;
        }
        let started = Instant::now();
        let results = self.master.remove(keys, force).await;
        self.counted_all(RpcOp::Remove, started, results)
    }

    async fn clear_replicas(
        self,
        _: Context,
        keys: Vec<String>,
        segment: Option<String>,
    ) -> Vec<CodeResult<()>> {
        if let Some(refused) = oversized(keys.len()) {
            return refused;
        }
        let started = Instant::now();
        let results = self.master.clear_replicas(keys, segment).await;
        self.counted_all(RpcOp::Remove, started, results)
    }

    async fn remove_by_regex(
        self,
        _: Context,
        tenant: String,
        pattern: String,
        force: bool,
    ) -> CodeResult<u64> {
        let tenant = Tenant::new(&tenant).map_err(|_| ErrorCode::INVALID_PARAMS)?;
        self.master.remove_by_regex(tenant, pattern, force).await
    }

    async fn remove_all(self, _: Context, tenant: String, force: bool) -> CodeResult<u64> {
        let tenant = Tenant::new(&tenant).map_err(|_| ErrorCode::INVALID_PARAMS)?;
        self.master.remove_all(tenant, force).await
    }

    async fn create_copy_task(
        self,
        _: Context,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> CodeResult<u128> {
        let started = Instant::now();
        let result = self.master.create_copy_task(key, targets, id).await;
        self.counted(RpcOp::Task, started, 0, result)
    }

    async fn create_move_task(
        self,
        _: Context,
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> CodeResult<u128> {
        let started = Instant::now();
        let result = self.master.create_move_task(key, source, target, id).await;
        self.counted(RpcOp::Task, started, 0, result)
    }

    async fn query_task(self, _: Context, id: u128) -> CodeResult<TaskInfo> {
        self.master.query_task(id).await
    }

    async fn fetch_tasks(self, _: Context, client: u128, max: u32) -> CodeResult<Vec<TaskWork>> {
        self.master.fetch_tasks(client, max).await
    }

    async fn finish_task(
        self,
        _: Context,
        client: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> CodeResult<()> {
        self.master.finish_task(client, id, outcome).await
    }

    async fn enable_offload(self, _: Context, client: u128) -> CodeResult<()> {
        self.master.enable_offload(client).await
    }

    async fn offload_fetch(self, _: Context, client: u128, max: u32) -> CodeResult<OffloadWork> {
        self.master.offload_fetch(client, max).await
    }

    async fn offload_done(
        self,
        _: Context,
        client: u128,
        objects: Vec<(String, u64)>,
    ) -> CodeResult<()> {
        self.master.offload_done(client, objects).await
    }

    async fn disk_evicted(self, _: Context, client: u128, keys: Vec<String>) -> CodeResult<()> {
        self.master.disk_evicted(client, keys).await
    }

    async fn stats(self, _: Context) -> CodeResult<MasterStats> {
        self.master.stats().await
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
    !matches!(
        request,
        MasterRpcRequest::RemoveByRegex { .. }
            | MasterRpcRequest::RemoveAll { .. }
            | MasterRpcRequest::HaPull { .. }
            | MasterRpcRequest::HaSnapshot { .. }
    )
}

/// Under high availability a write waits for its replication: only reads answer at
/// once.
fn is_quick_read(request: &MasterRpcRequest) -> bool {
    matches!(
        request,
        MasterRpcRequest::Hello { .. }
            | MasterRpcRequest::Heartbeat { .. }
            | MasterRpcRequest::GetReplicaList { .. }
            | MasterRpcRequest::Exist { .. }
            | MasterRpcRequest::ObjectSize { .. }
            | MasterRpcRequest::ReplicaDesc { .. }
            | MasterRpcRequest::QueryTask { .. }
            | MasterRpcRequest::OffloadFetch { .. }
            | MasterRpcRequest::Stats { .. }
    )
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
