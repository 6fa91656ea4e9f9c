//! Memory calls: the shared pool and buffer registration.

use std::sync::Arc;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::handshake::SegmentKind;
use mooncake_device::MemoryKind;

use crate::client::DummyClient;
use crate::connection::Link;
use crate::memory::Offer;

impl DummyClient {
    /// Allocates `size` bytes of shared memory for zero-copy puts and gets; returns its
    /// address, or 0 when the pool cannot grow. No RPC unless the pool must grow.
    pub fn alloc_from_mem_pool(&self, size: u64) -> u64 {
        if size == 0 || self.is_closed() {
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
            && let Err(error) = self.inner.target.attach(&self.inner.identity, &offer)
        {
            tracing::warn!(%error, size, "the real client refused the new pool segment");
            return 0;
        }
        memory.pool.add_segment(segment);
        memory.pool.allocate(size).unwrap_or(0)
    }

    /// Returns a block from [`alloc_from_mem_pool`](Self::alloc_from_mem_pool);
    /// `INVALID_PARAMS` for an address that is not a live block.
    pub fn free_to_mem_pool(&self, ptr: u64) -> CodeResult<()> {
        let mut memory = self.inner.memory.lock();
        if memory.handle_blocks.contains(&ptr) {
            // Owned by a live BufferHandle; it frees the block when dropped.
            return Err(ErrorCode::INVALID_PARAMS);
        }
        if memory.pool.free(ptr) {
            Ok(())
        } else {
            Err(ErrorCode::INVALID_PARAMS)
        }
    }

    /// True when `ptr..ptr+size` is this client's shared memory or a registered buffer
    /// (memory it may read).
    pub fn owns_memory(&self, ptr: u64, size: u64) -> bool {
        self.inner.memory.lock().is_known(ptr, size)
    }

    /// Registers `ptr..ptr+size` for the zero-copy calls. Any range inside the dummy's
    /// shared memory is zero-copy; ordinary memory (heap, numpy arrays, pinned host
    /// memory) is accepted too: it is declared to the real client, which copies it once
    /// across processes where the kernel allows, and otherwise copied through the
    /// staging buffer. A GPU buffer is handed to the real client, which copies it with
    /// the CUDA driver ([`crate::device`]); memory that is neither readable host memory
    /// nor device memory is refused. The memory must stay valid until
    /// [`unregister_buffer`](Self::unregister_buffer).
    ///
    /// # Safety
    /// `ptr..ptr+size` must stay valid (mapped, not freed or reused for something else)
    /// until [`unregister_buffer`](Self::unregister_buffer) returns or this client is
    /// dropped: later calls read and write it without borrowing it.
    pub unsafe fn register_buffer(&self, ptr: u64, size: u64) -> CodeResult<()> {
        if self.is_closed() {
            return Err(ErrorCode::RPC_FAIL);
        }
        if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        match mooncake_device::classify(ptr, size) {
            MemoryKind::Host => {}
            MemoryKind::Device(allocation) => return self.register_device(ptr, size, allocation),
            MemoryKind::Unreachable(why) => {
                tracing::error!(ptr, size, %why, "register_buffer refused the range");
                return Err(ErrorCode::INVALID_PARAMS);
            }
        }
        self.attach_host_memory(ptr, size)?;
        #[cfg(feature = "embedded")]
        self.lend_to_embedded(ptr, size);
        let shared = self.inner.memory.lock().register(ptr, size);
        if shared {
            return Ok(());
        }
        if self.inner.target.is_in_process() {
            crate::declare::staging_notice(
                "the buffer overlaps one already used in place by the embedded real client",
            );
        } else {
            self.declare_buffer(ptr, size);
        }
        Ok(())
    }

    /// When `ptr..ptr+size` lies in a host allocation (`MooncakeHostMemAllocator`) not
    /// yet known to the real client, hands that allocation's segment over, so the
    /// range becomes zero-copy. `NO_AVAILABLE_HANDLE` when the real client refuses it.
    fn attach_host_memory(&self, ptr: u64, size: u64) -> CodeResult<()> {
        let Some(segment) = crate::host_memory::containing(ptr, size) else {
            return Ok(());
        };
        // Lock order as in `rpc`: link, then memory.
        let link = self.inner.link.lock();
        let mut memory = self.inner.memory.lock();
        if memory.has_host(&segment) {
            return Ok(());
        }
        let offer = Offer {
            memory: Arc::clone(&segment),
            kind: SegmentKind::Pool,
        };
        if matches!(*link, Link::Up(_))
            && let Err(error) = self.inner.target.attach(&self.inner.identity, &offer)
        {
            tracing::warn!(%error, size, "the real client refused a host allocation");
            return Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        memory.add_host(segment);
        Ok(())
    }

    /// Embedded mode: the real client runs in this process, so it can read and write an
    /// application buffer in place. The range is handed over as it is (zero-copy, like
    /// shared memory) instead of being copied through staging. A range overlapping one
    /// already handed over keeps the copy-through path.
    #[cfg(feature = "embedded")]
    fn lend_to_embedded(&self, ptr: u64, size: u64) {
        let crate::connection::Target::InProcess(host) = &self.inner.target else {
            return;
        };
        let mut memory = self.inner.memory.lock();
        if memory.is_shared(ptr, size) {
            return;
        }
        // SAFETY: the application registered `ptr..ptr+size` and, as upstream requires
        // of registered memory, keeps it valid until `unregister_buffer`, which removes
        // it from the real client before returning.
        let borrowed = match unsafe { mooncake_shm::SharedMemory::borrowed(ptr, size) } {
            Ok(borrowed) => Arc::new(borrowed),
            Err(error) => {
                tracing::debug!(%error, "registered buffer kept on the copy-through path");
                return;
            }
        };
        let offer = Offer {
            memory: Arc::clone(&borrowed),
            kind: SegmentKind::Pool,
        };
        match host.attach(self.inner.identity.client_id, Arc::clone(&offer.memory)) {
            Ok(()) => memory.add_host(borrowed),
            Err(error) => {
                tracing::debug!(%error, "registered buffer kept on the copy-through path");
            }
        }
    }

    /// Forgets a buffer registered with [`register_buffer`](Self::register_buffer)
    /// (and its declaration to the real client); `INVALID_PARAMS` when `ptr` does not
    /// start one.
    pub fn unregister_buffer(&self, ptr: u64) -> CodeResult<()> {
        if self.is_closed() {
            return Err(ErrorCode::RPC_FAIL);
        }
        // Lock order as in `rpc`: link, then memory.
        let mut link = self.inner.link.lock();
        let mut memory = self.inner.memory.lock();
        if memory.is_declared(ptr) {
            memory.unregister(ptr);
            drop(memory);
            self.forget_over(&mut link, ptr);
            return Ok(());
        }
        drop(link);
        if memory.unregister(ptr) {
            #[cfg(feature = "embedded")]
            if let (Some(gone), crate::connection::Target::InProcess(host)) =
                (memory.remove_borrowed(ptr), &self.inner.target)
            {
                host.detach(self.inner.identity.client_id, ptr);
                // Buffers registered inside the one just removed are handed over on
                // their own.
                let inner = memory.registrations_within(ptr, gone.len() as u64);
                drop(memory);
                for (start, len) in inner {
                    self.lend_to_embedded(start, len);
                }
            }
            Ok(())
        } else {
            Err(ErrorCode::INVALID_PARAMS)
        }
    }
}
