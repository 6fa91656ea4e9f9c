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

/// Writes all of `ptr..ptr+len` to the socket `fd`.
///
/// # Safety
/// `ptr..ptr+len` must be readable for the whole call (inside a live mapping the caller
/// keeps alive).
pub(crate) unsafe fn send_all(
    fd: std::os::fd::RawFd,
    ptr: *const u8,
    len: usize,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        // SAFETY: the caller guarantees the range is readable; `done < len`.
        let n = unsafe { libc::send(fd, ptr.add(done).cast(), len - done, libc::MSG_NOSIGNAL) };
        if n < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        done += n.unsigned_abs();
    }
    Ok(())
}

/// Fills all of `ptr..ptr+len` from the socket `fd`.
///
/// # Safety
/// `ptr..ptr+len` must be writable for the whole call (inside a live mapping the caller
/// keeps alive).
pub(crate) unsafe fn recv_all(
    fd: std::os::fd::RawFd,
    ptr: *mut u8,
    len: usize,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        // SAFETY: the caller guarantees the range is writable; `done < len`.
        let n = unsafe { libc::recv(fd, ptr.add(done).cast(), len - done, 0) };
        if n < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "peer closed the connection mid-transfer",
            ));
        }
        done += n.unsigned_abs();
    }
    Ok(())
}
