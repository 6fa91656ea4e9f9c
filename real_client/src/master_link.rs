//! The real client's link to its master: the embedded one (a direct call) or a remote
//! `mooncake_master` (tarpc over TCP, reconnected on failure).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarpc::client::RpcError;
use tarpc::context;
use tokio::sync::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master::{ClientStatus, MasterService, MasterStats, PutStarted, TaskInfo};
use mooncake_core::protocol::codec;
use mooncake_core::protocol::master_rpc::{MASTER_PROTOCOL_VERSION, MasterRpcClient};
use mooncake_core::protocol::rpc::WriteMode;
use mooncake_core::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

/// Deadline of one call to a remote master.
const MASTER_DEADLINE: Duration = Duration::from_secs(10);

/// A remote master and the current connection to it.
#[derive(Debug)]
pub struct RemoteMaster {
    address: String,
    connection: Mutex<Option<MasterRpcClient>>,
}

/// The master a real client uses.
#[derive(Debug, Clone)]
pub enum MasterLink {
    /// In this process.
    Embedded(Arc<MasterService>),
    /// A `mooncake_master` over TCP.
    Remote(Arc<RemoteMaster>),
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
    /// A master at `address` (`host:port`); connects on first use.
    pub fn new(address: String) -> Self {
        RemoteMaster {
            address,
            connection: Mutex::new(None),
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

    /// The connected client, connecting first if needed.
    async fn client(&self) -> CodeResult<MasterRpcClient> {
        let mut connection = self.connection.lock().await;
        if let Some(client) = connection.as_ref() {
            return Ok(client.clone());
        }
        let client = self.connect().await?;
        *connection = Some(client.clone());
        Ok(client)
    }

    async fn forget(&self) {
        *self.connection.lock().await = None;
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

impl MasterLink {
    /// Whether the master answers.
    pub async fn is_reachable(&self) -> bool {
        match self {
            MasterLink::Embedded(_) => true,
            MasterLink::Remote(remote) => remote.client().await.is_ok(),
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
        match self {
            MasterLink::Embedded(m) => m.mount_segment(name, capacity, client, endpoint),
            MasterLink::Remote(r) => remote!(r, |c| c.mount_segment(
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
        match self {
            MasterLink::Embedded(m) => {
                m.remove_client(client);
                Ok(())
            }
            MasterLink::Remote(r) => remote!(r, |c| c.unmount_client(ctx(), client))?,
        }
    }

    /// Heartbeat.
    pub async fn heartbeat(&self, client: u128) -> CodeResult<ClientStatus> {
        match self {
            MasterLink::Embedded(_) => Ok(ClientStatus::Ok),
            MasterLink::Remote(r) => remote!(r, |c| c.heartbeat(ctx(), client)),
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
        match self {
            MasterLink::Embedded(m) => match mode {
                WriteMode::Put => m.put_start(key, size, config),
                WriteMode::Upsert => m.upsert_start(key, size, config),
            },
            MasterLink::Remote(r) => remote!(r, |c| c.put_start(
                ctx(),
                key.to_string(),
                size,
                config.clone(),
                mode
            ))?,
        }
    }

    /// Completes a write.
    pub async fn put_end(&self, key: &str, write_id: u64) -> CodeResult<()> {
        match self {
            MasterLink::Embedded(m) => m.put_end(key, write_id),
            MasterLink::Remote(r) => remote!(r, |c| c.put_end(ctx(), key.to_string(), write_id))?,
        }
    }

    /// Abandons a write.
    pub async fn put_revoke(&self, key: &str, write_id: u64) -> CodeResult<()> {
        match self {
            MasterLink::Embedded(m) => m.put_revoke(key, write_id),
            MasterLink::Remote(r) => {
                remote!(r, |c| c.put_revoke(ctx(), key.to_string(), write_id))?
            }
        }
    }

    /// Replicas and lease of a readable object.
    pub async fn get_replica_list(
        &self,
        key: &str,
    ) -> CodeResult<(Vec<ReplicaDescriptor>, Duration)> {
        match self {
            MasterLink::Embedded(m) => m.get_replica_list(key),
            MasterLink::Remote(r) => {
                let (replicas, ms) = remote!(r, |c| c.get_replica_list(ctx(), key.to_string()))??;
                Ok((replicas, Duration::from_millis(ms)))
            }
        }
    }

    /// Existence per key.
    pub async fn exist(&self, keys: Vec<String>) -> Vec<CodeResult<bool>> {
        match self {
            MasterLink::Embedded(m) => keys.iter().map(|k| m.exist(k)).collect(),
            MasterLink::Remote(r) => {
                let n = keys.len();
                let result: CodeResult<_> = remote!(r, |c| c.exist(ctx(), keys));
                result.unwrap_or_else(|code| vec![Err(code); n])
            }
        }
    }

    /// Size of an object.
    pub async fn object_size(&self, key: &str) -> CodeResult<u64> {
        match self {
            MasterLink::Embedded(m) => m.object_size(key),
            MasterLink::Remote(r) => remote!(r, |c| c.object_size(ctx(), key.to_string()))?,
        }
    }

    /// Replica descriptors per key.
    pub async fn replica_desc(&self, keys: Vec<String>) -> Vec<CodeResult<Vec<ReplicaDescriptor>>> {
        match self {
            MasterLink::Embedded(m) => keys.iter().map(|k| m.replica_descriptors(k)).collect(),
            MasterLink::Remote(r) => {
                let n = keys.len();
                let result: CodeResult<_> = remote!(r, |c| c.replica_desc(ctx(), keys));
                result.unwrap_or_else(|code| vec![Err(code); n])
            }
        }
    }

    /// Removes objects.
    pub async fn remove(&self, keys: Vec<String>, force: bool) -> Vec<CodeResult<()>> {
        match self {
            MasterLink::Embedded(m) => m.batch_remove(&keys, force),
            MasterLink::Remote(r) => {
                let n = keys.len();
                let result: CodeResult<_> = remote!(r, |c| c.remove(ctx(), keys, force));
                result.unwrap_or_else(|code| vec![Err(code); n])
            }
        }
    }

    /// Removes objects matching a regex.
    pub async fn remove_by_regex(&self, pattern: String, force: bool) -> CodeResult<u64> {
        match self {
            MasterLink::Embedded(m) => m.remove_by_regex(&pattern, force),
            MasterLink::Remote(r) => remote!(r, |c| c.remove_by_regex(ctx(), pattern, force))?,
        }
    }

    /// Removes every object.
    pub async fn remove_all(&self, force: bool) -> CodeResult<u64> {
        match self {
            MasterLink::Embedded(m) => Ok(m.remove_all(force)),
            MasterLink::Remote(r) => remote!(r, |c| c.remove_all(ctx(), force)),
        }
    }

    /// Creates a copy task.
    pub async fn create_copy_task(
        &self,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> CodeResult<u128> {
        match self {
            MasterLink::Embedded(m) => m.create_copy_task(&key, &targets, id),
            MasterLink::Remote(r) => remote!(r, |c| c.create_copy_task(ctx(), key, targets, id))?,
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
        match self {
            MasterLink::Embedded(m) => m.create_move_task(&key, &source, &target, id),
            MasterLink::Remote(r) => {
                remote!(r, |c| c.create_move_task(ctx(), key, source, target, id))?
            }
        }
    }

    /// The state of a task.
    pub async fn query_task(&self, id: u128) -> CodeResult<TaskInfo> {
        match self {
            MasterLink::Embedded(m) => m.query_task(id),
            MasterLink::Remote(r) => remote!(r, |c| c.query_task(ctx(), id))?,
        }
    }

    /// Object counts and segment usage.
    pub async fn stats(&self) -> CodeResult<MasterStats> {
        match self {
            MasterLink::Embedded(m) => Ok(m.stats()),
            MasterLink::Remote(r) => remote!(r, |c| c.stats(ctx())),
        }
    }
}
