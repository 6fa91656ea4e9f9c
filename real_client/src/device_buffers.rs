//! GPU buffers a dummy registered, and how this real client reaches them.
//!
//! * An in-process dummy (embedded mode) lends its device buffers as they are: the
//!   device pointers are valid here.
//! * A dummy in another process sends the IPC handle of each buffer's allocation; the
//!   allocation is opened once per session (cache keyed by the dummy's allocation
//!   base) and closed when the last buffer in it is forgotten or the session ends —
//!   after the last copy in flight, which holds the allocation too.
//!
//! Requests then name ranges inside a registered buffer, and the store copies them
//! straight between the device and the segment ([`Region::Device`]). The node's
//! segment is pinned in the background when the first device buffer arrives, so those
//! copies run at bus speed. At most [`MAX_DEVICE_BUFFERS`] buffers per session.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::rpc::DeviceBufferDecl;
use mooncake_device::DeviceApi;
use mooncake_device::driver::{self, IPC_HANDLE_LEN};
use mooncake_shm::SharedMemory;

use crate::region::{DeviceRange, DeviceTarget, Region};

/// Most device buffers one session may register.
pub const MAX_DEVICE_BUFFERS: usize = 4096;

/// One registered buffer.
#[derive(Clone, Debug)]
struct Buffer {
    len: u64,
    /// The dummy's start of the allocation holding the buffer.
    dummy_base: u64,
    target: Arc<DeviceTarget>,
}

#[derive(Debug, Default)]
struct Registered {
    /// Dummy address → buffer.
    buffers: BTreeMap<u64, Buffer>,
    /// Opened allocations by the dummy's allocation base.
    allocations: HashMap<u64, Arc<DeviceTarget>>,
    longest: u64,
}

/// The device buffers of one session.
#[derive(Debug, Default)]
pub struct DeviceBuffers {
    registered: RwLock<Registered>,
}

impl Registered {
    fn insert(&mut self, addr: u64, buffer: Buffer) -> CodeResult<()> {
        if !self.buffers.contains_key(&addr) && self.buffers.len() >= MAX_DEVICE_BUFFERS {
            return Err(ErrorCode::NO_AVAILABLE_HANDLE);
        }
        self.longest = self.longest.max(buffer.len);
        if let Some(old) = self.buffers.insert(addr, buffer) {
            self.release(old.dummy_base);
        }
        Ok(())
    }

    /// Forgets the allocation at `dummy_base` when no buffer lies in it any more.
    fn release(&mut self, dummy_base: u64) {
        if !self.buffers.values().any(|b| b.dummy_base == dummy_base) {
            self.allocations.remove(&dummy_base);
        }
    }

    fn containing(&self, addr: u64, len: u64) -> Option<(u64, &Buffer)> {
        let end = addr.checked_add(len)?;
        if len == 0 {
            return None;
        }
        let first = addr.saturating_sub(self.longest);
        self.buffers
            .range(first..=addr)
            .rev()
            .find(|(start, b)| start.saturating_add(b.len) >= end)
            .map(|(start, b)| (*start, b))
    }
}

/// Checks a declaration from a dummy: a non-empty range inside the allocation it names.
fn validate(decl: &DeviceBufferDecl) -> Result<[u8; IPC_HANDLE_LEN], String> {
    let handle: [u8; IPC_HANDLE_LEN] = decl.handle.as_slice().try_into().map_err(|_| {
        format!(
            "an IPC handle has {IPC_HANDLE_LEN} bytes, not {}",
            decl.handle.len()
        )
    })?;
    let end = decl.addr.checked_add(decl.len);
    let alloc_end = decl.alloc_base.checked_add(decl.alloc_len);
    match (end, alloc_end) {
        (Some(end), Some(alloc_end))
            if decl.len > 0 && decl.addr >= decl.alloc_base && end <= alloc_end =>
        {
            Ok(handle)
        }
        _ => Err(format!(
            "the buffer {:#x} + {} bytes does not lie inside its allocation {:#x} + {} bytes",
            decl.addr, decl.len, decl.alloc_base, decl.alloc_len
        )),
    }
}

impl DeviceBuffers {
    /// Registers a buffer of a dummy in another process: opens its allocation from the
    /// IPC handle (once per allocation). The error says why it cannot be reached.
    pub fn declare(
        &self,
        decl: &DeviceBufferDecl,
        segment: &Arc<SharedMemory>,
    ) -> Result<(), String> {
        let handle = validate(decl)?;
        let driver = driver::driver(decl.api).map_err(|e| {
            format!(
                "mooncake_client cannot reach {} GPU memory: {e}; run it on the GPU node with the driver",
                decl.api
            )
        })?;
        let mut registered = self.registered.write();
        // The same base with another handle is a new allocation at a reused address
        // (the old one was freed): opened afresh.
        let cached = registered
            .allocations
            .get(&decl.alloc_base)
            .filter(|target| target.handle == Some(handle));
        let target = match cached {
            Some(target) => Arc::clone(target),
            None => {
                let opened = driver
                    .open(decl.device, &handle)
                    .map_err(|e| format!("opening the GPU allocation of the dummy failed: {e}"))?;
                let target = Arc::new(DeviceTarget {
                    api: decl.api,
                    device: decl.device,
                    base: opened.ptr(),
                    handle: Some(handle),
                    _opened: Some(opened),
                });
                registered
                    .allocations
                    .insert(decl.alloc_base, Arc::clone(&target));
                target
            }
        };
        let buffer = Buffer {
            len: decl.len,
            dummy_base: decl.alloc_base,
            target,
        };
        let inserted = registered.insert(decl.addr, buffer);
        if inserted.is_err() {
            registered.release(decl.alloc_base);
            return Err(format!(
                "at most {MAX_DEVICE_BUFFERS} GPU buffers may be registered per dummy"
            ));
        }
        drop(registered);
        pin_segment(segment, decl.api);
        Ok(())
    }

    /// Registers a buffer of an in-process dummy (its device pointers are valid here).
    pub fn lend(
        &self,
        addr: u64,
        len: u64,
        allocation: mooncake_device::DeviceAllocation,
        segment: &Arc<SharedMemory>,
    ) -> CodeResult<()> {
        if len == 0 || addr.checked_add(len).is_none() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let mut registered = self.registered.write();
        let target = Arc::clone(
            registered
                .allocations
                .entry(allocation.base)
                .or_insert_with(|| {
                    Arc::new(DeviceTarget {
                        api: allocation.api,
                        device: allocation.device,
                        base: allocation.base,
                        handle: None,
                        _opened: None,
                    })
                }),
        );
        let buffer = Buffer {
            len,
            dummy_base: allocation.base,
            target,
        };
        let inserted = registered.insert(addr, buffer);
        if inserted.is_err() {
            registered.release(allocation.base);
        }
        drop(registered);
        if inserted.is_ok() {
            pin_segment(segment, allocation.api);
        }
        inserted
    }

    /// Forgets the buffer registered at `addr`; false when there is none.
    pub fn forget(&self, addr: u64) -> bool {
        let mut registered = self.registered.write();
        let Some(buffer) = registered.buffers.remove(&addr) else {
            return false;
        };
        registered.release(buffer.dummy_base);
        registered.longest = registered
            .buffers
            .values()
            .map(|b| b.len)
            .max()
            .unwrap_or(0);
        true
    }

    /// The dummy's `addr..addr+len`, when it lies wholly inside one registered buffer.
    pub fn region(&self, addr: u64, len: u64) -> Option<Region> {
        let registered = self.registered.read();
        let (_, buffer) = registered.containing(addr, len)?;
        let offset = addr.checked_sub(buffer.dummy_base)?;
        Some(Region::Device(DeviceRange {
            target: Arc::clone(&buffer.target),
            ptr: buffer.target.base.checked_add(offset)?,
            len,
        }))
    }

    /// Number of registered buffers.
    pub fn count(&self) -> usize {
        self.registered.read().buffers.len()
    }
}

/// Bytes of this node's segment pinned for GPU copies (0 until the pinning of
/// [`pin_segment`] succeeded).
static SEGMENT_PINNED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes of this node's segment pinned for GPU copies: 0 until the first GPU buffer
/// is registered and the background pinning has finished (or when it failed).
pub fn segment_pinned_bytes() -> u64 {
    SEGMENT_PINNED_BYTES.load(Ordering::Relaxed)
}

/// Pins this node's segment once, on a background thread, so that copies between
/// devices and the segment run at bus speed; a failure is logged (copies then run
/// from pageable memory, slower but correct).
fn pin_segment(segment: &Arc<SharedMemory>, api: DeviceApi) {
    static PINNED: OnceLock<()> = OnceLock::new();
    let segment = Arc::clone(segment);
    PINNED.get_or_init(move || {
        let spawned = std::thread::Builder::new()
            .name("mooncake-pin".into())
            .spawn(move || {
                let Ok(driver) = driver::driver(api) else {
                    return;
                };
                // SAFETY: the segment lives as long as the process serves; the guard is
                // kept for the life of the process.
                match unsafe { driver.pin(segment.base() as *mut u8, segment.len() as u64) } {
                    Ok(pinned) => {
                        tracing::info!(bytes = pinned.len(), "segment pinned for GPU copies");
                        SEGMENT_PINNED_BYTES.store(pinned.len(), Ordering::Relaxed);
                        std::mem::forget(pinned);
                        std::mem::forget(segment);
                    }
                    Err(error) => tracing::warn!(%error, "the segment could not be pinned for GPU copies (they run from pageable memory; raise the memlock limit)"),
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "cannot start the thread that pins the segment");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decl(
        addr: u64,
        len: u64,
        alloc_base: u64,
        alloc_len: u64,
        handle: usize,
    ) -> DeviceBufferDecl {
        DeviceBufferDecl {
            addr,
            len,
            device: 0,
            alloc_base,
            alloc_len,
            handle: serde_bytes::ByteBuf::from(vec![0u8; handle]),
            api: DeviceApi::Cuda,
        }
    }

    #[test]
    fn declarations_are_checked() {
        assert!(validate(&decl(4096, 100, 4096, 8192, 64)).is_ok());
        assert!(
            validate(&decl(4096, 100, 4096, 8192, 63))
                .expect_err("a short handle")
                .contains("64 bytes")
        );
        assert!(
            validate(&decl(4000, 100, 4096, 8192, 64)).is_err(),
            "before the allocation"
        );
        assert!(
            validate(&decl(12000, 1000, 4096, 8192, 64)).is_err(),
            "past its end"
        );
        assert!(validate(&decl(4096, 0, 4096, 8192, 64)).is_err(), "empty");
        assert!(
            validate(&decl(u64::MAX, 2, 4096, u64::MAX, 64)).is_err(),
            "wraps"
        );
    }
}
