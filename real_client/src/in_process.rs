//! Dummies in the real client's own process (the Python `setup()` embedded mode).
//!
//! An in-process dummy registers its shared memory by handing over the mapping itself
//! (no fd passing) and talks to the handlers through an in-memory tarpc channel, so it
//! runs exactly the code paths of a dummy in another process, minus the socket.

use std::sync::Arc;

use tarpc::transport::channel::{self, UnboundedChannel};
use tarpc::{ClientMessage, Response};

use mooncake_core::protocol::rpc::{RealClientRpcRequest, RealClientRpcResponse};
use mooncake_shm::{SharedMemory, TranslateError};

use crate::server::{ServerState, serve_session};
use crate::session::Session;

/// The dummy's end of an in-process session.
pub type InProcessTransport =
    UnboundedChannel<Response<RealClientRpcResponse>, ClientMessage<RealClientRpcRequest>>;

/// Opens a session for an in-process dummy with `memory` registered, served on
/// `runtime` (the real client's). The session ends when the returned transport drops.
pub fn attach(
    state: &Arc<ServerState>,
    runtime: &tokio::runtime::Handle,
    client_id: u128,
    name: String,
    memory: &[Arc<SharedMemory>],
) -> Result<InProcessTransport, TranslateError> {
    let session = Arc::new(Session::new(
        client_id,
        std::process::id(),
        nix::unistd::geteuid().as_raw(),
        name,
    ));
    {
        let mut registry = session.registry().write();
        for segment in memory {
            registry.add(segment.base(), Arc::clone(segment))?;
        }
    }
    // Registered now, so that a pool segment added right after attaching finds it.
    state.sessions.insert(Arc::clone(&session));
    let (dummy_end, server_end) = channel::unbounded();
    runtime.spawn(serve_session(Arc::clone(state), session, server_end));
    Ok(dummy_end)
}

/// Adds a segment to the in-process session of `client_id` (when its pool grows).
pub fn register(
    state: &ServerState,
    client_id: u128,
    memory: Arc<SharedMemory>,
) -> Result<(), String> {
    let session = state
        .sessions
        .get(client_id)
        .ok_or_else(|| "no in-process session for this client".to_string())?;
    let base = memory.base();
    session
        .registry()
        .write()
        .add(base, memory)
        .map_err(|e| e.to_string())
}

/// Removes the segment at `base` from the in-process session of `client_id` (the
/// application unregistered a buffer the real client used in place); false when there
/// is no such segment.
pub fn unregister(state: &ServerState, client_id: u128, base: u64) -> bool {
    state
        .sessions
        .get(client_id)
        .is_some_and(|session| session.registry().write().remove(base))
}
