//! Device (GPU) memory for mooncake-rs.
//!
//! Engines register their GPU KV caches with `register_buffer` and move pages between
//! them and the store. This crate is the one place that knows about device memory:
//!
//! * [`classify`] tells what an address range of this process is: host memory the CPU
//!   can read, a device allocation (CUDA or HIP), or neither (never dereferenced);
//! * [`driver`] is a GPU driver loaded at run time (no toolkit at build time, and a
//!   machine without a GPU runs without it): copies between device and host memory on
//!   a stream, IPC handles that let another process (the real client) open a dummy's
//!   allocation, and pinning host memory so copies run at bus speed. [`cuda`] and
//!   [`hip`] are its two interfaces;
//! * [`fake`] builds stand-in driver libraries for tests on machines without a GPU.
//!
//! The rest of the code sees [`MemoryKind`] and the calls of [`driver::Driver`].

mod api;
pub mod cuda;
pub mod driver;
mod error;
pub mod fake;
pub mod hip;
pub mod host;

pub use api::DeviceAllocation;
pub use error::DeviceError;
pub use mooncake_core::types::DeviceApi;

/// What an address range of this process is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory the CPU can read.
    Host,
    /// Memory of a device allocation (wholly inside it).
    Device(DeviceAllocation),
    /// Neither: the text says why, and what to do.
    Unreachable(String),
}

/// The interfaces asked, in order, about an address that is not host memory.
const INTERFACES: [DeviceApi; 2] = [DeviceApi::Cuda, DeviceApi::Hip];

/// Classifies `addr..addr+len` of this process. Host memory is recognized without
/// loading any driver; anything else is asked of the CUDA driver, then of the HIP
/// runtime (each loaded on first need). Never dereferences the range.
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
    let mut answers = Vec::new();
    for api in INTERFACES {
        let known = driver::driver(api).and_then(|driver| driver.allocation_of(addr));
        match known {
            Ok(Some(allocation)) => return within(allocation, addr, len, last),
            Ok(None) => answers.push(format!("the {api} driver does not know it")),
            Err(why) => answers.push(why.to_string()),
        }
    }
    if readable.is_none() {
        // The probe could not tell (seccomp) and no driver knows the range: host
        // memory, as before device memory was known.
        return MemoryKind::Host;
    }
    MemoryKind::Unreachable(format!(
        "{addr:#x} + {len} bytes is neither host memory this process can read nor device memory ({}); for a GPU buffer make the driver loadable (libcuda.so or libamdhip64.so on the library path, or {} / {})",
        answers.join("; "),
        cuda::LIBRARY_ENV,
        hip::LIBRARY_ENV
    ))
}

/// `addr..=last` inside `allocation`, or why not.
fn within(allocation: DeviceAllocation, addr: u64, len: u64, last: u64) -> MemoryKind {
    let end = allocation.base.saturating_add(allocation.len);
    if last < end {
        MemoryKind::Device(allocation)
    } else {
        MemoryKind::Unreachable(format!(
            "{addr:#x} + {len} bytes runs past the end of its {} device allocation ({:#x} + {} bytes)",
            allocation.api, allocation.base, allocation.len
        ))
    }
}
