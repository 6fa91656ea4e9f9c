//! Reading a batch of records several at a time.
//!
//! Records that follow each other in one file (a batch read in the order it was
//! written) are read in order on the caller's thread: the device is kept busy ahead
//! of it by a direct stream's helpers ([`crate::direct_run`]) or the page cache's
//! read-ahead, and a second reader interleaving with the first measured no faster,
//! at times slower. What a second thread does take over is the checking: the caller
//! hands the records it has read over about 1 MiB at a time to one helper, which
//! checks their keys and checksums while the caller reads on
//! ([`Schedule::Pipelined`]), so that the reads follow each other as closely as a
//! plain sequential read's.
//!
//! Scattered records (other files, other places of a file) each wait for the device
//! on their own, so a batch of them is read by up to [`READERS`] threads (the caller
//! and scoped helpers started for the batch) taking the next record in turn, each
//! reading and checking it: random 64 KiB reads measured 2.2-2.6 times faster with
//! four threads than with one.
//!
//! Batches moving less than [`PARALLEL_BYTES`], and batches in order too small for
//! two hand-offs, are read and checked on the caller's thread alone. Each step (a
//! read, a check) runs on one thread from start to end, so whatever a step sets up
//! around itself (a guard over shared memory, a lock) stays on that thread.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::{ReadPlan, StoreError, UncheckedRead, lie_in_order};
use crate::batch_reader::BatchReader;

/// Most threads reading one batch (the caller included): reads wait on the device,
/// not the CPU, so this may exceed the cores.
pub const READERS: usize = 4;

/// Smallest batch, in bytes, read by more than one thread, or written by more than
/// one when it is a file per object (below it, starting helper threads costs more
/// than the overlap gains).
pub const PARALLEL_BYTES: u64 = 1 << 20;

/// Bytes of records a pipelined read hands to its checker at once: handing over each
/// 64 KiB record on its own woke the checker so often that the batch read slower
/// than without it.
pub const HANDOFF_BYTES: u64 = 1 << 20;

/// Hand-offs queued between a pipelined read and its checker at most (besides the one
/// being checked and the one being filled): the values lie in their destinations
/// meanwhile, so this bounds only the headers held between the two threads.
const PIPELINE_DEPTH: usize = 16;

/// How the reads of one batch are spread over threads ([`schedule_for`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Each record read and checked in turn on the caller's thread.
    InTurn,
    /// Records read in order on the caller's thread and handed `per_handoff` at a
    /// time to one helper thread, which checks them while the next are read.
    Pipelined {
        /// Records per hand-off (about [`HANDOFF_BYTES`]).
        per_handoff: usize,
    },
    /// Records read and checked by this many threads taking the next in turn.
    Parallel(usize),
}

/// The schedule for `plans`: [`InTurn`](Schedule::InTurn) for fewer than two
/// records or less than [`PARALLEL_BYTES`]; when each record follows the one before
/// it in the same file (see [`ReadPlan::follows`]),
/// [`Pipelined`](Schedule::Pipelined) with hand-offs of about [`HANDOFF_BYTES`] if
/// the batch makes at least two (else `InTurn`: a single hand-off would be checked
/// only after the last read); else [`Parallel`](Schedule::Parallel) with up to
/// [`READERS`] threads.
pub fn schedule_for(plans: &[&ReadPlan]) -> Schedule {
    let bytes = plans
        .iter()
        .map(|plan| plan.len())
        .fold(0u64, u64::saturating_add);
    if plans.len() < 2 || bytes < PARALLEL_BYTES {
        return Schedule::InTurn;
    }
    if lie_in_order(plans) {
        let average = bytes / plans.len() as u64;
        let per_handoff =
            usize::try_from(HANDOFF_BYTES.div_ceil(average.max(1))).unwrap_or(usize::MAX);
        if plans.len() / 2 < per_handoff {
            return Schedule::InTurn;
        }
        return Schedule::Pipelined { per_handoff };
    }
    Schedule::Parallel(plans.len().min(READERS))
}

/// Runs `read(i)` then `finish(i, what it read)` for every `i < count` as `schedule`
/// says; answers each item's result in order.
pub fn map_checked_reads<A: Send, T: Send>(
    count: usize,
    schedule: Schedule,
    read: impl Fn(usize) -> A + Sync,
    finish: impl Fn(usize, A) -> T + Sync,
) -> Vec<T> {
    match schedule {
        Schedule::InTurn => (0..count).map(|i| finish(i, read(i))).collect(),
        Schedule::Parallel(readers) => map_on_threads(count, readers, |i| finish(i, read(i))),
        Schedule::Pipelined { per_handoff } => pipelined(count, per_handoff, &read, &finish),
    }
}

/// Reads every item in order on the caller's thread, handing them `per_handoff` at a
/// time to one scoped helper that finishes each in turn; when the helper cannot be
/// started, the caller finishes each item itself.
fn pipelined<A: Send, T: Send>(
    count: usize,
    per_handoff: usize,
    read: &(impl Fn(usize) -> A + Sync),
    finish: &(impl Fn(usize, A) -> T + Sync),
) -> Vec<T> {
    let per_handoff = per_handoff.clamp(1, count.max(1));
    std::thread::scope(|scope| {
        // Made inside the scope and moved into its closures: whichever side ends
        // first (or panics) drops its end, which ends the other's loop, so the
        // scope never waits on a blocked thread.
        let (handoffs, queue) = std::sync::mpsc::sync_channel::<Vec<(usize, A)>>(PIPELINE_DEPTH);
        let checker = std::thread::Builder::new()
            .name("ssd-checker".into())
            .spawn_scoped(scope, move || {
                queue
                    .iter()
                    .flatten()
                    .map(|(index, what)| finish(index, what))
                    .collect::<Vec<T>>()
            });
        let Ok(checker) = checker else {
            return (0..count).map(|i| finish(i, read(i))).collect();
        };
        let mut group = Vec::with_capacity(per_handoff);
        for index in 0..count {
            group.push((index, read(index)));
            if group.len() == per_handoff || index + 1 == count {
                let full = std::mem::replace(&mut group, Vec::with_capacity(per_handoff));
                if handoffs.send(full).is_err() {
                    break;
                }
            }
        }
        drop(handoffs);
        match checker.join() {
            Ok(answers) => answers,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    })
}

/// Runs `work(i)` for every `i < count` on `threads` threads (the caller's and
/// helpers started for the call; at most [`READERS`]), each taking the next item in
/// turn; answers each item's result in order. (Scattered reads; file-per-key writes
/// too, a file per item.)
pub fn map_on_threads<T: Send>(
    count: usize,
    threads: usize,
    work: impl Fn(usize) -> T + Sync,
) -> Vec<T> {
    let threads = threads.clamp(1, READERS).min(count);
    if threads <= 1 {
        return (0..count).map(work).collect();
    }
    let answers: Vec<Mutex<Option<T>>> = (0..count).map(|_| Mutex::new(None)).collect();
    let next = AtomicUsize::new(0);
    let take_turns = || {
        loop {
            let index = next.fetch_add(1, Ordering::Relaxed);
            let Some(slot) = answers.get(index) else {
                break;
            };
            let answer = work(index);
            *slot
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(answer);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            // A helper that cannot be started leaves its share to the others.
            let _ = std::thread::Builder::new()
                .name("ssd-worker".into())
                .spawn_scoped(scope, take_turns);
        }
        take_turns();
    });
    answers
        .into_iter()
        .map(|slot| {
            slot.into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .expect("every item is done before the scope ends")
        })
        .collect()
}

/// Reads each plan's value into the start of the destination of the same index (as
/// [`ReadPlan::read_into`] does, on the threads [`schedule_for`] gives the batch,
/// through a [`BatchReader`]); answers each value's length or error, in order. Fewer
/// destinations than plans: the plans left over answer `Invalid`.
pub fn read_plans(plans: &[ReadPlan], dests: Vec<&mut [u8]>) -> Vec<Result<u64, StoreError>> {
    let schedule = schedule_for(&plans.iter().collect::<Vec<_>>());
    read_plans_as(plans, dests, schedule, true)
}

/// [`read_plans`] on the threads `schedule` says, whatever the plans; `aided`: through
/// a [`BatchReader`] (direct streams, read-ahead hints), else every record through the
/// page cache alone (for comparing schedules and readers).
pub fn read_plans_as(
    plans: &[ReadPlan],
    dests: Vec<&mut [u8]>,
    schedule: Schedule,
    aided: bool,
) -> Vec<Result<u64, StoreError>> {
    let reader = if aided {
        BatchReader::new(plans.iter().map(Some).collect())
    } else {
        BatchReader::unaided()
    };
    let dests: Vec<Mutex<&mut [u8]>> = dests.into_iter().map(Mutex::new).collect();
    let dest = |index: usize| {
        let dest = dests.get(index).ok_or_else(|| {
            StoreError::Invalid(format!("no destination for read {index} of the batch"))
        })?;
        Ok(dest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner))
    };
    map_checked_reads(
        plans.len(),
        schedule,
        |index| reader.read_unchecked(index, &plans[index], *dest(index)?),
        |index, read: Result<UncheckedRead, StoreError>| {
            plans[index].finish_read(read?, *dest(index)?)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_item_is_answered_in_order_whatever_thread_read_it() {
        let answers = map_on_threads(100, READERS, |index| index * 2);
        assert_eq!(answers, (0..100).map(|i| i * 2).collect::<Vec<_>>());
    }

    #[test]
    fn a_pipelined_batch_reads_on_the_caller_and_checks_on_one_helper_in_order() {
        let caller = std::thread::current().id();
        let readers = Mutex::new(std::collections::HashSet::new());
        let checkers = Mutex::new(std::collections::HashSet::new());
        let answers = map_checked_reads(
            200,
            Schedule::Pipelined { per_handoff: 7 },
            |index| {
                readers
                    .lock()
                    .expect("not poisoned")
                    .insert(std::thread::current().id());
                index * 3
            },
            |index, read| {
                checkers
                    .lock()
                    .expect("not poisoned")
                    .insert(std::thread::current().id());
                (index, read + 1)
            },
        );
        assert_eq!(
            answers,
            (0..200).map(|i| (i, i * 3 + 1)).collect::<Vec<_>>()
        );
        let readers = readers.into_inner().expect("not poisoned");
        let checkers = checkers.into_inner().expect("not poisoned");
        assert_eq!(readers.into_iter().collect::<Vec<_>>(), vec![caller]);
        assert_eq!(checkers.len(), 1);
        assert!(
            !checkers.contains(&caller),
            "the checks ran beside the reads"
        );
    }

    #[test]
    fn every_schedule_answers_every_item_in_order() {
        for schedule in [
            Schedule::InTurn,
            Schedule::Pipelined { per_handoff: 1 },
            Schedule::Pipelined { per_handoff: 5 },
            Schedule::Parallel(READERS),
        ] {
            let answers = map_checked_reads(0, schedule, |i| i, |i, read| i + read);
            assert!(answers.is_empty(), "{schedule:?}");
            let answers = map_checked_reads(37, schedule, |i| i, |i, read| i + read);
            assert_eq!(
                answers,
                (0..37).map(|i| 2 * i).collect::<Vec<_>>(),
                "{schedule:?}"
            );
        }
    }

    #[test]
    fn the_readers_asked_for_share_the_items() {
        let threads = |count, readers| {
            let seen = Mutex::new(std::collections::HashSet::new());
            map_on_threads(count, readers, |_| {
                std::thread::sleep(std::time::Duration::from_millis(2));
                seen.lock()
                    .expect("not poisoned")
                    .insert(std::thread::current().id());
            });
            seen.into_inner().expect("not poisoned").len()
        };
        assert_eq!(threads(8, 1), 1);
        assert_eq!(threads(1, READERS), 1);
        assert!(threads(8, READERS) > 1);
        assert!(threads(8, 100) <= READERS);
    }
}
