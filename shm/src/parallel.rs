//! Long copies split across a few threads.
//!
//! One thread's copy reaches only part of the memory bandwidth (about two thirds on the
//! machines we measured); two or three threads together come close to all of it. A
//! copy of at least two pieces' worth is cut into page-aligned pieces that the
//! calling thread and a few helper threads (started once, one per further core, at
//! most [`MAX_THREADS`] in all) take in turn. The caller copies pieces too and never
//! waits for a helper that is busy elsewhere: it only waits for pieces a helper has
//! already started, so a loaded process loses nothing but the hand-off.
//!
//! A batch of many copies of a megabyte or so ([`for_each_item`]) is shared out item by
//! item instead: one hand-off for the whole batch rather than one per copy.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, mpsc};

/// Smallest piece of a split memcpy (so memcpys of 1 MiB or more are split).
pub(crate) const MEMCPY_PIECE: usize = 512 << 10;

/// How long a caller that has run out of pieces spins for the pieces helpers are still
/// copying before it sleeps: about one 512 KiB piece's copy on a slow machine.
const SPIN_FOR_PIECES: std::time::Duration = std::time::Duration::from_micros(100);

/// Items of a batch at least this large on average are not shared out item by item
/// ([`for_each_item`]): each splits its own copy instead.
const SPLIT_ITEM_BYTES: u64 = 8 * MEMCPY_PIECE as u64;

/// Most threads one copy uses (the caller and up to three helpers).
pub(crate) const MAX_THREADS: usize = 4;

thread_local! {
    /// Set while this thread's copies must not be shared out ([`on_this_thread`]).
    static ALONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn alone() -> bool {
    ALONE.with(std::cell::Cell::get)
}

/// Runs `work` with every copy it makes done on this thread alone, none shared out to
/// the helper threads: for copies that run while a round trip is under way, whose peer
/// (on this machine) needs the other cores more than the copy does.
pub fn on_this_thread<T>(work: impl FnOnce() -> T) -> T {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            ALONE.with(|flag| flag.set(self.0));
        }
    }
    let _reset = Reset(ALONE.with(|flag| flag.replace(true)));
    work()
}

/// The work of one piece, by its index.
type PieceWork<'a> = dyn Fn(usize) -> std::io::Result<()> + Sync + 'a;

/// One split job, shared by the caller and the helpers that pick it up.
struct Job {
    /// The caller's work function, its lifetime erased: it is only called for a piece
    /// claimed through `next` while `pieces` are left, and the caller does not return
    /// before every claimed piece has finished.
    work: *const PieceWork<'static>,
    pieces: usize,
    next: AtomicUsize,
    /// Pieces finished, read without a lock by a caller that spins for the last ones.
    done: AtomicUsize,
    /// The first failure, if any.
    failure: Mutex<Option<std::io::Error>>,
    /// The first panic of a piece, carried to the caller, which resumes it.
    panic: Mutex<Option<Box<dyn std::any::Any + Send>>>,
    /// Taken to sleep on `all_done`, and by the last piece before it notifies.
    sleeping: Mutex<()>,
    all_done: Condvar,
}

// SAFETY: `work` points at a `Sync` closure that outlives every call made through it
// (see `Job::work`); the rest is thread-safe by construction.
unsafe impl Send for Job {}
// SAFETY: as above.
unsafe impl Sync for Job {}

impl Job {
    /// Runs pieces until none is left unclaimed.
    fn run(&self) {
        loop {
            let index = self.next.fetch_add(1, Ordering::AcqRel);
            if index >= self.pieces {
                return;
            }
            // SAFETY: a piece was claimed, so the caller is still waiting for it and
            // its closure is alive (see `Job::work`). A panic finishes the piece too
            // (the caller never waits for a piece that will not finish) and goes to
            // the caller, which resumes it once every piece is done.
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                (*self.work)(index)
            }))
            .unwrap_or_else(|payload| {
                let mut panic = self.panic.lock().unwrap_or_else(PoisonError::into_inner);
                panic.get_or_insert(payload);
                Ok(())
            });
            if let Err(error) = outcome {
                let mut failure = self.failure.lock().unwrap_or_else(PoisonError::into_inner);
                failure.get_or_insert(error);
            }
            if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.pieces {
                let _sleeping = self.sleeping.lock().unwrap_or_else(PoisonError::into_inner);
                self.all_done.notify_all();
            }
        }
    }

    /// Waits for every piece to finish: spinning for up to [`SPIN_FOR_PIECES`] (the
    /// pieces left were started by helpers and end within one piece's copy, sooner
    /// than a sleeping thread wakes up on a virtual machine), then sleeping.
    fn wait(&self) -> std::io::Result<()> {
        let spin_until = std::time::Instant::now() + SPIN_FOR_PIECES;
        while self.done.load(Ordering::Acquire) < self.pieces
            && std::time::Instant::now() < spin_until
        {
            std::hint::spin_loop();
        }
        let mut sleeping = self.sleeping.lock().unwrap_or_else(PoisonError::into_inner);
        while self.done.load(Ordering::Acquire) < self.pieces {
            sleeping = self
                .all_done
                .wait(sleeping)
                .unwrap_or_else(PoisonError::into_inner);
        }
        drop(sleeping);
        let panic = self
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(payload) = panic {
            std::panic::resume_unwind(payload);
        }
        let failure = self
            .failure
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        failure.map_or(Ok(()), Err)
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
        job.run();
    }
}

/// Runs `work(index)` for every index of `0..pieces`, on this thread and up to
/// `threads - 1` helpers; the first error is returned once every piece has run.
fn run_pieces(pieces: usize, threads: usize, work: &PieceWork<'_>) -> std::io::Result<()> {
    // SAFETY: only the lifetime is erased; this function does not return before every
    // piece claimed by anyone has finished (the wait below), and pieces are claimed
    // only while some are left, so the closure is never called after it returns.
    let erased: *const PieceWork<'static> =
        unsafe { std::mem::transmute::<*const PieceWork<'_>, *const PieceWork<'static>>(work) };
    let job = Arc::new(Job {
        work: erased,
        pieces,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        failure: Mutex::new(None),
        panic: Mutex::new(None),
        sleeping: Mutex::new(()),
        all_done: Condvar::new(),
    });
    {
        let queue = helpers()
            .queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for _ in 1..threads {
            // A closed queue (no helper left) only means this thread does it all.
            let _ = queue.send(Arc::clone(&job));
        }
    }
    job.run();
    job.wait()
}

/// Runs `copy(offset, len)` over `0..len` in page-aligned pieces of at least
/// `min_piece` bytes, on this thread and on helper threads (a copy shorter than two
/// pieces runs here alone); the first error is returned once every piece has run.
pub(crate) fn split_copy(
    len: usize,
    min_piece: usize,
    copy: &(dyn Fn(usize, usize) -> std::io::Result<()> + Sync),
) -> std::io::Result<()> {
    if len < 2 * min_piece.max(1) || alone() {
        return copy(0, len);
    }
    let threads = (len / min_piece.max(1)).clamp(1, helpers().count + 1);
    if threads == 1 {
        return copy(0, len);
    }
    let piece = len.div_ceil(threads).next_multiple_of(4096);
    let pieces = len.div_ceil(piece);
    run_pieces(pieces, threads, &|index| {
        let offset = index * piece;
        copy(offset, piece.min(len - offset))
    })
}

/// Runs `work(index)` for every index of `0..count`, the items of a batch that moves
/// `bytes` in all: on this thread alone when that is less than two copy pieces (a
/// hand-off to another thread costs more than it saves), else on this thread and the
/// helper threads, each taking the next item not yet taken, so a batch of many
/// medium-sized copies pays one hand-off instead of one per copy (items of
/// [`SPLIT_ITEM_BYTES`] or more on average run here in turn, each split on its own).
/// Returns once every item has run. `work` must not block on anything but its own
/// copies.
pub(crate) fn for_each_item(count: usize, bytes: u64, work: &(dyn Fn(usize) + Sync)) {
    let threads = helpers_for(count, bytes);
    if threads <= 1 {
        (0..count).for_each(work);
        return;
    }
    let _ = run_pieces(count, threads, &|index| {
        work(index);
        Ok(())
    });
}

/// Runs `work(index)` for every item of a batch that moves `bytes` in all, shared out
/// across the copy threads as [`for_each_item`] says, and answers what each item
/// returned: one value per item, in order.
pub fn map_items<T: Send>(count: usize, bytes: u64, work: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if helpers_for(count, bytes) <= 1 {
        return (0..count).map(work).collect();
    }
    let answers: Vec<Mutex<Option<T>>> = (0..count).map(|_| Mutex::new(None)).collect();
    for_each_item(count, bytes, &|index| {
        let answer = work(index);
        *answers[index]
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(answer);
    });
    answers
        .into_iter()
        .enumerate()
        // Every item ran above (a panic in one was resumed before this point); `work`
        // again only if one somehow did not.
        .map(|(index, answer)| {
            let answer = answer.into_inner().unwrap_or_else(PoisonError::into_inner);
            answer.unwrap_or_else(|| work(index))
        })
        .collect()
}

/// How many threads a batch of `count` items moving `bytes` is worth.
fn helpers_for(count: usize, bytes: u64) -> usize {
    if count < 2 || bytes < 2 * MEMCPY_PIECE as u64 || alone() {
        return 1;
    }
    // Items of several megabytes split their own copies, which measured faster
    // (16 MiB items: 19-21 GB/s split piece by piece, 15 GB/s item by item).
    if bytes / count as u64 >= SPLIT_ITEM_BYTES {
        return 1;
    }
    count.min(helpers().count + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_on_this_thread_are_not_shared_out() {
        const PIECE: usize = 64 << 10;
        let me = std::thread::current().id();
        let threads = Mutex::new(std::collections::HashSet::new());
        let record = |_: usize, _: usize| {
            threads
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(std::thread::current().id());
            Ok(())
        };
        on_this_thread(|| split_copy(16 * PIECE, PIECE, &record)).expect("copy");
        let items = on_this_thread(|| {
            map_items(8, 64 * MEMCPY_PIECE as u64, |_| std::thread::current().id())
        });
        assert!(items.iter().all(|id| *id == me));
        assert_eq!(*threads.lock().expect("lock"), [me].into_iter().collect());
        assert!(!alone(), "the flag is reset on return");
    }

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

    #[test]
    fn every_item_of_a_batch_runs_once_wherever_it_runs() {
        for (count, bytes) in [
            (0usize, 0u64),
            (1, 64 << 20),
            (32, 4096),
            (32, 32 << 20),
            (3, 1 << 30),
        ] {
            let runs: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
            for_each_item(count, bytes, &|index| {
                runs[index].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                runs.iter().all(|r| r.load(Ordering::Relaxed) == 1),
                "{count} items of {bytes} bytes"
            );
        }
    }

    #[test]
    fn a_panic_in_an_item_reaches_the_caller_after_every_item_ran() {
        let ran = AtomicUsize::new(0);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            for_each_item(8, 8 << 20, &|index| {
                ran.fetch_add(1, Ordering::Relaxed);
                assert!(index != 3, "item 3 fails");
            });
        }));
        assert!(outcome.is_err(), "the panic was swallowed");
        assert_eq!(ran.load(Ordering::Relaxed), 8);
        // The copy threads survive it.
        let answers = map_items(8, 8 << 20, |index| index + 1);
        assert_eq!(answers, (1..=8).collect::<Vec<_>>());
    }

    #[test]
    fn answers_of_a_batch_come_back_in_order() {
        for (count, bytes) in [(0usize, 0u64), (5, 4096), (32, 32 << 20)] {
            let answers = map_items(count, bytes, |index| index * 3);
            assert_eq!(answers, (0..count).map(|i| i * 3).collect::<Vec<_>>());
        }
    }

    #[test]
    fn items_of_a_batch_may_split_their_own_copies() {
        let seen = Mutex::new(vec![0u8; 8 * MEMCPY_PIECE]);
        for_each_item(4, 8 * MEMCPY_PIECE as u64, &|item| {
            let base = item * 2 * MEMCPY_PIECE;
            split_copy(2 * MEMCPY_PIECE, MEMCPY_PIECE, &|offset, piece| {
                let mut seen = seen.lock().unwrap_or_else(PoisonError::into_inner);
                for byte in &mut seen[base + offset..base + offset + piece] {
                    *byte += 1;
                }
                Ok(())
            })
            .expect("copy");
        });
        assert!(seen.into_inner().expect("lock").iter().all(|&b| b == 1));
    }
}
