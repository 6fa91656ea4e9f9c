//! The real client's link to its master: the embedded one (a direct call) or a remote
//! `mooncake_master` (tarpc over TCP, reconnected on failure).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarpc::client::RpcError;
use tarpc::context;
use tokio::sync::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master::{
    ClientStatus, MasterService, MasterStats, OffloadWork, PutStarted, TaskInfo, TaskWork,
};
use mooncake_core::protocol::auth::{self, ClusterSecret};
use mooncake_core::protocol::blocking::{BlockingCallError, BlockingClient};
use mooncake_core::protocol::codec;
use mooncake_core::protocol::master_rpc::{
    MASTER_PROTOCOL_VERSION, MAX_MASTER_BATCH, MasterRpcClient, MasterRpcRequest, MasterRpcResponse,
};
use mooncake_core::protocol::rpc::WriteMode;
use mooncake_core::tenant::Tenant;
use mooncake_core::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

/// Deadline of one call to a remote master.
const MASTER_DEADLINE: Duration = Duration::from_secs(10);

/// Most idle blocking connections kept for callers' threads.
const MAX_IDLE_BLOCKING: usize = 16;

/// A blocking connection to the master.
type BlockingMaster = BlockingClient<MasterRpcRequest, MasterRpcResponse>;

/// A remote master and the current connections to it: a tarpc client for the
/// runtime's tasks, and blocking connections for application threads (embedded mode).
#[derive(Debug)]
pub struct RemoteMaster {
    address: String,
    /// Proves our cluster membership to the master (`None`: unauthenticated).
    secret: Option<Arc<ClusterSecret>>,
    connection: Mutex<Option<MasterRpcClient>>,
    blocking: parking_lot::Mutex<Vec<BlockingMaster>>,
}

thread_local! {
    static ON_CALLER_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `work` with this thread marked as an application's calling thread: master
/// calls made meanwhile use a blocking connection on this thread (one wake-up per round
/// trip) instead of the runtime's tarpc client.
pub fn as_caller_thread<T>(work: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            ON_CALLER_THREAD.with(|flag| flag.set(self.0));
        }
    }
    let _reset = Reset(ON_CALLER_THREAD.with(|flag| flag.replace(true)));
    work()
}

fn on_caller_thread() -> bool {
    ON_CALLER_THREAD.with(std::cell::Cell::get)
}

/// Where the master is.
#[derive(Debug, Clone)]
pub enum MasterKind {
    /// In this process.
    Embedded(Arc<MasterService>),
    /// A `mooncake_master` over TCP.
    Remote(Arc<RemoteMaster>),
}

/// The master a real client uses, seen through the client's tenant: keys are scoped
/// on the way out and unscoped on the way back (see [`mooncake_core::tenant`]).
#[derive(Debug, Clone)]
pub struct MasterLink {
    kind: MasterKind,
    tenant: Tenant,
    /// Keys are the master's already (no scoping): the SSD tier's view.
    unscoped: bool,
    /// Lease asked for by reads (`None`: the master's default).
    read_lease: Option<Duration>,
}

fn ctx() -> context::Context {
    let mut ctx = context::current();
    ctx.deadline = Instant::now() + MASTER_DEADLINE;
    ctx
}

fn rpc_error(error: &RpcError) -> ErrorCode {
    match error {
        RpcError::DeadlineExceeded => ErrorCode::RPC_TIMEOUT,
        _ => ErrorCode::RPC_FAIL,
    }
}

impl RemoteMaster {
    /// A master at `address` (`host:port`); connects on first use, proving cluster
    /// membership with `secret` when given.
    pub fn new(address: String, secret: Option<Arc<ClusterSecret>>) -> Self {
        RemoteMaster {
            address,
            secret,
            connection: Mutex::new(None),
            blocking: parking_lot::Mutex::new(Vec::new()),
        }
    }

    /// The master's address.
    pub fn address(&self) -> &str {
        &self.address
    }

    async fn connect(&self) -> CodeResult<MasterRpcClient> {
        let stream = tokio::time::timeout(
            Duration::from_secs(3),
            tokio::net::TcpStream::connect(&self.address),
        )
        .await
        .map_err(|_| ErrorCode::RPC_TIMEOUT)?
        .map_err(|error| {
            tracing::debug!(address = %self.address, %error, "cannot reach the master");
            ErrorCode::RPC_FAIL
        })?;
        let _ = stream.set_nodelay(true);
        let mut stream = stream;
        if let Some(secret) = &self.secret {
            auth::authenticate_client_async(&mut stream, secret, auth::Channel::Master)
                .await
                .map_err(|error| self.refused(&error))?;
        }
        let client =
            MasterRpcClient::new(tarpc::client::Config::default(), codec::transport(stream))
                .spawn();
        let hello = client
            .hello(ctx(), MASTER_PROTOCOL_VERSION)
            .await
            .map_err(|e| rpc_error(&e))??;
        tracing::info!(address = %self.address, master = %format!("{:032x}", hello.master_id), "connected to the master");
        Ok(client)
    }

    /// The connected client, connecting first if needed. The lock is not held while
    /// connecting, so calls on a live connection never wait behind a reconnect; when
    /// two calls connect at once, the first connection stored is kept.
    async fn client(&self) -> CodeResult<MasterRpcClient> {
        if let Some(client) = self.connection.lock().await.as_ref() {
            return Ok(client.clone());
        }
        let fresh = self.connect().await?;
        let mut connection = self.connection.lock().await;
        Ok(connection.get_or_insert(fresh).clone())
    }

    /// The error of a connection that did not authenticate, logged with the reason.
    fn refused(&self, error: &auth::AuthError) -> ErrorCode {
        tracing::error!(
            address = %self.address,
            %error,
            "the master did not accept our cluster secret (or we did not accept its proof): check --cluster_secret_file on both sides"
        );
        ErrorCode::RPC_FAIL
    }

    async fn forget(&self) {
        *self.connection.lock().await = None;
    }

    /// Opens a blocking connection and checks the master's protocol version.
    fn connect_blocking(&self) -> CodeResult<BlockingMaster> {
        let address = std::net::ToSocketAddrs::to_socket_addrs(&self.address)
            .ok()
            .and_then(|mut addresses| addresses.next())
            .ok_or(ErrorCode::RPC_FAIL)?;
        let stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(3))
            .map_err(|error| {
                tracing::debug!(address = %self.address, %error, "cannot reach the master");
                ErrorCode::RPC_FAIL
            })?;
        if let Some(secret) = &self.secret {
            let mut stream = &stream;
            let _ = stream.set_read_timeout(Some(auth::AUTH_DEADLINE));
            let _ = stream.set_write_timeout(Some(auth::AUTH_DEADLINE));
            auth::authenticate_client(&mut stream, secret, auth::Channel::Master)
                .map_err(|error| self.refused(&error))?;
        }
        let mut client = BlockingClient::new(stream).map_err(|_| ErrorCode::RPC_FAIL)?;
        let hello = MasterRpcRequest::Hello {
            version: MASTER_PROTOCOL_VERSION,
        };
        match client.call(hello, MASTER_DEADLINE) {
            Ok(MasterRpcResponse::Hello(answer)) => answer.map(|_| client),
            Ok(_) => Err(ErrorCode::RPC_FAIL),
            Err(error) => Err(blocking_error(&error)),
        }
    }

    /// Calls the master on this thread over a pooled blocking connection; a failed
    /// connection is dropped (the next call opens another).
    fn call_blocking(&self, request: MasterRpcRequest) -> CodeResult<MasterRpcResponse> {
        let pooled = self.blocking.lock().pop();
        let mut client = match pooled {
            Some(client) => client,
            None => self.connect_blocking()?,
        };
        match client.call(request, MASTER_DEADLINE) {
            Ok(answer) => {
                let mut idle = self.blocking.lock();
                if idle.len() < MAX_IDLE_BLOCKING {
                    idle.push(client);
                }
                Ok(answer)
            }
            Err(error) => {
                tracing::debug!(address = %self.address, %error, "master call failed");
                Err(blocking_error(&error))
            }
        }
    }
}

fn blocking_error(error: &BlockingCallError) -> ErrorCode {
    match error {
        BlockingCallError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            ErrorCode::RPC_TIMEOUT
        }
        _ => ErrorCode::RPC_FAIL,
    }
}

/// Runs a call against the remote master; a transport failure drops the connection so
/// the next call reconnects.
macro_rules! remote {
    ($remote:expr, |$client:ident| $call:expr) => {
        async {
            let $client = $remote.client().await?;
            match $call.await {
                Ok(value) => Ok(value),
                Err(error) => {
                    if !matches!(error, RpcError::DeadlineExceeded) {
                        $remote.forget().await;
                    }
                    Err(rpc_error(&error))
                }
            }
        }
        .await
    };
}

/// The only result of a batch of one.
fn first<T>(results: Vec<CodeResult<T>>) -> CodeResult<T> {
    results
        .into_iter()
        .next()
        .unwrap_or(Err(ErrorCode::RPC_FAIL))
}

/// Sends `items` in calls of at most [`MAX_MASTER_BATCH`] items, one after another;
/// a failed call (or an answer of the wrong length) fails each of its items.
async fn chunked<I, T, F>(items: Vec<I>, mut call: impl FnMut(Vec<I>) -> F) -> Vec<CodeResult<T>>
where
    F: std::future::Future<Output = CodeResult<Vec<CodeResult<T>>>>,
{
    let mut results = Vec::with_capacity(items.len());
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        let chunk: Vec<I> = items.by_ref().take(MAX_MASTER_BATCH).collect();
        let n = chunk.len();
        match call(chunk).await {
            Ok(answers) if answers.len() == n => results.extend(answers),
            Ok(_) => results.extend((0..n).map(|_| Err(ErrorCode::RPC_FAIL))),
            Err(code) => results.extend((0..n).map(|_| Err(code))),
        }
    }
    results
}

/// Like `remote!`, but on an application's calling thread the request goes over a
/// blocking connection from this thread (see [`as_caller_thread`]).
macro_rules! remote_or_blocking {
    ($remote:expr, $variant:ident { $($field:ident: $value:expr),* $(,)? }, |$client:ident| $call:expr) => {
        if on_caller_thread() {
            match $remote.call_blocking(MasterRpcRequest::$variant { $($field: $value),* }) {
                Ok(MasterRpcResponse::$variant(answer)) => Ok(answer),
                Ok(_) => Err(ErrorCode::RPC_FAIL),
                Err(code) => Err(code),
            }
        } else {
            remote!($remote, |$client| $call)
        }
    };
}

impl MasterLink {
    /// A link to `kind` for the keys of `tenant`.
    pub fn new(kind: MasterKind, tenant: Tenant) -> Self {
        MasterLink {
            kind,
            tenant,
            unscoped: false,
            read_lease: None,
        }
    }

    /// The same master, for keys that are the master's own (tenant-scoped already),
    /// with reads leased for at most a second: the SSD tier's quick copies to disk.
    pub fn unscoped(&self) -> MasterLink {
        MasterLink {
            unscoped: true,
            read_lease: Some(Duration::from_secs(1)),
            ..self.clone()
        }
    }

    /// The master's name for `key`.
    pub fn scope<'a>(&self, key: &'a str) -> std::borrow::Cow<'a, str> {
        if self.unscoped {
            std::borrow::Cow::Borrowed(key)
        } else {
            self.tenant.scope(key)
        }
    }

    fn scope_all(&self, keys: Vec<String>) -> Vec<String> {
        if self.unscoped {
            keys
        } else {
            self.tenant.scope_all(keys)
        }
    }

    /// True when the master is a separate process (it expects heartbeats).
    pub fn is_remote(&self) -> bool {
        matches!(self.kind, MasterKind::Remote(_))
    }

    /// The tenant whose keys this link sees.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// Whether the master answers.
    pub async fn is_reachable(&self) -> bool {
        match &self.kind {
            MasterKind::Embedded(_) => true,
            MasterKind::Remote(remote) => remote.client().await.is_ok(),
        }
    }

    /// Mounts a segment for `client`.
    pub async fn mount_segment(
        &self,
        client: u128,
        name: &str,
        capacity: u64,
        endpoint: &str,
    ) -> CodeResult<SegmentId> {
        match &self.kind {
            MasterKind::Embedded(m) => m.mount_segment(name, capacity, client, endpoint),
            MasterKind::Remote(r) => remote!(r, |c| c.mount_segment(
                ctx(),
                client,
                name.to_string(),
                capacity,
                endpoint.to_string()
            ))?,
        }
    }

    /// Unmounts everything `client` mounted.
    pub async fn unmount_client(&self, client: u128) -> CodeResult<()> {
        match &self.kind {
            MasterKind::Embedded(m) => {
                m.remove_client(client);
                Ok(())
            }
            MasterKind::Remote(r) => remote!(r, |c| c.unmount_client(ctx(), client))?,
        }
    }

    /// Heartbeat.
    pub async fn heartbeat(&self, client: u128) -> CodeResult<ClientStatus> {
        match &self.kind {
            MasterKind::Embedded(_) => Ok(ClientStatus::Ok),
            MasterKind::Remote(r) => remote!(r, |c| c.heartbeat(ctx(), client)),
        }
    }

    /// Starts a write.
    pub async fn put_start(
        &self,
        key: &str,
        size: u64,
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> CodeResult<PutStarted> {
        first(self.put_start_many(&[(key, size)], config, mode).await)
    }

    /// Starts writes of `(key, size)` items: one master round trip for the batch.
    pub async fn put_start_many(
        &self,
        items: &[(&str, u64)],
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<PutStarted>> {
        match &self.kind {
            MasterKind::Embedded(m) => items
                .iter()
                .map(|(key, size)| {
                    let key = self.scope(key);
                    match mode {
                        WriteMode::Put => m.put_start(&key, *size, config),
                        WriteMode::Upsert => m.upsert_start(&key, *size, config),
                    }
                })
                .collect(),
            MasterKind::Remote(r) => {
                let scoped: Vec<(String, u64)> = items
                    .iter()
                    .map(|(key, size)| (self.scope(key).into_owned(), *size))
                    .collect();
                chunked(scoped, |chunk| async {
                    remote_or_blocking!(
                        r,
                        PutStart {
                            items: chunk,
                            config: config.clone(),
                            mode: mode
                        },
                        |c| c.put_start(ctx(), chunk, config.clone(), mode)
                    )
                })
                .await
            }
        }
    }

    /// Completes a write.
    pub async fn put_end(&self, key: &str, write_id: u64) -> CodeResult<()> {
        first(self.put_end_many(&[(key, write_id)]).await)
    }

    /// Completes writes named by `(key, write id)`: one round trip for the batch.
    pub async fn put_end_many(&self, items: &[(&str, u64)]) -> Vec<CodeResult<()>> {
        match &self.kind {
            MasterKind::Embedded(m) => items
                .iter()
                .map(|(key, id)| m.put_end(&self.scope(key), *id))
                .collect(),
            MasterKind::Remote(r) => {
                let scoped = self.scope_writes(items);
                chunked(scoped, |chunk| async {
                    remote_or_blocking!(r, PutEnd { items: chunk }, |c| c.put_end(ctx(), chunk))
                })
                .await
            }
        }
    }

    /// Abandons a write.
    pub async fn put_revoke(&self, key: &str, write_id: u64) -> CodeResult<()> {
        first(self.put_revoke_many(&[(key, write_id)]).await)
    }

    /// Abandons writes named by `(key, write id)`: one round trip for the batch.
    pub async fn put_revoke_many(&self, items: &[(&str, u64)]) -> Vec<CodeResult<()>> {
        match &self.kind {
            MasterKind::Embedded(m) => items
                .iter()
                .map(|(key, id)| m.put_revoke(&self.scope(key), *id))
                .collect(),
            MasterKind::Remote(r) => {
                let scoped = self.scope_writes(items);
                chunked(scoped, |chunk| async {
                    remote_or_blocking!(r, PutRevoke { items: chunk }, |c| c
                        .put_revoke(ctx(), chunk))
                })
                .await
            }
        }
    }

    fn scope_writes(&self, items: &[(&str, u64)]) -> Vec<(String, u64)> {
        items
            .iter()
            .map(|(key, id)| (self.scope(key).into_owned(), *id))
            .collect()
    }

    /// Replicas and lease of a readable object.
    pub async fn get_replica_list(
        &self,
        key: &str,
    ) -> CodeResult<(Vec<ReplicaDescriptor>, Duration)> {
        first(self.get_replica_lists(&[key]).await)
    }

    /// Replicas and lease of each readable object: one round trip for the batch.
    pub async fn get_replica_lists(
        &self,
        keys: &[&str],
    ) -> Vec<CodeResult<(Vec<ReplicaDescriptor>, Duration)>> {
        let lease = self.read_lease;
        match &self.kind {
            MasterKind::Embedded(m) => keys
                .iter()
                .map(|key| m.get_replica_list_leased(&self.scope(key), lease))
                .collect(),
            MasterKind::Remote(r) => {
                let lease_ms = lease.map(|l| u64::try_from(l.as_millis()).unwrap_or(u64::MAX));
                let scoped: Vec<String> = keys.iter().map(|k| self.scope(k).into_owned()).collect();
                chunked(scoped, |chunk| async move {
                    remote_or_blocking!(
                        r,
                        GetReplicaList {
                            keys: chunk,
                            lease_ms: lease_ms
                        },
                        |c| c.get_replica_list(ctx(), chunk, lease_ms)
                    )
                })
                .await
                .into_iter()
                .map(|result| result.map(|(replicas, ms)| (replicas, Duration::from_millis(ms))))
                .collect()
            }
        }
    }

    /// Existence per key.
    pub async fn exist(&self, keys: Vec<String>) -> Vec<CodeResult<bool>> {
        let keys = self.scope_all(keys);
        match &self.kind {
            MasterKind::Embedded(m) => keys.iter().map(|k| m.exist(k)).collect(),
            MasterKind::Remote(r) => {
                let n = keys.len();
                let result: CodeResult<_> =
                    remote_or_blocking!(r, Exist { keys: keys }, |c| c.exist(ctx(), keys));
                result.unwrap_or_else(|code| vec![Err(code); n])
            }
        }
    }

    /// Size of an object.
    pub async fn object_size(&self, key: &str) -> CodeResult<u64> {
        let scoped = self.scope(key);
        let key = scoped.as_ref();
        match &self.kind {
            MasterKind::Embedded(m) => m.object_size(key),
            MasterKind::Remote(r) => remote_or_blocking!(
                r,
                ObjectSize {
                    key: key.to_string()
                },
                |c| c.object_size(ctx(), key.to_string())
            )?,
        }
    }

    /// Replica descriptors per key.
    pub async fn replica_desc(&self, keys: Vec<String>) -> Vec<CodeResult<Vec<ReplicaDescriptor>>> {
        let keys = self.scope_all(keys);
        match &self.kind {
            MasterKind::Embedded(m) => keys.iter().map(|k| m.replica_descriptors(k)).collect(),
            MasterKind::Remote(r) => {
                let n = keys.len();
                let result: CodeResult<_> = remote!(r, |c| c.replica_desc(ctx(), keys));
                result.unwrap_or_else(|code| vec![Err(code); n])
            }
        }
    }

    /// Removes objects.
    pub async fn remove(&self, keys: Vec<String>, force: bool) -> Vec<CodeResult<()>> {
        let keys = self.scope_all(keys);
        match &self.kind {
            MasterKind::Embedded(m) => m.batch_remove(&keys, force),
            MasterKind::Remote(r) => {
                let n = keys.len();
                let result: CodeResult<_> = remote_or_blocking!(
                    r,
                    Remove {
                        keys: keys,
                        force: force
                    },
                    |c| c.remove(ctx(), keys, force)
                );
                result.unwrap_or_else(|code| vec![Err(code); n])
            }
        }
    }

    /// Removes objects matching a regex.
    pub async fn remove_by_regex(&self, pattern: String, force: bool) -> CodeResult<u64> {
        match &self.kind {
            MasterKind::Embedded(m) => m.remove_by_regex_of(&self.tenant, &pattern, force),
            MasterKind::Remote(r) => {
                let tenant = self.tenant.name().to_string();
                remote!(r, |c| c.remove_by_regex(ctx(), tenant, pattern, force))?
            }
        }
    }

    /// Removes every object.
    pub async fn remove_all(&self, force: bool) -> CodeResult<u64> {
        match &self.kind {
            MasterKind::Embedded(m) => Ok(m.remove_all_of(&self.tenant, force)),
            MasterKind::Remote(r) => {
                let tenant = self.tenant.name().to_string();
                remote!(r, |c| c.remove_all(ctx(), tenant, force))?
            }
        }
    }

    /// Creates a copy task.
    pub async fn create_copy_task(
        &self,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> CodeResult<u128> {
        let key = self.scope(&key).into_owned();
        match &self.kind {
            MasterKind::Embedded(m) => m.create_copy_task(&key, &targets, id),
            MasterKind::Remote(r) => remote!(r, |c| c.create_copy_task(ctx(), key, targets, id))?,
        }
    }

    /// Creates a move task.
    pub async fn create_move_task(
        &self,
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> CodeResult<u128> {
        let key = self.scope(&key).into_owned();
        match &self.kind {
            MasterKind::Embedded(m) => m.create_move_task(&key, &source, &target, id),
            MasterKind::Remote(r) => {
                remote!(r, |c| c.create_move_task(ctx(), key, source, target, id))?
            }
        }
    }

    /// The state of a task.
    pub async fn query_task(&self, id: u128) -> CodeResult<TaskInfo> {
        let mut info = match &self.kind {
            MasterKind::Embedded(m) => m.query_task(id),
            MasterKind::Remote(r) => remote!(r, |c| c.query_task(ctx(), id))?,
        }?;
        // Another tenant's task is not this tenant's business.
        info.key = self
            .tenant
            .unscope(&info.key)
            .ok_or(ErrorCode::TASK_NOT_FOUND)?
            .to_string();
        Ok(info)
    }

    /// Up to `max` copy/move tasks for `client` to execute.
    pub async fn fetch_tasks(&self, client: u128, max: u32) -> CodeResult<Vec<TaskWork>> {
        match &self.kind {
            MasterKind::Embedded(m) => Ok(m.fetch_tasks(client, max as usize)),
            MasterKind::Remote(r) => remote!(r, |c| c.fetch_tasks(ctx(), client, max)),
        }
    }

    /// Reports the outcome of a task `client` executed.
    pub async fn finish_task(
        &self,
        client: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> CodeResult<()> {
        match &self.kind {
            MasterKind::Embedded(m) => m.finish_task(client, id, outcome),
            MasterKind::Remote(r) => remote!(r, |c| c.finish_task(ctx(), client, id, outcome))?,
        }
    }

    /// Registers this node's SSD tier.
    pub async fn enable_offload(&self, client: u128) -> CodeResult<()> {
        match &self.kind {
            MasterKind::Embedded(m) => m.enable_offload(client),
            MasterKind::Remote(r) => remote!(r, |c| c.enable_offload(ctx(), client))?,
        }
    }

    /// Work queued for this node's SSD tier.
    pub async fn offload_fetch(&self, client: u128, max: u32) -> CodeResult<OffloadWork> {
        match &self.kind {
            MasterKind::Embedded(m) => m.offload_fetch(client, max as usize),
            MasterKind::Remote(r) => remote!(r, |c| c.offload_fetch(ctx(), client, max))?,
        }
    }

    /// Reports objects on this node's disk.
    pub async fn offload_done(&self, client: u128, objects: Vec<(String, u64)>) -> CodeResult<()> {
        match &self.kind {
            MasterKind::Embedded(m) => m.offload_done(client, &objects),
            MasterKind::Remote(r) => remote!(r, |c| c.offload_done(ctx(), client, objects))?,
        }
    }

    /// Reports disk copies about to be deleted.
    pub async fn disk_evicted(&self, client: u128, keys: Vec<String>) -> CodeResult<()> {
        match &self.kind {
            MasterKind::Embedded(m) => {
                m.disk_evicted(client, &keys);
                Ok(())
            }
            MasterKind::Remote(r) => remote!(r, |c| c.disk_evicted(ctx(), client, keys)),
        }
    }

    /// Object counts and segment usage.
    pub async fn stats(&self) -> CodeResult<MasterStats> {
        match &self.kind {
            MasterKind::Embedded(m) => Ok(m.stats()),
            MasterKind::Remote(r) => remote!(r, |c| c.stats(ctx())),
        }
    }
}
