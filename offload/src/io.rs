//! File I/O of the SSD tier: POSIX `pread`/`pwrite`, or io_uring when asked for
//! (`MOONCAKE_OFFLOAD_USE_URING=1`) and the kernel allows it.
//!
//! When the ring cannot be created (an old kernel, or a container whose seccomp profile
//! forbids the `io_uring_*` system calls, as Docker's default does) the engine logs why
//! and falls back to POSIX, so enabling io_uring never stops a node from starting.
//!
//! The ring lives on a dedicated thread: callers queue operations and wait for their
//! results; the thread submits everything queued since its last submission at once, so
//! concurrent callers share submissions.
//!
//! Batches are written as gathered windows ([`Gathered`]): each record's header from a
//! small buffer and its value straight from the caller's memory, several megabytes per
//! `pwritev` (with io_uring, [`WRITES_IN_FLIGHT`] windows queued at once), and the
//! write-back of each window starts as soon as it is written (`sync_file_range`), so
//! the device writes while the next window is checksummed. Reads gather the same way:
//! a record's header into a small buffer and its value into the destination, one
//! `preadv` through the page cache (with either engine: see
//! [`read_gathered`](IoEngine::read_gathered)), whose read-ahead keeps a sequential
//! scan at the device's speed; a batch of records in order that is not cached is
//! streamed with direct reads instead ([`crate::direct_run`], either engine).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use io_uring::{IoUring, opcode, types};

/// Submission queue depth of the ring (and the most operations per batch).
const RING_ENTRIES: u32 = 32;

/// Gathered windows a batch keeps queued at once with io_uring.
pub const WRITES_IN_FLIGHT: usize = 2;

/// Most buffers in one gathered write (the kernel's `IOV_MAX` is 1024).
pub const MAX_GATHER: usize = 1024;

/// One operation handed to the ring's thread, with where to send its result.
struct Job {
    entry: io_uring::squeue::Entry,
    done: std::sync::mpsc::SyncSender<std::io::Result<usize>>,
}

/// The io_uring of the tier, owned by a dedicated thread that submits every operation
/// queued since its last submission at once (so concurrent callers share submissions).
pub struct UringThread {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl UringThread {
    fn start() -> std::io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("ssd-io-uring".into())
            .spawn(move || run_ring(ring, &queue))?;
        Ok(UringThread {
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// Runs one operation and waits for it; the bytes it moved.
    ///
    /// # Safety
    ///
    /// Every buffer and file descriptor `entry` refers to must stay valid until this
    /// returns (it returns only once the kernel completed the operation, or the
    /// operation was never submitted).
    unsafe fn run(&self, entry: io_uring::squeue::Entry) -> std::io::Result<usize> {
        // SAFETY: forwarded from the caller.
        let pending = unsafe { self.start_one(entry) }?;
        pending
            .recv()
            .map_err(|_| std::io::Error::other("the io_uring thread stopped"))?
    }

    /// Queues one operation; the receiver gets its result.
    ///
    /// # Safety
    ///
    /// As for [`run`](Self::run): the caller must wait for the result before the
    /// buffers and descriptors of `entry` go away.
    unsafe fn start_one(
        &self,
        entry: io_uring::squeue::Entry,
    ) -> std::io::Result<std::sync::mpsc::Receiver<std::io::Result<usize>>> {
        let (done, result) = std::sync::mpsc::sync_channel(1);
        self.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(Job { entry, done }).ok())
            .ok_or_else(|| std::io::Error::other("the io_uring thread stopped"))?;
        Ok(result)
    }
}

impl Drop for UringThread {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has finished what it holds.
        self.jobs = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The ring's thread: takes every queued job (up to the ring's depth), submits them
/// together, waits for all their completions and answers each caller.
fn run_ring(mut ring: IoUring, queue: &std::sync::mpsc::Receiver<Job>) {
    while let Ok(first) = queue.recv() {
        let mut batch = vec![first];
        while batch.len() < RING_ENTRIES as usize {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let mut results: Vec<Option<std::io::Result<usize>>> =
            (0..batch.len()).map(|_| None).collect();
        let mut submitted = 0;
        for (index, job) in batch.iter().enumerate() {
            let entry = job.entry.clone().user_data(index as u64);
            // SAFETY: each caller keeps the entry's buffers alive until it gets its
            // result, which is sent only after the completion below.
            if unsafe { ring.submission().push(&entry) }.is_ok() {
                submitted += 1;
            } else {
                results[index] = Some(Err(std::io::Error::other("io_uring queue full")));
            }
        }
        let mut wait_failures = 0u32;
        while submitted > 0 {
            // The ring is never given up while operations are in flight (the kernel may
            // still use the callers' buffers), and every caller gets its answer: a failed
            // wait (a full completion queue, a signal, a transient error) is logged,
            // completions are reaped, and the wait is tried again.
            if let Err(error) = ring.submit_and_wait(submitted)
                && error.kind() != std::io::ErrorKind::Interrupted
            {
                wait_failures += 1;
                if wait_failures.is_power_of_two() {
                    tracing::warn!(%error, failures = wait_failures, "io_uring wait failed; retrying");
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            for completion in ring.completion() {
                let result = completion.result();
                let outcome = if result < 0 {
                    Err(std::io::Error::from_raw_os_error(-result))
                } else {
                    usize::try_from(result).map_err(std::io::Error::other)
                };
                if let Some(slot) = usize::try_from(completion.user_data())
                    .ok()
                    .and_then(|i| results.get_mut(i))
                {
                    *slot = Some(outcome);
                    submitted -= 1;
                }
            }
        }
        for (job, result) in batch.into_iter().zip(results) {
            let _ = job
                .done
                .send(result.unwrap_or_else(|| Err(std::io::Error::other("no completion"))));
        }
    }
}

/// Failpoint of every read of the tier's files (args: `eio`, the default, or `enospc`).
pub const FAILPOINT_READ: &str = "offload.disk.read";
/// Failpoint of every write of the tier's files: `eio` (the default) and `enospc` fail
/// before writing; `short` writes the first half of the bytes, then fails with `ENOSPC`
/// as a disk that fills up mid-write does.
pub const FAILPOINT_WRITE: &str = "offload.disk.write";
/// Failpoint of every `fdatasync` of the tier's files (args as reads).
pub const FAILPOINT_FSYNC: &str = "offload.disk.fsync";

/// The error failpoint `name` injects, when it fires.
fn injected(name: &str) -> Option<std::io::Error> {
    let arg = mooncake_core::failpoint::hit(name)?;
    let code = if arg == "enospc" || arg == "short" {
        libc::ENOSPC
    } else {
        libc::EIO
    };
    Some(std::io::Error::from_raw_os_error(code))
}

/// Alignment of direct reads' and writes' offsets, lengths and buffers (the largest
/// logical block size in common use).
pub(crate) const ALIGN: usize = 4096;

/// A buffer starting at an [`ALIGN`] boundary, for direct reads and writes.
pub(crate) struct AlignedBuffer {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl AlignedBuffer {
    /// `len` bytes (zeros); `None` when no aligned start could be found in the
    /// allocation.
    pub(crate) fn new(len: usize) -> Option<Self> {
        let storage = vec![0u8; len.checked_add(ALIGN)?];
        let start = storage.as_ptr().align_offset(ALIGN);
        (start <= ALIGN).then_some(AlignedBuffer {
            storage,
            start,
            len,
        })
    }

    /// The buffer's bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    /// The buffer's bytes, to fill.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// True when [`FAILPOINT_READ`] fires for a read made outside [`IoEngine`].
pub(crate) fn read_failure_injected() -> bool {
    injected(FAILPOINT_READ).is_some()
}

/// The error [`FAILPOINT_WRITE`] injects into a write of `buf` at `offset`, having
/// written half of it for `short`.
pub(crate) fn injected_write(file: &File, buf: &[u8], offset: u64) -> Option<std::io::Error> {
    let arg = mooncake_core::failpoint::hit(FAILPOINT_WRITE)?;
    if arg == "short" {
        let _ = file.write_all_at(&buf[..buf.len() / 2], offset);
    }
    Some(std::io::Error::from_raw_os_error(
        if arg == "eio" || arg.is_empty() {
            libc::EIO
        } else {
            libc::ENOSPC
        },
    ))
}

/// How the tier reads and writes its files.
pub enum IoEngine {
    /// `pread`/`pwrite`/`fdatasync`.
    Posix,
    /// io_uring, on its own thread.
    Uring(Box<UringThread>),
}

impl std::fmt::Debug for IoEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_uring() {
            "IoEngine::Uring"
        } else {
            "IoEngine::Posix"
        })
    }
}

impl IoEngine {
    /// io_uring when `use_uring` and the kernel allows it, else POSIX.
    pub fn new(use_uring: bool) -> Self {
        if !use_uring {
            return IoEngine::Posix;
        }
        match UringThread::start() {
            Ok(ring) => {
                tracing::info!("SSD tier I/O: io_uring");
                IoEngine::Uring(Box::new(ring))
            }
            Err(error) => {
                tracing::warn!(%error, "io_uring is not available here; the SSD tier uses pread/pwrite");
                IoEngine::Posix
            }
        }
    }

    /// True when io_uring is in use.
    pub fn is_uring(&self) -> bool {
        matches!(self, IoEngine::Uring(_))
    }

    /// Reads exactly `buf.len()` bytes at `offset`.
    pub fn read_exact_at(&self, file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        if let Some(error) = injected(FAILPOINT_READ) {
            return Err(error);
        }
        let IoEngine::Uring(ring) = self else {
            return file.read_exact_at(buf, offset);
        };
        let fd = types::Fd(file.as_raw_fd());
        let base = buf.as_mut_ptr();
        repeat_until_done(buf.len(), std::io::ErrorKind::UnexpectedEof, |done, len| {
            // SAFETY: `done < buf.len()`, so the pointer stays inside `buf`.
            let at = unsafe { base.add(done) };
            let entry = opcode::Read::new(fd, at, len)
                .offset(offset + done as u64)
                .build();
            // SAFETY: `buf` and `file` outlive the operation: `run` waits for it.
            unsafe { ring.run(entry) }
        })
    }

    /// Writes all of `buf` at `offset`.
    pub fn write_all_at(&self, file: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
        if let Some(error) = injected_write(file, buf, offset) {
            return Err(error);
        }
        let IoEngine::Uring(ring) = self else {
            return file.write_all_at(buf, offset);
        };
        let fd = types::Fd(file.as_raw_fd());
        repeat_until_done(buf.len(), std::io::ErrorKind::WriteZero, |done, len| {
            let entry = opcode::Write::new(fd, buf[done..].as_ptr(), len)
                .offset(offset + done as u64)
                .build();
            // SAFETY: `buf` and `file` outlive the operation: `run` waits for it.
            unsafe { ring.run(entry) }
        })
    }

    /// Flushes the file's data to the device.
    pub fn sync_data(&self, file: &File) -> std::io::Result<()> {
        if let Some(error) = injected(FAILPOINT_FSYNC) {
            return Err(error);
        }
        let IoEngine::Uring(ring) = self else {
            return file.sync_data();
        };
        let entry = opcode::Fsync::new(types::Fd(file.as_raw_fd()))
            .flags(types::FsyncFlags::DATASYNC)
            .build();
        // SAFETY: `file` outlives the operation: `run` waits for it.
        unsafe { ring.run(entry) }.map(|_| ())
    }

    /// Writes every window of `windows` to `file`, in order, and starts the write-back
    /// of each as soon as it is written. With io_uring up to [`WRITES_IN_FLIGHT`]
    /// windows are queued at once; short writes are finished one by one. Returns only
    /// when no write of the call is in flight any more (the kernel may read the
    /// callers' buffers until then), with the first error met.
    pub fn write_gathered<'a>(
        &self,
        file: &File,
        windows: impl Iterator<Item = Gathered<'a>>,
    ) -> std::io::Result<()> {
        let IoEngine::Uring(ring) = self else {
            for window in windows {
                let window = window.seal();
                window.write_at(file)?;
                start_writeback(file, window.offset, window.len);
            }
            return Ok(());
        };
        let fd = types::Fd(file.as_raw_fd());
        let mut in_flight = std::collections::VecDeque::new();
        let mut failure = None;
        for window in windows {
            let window = window.seal();
            if let Some(error) = window.injected_failure(file) {
                failure = Some(error);
                break;
            }
            let count = u32::try_from(window.iovecs.len()).unwrap_or(u32::MAX);
            let entry = opcode::Writev::new(fd, window.iovecs.as_ptr(), count)
                .offset(window.offset)
                .build();
            // SAFETY: the window (its iovecs and the buffers they point at) and `file`
            // stay alive until the write's result is taken below: every queued write is
            // awaited before this function returns.
            let started = unsafe { ring.start_one(entry) };
            in_flight.push_back((window, started));
            if in_flight.len() >= WRITES_IN_FLIGHT
                && let Some(done) = in_flight.pop_front()
                && let Err(error) = finish_gathered(file, done)
            {
                failure = Some(error);
                break;
            }
        }
        while let Some(done) = in_flight.pop_front() {
            if let Err(error) = finish_gathered(file, done) {
                failure.get_or_insert(error);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    /// Reads `file` at `offset` into `buffers`, one after the other, until they are
    /// full (a file that ends first is `UnexpectedEof`). Both engines read with
    /// `preadv` on the caller's thread: a read is waited for at once, so a ring adds
    /// a hand-over to its thread and no overlap (measured: a third of the speed for
    /// cold 64 KiB records), while the page cache's read-ahead serves sequential
    /// reads at the device's speed.
    pub fn read_gathered(
        &self,
        file: &File,
        buffers: &mut [std::io::IoSliceMut<'_>],
        offset: u64,
    ) -> std::io::Result<()> {
        if let Some(error) = injected(FAILPOINT_READ) {
            return Err(error);
        }
        let mut buffers = buffers;
        let mut at = offset;
        while !buffers.is_empty() {
            let count = libc::c_int::try_from(buffers.len().min(MAX_GATHER)).unwrap_or(1);
            let offset = libc::off_t::try_from(at).map_err(std::io::Error::other)?;
            // SAFETY: `IoSliceMut` is ABI-compatible with `iovec`; the buffers are
            // borrowed mutably for the call.
            let read = unsafe {
                libc::preadv(
                    file.as_raw_fd(),
                    buffers.as_ptr().cast::<libc::iovec>(),
                    count,
                    offset,
                )
            };
            let Some(read) = moved(read) else {
                continue;
            };
            match read? {
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                read => {
                    at += read as u64;
                    std::io::IoSliceMut::advance_slices(&mut buffers, read);
                }
            }
        }
        Ok(())
    }

    /// Flushes everything written to the filesystem holding `file` (`syncfs`): one
    /// call for a batch of many files and the directory entries naming them.
    pub fn sync_filesystem(&self, file: &File) -> std::io::Result<()> {
        if let Some(error) = injected(FAILPOINT_FSYNC) {
            return Err(error);
        }
        // SAFETY: a plain system call on an open descriptor.
        if unsafe { libc::syncfs(file.as_raw_fd()) } == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }
}

/// Takes the result of a queued gathered write and finishes it when it was short;
/// then starts the window's write-back.
fn finish_gathered(
    file: &File,
    (window, started): (
        Gathered<'_>,
        std::io::Result<std::sync::mpsc::Receiver<std::io::Result<usize>>>,
    ),
) -> std::io::Result<()> {
    let written = started?
        .recv()
        .map_err(|_| std::io::Error::other("the io_uring thread stopped"))??;
    if written < window.len {
        window.write_rest_at(file, written)?;
    }
    start_writeback(file, window.offset, window.len);
    Ok(())
}

/// What a `preadv`/`pwritev` call that returned `ret` did: the bytes it moved, its
/// error, or `None` when a signal interrupted it (call again).
fn moved(ret: isize) -> Option<std::io::Result<usize>> {
    if ret >= 0 {
        return Some(Ok(ret.unsigned_abs()));
    }
    let error = std::io::Error::last_os_error();
    (error.kind() != std::io::ErrorKind::Interrupted).then_some(Err(error))
}

/// Asks the kernel to start writing `len` bytes at `offset` of `file` to the device
/// now, without waiting (`sync_file_range(SYNC_FILE_RANGE_WRITE)`): the later
/// `fdatasync` then finds them written or on their way. Advisory: failures are
/// ignored (the sync that follows reports real ones).
pub fn start_writeback(file: &File, offset: u64, len: usize) {
    let (Ok(offset), Ok(len)) = (
        libc::off64_t::try_from(offset),
        libc::off64_t::try_from(len),
    ) else {
        return;
    };
    // SAFETY: a plain system call on an open descriptor.
    unsafe {
        libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE);
    }
}

/// Asks the kernel to start reading `len` bytes at `offset` of `file` into the page
/// cache now, without waiting (`posix_fadvise(POSIX_FADV_WILLNEED)`): the reads that
/// follow find them there or on their way. Advisory: failures are ignored (the reads
/// report real ones).
pub fn start_readahead(file: &File, offset: u64, len: u64) {
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: a plain system call on an open descriptor.
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), offset, len, libc::POSIX_FADV_WILLNEED);
    }
}

/// Contiguous bytes to write at one offset of a file, gathered from several buffers:
/// pieces copied in ([`push_copy`](Self::push_copy), for record headers and keys) and
/// pieces borrowed from the caller for `'a` ([`push`](Self::push), for values).
pub struct Gathered<'a> {
    offset: u64,
    len: usize,
    copied: Vec<u8>,
    parts: Vec<Part<'a>>,
    iovecs: Vec<libc::iovec>,
}

impl std::fmt::Debug for Gathered<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gathered")
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("pieces", &self.parts.len())
            .finish_non_exhaustive()
    }
}

/// One piece of a [`Gathered`] window.
#[derive(Debug)]
enum Part<'a> {
    /// `copied[start..end]`.
    Copied(usize, usize),
    /// Caller memory.
    Borrowed(&'a [u8]),
}

impl<'a> Gathered<'a> {
    /// An empty window starting at `offset`.
    pub fn new(offset: u64) -> Self {
        Gathered {
            offset,
            len: 0,
            copied: Vec::new(),
            parts: Vec::new(),
            iovecs: Vec::new(),
        }
    }

    /// Where the window starts.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes in the window.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing was added.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Pieces in the window.
    pub fn pieces(&self) -> usize {
        self.parts.len()
    }

    /// Appends a copy of `bytes` (small pieces: headers, keys, padding).
    pub fn push_copy(&mut self, bytes: &[u8]) {
        let start = self.copied.len();
        self.copied.extend_from_slice(bytes);
        match self.parts.last_mut() {
            Some(Part::Copied(_, end)) if *end == start => *end = self.copied.len(),
            _ => self.parts.push(Part::Copied(start, self.copied.len())),
        }
        self.len += bytes.len();
    }

    /// Appends `bytes`, written from where they are.
    pub fn push(&mut self, bytes: &'a [u8]) {
        if !bytes.is_empty() {
            self.parts.push(Part::Borrowed(bytes));
            self.len += bytes.len();
        }
    }

    /// Fixes the pieces' addresses for the kernel (no piece is added after this).
    fn seal(mut self) -> Self {
        let copied = self.copied.as_ptr();
        self.iovecs = self
            .parts
            .iter()
            .map(|part| match part {
                Part::Copied(start, end) => libc::iovec {
                    // SAFETY: `start <= end <= copied.len()`; the pointer stays inside
                    // the buffer, which is never changed once sealed.
                    iov_base: unsafe { copied.add(*start) }.cast_mut().cast(),
                    iov_len: end - start,
                },
                Part::Borrowed(bytes) => libc::iovec {
                    iov_base: bytes.as_ptr().cast_mut().cast(),
                    iov_len: bytes.len(),
                },
            })
            .collect();
        self
    }

    /// Writes the whole window to a stream (a socket), with gathered writes.
    pub fn write_to(self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        let window = self.seal();
        let mut slices = window.slices();
        let mut rest = slices.as_mut_slice();
        while !rest.is_empty() {
            let count = rest.len().min(MAX_GATHER);
            match out.write_vectored(&rest[..count]) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(written) => std::io::IoSlice::advance_slices(&mut rest, written),
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// The sealed window's pieces as slices.
    fn slices(&self) -> Vec<std::io::IoSlice<'_>> {
        self.iovecs
            .iter()
            .map(|iovec| {
                // SAFETY: each iovec was made in `seal` from a live piece of this window.
                std::io::IoSlice::new(unsafe {
                    std::slice::from_raw_parts(iovec.iov_base.cast::<u8>(), iovec.iov_len)
                })
            })
            .collect()
    }

    /// The error [`FAILPOINT_WRITE`] injects into this window, when it fires.
    fn injected_failure(&self, file: &File) -> Option<std::io::Error> {
        let first = match self.parts.first()? {
            Part::Copied(start, end) => &self.copied[*start..*end],
            Part::Borrowed(bytes) => bytes,
        };
        injected_write(file, first, self.offset)
    }

    /// Writes the whole window with `pwritev` (sealed first).
    fn write_at(&self, file: &File) -> std::io::Result<()> {
        if let Some(error) = self.injected_failure(file) {
            return Err(error);
        }
        self.write_rest_at(file, 0)
    }

    /// Writes the window from its byte `done` on.
    fn write_rest_at(&self, file: &File, mut done: usize) -> std::io::Result<()> {
        let mut slices = self.slices();
        let mut rest = slices.as_mut_slice();
        std::io::IoSlice::advance_slices(&mut rest, done);
        while !rest.is_empty() {
            let count = libc::c_int::try_from(rest.len().min(MAX_GATHER)).unwrap_or(1);
            let offset =
                libc::off_t::try_from(self.offset + done as u64).map_err(std::io::Error::other)?;
            // SAFETY: `IoSlice` is ABI-compatible with `iovec`; the slices borrow live
            // buffers for the call.
            let written =
                unsafe { libc::pwritev(file.as_raw_fd(), rest.as_ptr().cast(), count, offset) };
            let Some(written) = moved(written) else {
                continue;
            };
            match written? {
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                written => {
                    done += written;
                    std::io::IoSlice::advance_slices(&mut rest, written);
                }
            }
        }
        Ok(())
    }
}

/// Runs `step(done, len)` (moving at most `len` bytes from offset `done`, returning
/// how many it moved) until `total` bytes are moved; 0 bytes moved is `stalled`.
fn repeat_until_done(
    total: usize,
    stalled: std::io::ErrorKind,
    mut step: impl FnMut(usize, u32) -> std::io::Result<usize>,
) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < total {
        let len = u32::try_from(total - done).unwrap_or(u32::MAX);
        match step(done, len)? {
            0 => return Err(stalled.into()),
            n => done += n,
        }
    }
    Ok(())
}

/// A new empty file in the temporary directory, for reading and writing (tests).
#[cfg(test)]
pub(crate) fn scratch_file(name: &str, uring: bool) -> (std::path::PathBuf, File) {
    let path =
        std::env::temp_dir().join(format!("mooncake-io-{name}-{}-{uring}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(&path)
        .expect("open");
    (path, file)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_engines_read_what_they_wrote() {
        for use_uring in [false, true] {
            let engine = IoEngine::new(use_uring);
            let (path, file) = scratch_file("plain", use_uring);
            let data: Vec<u8> = (0..300_000u32).map(|i| i.to_le_bytes()[1]).collect();
            engine.write_all_at(&file, &data, 4096).expect("write");
            engine.sync_data(&file).expect("sync");
            let mut back = vec![0u8; data.len()];
            engine.read_exact_at(&file, &mut back, 4096).expect("read");
            assert!(back == data, "uring={use_uring}");
            let mut past = vec![0u8; 10];
            assert!(
                engine
                    .read_exact_at(&file, &mut past, 4096 + 299_995)
                    .is_err()
            );
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Windows of `(offset, pieces)`: the pieces of each window are written back to
    /// back from its offset.
    fn windows_of(pieces: &[(u64, Vec<Vec<u8>>)]) -> Vec<Gathered<'_>> {
        pieces
            .iter()
            .map(|(offset, parts)| {
                let mut window = Gathered::new(*offset);
                for (i, part) in parts.iter().enumerate() {
                    if i % 2 == 0 {
                        window.push_copy(part);
                    } else {
                        window.push(part);
                    }
                }
                window
            })
            .collect()
    }

    #[test]
    fn gathered_writes_and_reads_round_trip() {
        for use_uring in [false, true] {
            let engine = IoEngine::new(use_uring);
            let (path, file) = scratch_file("gathered", use_uring);
            // 40 windows (more than are queued at once), one of 5 MiB.
            let pieces: Vec<(u64, Vec<Vec<u8>>)> = (0..40u64)
                .map(|i| {
                    let parts = (0..5u8)
                        .map(|p| {
                            let len = if i == 7 && p == 3 {
                                5 << 20
                            } else {
                                100 + 7 * usize::from(p)
                            };
                            (0..len)
                                .map(|j| (j as u64 ^ i ^ (u64::from(p) << 4)).to_le_bytes()[0])
                                .collect()
                        })
                        .collect();
                    (i * (8 << 20) + 100, parts)
                })
                .collect();
            engine
                .write_gathered(&file, windows_of(&pieces).into_iter())
                .expect("write");
            engine.sync_data(&file).expect("sync");
            for (offset, parts) in &pieces {
                let mut back: Vec<Vec<u8>> = parts.iter().map(|p| vec![0u8; p.len()]).collect();
                let mut slices: Vec<std::io::IoSliceMut<'_>> = back
                    .iter_mut()
                    .map(|b| std::io::IoSliceMut::new(b))
                    .collect();
                engine
                    .read_gathered(&file, &mut slices, *offset)
                    .expect("read");
                assert!(back == *parts, "uring={use_uring} at {offset}");
            }
            let end = pieces
                .last()
                .map_or(0, |(o, p)| o + p.iter().map(Vec::len).sum::<usize>() as u64);
            let mut past = [0u8; 10];
            assert_eq!(
                engine
                    .read_gathered(&file, &mut [std::io::IoSliceMut::new(&mut past)], end - 5)
                    .map_err(|e| e.kind()),
                Err(std::io::ErrorKind::UnexpectedEof)
            );
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Set in the re-executed test binary that runs under a file-size limit.
    const FSIZE_CHILD: &str = "MOONCAKE_IO_TEST_FSIZE_CHILD";
    /// The file-size limit of that child.
    const FSIZE_LIMIT: u64 = 1 << 16;

    /// A batch whose first window the file-size limit cuts short (and whose finishing
    /// write then fails with EFBIG) fails, but only once every other write queued is
    /// done: the caller may free the buffers as soon as it returns. Runs in a child
    /// process, since the limit applies to the whole process.
    #[test]
    fn a_short_write_that_cannot_be_finished_fails_the_batch_after_the_others_are_done() {
        if std::env::var_os(FSIZE_CHILD).is_some() {
            return short_write_under_a_file_size_limit();
        }
        // The child's output goes to pipes: the file-size limit would also cut its
        // writes to a log file larger than the limit.
        let output = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "io::tests::a_short_write_that_cannot_be_finished_fails_the_batch_after_the_others_are_done",
                "--test-threads=1",
            ])
            .env(FSIZE_CHILD, "1")
            .output()
            .expect("child runs");
        assert!(
            output.status.success(),
            "the child failed: {}\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    fn short_write_under_a_file_size_limit() {
        let limit = libc::rlimit {
            rlim_cur: FSIZE_LIMIT,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: plain system calls on this (child) process: writes past the limit
        // fail with EFBIG instead of raising SIGXFSZ.
        unsafe {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &limit), 0);
        }
        let engine = IoEngine::new(true);
        if !engine.is_uring() {
            return;
        }
        let (path, file) = scratch_file("fsize", true);
        let cut = vec![0xAB; 4096];
        // The windows queued at once: the first cut short, the others must be done
        // when the call fails.
        let count = u8::try_from(WRITES_IN_FLIGHT - 1).expect("a few windows");
        let others: Vec<Vec<u8>> = (0..count).map(|i| vec![i; 300]).collect();
        let mut pieces = vec![(FSIZE_LIMIT - 100, vec![Vec::new(), cut])];
        pieces.extend(
            others
                .iter()
                .zip(0u64..)
                .map(|(b, i)| (i * 512, vec![Vec::new(), b.clone()])),
        );
        let error = engine
            .write_gathered(&file, windows_of(&pieces).into_iter())
            .expect_err("the rest of the cut write cannot be written");
        assert_eq!(error.raw_os_error(), Some(libc::EFBIG), "{error}");
        for (offset, parts) in &pieces[1..] {
            let mut back = vec![0u8; parts[1].len()];
            file.read_exact_at(&mut back, *offset).expect("pread");
            assert!(back == parts[1], "the write at {offset} is done");
        }
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn concurrent_callers_share_the_ring_thread() {
        let engine = std::sync::Arc::new(IoEngine::new(true));
        let (path, file) = scratch_file("threads", true);
        let file = std::sync::Arc::new(file);
        let workers: Vec<_> = (0..4u8)
            .map(|t| {
                let (engine, file) = (engine.clone(), file.clone());
                std::thread::spawn(move || {
                    for round in 0..50u8 {
                        let data = vec![t ^ round; 10_000];
                        let offset = u64::from(t) * 1_000_000 + u64::from(round) * 10_000;
                        engine.write_all_at(&file, &data, offset).expect("write");
                        let mut back = vec![0u8; data.len()];
                        engine
                            .read_exact_at(&file, &mut back, offset)
                            .expect("read");
                        assert!(back == data, "thread {t} round {round}");
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("worker");
        }
        drop(engine);
        let _ = std::fs::remove_file(&path);
    }
}
