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

/// Copies `len` bytes from `src` to `dst` like [`copy_bytes`], storing to the
/// destination with non-temporal stores on x86-64: the bytes go to memory without the
/// destination's cache lines being read first or the cache being filled with them
/// (measured: 1 MiB into memory not in cache in 39 µs instead of 52). For copies into
/// memory this core will not read again soon (values written into the segment).
///
/// # Safety
/// As for [`copy_bytes`]; the ranges must not overlap.
pub(crate) unsafe fn stream_bytes(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        const LINE: usize = 64;
        let head = dst.align_offset(LINE).min(len);
        let end = head + (len - head) / LINE * LINE;
        // SAFETY: `0..head` lies inside both ranges (the caller's guarantee).
        unsafe { copy_bytes(src, dst, head) };
        let mut at = head;
        while at < end {
            // SAFETY: `at..at+64` lies inside both ranges; `dst + at` is 64-byte
            // aligned (as `_mm_stream_si128` requires 16), the loads are unaligned.
            unsafe {
                let from = src.add(at).cast::<__m128i>();
                let to = dst.add(at).cast::<__m128i>();
                let parts = [
                    _mm_loadu_si128(from),
                    _mm_loadu_si128(from.add(1)),
                    _mm_loadu_si128(from.add(2)),
                    _mm_loadu_si128(from.add(3)),
                ];
                for (i, part) in parts.into_iter().enumerate() {
                    _mm_stream_si128(to.add(i), part);
                }
            }
            at += LINE;
        }
        // SAFETY: the fence orders the streamed stores before anything this thread
        // does next (such as telling another thread the copy is done); the tail lies
        // inside both ranges.
        unsafe {
            _mm_sfence();
            copy_bytes(src.add(end), dst.add(end), len - end);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's guarantee.
    unsafe {
        copy_bytes(src, dst, len)
    }
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

/// Most pieces one `sendmsg` call takes (the kernel's `IOV_MAX`).
const MAX_IOVECS: usize = 1024;

/// Writes every `(ptr, len)` piece, in order, to the socket `fd` with as few `sendmsg`
/// calls as the kernel allows (one when the socket buffer has room).
///
/// # Safety
/// Each `ptr..ptr+len` must be readable for the whole call (inside a live mapping or
/// allocation the caller keeps alive).
pub(crate) unsafe fn send_vectored_all(
    fd: std::os::fd::RawFd,
    pieces: &[(*const u8, usize)],
) -> std::io::Result<()> {
    let mut iovecs: Vec<libc::iovec> = pieces
        .iter()
        .filter(|(_, len)| *len > 0)
        .map(|&(ptr, len)| libc::iovec {
            iov_base: ptr.cast_mut().cast(),
            iov_len: len,
        })
        .collect();
    let mut first = 0;
    while first < iovecs.len() {
        let last = (first + MAX_IOVECS).min(iovecs.len());
        let batch = &mut iovecs[first..last];
        // SAFETY: an all-zero msghdr is valid; the iovecs point into ranges the caller
        // guarantees readable.
        let mut message: libc::msghdr = unsafe { std::mem::zeroed() };
        message.msg_iov = batch.as_mut_ptr();
        message.msg_iovlen = batch.len() as _;
        // SAFETY: `message` points at `batch`, which outlives the call.
        let sent = unsafe { libc::sendmsg(fd, &message, libc::MSG_NOSIGNAL) };
        if sent < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        // Skip what went out; the first piece not fully sent starts the next call.
        let mut sent = sent.unsigned_abs();
        while first < iovecs.len() && sent >= iovecs[first].iov_len {
            sent -= iovecs[first].iov_len;
            first += 1;
        }
        if sent > 0 {
            let piece = &mut iovecs[first];
            // SAFETY: `sent < iov_len`, so the advanced pointer stays inside the piece.
            piece.iov_base = unsafe { piece.iov_base.cast::<u8>().add(sent) }.cast();
            piece.iov_len -= sent;
        }
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

/// Largest transfer handed to one `process_vm_readv`/`process_vm_writev` call (the
/// kernel caps a call near 2 GiB).
const CROSS_MEMORY_CHUNK: usize = 1 << 30;

/// Which way a cross-memory copy goes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Direction {
    /// From the other process into this one (`process_vm_readv`).
    Read,
    /// From this process into the other one (`process_vm_writev`).
    Write,
}

/// Copies all of `len` bytes between `local..local+len` in this process and
/// `remote..remote+len` in process `pid`, in the direction given. A call that moves no
/// bytes (an unmapped remote page) is `EFAULT`.
///
/// # Safety
/// `local..local+len` must lie inside a live mapping of this process that the caller
/// keeps alive for the whole call, writable for [`Direction::Read`]. The remote range
/// is checked by the kernel, never dereferenced here.
pub(crate) unsafe fn cross_memory_copy(
    direction: Direction,
    pid: libc::pid_t,
    local: *mut u8,
    remote: u64,
    len: usize,
) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let chunk = (len - done).min(CROSS_MEMORY_CHUNK);
        let local_iov = libc::iovec {
            // SAFETY: `done < len`, so the pointer stays inside the caller's range.
            iov_base: unsafe { local.add(done) }.cast(),
            iov_len: chunk,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote + done as u64) as *mut libc::c_void,
            iov_len: chunk,
        };
        // SAFETY: one iovec each; the local one lies inside the caller's live range
        // (see the function's contract), the remote one is checked by the kernel.
        let moved = unsafe {
            match direction {
                Direction::Read => libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0),
                Direction::Write => libc::process_vm_writev(pid, &local_iov, 1, &remote_iov, 1, 0),
            }
        };
        if moved < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        if moved == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += moved.unsigned_abs();
    }
    Ok(())
}

/// A pidfd for process `pid` (`pidfd_open`, Linux 5.3).
pub(crate) fn pidfd_open(pid: libc::pid_t) -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = std::os::fd::RawFd::try_from(fd)
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: the kernel just returned this descriptor, and nothing else owns it.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) })
}

/// True when the process behind `pidfd` has exited (its pidfd polls readable).
pub(crate) fn pidfd_exited(pidfd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<bool> {
    let mut entry = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&pidfd),
        events: libc::POLLIN,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd, zero timeout.
        let ready = unsafe { libc::poll(&mut entry, 1, 0) };
        if ready >= 0 {
            return Ok(ready > 0);
        }
        let error = std::io::Error::last_os_error();
        if error.kind() != std::io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Names `pid` as the one process (besides ancestors) that may ptrace this one under
/// Yama's `ptrace_scope` 1 (`prctl(PR_SET_PTRACER)`); replaces an earlier choice.
pub(crate) fn set_ptracer(pid: libc::pid_t) -> std::io::Result<()> {
    let tracer = libc::c_ulong::try_from(pid)
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: PR_SET_PTRACER takes one integer argument and touches no memory of ours.
    let rc = unsafe { libc::prctl(libc::PR_SET_PTRACER, tracer, 0, 0, 0) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Lowers the calling thread's scheduling priority to the lowest (nice 19), so that
/// background work only takes what the rest of the process leaves. Best effort.
pub(crate) fn lower_thread_priority() {
    // SAFETY: plain system calls on this thread's own id.
    let tid = unsafe { libc::gettid() };
    // SAFETY: as above; `setpriority` takes no pointers.
    let _ = unsafe { libc::setpriority(libc::PRIO_PROCESS, tid.unsigned_abs(), 19) };
}
