//! Writing a batch's records to the device with direct writes.
//!
//! A batch of at least [`MIN_DIRECT_BYTES`] is laid out run by run (records that follow
//! each other in the file within [`MAX_PAD`] bytes, the gaps written as zeros, as the
//! gathered windows of [`crate::record_writer`] do): each run's whole 4 KiB blocks are
//! copied (headers, keys, values) into aligned buffers of [`CHUNK_BYTES`] and written
//! with `O_DIRECT`, [`WRITES_IN_FLIGHT`] at once on helper threads, while the next
//! buffer is filled; the run's partial first and last blocks, if any, are written
//! through the page cache. This is one copy, as a write through the page cache makes,
//! but the device gets large writes queued several deep instead of the page cache's
//! write-back (which stalled here: buffered 1 MiB writes of 512 MiB measured
//! 0.75-0.80 GB/s with fio on the test machine, direct ones at depth 4 1.5-1.8).
//! The caller syncs the file afterwards, as for any write (`fdatasync` makes the
//! blocks' allocation durable).
//!
//! The file is reopened for direct writes through `/proc/self/fd`; where that or
//! `O_DIRECT` is refused, [`write_records`] answers `None` and the caller writes the
//! usual way.
//!
//! # Limits
//!
//! Per batch being written: [`WRITES_IN_FLIGHT`] helper threads and
//! `WRITES_IN_FLIGHT + 1` buffers of [`CHUNK_BYTES`] (10 MiB), released when the batch
//! is written.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::sync::mpsc;

use parking_lot::Mutex;

use crate::io::{ALIGN, AlignedBuffer, injected_write};
use crate::record::{self, HEADER_LEN, MAX_PAD, Placement};

/// Bytes of one direct write.
pub const CHUNK_BYTES: usize = 2 << 20;

/// Direct writes in flight at once (one helper thread each).
pub const WRITES_IN_FLIGHT: usize = 4;

/// Buffers of a batch: those being written and the one being filled.
const SLOTS: usize = WRITES_IN_FLIGHT + 1;

/// The smallest batch written directly: below it the helpers cost more than the
/// page cache's write-back loses.
pub const MIN_DIRECT_BYTES: u64 = 4 << 20;

/// Writes `records` (in any order; none may overlap another) as the module
/// documentation says; `None` when the batch is too small, records overlap, or the
/// file cannot be opened for direct writes (write it the usual way). Not synced.
pub fn write_records(file: &File, records: &[Placement<'_>]) -> Option<std::io::Result<()>> {
    let total: u64 = records.iter().map(|r| r.end() - r.offset).sum();
    if total < MIN_DIRECT_BYTES {
        return None;
    }
    let mut sorted = records.to_vec();
    sorted.sort_unstable_by_key(|record| record.offset);
    if sorted.windows(2).any(|pair| pair[1].offset < pair[0].end()) {
        return None;
    }
    let direct = open_direct(file)?;
    let buffers = (0..SLOTS)
        .map(|_| AlignedBuffer::new(CHUNK_BYTES).map(Mutex::new))
        .collect::<Option<Vec<_>>>()?;
    let writer = Writer {
        file,
        direct: &direct,
        buffers: &buffers,
    };
    Some(runs(&sorted).try_for_each(|run| writer.write_run(run)))
}

/// The runs of `sorted`: records that follow each other within [`MAX_PAD`] bytes.
fn runs<'s, 'a>(sorted: &'s [Placement<'a>]) -> impl Iterator<Item = &'s [Placement<'a>]> {
    sorted.chunk_by(|previous, next| next.offset - previous.end() < MAX_PAD as u64)
}

/// Reopens `file` for writing with `O_DIRECT` (a new open file description, so the
/// caller's descriptor keeps writing through the page cache).
fn open_direct(file: &File) -> Option<File> {
    std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DIRECT)
        .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
        .ok()
}

/// What writing one batch uses.
struct Writer<'w> {
    file: &'w File,
    direct: &'w File,
    buffers: &'w [Mutex<AlignedBuffer>],
}

impl Writer<'_> {
    /// Writes one run: its whole blocks directly, its partial first and last blocks
    /// through the page cache.
    fn write_run(&self, run: &[Placement<'_>]) -> std::io::Result<()> {
        let (Some(first), Some(last)) = (run.first(), run.last()) else {
            return Ok(());
        };
        let (start, end) = (first.offset, last.end());
        let align = ALIGN as u64;
        let direct_start = start.next_multiple_of(align).min(end);
        let direct_end = (end / align * align).max(direct_start);
        let mut bytes = RunBytes::new(run);
        self.write_buffered(&mut bytes, start, direct_start)?;
        self.write_direct(&mut bytes, direct_start, direct_end)?;
        self.write_buffered(&mut bytes, direct_end, end)
    }

    /// Writes the run's bytes from `from` to `to` through the caller's descriptor.
    fn write_buffered(
        &self,
        bytes: &mut RunBytes<'_, '_>,
        from: u64,
        to: u64,
    ) -> std::io::Result<()> {
        let len = usize::try_from(to - from).map_err(std::io::Error::other)?;
        if len == 0 {
            return Ok(());
        }
        let mut buffer = vec![0u8; len];
        bytes.fill(&mut buffer);
        if let Some(error) = injected_write(self.file, &buffer, from) {
            return Err(error);
        }
        self.file.write_all_at(&buffer, from)
    }

    /// Writes the run's bytes from `from` to `to` (both aligned) directly, chunk by
    /// chunk, [`WRITES_IN_FLIGHT`] chunks at once on helper threads while the caller
    /// fills the next; the first error stops the filling, and every write under way
    /// ends before this returns.
    fn write_direct(
        &self,
        bytes: &mut RunBytes<'_, '_>,
        from: u64,
        to: u64,
    ) -> std::io::Result<()> {
        if from >= to {
            return Ok(());
        }
        let failure: Mutex<Option<std::io::Error>> = Mutex::new(None);
        let failed = || failure.lock().is_some();
        let (jobs, queue) = mpsc::sync_channel::<(usize, u64, usize)>(SLOTS);
        let queue = Mutex::new(queue);
        let (freed, free) = mpsc::channel::<usize>();
        std::thread::scope(|scope| {
            for slot in 0..SLOTS {
                let _ = freed.send(slot);
            }
            let mut helpers = 0;
            for _ in 0..WRITES_IN_FLIGHT {
                let (queue, freed, failure) = (&queue, freed.clone(), &failure);
                let spawned = std::thread::Builder::new()
                    .name("ssd-direct-write".into())
                    .spawn_scoped(scope, move || self.drain(queue, &freed, failure));
                helpers += usize::from(spawned.is_ok());
            }
            drop(freed);
            if helpers == 0 {
                *failure.lock() = Some(std::io::Error::other("cannot start a direct-write thread"));
            }
            let mut at = from;
            while at < to && !failed() {
                let Ok(slot) = free.recv() else { break };
                let len = usize::try_from((to - at).min(CHUNK_BYTES as u64)).unwrap_or(CHUNK_BYTES);
                {
                    let mut buffer = self.buffers[slot].lock();
                    bytes.fill(&mut buffer.bytes_mut()[..len]);
                }
                if jobs.send((slot, at, len)).is_err() {
                    break;
                }
                at += len as u64;
            }
            drop(jobs);
            if at < to && !failed() {
                *failure.lock() = Some(std::io::Error::other("the direct-write threads stopped"));
            }
        });
        failure.into_inner().map_or(Ok(()), Err)
    }

    /// A helper's loop: writes each queued chunk (unless a write failed already) and
    /// hands its buffer back, until the queue closes.
    fn drain(
        &self,
        queue: &Mutex<mpsc::Receiver<(usize, u64, usize)>>,
        freed: &mpsc::Sender<usize>,
        failure: &Mutex<Option<std::io::Error>>,
    ) {
        loop {
            let job = queue.lock().recv();
            let Ok((slot, offset, len)) = job else { return };
            let failed = failure.lock().is_some();
            if !failed {
                let buffer = self.buffers[slot].lock();
                if let Err(error) = self.write_chunk(&buffer.bytes()[..len], offset) {
                    failure.lock().get_or_insert(error);
                }
            }
            let _ = freed.send(slot);
        }
    }

    /// Writes one aligned chunk directly; a short write's rest goes through the page
    /// cache (it may no longer be aligned).
    fn write_chunk(&self, chunk: &[u8], offset: u64) -> std::io::Result<()> {
        if let Some(error) = injected_write(self.file, chunk, offset) {
            return Err(error);
        }
        let mut done = 0;
        while done < chunk.len() {
            match self.direct.write_at(&chunk[done..], offset + done as u64) {
                Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
                Ok(written) if (done + written) % ALIGN != 0 => {
                    done += written;
                    return self.file.write_all_at(&chunk[done..], offset + done as u64);
                }
                Ok(written) => done += written,
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }
}

/// The bytes of one run of records in file order, handed out front to back: before
/// each record the zeros of the gap since the one before, then its header (computed
/// when reached), key and value.
struct RunBytes<'r, 'a> {
    run: &'r [Placement<'a>],
    /// The record being handed out.
    index: usize,
    /// Bytes of it (from the end of the record before, gap included) handed out.
    done: u64,
    /// The current record's header, once computed.
    header: Option<[u8; HEADER_LEN]>,
}

impl<'r, 'a> RunBytes<'r, 'a> {
    fn new(run: &'r [Placement<'a>]) -> Self {
        RunBytes {
            run,
            index: 0,
            done: 0,
            header: None,
        }
    }

    /// Fills `out` with the next bytes of the run (zeros past its end).
    fn fill(&mut self, out: &mut [u8]) {
        let mut filled = 0;
        while filled < out.len() {
            let Some(piece) = self.piece() else {
                out[filled..].fill(0);
                return;
            };
            let take = piece.len().min(out.len() - filled);
            if take == 0 {
                // Nothing left of this record (never reached: records are never empty).
                self.advance_record();
                continue;
            }
            match piece {
                Piece::Zeros(_) => out[filled..filled + take].fill(0),
                Piece::Bytes(bytes) => out[filled..filled + take].copy_from_slice(&bytes[..take]),
            }
            filled += take;
            self.advance(take as u64);
        }
    }

    /// What comes next: the rest of the gap, header, key or value of the current
    /// record; `None` past the run's end.
    fn piece(&mut self) -> Option<Piece<'_>> {
        let record = self.run.get(self.index)?;
        let gap = self.gap_before(record);
        let mut at = self.done;
        if at < gap {
            return Some(Piece::Zeros(
                usize::try_from(gap - at).unwrap_or(usize::MAX),
            ));
        }
        at -= gap;
        let at = usize::try_from(at).unwrap_or(usize::MAX);
        if at < HEADER_LEN {
            let header = self
                .header
                .get_or_insert_with(|| record::header(record.key.as_bytes(), record.value));
            return Some(Piece::Bytes(&header[at..]));
        }
        let at = at - HEADER_LEN;
        let key = record.key.as_bytes();
        if at < key.len() {
            return Some(Piece::Bytes(&key[at..]));
        }
        record.value.get(at - key.len()..).map(Piece::Bytes)
    }

    /// Moves `len` bytes on, to the next record at the end of one.
    fn advance(&mut self, len: u64) {
        self.done += len;
        let Some(record) = self.run.get(self.index) else {
            return;
        };
        let gap = self.gap_before(record);
        if self.done >= gap + (record.end() - record.offset) {
            self.advance_record();
        }
    }

    /// Bytes between the end of the record before the current one and `record` (the
    /// current one): zeros to hand out first.
    fn gap_before(&self, record: &Placement<'_>) -> u64 {
        self.index
            .checked_sub(1)
            .and_then(|previous| self.run.get(previous))
            .map_or(0, |previous| record.offset - previous.end())
    }

    /// Moves on to the next record.
    fn advance_record(&mut self) {
        self.index += 1;
        self.done = 0;
        self.header = None;
    }
}

/// A stretch of a run's bytes.
enum Piece<'p> {
    /// This many zeros.
    Zeros(usize),
    /// These bytes.
    Bytes(&'p [u8]),
}

impl Piece<'_> {
    fn len(&self) -> usize {
        match self {
            Piece::Zeros(len) => *len,
            Piece::Bytes(bytes) => bytes.len(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::IoEngine;
    use crate::test_dir::TempDir;

    const MIB: usize = 1 << 20;

    fn value(len: usize, seed: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 31 + seed).to_le_bytes()[0]).collect()
    }

    /// A file of `len` bytes of 0xEE (what other records' bytes stand for).
    fn filled_file(dir: &TempDir, name: &str, len: usize) -> File {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(dir.0.join(name))
            .expect("create");
        file.write_all_at(&vec![0xEE; len], 0).expect("fill");
        file
    }

    fn contents(file: &File) -> Vec<u8> {
        let len = usize::try_from(file.metadata().expect("stat").len()).expect("fits");
        let mut bytes = vec![0u8; len];
        file.read_exact_at(&mut bytes, 0).expect("read");
        bytes
    }

    /// What a file of `len` bytes of 0xEE holds after `records` are written: each
    /// record's header, key and value where placed, zeros in gaps under
    /// [`MAX_PAD`] between records, the rest untouched.
    fn expected(len: usize, records: &[Placement<'_>]) -> Vec<u8> {
        let mut bytes = vec![0xEE; len];
        let mut sorted = records.to_vec();
        sorted.sort_unstable_by_key(|record| record.offset);
        let at = |offset: u64| usize::try_from(offset).expect("fits");
        for pair in sorted.windows(2) {
            if pair[1].offset - pair[0].end() < MAX_PAD as u64 {
                bytes[at(pair[0].end())..at(pair[1].offset)].fill(0);
            }
        }
        for record in &sorted {
            let mut whole = record::header(record.key.as_bytes(), record.value).to_vec();
            whole.extend_from_slice(record.key.as_bytes());
            whole.extend_from_slice(record.value);
            bytes[at(record.offset)..at(record.end())].copy_from_slice(&whole);
        }
        bytes
    }

    #[test]
    fn direct_writes_lay_records_out_as_the_page_cache_path_and_leave_gaps_alone() {
        let dir = TempDir::new("direct-write");
        // Runs starting on and off block boundaries, records of every size around a
        // chunk, gaps under MAX_PAD (zeros) and over it (other records' bytes, kept).
        let sizes = [
            100,
            3 * MIB + 5,
            64 << 10,
            2 * MIB,
            1,
            5 * MIB - 7,
            4000,
            MIB,
        ];
        let gaps = [0u64, 0, 17, 4095, 4096, 100_000, 1, 8191];
        let values: Vec<Vec<u8>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| value(n, i))
            .collect();
        let keys: Vec<String> = (0..sizes.len()).map(|i| format!("key-{i}")).collect();
        let mut offset = 4096 * 3 + 123;
        let mut records = Vec::new();
        for ((key, value), gap) in keys.iter().zip(&values).zip(gaps) {
            offset += gap;
            let record = Placement { offset, key, value };
            offset = record.end();
            records.push(record);
        }
        let len = usize::try_from(offset).expect("fits") + 10_000;
        let direct = filled_file(&dir, "direct", len);
        assert!(write_records(&direct, &records).is_some_and(|written| written.is_ok()));
        let (got, want) = (contents(&direct), expected(len, &records));
        assert_eq!(got.len(), want.len());
        let difference = got.iter().zip(&want).position(|(a, b)| a != b);
        assert!(difference.is_none(), "first difference at {difference:?}");
        // Each record reads back whole and checked.
        for record in &records {
            let plan = crate::backend::ReadPlan::in_file(
                dir.0.join("direct"),
                record.offset,
                record.key,
                record.value.len() as u64,
                std::sync::Arc::new(IoEngine::new(false)),
                None,
            );
            let mut dest = vec![0u8; record.value.len()];
            assert_eq!(
                plan.read_into(&mut dest).ok(),
                Some(record.value.len() as u64)
            );
            assert!(dest == record.value);
        }
    }

    #[test]
    fn small_or_overlapping_batches_are_left_to_the_page_cache_path() {
        let dir = TempDir::new("direct-write-not");
        let file = filled_file(&dir, "file", 0);
        let small = value(MIB, 1);
        let records = [Placement {
            offset: 0,
            key: "k",
            value: &small,
        }];
        assert!(write_records(&file, &records).is_none());
        let big = value(5 * MIB, 2);
        let overlapping = [
            Placement {
                offset: 0,
                key: "a",
                value: &big,
            },
            Placement {
                offset: 4096,
                key: "b",
                value: &big,
            },
        ];
        assert!(write_records(&file, &overlapping).is_none());
    }

    #[test]
    fn a_new_file_grows_to_its_last_record_exactly() {
        let dir = TempDir::new("direct-write-new");
        let file = filled_file(&dir, "file", 0);
        let values: Vec<Vec<u8>> = (0..5).map(|i| value(MIB + 333, i)).collect();
        let keys: Vec<String> = (0..5).map(|i| format!("k{i}")).collect();
        let mut offset = 0;
        let records: Vec<Placement<'_>> = keys
            .iter()
            .zip(&values)
            .map(|(key, value)| {
                let record = Placement { offset, key, value };
                offset = record.end();
                record
            })
            .collect();
        assert!(write_records(&file, &records).is_some_and(|written| written.is_ok()));
        assert_eq!(file.metadata().expect("stat").len(), offset);
    }
}
