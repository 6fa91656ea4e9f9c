//! Dummies in the real client's own process (the Python `setup()` embedded mode).
//!
//! An in-process dummy registers its memory by handing over the mapping itself (no fd
//! passing) and calls the handlers directly: a [`DirectSession`] runs each request on
//! the caller's thread, inside the real client's runtime, with no channel, no
//! serialization and no thread hand-off. The handlers are the ones a dummy in another
//! process reaches over its socket, so both modes share every code path past the
//! transport.

use std::sync::Arc;

use tarpc::client::RpcError;
use tarpc::context::Context;
use tarpc::server::Serve;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::{RealClientRpc, RealClientRpcRequest, RealClientRpcResponse};
use mooncake_shm::{SharedMemory, TranslateError};

use crate::rpc::DummyHandler;
use crate::session::Session;
use crate::state::ServerState;

/// The session of a dummy in this process. Requests run on the calling thread; the
/// session ends (its memory released) when this is dropped.
#[derive(Debug)]
pub struct DirectSession {
    handler: DummyHandler,
    runtime: tokio::runtime::Handle,
}

impl DirectSession {
    /// Serves one request on the calling thread, inside the real client's runtime (so
    /// timers, sockets and spawned work use its workers), within the request's deadline;
    /// its calls to a remote master go out from this thread too.
    /// Must not be called from inside an asynchronous context.
    pub fn call_blocking(
        &self,
        ctx: Context,
        request: RealClientRpcRequest,
    ) -> Result<RealClientRpcResponse, RpcError> {
        let serve = self.handler.clone().serve();
        let within = ctx
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        mooncake_core::protocol::master_client::as_caller_thread(|| {
            self.runtime.block_on(async move {
                match tokio::time::timeout(within, serve.serve(ctx, request)).await {
                    Ok(answer) => answer.map_err(RpcError::Server),
                    Err(_) => Err(RpcError::DeadlineExceeded),
                }
            })
        })
    }
}

impl Drop for DirectSession {
    fn drop(&mut self) {
        let session = &self.handler.session;
        self.handler.state.sessions.remove(session);
        tracing::info!(name = %session.name, "in-process dummy detached");
    }
}

/// Opens a session for an in-process dummy with `memory` registered, served on the
/// caller's threads inside `runtime` (the real client's).
pub fn attach(
    state: &Arc<ServerState>,
    runtime: &tokio::runtime::Handle,
    client_id: u128,
    name: String,
    memory: &[Arc<SharedMemory>],
) -> Result<DirectSession, TranslateError> {
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
    let info = session.info();
    tracing::info!(name = %info.name, segments = info.segments, "in-process dummy attached");
    Ok(DirectSession {
        handler: DummyHandler {
            state: Arc::clone(state),
            session,
        },
        runtime: runtime.clone(),
    })
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

/// Registers a GPU buffer of the in-process session of `client_id` (its device
/// pointers are valid in this process): requests naming ranges inside it are copied
/// by the driver between the device and the segment.
pub fn register_device(
    state: &ServerState,
    client_id: u128,
    addr: u64,
    len: u64,
    allocation: mooncake_device::DeviceAllocation,
) -> CodeResult<()> {
    let session = state
        .sessions
        .get(client_id)
        .ok_or(ErrorCode::INVALID_PARAMS)?;
    let segment = &state.store.segment().memory;
    session.devices().lend(addr, len, allocation, segment)
}

/// Forgets the GPU buffer registered at `addr` by the in-process session of
/// `client_id`; false when there is none.
pub fn unregister_device(state: &ServerState, client_id: u128, addr: u64) -> bool {
    state
        .sessions
        .get(client_id)
        .is_some_and(|session| session.devices().forget(addr))
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
