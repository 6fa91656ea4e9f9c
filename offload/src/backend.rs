//! The contract every SSD-tier storage backend meets, and what they share: errors,
//! recovery reports, limits, two-phase evictions and read plans.
//!
//! A backend keeps checksummed [records](crate::record) on disk and an in-memory index
//! of them, rebuilt from disk when it opens. Writes come in batches; before a batch the
//! caller asks [`make_room`](StorageBackend::make_room), which takes victims out of the
//! index and returns their keys, tells the master, and only then lets
//! [`finish_eviction`](StorageBackend::finish_eviction) delete their bytes. Reads look a
//! key up ([`locate`](StorageBackend::locate)) and read the bytes with the returned
//! [`ReadPlan`] without holding the backend: the plan keeps what it reads from being
//! reused (an open file of a deleted path stays readable; the one-file backend holds
//! the extent), and it checks the record's key and checksum, so a read racing an
//! eviction gets the right bytes or "not found", never other bytes.

use std::fs::File;
use std::io::IoSliceMut;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::EvictionPolicy;
use crate::io::IoEngine;
use crate::record::{self, HEADER_LEN, Header, MAX_KEY_LEN};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The key is not on disk (never written, removed, evicted, or found corrupt).
    #[error("object not on disk")]
    NotFound,
    /// The key is on disk already, or twice in one batch.
    #[error("object {0:?} is on disk already")]
    AlreadyExists(String),
    /// An empty batch, an empty or oversized key.
    #[error("invalid object: {0}")]
    Invalid(String),
    /// The destination is smaller than the value.
    #[error("destination of {have} bytes is smaller than the value of {need} bytes")]
    BufferTooSmall {
        /// Bytes needed.
        need: u64,
        /// Bytes given.
        have: u64,
    },
    /// The bytes on disk fail their checksum; the key was dropped from the index.
    #[error("object on disk is corrupt ({0})")]
    Corrupt(record::RecordError),
    /// The limits leave no room and the policy forbids eviction (or the batch alone
    /// exceeds them).
    #[error(
        "disk limits reached: {used} of {quota} bytes and {keys} of {keys_limit} keys used, {needed} bytes needed"
    )]
    QuotaExceeded {
        /// The byte quota.
        quota: u64,
        /// Bytes in use.
        used: u64,
        /// Bytes the write needs.
        needed: u64,
        /// Keys stored.
        keys: u64,
        /// The key limit.
        keys_limit: u64,
    },
    /// The backend or client named in the settings is not available in this build.
    #[error("{0} is not available in this build")]
    Unsupported(&'static str),
    /// A distributed KV store failed or could not be reached.
    #[error("distributed KV store: {0}")]
    Remote(String),
    /// The backend could not be set up (the message names the setting).
    #[error("{0}")]
    Setup(String),
    /// A file operation failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The error for a prepared batch handed to a backend that did not prepare it.
pub(crate) fn foreign_batch() -> StoreError {
    StoreError::Invalid("a batch prepared by another backend".into())
}

/// Maps an I/O error on `path` during `op` to a [`StoreError`].
pub(crate) fn io_error<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// What startup found on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Files of objects indexed (buckets; files; 1 for the one-file backend).
    pub buckets: u64,
    /// Objects indexed.
    pub objects: u64,
    /// Records left out: truncated, bit-flipped or unreadable.
    pub corrupt_records: u64,
    /// Files dropped whole (bad metadata, or no valid record left).
    pub dropped_buckets: u64,
    /// Leftovers of interrupted writes deleted.
    pub orphan_files: u64,
}

/// How much a backend may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes on disk.
    pub bytes: u64,
    /// Objects.
    pub keys: u64,
}

impl Limits {
    /// A byte quota and no key limit.
    pub fn bytes(bytes: u64) -> Self {
        Limits {
            bytes,
            keys: u64::MAX,
        }
    }
}

/// What a backend holds against its limits, and the checks every backend makes.
#[derive(Clone, Copy, Debug)]
pub struct Room {
    /// The limits.
    pub limits: Limits,
    /// Bytes in use.
    pub used: u64,
    /// Objects stored.
    pub keys: usize,
}

impl Room {
    /// Whether `bytes` more bytes and `keys` more objects fit.
    pub(crate) fn fits(&self, bytes: u64, keys: u64) -> bool {
        self.used.saturating_add(bytes) <= self.limits.bytes
            && (self.keys as u64).saturating_add(keys) <= self.limits.keys
    }

    /// Whether at most `bytes` bytes and `keys` objects are held.
    pub(crate) fn holds_at_most(&self, bytes: u64, keys: u64) -> bool {
        self.used <= bytes && self.keys as u64 <= keys
    }

    /// The error for a batch of `needed` bytes that does not fit.
    pub(crate) fn exceeded(&self, needed: u64) -> StoreError {
        StoreError::QuotaExceeded {
            quota: self.limits.bytes,
            used: self.used,
            needed,
            keys: self.keys as u64,
            keys_limit: self.limits.keys,
        }
    }

    /// The start of every `make_room`: `Ok(true)` when the batch fits now, `Ok(false)`
    /// when eviction has to make room, an error when eviction cannot (policy `none`,
    /// or the batch alone above the limits).
    pub(crate) fn before_eviction(
        &self,
        bytes: u64,
        keys: u64,
        policy: EvictionPolicy,
    ) -> Result<bool, StoreError> {
        if self.fits(bytes, keys) {
            Ok(true)
        } else if bytes > self.limits.bytes
            || keys > self.limits.keys
            || policy == EvictionPolicy::None
        {
            Err(self.exceeded(bytes))
        } else {
            Ok(false)
        }
    }
}

/// Victims taken out of the index by [`StorageBackend::make_room`], whose bytes
/// [`StorageBackend::finish_eviction`] deletes.
#[derive(Debug, Default)]
#[must_use = "the bytes are only deleted by finish_eviction"]
pub struct Eviction {
    /// Keys that are no longer on disk (tell the master before finishing).
    pub keys: Vec<String>,
    /// The victims, in the backend's own terms (bucket ids, file ids, extents).
    pub(crate) units: Vec<u64>,
}

impl Eviction {
    /// Number of victims (buckets, files or extents).
    pub fn units(&self) -> usize {
        self.units.len()
    }
}

/// The objects of a batch: keys and values.
pub type Objects<'a> = [(&'a str, &'a [u8])];

/// Writes a prepared batch's objects (given again to [`PreparedBatch::write`]).
type WriteFn = Box<dyn FnOnce(&Objects<'_>) -> Result<(), StoreError> + Send>;

/// A batch checked and given its place by [`StorageBackend::prepare_batch`]. Its bytes
/// are written by [`write`](Self::write), from the objects themselves (no copy is
/// made in between) and without holding the backend (reads go on meanwhile); then
/// [`StorageBackend::commit_batch`] indexes it, or undoes the reservation when the
/// write failed.
#[must_use = "a prepared batch holds reserved space until committed"]
pub struct PreparedBatch {
    write: Option<WriteFn>,
    /// Key and value lengths of the objects prepared, which `write` must be given.
    shape: Vec<(usize, usize)>,
    /// What the backend needs to index the batch (its own type).
    pub(crate) state: Box<dyn std::any::Any + Send>,
}

impl std::fmt::Debug for PreparedBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedBatch")
            .field("objects", &self.shape.len())
            .field("written", &self.write.is_none())
            .finish_non_exhaustive()
    }
}

impl PreparedBatch {
    /// A batch of `objects` whose bytes `write` writes, indexed later from `state`.
    pub(crate) fn new(
        objects: &Objects<'_>,
        write: impl FnOnce(&Objects<'_>) -> Result<(), StoreError> + Send + 'static,
        state: impl std::any::Any + Send,
    ) -> Self {
        PreparedBatch {
            write: Some(Box::new(write)),
            shape: objects.iter().map(|(k, v)| (k.len(), v.len())).collect(),
            state: Box::new(state),
        }
    }

    /// Phase two: writes and syncs the batch's bytes, read from `objects`, which must
    /// be the objects the batch was prepared for (their keys and values may be
    /// borrowed from anywhere, shared memory included). Once; later calls do
    /// nothing. Objects of other lengths than those prepared are refused.
    pub fn write(&mut self, objects: &Objects<'_>) -> Result<(), StoreError> {
        let same = objects.len() == self.shape.len()
            && objects
                .iter()
                .zip(&self.shape)
                .all(|((k, v), shape)| (k.len(), v.len()) == *shape);
        if !same {
            return Err(StoreError::Invalid(
                "a prepared batch written with other objects than it was prepared for".into(),
            ));
        }
        self.write.take().map_or(Ok(()), |write| write(objects))
    }

    /// The backend's state, when it is of type `T`.
    pub(crate) fn into_state<T: 'static>(self) -> Option<T> {
        self.state.downcast::<T>().ok().map(|state| *state)
    }
}

/// Largest gap between two records that still counts as one following the other
/// ([`ReadPlan::follows`]): within the kernel's read-ahead window.
pub const FOLLOWS_WITHIN: u64 = 1 << 20;

/// How to read one object, obtained from [`StorageBackend::locate`] and used without
/// holding the backend.
#[derive(Clone, Debug)]
pub struct ReadPlan {
    key: String,
    value_len: u64,
    source: Source,
}

/// Where a read plan's record is.
#[derive(Clone, Debug)]
enum Source {
    /// At `offset` of the file at `path`.
    File {
        path: PathBuf,
        offset: u64,
        io: Arc<IoEngine>,
        /// Keeps the one-file backend from reusing the extent while the plan lives.
        #[expect(dead_code, reason = "held for its reference count, never read")]
        pin: Option<Arc<()>>,
        /// The file, already open (else it is opened by path for the read).
        open: Option<Arc<File>>,
    },
    /// Under `store_key` in a store outside this machine (see [`RecordSource`]).
    Store {
        source: Arc<dyn RecordSource>,
        store_key: Vec<u8>,
    },
}

/// True when each of `plans` follows the one before it in the same file (see
/// [`ReadPlan::follows`]): reading them in turn is a sequential read.
pub fn lie_in_order(plans: &[&ReadPlan]) -> bool {
    plans.windows(2).all(|pair| pair[1].follows(pair[0]))
}

/// Where a [`ReadPlan`]'s record lies in a file ([`ReadPlan::file_extent`]), or a run
/// of records that follow each other in one.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FileExtent<'p> {
    /// The file's path.
    pub(crate) path: &'p Path,
    /// The file, when the plan holds it open.
    pub(crate) open: Option<&'p File>,
    /// Where the record starts in the file.
    pub(crate) offset: u64,
    /// Bytes from there.
    pub(crate) len: u64,
}

impl FileExtent<'_> {
    /// Runs `use_file` on the extent's file: the one its plan holds open, else opened
    /// by path for the call; `None` when it cannot be opened.
    pub(crate) fn with_file<R>(&self, use_file: impl FnOnce(&File) -> R) -> Option<R> {
        match self.open {
            Some(file) => Some(use_file(file)),
            None => File::open(self.path).ok().map(|file| use_file(&file)),
        }
    }
}

/// What [`ReadPlan::read_unchecked`] read besides the value, for
/// [`ReadPlan::finish_read`] to check: made only by `read_unchecked`.
#[derive(Debug)]
#[must_use = "the value read is unchecked until `finish_read` has checked it"]
pub struct UncheckedRead(Unchecked);

/// What an [`UncheckedRead`] holds.
#[derive(Debug)]
enum Unchecked {
    /// The record's header and key, read from a file: not checked yet.
    Head(Vec<u8>),
    /// A record from a store outside this machine, already checked: the value's
    /// length.
    Checked(u64),
}

impl UncheckedRead {
    /// A record's header and key read beside its value by another reader than
    /// [`ReadPlan::read_unchecked`] (see [`crate::direct_run`]).
    pub(crate) fn from_head(head: Vec<u8>) -> Self {
        UncheckedRead(Unchecked::Head(head))
    }
}

impl ReadPlan {
    /// The record of `key` (value of `value_len` bytes) at `offset` of `path`; `pin`
    /// keeps its space from being reused while the plan lives.
    pub(crate) fn in_file(
        path: PathBuf,
        offset: u64,
        key: &str,
        value_len: u64,
        io: Arc<IoEngine>,
        pin: Option<Arc<()>>,
    ) -> Self {
        ReadPlan {
            key: key.to_string(),
            value_len,
            source: Source::File {
                path,
                offset,
                io,
                pin,
                open: None,
            },
        }
    }

    /// The same plan reading through `file`, the record's file already open (no
    /// `open` per read).
    pub(crate) fn through(mut self, file: Arc<File>) -> Self {
        if let Source::File { open, .. } = &mut self.source {
            *open = Some(file);
        }
        self
    }

    /// The record of `key` stored under `store_key` in `source`.
    pub(crate) fn in_store(
        source: Arc<dyn RecordSource>,
        store_key: Vec<u8>,
        key: &str,
        value_len: u64,
    ) -> Self {
        ReadPlan {
            key: key.to_string(),
            value_len,
            source: Source::Store { source, store_key },
        }
    }

    /// Size of the value.
    pub fn len(&self) -> u64 {
        self.value_len
    }

    /// True when this record lies in the same file as `previous`, starting where it
    /// ends or at most [`FOLLOWS_WITHIN`] bytes further: reading the two in order is a
    /// sequential read, which the page cache's read-ahead serves.
    pub fn follows(&self, previous: &ReadPlan) -> bool {
        self.gap_after(previous)
            .is_some_and(|gap| gap <= FOLLOWS_WITHIN)
    }

    /// Bytes between the end of `previous`'s record and the start of this one, when
    /// both lie in the same file and this one starts at or after that end.
    fn gap_after(&self, previous: &ReadPlan) -> Option<u64> {
        let (
            Source::File { path, offset, .. },
            Source::File {
                path: previous_path,
                offset: previous_offset,
                ..
            },
        ) = (&self.source, &previous.source)
        else {
            return None;
        };
        let previous_end = previous_offset.saturating_add(previous.record_len());
        (path == previous_path).then(|| offset.checked_sub(previous_end))?
    }

    /// Where the record lies: its file's path (and the file, when the plan holds it
    /// open), its offset and whole length; `None` for a record outside this machine
    /// (for hinting reads ahead, see [`crate::read_ahead`]).
    pub(crate) fn file_extent(&self) -> Option<FileExtent<'_>> {
        match &self.source {
            Source::File {
                path, offset, open, ..
            } => Some(FileExtent {
                path,
                open: open.as_deref(),
                offset: *offset,
                len: self.record_len(),
            }),
            Source::Store { .. } => None,
        }
    }

    /// Length of the whole record: header, key and value.
    fn record_len(&self) -> u64 {
        ((HEADER_LEN + self.key.len()) as u64).saturating_add(self.value_len)
    }

    /// True for an empty value (never stored: values are at least one byte).
    pub fn is_empty(&self) -> bool {
        self.value_len == 0
    }

    /// Reads the value into the start of `dest` and checks the record's key and
    /// checksum; returns the value's length. The header and key go to a small buffer
    /// and the value straight into `dest`, in one read.
    pub fn read_into(&self, dest: &mut [u8]) -> Result<u64, StoreError> {
        let read = self.read_unchecked(dest)?;
        self.finish_read(read, dest)
    }

    /// The first half of [`read_into`](Self::read_into): reads the value into the
    /// start of `dest` and the header and key beside it, without checking them. The
    /// read is worth nothing until [`finish_read`](Self::finish_read) has checked it
    /// (possibly on another thread, while this one reads the next record).
    pub fn read_unchecked(&self, dest: &mut [u8]) -> Result<UncheckedRead, StoreError> {
        let value = self.value_in(dest)?;
        if let Source::Store { source, store_key } = &self.source {
            return self
                .read_from_store(source.as_ref(), store_key, value)
                .map(|len| UncheckedRead(Unchecked::Checked(len)));
        }
        self.with_file(|file, path, offset, io| {
            let mut head = vec![0u8; HEADER_LEN + self.key.len()];
            let mut parts = [IoSliceMut::new(&mut head), IoSliceMut::new(value)];
            io.read_gathered(file, &mut parts, offset)
                .map_err(|error| read_failed(path, error))?;
            Ok(UncheckedRead(Unchecked::Head(head)))
        })
    }

    /// The second half of [`read_into`](Self::read_into): checks what
    /// [`read_unchecked`](Self::read_unchecked) read into `dest` (the same
    /// destination); returns the value's length.
    pub fn finish_read(&self, read: UncheckedRead, dest: &mut [u8]) -> Result<u64, StoreError> {
        let head = match read.0 {
            Unchecked::Checked(len) => return Ok(len),
            Unchecked::Head(head) => head,
        };
        let value = self.value_in(dest)?;
        match self.check(&head, value) {
            Err(StoreError::Corrupt(_)) => self.recheck(value),
            checked => checked,
        }
    }

    /// The first [`len`](Self::len) bytes of `dest`, where the value is read to.
    fn value_in<'d>(&self, dest: &'d mut [u8]) -> Result<&'d mut [u8], StoreError> {
        let have = dest.len() as u64;
        usize::try_from(self.value_len)
            .ok()
            .and_then(|need| dest.get_mut(..need))
            .ok_or(StoreError::BufferTooSmall {
                need: self.value_len,
                have,
            })
    }

    /// Reads a record that failed its check again, into a private buffer: `value` may
    /// be memory another process changed meanwhile, which must not get an intact
    /// record dropped. Copies the value to `value` when the record is intact. A plan
    /// without an open file opens it again by path: a file deleted since the first
    /// read answers `NotFound` (the object is gone either way).
    fn recheck(&self, value: &mut [u8]) -> Result<u64, StoreError> {
        let body_at = HEADER_LEN + self.key.len();
        let mut record = vec![0u8; body_at + value.len()];
        self.with_file(|file, path, offset, io| {
            io.read_gathered(file, &mut [IoSliceMut::new(&mut record)], offset)
                .map_err(|error| read_failed(path, error))
        })?;
        let (head, body) = record.split_at(body_at);
        self.check(head, body)?;
        value.copy_from_slice(body);
        Ok(self.value_len)
    }

    /// Runs `read` on the record's file (the one the plan holds open, else opened now;
    /// gone: `NotFound`), with its path, the record's offset and the I/O engine. A
    /// record outside this machine has no file: `Invalid`.
    fn with_file<R>(
        &self,
        read: impl FnOnce(&File, &Path, u64, &IoEngine) -> Result<R, StoreError>,
    ) -> Result<R, StoreError> {
        let Source::File {
            path,
            offset,
            io,
            open,
            ..
        } = &self.source
        else {
            return Err(StoreError::Invalid(
                "a record outside this machine has no file".into(),
            ));
        };
        match open {
            Some(file) => read(file, path, *offset, io),
            None => {
                let file = File::open(path).map_err(|_| StoreError::NotFound)?;
                read(&file, path, *offset, io)
            }
        }
    }

    /// Reads the record from a store outside this machine and checks it: header and
    /// key into a small buffer, the value straight into `value`.
    fn read_from_store(
        &self,
        source: &dyn RecordSource,
        store_key: &[u8],
        value: &mut [u8],
    ) -> Result<u64, StoreError> {
        let mut head = vec![0u8; HEADER_LEN + self.key.len()];
        let record_len = (head.len() + value.len()) as u64;
        match source.read_record(store_key, &mut head, value)? {
            len if len == record_len => self.check(&head, value),
            // Another length: another record (the object was replaced meanwhile) or
            // not a record; never this object's bytes, and nothing to drop here.
            _ => Err(StoreError::NotFound),
        }
    }

    /// Checks a record read back: its header, that it holds this plan's key (another
    /// record now means the object is gone) and its checksum.
    fn check(&self, head: &[u8], value: &[u8]) -> Result<u64, StoreError> {
        let header = Header::parse(head).map_err(StoreError::Corrupt)?;
        if &head[HEADER_LEN..] != self.key.as_bytes() || header.value_len != self.value_len {
            return Err(StoreError::NotFound);
        }
        header
            .verify(&head[HEADER_LEN..], value)
            .map_err(StoreError::Corrupt)?;
        Ok(self.value_len)
    }
}

/// Where a backend that keeps its records outside this machine (a distributed KV store)
/// reads one back, so that a [`ReadPlan`] can read it without naming the store's client.
pub trait RecordSource: Send + Sync + std::fmt::Debug {
    /// Reads the record stored under `store_key`: its first `head.len()` bytes into
    /// `head`, the rest into `value`. Answers the record's whole length (another length
    /// than `head.len() + value.len()` means another record); `NotFound` when there is
    /// none or it does not fit.
    fn read_record(
        &self,
        store_key: &[u8],
        head: &mut [u8],
        value: &mut [u8],
    ) -> Result<u64, StoreError>;
}

/// A store of objects on local disk. See the module documentation for the protocol.
pub trait StorageBackend: Send + std::fmt::Debug {
    /// The backend's configuration name.
    fn name(&self) -> &'static str;

    /// Its limits and what it holds against them.
    fn room(&self) -> Room;

    /// Objects on disk.
    fn len(&self) -> usize {
        self.room().keys
    }

    /// True when no object is on disk.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes in use on disk (what counts against the byte limit).
    fn used_bytes(&self) -> u64 {
        self.room().used
    }

    /// The limits it keeps to.
    fn limits(&self) -> Limits {
        self.room().limits
    }

    /// Whether `key` is on disk.
    fn contains(&self, key: &str) -> bool;

    /// Every object on disk with its value size (for re-registering with the master).
    fn objects(&self) -> Vec<(String, u64)>;

    /// Phase one of eviction: takes victims out of the index, by the policy's order,
    /// until the batch `objects` fits. Their keys become unreadable at once; their
    /// bytes stay until [`finish_eviction`](Self::finish_eviction). `QuotaExceeded`
    /// when that is impossible (policy `none`, or the batch alone above the limits);
    /// nothing is evicted then.
    fn make_room(&mut self, objects: &[(&str, &[u8])]) -> Result<Eviction, StoreError>;

    /// Watermark eviction: takes victims out of the index, by the policy's order, until
    /// at most `bytes` bytes and `keys` objects remain (none under policy `none`).
    /// Finished like [`make_room`](Self::make_room)'s.
    fn shrink_to(&mut self, bytes: u64, keys: u64) -> Eviction;

    /// Phase two of eviction: deletes the victims' bytes.
    fn finish_eviction(&mut self, eviction: Eviction);

    /// Phase one of a write: checks `objects` (a key already on disk is
    /// `AlreadyExists`; the room must have been made) and reserves their names and
    /// space. Phase two, [`PreparedBatch::write`], needs no access to the backend.
    fn prepare_batch(&mut self, objects: &[(&str, &[u8])]) -> Result<PreparedBatch, StoreError>;

    /// Phase three: indexes a batch whose write succeeded, or deletes what it left and
    /// gives its reservation back when `written` is an error (returned then).
    fn commit_batch(
        &mut self,
        batch: PreparedBatch,
        written: Result<(), StoreError>,
    ) -> Result<(), StoreError>;

    /// The three phases at once: writes `objects` durably and indexes them.
    fn write_batch(&mut self, objects: &[(&str, &[u8])]) -> Result<(), StoreError> {
        let mut batch = self.prepare_batch(objects)?;
        let written = batch.write(objects);
        self.commit_batch(batch, written)
    }

    /// Whether writing a batch copies each value into a buffer of the backend first
    /// (the file backends write values from where they are).
    fn copies_values(&self) -> bool {
        false
    }

    /// Looks `key` up (recording the read for `lru`); the bytes are read with
    /// [`ReadPlan::read_into`], without holding the backend.
    fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError>;

    /// Drops `key` and deletes its bytes. Returns whether it was there.
    fn remove(&mut self, key: &str) -> bool;

    /// Deletes every object; returns how many there were.
    fn remove_all(&mut self) -> usize;

    /// Reads `key` into `dest`; a corrupt record is dropped from the index.
    fn read_into(&mut self, key: &str, dest: &mut [u8]) -> Result<u64, StoreError> {
        let plan = self.locate(key)?;
        let result = plan.read_into(dest);
        if matches!(result, Err(StoreError::Corrupt(_))) {
            tracing::warn!(key, "an object on disk failed its checksum; dropping it");
            self.remove(key);
        }
        result
    }
}

/// Checks a batch before writing it: not empty, keys of 1 to [`MAX_KEY_LEN`] bytes,
/// values not empty, no key twice and none already stored (`stored`).
pub(crate) fn check_batch(
    objects: &[(&str, &[u8])],
    stored: impl Fn(&str) -> bool,
) -> Result<(), StoreError> {
    if objects.is_empty() {
        return Err(StoreError::Invalid("empty batch".into()));
    }
    let mut seen = std::collections::HashSet::new();
    for (key, value) in objects {
        if key.is_empty() || key.len() > MAX_KEY_LEN as usize {
            return Err(StoreError::Invalid(format!(
                "key of {} bytes (1 to {MAX_KEY_LEN})",
                key.len()
            )));
        }
        if value.is_empty() {
            return Err(StoreError::Invalid(format!("{key:?} has an empty value")));
        }
        if stored(key) || !seen.insert(*key) {
            return Err(StoreError::AlreadyExists((*key).to_string()));
        }
    }
    Ok(())
}

/// The record of `key` and `value`, in a buffer of its own (for tests that build
/// stores' contents by hand).
#[cfg(any(test, feature = "test-utils"))]
pub(crate) fn encode_record(key: &str, value: &[u8]) -> Vec<u8> {
    [
        &record::header(key.as_bytes(), value)[..],
        key.as_bytes(),
        value,
    ]
    .concat()
}

/// Bytes of the record of `key` and `value`.
pub(crate) fn record_len(key: &str, value: &[u8]) -> u64 {
    (HEADER_LEN + key.len()) as u64 + value.len() as u64
}

/// What a failed read of a record in `path` means: a file that ends early holds a torn
/// record (dropped by the caller); any other error (`EIO`, a disk gone) says nothing
/// about the record, which stays for the next read.
fn read_failed(path: &Path, error: std::io::Error) -> StoreError {
    if error.kind() == std::io::ErrorKind::UnexpectedEof {
        StoreError::Corrupt(record::RecordError::Truncated)
    } else {
        io_error("read", path)(error)
    }
}

/// Opens `path` for reading and writing, creating it when missing.
pub(crate) fn open_rw(path: &Path) -> Result<File, StoreError> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(io_error("open", path))
}

/// Creates `path`, writes `bytes` and syncs them.
pub(crate) fn write_synced(io: &IoEngine, path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let file = File::create(path).map_err(io_error("create", path))?;
    io.write_all_at(&file, bytes, 0)
        .map_err(io_error("write", path))?;
    io.sync_data(&file).map_err(io_error("sync", path))
}

/// Syncs a directory, so that renames and new entries in it survive a crash.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error("sync", dir))
}

/// Deletes `path`; a file already gone is fine, other failures are logged.
pub(crate) fn delete_file(path: &Path) {
    if let Err(error) = std::fs::remove_file(path)
        && error.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(path = %path.display(), %error, "cannot delete an SSD-tier file");
    }
}

/// Reads the record at `offset` of `file` back whole and checks its header and
/// checksum. `Some((key, value length))` when it is valid (and, with `expect`, holds
/// that key and value length).
pub(crate) fn check_record(
    file: &File,
    offset: u64,
    expect: Option<(&str, u64)>,
    buffer: &mut Vec<u8>,
) -> Option<(String, u64)> {
    let mut head = [0u8; HEADER_LEN];
    file.read_exact_at(&mut head, offset).ok()?;
    let header = Header::parse(&head).ok()?;
    // A corrupt length must not size the buffer: the record has to fit in its file.
    let available = file.metadata().ok()?.len().checked_sub(offset)?;
    if header.record_len() > available {
        return None;
    }
    if let Some((key, value_len)) = expect
        && (key.len() != header.key_len as usize || value_len != header.value_len)
    {
        return None;
    }
    let len = usize::try_from(header.record_len()).ok()?;
    buffer.resize(len, 0);
    file.read_exact_at(buffer, offset).ok()?;
    let (key, value) = buffer[HEADER_LEN..].split_at(header.key_len as usize);
    header.verify(key, value).ok()?;
    let key = std::str::from_utf8(key).ok()?;
    if expect.is_some_and(|(expected, _)| expected != key) {
        return None;
    }
    Some((key.to_string(), header.value_len))
}

/// Logs recovery progress every few seconds for stores with many objects.
pub(crate) struct Progress {
    what: &'static str,
    started: Instant,
    last: Instant,
    done: u64,
}

impl Progress {
    /// Starts counting the recovery of `what`.
    pub(crate) fn new(what: &'static str) -> Self {
        let now = Instant::now();
        Progress {
            what,
            started: now,
            last: now,
            done: 0,
        }
    }

    /// One more record checked.
    pub(crate) fn step(&mut self) {
        self.done += 1;
        if self.done.is_multiple_of(1024) && self.last.elapsed() >= Duration::from_secs(2) {
            self.last = Instant::now();
            tracing::info!(
                backend = self.what,
                records = self.done,
                seconds = self.started.elapsed().as_secs(),
                "SSD tier recovery in progress"
            );
        }
    }
}
