//! A segment kept in a file (`--segment_path`, on tmpfs such as `/dev/shm` or on
//! hugetlbfs), with a journal of the objects committed in it, so that a real client
//! restarted after a crash finds its objects again.
//!
//! The file outlives the process (a memfd dies with it). Layout, every part aligned to
//! the file's page size:
//!
//! | part | bytes |
//! |---|---|
//! | the segment | `--global_segment_size`, rounded up to a page |
//! | header | one page: magic, version, sizes, the file's generation, the active epoch |
//! | journal, two halves | each max(4 MiB, segment / 256) ([`journal`]) |
//!
//! While the process runs, the embedded master tells the [`SegmentJournal`] of every
//! object change ([`mooncake_master::ObjectObserver`]): a commit in this segment is
//! recorded with the CRC-32C of the value's bytes, and a removal or eviction is recorded
//! before the call that caused it returns. After a crash, [`recovery`] checks every
//! recorded object's bytes against its checksum and gives the whole ones back to the
//! new embedded master; a write in progress at the crash was never recorded, and bytes
//! that changed since their record are dropped, never served.
//!
//! The file is locked (`flock`) while a process uses it: a second `mooncake_client`
//! on the same path is refused.

pub mod journal;
pub mod recovery;

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::OwnedFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use mooncake_offload::checksum::crc32c;
use mooncake_shm::SharedMemory;
use nix::fcntl::{Flock, FlockArg};
use parking_lot::Mutex;

use journal::{Placement, Record};
pub use recovery::{Recovered, SegmentJournal, recover};

const MAGIC: &[u8; 8] = b"MCSEGF01";
const VERSION: u32 = 1;
/// Offset of the active epoch in the header (written alone, after the fields above
/// it are checked by their CRC).
const EPOCH_AT: usize = 56;
/// Smallest journal half.
const MIN_HALF: u64 = 4 << 20;

/// Why a segment file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SegmentFileError {
    /// Opening, sizing or mapping the file failed.
    #[error("segment file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// Another process holds the file.
    #[error(
        "segment file {path} is in use by another process (another mooncake_client with the same --segment_path?); stop it or choose another path"
    )]
    InUse {
        /// The file.
        path: PathBuf,
    },
    /// Mapping the segment failed.
    #[error("segment file {path}: {source}")]
    Map {
        /// The file.
        path: PathBuf,
        /// The mapping error.
        source: mooncake_shm::ShmError,
    },
}

/// The sizes of a segment file's parts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Layout {
    /// The file system's page size (huge on hugetlbfs).
    page: u64,
    /// Bytes of the segment.
    segment_len: u64,
    /// Bytes of each journal half.
    half_len: u64,
}

impl Layout {
    fn for_segment(segment_len: u64, page: u64) -> Option<Self> {
        let segment_len = segment_len.checked_next_multiple_of(page)?;
        let half_len = MIN_HALF
            .max(segment_len / 256)
            .checked_next_multiple_of(page)?;
        Some(Layout {
            page,
            segment_len,
            half_len,
        })
    }

    /// Bytes of header and journal after the segment.
    fn meta_len(&self) -> u64 {
        self.page + 2 * self.half_len
    }

    fn file_len(&self) -> u64 {
        self.segment_len + self.meta_len()
    }
}

/// The header's fixed fields as bytes (magic to generation, then their CRC).
fn header_bytes(layout: &Layout, generation: u128) -> [u8; 52] {
    let mut out = [0u8; 52];
    out[0..8].copy_from_slice(MAGIC);
    out[8..12].copy_from_slice(&VERSION.to_le_bytes());
    // The page size is at most 1 GiB.
    out[12..16].copy_from_slice(&u32::try_from(layout.page).unwrap_or(u32::MAX).to_le_bytes());
    out[16..24].copy_from_slice(&layout.segment_len.to_le_bytes());
    out[24..32].copy_from_slice(&layout.half_len.to_le_bytes());
    out[32..48].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32c(&out[..48]);
    out[48..52].copy_from_slice(&crc.to_le_bytes());
    out
}

/// What opening a segment file found in it.
#[derive(Debug)]
pub enum Found {
    /// A new or reset file: nothing to recover (`reason` says why an existing file's
    /// contents were dropped).
    Fresh {
        /// Why the contents were dropped, when there were any.
        reason: Option<String>,
    },
    /// The journal of an earlier process: the objects it recorded as committed, whose
    /// bytes [`recovery`] checks.
    Kept {
        /// Key → where its value lies.
        committed: HashMap<String, Placement>,
    },
}

/// The journal's writing side: the header and halves mapped, the objects committed now.
struct Journal {
    meta: MmapRaw,
    layout: Layout,
    epoch: u64,
    /// Where the next record goes in the active half.
    write_at: usize,
    live: HashMap<String, Placement>,
    /// Commits that did not fit in a half even after compaction (not recoverable).
    unrecorded: u64,
    /// Set once the file went to a successor process: nothing is written any more.
    handed_over: bool,
}

impl Journal {
    /// The journal of a file whose active half has epoch `epoch`, before its records
    /// are read.
    fn new(meta: MmapRaw, layout: Layout, epoch: u64) -> Self {
        Journal {
            meta,
            layout,
            epoch,
            write_at: 0,
            live: HashMap::new(),
            unrecorded: 0,
            handed_over: false,
        }
    }

    fn half_start(&self, epoch: u64) -> usize {
        let index = usize::from(epoch % 2 == 1);
        // Both values fit the mapping, which is in the address space.
        usize::try_from(self.layout.page + self.layout.half_len * index as u64).unwrap_or(0)
    }

    fn half_len(&self) -> usize {
        usize::try_from(self.layout.half_len).unwrap_or(0)
    }

    fn write(&self, at: usize, bytes: &[u8]) {
        debug_assert!(at + bytes.len() <= self.meta.len());
        // SAFETY: `at..at+len` lies inside the mapping (checked by the callers against
        // the half's bounds); this process alone writes the file, under the mutex.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.meta.as_mut_ptr().add(at),
                bytes.len(),
            );
        }
    }

    fn read(&self, at: usize, len: usize) -> &[u8] {
        // SAFETY: inside the mapping (callers pass the header or a half); only this
        // process writes it, under the mutex held by whoever reads.
        unsafe { std::slice::from_raw_parts(self.meta.as_ptr().add(at), len) }
    }

    fn store_epoch(&self, epoch: u64) {
        // SAFETY: the epoch is 8-byte aligned inside the header page; an aligned
        // 8-byte store is never seen torn.
        unsafe {
            let at = self.meta.as_mut_ptr().add(EPOCH_AT).cast::<u64>();
            std::ptr::write_volatile(at, epoch.to_le());
        }
    }

    /// Appends `record`, compacting into the other half when the active one is full.
    fn append(&mut self, record: Record) {
        if self.handed_over {
            return;
        }
        match &record {
            Record::Committed(key, placement) => {
                self.live.insert(key.clone(), *placement);
            }
            Record::Gone(key) => {
                if self.live.remove(key).is_none() {
                    return;
                }
            }
        }
        let Some(bytes) = journal::encode(&record, self.epoch) else {
            // Keys are far shorter than the format's 64 KiB.
            if let Record::Committed(key, _) = record {
                self.live.remove(&key);
                self.unrecorded += 1;
            }
            return;
        };
        if self.write_at + bytes.len() <= self.half_len() {
            self.write(self.half_start(self.epoch) + self.write_at, &bytes);
            self.write_at += bytes.len();
            return;
        }
        if !self.compact() {
            // Even the committed objects alone do not fit: this one is not kept.
            if let Record::Committed(key, _) = record {
                self.live.remove(&key);
                self.unrecorded += 1;
                if self.unrecorded == 1 {
                    tracing::warn!(
                        objects = self.live.len(),
                        "the segment file's journal is full: objects committed from now on are not found again after a restart (its size follows --global_segment_size; many small objects need more)"
                    );
                }
                self.compact();
            }
        }
    }

    /// Writes the objects committed now to the other half and makes it active; false
    /// (nothing changed) when they do not fit.
    fn compact(&mut self) -> bool {
        if journal::compacted_len(&self.live) > self.half_len() {
            return false;
        }
        let epoch = self.epoch + 1;
        let start = self.half_start(epoch);
        let mut at = 0;
        for (key, placement) in &self.live {
            if let Some(bytes) = journal::encode(&Record::Committed(key.clone(), *placement), epoch)
            {
                self.write(start + at, &bytes);
                at += bytes.len();
            }
        }
        if at + 8 <= self.half_len() {
            // A zero length ends the half, whatever an earlier epoch left after it.
            self.write(start + at, &[0u8; 8]);
        }
        self.store_epoch(epoch);
        self.epoch = epoch;
        self.write_at = at;
        true
    }
}

/// A segment in a file and the journal of its objects.
pub struct SegmentFile {
    path: PathBuf,
    memory: Arc<SharedMemory>,
    generation: u128,
    journal: Mutex<Journal>,
    /// Held while this process (or its successor after a handover) uses the file.
    lock: Mutex<Option<Flock<File>>>,
    /// What this process found in the file when it started.
    recovered: std::sync::OnceLock<Recovered>,
}

impl std::fmt::Debug for SegmentFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentFile")
            .field("path", &self.path)
            .field("generation", &self.generation)
            .finish_non_exhaustive()
    }
}

impl SegmentFile {
    /// Opens (or creates, mode 0600) the segment file at `path` for a segment of
    /// `segment_len` bytes, locks it, and reads its journal. A file made for another
    /// size or by another version is reset (its objects dropped, with the reason).
    pub fn open(path: &Path, segment_len: u64) -> Result<(Self, Found), SegmentFileError> {
        let io = |source| SegmentFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(nix::libc::O_CLOEXEC)
            .open(path)
            .map_err(io)?;
        Self::from_file(path, file, segment_len)
    }

    /// The segment file handed over by the process that used it before (its
    /// descriptor, the lock already held through it); its objects come with the
    /// handover, so the journal is only read to go on writing it.
    pub fn from_handed_over(
        path: &Path,
        fd: OwnedFd,
        segment_len: u64,
    ) -> Result<Self, SegmentFileError> {
        let (file, found) = Self::from_file(path, File::from(fd), segment_len)?;
        if let Found::Fresh {
            reason: Some(reason),
        } = found
        {
            tracing::warn!(path = %path.display(), reason, "the handed-over segment file was reset");
        }
        Ok(file)
    }

    fn from_file(
        path: &Path,
        file: File,
        segment_len: u64,
    ) -> Result<(Self, Found), SegmentFileError> {
        let io = |source| SegmentFileError::Io {
            path: path.to_path_buf(),
            source,
        };
        let lock = Flock::lock(
            file.try_clone().map_err(io)?,
            FlockArg::LockExclusiveNonblock,
        )
        .map_err(|_| SegmentFileError::InUse {
            path: path.to_path_buf(),
        })?;
        let metadata = file.metadata().map_err(io)?;
        let page = metadata.blksize().max(4096);
        let layout = Layout::for_segment(segment_len, page).ok_or_else(|| {
            io(std::io::Error::other(format!(
                "segment size {segment_len} is too large"
            )))
        })?;
        let existing = metadata.len();
        let meta_map = |file: &File| {
            MmapOptions::new()
                .offset(layout.segment_len)
                .len(usize::try_from(layout.meta_len()).unwrap_or(usize::MAX))
                .map_raw(file)
        };
        let mut reason = None;
        let mut kept = None;
        if existing == layout.file_len() {
            let meta = meta_map(&file).map_err(io)?;
            match read_header(&meta, &layout) {
                Ok((generation, epoch)) => kept = Some((meta, generation, epoch)),
                Err(why) => reason = Some(why),
            }
        } else if existing > 0 {
            reason = Some(format!(
                "the file holds {existing} bytes, not the {} of a {segment_len}-byte segment (was --global_segment_size changed?)",
                layout.file_len()
            ));
        }
        let (mut journal, generation, found) = match kept {
            Some((meta, generation, epoch)) => {
                let mut journal = Journal::new(meta, layout, epoch);
                let start = journal.half_start(epoch);
                let (committed, _) =
                    journal::replay(journal.read(start, journal.half_len()), epoch);
                // Start from a compact journal of exactly what was found (recovery
                // records what it drops).
                journal.live = committed.clone();
                (journal, generation, Found::Kept { committed })
            }
            None => {
                // Drop whatever was there (its pages too), then size and stamp it.
                file.set_len(0).map_err(io)?;
                file.set_len(layout.file_len()).map_err(io)?;
                let meta = meta_map(&file).map_err(io)?;
                let generation = mooncake_core::ids::random_id();
                write_header(&meta, &layout, generation);
                (
                    Journal::new(meta, layout, 0),
                    generation,
                    Found::Fresh { reason },
                )
            }
        };
        let memory = SharedMemory::map_file(file, layout.segment_len, false).map_err(|source| {
            SegmentFileError::Map {
                path: path.to_path_buf(),
                source,
            }
        })?;
        if !journal.compact() {
            journal.live.clear();
            journal.compact();
        }
        Ok((
            SegmentFile {
                path: path.to_path_buf(),
                memory: Arc::new(memory),
                generation,
                journal: Mutex::new(journal),
                lock: Mutex::new(Some(lock)),
                recovered: std::sync::OnceLock::new(),
            },
            found,
        ))
    }

    /// The segment's memory.
    pub fn memory(&self) -> &Arc<SharedMemory> {
        &self.memory
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Random id stamped when the file was created (or reset): the same value after a
    /// restart proves the same bytes.
    pub fn generation(&self) -> u128 {
        self.generation
    }

    /// What this process recovered from the file at its start (`None`: the file was new
    /// or reset, or it was handed over).
    pub fn recovered(&self) -> Option<Recovered> {
        self.recovered.get().copied()
    }

    /// Notes what recovery found (once).
    pub(crate) fn set_recovered(&self, recovered: Recovered) {
        let _ = self.recovered.set(recovered);
    }

    /// Objects committed now, as the journal knows them.
    pub fn journaled_objects(&self) -> usize {
        self.journal.lock().live.len()
    }

    /// Commits that did not fit in the journal (lost at a restart).
    pub fn unrecorded_commits(&self) -> u64 {
        self.journal.lock().unrecorded
    }

    /// Records that `key` is committed at `placement`, unless it already is.
    pub(crate) fn record_committed(&self, key: &str, placement: Placement) {
        let mut journal = self.journal.lock();
        if journal.live.get(key) == Some(&placement) {
            return;
        }
        journal.append(Record::Committed(key.to_string(), placement));
    }

    /// Whether `key` is recorded at `offset` with `size` bytes (then its checksum need
    /// not be computed again).
    pub(crate) fn is_recorded(&self, key: &str, offset: u64, size: u64) -> bool {
        self.journal
            .lock()
            .live
            .get(key)
            .is_some_and(|p| p.offset == offset && p.size == size)
    }

    /// Records that `key` is gone (nothing when it was not recorded).
    pub(crate) fn record_gone(&self, key: &str) {
        self.journal.lock().append(Record::Gone(key.to_string()));
    }

    /// Forgets every record (the objects are a remote master's to keep).
    pub(crate) fn clear_journal(&self) {
        let mut journal = self.journal.lock();
        journal.live.clear();
        journal.compact();
    }

    /// Stops writing the journal: a successor process is about to take the file over
    /// ([`crate::handover`]) and writes it from then on.
    pub fn pause_journal(&self) {
        self.journal.lock().handed_over = true;
    }

    /// Writes the journal again (the handover failed; this process serves on).
    pub fn resume_journal(&self) {
        self.journal.lock().handed_over = false;
    }

    /// The successor serves: its descriptor shares this one's lock, which must outlive
    /// this process (unlocking on drop would release it for the successor too).
    pub fn leave_lock_to_successor(&self) {
        if let Some(lock) = self.lock.lock().take() {
            // The descriptor closes when this process exits.
            std::mem::forget(lock);
        }
    }
}

fn write_header(meta: &MmapRaw, layout: &Layout, generation: u128) {
    let bytes = header_bytes(layout, generation);
    // SAFETY: the header page is inside the mapping, which is at least a page long;
    // no other process uses the file (locked).
    unsafe {
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), meta.as_mut_ptr(), bytes.len());
        std::ptr::write_volatile(meta.as_mut_ptr().add(EPOCH_AT).cast::<u64>(), 0);
    }
}

/// The generation and active epoch of a header written for `layout`, or why it is not
/// usable.
fn read_header(meta: &MmapRaw, layout: &Layout) -> Result<(u128, u64), String> {
    // SAFETY: the header page is inside the mapping; the file is locked.
    let header = unsafe { std::slice::from_raw_parts(meta.as_ptr(), 64) };
    if &header[0..8] != MAGIC {
        return Err("the file is not a segment file of this version (no header)".into());
    }
    let generation = u128::from_le_bytes(header[32..48].try_into().unwrap_or_default());
    if header[..52] != header_bytes(layout, generation)[..] {
        return Err("the header does not match this segment size or version, or is damaged".into());
    }
    let epoch = u64::from_le_bytes(
        header[EPOCH_AT..EPOCH_AT + 8]
            .try_into()
            .unwrap_or_default(),
    );
    Ok((generation, epoch))
}

#[cfg(test)]
mod tests;
