//! The dummy's shared memory: the application pool (growing on demand) and the staging
//! buffer that ordinary memory is copied through.

use std::sync::Arc;

use mooncake_core::protocol::handshake::SegmentKind;
use mooncake_shm::shared_memory::PageSize;
use mooncake_shm::{MemSlice, PoolAllocator, SharedMemory, ShmError};

use crate::connection::Offer;

/// Pool and staging allocators plus the segments behind them.
#[derive(Debug)]
pub struct DummyMemory {
    /// Blocks handed out by `alloc_from_mem_pool`.
    pub pool: PoolAllocator,
    /// Short-lived blocks for copying ordinary memory through.
    pub staging: Option<(Arc<SharedMemory>, PoolAllocator)>,
    /// Size of each additional pool segment.
    pub growth_step: u64,
    page: PageSize,
}

impl DummyMemory {
    /// Creates the pool (`pool_size` bytes) and the staging buffer (`staging_size`
    /// bytes; none when 0).
    pub fn create(pool_size: u64, staging_size: u64) -> Result<Self, ShmError> {
        let page = PageSize::from_env();
        let pool_memory = Arc::new(SharedMemory::create(
            "mooncake_pool",
            pool_size.max(1),
            page,
        )?);
        let staging = if staging_size > 0 {
            let memory = Arc::new(SharedMemory::create(
                "mooncake_staging",
                staging_size,
                page,
            )?);
            let allocator = PoolAllocator::new(Arc::clone(&memory));
            Some((memory, allocator))
        } else {
            None
        };
        Ok(DummyMemory {
            pool: PoolAllocator::new(pool_memory),
            staging,
            growth_step: pool_size.max(64 << 20),
            page,
        })
    }

    /// A new pool segment large enough for `len` bytes (not yet added to the pool).
    pub fn new_pool_segment(&self, len: u64) -> Result<Arc<SharedMemory>, ShmError> {
        let size = len.max(self.growth_step);
        Ok(Arc::new(SharedMemory::create(
            "mooncake_pool",
            size,
            self.page,
        )?))
    }

    /// Every segment to register with a real client.
    pub fn offers(&self) -> Vec<Offer> {
        let pool = self.pool.segments().map(|memory| Offer {
            memory: Arc::clone(memory),
            kind: SegmentKind::Pool,
        });
        let staging = self.staging.iter().map(|(memory, _)| Offer {
            memory: Arc::clone(memory),
            kind: SegmentKind::Staging,
        });
        pool.chain(staging).collect()
    }

    /// Takes a staging block of `len` bytes.
    pub fn stage(&mut self, len: u64) -> Option<StagingBlock> {
        let (memory, allocator) = self.staging.as_mut()?;
        let addr = allocator.allocate(len)?;
        let slice = memory.slice(addr - memory.base(), len)?;
        Some(StagingBlock { addr, slice })
    }

    /// Returns a staging block.
    pub fn unstage(&mut self, block: &StagingBlock) {
        if let Some((_, allocator)) = self.staging.as_mut() {
            allocator.free(block.addr);
        }
    }

    /// Capacity of the staging buffer.
    pub fn staging_capacity(&self) -> u64 {
        self.staging.as_ref().map_or(0, |(_, a)| a.capacity())
    }
}

/// A block of the staging buffer: its dummy address and its memory.
#[derive(Debug)]
pub struct StagingBlock {
    /// Address in this process (what the real client is told).
    pub addr: u64,
    /// The memory.
    pub slice: MemSlice,
}
