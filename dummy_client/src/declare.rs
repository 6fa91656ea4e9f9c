//! Declaring registered ordinary memory to the real client, so that it copies those
//! buffers once, straight between this process's memory and its segment
//! (`process_vm_readv` / `process_vm_writev`), instead of twice through staging.
//!
//! Each buffer `register_buffer` accepts outside the dummy's shared memory is declared
//! to the session (address, length); `unregister_buffer` forgets it, and a reconnect
//! declares every registered buffer again. Before the first declaration over a
//! connection, the dummy lets its real client read its memory where Yama's
//! `ptrace_scope` 1 demands it (`PR_SET_PTRACER` with the real client's pid from the
//! socket credentials; never `PR_SET_PTRACER_ANY`). The real client probes once per
//! session whether the kernel lets it; when it does not, the buffers stay on the
//! staging path and the log says why, once per process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use mooncake_core::error::ErrorCode;
use mooncake_core::protocol::bounded::Batch;
use mooncake_core::protocol::rpc::{
    CONTROL_DEADLINE, CrossMemory, Declaration, MAX_DECLARED_RANGES, MemRange,
};
use mooncake_shm::cross_memory;

use crate::client::DummyClient;
use crate::connection::{Connected, Link};

/// Whether the notice "registered ordinary memory goes through staging" was logged.
static STAGING_NOTICE: AtomicBool = AtomicBool::new(false);

/// Whether the notice "registered ordinary memory is copied once" was logged.
static CROSS_MEMORY_NOTICE: AtomicBool = AtomicBool::new(false);

/// Logs, once per process, that registered ordinary memory is copied through the
/// staging buffer, and why.
pub(crate) fn staging_notice(why: &str) {
    if !STAGING_NOTICE.swap(true, Ordering::Relaxed) {
        tracing::warn!(
            "registered ordinary memory (heap, numpy, pinned host memory) is copied through the staging buffer (two copies, at most local_buffer_size bytes at a time), not once by the real client: {why}. Allocate with alloc_from_mem_pool or MooncakeHostMemAllocator for zero copy"
        );
    }
}

/// A context for a control call (declarations), with the control deadline.
pub(crate) fn deadline() -> tarpc::context::Context {
    let mut ctx = tarpc::context::current();
    ctx.deadline = Instant::now() + CONTROL_DEADLINE;
    ctx
}

impl DummyClient {
    /// Declares the registered ordinary buffers `buffers` (`(start, len)`) over
    /// `connected` and records which ones the real client accepted and whether it
    /// reaches them. The caller holds the link lock, not the memory lock.
    pub(crate) fn declare_over(&self, connected: &Connected, buffers: &[(u64, u64)]) {
        if buffers.is_empty() {
            return;
        }
        if let Some(pid) = connected.real_client_pid
            && let Err(error) = cross_memory::allow_tracer(self.inner.identity.client_id, pid)
        {
            tracing::debug!(%error, "the real client was not named as this process's tracer");
        }
        let ranges: Vec<MemRange> = buffers
            .iter()
            .map(|&(addr, len)| MemRange { addr, len })
            .collect();
        let mut answers = Vec::new();
        for chunk in ranges.chunks(MAX_DECLARED_RANGES) {
            let rpc = connected.rpc.clone();
            let request = Batch(chunk.to_vec());
            let call = async move { rpc.declare_memory(deadline(), request).await };
            match self.block_on(call) {
                Ok(answer) if answer.accepted.len() == chunk.len() => answers.push(answer),
                // The real client may have recorded what this side cannot tell: close the
                // session (the next call reconnects and declares afresh), so that no
                // declaration outlives its buffer unnoticed.
                Ok(_) => return connected.disconnect(),
                Err(error) => {
                    tracing::warn!(%error, "declaring registered memory failed; reconnecting");
                    return connected.disconnect();
                }
            }
        }
        self.record(buffers, &answers);
    }

    /// Runs a call on this client's runtime (or, in process, on this thread).
    pub(crate) fn block_on<F: std::future::Future>(&self, call: F) -> F::Output {
        if self.inner.target.is_in_process() {
            crate::connection::run_in_process(call)
        } else {
            self.inner.runtime.block_on(call)
        }
    }

    /// Records the real client's answers to the declaration of `buffers`.
    fn record(&self, buffers: &[(u64, u64)], answers: &[Declaration]) {
        let accepted = answers.iter().flat_map(|a| a.accepted.iter());
        let mut memory = self.inner.memory.lock();
        let mut refused = false;
        for (&(start, _), result) in buffers.iter().zip(accepted) {
            memory.set_declared(start, result.is_ok());
            refused |= *result == Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        let Some(last) = answers.last() else {
            return;
        };
        match &last.cross_memory {
            CrossMemory::Available => {
                memory.set_cross_memory(true);
                drop(memory);
                if refused {
                    staging_notice(&format!(
                        "more than {MAX_DECLARED_RANGES} ordinary buffers are registered; the rest are not declared to the real client"
                    ));
                } else if !CROSS_MEMORY_NOTICE.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        "registered ordinary memory is copied once, by the real client, straight to and from this process's memory (cross-memory attach)"
                    );
                }
            }
            CrossMemory::Unavailable(reason) => {
                memory.set_cross_memory(false);
                drop(memory);
                staging_notice(&format!("the real client cannot reach it: {reason}"));
            }
        }
    }

    /// Declares the registered ordinary buffer `start..start+len` to the connected real
    /// client (socket connections only: an in-process real client uses registered
    /// memory in place).
    pub(crate) fn declare_buffer(&self, start: u64, len: u64) {
        if self.inner.target.is_in_process() {
            return;
        }
        let link = self.inner.link.lock();
        if let Link::Up(connected) = &*link {
            self.declare_over(connected, &[(start, len)]);
        }
    }

    /// Tells the connected real client to forget the buffer declared at `start`. When
    /// it cannot be told, the connection is closed (the next call reconnects and
    /// declares only the buffers still registered), so a forgotten buffer is never
    /// touched again. The caller holds the link lock.
    pub(crate) fn forget_over(&self, link: &mut Link, start: u64) {
        let Link::Up(connected) = &*link else {
            return;
        };
        let rpc = connected.rpc.clone();
        let call = async move { rpc.forget_memory(deadline(), start).await };
        if let Err(error) = self.block_on(call) {
            tracing::warn!(%error, "the real client could not be told that a buffer was unregistered; reconnecting");
            connected.disconnect();
            link.fail();
        }
    }

    /// Declares every registered ordinary buffer over a new connection.
    pub(crate) fn redeclare(&self, connected: &Connected) {
        let buffers = {
            let mut memory = self.inner.memory.lock();
            memory.forget_declarations();
            memory.ordinary_registrations()
        };
        if !self.inner.target.is_in_process() {
            self.declare_over(connected, &buffers);
        }
        self.redeclare_devices(connected);
    }
}
