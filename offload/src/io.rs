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
//! With io_uring the engine also submits batches of writes at once
//! ([`write_batch_at`](IoEngine::write_batch_at)) and reads records with O_DIRECT
//! ([`read_direct`](IoEngine::read_direct)) through a bounce buffer registered with the
//! ring ([`FIXED_BUFFER`] bytes, counted against the locked-memory limit, `ulimit -l`;
//! without room there, reads use a temporary aligned buffer). Files on filesystems
//! without O_DIRECT (tmpfs) are read through the page cache.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

use io_uring::{IoUring, opcode, types};
use parking_lot::Mutex;

/// Submission queue depth of the ring (and the most operations per batch).
const RING_ENTRIES: u32 = 32;

/// Alignment O_DIRECT needs for file offsets, lengths and buffer addresses.
pub const DIRECT_ALIGN: usize = 4096;

/// Bytes of the bounce buffer registered with the ring.
pub const FIXED_BUFFER: usize = 4 << 20;

/// A zeroed heap buffer aligned to [`DIRECT_ALIGN`], for O_DIRECT transfers.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer is plain owned memory; access goes through `&`/`&mut` borrows.
unsafe impl Send for AlignedBuf {}
// SAFETY: as above; shared borrows only read.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    fn layout(len: usize) -> Option<std::alloc::Layout> {
        std::alloc::Layout::from_size_align(len.max(DIRECT_ALIGN), DIRECT_ALIGN).ok()
    }

    /// `len` zeroed bytes (at least one alignment unit is allocated); `None` when the
    /// allocation fails.
    pub fn zeroed(len: usize) -> Option<Self> {
        let layout = Self::layout(len)?;
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, len })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` holds `len` initialised (zeroed, then written) bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(layout) = Self::layout(self.len) {
            // SAFETY: allocated in `zeroed` with this very layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

/// One operation handed to the ring's thread, with where to send its result.
struct Job {
    entry: io_uring::squeue::Entry,
    done: std::sync::mpsc::SyncSender<std::io::Result<usize>>,
}

/// The io_uring of the tier, owned by a dedicated thread that submits every operation
/// queued since its last submission at once (so concurrent callers share submissions),
/// and the bounce buffer registered with the ring (when the locked-memory limit
/// allowed the registration).
pub struct UringThread {
    jobs: Option<std::sync::mpsc::Sender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
    fixed: Option<Mutex<AlignedBuf>>,
}

impl UringThread {
    fn start() -> std::io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let fixed = register_bounce_buffer(&ring).map(Mutex::new);
        let (jobs, queue) = std::sync::mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("ssd-io-uring".into())
            .spawn(move || run_ring(ring, &queue))?;
        Ok(UringThread {
            jobs: Some(jobs),
            thread: Some(thread),
            fixed,
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

/// Registers a [`FIXED_BUFFER`]-byte bounce buffer with `ring`; `None` (logged) when
/// the locked-memory limit forbids it.
fn register_bounce_buffer(ring: &IoUring) -> Option<AlignedBuf> {
    let mut buffer = AlignedBuf::zeroed(FIXED_BUFFER)?;
    let iovec = libc::iovec {
        iov_base: buffer.as_mut_slice().as_mut_ptr().cast(),
        iov_len: FIXED_BUFFER,
    };
    // SAFETY: the buffer is kept by the `UringThread` that owns (through its thread)
    // the ring, and dropped only after the thread, and so the ring, has ended.
    match unsafe { ring.submitter().register_buffers(&[iovec]) } {
        Ok(()) => Some(buffer),
        Err(error) => {
            tracing::warn!(%error, bytes = FIXED_BUFFER, "cannot register the SSD tier's bounce buffer with io_uring (raise `ulimit -l`); reads use temporary buffers");
            None
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

/// The error [`FAILPOINT_WRITE`] injects into a write of `buf` at `offset`, having
/// written half of it for `short`.
fn injected_write(file: &File, buf: &[u8], offset: u64) -> Option<std::io::Error> {
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

    /// Writes every `(offset, bytes)` of `writes` to `file`: with io_uring, up to
    /// [`RING_ENTRIES`] operations queued at once (one submission); short writes are
    /// finished one by one.
    pub fn write_batch_at(&self, file: &File, writes: &[(u64, &[u8])]) -> std::io::Result<()> {
        if let Some((offset, bytes)) = writes.first()
            && let Some(error) = injected_write(file, bytes, *offset)
        {
            return Err(error);
        }
        let IoEngine::Uring(ring) = self else {
            return writes
                .iter()
                .try_for_each(|(offset, bytes)| file.write_all_at(bytes, *offset));
        };
        let fd = types::Fd(file.as_raw_fd());
        for chunk in writes.chunks(RING_ENTRIES as usize) {
            let mut pending = Vec::with_capacity(chunk.len());
            for (offset, bytes) in chunk {
                let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                let entry = opcode::Write::new(fd, bytes.as_ptr(), len)
                    .offset(*offset)
                    .build();
                // SAFETY: `writes` and `file` outlive the operations: every result is
                // awaited below before this function returns.
                pending.push(unsafe { ring.start_one(entry) });
            }
            // Every operation of the chunk is awaited before anything returns: the
            // kernel may still be reading from the caller's buffers.
            let mut failure = None;
            for ((offset, bytes), started) in chunk.iter().zip(pending) {
                let written = started.and_then(|result| {
                    result
                        .recv()
                        .map_err(|_| std::io::Error::other("the io_uring thread stopped"))?
                });
                let finished = match written {
                    Ok(n) if n < bytes.len() => {
                        self.write_all_at(file, &bytes[n..], offset + n as u64)
                    }
                    Ok(_) => Ok(()),
                    Err(error) => Err(error),
                };
                if let Err(error) = finished {
                    failure.get_or_insert(error);
                }
            }
            if let Some(error) = failure {
                return Err(error);
            }
        }
        Ok(())
    }

    /// With io_uring: reads `len` bytes at `offset` of the file at `path` with O_DIRECT
    /// (the aligned window around them, through the registered bounce buffer when it
    /// fits) and hands them to `consume`. `None` without io_uring, or when the file
    /// system refuses O_DIRECT: read through the page cache then.
    pub fn read_direct<R>(
        &self,
        path: &Path,
        offset: u64,
        len: usize,
        consume: impl FnOnce(&[u8]) -> R,
    ) -> Option<std::io::Result<R>> {
        let IoEngine::Uring(ring) = self else {
            return None;
        };
        if let Some(error) = injected(FAILPOINT_READ) {
            return Some(Err(error));
        }
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
        {
            Ok(file) => file,
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => return None,
            Err(error) => return Some(Err(error)),
        };
        let align = DIRECT_ALIGN as u64;
        let start = offset / align * align;
        let skip = usize::try_from(offset - start).unwrap_or(0);
        let window = (skip + len).next_multiple_of(DIRECT_ALIGN);
        let window_len = u32::try_from(window).ok()?;
        let fd = types::Fd(file.as_raw_fd());
        // The registered buffer, held for the read and the copy out of it.
        let mut fixed = ring
            .fixed
            .as_ref()
            .filter(|_| window <= FIXED_BUFFER)
            .map(Mutex::lock);
        let mut temporary = None;
        let (buffer, entry) = match fixed.as_deref_mut() {
            Some(buffer) => {
                let buffer = buffer.as_mut_slice();
                let entry = opcode::ReadFixed::new(fd, buffer.as_mut_ptr(), window_len, 0)
                    .offset(start)
                    .build();
                (buffer, entry)
            }
            None => {
                let Some(buffer) = AlignedBuf::zeroed(window) else {
                    return Some(Err(std::io::Error::other("cannot allocate a read buffer")));
                };
                let buffer = temporary.insert(buffer).as_mut_slice();
                let entry = opcode::Read::new(fd, buffer.as_mut_ptr(), window_len)
                    .offset(start)
                    .build();
                (buffer, entry)
            }
        };
        // SAFETY: the buffer (registered and locked, or temporary) and the file outlive
        // the operation: `run` waits for it.
        let read = match unsafe { ring.run(entry) } {
            Ok(read) => read,
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => return None,
            Err(error) => return Some(Err(error)),
        };
        if read < skip + len {
            return Some(Err(std::io::ErrorKind::UnexpectedEof.into()));
        }
        Some(Ok(consume(&buffer[skip..skip + len])))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A new empty file in the temporary directory, for reading and writing.
    fn scratch_file(name: &str, uring: bool) -> (std::path::PathBuf, File) {
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

    #[test]
    fn batched_writes_and_direct_reads_round_trip() {
        for use_uring in [false, true] {
            let engine = IoEngine::new(use_uring);
            let (path, file) = scratch_file("batch", use_uring);
            // 40 writes (more than one submission), one larger than the bounce buffer.
            let pieces: Vec<(u64, Vec<u8>)> = (0..40u64)
                .zip(0usize..)
                .map(|(i, n)| {
                    let len = if i == 7 {
                        FIXED_BUFFER + 5000
                    } else {
                        3000 + n
                    };
                    let offset = i * 8192 + if i == 7 { 0 } else { 100 };
                    let offset = if i > 7 {
                        offset + FIXED_BUFFER as u64
                    } else {
                        offset
                    };
                    (
                        offset,
                        (0..len).map(|j| (j as u64 ^ i).to_le_bytes()[0]).collect(),
                    )
                })
                .collect();
            let writes: Vec<(u64, &[u8])> =
                pieces.iter().map(|(o, b)| (*o, b.as_slice())).collect();
            engine.write_batch_at(&file, &writes).expect("batch");
            engine.sync_data(&file).expect("sync");
            for (offset, bytes) in &pieces {
                let mut back = vec![0u8; bytes.len()];
                file.read_exact_at(&mut back, *offset).expect("pread");
                assert!(back == *bytes, "uring={use_uring} at {offset}");
                // Direct reads need io_uring and a filesystem with O_DIRECT.
                if let Some(read) = engine.read_direct(&path, *offset, bytes.len(), <[u8]>::to_vec)
                {
                    assert!(read.expect("direct") == *bytes, "at {offset}");
                } else {
                    assert!(!engine.is_uring() || std::env::temp_dir().starts_with("/dev/shm"));
                }
            }
            let _ = std::fs::remove_file(&path);
        }
    }

    /// Set in the re-executed test binary that runs under a file-size limit.
    const FSIZE_CHILD: &str = "MOONCAKE_IO_TEST_FSIZE_CHILD";
    /// The file-size limit of that child.
    const FSIZE_LIMIT: u64 = 1 << 16;

    /// A batch whose first write the file-size limit cuts short (and whose finishing
    /// write then fails with EFBIG) fails, but only once every other write of the batch
    /// is done: the caller may free the buffers as soon as it returns. Runs in a child
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
        // One submission's worth: a failed chunk stops the batch before the next one.
        let count = u8::try_from(RING_ENTRIES - 1).expect("a small ring");
        let others: Vec<Vec<u8>> = (0..count).map(|i| vec![i; 300]).collect();
        let mut writes: Vec<(u64, &[u8])> = vec![(FSIZE_LIMIT - 100, &cut)];
        writes.extend(
            others
                .iter()
                .zip(0u64..)
                .map(|(b, i)| (i * 512, b.as_slice())),
        );
        let error = engine
            .write_batch_at(&file, &writes)
            .expect_err("the rest of the cut write cannot be written");
        assert_eq!(error.raw_os_error(), Some(libc::EFBIG), "{error}");
        for (offset, bytes) in &writes[1..] {
            let mut back = vec![0u8; bytes.len()];
            file.read_exact_at(&mut back, *offset).expect("pread");
            assert!(back == *bytes, "the write at {offset} is done");
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
