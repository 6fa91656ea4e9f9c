//! [`DummyClient`]: the store API of an inference rank, forwarded to its real client.
//!
//! This module holds the client's state and the call machinery (reconnect, deadlines,
//! error mapping); the operations live in `write`, `read`, `query` and `pool`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tarpc::client::RpcError;
use tarpc::context;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::address::SocketAddress;
use mooncake_core::protocol::bounded::{Batch, Elements, MAX_REQUEST_ELEMENTS};
use mooncake_core::protocol::rpc::{CONTROL_DEADLINE, StatusReport};

use crate::connection::{ConnectError, Identity, Link, RealClient, Target};
use crate::memory::{DummyMemory, StagingBlock};

/// Environment variable naming the real client when `setup_dummy` gets no address.
pub const CLIENT_ADDRESS_ENV: &str = "MOONCAKE_CLIENT";

/// Why setting a client up failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The address did not parse.
    #[error(transparent)]
    Address(#[from] mooncake_core::protocol::address::AddressError),
    /// Shared memory could not be created.
    #[error("cannot create the dummy's shared memory: {0}")]
    Memory(#[from] mooncake_shm::ShmError),
    /// The runtime could not start.
    #[error("cannot start the client's I/O runtime: {0}")]
    Runtime(std::io::Error),
    /// The real client could not be reached or refused us.
    #[error(transparent)]
    Connect(#[from] ConnectError),
    /// The in-process real client could not start.
    #[error("cannot start the embedded real client: {0}")]
    Embedded(String),
    /// `MOONCAKE_CLIENT_SPIN_US` is not valid.
    #[error(transparent)]
    Spin(#[from] crate::spin::SpinError),
}

/// Result of [`DummyClient::health_check`], with upstream's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Connected and the real client reaches its master (0).
    Ok = 0,
    /// Closed or never set up (1).
    NotInitialized = 1,
    /// The real client or its master is unreachable (2).
    Unreachable = 2,
}

pub(crate) struct Inner {
    pub(crate) target: Target,
    pub(crate) identity: Identity,
    pub(crate) runtime: tokio::runtime::Runtime,
    pub(crate) memory: Mutex<DummyMemory>,
    pub(crate) link: Mutex<Link>,
    pub(crate) closed: AtomicBool,
    /// How long a call polls for its answer before the thread sleeps
    /// (`MOONCAKE_CLIENT_SPIN_US`; zero: it sleeps at once).
    pub(crate) spin: Duration,
    /// Keeps an in-process real client alive until [`DummyClient::close`] (or the
    /// last clone is dropped).
    pub(crate) embedded: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Calls that were sent and then failed in transport (deadline, lost connection):
    /// the real client may still be working on them.
    calls_in_doubt: AtomicU64,
    /// Bytes of staging withheld from reuse after calls in doubt.
    withheld: AtomicU64,
}

/// A dummy client: holds no store resources, only its shared memory and a link to its
/// real client. Cheap to clone; every clone shares the same link and memory.
#[derive(Clone)]
pub struct DummyClient {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for DummyClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DummyClient")
            .field("target", &self.inner.target.to_string())
            .finish_non_exhaustive()
    }
}

fn process_name() -> String {
    let program = std::env::args()
        .next()
        .and_then(|p| p.rsplit('/').next().map(str::to_string))
        .unwrap_or_else(|| "dummy".into());
    format!("{program}[{}]", std::process::id())
}

fn deadline(after: Duration) -> context::Context {
    let mut ctx = context::current();
    ctx.deadline = Instant::now() + after;
    ctx
}

/// `count` copies of the same failure (a batch that failed as a whole).
pub(crate) fn all_failed<T>(count: usize, code: ErrorCode) -> Vec<CodeResult<T>> {
    (0..count).map(|_| Err(code)).collect()
}

/// Maps an RPC failure to the code callers see.
fn rpc_code(error: &RpcError) -> ErrorCode {
    match error {
        RpcError::DeadlineExceeded => ErrorCode::RPC_TIMEOUT,
        _ => ErrorCode::RPC_FAIL,
    }
}

impl DummyClient {
    /// Creates the shared-memory pool (`mem_pool_size` bytes) and staging buffer
    /// (`local_buffer_size` bytes), connects to the real client at `server_address`
    /// (or `MOONCAKE_CLIENT`, or the default port 50052) and registers both.
    pub fn setup_dummy(
        mem_pool_size: u64,
        local_buffer_size: u64,
        server_address: Option<&str>,
    ) -> Result<Self, SetupError> {
        let from_env = std::env::var(CLIENT_ADDRESS_ENV).ok();
        let text = server_address
            .filter(|a| !a.trim().is_empty())
            .or(from_env.as_deref())
            .unwrap_or("127.0.0.1:50052");
        let address = SocketAddress::parse(text)?;
        Self::setup_with(
            Target::Socket(address),
            mem_pool_size,
            local_buffer_size,
            None,
        )
    }

    /// Creates the memory and connects to `target`.
    pub(crate) fn setup_with(
        target: Target,
        mem_pool_size: u64,
        local_buffer_size: u64,
        embedded: Option<Box<dyn std::any::Any + Send>>,
    ) -> Result<Self, SetupError> {
        // An in-process real client answers without a socket: nothing to spin for.
        let spin = if target.is_in_process() {
            Duration::ZERO
        } else {
            crate::spin::spin_from_env()?
        };
        let mut memory = DummyMemory::create(mem_pool_size, local_buffer_size)?;
        // Host allocations made before setup (an engine's KV pool) are zero-copy too.
        for allocation in crate::host_memory::all() {
            memory.add_host(allocation);
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(SetupError::Runtime)?;
        let identity = Identity {
            client_id: mooncake_core::ids::random_id(),
            name: process_name(),
        };
        let connected = {
            let _guard = runtime.enter();
            target.connect(&identity, &memory.offers())?
        };
        Ok(DummyClient {
            inner: Arc::new(Inner {
                target,
                identity,
                runtime,
                memory: Mutex::new(memory),
                link: Mutex::new(Link::Up(connected)),
                closed: AtomicBool::new(false),
                spin,
                embedded: Mutex::new(embedded),
                calls_in_doubt: AtomicU64::new(0),
                withheld: AtomicU64::new(0),
            }),
        })
    }

    /// The RPC client and the real client instance it reaches, reconnecting first if
    /// the link is down and its backoff elapsed.
    fn rpc(&self) -> CodeResult<(RealClient, u128)> {
        let mut link = self.inner.link.lock();
        if let Link::Up(connected) = &*link
            && connected.peer_hung_up()
        {
            tracing::warn!(target = %self.inner.target, "the real client closed the connection; will reconnect");
            *link = Link::down_now();
        }
        if let Link::Down { retry_at, .. } = &*link {
            if Instant::now() < *retry_at {
                return Err(ErrorCode::RPC_FAIL);
            }
            let offers = self.inner.memory.lock().offers();
            let _guard = self.inner.runtime.enter();
            match self.inner.target.connect(&self.inner.identity, &offers) {
                Ok(connected) => {
                    self.redeclare(&connected);
                    tracing::info!(target = %self.inner.target, instance = %format!("{:032x}", connected.instance_id), "reconnected to the real client; shared memory registered and ordinary buffers declared again");
                    *link = Link::Up(connected);
                }
                Err(error) => {
                    tracing::debug!(%error, "reconnect failed");
                    link.fail();
                    return Err(ErrorCode::RPC_FAIL);
                }
            }
        }
        match &*link {
            Link::Up(connected) => Ok((connected.rpc.clone(), connected.instance_id)),
            _ => Err(ErrorCode::RPC_FAIL),
        }
    }

    /// After a call to `instance` failed in transport: connects again at once (waiting
    /// up to the handshake's deadline for a process that is taking over) and answers
    /// the new RPC client when the same instance answers, handed over to a new process
    /// (`mooncake_client --takeover`): the old process answered every request it
    /// served, so the failed call was not served and may go again. A real client that
    /// restarted (a new instance) gets no second call.
    fn after_handover(&self, instance: u128) -> Option<RealClient> {
        if self.inner.target.is_in_process() || self.inner.closed.load(Ordering::Acquire) {
            return None;
        }
        let mut link = self.inner.link.lock();
        if let Link::Up(connected) = &*link
            && !connected.peer_hung_up()
        {
            // Another call reconnected meanwhile.
            return (connected.instance_id == instance).then(|| connected.rpc.clone());
        }
        let offers = self.inner.memory.lock().offers();
        let _guard = self.inner.runtime.enter();
        let connected = match self.inner.target.connect(&self.inner.identity, &offers) {
            Ok(connected) => connected,
            Err(error) => {
                tracing::debug!(%error, "reconnect after a failed call failed");
                link.fail();
                return None;
            }
        };
        self.redeclare(&connected);
        let same = connected.instance_id == instance;
        if same {
            tracing::info!(target = %self.inner.target, "the real client was handed over to a new process; the interrupted call goes again");
        }
        let rpc = connected.rpc.clone();
        *link = Link::Up(connected);
        same.then_some(rpc)
    }

    /// Runs one call's future on the caller's thread, as the link wants it.
    fn run<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, RpcError>>,
    ) -> Result<T, RpcError> {
        if self.inner.target.is_in_process() {
            crate::connection::run_in_process(call)
        } else if self.inner.spin.is_zero() {
            self.inner.runtime.block_on(call)
        } else {
            let spin = self.inner.spin;
            self.inner
                .runtime
                .block_on(crate::spin::spin_then_wait(call, spin))
        }
    }

    /// Counts a failed call and marks the link down after a transport failure; the
    /// call's error code.
    fn failed(&self, error: &RpcError) -> ErrorCode {
        if !matches!(error, RpcError::Server(_)) {
            self.inner.calls_in_doubt.fetch_add(1, Ordering::AcqRel);
        }
        if !matches!(error, RpcError::DeadlineExceeded | RpcError::Server(_)) {
            self.inner.link.lock().fail();
        }
        rpc_code(error)
    }

    /// Runs one RPC to completion on the caller's thread. `make` builds the call; it
    /// runs a second time only when the first failed in transport while the real
    /// client was handed over to a new process (see `after_handover`).
    pub(crate) fn call<T, F>(
        &self,
        timeout: Duration,
        make: impl Fn(RealClient, context::Context) -> F,
    ) -> CodeResult<T>
    where
        F: std::future::Future<Output = Result<T, RpcError>>,
    {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(ErrorCode::RPC_FAIL);
        }
        let (rpc, instance) = self.rpc()?;
        match self.run(make(rpc, deadline(timeout))) {
            Ok(value) => Ok(value),
            Err(error @ (RpcError::DeadlineExceeded | RpcError::Server(_))) => {
                Err(self.failed(&error))
            }
            Err(error) => match self.after_handover(instance) {
                Some(rpc) => self
                    .run(make(rpc, deadline(timeout)))
                    .map_err(|error| self.failed(&error)),
                None => {
                    self.inner.calls_in_doubt.fetch_add(1, Ordering::AcqRel);
                    Err(rpc_code(&error))
                }
            },
        }
    }

    /// Like [`call`](Self::call) for batch RPCs: a transport failure becomes one error
    /// per input.
    pub(crate) fn call_batch<T, F>(
        &self,
        count: usize,
        timeout: Duration,
        make: impl Fn(RealClient, context::Context) -> F,
    ) -> Vec<CodeResult<T>>
    where
        F: std::future::Future<Output = Result<Vec<CodeResult<T>>, RpcError>>,
    {
        match self.call(timeout, make) {
            Ok(results) if results.len() == count => results,
            Ok(_) => all_failed(count, ErrorCode::RPC_FAIL),
            Err(code) => all_failed(count, code),
        }
    }

    /// Like [`call_batch`](Self::call_batch) for a batch of any size: sends `items` in
    /// as many requests as keep each within the real client's decoding budget
    /// ([`MAX_REQUEST_ELEMENTS`]); one result per item, in order. An item over the
    /// budget on its own is `INVALID_PARAMS`.
    pub(crate) fn call_chunked<I, T, F>(
        &self,
        items: Vec<I>,
        timeout: Duration,
        make: impl Fn(RealClient, context::Context, Batch<I>) -> F,
    ) -> Vec<CodeResult<T>>
    where
        I: Elements + Clone,
        F: std::future::Future<Output = Result<Vec<CodeResult<T>>, RpcError>>,
    {
        let mut results = Vec::with_capacity(items.len());
        for chunk in split_by_elements(items, MAX_REQUEST_ELEMENTS) {
            match chunk {
                Chunk::Request(items) => {
                    let count = items.len();
                    let batch = Batch(items);
                    results.extend(
                        self.call_batch(count, timeout, |rpc, ctx| make(rpc, ctx, batch.clone())),
                    );
                }
                Chunk::Oversized => results.push(Err(ErrorCode::INVALID_PARAMS)),
            }
        }
        results
    }

    /// Takes a staging block of `len` bytes, if the staging buffer has room.
    pub(crate) fn stage(&self, len: u64) -> Option<StagingBlock> {
        if len == 0 {
            return None;
        }
        self.inner.memory.lock().stage(len)
    }

    /// Returns staging blocks.
    pub(crate) fn unstage(&self, blocks: &[StagingBlock]) {
        let mut memory = self.inner.memory.lock();
        for block in blocks {
            memory.unstage(block);
        }
    }

    /// Bytes of the staging buffer withheld from reuse because a call that used them
    /// failed in transport while the real client may still read or write them.
    pub fn withheld_staging_bytes(&self) -> u64 {
        self.inner.withheld.load(Ordering::Relaxed)
    }

    /// How many calls so far were sent and then failed in transport; taken before a
    /// call whose shared memory is returned with [`unstage_after`](Self::unstage_after).
    pub(crate) fn calls_in_doubt(&self) -> u64 {
        self.inner.calls_in_doubt.load(Ordering::Acquire)
    }

    /// Returns staging blocks of calls made since [`calls_in_doubt`](Self::calls_in_doubt)
    /// was `before`. When a call has failed in transport since, the real client may still
    /// read or write them (a request past its deadline runs on): they stay out of use
    /// for the life of this client rather than carry another call's bytes.
    pub(crate) fn unstage_after(&self, blocks: &[StagingBlock], before: u64) {
        if blocks.is_empty() {
            return;
        }
        if self.calls_in_doubt() == before {
            return self.unstage(blocks);
        }
        let bytes: u64 = blocks.iter().map(|b| b.slice.len() as u64).sum();
        self.inner.withheld.fetch_add(bytes, Ordering::Relaxed);
        tracing::warn!(
            blocks = blocks.len(),
            bytes,
            "a call failed in transport while the real client may still use its staging blocks; they are not reused"
        );
    }

    /// The real client's status: attached dummies, mappings, segment usage, objects.
    pub fn status(&self) -> CodeResult<StatusReport> {
        self.call(
            CONTROL_DEADLINE,
            |rpc, ctx| async move { rpc.status(ctx).await },
        )
    }

    /// 0 when the real client and its master answer, 1 after `close()`, 2 otherwise.
    pub fn health_check(&self) -> Health {
        if self.inner.closed.load(Ordering::Acquire) {
            return Health::NotInitialized;
        }
        match self.call(
            CONTROL_DEADLINE,
            |rpc, ctx| async move { rpc.ping(ctx).await },
        ) {
            Ok(reply) if reply.master_ok => Health::Ok,
            _ => Health::Unreachable,
        }
    }

    /// Instance id of the real client currently connected, if any.
    pub fn instance_id(&self) -> Option<u128> {
        match &*self.inner.link.lock() {
            Link::Up(connected) => Some(connected.instance_id),
            _ => None,
        }
    }

    /// Name of the real client's segment (`host:port`), the value to use as a
    /// `preferred_segment` for data placed on this node; empty when disconnected.
    pub fn get_hostname(&self) -> String {
        match &*self.inner.link.lock() {
            Link::Up(connected) => connected.segment_name.clone(),
            _ => String::new(),
        }
    }

    /// Bytes of the staging buffer (`local_buffer_size` at setup).
    pub fn local_buffer_size(&self) -> u64 {
        self.inner.memory.lock().staging_capacity()
    }

    /// True after [`close`](Self::close).
    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Disconnects from the real client (which releases everything this dummy held);
    /// later calls return errors. In embedded mode the in-process real client stops
    /// too. Idempotent.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        let mut link = self.inner.link.lock();
        if let Link::Up(connected) = &*link {
            connected.disconnect();
        }
        *link = Link::Closed;
        drop(link);
        mooncake_shm::cross_memory::release_tracer(self.inner.identity.client_id);
        // An in-process real client stops with its only user.
        let embedded = self.inner.embedded.lock().take();
        drop(embedded);
    }
}

/// One request's worth of a batch, or an item too large for any request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Chunk<I> {
    /// Items that fit one request, in order.
    Request(Vec<I>),
    /// One item whose own lists pass the budget.
    Oversized,
}

/// Splits `items`, in order, into requests of at most `budget` list elements each.
pub(crate) fn split_by_elements<I: Elements>(items: Vec<I>, budget: usize) -> Vec<Chunk<I>> {
    let mut chunks = Vec::new();
    let mut current = Vec::new();
    let mut used = 0usize;
    for item in items {
        let elements = item.elements();
        if elements > budget {
            if !current.is_empty() {
                chunks.push(Chunk::Request(std::mem::take(&mut current)));
                used = 0;
            }
            chunks.push(Chunk::Oversized);
            continue;
        }
        if used + elements > budget {
            chunks.push(Chunk::Request(std::mem::take(&mut current)));
            used = 0;
        }
        used += elements;
        current.push(item);
    }
    if !current.is_empty() {
        chunks.push(Chunk::Request(current));
    }
    chunks
}

#[cfg(feature = "embedded")]
impl DummyClient {
    /// Starts a real client in this process with `config` (its segment is this
    /// process's memory) and returns a client attached to it, with a shared pool of
    /// `mem_pool_size` bytes and a staging buffer of `local_buffer_size` bytes.
    pub fn setup_embedded(
        config: mooncake_real_client::RealClientConfig,
        mem_pool_size: u64,
        local_buffer_size: u64,
    ) -> Result<Self, SetupError> {
        use crate::embedded::StartFailure;
        let (host, running) = crate::embedded::start(config).map_err(|failure| match failure {
            StartFailure::Runtime(error) => SetupError::Runtime(error),
            StartFailure::RealClient(reason) => SetupError::Embedded(reason),
        })?;
        DummyClient::setup_with(
            Target::InProcess(host),
            mem_pool_size,
            local_buffer_size,
            Some(Box::new(running)),
        )
    }
}

#[cfg(test)]
mod tests {
    use mooncake_core::protocol::rpc::{GetItem, MemRange};

    use super::*;

    #[test]
    fn batches_are_split_to_fit_the_request_budget() {
        let keys: Vec<String> = (0..7).map(|i| i.to_string()).collect();
        let sizes: Vec<usize> = split_by_elements(keys, 3)
            .iter()
            .map(|chunk| match chunk {
                Chunk::Request(items) => items.len(),
                Chunk::Oversized => 0,
            })
            .collect();
        assert_eq!(sizes, vec![3, 3, 1]);
    }

    #[test]
    fn an_item_over_the_budget_alone_is_set_apart_in_its_place() {
        let item = |ranges: usize| GetItem {
            key: String::new(),
            dests: vec![MemRange { addr: 0, len: 1 }; ranges],
        };
        let chunks = split_by_elements(vec![item(1), item(9), item(2)], 4);
        assert_eq!(
            chunks,
            vec![
                Chunk::Request(vec![item(1)]),
                Chunk::Oversized,
                Chunk::Request(vec![item(2)]),
            ]
        );
    }
}
