//! File I/O of the SSD tier: POSIX `pread`/`pwrite`, or io_uring when asked for
//! (`MOONCAKE_OFFLOAD_USE_URING=1`) and the kernel allows it.
//!
//! When the ring cannot be created (an old kernel, or a container whose seccomp profile
//! forbids the `io_uring_*` system calls, as Docker's default does) the engine logs why
//! and falls back to POSIX, so enabling io_uring never stops a node from starting.
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

/// An io_uring and the bounce buffer registered with it (when the locked-memory limit
/// allowed the registration).
pub struct Ring {
    ring: IoUring,
    fixed: Option<AlignedBuf>,
}

impl Ring {
    fn new() -> std::io::Result<Self> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let fixed = AlignedBuf::zeroed(FIXED_BUFFER).and_then(|mut buffer| {
            let iovec = libc::iovec {
                iov_base: buffer.as_mut_slice().as_mut_ptr().cast(),
                iov_len: FIXED_BUFFER,
            };
            // SAFETY: the buffer lives in the `Ring` next to the ring and is dropped
            // after it (field order); the kernel pins it until then.
            match unsafe { ring.submitter().register_buffers(&[iovec]) } {
                Ok(()) => Some(buffer),
                Err(error) => {
                    tracing::warn!(%error, bytes = FIXED_BUFFER, "cannot register the SSD tier's bounce buffer with io_uring (raise `ulimit -l`); reads use temporary buffers");
                    None
                }
            }
        });
        Ok(Ring { ring, fixed })
    }
}

/// How the tier reads and writes its files.
pub enum IoEngine {
    /// `pread`/`pwrite`/`fdatasync`.
    Posix,
    /// One io_uring, used by one caller at a time.
    Uring(Box<Mutex<Ring>>),
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
        match Ring::new() {
            Ok(ring) => {
                tracing::info!("SSD tier I/O: io_uring");
                IoEngine::Uring(Box::new(Mutex::new(ring)))
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
            // SAFETY: `buf` and `file` outlive the operation: `complete` waits for it.
            unsafe { complete(&mut ring.lock().ring, &entry) }
        })
    }

    /// Writes all of `buf` at `offset`.
    pub fn write_all_at(&self, file: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let IoEngine::Uring(ring) = self else {
            return file.write_all_at(buf, offset);
        };
        let fd = types::Fd(file.as_raw_fd());
        repeat_until_done(buf.len(), std::io::ErrorKind::WriteZero, |done, len| {
            let entry = opcode::Write::new(fd, buf[done..].as_ptr(), len)
                .offset(offset + done as u64)
                .build();
            // SAFETY: `buf` and `file` outlive the operation: `complete` waits for it.
            unsafe { complete(&mut ring.lock().ring, &entry) }
        })
    }

    /// Flushes the file's data to the device.
    pub fn sync_data(&self, file: &File) -> std::io::Result<()> {
        let IoEngine::Uring(ring) = self else {
            return file.sync_data();
        };
        let entry = opcode::Fsync::new(types::Fd(file.as_raw_fd()))
            .flags(types::FsyncFlags::DATASYNC)
            .build();
        // SAFETY: `file` outlives the operation: `complete` waits for it.
        unsafe { complete(&mut ring.lock().ring, &entry) }.map(|_| ())
    }

    /// Writes every `(offset, bytes)` of `writes` to `file`: with io_uring, up to
    /// [`RING_ENTRIES`] operations per submission; short writes are finished one by one.
    pub fn write_batch_at(&self, file: &File, writes: &[(u64, &[u8])]) -> std::io::Result<()> {
        let IoEngine::Uring(ring) = self else {
            return writes
                .iter()
                .try_for_each(|(offset, bytes)| file.write_all_at(bytes, *offset));
        };
        let fd = types::Fd(file.as_raw_fd());
        for chunk in writes.chunks(RING_ENTRIES as usize) {
            let mut done = vec![0usize; chunk.len()];
            {
                let mut ring = ring.lock();
                let ring = &mut ring.ring;
                for (index, (offset, bytes)) in chunk.iter().enumerate() {
                    let len = u32::try_from(bytes.len()).unwrap_or(u32::MAX);
                    let entry = opcode::Write::new(fd, bytes.as_ptr(), len)
                        .offset(*offset)
                        .build()
                        .user_data(index as u64);
                    // SAFETY: the bytes and the file outlive the batch: every
                    // completion is awaited below before they can be dropped.
                    unsafe { ring.submission().push(&entry) }
                        .map_err(|_| std::io::Error::other("io_uring submission queue full"))?;
                }
                ring.submit_and_wait(chunk.len())?;
                for completion in ring.completion() {
                    let index = usize::try_from(completion.user_data()).unwrap_or(usize::MAX);
                    let result = completion.result();
                    if result < 0 {
                        return Err(std::io::Error::from_raw_os_error(-result));
                    }
                    if let Some(slot) = done.get_mut(index) {
                        *slot = usize::try_from(result).unwrap_or(0);
                    }
                }
            }
            for ((offset, bytes), written) in chunk.iter().zip(done) {
                if written < bytes.len() {
                    self.write_all_at(file, &bytes[written..], offset + written as u64)?;
                }
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
        let fd = types::Fd(file.as_raw_fd());
        let mut ring = ring.lock();
        let Ring { ring, fixed } = &mut *ring;
        let mut temporary = None;
        let (buffer, fixed_index) = match fixed {
            Some(buffer) if window <= FIXED_BUFFER => (buffer.as_mut_slice(), Some(0u16)),
            _ => match AlignedBuf::zeroed(window) {
                Some(buffer) => (temporary.insert(buffer).as_mut_slice(), None),
                None => return Some(Err(std::io::Error::other("cannot allocate a read buffer"))),
            },
        };
        let Ok(window_len) = u32::try_from(window) else {
            return None;
        };
        let entry = match fixed_index {
            Some(index) => opcode::ReadFixed::new(fd, buffer.as_mut_ptr(), window_len, index)
                .offset(start)
                .build(),
            None => opcode::Read::new(fd, buffer.as_mut_ptr(), window_len)
                .offset(start)
                .build(),
        };
        // SAFETY: the buffer (registered or temporary) and the file outlive the
        // operation: `complete` waits for it.
        let read = match unsafe { complete(ring, &entry) } {
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

/// Submits one operation and waits for its completion; the bytes it moved.
///
/// # Safety
///
/// Every buffer and file descriptor `entry` refers to must stay valid until this
/// returns (it returns only once the kernel completed the operation).
unsafe fn complete(ring: &mut IoUring, entry: &io_uring::squeue::Entry) -> std::io::Result<usize> {
    // SAFETY: the caller keeps the entry's buffers alive until completion, awaited below.
    unsafe { ring.submission().push(entry) }
        .map_err(|_| std::io::Error::other("io_uring submission queue full"))?;
    ring.submit_and_wait(1)?;
    let completion = ring
        .completion()
        .next()
        .ok_or_else(|| std::io::Error::other("io_uring returned no completion"))?;
    let result = completion.result();
    if result < 0 {
        Err(std::io::Error::from_raw_os_error(-result))
    } else {
        usize::try_from(result).map_err(std::io::Error::other)
    }
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
}
