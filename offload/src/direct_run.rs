//! Reading a batch's records that lie in order in one file straight from the device.
//!
//! A batched get of records that follow each other in one file (a bucket read back in
//! the order it was written, or a run of the one-file backend) knows every byte it
//! will read before the first. When the first of them is not in the page cache, a
//! [`DirectRun`] reads the whole extent with `O_DIRECT` in [`CHUNK_BYTES`] pieces,
//! [`CHUNKS_IN_FLIGHT`] at once on helper threads, into buffers of its own; each
//! record's header, key and value are copied out of them (one copy, as the page
//! cache's is) while the next pieces are on their way. The page cache's read-ahead
//! starts small again in every file and the pages hinted to it come as single pages;
//! direct pieces keep the device busy from the first record, in every file: raw
//! direct reads of 1 MiB at four in flight ran at 1.7 GB/s over sixteen files of
//! 32 MiB on the test machine, where 64 KiB buffered reads of the same files ran at
//! 0.7-0.9 GB/s and of one file of 512 MiB at 1.5 GB/s.
//!
//! A batch whose first record's first page is cached is read through the page cache
//! as before (it serves it at memory speed). Whatever the run cannot serve (the file
//! cannot be opened with `O_DIRECT`, a piece fails or ends early, a destination too
//! small, a record asked for again or behind the last one served, a second reader
//! at the same time) is answered `None`, and the caller reads that record the usual
//! way, which reports real errors. The reader only goes forward: asking for a chunk
//! releases every chunk before it, so records it skips never hold the stream up.
//! The values are checked afterwards as any read's are.
//!
//! # Limits
//!
//! Per batch being read: [`CHUNKS_IN_FLIGHT`] helper threads and
//! `CHUNKS_IN_FLIGHT + 2` buffers of [`CHUNK_BYTES`] (6 MiB), released when the
//! batch ends; at most [`MAX_RUNS`] runs at once in a process (other batches read
//! through the page cache); only runs of at least [`MIN_RUN_BYTES`] are streamed.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};

use crate::backend::{FileExtent, ReadPlan, UncheckedRead, lie_in_order};
use crate::io::{ALIGN, AlignedBuffer};

/// Bytes of one direct read.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Direct reads in flight at once (one helper thread each).
pub const CHUNKS_IN_FLIGHT: usize = 4;

/// Buffers of a run: those in flight, the one being copied out and one spare.
const SLOTS: usize = CHUNKS_IN_FLIGHT + 2;

/// The smallest extent streamed: below it the helper threads cost more than the
/// page cache's read-ahead loses.
pub const MIN_RUN_BYTES: u64 = 4 << 20;

/// Direct runs alive at once in this process at most (each holds its helpers and
/// buffers); a batch read beyond it goes through the page cache.
pub const MAX_RUNS: usize = 4;

/// Direct runs alive now (see [`MAX_RUNS`]).
static LIVE_RUNS: AtomicUsize = AtomicUsize::new(0);

/// The state of one chunk's buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// Not holding any chunk being read or waiting to be copied out.
    Free,
    /// Chunk `.0` is being read into it.
    Loading(usize),
    /// Chunk `.0` is in it: `.1` bytes (fewer than asked at the end of the file).
    Ready(usize, usize),
    /// Reading chunk `.0` failed.
    Failed(usize),
}

/// What the helpers and the reader share.
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    buffers: Vec<Mutex<AlignedBuffer>>,
    file: File,
    /// Offset in the file of chunk 0 (aligned).
    base: u64,
    /// Bytes from `base` to read (aligned).
    len: u64,
}

struct State {
    slots: Vec<Slot>,
    /// Chunks before this one are no longer needed: their slots may be reused.
    released: usize,
    /// Set when the run ends: helpers stop.
    stop: bool,
    /// Set when a helper ended without finishing its chunks (it panicked): the
    /// reader stops waiting.
    broken: bool,
}

impl State {
    /// Releases every chunk before `chunk`: their slots are freed now (those still
    /// being read, when their read ends).
    fn release_before(&mut self, chunk: usize) -> bool {
        if chunk <= self.released {
            return false;
        }
        for slot in &mut self.slots {
            if matches!(*slot, Slot::Ready(c, _) | Slot::Failed(c) if c < chunk) {
                *slot = Slot::Free;
            }
        }
        self.released = chunk;
        true
    }
}

/// One batch's records streamed from their file with direct reads (see the module
/// documentation); dropping it stops and joins its helpers.
pub struct DirectRun {
    shared: Arc<Shared>,
    /// Each item's record in the file: `(offset, head length, value length)`;
    /// `None` for items not in the run.
    records: Vec<Option<(u64, usize, u64)>>,
    helpers: Vec<std::thread::JoinHandle<()>>,
    /// Held by the one reader copying out: a second one at the same time is
    /// answered `None` (the stream serves one reader going forward).
    reading: Mutex<()>,
}

impl DirectRun {
    /// Starts streaming `plans` (`None`: an item with nothing to read) when the
    /// records lie in order in one file, span at least [`MIN_RUN_BYTES`] and the
    /// first is not in the page cache, the file opens with `O_DIRECT`, and fewer
    /// than [`MAX_RUNS`] runs are alive.
    pub fn start(plans: &[Option<&ReadPlan>]) -> Option<Self> {
        let located: Vec<&ReadPlan> = plans.iter().copied().flatten().collect();
        if located.len() < 2 || !lie_in_order(&located) {
            return None;
        }
        let first = located.first()?.file_extent()?;
        let last = located.last()?.file_extent()?;
        let align = ALIGN as u64;
        let base = first.offset / align * align;
        let end = last
            .offset
            .checked_add(last.len)?
            .checked_next_multiple_of(align)?;
        let len = end.checked_sub(base)?;
        if len < MIN_RUN_BYTES || is_cached(&first) {
            return None;
        }
        let records = plans
            .iter()
            .map(|plan| {
                let plan = (*plan)?;
                let extent = plan.file_extent()?;
                let head = usize::try_from(extent.len.checked_sub(plan.len())?).ok()?;
                Some((extent.offset, head, plan.len()))
            })
            .collect();
        let chunks = usize::try_from(len.div_ceil(CHUNK_BYTES as u64)).ok()?;
        let buffers = (0..SLOTS)
            .map(|_| AlignedBuffer::new(CHUNK_BYTES).map(Mutex::new))
            .collect::<Option<Vec<_>>>()?;
        let file = open_direct(first.path)?;
        let admitted = LIVE_RUNS
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |live| {
                (live < MAX_RUNS).then_some(live + 1)
            })
            .is_ok();
        if !admitted {
            return None;
        }
        let mut run = DirectRun {
            shared: Arc::new(Shared {
                state: Mutex::new(State {
                    slots: vec![Slot::Free; SLOTS],
                    released: 0,
                    stop: false,
                    broken: false,
                }),
                changed: Condvar::new(),
                buffers,
                file,
                base,
                len,
            }),
            records,
            helpers: Vec::new(),
            reading: Mutex::new(()),
        };
        for helper in 0..CHUNKS_IN_FLIGHT.min(chunks) {
            let shared = Arc::clone(&run.shared);
            let spawned = std::thread::Builder::new()
                .name("ssd-direct-read".into())
                .spawn(move || fetch(&shared, helper, chunks));
            // Every helper takes chunks of its own: all must run, or the run stalls
            // (dropping it stops those started).
            run.helpers.push(spawned.ok()?);
        }
        Some(run)
    }

    /// Reads item `index`'s record: the value into the start of `dest`, the header
    /// and key into the returned read (unchecked, as [`ReadPlan::read_unchecked`]
    /// answers). `None` when the run cannot serve it: read it the usual way. Items
    /// are served going forward; one asked for again or behind the last served,
    /// or while another thread reads, is answered `None`.
    pub fn read_unchecked(&self, index: usize, dest: &mut [u8]) -> Option<UncheckedRead> {
        let (offset, head_len, value_len) = (*self.records.get(index)?)?;
        let value = dest.get_mut(..usize::try_from(value_len).ok()?)?;
        let _reading = self.reading.try_lock()?;
        let mut head = vec![0u8; head_len];
        let at = offset.checked_sub(self.shared.base)?;
        self.copy_out(at, &mut head)?;
        self.copy_out(at.checked_add(head_len as u64)?, value)?;
        Some(UncheckedRead::from_head(head))
    }

    /// Copies the run's bytes from `at` (relative to its base) into `out`, chunk by
    /// chunk as each arrives.
    fn copy_out(&self, at: u64, out: &mut [u8]) -> Option<()> {
        let chunk_bytes = CHUNK_BYTES as u64;
        let mut done = 0usize;
        while done < out.len() {
            let position = at.checked_add(done as u64)?;
            let chunk = usize::try_from(position / chunk_bytes).ok()?;
            let within = usize::try_from(position % chunk_bytes).ok()?;
            let (slot, ready) = self.wait_for(chunk)?;
            let buffer = self.shared.buffers[slot].lock();
            let available = buffer.bytes().get(within..ready)?;
            let take = available.len().min(out.len() - done);
            if take == 0 {
                return None;
            }
            out[done..done + take].copy_from_slice(&available[..take]);
            done += take;
        }
        Some(())
    }

    /// Releases every chunk before `chunk` (the reader goes forward only, so it
    /// needs none of them again), then waits until `chunk` is read: its slot and
    /// the bytes in it (the slot is not reused before the reader moves past it), or
    /// `None` when it failed, was released already or a helper is gone.
    fn wait_for(&self, chunk: usize) -> Option<(usize, usize)> {
        let slot = chunk % SLOTS;
        let mut state = self.shared.state.lock();
        if state.release_before(chunk) {
            self.shared.changed.notify_all();
        }
        loop {
            if chunk < state.released || state.broken {
                return None;
            }
            match state.slots[slot] {
                Slot::Ready(ready, len) if ready == chunk => return Some((slot, len)),
                Slot::Failed(failed) if failed == chunk => return None,
                _ => self.shared.changed.wait(&mut state),
            }
        }
    }
}

impl Drop for DirectRun {
    fn drop(&mut self) {
        self.shared.state.lock().stop = true;
        self.shared.changed.notify_all();
        for helper in self.helpers.drain(..) {
            let _ = helper.join();
        }
        LIVE_RUNS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Marks the run broken when a helper ends by unwinding, so that the reader stops
/// waiting for its chunks.
struct HelperExit<'a>(&'a Shared);

impl Drop for HelperExit<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.state.lock().broken = true;
            self.0.changed.notify_all();
        }
    }
}

/// Helper `helper`'s loop: reads chunks `helper`, `helper + CHUNKS_IN_FLIGHT`, … of
/// `chunks`, each once its slot is free, until the last or until the run stops.
/// Chunks the reader has moved past are skipped.
fn fetch(shared: &Shared, helper: usize, chunks: usize) {
    let _exit = HelperExit(shared);
    for chunk in (helper..chunks).step_by(CHUNKS_IN_FLIGHT) {
        let slot = chunk % SLOTS;
        {
            let mut state = shared.state.lock();
            // The slot's previous chunk (`chunk - SLOTS`) must be released first.
            while !state.stop
                && chunk >= state.released
                && (chunk >= state.released + SLOTS || state.slots[slot] != Slot::Free)
            {
                shared.changed.wait(&mut state);
            }
            if state.stop {
                return;
            }
            if chunk < state.released {
                continue;
            }
            state.slots[slot] = Slot::Loading(chunk);
        }
        let outcome = read_chunk(shared, slot, chunk);
        let mut state = shared.state.lock();
        state.slots[slot] = match outcome {
            // Released while it was read: nobody will copy it out.
            _ if chunk < state.released => Slot::Free,
            Some(ready) => Slot::Ready(chunk, ready),
            None => Slot::Failed(chunk),
        };
        shared.changed.notify_all();
    }
}

/// Reads chunk `chunk` into slot `slot`'s buffer; the bytes read (fewer at the end of
/// the file), `None` on an error.
fn read_chunk(shared: &Shared, slot: usize, chunk: usize) -> Option<usize> {
    if crate::io::read_failure_injected() {
        return None;
    }
    let start = (chunk as u64).checked_mul(CHUNK_BYTES as u64)?;
    let want = usize::try_from(shared.len.checked_sub(start)?.min(CHUNK_BYTES as u64)).ok()?;
    let mut buffer = shared.buffers[slot].lock();
    let bytes = &mut buffer.bytes_mut()[..want];
    let mut filled = 0;
    while filled < want {
        match shared
            .file
            .read_at(&mut bytes[filled..], shared.base + start + filled as u64)
        {
            Ok(0) => break,
            // A short direct read leaves the rest unaligned: ask again only from an
            // aligned point (else the end of the file was reached).
            Ok(read) if (filled + read) % ALIGN != 0 => {
                filled += read;
                break;
            }
            Ok(read) => filled += read,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Some(filled)
}

/// Opens `path` for direct reads; `None` when the filesystem does not allow them.
fn open_direct(path: &Path) -> Option<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .ok()
}

/// True when the first byte of `extent` is in the page cache (or when that cannot be
/// told): a one-byte read that must not wait for the device
/// (`preadv2(RWF_NOWAIT)`) succeeds. (When it fails, the kernel may start reading
/// that page meanwhile: a few KiB.)
fn is_cached(extent: &FileExtent<'_>) -> bool {
    let Ok(offset) = libc::off_t::try_from(extent.offset) else {
        return true;
    };
    extent
        .with_file(|file| {
            let mut byte = [0u8; 1];
            let iov = libc::iovec {
                iov_base: byte.as_mut_ptr().cast(),
                iov_len: 1,
            };
            // SAFETY: one iovec over a live local buffer, for the length of the call.
            let read = unsafe {
                libc::preadv2(
                    file.as_raw_fd(),
                    &raw const iov,
                    1,
                    offset,
                    libc::RWF_NOWAIT,
                )
            };
            read >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock
        })
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsRawFd;
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;
    use crate::backend::StoreError;
    use crate::batch_reader::BatchReader;
    use crate::io::IoEngine;
    use crate::record::HEADER_LEN;
    use crate::record_writer::{Placement, write_records};
    use crate::test_dir::TempDir;

    const MIB: usize = 1 << 20;

    /// A record to write: its offset, key and value.
    struct Record {
        offset: u64,
        key: String,
        value: Vec<u8>,
    }

    /// Records of `sizes` back to back from offset 0, each `gap` bytes after the one
    /// before.
    fn records(sizes: &[usize], gap: u64) -> Vec<Record> {
        let mut offset = 0u64;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &size)| {
                let key = format!("key-{i}");
                let value = (0..size)
                    .map(|b| (b * 7 + i).to_le_bytes()[0])
                    .collect::<Vec<u8>>();
                let record = Record { offset, key, value };
                offset += (HEADER_LEN + record.key.len() + size) as u64 + gap;
                record
            })
            .collect()
    }

    /// Writes `records` to `name` in `dir`, synced, and drops its pages from the page
    /// cache unless `keep_cached`.
    fn write_file(dir: &TempDir, name: &str, records: &[Record], keep_cached: bool) -> PathBuf {
        let path = dir.0.join(name);
        let file = File::create(&path).expect("create");
        let placements: Vec<Placement<'_>> = records
            .iter()
            .map(|r| Placement {
                offset: r.offset,
                key: &r.key,
                value: &r.value,
            })
            .collect();
        let io = IoEngine::new(false);
        write_records(&io, &file, &placements).expect("write");
        file.sync_all().expect("sync");
        if keep_cached {
            // Large batches are written directly, past the page cache: read it in.
            std::fs::read(&path).expect("read back");
        } else {
            // SAFETY: a plain system call on an open descriptor.
            unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
        path
    }

    fn plans(path: &Path, records: &[Record]) -> Vec<ReadPlan> {
        let io = Arc::new(IoEngine::new(false));
        records
            .iter()
            .map(|r| {
                ReadPlan::in_file(
                    path.to_path_buf(),
                    r.offset,
                    &r.key,
                    r.value.len() as u64,
                    Arc::clone(&io),
                    None,
                )
            })
            .collect()
    }

    /// Reads every plan in order through `reader` and checks it; the values or errors.
    /// A value must arrive intact from the read itself: the check would read a
    /// damaged one again the usual way and hide a fault of the stream.
    fn read_all(reader: &BatchReader<'_>, plans: &[ReadPlan]) -> Vec<Result<Vec<u8>, StoreError>> {
        plans
            .iter()
            .enumerate()
            .map(|(index, plan)| {
                let mut dest = vec![0u8; usize::try_from(plan.len()).expect("fits")];
                let read = reader.read_unchecked(index, plan, &mut dest)?;
                let as_read = dest.clone();
                plan.finish_read(read, &mut dest)?;
                assert!(as_read == dest, "item {index} arrived damaged");
                Ok(dest)
            })
            .collect()
    }

    fn direct_io_works_in(dir: &TempDir) -> bool {
        let probe = dir.0.join("probe");
        File::create(&probe).expect("create");
        open_direct(&probe).is_some()
    }

    #[test]
    fn cold_records_in_order_are_streamed_and_read_back_intact() {
        let dir = TempDir::new("direct-run-streamed");
        // Small and large records, one larger than all buffers together, records that
        // cross chunk boundaries, and gaps (up to the 1 MiB a run allows).
        let sizes = [1000, 3 * MIB / 2, 7 * MIB, 64 << 10, MIB, 5, 2 * MIB + 3];
        for gap in [0, 4096 + 17, 1 << 20] {
            let records = records(&sizes, gap);
            let path = write_file(&dir, &format!("gap-{gap}"), &records, false);
            let plans = plans(&path, &records);
            let reader = BatchReader::new(plans.iter().map(Some).collect());
            assert_eq!(reader.is_direct(), direct_io_works_in(&dir), "gap {gap}");
            for (read, record) in read_all(&reader, &plans).into_iter().zip(&records) {
                assert!(
                    read.as_ref().is_ok_and(|value| *value == record.value),
                    "{} (gap {gap}): {:?}",
                    record.key,
                    read.map(|value| value.len())
                );
            }
        }
    }

    #[test]
    fn cached_records_are_read_through_the_page_cache() {
        let dir = TempDir::new("direct-run-cached");
        let records = records(&[MIB; 6], 0);
        let path = write_file(&dir, "cached", &records, true);
        let plans = plans(&path, &records);
        let reader = BatchReader::new(plans.iter().map(Some).collect());
        assert!(!reader.is_direct());
        let reads = read_all(&reader, &plans);
        assert!(
            reads
                .iter()
                .zip(&records)
                .all(|(read, record)| read.as_ref().is_ok_and(|value| *value == record.value))
        );
    }

    #[test]
    fn small_scattered_or_single_record_batches_are_not_streamed() {
        let dir = TempDir::new("direct-run-not");
        let records = records(&[MIB; 6], 0);
        let path = write_file(&dir, "file", &records, false);
        let all = plans(&path, &records);
        let start = |plans: Vec<Option<&ReadPlan>>| DirectRun::start(&plans).is_some();
        // Under MIN_RUN_BYTES.
        assert!(!start(all[..3].iter().map(Some).collect()));
        // Out of order.
        assert!(!start(all.iter().rev().map(Some).collect()));
        // One record.
        assert!(!start(vec![Some(&all[0])]));
        // Items without a plan do not break a run.
        if direct_io_works_in(&dir) {
            let mut with_holes: Vec<Option<&ReadPlan>> = all.iter().map(Some).collect();
            with_holes.insert(2, None);
            assert!(start(with_holes));
        }
    }

    #[test]
    fn a_record_cut_short_by_the_end_of_the_file_fails_the_others_are_read() {
        let dir = TempDir::new("direct-run-torn");
        let records = records(&[MIB; 6], 0);
        let path = write_file(&dir, "torn", &records, false);
        let cut = records[5].offset + 1000;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|file| file.set_len(cut))
            .expect("truncate");
        let plans = plans(&path, &records);
        let reader = BatchReader::new(plans.iter().map(Some).collect());
        let reads = read_all(&reader, &plans);
        for (read, record) in reads[..5].iter().zip(&records) {
            assert!(read.as_ref().is_ok_and(|value| *value == record.value));
        }
        assert!(reads[5].is_err(), "{:?}", reads[5].as_ref().map(Vec::len));
    }

    #[test]
    fn records_skipped_or_past_the_end_never_hold_the_stream_up() {
        let dir = TempDir::new("direct-run-skipped");
        // Item 1 (7 MiB, more than all buffers) gets a destination too small: the
        // stream skips it and serves the items after it.
        let records = records(&[MIB, 7 * MIB, MIB, MIB, 3 * MIB], 0);
        let path = write_file(&dir, "skipped", &records, false);
        let plans = plans(&path, &records);
        let reader = BatchReader::new(plans.iter().map(Some).collect());
        for (index, (plan, record)) in plans.iter().zip(&records).enumerate() {
            let short = index == 1;
            let mut dest = vec![0u8; record.value.len() - usize::from(short)];
            let read = reader
                .read_unchecked(index, plan, &mut dest)
                .and_then(|read| plan.finish_read(read, &mut dest));
            if short {
                assert!(matches!(read, Err(StoreError::BufferTooSmall { .. })));
            } else {
                assert!(read.is_ok() && dest == record.value, "item {index}");
            }
        }
        // A file cut short after 2 MiB under a run of 24 MiB: every chunk past the
        // end comes back empty; each record there fails the usual way, none hangs.
        let cut_records = self::records(&[MIB; 24], 0);
        let path = write_file(&dir, "cut", &cut_records, false);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .and_then(|file| file.set_len(2 * MIB as u64))
            .expect("truncate");
        let cut_plans = self::plans(&path, &cut_records);
        let reader = BatchReader::new(cut_plans.iter().map(Some).collect());
        let reads = read_all(&reader, &cut_plans);
        assert!(reads[0].is_ok());
        assert!(reads[2..].iter().all(Result::is_err));
    }

    #[test]
    fn a_run_dropped_part_way_stops_its_helpers() {
        let dir = TempDir::new("direct-run-dropped");
        let records = records(&[MIB; 24], 0);
        let path = write_file(&dir, "file", &records, false);
        let plans = plans(&path, &records);
        let refs: Vec<Option<&ReadPlan>> = plans.iter().map(Some).collect();
        let Some(run) = DirectRun::start(&refs) else {
            assert!(!direct_io_works_in(&dir));
            return;
        };
        let mut dest = vec![0u8; MIB];
        assert!(run.read_unchecked(0, &mut dest).is_some());
        // Asking for an earlier record again: released, not served.
        assert!(run.read_unchecked(0, &mut dest).is_none());
        drop(run);
    }
}
