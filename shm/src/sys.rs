//! The unsafe operations of this crate, each with the invariant it relies on.

use std::fs::File;

use memmap2::{MmapOptions, MmapRaw};

/// Maps `len` bytes of `file` shared and writable, optionally pre-faulting the pages.
pub(crate) fn map_shared(file: &File, len: usize, populate: bool) -> std::io::Result<MmapRaw> {
    let mut options = MmapOptions::new();
    options.len(len);
    if populate {
        options.populate();
    }
    options.map_raw(file)
}

/// Copies `len` bytes from `src` to `dst`.
///
/// # Safety
/// `src..src+len` must be readable and `dst..dst+len` writable for the whole call: both
/// must lie inside live mappings kept alive by the caller. The ranges may overlap. Bytes
/// in shared memory may be changed concurrently by another process; the copy then sees
/// some mix of old and new bytes, which is the documented contract for a buffer the
/// caller modifies during an operation, never memory outside the mappings.
pub(crate) unsafe fn copy_bytes(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller guarantees both ranges are valid for `len` bytes.
    unsafe { std::ptr::copy(src, dst, len) }
}
