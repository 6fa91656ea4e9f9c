//! Copies to and from application memory that is not shared (copy-through buffers).
//!
//! The application registered these ranges with `register_buffer` and keeps them valid
//! until `unregister_buffer`, as upstream requires of registered memory; the dummy only
//! touches a range after [`DummyMemory::classify`](crate::memory::DummyMemory::classify)
//! found it inside such a registration.

use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_shm::MemSlice;

/// Bytes of application memory copied on the copy-through path by this process.
static COPIED: AtomicU64 = AtomicU64::new(0);

/// Bytes this process copied between registered ordinary memory and staging (or an
/// RPC message) since it started: zero when every transfer was zero-copy.
pub fn copied_bytes() -> u64 {
    COPIED.load(Ordering::Relaxed)
}

fn count(len: usize) {
    COPIED.fetch_add(len as u64, Ordering::Relaxed);
}

/// Copies `len` bytes of registered application memory at `addr` into `dest`.
pub fn copy_in(addr: u64, len: usize, dest: &MemSlice) {
    // SAFETY: `addr..addr+len` lies inside a buffer the application registered and
    // promised to keep valid; it is only read.
    let source = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
    count(dest.write_from(source));
}

/// Copies `len` bytes of `source` to registered application memory at `addr`.
pub fn copy_out(source: &MemSlice, addr: u64, len: usize) {
    // SAFETY: `addr..addr+len` lies inside a buffer the application registered for
    // writing and promised to keep valid for the duration of the call.
    let dest = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
    count(source.read_into(dest));
}

/// Copies `len` bytes of registered application memory at `addr` into a new vector.
pub fn to_vec(addr: u64, len: usize) -> Vec<u8> {
    count(len);
    // SAFETY: as in `copy_in`.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
}

/// Copies `bytes` to registered application memory at `addr`.
pub fn write_bytes(addr: u64, bytes: &[u8]) {
    // SAFETY: as in `copy_out`: `addr..addr+bytes.len()` lies inside a registered buffer.
    let dest = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, bytes.len()) };
    dest.copy_from_slice(bytes);
    count(bytes.len());
}
