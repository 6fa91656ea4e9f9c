//! [`Region`]: a range of a dummy's memory that a request names, as the store reads
//! and writes it.
//!
//! Shared memory the dummy registered is mapped here ([`Region::Mapped`]): a memcpy
//! to or from the segment, or the transfer engine's socket, reaches it directly. Ordinary
//! memory the dummy declared ([`Region::Process`]) is not mapped: it is copied once with
//! `process_vm_readv` / `process_vm_writev` between the dummy's pages and a mapping of
//! this process (the segment, or a private bounce buffer that feeds the transfer engine).
//! GPU memory the dummy registered ([`Region::Device`]) is copied by the CUDA driver
//! between the device and such a mapping; the CPU never touches it.

use std::sync::Arc;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_device::DeviceApi;
use mooncake_device::driver::{IPC_HANDLE_LEN, OpenedAllocation};
use mooncake_shm::MemSlice;
use mooncake_shm::cross_memory::{CrossMemoryError, PeerProcess};

/// A device allocation reachable from this process.
#[derive(Debug)]
pub struct DeviceTarget {
    /// The GPU interface of the allocation.
    pub api: DeviceApi,
    /// The device.
    pub device: i32,
    /// The allocation's start, as a device address of this process.
    pub base: u64,
    /// The IPC handle it was opened from (none for an in-process dummy's).
    pub(crate) handle: Option<[u8; IPC_HANDLE_LEN]>,
    /// Keeps an allocation of another process open (none for an in-process dummy's).
    pub(crate) _opened: Option<OpenedAllocation>,
}

/// A range of the dummy's ordinary memory.
#[derive(Clone, Debug)]
pub struct ProcessRange {
    /// The dummy process.
    pub process: Arc<PeerProcess>,
    /// Start address in the dummy.
    pub addr: u64,
    /// Length in bytes (never 0).
    pub len: u64,
}

/// A range of a dummy's GPU memory, as a device address of this process.
#[derive(Clone, Debug)]
pub struct DeviceRange {
    /// The allocation (kept open while the range is in use).
    pub target: Arc<DeviceTarget>,
    /// Start, as a device address of this process.
    pub ptr: u64,
    /// Length in bytes (never 0).
    pub len: u64,
}

/// A range of a dummy's memory, already checked against what the dummy registered or
/// declared.
#[derive(Clone, Debug)]
pub enum Region {
    /// Shared memory mapped in this process.
    Mapped(MemSlice),
    /// Ordinary memory of the dummy, reached across processes.
    Process(ProcessRange),
    /// GPU memory of the dummy, copied by the CUDA driver.
    Device(DeviceRange),
}

impl From<MemSlice> for Region {
    fn from(slice: MemSlice) -> Self {
        Region::Mapped(slice)
    }
}

/// `Ok` unless the dummy took pages of the shared memory under `slice` away (a copy
/// touching it may have moved meaningless bytes): then `INVALID_PARAMS`, logged.
fn intact(slice: &MemSlice) -> CodeResult<()> {
    if slice.is_poisoned() {
        tracing::warn!(
            "a dummy's shared memory lost pages under its mapping (a hole punched in a hugetlb memfd?); requests naming it are refused"
        );
        return Err(ErrorCode::INVALID_PARAMS);
    }
    Ok(())
}

/// Logs a failed cross-memory copy; the code the request gets.
fn failed(error: &CrossMemoryError) -> ErrorCode {
    tracing::warn!(%error, "a copy to or from a dummy's declared memory failed");
    ErrorCode::INVALID_PARAMS
}

/// Logs a failed device copy; the code the request gets.
fn device_failed(error: &mooncake_device::DeviceError) -> ErrorCode {
    tracing::warn!(%error, "a copy to or from a dummy's GPU memory failed");
    ErrorCode::TRANSFER_FAIL
}

impl DeviceRange {
    fn driver(&self) -> CodeResult<&'static mooncake_device::driver::Driver> {
        mooncake_device::driver::driver(self.target.api).map_err(|e| device_failed(&e))
    }

    /// Copies the first `dest.len` bytes of this range (at most its length) to `dest`.
    fn copy_into(&self, dest: &MemSlice) -> CodeResult<()> {
        let dest = shorter(dest, self.len)?;
        let driver = self.driver()?;
        dest.fill_with(|bytes| {
            // SAFETY: `bytes` is a bounds-checked mapping kept alive by `dest`; the
            // device range lies in an allocation `target` keeps open.
            unsafe {
                driver.copy_to_host(
                    self.target.device,
                    self.ptr,
                    bytes.as_mut_ptr(),
                    bytes.len() as u64,
                )
            }
        })
        .map_err(|e| device_failed(&e))
    }

    /// Copies `bytes` (at most this range's length) to the start of this range.
    fn write(&self, bytes: &[u8]) -> CodeResult<()> {
        let len = usize::try_from(self.len)
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        let driver = self.driver()?;
        // SAFETY: `bytes` is readable; the device range lies in an allocation `target`
        // keeps open.
        unsafe { driver.copy_from_host(self.target.device, bytes.as_ptr(), self.ptr, len as u64) }
            .map_err(|e| device_failed(&e))
    }
}

impl Region {
    /// The GPU interface of a device range (`None` for host memory).
    pub fn device_api(&self) -> Option<mooncake_device::DeviceApi> {
        match self {
            Region::Device(range) => Some(range.target.api),
            Region::Mapped(_) | Region::Process(_) => None,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        match self {
            Region::Mapped(slice) => slice.len() as u64,
            Region::Process(range) => range.len,
            Region::Device(range) => range.len,
        }
    }

    /// Always false: empty regions are never made.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The mapping, when the region is shared memory.
    pub fn mapped(&self) -> Option<&MemSlice> {
        match self {
            Region::Mapped(slice) => Some(slice),
            Region::Process(_) | Region::Device(_) => None,
        }
    }

    /// `offset..offset+len` of this region, or `None` when it is not wholly inside (or
    /// empty).
    pub fn sub(&self, offset: u64, len: u64) -> Option<Region> {
        match self {
            Region::Mapped(slice) => slice.sub(offset, len).map(Region::Mapped),
            Region::Process(range) => {
                let end = offset.checked_add(len)?;
                (len > 0 && end <= range.len).then(|| {
                    Region::Process(ProcessRange {
                        process: Arc::clone(&range.process),
                        addr: range.addr + offset,
                        len,
                    })
                })
            }
            Region::Device(range) => {
                let end = offset.checked_add(len)?;
                (len > 0 && end <= range.len).then(|| {
                    Region::Device(DeviceRange {
                        target: Arc::clone(&range.target),
                        ptr: range.ptr + offset,
                        len,
                    })
                })
            }
        }
    }

    /// Copies `min(self.len, dest.len)` bytes of this region into `dest`.
    pub fn copy_into(&self, dest: &MemSlice) -> CodeResult<()> {
        match self {
            Region::Mapped(slice) => {
                intact(slice)?;
                slice.copy_to(dest);
                intact(slice)
            }
            Region::Process(range) => {
                let dest = shorter(dest, range.len)?;
                range
                    .process
                    .read_into(range.addr, &dest)
                    .map_err(|e| failed(&e))
            }
            Region::Device(range) => {
                range.copy_into(dest)?;
                intact(dest)
            }
        }
    }

    /// Like [`copy_into`](Self::copy_into), for a `dest` in the segment that this
    /// process will not read soon: a long copy from mapped memory bypasses the cache
    /// ([`MemSlice::stream_to`]).
    pub fn store_into(&self, dest: &MemSlice) -> CodeResult<()> {
        match self {
            Region::Mapped(slice) => {
                intact(slice)?;
                slice.stream_to(dest);
                intact(slice)
            }
            _ => self.copy_into(dest),
        }
    }

    /// Copies `min(self.len, source.len)` bytes of `source` into this region.
    pub fn fill_from(&self, source: &MemSlice) -> CodeResult<()> {
        match self {
            Region::Mapped(slice) => {
                intact(slice)?;
                source.copy_to(slice);
                intact(slice)
            }
            Region::Process(range) => {
                let source = shorter(source, range.len)?;
                range
                    .process
                    .write_from(&source, range.addr)
                    .map_err(|e| failed(&e))
            }
            Region::Device(range) => {
                let source = shorter(source, range.len)?;
                // SAFETY: the segment range being read is the object's, which no one
                // writes while it is read (as for a memcpy). The driver reads it on this
                // thread, guarded against a SIGBUS like every host copy.
                unsafe { source.read_with(|bytes| range.write(bytes)) }?;
                intact(&source)
            }
        }
    }

    /// Copies `min(self.len, bytes.len)` bytes of `bytes` into this region.
    pub fn write_bytes(&self, bytes: &[u8]) -> CodeResult<()> {
        let len = usize::try_from(self.len())
            .unwrap_or(usize::MAX)
            .min(bytes.len());
        match self {
            Region::Mapped(slice) => {
                intact(slice)?;
                slice.write_from(&bytes[..len]);
                intact(slice)
            }
            Region::Process(range) => range
                .process
                .write_bytes(&bytes[..len], range.addr)
                .map_err(|e| failed(&e)),
            Region::Device(range) => range.write(&bytes[..len]),
        }
    }
}

/// The first `min(slice.len, len)` bytes of `slice`.
fn shorter(slice: &MemSlice, len: u64) -> CodeResult<MemSlice> {
    slice
        .sub(0, len.min(slice.len() as u64))
        .ok_or(ErrorCode::INTERNAL_ERROR)
}
