//! Long copies split across a few threads.
//!
//! One thread's copy reaches only part of the memory bandwidth (about two thirds on the
//! machines we measured); two or three threads together come close to all of it. A
//! copy of at least two pieces' worth is cut into page-aligned pieces that the
//! calling thread and a few helper threads (started once, one per further core, at
//! most [`MAX_THREADS`] in all) take in turn. The caller copies pieces too and never
//! waits for a helper that is busy elsewhere: it only waits for pieces a helper has
//! already started, so a loaded process loses nothing but the hand-off.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, mpsc};

/// Smallest piece of a split memcpy (so memcpys of 1 MiB or more are split).
pub(crate) const MEMCPY_PIECE: usize = 512 << 10;

/// Most threads one copy uses (the caller and up to three helpers).
pub(crate) const MAX_THREADS: usize = 4;

/// The copy of one piece: `(offset, len)` within the whole range.
type PieceCopy<'a> = dyn Fn(usize, usize) -> std::io::Result<()> + Sync + 'a;

/// One split copy, shared by the caller and the helpers that pick it up.
struct Job {
    /// The caller's copy function, its lifetime erased: it is only called for a piece
    /// claimed through `next` while `pieces` are left, and the caller does not return
    /// before every claimed piece has finished.
    copy: *const PieceCopy<'static>,
    len: usize,
    piece: usize,
    pieces: usize,
    next: AtomicUsize,
    finished: Mutex<(usize, std::io::Result<()>)>,
    all_done: Condvar,
}

// SAFETY: `copy` points at a `Sync` closure that outlives every call made through it
// (see `Job::copy`); the rest is thread-safe by construction.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

impl Job {
    /// Copies pieces until none is left unclaimed.
    fn work(&self) {
        loop {
            let index = self.next.fetch_add(1, Ordering::AcqRel);
            if index >= self.pieces {
                return;
            }
            let offset = index * self.piece;
            let len = self.piece.min(self.len - offset);
            // SAFETY: a piece was claimed, so the caller is still waiting for it and
            // its closure is alive (see `Job::copy`).
            let outcome = unsafe { (*self.copy)(offset, len) };
            let mut finished = self.finished.lock().unwrap_or_else(PoisonError::into_inner);
            finished.0 += 1;
            if let (Err(error), Ok(())) = (outcome, &finished.1) {
                finished.1 = Err(error);
            }
            if finished.0 == self.pieces {
                self.all_done.notify_all();
            }
        }
    }
}

/// The helper threads and the queue they take jobs from.
struct Helpers {
    count: usize,
    queue: Mutex<mpsc::Sender<Arc<Job>>>,
}

fn helpers() -> &'static Helpers {
    static HELPERS: OnceLock<Helpers> = OnceLock::new();
    HELPERS.get_or_init(|| {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        let (queue, jobs) = mpsc::channel::<Arc<Job>>();
        let jobs = Arc::new(Mutex::new(jobs));
        let count = (1..cores.min(MAX_THREADS))
            .filter(|i| {
                let jobs = Arc::clone(&jobs);
                std::thread::Builder::new()
                    .name(format!("mooncake-copy-{i}"))
                    .spawn(move || help(&jobs))
                    .is_ok()
            })
            .count();
        Helpers {
            count,
            queue: Mutex::new(queue),
        }
    })
}

/// A helper thread: works on jobs until the queue closes.
fn help(jobs: &Mutex<mpsc::Receiver<Arc<Job>>>) {
    loop {
        let next = jobs.lock().unwrap_or_else(PoisonError::into_inner).recv();
        let Ok(job) = next else { return };
        job.work();
    }
}

/// Runs `copy(offset, len)` over `0..len` in page-aligned pieces of at least
/// `min_piece` bytes, on this thread and on helper threads (a copy shorter than two
/// pieces runs here alone); the first error is returned once every piece has run.
pub(crate) fn split_copy(
    len: usize,
    min_piece: usize,
    copy: &(dyn Fn(usize, usize) -> std::io::Result<()> + Sync),
) -> std::io::Result<()> {
    if len < 2 * min_piece.max(1) {
        return copy(0, len);
    }
    let helpers = helpers();
    let threads = (len / min_piece.max(1)).clamp(1, helpers.count + 1);
    if threads == 1 {
        return copy(0, len);
    }
    let piece = len.div_ceil(threads).next_multiple_of(4096);
    let pieces = len.div_ceil(piece);
    // SAFETY: only the lifetime is erased; this function does not return before every
    // piece claimed by anyone has finished (the wait below), and pieces are claimed
    // only while some are left, so the closure is never called after it returns.
    let erased: *const PieceCopy<'static> =
        unsafe { std::mem::transmute::<*const PieceCopy<'_>, *const PieceCopy<'static>>(copy) };
    let job = Arc::new(Job {
        copy: erased,
        len,
        piece,
        pieces,
        next: AtomicUsize::new(0),
        finished: Mutex::new((0, Ok(()))),
        all_done: Condvar::new(),
    });
    {
        let queue = helpers.queue.lock().unwrap_or_else(PoisonError::into_inner);
        for _ in 1..threads {
            // A closed queue (no helper left) only means this thread copies it all.
            let _ = queue.send(Arc::clone(&job));
        }
    }
    job.work();
    let mut finished = job.finished.lock().unwrap_or_else(PoisonError::into_inner);
    while finished.0 < pieces {
        finished = job
            .all_done
            .wait(finished)
            .unwrap_or_else(PoisonError::into_inner);
    }
    std::mem::replace(&mut finished.1, Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_is_covered_once_and_errors_are_reported() {
        const PIECE: usize = 64 << 10;
        for len in [1usize, 4096, 2 * PIECE - 1, 2 * PIECE, 11 * PIECE + 123] {
            let seen = Mutex::new(vec![0u8; len]);
            split_copy(len, PIECE, &|offset, piece| {
                let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
                for byte in &mut seen[offset..offset + piece] {
                    *byte += 1;
                }
                Ok(())
            })
            .expect("copy");
            assert!(
                seen.into_inner().expect("lock").iter().all(|&b| b == 1),
                "len {len}"
            );
        }
        let failed = split_copy(4 * PIECE, PIECE, &|offset, _| {
            if offset == 0 {
                Ok(())
            } else {
                Err(std::io::Error::other("piece failed"))
            }
        });
        assert!(failed.is_err() || helpers().count == 0);
    }
}
