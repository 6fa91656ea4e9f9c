//! The real client's map of one dummy's shared memory: `dummy range → real address`.
//!
//! Every address a dummy names is translated here, and a range that is not wholly inside
//! one registered segment is rejected before any byte moves.

use std::sync::Arc;

use crate::shared_memory::{MemSlice, SharedMemory};

/// Why a dummy range could not be translated or registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    /// The range is empty.
    #[error("empty range at {addr:#x}")]
    Empty {
        /// Start address.
        addr: u64,
    },
    /// The range is not inside any registered segment.
    #[error("range {addr:#x}+{len} is not inside the dummy's registered shared memory")]
    Unregistered {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// The range starts inside a segment but runs past its end.
    #[error("range {addr:#x}+{len} runs past the end of its segment ({segment_end:#x})")]
    PastEnd {
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// End of the segment the range starts in.
        segment_end: u64,
    },
    /// A new segment would overlap one already registered.
    #[error("segment {base:#x}+{len} overlaps a segment already registered")]
    Overlap {
        /// Declared base.
        base: u64,
        /// Declared length.
        len: u64,
    },
}

#[derive(Debug)]
struct Region {
    dummy_base: u64,
    len: u64,
    mem: Arc<SharedMemory>,
}

/// Segments one dummy has registered, sorted by their address in the dummy.
#[derive(Debug, Default)]
pub struct Registry {
    regions: Vec<Region>,
}

impl Registry {
    /// Records that the dummy's `dummy_base..dummy_base+mem.len()` is `mem`.
    pub fn add(&mut self, dummy_base: u64, mem: Arc<SharedMemory>) -> Result<(), TranslateError> {
        let len = mem.len() as u64;
        let overlap = TranslateError::Overlap {
            base: dummy_base,
            len,
        };
        let end = dummy_base.checked_add(len).ok_or_else(|| overlap.clone())?;
        let index = self.regions.partition_point(|r| r.dummy_base < dummy_base);
        let clashes_prev = index > 0 && {
            let prev = &self.regions[index - 1];
            prev.dummy_base + prev.len > dummy_base
        };
        let clashes_next = self
            .regions
            .get(index)
            .is_some_and(|next| next.dummy_base < end);
        if clashes_prev || clashes_next {
            return Err(overlap);
        }
        self.regions.insert(
            index,
            Region {
                dummy_base,
                len,
                mem,
            },
        );
        Ok(())
    }

    /// The shared memory behind the dummy's `addr..addr+len`.
    pub fn translate(&self, addr: u64, len: u64) -> Result<MemSlice, TranslateError> {
        if len == 0 {
            return Err(TranslateError::Empty { addr });
        }
        let index = self.regions.partition_point(|r| r.dummy_base <= addr);
        let region = index
            .checked_sub(1)
            .map(|i| &self.regions[i])
            .filter(|r| addr - r.dummy_base < r.len)
            .ok_or(TranslateError::Unregistered { addr, len })?;
        let offset = addr - region.dummy_base;
        let past_end = TranslateError::PastEnd {
            addr,
            len,
            segment_end: region.dummy_base + region.len,
        };
        region.mem.slice(offset, len).ok_or(past_end)
    }

    /// Forgets the segment registered at `dummy_base`; false when there is none.
    pub fn remove(&mut self, dummy_base: u64) -> bool {
        match self.regions.iter().position(|r| r.dummy_base == dummy_base) {
            Some(index) => {
                self.regions.remove(index);
                true
            }
            None => false,
        }
    }

    /// Number of registered segments.
    pub fn segment_count(&self) -> usize {
        self.regions.len()
    }

    /// Bytes mapped in total.
    pub fn mapped_bytes(&self) -> u64 {
        self.regions.iter().map(|r| r.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_memory::PageSize;

    fn mem(len: u64) -> Arc<SharedMemory> {
        Arc::new(SharedMemory::create("reg", len, PageSize::Normal).expect("create"))
    }

    #[test]
    fn translates_only_inside_segments() {
        let mut registry = Registry::default();
        registry.add(0x10000, mem(4096)).expect("add");
        registry.add(0x20000, mem(8192)).expect("add");
        assert_eq!(registry.mapped_bytes(), 12288);
        assert_eq!(
            registry.translate(0x10000, 4096).expect("whole").len(),
            4096
        );
        assert_eq!(registry.translate(0x20100, 16).expect("inside").len(), 16);
        assert!(matches!(
            registry.translate(0x10000, 4097),
            Err(TranslateError::PastEnd { .. })
        ));
        assert!(matches!(
            registry.translate(0x0fff0, 32),
            Err(TranslateError::Unregistered { .. })
        ));
        assert!(matches!(
            registry.translate(0x11000, 1),
            Err(TranslateError::Unregistered { .. })
        ));
        assert!(matches!(
            registry.translate(0x20000, u64::MAX),
            Err(TranslateError::PastEnd { .. })
        ));
        assert!(matches!(
            registry.translate(u64::MAX, 1),
            Err(TranslateError::Unregistered { .. })
        ));
        assert!(matches!(
            registry.translate(0x10000, 0),
            Err(TranslateError::Empty { .. })
        ));
        assert!(matches!(
            registry.add(0x10800, mem(4096)),
            Err(TranslateError::Overlap { .. })
        ));
        assert!(matches!(
            registry.add(0x1f000, mem(8192)),
            Err(TranslateError::Overlap { .. })
        ));
        assert!(matches!(
            registry.add(u64::MAX - 10, mem(4096)),
            Err(TranslateError::Overlap { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn any_range_is_inside_or_rejected(addr in 0x8000u64..0x30000, len in 0u64..0x10000) {
            let mut registry = Registry::default();
            registry.add(0x10000, mem(4096)).expect("add");
            registry.add(0x20000, mem(8192)).expect("add");
            let inside = (addr >= 0x10000 && addr + len <= 0x11000) || (addr >= 0x20000 && addr + len <= 0x22000);
            proptest::prop_assert_eq!(registry.translate(addr, len).is_ok(), inside && len > 0);
        }
    }
}
