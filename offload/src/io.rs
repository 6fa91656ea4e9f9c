//! File I/O of the SSD tier: POSIX `pread`/`pwrite`, or io_uring when asked for
//! (`MOONCAKE_OFFLOAD_USE_URING=1`) and the kernel allows it.
//!
//! When the ring cannot be created (an old kernel, or a container whose seccomp profile
//! forbids the `io_uring_*` system calls, as Docker's default does) the engine logs why
//! and falls back to POSIX, so enabling io_uring never stops a node from starting.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;

use io_uring::{IoUring, opcode, types};
use parking_lot::Mutex;

/// Submission queue depth of the ring.
const RING_ENTRIES: u32 = 32;

/// How the tier reads and writes its files.
pub enum IoEngine {
    /// `pread`/`pwrite`/`fdatasync`.
    Posix,
    /// One io_uring, used by one caller at a time.
    Uring(Box<Mutex<IoUring>>),
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
        match IoUring::new(RING_ENTRIES) {
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
            unsafe { complete(&mut ring.lock(), &entry) }
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
            unsafe { complete(&mut ring.lock(), &entry) }
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
        unsafe { complete(&mut ring.lock(), &entry) }.map(|_| ())
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

    #[test]
    fn both_engines_read_what_they_wrote() {
        for use_uring in [false, true] {
            let engine = IoEngine::new(use_uring);
            let path = std::env::temp_dir()
                .join(format!("mooncake-io-{}-{use_uring}", std::process::id()));
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(true)
                .read(true)
                .write(true)
                .open(&path)
                .expect("open");
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
}
