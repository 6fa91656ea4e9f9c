//! Embedded mode: the real client runs inside this process (Python `setup()`).
//!
//! A [`Host`] owns an in-process real client, served by its own multi-threaded runtime
//! on a background thread; the dummy client calls its handlers directly on the
//! caller's thread (no channel, no serialization), so every call takes the same code
//! path as with a separate `mooncake_client` past the transport.

use std::sync::Arc;

use mooncake_real_client::ServerState;
use mooncake_real_client::{RealClient, RealClientConfig, in_process};

use crate::client::{DummyClient, SetupError};
use crate::connection::{ConnectError, Connected, Identity, Offer, Target};

/// Handle to the in-process real client.
#[derive(Clone, Debug)]
pub struct Host {
    state: Arc<ServerState>,
    runtime: tokio::runtime::Handle,
}

impl Host {
    fn refused(reason: String) -> ConnectError {
        ConnectError::Refused {
            address: mooncake_core::protocol::address::SocketAddress::Abstract("in-process".into()),
            reason,
        }
    }

    /// Opens an in-process session with `offers` registered.
    pub fn connect(
        &self,
        identity: &Identity,
        offers: &[Offer],
    ) -> Result<Connected, ConnectError> {
        let memory: Vec<_> = offers.iter().map(|o| Arc::clone(&o.memory)).collect();
        let direct = in_process::attach(
            &self.state,
            &self.runtime,
            identity.client_id,
            identity.name.clone(),
            &memory,
        )
        .map_err(|e| Self::refused(e.to_string()))?;
        let identity_of = &self.state.identity;
        Ok(Connected::in_process(
            direct,
            identity_of.instance_id,
            identity_of.segment_name.clone(),
        ))
    }

    /// Removes the segment at `base` from the in-process session.
    pub fn detach(&self, identity: &Identity, base: u64) -> bool {
        in_process::unregister(&self.state, identity.client_id, base)
    }

    /// Registers a GPU buffer with the in-process session (its device pointers are
    /// valid in the real client, which runs here).
    pub fn register_device(
        &self,
        identity: &Identity,
        addr: u64,
        len: u64,
        allocation: mooncake_device::DeviceAllocation,
    ) -> mooncake_core::error::CodeResult<()> {
        in_process::register_device(&self.state, identity.client_id, addr, len, allocation)
    }

    /// Adds a segment to the in-process session.
    pub fn attach(&self, identity: &Identity, offer: &Offer) -> Result<(), ConnectError> {
        in_process::register(&self.state, identity.client_id, Arc::clone(&offer.memory))
            .map_err(Self::refused)
    }
}

/// How long dropping [`Running`] waits for the in-process real client to unmount and
/// stop before leaving its thread to finish on its own.
const STOP_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Keeps the in-process real client running; stops it when dropped.
struct Running {
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

impl DummyClient {
    /// Starts a real client in this process with `config` (its segment is this
    /// process's memory) and returns a client attached to it, with a shared pool of
    /// `mem_pool_size` bytes and a staging buffer of `local_buffer_size` bytes.
    pub fn setup_embedded(
        config: RealClientConfig,
        mem_pool_size: u64,
        local_buffer_size: u64,
    ) -> Result<Self, SetupError> {
        let threads = config.threads;
        let mut builder = tokio::runtime::Builder::new_multi_thread();
        builder
            .worker_threads(if threads > 0 { threads } else { 2 })
            .thread_name("mooncake-embedded");
        let runtime = builder.enable_all().build().map_err(SetupError::Runtime)?;
        let client = runtime
            .block_on(RealClient::start(config))
            .map_err(|e| SetupError::Embedded(e.to_string()))?;
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
            .map_err(SetupError::Runtime)?;
        let running = Running {
            stop,
            stopped,
            thread: Some(thread),
        };
        let host = Host {
            state,
            runtime: handle,
        };
        DummyClient::setup_with(
            Target::InProcess(host),
            mem_pool_size,
            local_buffer_size,
            Some(Box::new(running)),
        )
    }
}
