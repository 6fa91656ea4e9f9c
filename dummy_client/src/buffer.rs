//! [`BufferHandle`]: an object's bytes in the dummy's shared pool, valid until dropped.

use crate::client::DummyClient;

/// A copy of an object in a block of the dummy's shared pool. The memory stays valid
/// (and unchanged) until the handle is dropped, even if the key is removed or replaced
/// meanwhile, or the real client restarts; dropping it returns the block to the pool.
#[derive(Debug)]
pub struct BufferHandle {
    client: DummyClient,
    addr: u64,
    size: u64,
}

impl BufferHandle {
    /// Takes ownership of a pool block holding `size` valid bytes.
    pub(crate) fn new(client: DummyClient, addr: u64, size: u64) -> Self {
        client.inner.memory.lock().handle_blocks.insert(addr);
        BufferHandle { client, addr, size }
    }

    /// Address of the bytes in this process.
    pub fn ptr(&self) -> u64 {
        self.addr
    }

    /// Number of bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Number of bytes (same as [`size`](Self::size)).
    pub fn len(&self) -> usize {
        usize::try_from(self.size).unwrap_or(usize::MAX)
    }

    /// True for an empty object (never happens: empty objects cannot be stored).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the block `addr..addr+size` was allocated from the pool for this handle
        // alone and stays allocated until `drop`; the real client wrote it before the
        // handle was made and never touches it again.
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len()) }
    }
}

impl Drop for BufferHandle {
    fn drop(&mut self) {
        let mut memory = self.client.inner.memory.lock();
        memory.handle_blocks.remove(&self.addr);
        memory.pool.free(self.addr);
    }
}
