//! [`RemoteMaster`]: a `mooncake_master` reached over tarpc, reconnected on failure.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarpc::client::RpcError;
use tarpc::context;
use tokio::sync::Mutex;

use crate::error::{CodeResult, ErrorCode};
use crate::protocol::auth::{self, ClusterSecret};
use crate::protocol::blocking::{BlockingCallError, BlockingClient};
use crate::protocol::codec;
use crate::protocol::master_rpc::{
    MASTER_PROTOCOL_VERSION, MAX_MASTER_BATCH, MasterHello, MasterRpcClient, MasterRpcRequest,
    MasterRpcResponse,
};
use crate::protocol::rpc::WriteMode;
use crate::tenant::Tenant;
use crate::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

use super::replication::{ChangeBatch, SnapshotPart};
use super::{
    ClientStatus, LeaseBudget, LeasedReplicas, Master, MasterFuture, MasterStats, OffloadWork,
    PutStarted, TaskInfo, TaskWork,
};

/// Deadline of one call to a remote master.
const MASTER_DEADLINE: Duration = Duration::from_secs(10);

/// Deadline of connecting to the master.
const CONNECT_DEADLINE: Duration = Duration::from_secs(3);

/// Most idle blocking connections kept for callers' threads.
const MAX_IDLE_BLOCKING: usize = 16;

/// A blocking connection to the master.
type BlockingMaster = BlockingClient<MasterRpcRequest, MasterRpcResponse>;

/// A live connection and what the master said when it was opened.
#[derive(Clone, Debug)]
struct Connection {
    client: MasterRpcClient,
    hello: MasterHello,
}

/// A remote master and the current connections to it: a tarpc client for the
/// runtime's tasks, and blocking connections for application threads (embedded mode).
/// A connection that fails is dropped; the next call opens another.
#[derive(Debug)]
pub struct RemoteMaster {
    address: String,
    /// Proves our cluster membership to the master (`None`: unauthenticated).
    secret: Option<Arc<ClusterSecret>>,
    connection: Mutex<Option<Connection>>,
    blocking: parking_lot::Mutex<Vec<BlockingMaster>>,
    /// How long a call on an application's thread polls for the answer before the
    /// thread sleeps (see [`crate::spin`]).
    caller_spin: std::time::Duration,
}

thread_local! {
    static ON_CALLER_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `work` with this thread marked as an application's calling thread: remote
/// master calls made meanwhile use a blocking connection on this thread (one wake-up
/// per round trip) instead of the runtime's tarpc client.
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

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
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
            caller_spin: std::time::Duration::ZERO,
        }
    }

    /// The same master, with calls on an application's thread polling up to `spin` for
    /// their answer before the thread sleeps (`MOONCAKE_CLIENT_SPIN_US`).
    pub fn with_caller_spin(mut self, spin: std::time::Duration) -> Self {
        self.caller_spin = spin;
        self
    }

    /// The master's address.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// High availability: the changes a standby pulls from its leader (see
    /// [`MasterRpc::ha_pull`](crate::protocol::master_rpc::MasterRpc::ha_pull)).
    pub async fn ha_pull(
        &self,
        standby: (u128, String),
        epoch: u64,
        from: u64,
        wait: Duration,
    ) -> CodeResult<ChangeBatch> {
        let wait_ms = u32::try_from(wait.as_millis()).unwrap_or(u32::MAX);
        self.call(move |c| async move {
            let mut context = ctx();
            context.deadline = Instant::now() + wait + MASTER_DEADLINE;
            let (id, address) = standby;
            c.ha_pull(context, id, address, epoch, from, wait_ms).await
        })
        .await
        .and_then(|answer| answer)
    }

    /// High availability: one part of the leader's snapshot (part 0 takes a new one).
    pub async fn ha_snapshot(&self, standby: u128, part: u32) -> CodeResult<SnapshotPart> {
        self.call(move |c| async move { c.ha_snapshot(ctx(), standby, part).await })
            .await
            .and_then(|answer| answer)
    }

    async fn connect(&self) -> CodeResult<Connection> {
        let stream = tokio::time::timeout(
            CONNECT_DEADLINE,
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
        Ok(Connection { client, hello })
    }

    /// The live connection, connecting first if needed. The lock is not held while
    /// connecting, so calls on a live connection never wait behind a reconnect; when
    /// two calls connect at once, the first connection stored is kept.
    async fn connection(&self) -> CodeResult<Connection> {
        if let Some(connection) = self.connection.lock().await.as_ref() {
            return Ok(connection.clone());
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

    /// Runs one tarpc call; a transport failure (other than a deadline) drops the
    /// connection so the next call reconnects.
    async fn call<T, F>(&self, call: impl FnOnce(MasterRpcClient) -> F) -> CodeResult<T>
    where
        F: Future<Output = Result<T, RpcError>>,
    {
        let connection = self.connection().await?;
        match call(connection.client).await {
            Ok(value) => Ok(value),
            Err(error) => {
                if !matches!(error, RpcError::DeadlineExceeded) {
                    self.forget().await;
                }
                Err(rpc_error(&error))
            }
        }
    }

    /// Like [`call`](Self::call) with `args`, but on an application's calling thread
    /// `request(args)` goes over a blocking connection from this thread (see
    /// [`as_caller_thread`]) and `unpack` takes the answer out of the response.
    async fn call_or_block<A, T, F>(
        &self,
        args: A,
        request: impl FnOnce(A) -> MasterRpcRequest,
        unpack: impl FnOnce(MasterRpcResponse) -> Option<T>,
        call: impl FnOnce(MasterRpcClient, A) -> F,
    ) -> CodeResult<T>
    where
        F: Future<Output = Result<T, RpcError>>,
    {
        if on_caller_thread() {
            return self
                .call_blocking(request(args))
                .and_then(|answer| unpack(answer).ok_or(ErrorCode::RPC_FAIL));
        }
        self.call(|client| call(client, args)).await
    }

    /// Opens a blocking connection and checks the master's protocol version.
    fn connect_blocking(&self) -> CodeResult<BlockingMaster> {
        let address = std::net::ToSocketAddrs::to_socket_addrs(&self.address)
            .ok()
            .and_then(|mut addresses| addresses.next())
            .ok_or(ErrorCode::RPC_FAIL)?;
        let stream =
            std::net::TcpStream::connect_timeout(&address, CONNECT_DEADLINE).map_err(|error| {
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
        let mut client = BlockingClient::new(stream)
            .map_err(|_| ErrorCode::RPC_FAIL)?
            .with_spin(self.caller_spin);
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
        self.call_blocking_during(request, || {})
    }

    /// [`call_blocking`](Self::call_blocking), running `work` (exactly once, whatever
    /// the outcome) after the request is sent and before its answer is read.
    fn call_blocking_during(
        &self,
        request: MasterRpcRequest,
        work: impl FnOnce(),
    ) -> CodeResult<MasterRpcResponse> {
        let pooled = self.blocking.lock().pop();
        let client = match pooled {
            Some(client) => Ok(client),
            None => self.connect_blocking(),
        };
        let sent = client.and_then(|mut client| match client.send(request, MASTER_DEADLINE) {
            Ok(sent) => Ok((client, sent)),
            Err(error) => Err(self.blocking_failed(&error)),
        });
        work();
        let (mut client, sent) = sent?;
        match client.receive(sent) {
            Ok(answer) => {
                let mut idle = self.blocking.lock();
                if idle.len() < MAX_IDLE_BLOCKING {
                    idle.push(client);
                }
                Ok(answer)
            }
            Err(error) => Err(self.blocking_failed(&error)),
        }
    }

    /// Logs a failed blocking call; the code its caller gets.
    fn blocking_failed(&self, error: &BlockingCallError) -> ErrorCode {
        tracing::debug!(address = %self.address, %error, "master call failed");
        blocking_error(error)
    }
}

/// Sends `items` in calls of at most [`MAX_MASTER_BATCH`] items, one after another;
/// a failed call (or an answer of the wrong length) fails each of its items.
async fn chunked<I, T, F>(items: Vec<I>, mut call: impl FnMut(Vec<I>) -> F) -> Vec<CodeResult<T>>
where
    F: Future<Output = CodeResult<Vec<CodeResult<T>>>>,
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

/// Takes the answer out of response variant `$variant`.
macro_rules! unpack {
    ($variant:ident) => {
        |response| match response {
            MasterRpcResponse::$variant(answer) => Some(answer),
            _ => None,
        }
    };
}

impl Master for RemoteMaster {
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>> {
        Box::pin(async { self.connection().await.map(|c| c.hello) })
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn mount_segment(
        &self,
        client: u128,
        name: String,
        capacity: u64,
        endpoint: String,
    ) -> MasterFuture<'_, CodeResult<SegmentId>> {
        Box::pin(async move {
            self.call(move |c| async move {
                c.mount_segment(ctx(), client, name, capacity, endpoint)
                    .await
            })
            .await?
        })
    }

    fn unmount_client(&self, client: u128) -> MasterFuture<'_, CodeResult<()>> {
        Box::pin(async move {
            self.call(move |c| async move { c.unmount_client(ctx(), client).await })
                .await?
        })
    }

    fn heartbeat(&self, client: u128) -> MasterFuture<'_, CodeResult<ClientStatus>> {
        Box::pin(async move {
            self.call(move |c| async move { c.heartbeat(ctx(), client).await })
                .await
                .and_then(|answer| answer)
        })
    }

    fn put_start(
        &self,
        items: Vec<(String, u64)>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> MasterFuture<'_, Vec<CodeResult<PutStarted>>> {
        Box::pin(async move {
            chunked(items, |chunk| {
                let config = config.clone();
                self.call_or_block(
                    (chunk, config),
                    |(items, config)| MasterRpcRequest::PutStart {
                        items,
                        config,
                        mode,
                    },
                    unpack!(PutStart),
                    move |c, (items, config)| async move {
                        c.put_start(ctx(), items, config, mode).await
                    },
                )
            })
            .await
        })
    }

    fn put_commit(
        &self,
        items: Vec<(String, u64, String)>,
    ) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        Box::pin(async move {
            chunked(items, |chunk| {
                self.call_or_block(
                    chunk,
                    |items| MasterRpcRequest::PutCommit { items },
                    unpack!(PutCommit),
                    move |c, items| async move { c.put_commit(ctx(), items).await },
                )
            })
            .await
        })
    }

    fn put_commit_during<'a>(
        &'a self,
        items: Vec<(String, u64, String)>,
        work: Box<dyn FnOnce() + Send + 'a>,
    ) -> MasterFuture<'a, Vec<CodeResult<()>>> {
        Box::pin(async move {
            // The runtime's tarpc client sends from its own task: only a caller's thread
            // holds the request in its hands between sending and reading the answer.
            if !on_caller_thread() || items.len() > MAX_MASTER_BATCH {
                work();
                return self.put_commit(items).await;
            }
            let count = items.len();
            let answers = self
                .call_blocking_during(MasterRpcRequest::PutCommit { items }, work)
                .and_then(|answer| unpack!(PutCommit)(answer).ok_or(ErrorCode::RPC_FAIL))
                .and_then(|answers: Vec<CodeResult<()>>| {
                    if answers.len() == count {
                        Ok(answers)
                    } else {
                        Err(ErrorCode::RPC_FAIL)
                    }
                });
            answers.unwrap_or_else(|code| (0..count).map(|_| Err(code)).collect())
        })
    }

    fn put_end(&self, items: Vec<(String, u64)>) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        Box::pin(async move {
            chunked(items, |chunk| {
                self.call_or_block(
                    chunk,
                    |items| MasterRpcRequest::PutEnd { items },
                    unpack!(PutEnd),
                    move |c, items| async move { c.put_end(ctx(), items).await },
                )
            })
            .await
        })
    }

    fn put_revoke(&self, items: Vec<(String, u64)>) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        Box::pin(async move {
            chunked(items, |chunk| {
                self.call_or_block(
                    chunk,
                    |items| MasterRpcRequest::PutRevoke { items },
                    unpack!(PutRevoke),
                    move |c, items| async move { c.put_revoke(ctx(), items).await },
                )
            })
            .await
        })
    }

    fn get_replica_list(
        &self,
        keys: Vec<String>,
        lease: Option<Duration>,
    ) -> MasterFuture<'_, Vec<CodeResult<LeasedReplicas>>> {
        let lease_ms = lease.map(millis);
        Box::pin(async move {
            chunked(keys, |chunk| {
                self.call_or_block(
                    chunk,
                    |keys| MasterRpcRequest::GetReplicaList { keys, lease_ms },
                    unpack!(GetReplicaList),
                    move |c, keys| async move { c.get_replica_list(ctx(), keys, lease_ms).await },
                )
            })
            .await
            .into_iter()
            .map(|result| result.map(|(replicas, ms)| (replicas, Duration::from_millis(ms))))
            .collect()
        })
    }

    fn exist(
        &self,
        keys: Vec<String>,
        budget: LeaseBudget,
    ) -> MasterFuture<'_, Vec<CodeResult<Option<u64>>>> {
        // Calls go one after another: each gets what the ones before left of the budget.
        let left = std::sync::Mutex::new(budget);
        Box::pin(async move {
            chunked(keys, |chunk| {
                let budget = *left.lock().unwrap_or_else(|e| e.into_inner());
                let left = &left;
                async move {
                    let bytes = budget.0;
                    let found = self
                        .call_or_block(
                            chunk,
                            |keys| MasterRpcRequest::Exist {
                                keys,
                                max_leased_bytes: bytes,
                            },
                            unpack!(Exist),
                            move |c, keys| async move { c.exist(ctx(), keys, bytes).await },
                        )
                        .await?;
                    let mut after = budget;
                    for size in found
                        .iter()
                        .filter_map(|f| f.as_ref().ok().copied().flatten())
                    {
                        after.take(size);
                    }
                    *left.lock().unwrap_or_else(|e| e.into_inner()) = after;
                    Ok(found)
                }
            })
            .await
        })
    }

    fn object_size(&self, key: String) -> MasterFuture<'_, CodeResult<u64>> {
        Box::pin(async move {
            self.call_or_block(
                key,
                |key| MasterRpcRequest::ObjectSize { key },
                unpack!(ObjectSize),
                move |c, key| async move { c.object_size(ctx(), key).await },
            )
            .await?
        })
    }

    fn replica_desc(
        &self,
        keys: Vec<String>,
    ) -> MasterFuture<'_, Vec<CodeResult<Vec<ReplicaDescriptor>>>> {
        Box::pin(async move {
            chunked(keys, |chunk| {
                self.call(move |c| async move { c.replica_desc(ctx(), chunk).await })
            })
            .await
        })
    }

    fn remove(&self, keys: Vec<String>, force: bool) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        Box::pin(async move {
            chunked(keys, |chunk| {
                self.call_or_block(
                    chunk,
                    |keys| MasterRpcRequest::Remove { keys, force },
                    unpack!(Remove),
                    move |c, keys| async move { c.remove(ctx(), keys, force).await },
                )
            })
            .await
        })
    }

    fn clear_replicas(
        &self,
        keys: Vec<String>,
        segment: Option<String>,
    ) -> MasterFuture<'_, Vec<CodeResult<()>>> {
        Box::pin(async move {
            chunked(keys, |chunk| {
                self.call_or_block(
                    (chunk, segment.clone()),
                    |(keys, segment)| MasterRpcRequest::ClearReplicas { keys, segment },
                    unpack!(ClearReplicas),
                    |c, (keys, segment)| async move { c.clear_replicas(ctx(), keys, segment).await },
                )
            })
            .await
        })
    }

    fn remove_by_regex(
        &self,
        tenant: Tenant,
        pattern: String,
        force: bool,
    ) -> MasterFuture<'_, CodeResult<u64>> {
        let tenant = tenant.name().to_string();
        Box::pin(async move {
            self.call(
                move |c| async move { c.remove_by_regex(ctx(), tenant, pattern, force).await },
            )
            .await?
        })
    }

    fn remove_all(&self, tenant: Tenant, force: bool) -> MasterFuture<'_, CodeResult<u64>> {
        let tenant = tenant.name().to_string();
        Box::pin(async move {
            self.call(move |c| async move { c.remove_all(ctx(), tenant, force).await })
                .await?
        })
    }

    fn create_copy_task(
        &self,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> MasterFuture<'_, CodeResult<u128>> {
        Box::pin(async move {
            self.call(move |c| async move { c.create_copy_task(ctx(), key, targets, id).await })
                .await?
        })
    }

    fn create_move_task(
        &self,
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> MasterFuture<'_, CodeResult<u128>> {
        Box::pin(async move {
            self.call(
                move |c| async move { c.create_move_task(ctx(), key, source, target, id).await },
            )
            .await?
        })
    }

    fn query_task(&self, id: u128) -> MasterFuture<'_, CodeResult<TaskInfo>> {
        Box::pin(async move {
            self.call(move |c| async move { c.query_task(ctx(), id).await })
                .await?
        })
    }

    fn fetch_tasks(&self, client: u128, max: u32) -> MasterFuture<'_, CodeResult<Vec<TaskWork>>> {
        Box::pin(async move {
            self.call(move |c| async move { c.fetch_tasks(ctx(), client, max).await })
                .await
                .and_then(|answer| answer)
        })
    }

    fn finish_task(
        &self,
        client: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> MasterFuture<'_, CodeResult<()>> {
        Box::pin(async move {
            self.call(move |c| async move { c.finish_task(ctx(), client, id, outcome).await })
                .await?
        })
    }

    fn enable_offload(&self, client: u128) -> MasterFuture<'_, CodeResult<()>> {
        Box::pin(async move {
            self.call(move |c| async move { c.enable_offload(ctx(), client).await })
                .await?
        })
    }

    fn offload_fetch(&self, client: u128, max: u32) -> MasterFuture<'_, CodeResult<OffloadWork>> {
        Box::pin(async move {
            self.call(move |c| async move { c.offload_fetch(ctx(), client, max).await })
                .await?
        })
    }

    fn offload_done(
        &self,
        client: u128,
        objects: Vec<(String, u64)>,
    ) -> MasterFuture<'_, CodeResult<()>> {
        Box::pin(async move {
            self.call(move |c| async move { c.offload_done(ctx(), client, objects).await })
                .await?
        })
    }

    fn disk_evicted(&self, client: u128, keys: Vec<String>) -> MasterFuture<'_, CodeResult<()>> {
        Box::pin(async move {
            self.call(move |c| async move { c.disk_evicted(ctx(), client, keys).await })
                .await
                .and_then(|answer| answer)
        })
    }

    fn stats(&self) -> MasterFuture<'_, CodeResult<MasterStats>> {
        Box::pin(async {
            self.call(move |c| async move { c.stats(ctx()).await })
                .await
                .and_then(|answer| answer)
        })
    }
}
