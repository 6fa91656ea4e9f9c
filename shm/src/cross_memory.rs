//! Ordinary memory of another process (a dummy's heap, numpy arrays, pinned host
//! memory), read and written in one copy with `process_vm_readv` / `process_vm_writev`.
//!
//! # Lifecycle and trust
//!
//! * **Who reads and writes**: the real client, in the memory of one of its dummies,
//!   named by the pid from the dummy's socket credentials. Nothing is mapped: each copy
//!   goes straight between the dummy's pages and a mapping of this process (the segment
//!   or a bounce buffer).
//! * **Who permits it**: the kernel, when the caller may ptrace the dummy (same uid and a
//!   dumpable dummy, or `CAP_SYS_PTRACE`), and Yama's `ptrace_scope` agrees. Under scope
//!   1 the dummy names its real client with [`allow_tracer`]; scope 2 needs
//!   `CAP_SYS_PTRACE`, scope 3 forbids it.
//! * **Which process**: a [`PeerProcess`] holds a pidfd opened while the dummy was
//!   connected. Every copy checks that this process has not exited (reads after the
//!   copy, writes before it), so a pid reused by a newer process is never touched.
//! * **Which ranges**: whatever the caller passes. The real client only passes ranges
//!   that lie wholly inside memory the dummy declared, and the kernel refuses pages that
//!   are not mapped (`EFAULT`).
//!
//! The kernel copies page by page, pinning each page of the other process first, at a
//! fraction of memcpy's speed (a third to a half on a virtual machine, less when the
//! two sides sit at different offsets within their pages); a long copy is therefore
//! split across a few threads, each of which adds about as much again.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Mutex, PoisonError};

use crate::parallel;
use crate::shared_memory::MemSlice;
use crate::sys::{self, Direction};

/// Why a cross-memory copy (or opening its target) failed.
#[derive(Debug, thiserror::Error)]
pub enum CrossMemoryError {
    /// A system call failed; `source` carries the errno.
    #[error("{call} for process {pid} failed: {source}")]
    Os {
        /// The system call.
        call: &'static str,
        /// The target process.
        pid: i32,
        /// The OS error.
        source: std::io::Error,
    },
    /// The process exited (its pid may already name another process).
    #[error("process {pid} has exited")]
    Exited {
        /// The process that exited.
        pid: i32,
    },
}

impl CrossMemoryError {
    /// The errno of a failed system call (`ESRCH` for an exited process).
    pub fn errno(&self) -> Option<i32> {
        match self {
            CrossMemoryError::Os { source, .. } => source.raw_os_error(),
            CrossMemoryError::Exited { .. } => Some(libc::ESRCH),
        }
    }
}

/// Smallest piece of a split cross-memory copy (copies of 256 KiB or more are split
/// across threads: [`crate::parallel`]).
const PIECE: usize = 128 << 10;

/// [`sys::cross_memory_copy`] of `len` bytes; a long copy is split into page-aligned
/// pieces copied by this thread and helper threads.
///
/// # Safety
/// As for [`sys::cross_memory_copy`]: `local..local+len` lies inside a live mapping the
/// caller keeps alive for the whole call (writable for a read).
unsafe fn copy(
    direction: Direction,
    pid: i32,
    local: *mut u8,
    remote: u64,
    len: usize,
) -> std::io::Result<()> {
    let base = local.expose_provenance();
    parallel::split_copy(len, PIECE, &|offset, piece| {
        let at: *mut u8 = std::ptr::with_exposed_provenance_mut(base + offset);
        // SAFETY: `offset..offset+piece` lies inside the caller's range, alive until
        // `split_copy` returns.
        unsafe { sys::cross_memory_copy(direction, pid, at, remote + offset as u64, piece) }
    })
}

/// Another process whose ordinary memory this one copies to and from.
#[derive(Debug)]
pub struct PeerProcess {
    pid: i32,
    pidfd: OwnedFd,
}

impl PeerProcess {
    /// Opens process `pid` (a pidfd that keeps naming it even if the pid is reused).
    pub fn open(pid: i32) -> Result<Self, CrossMemoryError> {
        let pidfd = sys::pidfd_open(pid).map_err(|source| CrossMemoryError::Os {
            call: "pidfd_open",
            pid,
            source,
        })?;
        Ok(PeerProcess { pid, pidfd })
    }

    /// The process id.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// Fails with [`CrossMemoryError::Exited`] once the process has exited.
    fn check_alive(&self) -> Result<(), CrossMemoryError> {
        match sys::pidfd_exited(self.pidfd.as_fd()) {
            Ok(false) => Ok(()),
            Ok(true) => Err(CrossMemoryError::Exited { pid: self.pid }),
            Err(source) => Err(CrossMemoryError::Os {
                call: "poll(pidfd)",
                pid: self.pid,
                source,
            }),
        }
    }

    fn os(&self, call: &'static str) -> impl FnOnce(std::io::Error) -> CrossMemoryError {
        let pid = self.pid;
        move |source| CrossMemoryError::Os { call, pid, source }
    }

    /// Copies `dest.len()` bytes at `addr` of the process into `dest`.
    pub fn read_into(&self, addr: u64, dest: &MemSlice) -> Result<(), CrossMemoryError> {
        // SAFETY: `dest` was bounds-checked against a mapping it keeps alive for the
        // call; the holder of a slice may write it.
        unsafe { copy(Direction::Read, self.pid, dest.ptr(), addr, dest.len()) }
            .map_err(self.os("process_vm_readv"))?;
        // Alive after the copy: the pid named this process during the whole copy.
        self.check_alive()
    }

    /// Copies all of `source` to `addr` of the process.
    pub fn write_from(&self, source: &MemSlice, addr: u64) -> Result<(), CrossMemoryError> {
        self.check_alive()?;
        // SAFETY: `source` was bounds-checked against a mapping it keeps alive for the
        // call; it is only read.
        unsafe { copy(Direction::Write, self.pid, source.ptr(), addr, source.len()) }
            .map_err(self.os("process_vm_writev"))
    }

    /// Copies `bytes` to `addr` of the process.
    pub fn write_bytes(&self, bytes: &[u8], addr: u64) -> Result<(), CrossMemoryError> {
        self.check_alive()?;
        // SAFETY: `bytes` is a live slice for the whole call and is only read (the
        // pointer is cast to `*mut` for the iovec, never written through).
        unsafe {
            copy(
                Direction::Write,
                self.pid,
                bytes.as_ptr().cast_mut(),
                addr,
                bytes.len(),
            )
        }
        .map_err(self.os("process_vm_writev"))
    }

    /// Reads one byte at `addr`: whether this process may read the other's memory.
    pub fn probe(&self, addr: u64) -> Result<(), CrossMemoryError> {
        let mut byte = [0u8; 1];
        // SAFETY: `byte` is a live, writable local for the whole call.
        unsafe { sys::cross_memory_copy(Direction::Read, self.pid, byte.as_mut_ptr(), addr, 1) }
            .map_err(self.os("process_vm_readv"))?;
        self.check_alive()
    }
}

/// Yama's `kernel.yama.ptrace_scope` (0 classic, 1 restricted, 2 admin only, 3 none);
/// `None` when Yama is not in the kernel.
pub fn yama_ptrace_scope() -> Option<u8> {
    std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|text| text.trim().parse().ok())
}

/// The tracer this process named, and the client that named it.
static TRACER: Mutex<Option<(u128, u32)>> = Mutex::new(None);

/// Why [`allow_tracer`] did not name a tracer.
#[derive(Debug, thiserror::Error)]
pub enum AllowTracerError {
    /// The pid is not a process (0: the peer is in a pid namespace this one cannot see).
    #[error("pid {0} cannot be named as a tracer")]
    BadPid(u32),
    /// Another client of this process already named a different real client; a process
    /// can name only one.
    #[error(
        "this process already lets real client pid {0} read its memory (Yama ptrace_scope 1 allows one)"
    )]
    Taken(u32),
    /// `prctl(PR_SET_PTRACER)` failed.
    #[error("prctl(PR_SET_PTRACER, {pid}) failed: {source}")]
    Prctl {
        /// The pid.
        pid: u32,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Under Yama `ptrace_scope` 1, lets process `pid` (a real client) read and write this
/// process's memory (`prctl(PR_SET_PTRACER, pid)`, never `PR_SET_PTRACER_ANY`), on
/// behalf of the client `owner`. A process names one tracer: the owner may move it (its
/// real client restarted with a new pid); another owner gets [`AllowTracerError::Taken`]
/// for a different pid. Does nothing under any other scope (0: nothing needed; 2 and 3:
/// no declaration helps).
pub fn allow_tracer(owner: u128, pid: u32) -> Result<(), AllowTracerError> {
    if yama_ptrace_scope() != Some(1) {
        return Ok(());
    }
    let raw = i32::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or(AllowTracerError::BadPid(pid))?;
    let mut tracer = TRACER.lock().unwrap_or_else(PoisonError::into_inner);
    match *tracer {
        Some((_, current)) if current == pid => return Ok(()),
        Some((holder, current)) if holder != owner => return Err(AllowTracerError::Taken(current)),
        _ => {}
    }
    sys::set_ptracer(raw).map_err(|source| AllowTracerError::Prctl { pid, source })?;
    *tracer = Some((owner, pid));
    Ok(())
}

/// Gives up `owner`'s claim on the tracer (its client closed), so another client of
/// this process may name its own real client.
pub fn release_tracer(owner: u128) {
    let mut tracer = TRACER.lock().unwrap_or_else(PoisonError::into_inner);
    if tracer.is_some_and(|(holder, _)| holder == owner) {
        *tracer = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_memory::{PageSize, SharedMemory};
    use std::sync::Arc;

    #[test]
    fn copies_to_and_from_this_process_by_pid() {
        let me = PeerProcess::open(i32::try_from(std::process::id()).expect("pid")).expect("open");
        let mut heap = vec![0u8; 10_000];
        heap[..5].copy_from_slice(b"hello");
        let addr = heap.as_mut_ptr() as u64;
        let mem = Arc::new(SharedMemory::create("xmem", 10_000, PageSize::Normal).expect("create"));
        let slice = mem.slice(0, 10_000).expect("slice");
        me.probe(addr).expect("probe");
        me.read_into(addr, &slice).expect("read");
        assert_eq!(&slice.to_vec()[..5], b"hello");
        let word = slice.sub(0, 5).expect("sub");
        word.write_from(b"world");
        me.write_from(&word, addr + 100).expect("write");
        me.write_bytes(b"!", addr + 105).expect("write bytes");
        assert_eq!(&heap[100..106], b"world!");
    }

    #[test]
    fn long_copies_are_split_and_stay_byte_exact() {
        let me = PeerProcess::open(i32::try_from(std::process::id()).expect("pid")).expect("open");
        let len = (3 << 20) + 123;
        let heap: Vec<u8> = (0..len)
            .map(|i: usize| (i % 251).to_le_bytes()[0])
            .collect();
        let mem =
            Arc::new(SharedMemory::create("xmem", len as u64, PageSize::Normal).expect("create"));
        let slice = mem.slice(0, len as u64).expect("slice");
        me.read_into(heap.as_ptr() as u64, &slice).expect("read");
        assert!(slice.to_vec() == heap);
        let mut back = vec![0u8; len];
        me.write_from(&slice, back.as_mut_ptr() as u64)
            .expect("write");
        assert!(back == heap);
    }

    #[test]
    fn unmapped_memory_and_exited_processes_are_errors() {
        let me = PeerProcess::open(i32::try_from(std::process::id()).expect("pid")).expect("open");
        let error = me.probe(8).expect_err("page 0 is not mapped");
        assert_eq!(error.errno(), Some(libc::EFAULT));
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let peer = PeerProcess::open(i32::try_from(child.id()).expect("pid")).expect("open");
        child.wait().expect("wait");
        let bytes = [1u8; 4];
        assert!(matches!(
            peer.write_bytes(&bytes, 4096),
            Err(CrossMemoryError::Exited { .. })
        ));
    }
}
