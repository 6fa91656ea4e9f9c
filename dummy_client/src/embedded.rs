//! Embedded mode: the real client runs inside this process (Python `setup()`).
//!
//! A [`Host`] owns an in-process real client, served by its own multi-threaded runtime
//! on a background thread; the dummy client calls its handlers directly on the
//! caller's thread (no channel, no serialization), so every call takes the same code
//! path as with a separate `mooncake_client` past the transport.

use std::sync::Arc;

use mooncake_real_client::ServerState;
use mooncake_real_client::{RealClient, RealClientConfig, in_process};

use mooncake_shm::SharedMemory;

/// Handle to the in-process real client.
#[derive(Clone, Debug)]
pub struct Host {
    state: Arc<ServerState>,
    runtime: tokio::runtime::Handle,
}

impl Host {
    /// Opens an in-process session for dummy `client_id` (named `name`) with `memory`
    /// registered; answers the session, the real client's instance id and its segment
    /// name, or why it refused.
    pub fn connect(
        &self,
        client_id: u128,
        name: String,
        memory: &[Arc<SharedMemory>],
    ) -> Result<(in_process::DirectSession, u128, String), String> {
        let direct = in_process::attach(&self.state, &self.runtime, client_id, name, memory)
            .map_err(|e| e.to_string())?;
        let identity = &self.state.identity;
        Ok((direct, identity.instance_id, identity.segment_name.clone()))
    }

    /// Removes the segment at `base` from dummy `client_id`'s in-process session.
    pub fn detach(&self, client_id: u128, base: u64) -> bool {
        in_process::unregister(&self.state, client_id, base)
    }

    /// Registers a GPU buffer with dummy `client_id`'s in-process session (its device
    /// pointers are valid in the real client, which runs here).
    pub fn register_device(
        &self,
        client_id: u128,
        addr: u64,
        len: u64,
        allocation: mooncake_device::DeviceAllocation,
    ) -> mooncake_core::error::CodeResult<()> {
        in_process::register_device(&self.state, client_id, addr, len, allocation)
    }

    /// Adds a segment to dummy `client_id`'s in-process session.
    pub fn attach(&self, client_id: u128, memory: Arc<SharedMemory>) -> Result<(), String> {
        in_process::register(&self.state, client_id, memory)
    }
}

/// How long dropping [`Running`] waits for the in-process real client to unmount and
/// stop before leaving its thread to finish on its own.
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Keeps the in-process real client running; stops it when dropped.
pub struct Running {
    stop: tokio::sync::watch::Sender<bool>,
    stopped: std::sync::mpsc::Receiver<()>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        // `send_replace` stores the request even if the server has not subscribed yet.
        self.stop.send_replace(true);
        let Some(thread) = self.thread.take() else {
            return;
        };
        // Bounded: this may run on a caller's thread (Python drops with the GIL held).
        match self.stopped.recv_timeout(STOP_WAIT) {
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let _ = thread.join();
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                tracing::warn!(
                    "the embedded real client did not stop within {STOP_WAIT:?}; leaving it to finish"
                );
            }
        }
    }
}

/// Why the in-process real client did not start.
#[derive(Debug)]
pub enum StartFailure {
    /// Its runtime or thread could not start.
    Runtime(std::io::Error),
    /// It refused its configuration or could not set up (the text says why).
    RealClient(String),
}

/// Starts a real client in this process with `config`, served by its own runtime on a
/// background thread: the handle to call it, and what keeps it running (dropping it
/// stops the real client).
pub fn start(config: RealClientConfig) -> Result<(Host, Running), StartFailure> {
    let threads = config.threads;
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder
        .worker_threads(if threads > 0 { threads } else { 2 })
        .thread_name("mooncake-embedded");
    let runtime = builder
        .enable_all()
        .build()
        .map_err(StartFailure::Runtime)?;
    let client = runtime
        .block_on(RealClient::start(config))
        .map_err(|e| StartFailure::RealClient(e.to_string()))?;
    let state = Arc::clone(client.state());
    let stop = client.shutdown_handle();
    let handle = runtime.handle().clone();
    let (stopped_tx, stopped) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("mooncake-embedded".into())
        .spawn(move || {
            runtime.block_on(client.serve());
            let _ = stopped_tx.send(());
        })
        .map_err(StartFailure::Runtime)?;
    let running = Running {
        stop,
        stopped,
        thread: Some(thread),
    };
    let host = Host {
        state,
        runtime: handle,
    };
    Ok((host, running))
}
