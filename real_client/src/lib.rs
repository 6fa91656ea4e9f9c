//! The mooncake-rs real client.
//!
//! One real client runs per node. It owns the node's contribution to the pool (the
//! global segment), runs the master in-process in the default single-node deployment,
//! and serves every dummy client (one per inference rank) on a Unix socket: dummies
//! register their shared memory once, then each request moves bytes directly between
//! that memory and the segment.
//!
//! * [`config`]: flags, environment and validation;
//! * [`server`]: listener, peer credential check, per-dummy tarpc channels;
//! * [`handshake`]: hello and shared-memory registration;
//! * [`session`]: per-dummy state, released when the dummy's connection closes;
//! * [`rpc`]: the request handlers;
//! * [`store`]: puts and gets against the master and the segment.
//!
//! The binary is thin: it parses flags and calls [`run`]. Embedders (the Python
//! `setup()` mode) call [`RealClient::start`] instead.

pub mod config;
pub mod handshake;
pub mod in_process;
pub mod rpc;
pub mod server;
pub mod session;
pub mod store;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use mooncake_core::master::{Clock, MasterService};
use mooncake_core::units::format_size;
use mooncake_shm::SharedMemory;
use mooncake_shm::shared_memory::PageSize;

pub use config::{ConfigError, RealClientConfig};
use handshake::ServerIdentity;
use server::{BindError, ServerState};
use store::{LocalSegment, Store};

/// Why the real client could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The dummy socket could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The global segment could not be allocated.
    #[error("cannot allocate the global segment of {size}: {source}; lower --global_segment_size")]
    Segment {
        /// Requested size, formatted.
        size: String,
        /// The cause.
        source: mooncake_shm::ShmError,
    },
    /// The master refused the segment.
    #[error("the master refused to mount the global segment: {0}")]
    Mount(mooncake_core::ErrorCode),
}

/// A started real client: its state and the handle to stop it.
#[derive(Debug)]
pub struct RealClient {
    state: Arc<ServerState>,
    shutdown: watch::Sender<bool>,
    listener: Option<std::os::unix::net::UnixListener>,
    config: RealClientConfig,
}

/// A random 128-bit id (instance ids, task ids).
pub fn random_id() -> u128 {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // No entropy source: fall back to time and pid, still unique per process start.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        return nanos ^ (u128::from(std::process::id()) << 96);
    }
    u128::from_le_bytes(bytes)
}

impl RealClient {
    /// Allocates and mounts the segment and binds the socket; serving starts with
    /// [`serve`](Self::serve).
    pub fn start(config: RealClientConfig) -> Result<Self, StartError> {
        let started = Instant::now();
        // Bind first: a second instance on the same socket must fail before it
        // allocates gigabytes of segment.
        let listener = config.socket.as_ref().map(server::bind).transpose()?;
        let master = Arc::new(MasterService::new(config.master.clone(), Clock::System));
        let memory = SharedMemory::create(
            "mooncake_segment",
            config.global_segment_size,
            PageSize::from_env(),
        )
        .map_err(|source| StartError::Segment {
            size: format_size(config.global_segment_size),
            source,
        })?;
        let memory = Arc::new(memory);
        prefault_in_background(Arc::clone(&memory));
        let segment_name = config.segment_name();
        let id = master
            .mount_segment(&segment_name, memory.len() as u64)
            .map_err(StartError::Mount)?;
        let state = Arc::new(ServerState {
            identity: ServerIdentity {
                instance_id: random_id(),
                segment_name,
                max_mapped_bytes: config.max_dummy_shm_size,
            },
            store: Store::new(master, LocalSegment { memory, id }),
            sessions: Default::default(),
            allowed_uids: config.allowed_uids.clone(),
            started,
        });
        let (shutdown, _) = watch::channel(false);
        Ok(RealClient {
            state,
            shutdown,
            listener,
            config,
        })
    }

    /// The shared state (store, sessions), for embedders.
    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }

    /// A handle that stops [`serve`](Self::serve) when sent `true`.
    pub fn shutdown_handle(&self) -> watch::Sender<bool> {
        self.shutdown.clone()
    }

    /// Serves dummies until the shutdown handle fires, then unmounts and cleans up.
    pub async fn serve(mut self) {
        let listener = self.listener.take();
        let config = &self.config;
        tracing::info!(
            socket = %config.socket.as_ref().map_or("none (in-process only)".to_string(), ToString::to_string),
            segment = %self.state.identity.segment_name,
            global_segment_size = %format_size(config.global_segment_size),
            master = "embedded",
            protocol = "tcp",
            max_dummy_shm_size = %format_size(config.max_dummy_shm_size),
            lease_ttl_ms = config.master.default_kv_lease_ttl.as_millis(),
            allowed_uids = ?config.allowed_uids,
            threads = config.threads,
            tenant = %config.tenant_id,
            instance = %format!("{:032x}", self.state.identity.instance_id),
            startup_ms = self.state.started.elapsed().as_millis(),
            "mooncake_client serving"
        );
        let mut shutdown = self.shutdown.subscribe();
        match listener {
            Some(listener) => server::serve(listener, Arc::clone(&self.state), shutdown).await,
            None => {
                let _ = shutdown.wait_for(|stop| *stop).await;
            }
        }
        let store = &self.state.store;
        if let Err(code) = store.master().unmount_segment(store.segment().id) {
            tracing::warn!(%code, "unmount at shutdown failed");
        }
        if let Some(mooncake_core::protocol::address::SocketAddress::Path(path)) = &config.socket {
            let _ = std::fs::remove_file(path);
        }
        tracing::info!("mooncake_client stopped");
    }
}

/// Touches every page of the segment on a background thread so that the first writes
/// do not pay page faults, without delaying startup.
fn prefault_in_background(memory: Arc<SharedMemory>) {
    let spawned = std::thread::Builder::new()
        .name("segment-prefault".into())
        .spawn(move || memory.prefault());
    if let Err(error) = spawned {
        tracing::debug!(%error, "segment prefault thread not started");
    }
}

/// Runs a real client until `shutdown` completes.
pub async fn run(
    config: RealClientConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), StartError> {
    let client = RealClient::start(config)?;
    let stop = client.shutdown_handle();
    let serving = tokio::spawn(client.serve());
    shutdown.await;
    tracing::info!("shutdown requested: no longer accepting dummies");
    let _ = stop.send(true);
    let _ = serving.await;
    Ok(())
}
