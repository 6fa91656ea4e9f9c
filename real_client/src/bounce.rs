//! Bounce buffers: private shared memory that the transfer engine sends from and
//! receives into when the caller's memory is not mapped in this process (a dummy's
//! declared ordinary memory, GPU memory, bytes of this process).
//!
//! Creating a buffer per transfer costs more than the copy it serves (a memfd, a
//! mapping, a page fault per page, and for GPU copies a pageable staging copy inside
//! the driver), so buffers are kept and reused: at most [`CACHED_BYTES`] in all, in
//! power-of-two size classes. A buffer is reused only once nobody holds a slice of it
//! any more. Buffers that serve GPU copies are pinned once (`cuMemHostRegister` /
//! `hipHostRegister`), so the device copies into and out of them run at bus speed.

use std::sync::Arc;

use parking_lot::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_device::DeviceApi;
use mooncake_device::driver::{self, PinnedHost};
use mooncake_shm::MemSlice;
use mooncake_shm::SharedMemory;
use mooncake_shm::shared_memory::PageSize;

/// Most bytes of bounce buffers kept for reuse; a transfer that finds no free buffer
/// within it gets a buffer of its own, freed when it ends.
pub const CACHED_BYTES: u64 = 256 << 20;
/// The smallest size class.
const MIN_CLASS: u64 = 64 << 10;

/// One kept buffer. `pinned` is declared first so that it is unpinned before the
/// memory can be unmapped.
#[derive(Debug)]
struct Cached {
    pinned: Option<PinnedHost>,
    memory: Arc<SharedMemory>,
}

impl Cached {
    /// True when no slice of the buffer is in use (only the pool holds it).
    fn is_free(&self) -> bool {
        Arc::strong_count(&self.memory) == 1
    }

    fn class(&self) -> u64 {
        self.memory.len() as u64
    }
}

/// The kept bounce buffers of one real client.
#[derive(Debug, Default)]
pub struct BouncePool {
    kept: Mutex<Vec<Cached>>,
}

impl BouncePool {
    /// A buffer of `len` bytes (its former contents are not cleared: callers overwrite
    /// every byte before reading any). With `pin_for`, the buffer is pinned for copies
    /// with that GPU interface (when pinning fails, copies run from pageable memory).
    pub fn take(&self, len: u64, pin_for: Option<DeviceApi>) -> CodeResult<MemSlice> {
        let class = size_class(len);
        let mut kept = self.kept.lock();
        let found = kept.iter().position(|c| c.class() == class && c.is_free());
        let index = match found {
            Some(index) => Some(index),
            None if make_room(&mut kept, class) => {
                kept.push(Cached {
                    pinned: None,
                    memory: create(class)?,
                });
                Some(kept.len() - 1)
            }
            None => None,
        };
        let Some(index) = index else {
            drop(kept);
            let memory = create(len.max(1))?;
            return memory.slice(0, len).ok_or(ErrorCode::INTERNAL_ERROR);
        };
        let cached = &mut kept[index];
        if let (Some(api), None) = (pin_for, &cached.pinned) {
            cached.pinned = pin(&cached.memory, api);
        }
        cached.memory.slice(0, len).ok_or(ErrorCode::INTERNAL_ERROR)
    }

    /// Bytes of buffers kept for reuse.
    #[cfg(test)]
    pub fn kept_bytes(&self) -> u64 {
        self.kept.lock().iter().map(Cached::class).sum()
    }
}

/// The size class of a buffer for `len` bytes.
fn size_class(len: u64) -> u64 {
    len.max(MIN_CLASS)
        .checked_next_power_of_two()
        .unwrap_or(u64::MAX)
}

/// True when a buffer of `class` bytes fits in [`CACHED_BYTES`], after dropping free
/// buffers of other classes if needed.
fn make_room(kept: &mut Vec<Cached>, class: u64) -> bool {
    if class > CACHED_BYTES {
        return false;
    }
    let mut total: u64 = kept.iter().map(Cached::class).sum();
    while total + class > CACHED_BYTES {
        let Some(index) = kept.iter().position(Cached::is_free) else {
            return false;
        };
        total -= kept.swap_remove(index).class();
    }
    true
}

fn create(len: u64) -> CodeResult<Arc<SharedMemory>> {
    SharedMemory::create("mooncake_bounce", len, PageSize::Normal)
        .map(Arc::new)
        .map_err(|error| {
            tracing::warn!(%error, len, "cannot create a bounce buffer");
            ErrorCode::NO_AVAILABLE_HANDLE
        })
}

/// Pins `memory` for copies with `api`; `None` (logged) when it cannot be.
fn pin(memory: &Arc<SharedMemory>, api: DeviceApi) -> Option<PinnedHost> {
    let driver = driver::driver(api).ok()?;
    // SAFETY: the guard is kept next to the `Arc` in `Cached`, declared before it, so it
    // is dropped (unpinned) while the memory is still mapped.
    match unsafe { driver.pin(memory.base() as *mut u8, memory.len() as u64) } {
        Ok(pinned) => Some(pinned),
        Err(error) => {
            tracing::warn!(%error, "a bounce buffer could not be pinned for GPU copies (they run from pageable memory; raise the memlock limit)");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_reused_only_once_its_slices_are_dropped() {
        let pool = BouncePool::default();
        let first = pool.take(100 << 10, None).expect("take");
        first.write_from(&[7]);
        let second = pool.take(100 << 10, None).expect("take");
        assert_eq!(
            second.to_vec()[0],
            0,
            "a buffer in use is not handed out again"
        );
        drop(first);
        let third = pool.take(90 << 10, None).expect("take");
        assert_eq!(third.to_vec()[0], 7, "a free buffer of the class is reused");
        assert_eq!(third.len(), 90 << 10);
        assert_eq!(pool.kept_bytes(), 2 * (128 << 10));
    }

    #[test]
    fn kept_bytes_stay_within_the_limit() {
        let pool = BouncePool::default();
        let held: Vec<MemSlice> = (0..3)
            .map(|_| pool.take(100 << 20, None).expect("take"))
            .collect();
        assert!(pool.kept_bytes() <= CACHED_BYTES, "{}", pool.kept_bytes());
        assert_eq!(
            held[2].len(),
            100 << 20,
            "past the limit a buffer of its own"
        );
        drop(held);
        // Free buffers of another class make room for a new class.
        let small = pool.take(4 << 20, None).expect("take");
        assert_eq!(small.len(), 4 << 20);
        assert!(pool.kept_bytes() <= CACHED_BYTES);
        let huge = pool.take(CACHED_BYTES + 1, None).expect("take");
        assert_eq!(huge.len() as u64, CACHED_BYTES + 1);
        assert!(pool.kept_bytes() <= CACHED_BYTES);
    }
}
