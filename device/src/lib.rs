//! Device (GPU) memory for mooncake-rs.
//!
//! Engines register their GPU KV caches with `register_buffer` and move pages between
//! them and the store. This crate is the one place that knows about device memory:
//!
//! * [`classify`] tells what an address range of this process is: host memory the CPU
//!   can read, a CUDA device allocation, or neither (never dereferenced);
//! * [`cuda`] is the CUDA driver, loaded at run time (no toolkit at build time, and a
//!   machine without a GPU runs without it): copies between device and host memory on
//!   a stream, IPC handles that let another process (the real client) open a dummy's
//!   allocation, and pinning host memory so copies run at bus speed;
//! * [`fake`] builds a stand-in driver library for tests on machines without a GPU.
//!
//! The rest of the code sees [`MemoryKind`] and the copy calls of [`cuda::Cuda`].

pub mod cuda;
mod error;
pub mod fake;
pub mod host;

pub use error::DeviceError;

/// A device allocation: where a device pointer belongs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceAllocation {
    /// Device ordinal.
    pub device: i32,
    /// Start of the allocation (a device address of this process).
    pub base: u64,
    /// Length of the allocation in bytes.
    pub len: u64,
}

/// What an address range of this process is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory the CPU can read.
    Host,
    /// Memory of a CUDA device allocation (wholly inside it).
    Cuda(DeviceAllocation),
    /// Neither: the text says why, and what to do.
    Unreachable(String),
}

/// Classifies `addr..addr+len` of this process. Host memory is recognized without
/// loading any driver; anything else is asked of the CUDA driver (loaded on first
/// need). Never dereferences the range.
pub fn classify(addr: u64, len: u64) -> MemoryKind {
    let Some(last) = len.checked_sub(1).and_then(|l| addr.checked_add(l)) else {
        return MemoryKind::Unreachable(format!(
            "the range {addr:#x} + {len} bytes is empty or wraps around"
        ));
    };
    let readable = host::is_readable(addr, last);
    if readable == Some(true) {
        return MemoryKind::Host;
    }
    let driver = match cuda::driver() {
        Ok(driver) => driver,
        // The probe could not tell (seccomp): treat the range as host memory, as
        // before device memory was known.
        Err(_) if readable.is_none() => return MemoryKind::Host,
        Err(why) => {
            return MemoryKind::Unreachable(format!(
                "{addr:#x} + {len} bytes is not host memory this process can read, and no CUDA driver is loaded ({why}); for a GPU buffer make libcuda.so loadable (the library path, or {})",
                cuda::LIBRARY_ENV
            ));
        }
    };
    match driver.allocation_of(addr) {
        Ok(Some(allocation)) => {
            let end = allocation.base.saturating_add(allocation.len);
            if last < end {
                MemoryKind::Cuda(allocation)
            } else {
                MemoryKind::Unreachable(format!(
                    "{addr:#x} + {len} bytes runs past the end of its device allocation ({:#x} + {} bytes)",
                    allocation.base, allocation.len
                ))
            }
        }
        Ok(None) if readable.is_none() => MemoryKind::Host,
        Ok(None) => MemoryKind::Unreachable(format!(
            "{addr:#x} + {len} bytes is neither host memory this process can read nor device memory the CUDA driver knows"
        )),
        Err(error) => MemoryKind::Unreachable(format!(
            "{addr:#x} + {len} bytes is not readable host memory and the CUDA driver could not classify it: {error}"
        )),
    }
}
