//! [`DummyClient`]: the store API of an inference rank, forwarded to `mooncake_client`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde_bytes::ByteBuf;
use tarpc::client::RpcError;
use tarpc::context;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::address::SocketAddress;
use mooncake_core::protocol::handshake::SegmentKind;
use mooncake_core::protocol::rpc::{
    CONTROL_DEADLINE, DATA_DEADLINE, GetItem, MemRange, PutItem, PutSource, RealClientRpcClient,
    StatusReport,
};
use mooncake_core::types::ReplicateConfig;

use crate::connection::{self, ConnectError, Identity, Link, Offer};
use crate::memory::{DummyMemory, StagingBlock};

/// Environment variable naming the real client when `setup_dummy` gets no address.
pub const CLIENT_ADDRESS_ENV: &str = "MOONCAKE_CLIENT";

/// First guess of an object's size when `get` copies it through staging.
const GET_GUESS: u64 = 1 << 20;

/// Why `setup_dummy` failed.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// The address did not parse.
    #[error(transparent)]
    Address(#[from] mooncake_core::protocol::address::AddressError),
    /// Shared memory could not be created.
    #[error("cannot create the dummy's shared memory: {0}")]
    Memory(#[from] mooncake_shm::ShmError),
    /// The runtime could not start.
    #[error("cannot start the dummy's I/O runtime: {0}")]
    Runtime(std::io::Error),
    /// The real client could not be reached or refused us.
    #[error(transparent)]
    Connect(#[from] ConnectError),
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

struct Inner {
    address: SocketAddress,
    identity: Identity,
    runtime: tokio::runtime::Runtime,
    memory: Mutex<DummyMemory>,
    link: Mutex<Link>,
    closed: AtomicBool,
}

/// A dummy client: holds no store resources, only its shared memory and a socket to
/// its real client. Cheap to clone; every clone shares the same connection.
#[derive(Clone)]
pub struct DummyClient {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for DummyClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DummyClient")
            .field("address", &self.inner.address)
            .finish_non_exhaustive()
    }
}

fn random_id() -> u128 {
    let mut bytes = [0u8; 16];
    let _ = getrandom::fill(&mut bytes);
    u128::from_le_bytes(bytes) ^ u128::from(std::process::id())
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
        let memory = DummyMemory::create(mem_pool_size, local_buffer_size)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(SetupError::Runtime)?;
        let identity = Identity {
            client_id: random_id(),
            name: process_name(),
        };
        let connected = {
            let _guard = runtime.enter();
            connection::connect(&address, &identity, &memory.offers())?
        };
        Ok(DummyClient {
            inner: Arc::new(Inner {
                address,
                identity,
                runtime,
                memory: Mutex::new(memory),
                link: Mutex::new(Link::Up(connected)),
                closed: AtomicBool::new(false),
            }),
        })
    }

    /// The RPC client, reconnecting first if the link is down and its backoff elapsed.
    fn rpc(&self) -> CodeResult<RealClientRpcClient> {
        let mut link = self.inner.link.lock();
        if let Link::Up(connected) = &*link
            && connected.peer_hung_up()
        {
            tracing::warn!(address = %self.inner.address, "mooncake_client closed the connection; will reconnect");
            *link = Link::down_now();
        }
        if let Link::Down { retry_at, .. } = &*link {
            if Instant::now() < *retry_at {
                return Err(ErrorCode::RPC_FAIL);
            }
            let offers = self.inner.memory.lock().offers();
            let _guard = self.inner.runtime.enter();
            match connection::connect(&self.inner.address, &self.inner.identity, &offers) {
                Ok(connected) => {
                    tracing::info!(address = %self.inner.address, instance = %format!("{:032x}", connected.instance_id), "reconnected to mooncake_client; shared memory registered again");
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
            Link::Up(connected) => Ok(connected.rpc.clone()),
            _ => Err(ErrorCode::RPC_FAIL),
        }
    }

    /// Runs one RPC to completion on the caller's thread.
    fn call<T, F>(
        &self,
        timeout: Duration,
        make: impl FnOnce(RealClientRpcClient, context::Context) -> F,
    ) -> CodeResult<T>
    where
        F: std::future::Future<Output = Result<T, RpcError>>,
    {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(ErrorCode::RPC_FAIL);
        }
        let rpc = self.rpc()?;
        match self.inner.runtime.block_on(make(rpc, deadline(timeout))) {
            Ok(value) => Ok(value),
            Err(error) => {
                if !matches!(error, RpcError::DeadlineExceeded | RpcError::Server(_)) {
                    self.inner.link.lock().fail();
                }
                Err(rpc_code(&error))
            }
        }
    }

    /// Like [`call`](Self::call) for batch RPCs: a transport failure becomes one error
    /// per input.
    fn call_batch<T, F>(
        &self,
        count: usize,
        timeout: Duration,
        make: impl FnOnce(RealClientRpcClient, context::Context) -> F,
    ) -> Vec<CodeResult<T>>
    where
        F: std::future::Future<Output = Result<Vec<CodeResult<T>>, RpcError>>,
    {
        match self.call(timeout, make) {
            Ok(results) if results.len() == count => results,
            Ok(_) => (0..count).map(|_| Err(ErrorCode::RPC_FAIL)).collect(),
            Err(code) => (0..count).map(|_| Err(code)).collect(),
        }
    }

    /// Allocates `size` bytes of shared memory for zero-copy puts and gets; returns its
    /// address, or 0 when the pool cannot grow. No RPC unless the pool must grow.
    pub fn alloc_from_mem_pool(&self, size: u64) -> u64 {
        if size == 0 || self.inner.closed.load(Ordering::Acquire) {
            return 0;
        }
        if let Some(addr) = self.inner.memory.lock().pool.allocate(size) {
            return addr;
        }
        // Growing: lock order is link, then memory (as in `rpc`), so that a reconnect
        // never registers a pool without the segment being added.
        let link = self.inner.link.lock();
        let mut memory = self.inner.memory.lock();
        if let Some(addr) = memory.pool.allocate(size) {
            return addr;
        }
        let segment = match memory.new_pool_segment(size) {
            Ok(segment) => segment,
            Err(error) => {
                tracing::warn!(%error, size, "cannot grow the shared memory pool");
                return 0;
            }
        };
        let offer = Offer {
            memory: Arc::clone(&segment),
            kind: SegmentKind::Pool,
        };
        if matches!(*link, Link::Up(_))
            && let Err(error) =
                connection::attach(&self.inner.address, &self.inner.identity, &offer)
        {
            tracing::warn!(%error, size, "mooncake_client refused the new pool segment");
            return 0;
        }
        memory.pool.add_segment(segment);
        memory.pool.allocate(size).unwrap_or(0)
    }

    /// Returns a block from [`alloc_from_mem_pool`](Self::alloc_from_mem_pool);
    /// `INVALID_PARAMS` for an address that is not a live block.
    pub fn free_to_mem_pool(&self, ptr: u64) -> CodeResult<()> {
        if self.inner.memory.lock().pool.free(ptr) {
            Ok(())
        } else {
            Err(ErrorCode::INVALID_PARAMS)
        }
    }

    fn stage(&self, len: u64) -> Option<StagingBlock> {
        self.inner.memory.lock().stage(len)
    }

    fn unstage(&self, block: &StagingBlock) {
        self.inner.memory.lock().unstage(block);
    }

    /// Stores `value` under `key` (copied once into the staging buffer, or sent inline
    /// when it does not fit). An existing key is kept and this returns success.
    pub fn put(&self, key: &str, value: &[u8], config: &ReplicateConfig) -> CodeResult<()> {
        let len = value.len() as u64;
        let staged = if len > 0 { self.stage(len) } else { None };
        let source = match &staged {
            Some(block) => {
                block.slice.write_from(value);
                PutSource::Shared(vec![MemRange {
                    addr: block.addr,
                    len,
                }])
            }
            None => PutSource::Inline(ByteBuf::from(value.to_vec())),
        };
        let result = self.put_items(
            vec![PutItem {
                key: key.to_string(),
                source,
            }],
            config,
        );
        if let Some(block) = &staged {
            self.unstage(block);
        }
        result
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))
    }

    fn put_items(&self, items: Vec<PutItem>, config: &ReplicateConfig) -> Vec<CodeResult<()>> {
        let count = items.len();
        let config = config.clone();
        self.call_batch(count, DATA_DEADLINE, |rpc, ctx| async move {
            rpc.put(ctx, items, config).await
        })
    }

    /// Reads `key` into a new vector (through the staging buffer).
    pub fn get(&self, key: &str) -> CodeResult<Vec<u8>> {
        let guess = GET_GUESS.min(self.inner.memory.lock().staging_capacity() / 2);
        if guess > 0
            && let Some(block) = self.stage(guess)
        {
            let result = self.get_staged(key, &block);
            self.unstage(&block);
            match result {
                Err(ErrorCode::BUFFER_OVERFLOW) => {}
                other => return other,
            }
            let size = self.get_size(key)?;
            if let Some(block) = self.stage(size) {
                let result = self.get_staged(key, &block);
                self.unstage(&block);
                if result != Err(ErrorCode::BUFFER_OVERFLOW) {
                    return result;
                }
            }
        }
        let key = key.to_string();
        self.call(DATA_DEADLINE, |rpc, ctx| async move {
            rpc.get_inline(ctx, key).await
        })?
        .map(ByteBuf::into_vec)
    }

    fn get_staged(&self, key: &str, block: &StagingBlock) -> CodeResult<Vec<u8>> {
        let dest = MemRange {
            addr: block.addr,
            len: block.slice.len() as u64,
        };
        let size = self
            .get_items(vec![GetItem {
                key: key.to_string(),
                dest,
            }])
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))?;
        let slice = block.slice.sub(0, size).ok_or(ErrorCode::INTERNAL_ERROR)?;
        Ok(slice.to_vec())
    }

    fn get_items(&self, items: Vec<GetItem>) -> Vec<CodeResult<u64>> {
        let count = items.len();
        self.call_batch(count, DATA_DEADLINE, |rpc, ctx| async move {
            rpc.get(ctx, items).await
        })
    }

    /// Stores `size` bytes at `ptr` (inside the dummy's shared memory) under `key`,
    /// zero-copy. A pointer outside shared memory is `INVALID_PARAMS`.
    pub fn put_from(
        &self,
        key: &str,
        ptr: u64,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<()> {
        self.batch_put_from(&[key], &[ptr], &[size], config)
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))
    }

    /// Reads `key` into `ptr..ptr+size` (shared memory), zero-copy; returns the object
    /// size. A buffer smaller than the object is `INVALID_PARAMS`.
    pub fn get_into(&self, key: &str, ptr: u64, size: u64) -> CodeResult<u64> {
        self.batch_get_into(&[key], &[ptr], &[size])
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))
    }

    /// [`put_from`](Self::put_from) for many keys in one request. Mismatched input
    /// lengths give `INVALID_PARAMS` for every key.
    pub fn batch_put_from<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[u64],
        sizes: &[u64],
        config: &ReplicateConfig,
    ) -> Vec<CodeResult<()>> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return (0..keys.len())
                .map(|_| Err(ErrorCode::INVALID_PARAMS))
                .collect();
        }
        if keys.is_empty() {
            return Vec::new();
        }
        let items = keys
            .iter()
            .zip(ptrs.iter().zip(sizes))
            .map(|(key, (&addr, &len))| PutItem {
                key: key.as_ref().to_string(),
                source: PutSource::Shared(vec![MemRange { addr, len }]),
            })
            .collect();
        self.put_items(items, config)
    }

    /// [`get_into`](Self::get_into) for many keys in one request; one size or error per
    /// key. Mismatched input lengths give `INVALID_PARAMS` for every key.
    pub fn batch_get_into<K: AsRef<str>>(
        &self,
        keys: &[K],
        ptrs: &[u64],
        sizes: &[u64],
    ) -> Vec<CodeResult<u64>> {
        if keys.len() != ptrs.len() || keys.len() != sizes.len() {
            return (0..keys.len())
                .map(|_| Err(ErrorCode::INVALID_PARAMS))
                .collect();
        }
        if keys.is_empty() {
            return Vec::new();
        }
        let items = keys
            .iter()
            .zip(ptrs.iter().zip(sizes))
            .map(|(key, (&addr, &len))| GetItem {
                key: key.as_ref().to_string(),
                dest: MemRange { addr, len },
            })
            .collect();
        self.get_items(items)
            .into_iter()
            .map(|r| {
                r.map_err(|c| {
                    if c == ErrorCode::BUFFER_OVERFLOW {
                        ErrorCode::INVALID_PARAMS
                    } else {
                        c
                    }
                })
            })
            .collect()
    }

    /// Whether `key` exists.
    pub fn is_exist(&self, key: &str) -> CodeResult<bool> {
        self.batch_is_exist(&[key])
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))
    }

    /// [`is_exist`](Self::is_exist) for many keys in one request.
    pub fn batch_is_exist<K: AsRef<str>>(&self, keys: &[K]) -> Vec<CodeResult<bool>> {
        if keys.is_empty() {
            return Vec::new();
        }
        let keys: Vec<String> = keys.iter().map(|k| k.as_ref().to_string()).collect();
        let count = keys.len();
        self.call_batch(count, CONTROL_DEADLINE, |rpc, ctx| async move {
            rpc.exist(ctx, keys).await
        })
    }

    /// Size of the object under `key`.
    pub fn get_size(&self, key: &str) -> CodeResult<u64> {
        let key = key.to_string();
        self.call(CONTROL_DEADLINE, |rpc, ctx| async move {
            rpc.object_size(ctx, key).await
        })?
    }

    /// Removes `key`; under a read lease this is `OBJECT_HAS_LEASE` unless `force`.
    pub fn remove(&self, key: &str, force: bool) -> CodeResult<()> {
        self.batch_remove(&[key], force)
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::RPC_FAIL))
    }

    /// [`remove`](Self::remove) for many keys in one request.
    pub fn batch_remove<K: AsRef<str>>(&self, keys: &[K], force: bool) -> Vec<CodeResult<()>> {
        if keys.is_empty() {
            return Vec::new();
        }
        let keys: Vec<String> = keys.iter().map(|k| k.as_ref().to_string()).collect();
        let count = keys.len();
        self.call_batch(count, CONTROL_DEADLINE, |rpc, ctx| async move {
            rpc.remove(ctx, keys, force).await
        })
    }

    /// Removes every object; returns how many were removed.
    pub fn remove_all(&self, force: bool) -> CodeResult<u64> {
        self.call(CONTROL_DEADLINE, |rpc, ctx| async move {
            rpc.remove_all(ctx, force).await
        })?
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

    /// Disconnects from the real client (which releases everything this dummy held);
    /// later calls return errors. Idempotent.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        *self.inner.link.lock() = Link::Closed;
    }
}
