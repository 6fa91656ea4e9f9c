//! Telling the kernel which records a batch reads next.
//!
//! Every record of a batched get is located before the first is read, so the batch
//! knows the bytes it will read; the kernel's read-ahead only guesses them from the
//! reads so far (starting small again in every file, and never across records that
//! lie apart). A [`ReadAhead`] hands the kernel the records' extents
//! (`posix_fadvise(WILLNEED)`, see [`crate::io::start_readahead`]) up to
//! a window in front of the batch's reads (about [`AHEAD_RECORDS`] records, at least
//! [`MIN_AHEAD_BYTES`] and at most [`MAX_AHEAD_BYTES`]), about half of it at a time:
//! the device reads them while the earlier ones are copied out and checked.
//!
//! Which records are hinted depends on what the kernel can follow on its own:
//!
//! * records scattered over files or places (a file per key, another order): all of
//!   them; nothing tells the kernel what comes next (64 KiB records of a file each:
//!   98 % of a raw sequential read hinted, 64 % without);
//! * records in order through a file the plan holds open (the bucket backend keeps
//!   its files open across batches): these; the descriptor's read-ahead state is left
//!   from earlier batches (86 % hinted, 52-60 % without);
//! * records in order through a descriptor opened for each read (the one-file
//!   backend): none; the kernel follows them from the pages already cached before
//!   each record and reads ahead in large folios, where a hint's pages are single
//!   pages (81-83 % hinted, 91-99 % without).
//!
//! A run of records that follow each other in one file is hinted in one call, through
//! the file the plan holds open or else opened by path for the call. Records outside
//! this machine (a distributed KV store) have no file and are not hinted; nor is a
//! batch of one record (its read follows at once).

use parking_lot::Mutex;

use crate::backend::{FileExtent, ReadPlan, lie_in_order};
use crate::io::start_readahead;

/// Records hinted in front of a batch's reads (of the batch's average size), within
/// [`MIN_AHEAD_BYTES`] and [`MAX_AHEAD_BYTES`]: 1 MiB records read faster with 16 MiB
/// hinted ahead than with 4 MiB (93-99 % of raw against 79-88 %), 64 KiB records
/// slower (73-81 % against 83-100 %; the pages the kernel reads for a hint are single
/// pages, where its own read-ahead reads large folios).
pub const AHEAD_RECORDS: u64 = 16;

/// The smallest window hinted ahead, in bytes.
pub const MIN_AHEAD_BYTES: u64 = 4 << 20;

/// The largest window hinted ahead, in bytes: the page cache the hints fill before
/// the reads take it (a limit per batch being read; a record that crosses the
/// window's end is hinted whole).
pub const MAX_AHEAD_BYTES: u64 = 16 << 20;

/// Bytes asked for in one `posix_fadvise` call at most: the kernel reads at most its
/// read-ahead size (`read_ahead_kb`, often 128 KiB) or the device's largest request
/// per call, whichever is larger, and drops the rest of a longer range; it reads
/// 2 MiB pieces within a call itself.
pub const HINT_PIECE_BYTES: u64 = 2 << 20;

/// The records of one batch still to be hinted, in the order they are read.
#[derive(Debug)]
pub struct ReadAhead<'p> {
    /// Each item's plan, when its record lies in a file and is to be hinted.
    plans: Vec<Option<&'p ReadPlan>>,
    /// `starts[i]`: bytes of the records before item `i` (one more entry than items:
    /// the last is the batch's total).
    starts: Vec<u64>,
    /// Bytes hinted in front of the reads (see [`AHEAD_RECORDS`]).
    window: u64,
    /// Items hinted so far, from the first.
    hinted: Mutex<usize>,
}

impl<'p> ReadAhead<'p> {
    /// Hints for a batch reading `plans` in this order (`None`: an item with nothing
    /// to read): when each record follows the one before (see
    /// [`ReadPlan::follows`]), for those held open, else for all in files; none for
    /// fewer than two.
    pub fn new(plans: Vec<Option<&'p ReadPlan>>) -> Self {
        let located: Vec<&ReadPlan> = plans.iter().copied().flatten().collect();
        let in_order = lie_in_order(&located);
        let plans: Vec<Option<&'p ReadPlan>> = plans
            .into_iter()
            .map(|plan| {
                plan.filter(|plan| {
                    plan.file_extent()
                        .is_some_and(|extent| !in_order || extent.open.is_some())
                })
            })
            .collect();
        let records = plans.iter().flatten().count() as u64;
        if records < 2 {
            return Self::none();
        }
        let mut starts = Vec::with_capacity(plans.len() + 1);
        let mut total = 0u64;
        starts.push(total);
        for plan in &plans {
            let len = plan.and_then(ReadPlan::file_extent).map_or(0, |e| e.len);
            total = total.saturating_add(len);
            starts.push(total);
        }
        let window = (total / records)
            .saturating_mul(AHEAD_RECORDS)
            .clamp(MIN_AHEAD_BYTES, MAX_AHEAD_BYTES);
        ReadAhead {
            plans,
            starts,
            window,
            hinted: Mutex::new(0),
        }
    }

    /// Hints nothing (for comparing reads with and without hints).
    pub fn none() -> Self {
        ReadAhead {
            plans: Vec::new(),
            starts: Vec::new(),
            window: MIN_AHEAD_BYTES,
            hinted: Mutex::new(0),
        }
    }

    /// Called before item `index` is read (from any thread; items are taken in
    /// order): when less than half of the window in front of it is hinted, hints the
    /// records up to a window from its start.
    pub fn before_read(&self, index: usize) {
        for run in self.take_due(index) {
            run.with_file(|file| {
                for (offset, len) in pieces(run.offset, run.len) {
                    start_readahead(file, offset, len);
                }
            });
        }
    }

    /// The extents to hint before item `index` is read, one per run of records that
    /// follow each other in one file (see [`before_read`](Self::before_read)); marks
    /// their items hinted. Empty when enough is hinted already, or while another
    /// thread takes its extents.
    fn take_due(&self, index: usize) -> Vec<FileExtent<'p>> {
        let items = self.plans.len();
        let Some(&start) = self.starts.get(index).filter(|_| index < items) else {
            return Vec::new();
        };
        let Some(mut hinted) = self.hinted.try_lock() else {
            return Vec::new();
        };
        if *hinted >= items || (*hinted > index && self.starts[*hinted] - start >= self.window / 2)
        {
            return Vec::new();
        }
        let from = (*hinted).max(index);
        let reach = self
            .starts
            .partition_point(|&at| at < start.saturating_add(self.window));
        let until = reach.clamp(from + 1, items);
        *hinted = until;
        self.runs(from, until)
    }

    /// The records of items `from..until`, those that follow each other in one file
    /// (see [`ReadPlan::follows`]) merged into one extent.
    fn runs(&self, from: usize, until: usize) -> Vec<FileExtent<'p>> {
        let mut runs: Vec<FileExtent<'p>> = Vec::new();
        let mut previous: Option<&ReadPlan> = None;
        for plan in self.plans[from..until].iter().copied().flatten() {
            let Some(extent) = plan.file_extent() else {
                continue;
            };
            match runs.last_mut() {
                Some(run) if previous.is_some_and(|previous| plan.follows(previous)) => {
                    run.len = extent.offset.saturating_add(extent.len) - run.offset;
                }
                _ => runs.push(extent),
            }
            previous = Some(plan);
        }
        runs
    }
}

/// `len` bytes from `offset` in pieces of at most [`HINT_PIECE_BYTES`], in order.
fn pieces(offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset.saturating_add(len);
    (offset..end)
        .step_by(usize::try_from(HINT_PIECE_BYTES).unwrap_or(usize::MAX))
        .map(move |at| (at, (end - at).min(HINT_PIECE_BYTES)))
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;
    use crate::io::IoEngine;
    use crate::record::HEADER_LEN;
    use crate::test_dir::TempDir;

    const MIB: u64 = 1 << 20;

    /// An empty file in `dir` standing for a record file (hints are not issued here).
    fn file(dir: &TempDir, name: &str) -> (PathBuf, Arc<File>) {
        let path = dir.0.join(name);
        (path.clone(), Arc::new(File::create(&path).expect("file")))
    }

    /// A plan for a whole record of `len` bytes (key `kNN`) at `offset` of `file`,
    /// held open unless `open` is false.
    fn plan(file: &(PathBuf, Arc<File>), offset: u64, len: u64, open: bool) -> ReadPlan {
        let key = format!("k{:02}", offset / MIB % 100);
        let value_len = len - (HEADER_LEN + key.len()) as u64;
        let plan = ReadPlan::in_file(
            file.0.clone(),
            offset,
            &key,
            value_len,
            Arc::new(IoEngine::new(false)),
            None,
        );
        if open {
            plan.through(Arc::clone(&file.1))
        } else {
            plan
        }
    }

    fn offsets(extents: &[FileExtent<'_>]) -> Vec<(u64, u64)> {
        extents
            .iter()
            .map(|extent| (extent.offset, extent.len))
            .collect()
    }

    #[test]
    fn records_in_order_are_hinted_a_window_ahead_half_a_window_at_a_time() {
        let dir = TempDir::new("read-ahead-in-order");
        let file = file(&dir, "records");
        // 1 MiB records: a window of 16 records, 16 MiB.
        let plans: Vec<ReadPlan> = (0..40).map(|i| plan(&file, i * MIB, MIB, true)).collect();
        let ahead = ReadAhead::new(plans.iter().map(Some).collect());
        assert_eq!(offsets(&ahead.take_due(0)), [(0, 16 * MIB)]);
        for index in 1..=8 {
            assert!(ahead.take_due(index).is_empty(), "item {index}");
        }
        assert_eq!(offsets(&ahead.take_due(9)), [(16 * MIB, 9 * MIB)]);
        // A reader far ahead (several threads) is hinted from where it reads.
        assert_eq!(offsets(&ahead.take_due(30)), [(30 * MIB, 10 * MIB)]);
        assert!(ahead.take_due(39).is_empty(), "all hinted");
        assert!(ahead.take_due(40).is_empty(), "past the last item");
    }

    #[test]
    fn the_window_is_sixteen_records_within_its_bounds() {
        let dir = TempDir::new("read-ahead-window");
        let file = file(&dir, "records");
        let small = 64 << 10;
        let plans: Vec<ReadPlan> = (0..200)
            .map(|i| plan(&file, i * small, small, true))
            .collect();
        let ahead = ReadAhead::new(plans.iter().map(Some).collect());
        assert_eq!(offsets(&ahead.take_due(0)), [(0, MIN_AHEAD_BYTES)]);
        let middle = 512 << 10;
        let plans: Vec<ReadPlan> = (0..40)
            .map(|i| plan(&file, i * middle, middle, true))
            .collect();
        let ahead = ReadAhead::new(plans.iter().map(Some).collect());
        assert_eq!(offsets(&ahead.take_due(0)), [(0, 16 * middle)]);
        let large = 8 * MIB;
        let plans: Vec<ReadPlan> = (0..4)
            .map(|i| plan(&file, i * large, large, true))
            .collect();
        let ahead = ReadAhead::new(plans.iter().map(Some).collect());
        assert_eq!(offsets(&ahead.take_due(0)), [(0, MAX_AHEAD_BYTES)]);
    }

    #[test]
    fn records_apart_or_in_other_files_are_hinted_on_their_own() {
        let dir = TempDir::new("read-ahead-apart");
        let (one, other) = (file(&dir, "one"), file(&dir, "other"));
        let plans = [
            plan(&one, 0, MIB, true),
            plan(&one, MIB, MIB, true),
            // Within FOLLOWS_WITHIN of the one before: the same extent.
            plan(&one, 2 * MIB + 4096, MIB, true),
            plan(&one, 8 * MIB, MIB, true),
            plan(&other, 9 * MIB, MIB, true),
            plan(&other, 0, MIB, true),
        ];
        let ahead = ReadAhead::new(plans.iter().map(Some).collect());
        assert_eq!(
            offsets(&ahead.take_due(0)),
            [
                (0, 3 * MIB + 4096),
                (8 * MIB, MIB),
                (9 * MIB, MIB),
                (0, MIB)
            ]
        );
    }

    #[test]
    fn a_run_is_asked_for_in_pieces_the_kernel_reads_whole() {
        let piece = HINT_PIECE_BYTES;
        assert_eq!(
            pieces(100, 2 * piece + 5).collect::<Vec<_>>(),
            [(100, piece), (100 + piece, piece), (100 + 2 * piece, 5)]
        );
        assert_eq!(pieces(7, piece).collect::<Vec<_>>(), [(7, piece)]);
        assert_eq!(pieces(7, 0).count(), 0);
    }

    #[test]
    fn one_record_or_records_in_order_not_held_open_are_not_hinted_scattered_ones_are() {
        let dir = TempDir::new("read-ahead-unhinted");
        let file = file(&dir, "records");
        let single = [plan(&file, 0, MIB, true)];
        assert!(
            ReadAhead::new(single.iter().map(Some).collect())
                .take_due(0)
                .is_empty()
        );
        // In order through descriptors opened per read: the kernel follows them.
        let closed: Vec<ReadPlan> = (0..2).map(|i| plan(&file, i * MIB, MIB, false)).collect();
        assert!(
            ReadAhead::new(closed.iter().map(Some).collect())
                .take_due(0)
                .is_empty()
        );
        // Scattered: hinted, by path.
        let closed = [plan(&file, MIB, MIB, false), plan(&file, 0, MIB, false)];
        let due = ReadAhead::new(closed.iter().map(Some).collect()).take_due(0);
        assert_eq!(offsets(&due), [(MIB, MIB), (0, MIB)]);
        assert!(
            due.iter()
                .all(|run| run.open.is_none() && run.path == file.0)
        );
        // Items without a record (not found) are skipped, the others hinted.
        let some = [plan(&file, 0, MIB, true), plan(&file, MIB, MIB, true)];
        let ahead = ReadAhead::new(vec![None, Some(&some[0]), None, Some(&some[1])]);
        let due = ahead.take_due(0);
        assert_eq!(offsets(&due), [(0, 2 * MIB)]);
        assert!(due[0].open.is_some());
        assert!(ReadAhead::none().take_due(0).is_empty());
        // Hinting through the path, or a path that is gone, reads nothing wrong.
        ReadAhead::new(closed.iter().map(Some).collect()).before_read(0);
        std::fs::remove_file(&file.0).expect("remove");
        ReadAhead::new(closed.iter().map(Some).collect()).before_read(0);
    }
}
