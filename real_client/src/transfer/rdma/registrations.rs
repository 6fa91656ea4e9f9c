//! Local memory registered with the NICs: each mapping (the segment, a dummy's shared
//! memory, an application's registered buffer, a bounce buffer) is registered once per
//! device, the first time a transfer uses it, and deregistered once the mapping is
//! gone (an entry whose mapping was dropped is never reused, even at the same
//! address).

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use mooncake_rdma::{Device, MemoryRegion, RdmaError, Reach};
use mooncake_shm::{MemSlice, SharedMemory};

/// Mappings registered at most (entries of dropped mappings are swept whenever a new
/// mapping comes); past it, a new mapping is refused and its transfers fail.
pub const MAX_REGISTERED_MAPPINGS: usize = 4096;

/// One mapping's registrations, one slot per device.
#[derive(Debug)]
struct Registered {
    memory: Weak<SharedMemory>,
    regions: Vec<Option<Arc<MemoryRegion>>>,
}

/// The registrations of this node's local memory.
#[derive(Debug, Default)]
pub struct Registrations {
    by_mapping: Mutex<HashMap<usize, Registered>>,
}

impl Registrations {
    /// Seeds the cache with `regions` (one per device) of `memory` (the segment,
    /// registered already for peers).
    pub fn seed(&self, memory: &Arc<SharedMemory>, regions: &[Arc<MemoryRegion>]) {
        self.by_mapping.lock().insert(
            Arc::as_ptr(memory) as usize,
            Registered {
                memory: Arc::downgrade(memory),
                regions: regions.iter().cloned().map(Some).collect(),
            },
        );
    }

    /// The registration on `device` (index `index` of `count`) of the mapping `slice`
    /// lies in, registering the whole mapping when it is new.
    pub fn region_for(
        &self,
        slice: &MemSlice,
        device: &Arc<Device>,
        index: usize,
        count: usize,
    ) -> Result<Arc<MemoryRegion>, RdmaError> {
        let memory = slice.memory();
        let key = Arc::as_ptr(memory) as usize;
        let mut by_mapping = self.by_mapping.lock();
        let current = by_mapping.get(&key).is_some_and(|entry| {
            entry
                .memory
                .upgrade()
                .is_some_and(|m| Arc::ptr_eq(&m, memory))
        });
        if !current {
            // Regions of dropped mappings still pin their pages: let them go.
            by_mapping.retain(|_, entry| entry.memory.strong_count() > 0);
            if by_mapping.len() >= MAX_REGISTERED_MAPPINGS {
                return Err(RdmaError::NoDevice(format!(
                    "{MAX_REGISTERED_MAPPINGS} mappings are registered already"
                )));
            }
            by_mapping.insert(
                key,
                Registered {
                    memory: Arc::downgrade(memory),
                    regions: vec![None; count],
                },
            );
        }
        let entry = by_mapping
            .get_mut(&key)
            .ok_or_else(|| RdmaError::NoDevice("registration vanished".into()))?;
        if let Some(Some(region)) = entry.regions.get(index) {
            return Ok(Arc::clone(region));
        }
        // SAFETY: the caller's slice keeps the mapping alive while this transfer uses
        // the region, and a region is only ever handed out for a live mapping (an
        // entry whose mapping died is replaced first); a region outliving its mapping
        // only keeps the old pages pinned until it is swept.
        let region = Arc::new(unsafe {
            MemoryRegion::register(device, memory.base(), memory.len() as u64, Reach::Local)
        }?);
        if let Some(slot) = entry.regions.get_mut(index) {
            *slot = Some(Arc::clone(&region));
        }
        Ok(region)
    }

    /// Mappings registered now.
    pub fn len(&self) -> usize {
        self.by_mapping.lock().len()
    }
}
