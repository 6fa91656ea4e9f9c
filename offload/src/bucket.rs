//! `bucket_storage_backend`: objects grouped into bucket files, one metadata file per
//! bucket, an in-memory index rebuilt from disk at startup.
//!
//! # On disk
//!
//! In the storage directory, per bucket `<id>` (ids grow with creation time):
//!
//! * `<id>.bucket`: the bucket's [records](crate::record), back to back;
//! * `<id>.meta`: `"MCBM"`, version (u32 = 1), object count (u32), data file length
//!   (u64), then per object its key length (u32), key, record offset (u64) and value
//!   length (u64), and last a CRC-32C (u32) of everything before it. Little endian.
//!
//! A bucket is written data first (then `fdatasync`), then its metadata to
//! `<id>.meta.tmp`, synced and renamed to `<id>.meta`: a bucket exists once its `.meta`
//! does. At startup a `.bucket` without `.meta` (a crash mid-write) and any `.meta.tmp`
//! are deleted, a `.meta` that fails its checksum drops its bucket, and every record is
//! read back and checked: a truncated or corrupt record is left out of the index (and
//! counted), the others of its bucket stay readable.
//!
//! # Eviction
//!
//! The store keeps its files under a byte quota by evicting whole buckets, oldest
//! first (`fifo`) or least recently read first (`lru`; never-read buckets go first), in
//! two phases so that the master can be told before any file disappears:
//! [`make_room`](BucketStore::make_room) takes the victims out of the index and returns
//! their keys, [`finish_eviction`](BucketStore::finish_eviction) deletes their files. A
//! read racing the deletion either finds the key gone or reads through a file handle it
//! already opened (on Linux an unlinked file stays readable), so it gets the right
//! bytes or "not found", never other bytes.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use std::sync::Arc;

use crate::checksum::crc32c;
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
    /// The quota leaves no room and the policy forbids eviction (or the batch alone
    /// exceeds the quota).
    #[error("disk quota of {quota} bytes reached ({used} used, {needed} needed)")]
    QuotaExceeded {
        /// The quota.
        quota: u64,
        /// Bytes in use.
        used: u64,
        /// Bytes the write needs.
        needed: u64,
    },
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

fn io_error<'a>(
    op: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Where one object is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Location {
    bucket: u64,
    offset: u64,
    key_len: u32,
    value_len: u64,
}

#[derive(Debug)]
struct Bucket {
    keys: Vec<String>,
    /// Keys of this bucket still in the index.
    live: usize,
    /// Bytes of its two files.
    bytes: u64,
    /// Access counter value of its last read (0: never read).
    last_read: u64,
}

/// What startup found on disk.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Buckets indexed.
    pub buckets: u64,
    /// Objects indexed.
    pub objects: u64,
    /// Records left out: truncated, bit-flipped or unreadable.
    pub corrupt_records: u64,
    /// Buckets dropped whole (bad metadata, or no valid record left).
    pub dropped_buckets: u64,
    /// Leftovers of interrupted writes deleted.
    pub orphan_files: u64,
}

/// Buckets taken out of the index by [`BucketStore::make_room`], whose files
/// [`BucketStore::finish_eviction`] deletes.
#[derive(Debug, Default)]
#[must_use = "the files are only deleted by finish_eviction"]
pub struct Eviction {
    /// Evicted bucket ids.
    pub buckets: Vec<u64>,
    /// Keys that are no longer on disk (tell the master before finishing).
    pub keys: Vec<String>,
}

/// How to read one object, obtained from [`BucketStore::locate`] and used without
/// holding the store.
#[derive(Clone, Debug)]
pub struct ReadPlan {
    path: PathBuf,
    location: Location,
    io: Arc<IoEngine>,
}

impl ReadPlan {
    /// Size of the value.
    pub fn len(&self) -> u64 {
        self.location.value_len
    }

    /// True for an empty value (never stored: values are at least one byte).
    pub fn is_empty(&self) -> bool {
        self.location.value_len == 0
    }

    /// Reads the value into the start of `dest` and checks it; returns its length.
    pub fn read_into(&self, dest: &mut [u8]) -> Result<u64, StoreError> {
        let location = self.location;
        let need = location.value_len;
        if (dest.len() as u64) < need {
            return Err(StoreError::BufferTooSmall {
                need,
                have: dest.len() as u64,
            });
        }
        let file = File::open(&self.path).map_err(|_| StoreError::NotFound)?;
        let mut head = vec![0u8; HEADER_LEN + location.key_len as usize];
        self.io
            .read_exact_at(&file, &mut head, location.offset)
            .map_err(|_| StoreError::Corrupt(record::RecordError::Truncated))?;
        let header = Header::parse(&head).map_err(StoreError::Corrupt)?;
        let value = &mut dest[..usize::try_from(need).unwrap_or(usize::MAX)];
        self.io
            .read_exact_at(&file, value, location.offset + head.len() as u64)
            .map_err(|_| StoreError::Corrupt(record::RecordError::Truncated))?;
        header
            .verify(&head[HEADER_LEN..], value)
            .map_err(StoreError::Corrupt)?;
        Ok(need)
    }
}

/// A bucket store in one directory.
#[derive(Debug)]
pub struct BucketStore {
    dir: PathBuf,
    quota: u64,
    policy: EvictionPolicy,
    index: HashMap<String, Location>,
    buckets: BTreeMap<u64, Bucket>,
    next_id: u64,
    used: u64,
    reads: u64,
    io: Arc<IoEngine>,
}

const META_MAGIC: [u8; 4] = *b"MCBM";
const META_VERSION: u32 = 1;

impl BucketStore {
    /// Opens the store in `dir` (which must exist), keeping its files under `quota`
    /// bytes with `policy`, and rebuilds the index from the files found there.
    pub fn open(
        dir: &Path,
        quota: u64,
        policy: EvictionPolicy,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        Self::open_with(dir, quota, policy, Arc::new(IoEngine::Posix))
    }

    /// [`open`](Self::open) with the I/O engine `io`.
    pub fn open_with(
        dir: &Path,
        quota: u64,
        policy: EvictionPolicy,
        io: Arc<IoEngine>,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        let mut store = BucketStore {
            dir: dir.to_path_buf(),
            quota,
            policy,
            index: HashMap::new(),
            buckets: BTreeMap::new(),
            next_id: initial_id(),
            used: 0,
            reads: 0,
            io,
        };
        let report = store.recover()?;
        Ok((store, report))
    }

    /// Objects on disk.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// True when no object is on disk.
    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Bytes of all bucket files.
    pub fn used_bytes(&self) -> u64 {
        self.used
    }

    /// The byte quota.
    pub fn quota(&self) -> u64 {
        self.quota
    }

    /// Whether `key` is on disk.
    pub fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// Every object on disk with its size (for re-registering with the master).
    pub fn objects(&self) -> impl Iterator<Item = (&str, u64)> {
        self.index.iter().map(|(k, l)| (k.as_str(), l.value_len))
    }

    /// Bytes a bucket holding `objects` takes on disk (data and metadata).
    pub fn bytes_needed(objects: &[(&str, &[u8])]) -> u64 {
        objects
            .iter()
            .map(|(k, v)| {
                let record = (HEADER_LEN + k.len()) as u64 + v.len() as u64;
                record + 4 + k.len() as u64 + 16
            })
            .sum::<u64>()
            + 24
    }

    /// Phase one of eviction: takes buckets out of the index, by the policy's order,
    /// until `needed` more bytes fit under the quota. Their keys become unreadable at
    /// once; their files stay until [`finish_eviction`](Self::finish_eviction).
    /// `QuotaExceeded` when that is impossible (policy `none`, or `needed` above the
    /// quota); nothing is evicted then.
    pub fn make_room(&mut self, needed: u64) -> Result<Eviction, StoreError> {
        let exceeded = || StoreError::QuotaExceeded {
            quota: self.quota,
            used: self.used,
            needed,
        };
        if self.used.saturating_add(needed) <= self.quota {
            return Ok(Eviction::default());
        }
        if needed > self.quota || self.policy == EvictionPolicy::None {
            return Err(exceeded());
        }
        let mut order: Vec<(u64, u64)> = self
            .buckets
            .iter()
            .map(|(id, b)| match self.policy {
                EvictionPolicy::Lru => (b.last_read, *id),
                _ => (0, *id),
            })
            .collect();
        order.sort_unstable();
        let mut eviction = Eviction::default();
        let mut used = self.used;
        for (_, id) in order {
            if used.saturating_add(needed) <= self.quota {
                break;
            }
            if let Some(bucket) = self.buckets.get(&id) {
                used -= bucket.bytes;
                eviction.buckets.push(id);
            }
        }
        for id in &eviction.buckets {
            if let Some(bucket) = self.buckets.remove(id) {
                self.used -= bucket.bytes;
                for key in bucket.keys {
                    if self.index.get(&key).is_some_and(|l| l.bucket == *id) {
                        self.index.remove(&key);
                        eviction.keys.push(key);
                    }
                }
            }
        }
        Ok(eviction)
    }

    /// Phase two of eviction: deletes the evicted buckets' files (metadata first, so a
    /// crash in between cannot bring a bucket back).
    pub fn finish_eviction(&mut self, eviction: Eviction) {
        for id in eviction.buckets {
            self.delete_files(id);
        }
    }

    /// Writes `objects` as one new bucket. The room must have been made (see
    /// [`make_room`](Self::make_room)); a key already on disk is `AlreadyExists`.
    pub fn write_bucket(&mut self, objects: &[(&str, &[u8])]) -> Result<u64, StoreError> {
        self.check_batch(objects)?;
        let needed = Self::bytes_needed(objects);
        if self.used.saturating_add(needed) > self.quota {
            return Err(StoreError::QuotaExceeded {
                quota: self.quota,
                used: self.used,
                needed,
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let (data, locations) = build_data(id, objects);
        let meta = build_meta(objects, &locations, data.len() as u64);
        let data_path = self.data_path(id);
        let written = write_synced(&self.io, &data_path, &data).and_then(|()| {
            let tmp = self.dir.join(format!("{id}.meta.tmp"));
            write_synced(&self.io, &tmp, &meta)?;
            std::fs::rename(&tmp, self.meta_path(id)).map_err(io_error("rename", &tmp))?;
            sync_dir(&self.dir)
        });
        if let Err(error) = written {
            self.delete_files(id);
            return Err(error);
        }
        let bytes = data.len() as u64 + meta.len() as u64;
        self.used += bytes;
        let keys: Vec<String> = objects.iter().map(|(k, _)| (*k).to_string()).collect();
        for (key, location) in keys.iter().zip(locations) {
            self.index.insert(key.clone(), location);
        }
        self.buckets.insert(
            id,
            Bucket {
                live: keys.len(),
                keys,
                bytes,
                last_read: 0,
            },
        );
        Ok(id)
    }

    fn check_batch(&self, objects: &[(&str, &[u8])]) -> Result<(), StoreError> {
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
            if self.index.contains_key(*key) || !seen.insert(*key) {
                return Err(StoreError::AlreadyExists((*key).to_string()));
            }
        }
        Ok(())
    }

    /// Looks `key` up and records the read for `lru`; the bytes are read with
    /// [`ReadPlan::read_into`], without holding the store.
    pub fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError> {
        let location = *self.index.get(key).ok_or(StoreError::NotFound)?;
        self.reads += 1;
        if let Some(bucket) = self.buckets.get_mut(&location.bucket) {
            bucket.last_read = self.reads;
        }
        Ok(ReadPlan {
            path: self.data_path(location.bucket),
            location,
            io: Arc::clone(&self.io),
        })
    }

    /// Reads `key` into `dest`; a corrupt record is dropped from the index.
    pub fn read_into(&mut self, key: &str, dest: &mut [u8]) -> Result<u64, StoreError> {
        let plan = self.locate(key)?;
        let result = plan.read_into(dest);
        if matches!(result, Err(StoreError::Corrupt(_))) {
            tracing::warn!(key, "an object on disk failed its checksum; dropping it");
            self.remove(key);
        }
        result
    }

    /// Drops `key` from the store; a bucket left without live keys is deleted.
    /// Returns whether it was there.
    pub fn remove(&mut self, key: &str) -> bool {
        let Some(location) = self.index.remove(key) else {
            return false;
        };
        let emptied = self
            .buckets
            .get_mut(&location.bucket)
            .is_some_and(|bucket| {
                bucket.live = bucket.live.saturating_sub(1);
                bucket.live == 0
            });
        if emptied && let Some(bucket) = self.buckets.remove(&location.bucket) {
            self.used -= bucket.bytes;
            self.delete_files(location.bucket);
        }
        true
    }

    /// Deletes every object.
    pub fn remove_all(&mut self) -> usize {
        let count = self.index.len();
        self.index.clear();
        let ids: Vec<u64> = self.buckets.keys().copied().collect();
        self.buckets.clear();
        self.used = 0;
        for id in ids {
            self.delete_files(id);
        }
        count
    }

    fn data_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.bucket"))
    }

    fn meta_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.meta"))
    }

    fn delete_files(&self, id: u64) {
        for path in [self.meta_path(id), self.data_path(id)] {
            if let Err(error) = std::fs::remove_file(&path)
                && error.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), %error, "cannot delete an evicted bucket file");
            }
        }
    }
}

/// Bucket ids start at `unix seconds << 12`, so ids keep growing across restarts even
/// when the directory was emptied.
fn initial_id() -> u64 {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    seconds << 12
}

fn build_data(id: u64, objects: &[(&str, &[u8])]) -> (Vec<u8>, Vec<Location>) {
    let total: usize = objects
        .iter()
        .map(|(k, v)| HEADER_LEN + k.len() + v.len())
        .sum();
    let mut data = Vec::with_capacity(total);
    let mut locations = Vec::with_capacity(objects.len());
    for (key, value) in objects {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "checked against MAX_KEY_LEN"
        )]
        locations.push(Location {
            bucket: id,
            offset: data.len() as u64,
            key_len: key.len() as u32,
            value_len: value.len() as u64,
        });
        data.extend_from_slice(&record::header(key.as_bytes(), value));
        data.extend_from_slice(key.as_bytes());
        data.extend_from_slice(value);
    }
    (data, locations)
}

fn build_meta(objects: &[(&str, &[u8])], locations: &[Location], data_len: u64) -> Vec<u8> {
    let mut meta = Vec::new();
    meta.extend_from_slice(&META_MAGIC);
    meta.extend_from_slice(&META_VERSION.to_le_bytes());
    #[expect(clippy::cast_possible_truncation, reason = "buckets hold few objects")]
    meta.extend_from_slice(&(objects.len() as u32).to_le_bytes());
    meta.extend_from_slice(&data_len.to_le_bytes());
    for ((key, _), location) in objects.iter().zip(locations) {
        meta.extend_from_slice(&location.key_len.to_le_bytes());
        meta.extend_from_slice(key.as_bytes());
        meta.extend_from_slice(&location.offset.to_le_bytes());
        meta.extend_from_slice(&location.value_len.to_le_bytes());
    }
    let crc = crc32c(&meta);
    meta.extend_from_slice(&crc.to_le_bytes());
    meta
}

/// One entry of a metadata file.
struct MetaEntry {
    key: String,
    offset: u64,
    value_len: u64,
}

/// Reads little-endian fields from a byte slice.
struct Cursor<'a> {
    bytes: &'a [u8],
}

impl Cursor<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        let (head, rest) = self.bytes.split_at_checked(n)?;
        self.bytes = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
}

/// Parses a metadata file; `None` when it is truncated, corrupt or not one.
fn parse_meta(bytes: &[u8]) -> Option<Vec<MetaEntry>> {
    let (body, crc) = bytes.split_at_checked(bytes.len().checked_sub(4)?)?;
    if crc32c(body).to_le_bytes() != crc {
        return None;
    }
    let mut cursor = Cursor { bytes: body };
    if cursor.take(4)? != META_MAGIC || cursor.u32()? != META_VERSION {
        return None;
    }
    let count = cursor.u32()?;
    let _data_len = cursor.u64()?;
    let mut entries = Vec::new();
    for _ in 0..count {
        let key_len = cursor.u32()?;
        if key_len == 0 || key_len > MAX_KEY_LEN {
            return None;
        }
        let key = std::str::from_utf8(cursor.take(key_len as usize)?).ok()?;
        entries.push(MetaEntry {
            key: key.to_string(),
            offset: cursor.u64()?,
            value_len: cursor.u64()?,
        });
    }
    cursor.bytes.is_empty().then_some(entries)
}

fn write_synced(io: &IoEngine, path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let file = File::create(path).map_err(io_error("create", path))?;
    io.write_all_at(&file, bytes, 0)
        .map_err(io_error("write", path))?;
    io.sync_data(&file).map_err(io_error("sync", path))
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error("sync", dir))
}

impl BucketStore {
    /// Rebuilds the index from the directory (see the module documentation).
    fn recover(&mut self) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        let dir = self.dir.clone();
        let entries = std::fs::read_dir(&dir).map_err(io_error("list", &dir))?;
        let mut metas = BTreeMap::new();
        let mut datas = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(id) = name
                .strip_suffix(".meta")
                .and_then(|s| s.parse::<u64>().ok())
            {
                metas.insert(id, entry.path());
            } else if let Some(id) = name
                .strip_suffix(".bucket")
                .and_then(|s| s.parse::<u64>().ok())
            {
                datas.push(id);
            } else if name.ends_with(".meta.tmp") {
                let _ = std::fs::remove_file(entry.path());
                report.orphan_files += 1;
            }
        }
        for id in datas {
            if !metas.contains_key(&id) {
                let _ = std::fs::remove_file(self.data_path(id));
                report.orphan_files += 1;
            }
        }
        for (id, meta_path) in metas {
            self.next_id = self.next_id.max(id + 1);
            let indexed = self.recover_bucket(id, &meta_path, &mut report);
            if indexed == 0 {
                report.dropped_buckets += 1;
                self.delete_files(id);
            } else {
                report.buckets += 1;
                report.objects += indexed as u64;
            }
        }
        if report.corrupt_records > 0 || report.dropped_buckets > 0 {
            tracing::warn!(?report, "SSD tier: damaged data left out at recovery");
        }
        Ok(report)
    }

    /// Indexes the valid records of one bucket; returns how many.
    fn recover_bucket(&mut self, id: u64, meta_path: &Path, report: &mut RecoveryReport) -> usize {
        let Some(entries) = std::fs::read(meta_path)
            .ok()
            .as_deref()
            .and_then(parse_meta)
        else {
            return 0;
        };
        let data_path = self.data_path(id);
        let Ok(file) = File::open(&data_path) else {
            return 0;
        };
        let mut keys = Vec::new();
        let mut buffer = Vec::new();
        for entry in entries {
            let location = Location {
                bucket: id,
                offset: entry.offset,
                #[expect(clippy::cast_possible_truncation, reason = "checked by parse_meta")]
                key_len: entry.key.len() as u32,
                value_len: entry.value_len,
            };
            if check_record(&file, &entry.key, location, &mut buffer) {
                // A key in two buckets (not written by this store): the newer wins.
                self.index.insert(entry.key.clone(), location);
                keys.push(entry.key);
            } else {
                report.corrupt_records += 1;
            }
        }
        if keys.is_empty() {
            return 0;
        }
        let bytes = std::fs::metadata(&data_path).map_or(0, |m| m.len())
            + std::fs::metadata(meta_path).map_or(0, |m| m.len());
        self.used += bytes;
        let count = keys.len();
        self.buckets.insert(
            id,
            Bucket {
                live: count,
                keys,
                bytes,
                last_read: 0,
            },
        );
        count
    }
}

/// Reads a whole record back and checks its header, key and checksum.
fn check_record(file: &File, key: &str, location: Location, buffer: &mut Vec<u8>) -> bool {
    let Ok(len) =
        usize::try_from(HEADER_LEN as u64 + u64::from(location.key_len) + location.value_len)
    else {
        return false;
    };
    buffer.resize(len, 0);
    if file.read_exact_at(buffer, location.offset).is_err() {
        return false;
    }
    let Ok(header) = Header::parse(buffer) else {
        return false;
    };
    let (key_bytes, value) = buffer[HEADER_LEN..].split_at(location.key_len as usize);
    key_bytes == key.as_bytes()
        && header.value_len == location.value_len
        && header.verify(key_bytes, value).is_ok()
}

#[cfg(test)]
mod tests;
