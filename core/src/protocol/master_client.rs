//! [`RemoteMaster`]: a `mooncake_master` reached over tarpc, reconnected on failure.
//! It forwards each [`MasterRequest`] as it is, from the runtime's tarpc client or,
//! on an application's calling thread, over a blocking connection of that thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarpc::client::RpcError;
use tarpc::context;
use tokio::sync::Mutex;

use crate::error::{CodeResult, ErrorCode};
use crate::master_api::replication::{ChangeBatch, SnapshotPart};
use crate::master_api::{
    CallShape, MASTER_PROTOCOL_VERSION, Master, MasterFuture, MasterHello, MasterRequest,
    MasterResponse,
};
use crate::protocol::auth::{self, ClusterSecret};
use crate::protocol::blocking::{BlockingCallError, BlockingClient};
use crate::protocol::codec;
use crate::protocol::master_rpc::{MasterRpcClient, MasterRpcRequest, MasterRpcResponse};

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
        self.rpc(move |c| async move {
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
        self.rpc(move |c| async move { c.ha_snapshot(ctx(), standby, part).await })
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
    async fn rpc<T, F>(&self, call: impl FnOnce(MasterRpcClient) -> F) -> CodeResult<T>
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

/// The answer to a call of `shape`: `answer` when it answers it, else the call failed
/// (a transport failure's code, or `RPC_FAIL` for an answer of another shape).
fn checked(shape: CallShape, answer: CodeResult<MasterResponse>) -> MasterResponse {
    match answer {
        Ok(response) if shape.answered_by(&response) => response,
        Ok(_) => shape.failed(ErrorCode::RPC_FAIL),
        Err(code) => shape.failed(code),
    }
}

/// The master call's answer out of a blocking connection's response.
fn unpack_call(response: MasterRpcResponse) -> CodeResult<MasterResponse> {
    match response {
        MasterRpcResponse::Call(answer) => Ok(answer),
        _ => Err(ErrorCode::RPC_FAIL),
    }
}

impl Master for RemoteMaster {
    fn hello(&self) -> MasterFuture<'_, CodeResult<MasterHello>> {
        Box::pin(async { self.connection().await.map(|c| c.hello) })
    }

    fn is_remote(&self) -> bool {
        true
    }

    fn call(&self, request: MasterRequest) -> MasterFuture<'_, MasterResponse> {
        Box::pin(async move {
            let shape = request.shape();
            let answer = if on_caller_thread() {
                self.call_blocking(MasterRpcRequest::Call { request })
                    .and_then(unpack_call)
            } else {
                self.rpc(move |c| async move { c.call(ctx(), request).await })
                    .await
            };
            checked(shape, answer)
        })
    }

    fn call_during<'a>(
        &'a self,
        request: MasterRequest,
        work: Box<dyn FnOnce() + Send + 'a>,
    ) -> MasterFuture<'a, MasterResponse> {
        Box::pin(async move {
            // The runtime's tarpc client sends from its own task: only a caller's thread
            // holds the request in its hands between sending and reading the answer.
            if !on_caller_thread() {
                work();
                return self.call(request).await;
            }
            let shape = request.shape();
            let answer = self
                .call_blocking_during(MasterRpcRequest::Call { request }, work)
                .and_then(unpack_call);
            checked(shape, answer)
        })
    }
}
