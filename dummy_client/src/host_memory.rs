//! Host memory for the application's own buffers that the real client can map
//! (upstream's `MooncakeHostMemAllocator`).
//!
//! Engines allocate their host KV pool before a store exists (SGLang's standalone mode
//! does exactly this) and register it later with `register_buffer`. Each allocation
//! made here is its own memfd segment, so that whichever dummy client registers a
//! range of it can hand the segment to its real client: transfers to and from that
//! pool are then zero-copy, like the dummy's own pool. The allocations belong to the
//! process, not to a client: they outlive `close()` and are freed with [`free`].
//!
//! Pages are not populated up front (a pool of many gigabytes would take seconds);
//! they are faulted in on first touch, by the application or by the real client.

use std::collections::BTreeMap;
use std::sync::Arc;

use parking_lot::Mutex;

use mooncake_shm::shared_memory::PageSize;
use mooncake_shm::{SharedMemory, ShmError};

/// Live allocations: base address → segment.
static ALLOCATIONS: Mutex<BTreeMap<u64, Arc<SharedMemory>>> = Mutex::new(BTreeMap::new());

/// Allocates `size` bytes of shareable host memory; returns its address.
pub fn alloc(size: u64) -> Result<u64, ShmError> {
    if size == 0 {
        return Err(ShmError::BadSize { len: 0 });
    }
    let memory =
        SharedMemory::create_populated("mooncake_host", size, PageSize::from_env(), false)?;
    let base = memory.base();
    ALLOCATIONS.lock().insert(base, Arc::new(memory));
    Ok(base)
}

/// Frees an allocation made by [`alloc`]; false when `addr` does not start one. A real
/// client that mapped it keeps its mapping until its session with this process ends.
pub fn free(addr: u64) -> bool {
    ALLOCATIONS.lock().remove(&addr).is_some()
}

/// Every live allocation (handed to a real client when a dummy sets up).
pub fn all() -> Vec<Arc<SharedMemory>> {
    ALLOCATIONS.lock().values().cloned().collect()
}

/// The allocation holding all of `addr..addr+len`, if any.
pub fn containing(addr: u64, len: u64) -> Option<Arc<SharedMemory>> {
    let end = addr.checked_add(len)?;
    let allocations = ALLOCATIONS.lock();
    let (base, memory) = allocations.range(..=addr).next_back()?;
    (end <= base.saturating_add(memory.len() as u64)).then(|| Arc::clone(memory))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocations_are_found_by_any_inner_range_and_freed_once() {
        let addr = alloc(10_000).expect("alloc");
        let memory = containing(addr + 100, 200).expect("inside");
        assert_eq!(memory.base(), addr);
        assert!(containing(addr, memory.len() as u64 + 1).is_none());
        assert!(containing(addr.wrapping_sub(1), 2).is_none());
        assert!(free(addr));
        assert!(!free(addr));
        assert!(containing(addr, 1).is_none());
    }

    #[test]
    fn zero_bytes_is_refused() {
        assert!(alloc(0).is_err());
    }
}
