//! The dummy's memory: the shared pool (growing on demand), the staging buffer that
//! ordinary memory is copied through when it must be, and the buffers the application
//! registered.
//!
//! Every `(ptr, len)` an application passes is classified here:
//! * inside the dummy's shared memory: sent as is, zero-copy;
//! * inside a buffer registered with `register_buffer` that is *not* shared memory
//!   (heap, numpy, pinned host memory) and that the real client accepted as declared
//!   memory it can reach across processes: sent as is, copied once by the real client;
//! * inside another registered ordinary buffer: copied through the staging buffer;
//! * inside a registered GPU buffer the real client opened (or, embedded, borrowed):
//!   sent as is, copied once by the real client's CUDA driver; never touched here;
//! * anything else: sent as is, and the real client rejects it with `INVALID_PARAMS`
//!   (it only ever touches memory the dummy registered or declared with it).

use std::collections::BTreeMap;
use std::sync::Arc;

use mooncake_core::protocol::handshake::SegmentKind;
use mooncake_core::protocol::rpc::MemRange;
use mooncake_device::DeviceAllocation;
use mooncake_shm::shared_memory::PageSize;
use mooncake_shm::{MemSlice, PoolAllocator, SharedMemory, ShmError};

/// A segment to register, with its role.
#[derive(Clone, Debug)]
pub struct Offer {
    /// The memory.
    pub memory: Arc<SharedMemory>,
    /// Pool or staging.
    pub kind: SegmentKind,
}

/// How the dummy passes one application range to the real client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeKind {
    /// Inside the dummy's shared memory: zero-copy.
    Shared,
    /// Inside a registered ordinary buffer declared to a real client that reaches it:
    /// copied once, by the real client.
    CrossMemory,
    /// Inside a registered ordinary buffer: copied through staging.
    CopyThrough,
    /// Inside a registered GPU buffer the real client reaches: copied once, by the
    /// real client's CUDA driver.
    Device,
    /// Unknown memory: forwarded and rejected by the real client.
    Foreign,
}

/// Pool and staging allocators, the segments behind them, and registered buffers.
#[derive(Debug)]
pub struct DummyMemory {
    /// Blocks handed out by `alloc_from_mem_pool`.
    pub pool: PoolAllocator,
    staging: Option<(Arc<SharedMemory>, PoolAllocator)>,
    growth_step: u64,
    page: PageSize,
    /// Buffers registered with `register_buffer`, by start address.
    registered: BTreeMap<u64, Registration>,
    /// Whether the real client reaches declared ordinary memory (its answer to the
    /// last declaration of this connection).
    cross_memory: bool,
    /// Pool blocks owned by live buffer handles (not freeable by the application).
    pub handle_blocks: std::collections::HashSet<u64>,
    /// Host allocations (`MooncakeHostMemAllocator`) registered with the real client.
    host: Vec<Arc<SharedMemory>>,
}

/// A buffer the application registered.
#[derive(Clone, Copy, Debug)]
struct Registration {
    len: u64,
    /// Inside the dummy's shared memory (zero-copy).
    shared: bool,
    /// Ordinary memory the connected real client accepted as declared, or a GPU
    /// buffer it reaches.
    declared: bool,
    /// The device allocation, for a GPU buffer.
    device: Option<DeviceAllocation>,
}

/// A block of the staging buffer: its dummy address and its memory.
#[derive(Debug)]
pub struct StagingBlock {
    /// Address in this process (what the real client is told).
    pub addr: u64,
    /// The memory.
    pub slice: MemSlice,
}

impl StagingBlock {
    /// The block as a range for a request.
    pub fn range(&self) -> MemRange {
        MemRange {
            addr: self.addr,
            len: self.slice.len() as u64,
        }
    }
}

impl DummyMemory {
    /// Creates the pool (`pool_size` bytes) and the staging buffer (`staging_size`
    /// bytes; none when 0).
    pub fn create(pool_size: u64, staging_size: u64) -> Result<Self, ShmError> {
        let page = PageSize::from_env();
        // Pages are faulted in on first use, not up front: engines size the pool for the
        // whole KV cache (gigabytes), and setup must not wait for it.
        let pool_memory = Arc::new(SharedMemory::create_populated(
            "mooncake_pool",
            pool_size.max(1),
            page,
            false,
        )?);
        let staging = if staging_size > 0 {
            let memory = Arc::new(SharedMemory::create_populated(
                "mooncake_staging",
                staging_size,
                page,
                false,
            )?);
            // Every copy-through transfer uses the staging buffer: fault it in on a
            // background thread so the first transfers do not pay for it.
            memory.prefault_in_background("mooncake-prefault");
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
            registered: BTreeMap::new(),
            cross_memory: false,
            handle_blocks: std::collections::HashSet::new(),
            host: Vec::new(),
        })
    }

    /// A new pool segment large enough for `len` bytes (not yet added to the pool).
    pub fn new_pool_segment(&self, len: u64) -> Result<Arc<SharedMemory>, ShmError> {
        let size = len.max(self.growth_step);
        Ok(Arc::new(SharedMemory::create_populated(
            "mooncake_pool",
            size,
            self.page,
            false,
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
        let host = self.host.iter().map(|memory| Offer {
            memory: Arc::clone(memory),
            kind: SegmentKind::Pool,
        });
        pool.chain(staging).chain(host).collect()
    }

    /// True when `memory` (a host allocation) is registered with the real client.
    pub fn has_host(&self, memory: &Arc<SharedMemory>) -> bool {
        self.host.iter().any(|m| Arc::ptr_eq(m, memory))
    }

    /// Records a host allocation as registered with the real client.
    pub fn add_host(&mut self, memory: Arc<SharedMemory>) {
        if !self.has_host(&memory) {
            self.host.push(memory);
        }
    }

    #[cfg(feature = "embedded")]
    /// Forgets the host segment starting at `base` (application memory borrowed in
    /// place); returns it when there was one.
    pub fn remove_borrowed(&mut self, base: u64) -> Option<Arc<SharedMemory>> {
        let index = self
            .host
            .iter()
            .position(|m| m.is_borrowed() && m.base() == base)?;
        Some(self.host.remove(index))
    }

    #[cfg(feature = "embedded")]
    /// Registered buffers lying inside `base..base+len`.
    pub fn registrations_within(&self, base: u64, len: u64) -> Vec<(u64, u64)> {
        let end = base.saturating_add(len);
        self.registered
            .range(base..end)
            .filter(|(start, r)| start.saturating_add(r.len) <= end)
            .map(|(&start, r)| (start, r.len))
            .collect()
    }

    /// Every registered buffer that is host memory but not shared memory, as
    /// `(start, len)`.
    pub fn ordinary_registrations(&self) -> Vec<(u64, u64)> {
        self.registered
            .iter()
            .filter(|(_, r)| !r.shared && r.device.is_none())
            .map(|(&start, r)| (start, r.len))
            .collect()
    }

    /// Every registered GPU buffer, as `(start, len, allocation)`.
    pub fn device_registrations(&self) -> Vec<(u64, u64, DeviceAllocation)> {
        self.registered
            .iter()
            .filter_map(|(&start, r)| r.device.map(|d| (start, r.len, d)))
            .collect()
    }

    /// Registers the GPU buffer `addr..addr+len` of `allocation`; `declared` when the
    /// real client reaches it already.
    pub fn register_device(
        &mut self,
        addr: u64,
        len: u64,
        allocation: DeviceAllocation,
        declared: bool,
    ) {
        let registration = Registration {
            len,
            shared: false,
            declared,
            device: Some(allocation),
        };
        self.registered.insert(addr, registration);
    }

    /// Records whether the real client accepted the buffer at `start` as declared.
    pub fn set_declared(&mut self, start: u64, declared: bool) {
        if let Some(registration) = self.registered.get_mut(&start) {
            registration.declared = declared;
        }
    }

    /// A new connection knows no declaration yet: every buffer goes through staging
    /// until declared again.
    pub fn forget_declarations(&mut self) {
        self.cross_memory = false;
        for registration in self.registered.values_mut() {
            registration.declared = false;
        }
    }

    /// Records whether the real client reaches declared memory.
    pub fn set_cross_memory(&mut self, available: bool) {
        self.cross_memory = available;
    }

    #[cfg(feature = "embedded")]
    /// True when `addr..addr+len` is already shared with the real client.
    pub fn is_shared(&self, addr: u64, len: u64) -> bool {
        self.in_shared_memory(addr, len)
    }

    fn in_host_memory(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        self.host
            .iter()
            .any(|m| addr >= m.base() && end <= m.base().saturating_add(m.len() as u64))
    }

    /// Takes a staging block of `len` bytes.
    pub fn stage(&mut self, len: u64) -> Option<StagingBlock> {
        let (memory, allocator) = self.staging.as_mut()?;
        let addr = allocator.allocate(len)?;
        let slice = memory.slice(addr - memory.base(), len)?;
        Some(StagingBlock { addr, slice })
    }

    /// The memory of pool block `addr..addr+len` (for the dummy's own copies).
    pub fn pool_slice(&self, addr: u64, len: u64) -> Option<MemSlice> {
        if !self.pool.within_block(addr, len) {
            return None;
        }
        self.pool.segments().find_map(|memory| {
            let offset = addr.checked_sub(memory.base())?;
            memory.slice(offset, len)
        })
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

    fn in_shared_memory(&self, addr: u64, len: u64) -> bool {
        (self.pool.contains(addr, len) && self.pool.within_block(addr, len))
            || self
                .staging
                .as_ref()
                .is_some_and(|(_, a)| a.contains(addr, len))
            || self.in_host_memory(addr, len)
    }

    /// True when `addr..addr+len` is host memory this client may read: its shared
    /// memory or a registered host buffer (never GPU memory).
    pub fn is_known(&self, addr: u64, len: u64) -> bool {
        !matches!(
            self.classify(addr, len),
            RangeKind::Foreign | RangeKind::Device
        )
    }

    /// Registers `addr..addr+len` as an application buffer (not declared yet);
    /// returns whether it is shared memory (zero-copy).
    pub fn register(&mut self, addr: u64, len: u64) -> bool {
        let shared = self.in_shared_memory(addr, len);
        let registration = Registration {
            len,
            shared,
            declared: false,
            device: None,
        };
        self.registered.insert(addr, registration);
        shared
    }

    /// True when the buffer registered at `addr` is declared to the real client.
    pub fn is_declared(&self, addr: u64) -> bool {
        self.registered.get(&addr).is_some_and(|r| r.declared)
    }

    /// Forgets a registered buffer; false when `addr` was not registered.
    pub fn unregister(&mut self, addr: u64) -> bool {
        self.registered.remove(&addr).is_some()
    }

    /// How the range `addr..addr+len` is passed on.
    pub fn classify(&self, addr: u64, len: u64) -> RangeKind {
        if self.in_shared_memory(addr, len) {
            return RangeKind::Shared;
        }
        let Some(end) = addr.checked_add(len) else {
            return RangeKind::Foreign;
        };
        let mut containing = self
            .registered
            .range(..=addr)
            .filter(|(start, r)| end <= start.saturating_add(r.len))
            .peekable();
        let Some((_, first)) = containing.peek() else {
            return RangeKind::Foreign;
        };
        if first.device.is_some() {
            // A GPU buffer: never copied here; forwarded when the real client reaches
            // it, else rejected by it.
            return if first.declared {
                RangeKind::Device
            } else {
                RangeKind::Foreign
            };
        }
        if self.cross_memory && containing.any(|(_, r)| r.declared) {
            RangeKind::CrossMemory
        } else {
            RangeKind::CopyThrough
        }
    }

    /// Usable bytes from `addr` on: the registered buffer's size when `addr` starts one,
    /// else the pool block's requested size, else the rest of its shared segment.
    pub fn capacity_at(&self, addr: u64) -> u64 {
        if let Some(registration) = self.registered.get(&addr) {
            return registration.len;
        }
        if let Some(len) = self.pool.block_len(addr) {
            return len;
        }
        let staging = self.staging.as_ref().map_or(0, |(_, a)| a.room_after(addr));
        self.pool.room_after(addr).max(staging)
    }
}
