//! Copies to and from application memory that is not shared (copy-through buffers).
//!
//! The application registered these ranges with `register_buffer` and keeps them valid
//! until `unregister_buffer`, as upstream requires of registered memory; the dummy only
//! touches a range after [`DummyMemory::classify`](crate::memory::DummyMemory::classify)
//! found it inside such a registration.

use mooncake_shm::MemSlice;

/// Copies `len` bytes of registered application memory at `addr` into `dest`.
pub fn copy_in(addr: u64, len: usize, dest: &MemSlice) {
    // SAFETY: `addr..addr+len` lies inside a buffer the application registered and
    // promised to keep valid; it is only read.
    let source = unsafe { std::slice::from_raw_parts(addr as *const u8, len) };
    dest.write_from(source);
}

/// Copies `len` bytes of `source` to registered application memory at `addr`.
pub fn copy_out(source: &MemSlice, addr: u64, len: usize) {
    // SAFETY: `addr..addr+len` lies inside a buffer the application registered for
    // writing and promised to keep valid for the duration of the call.
    let dest = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
    source.read_into(dest);
}

/// Copies `len` bytes of registered application memory at `addr` into a new vector.
pub fn to_vec(addr: u64, len: usize) -> Vec<u8> {
    // SAFETY: as in `copy_in`.
    unsafe { std::slice::from_raw_parts(addr as *const u8, len) }.to_vec()
}

/// Copies `bytes` to registered application memory at `addr`.
pub fn write_bytes(addr: u64, bytes: &[u8]) {
    // SAFETY: as in `copy_out`: `addr..addr+bytes.len()` lies inside a registered buffer.
    let dest = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, bytes.len()) };
    dest.copy_from_slice(bytes);
}
