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
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{
    Eviction, Limits, PreparedBatch, Progress, ReadPlan, RecoveryReport, Room, StorageBackend,
    StoreError, check_batch, check_record, delete_file, foreign_batch, io_error, record_len,
    sync_dir, write_synced,
};
use crate::checksum::crc32c;
use crate::config::EvictionPolicy;
use crate::io::IoEngine;
use crate::record::MAX_KEY_LEN;
use crate::record_writer::{Placement, write_records};

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

/// A bucket store in one directory.
#[derive(Debug)]
pub struct BucketStore {
    dir: PathBuf,
    limits: Limits,
    policy: EvictionPolicy,
    index: HashMap<String, Location>,
    buckets: BTreeMap<u64, Bucket>,
    next_id: u64,
    used: u64,
    reads: u64,
    io: Arc<IoEngine>,
    /// Data files of the buckets read last, kept open for the next reads (at most
    /// [`OPEN_BUCKETS`]; closed when their bucket is deleted).
    open_files: HashMap<u64, Arc<File>>,
}

/// Bucket data files kept open for reads.
const OPEN_BUCKETS: usize = 64;

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
        Self::open_with(dir, Limits::bytes(quota), policy, Arc::new(IoEngine::Posix))
    }

    /// [`open`](Self::open) with `limits` and the I/O engine `io`.
    pub fn open_with(
        dir: &Path,
        limits: Limits,
        policy: EvictionPolicy,
        io: Arc<IoEngine>,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        let mut store = BucketStore {
            dir: dir.to_path_buf(),
            limits,
            policy,
            index: HashMap::new(),
            buckets: BTreeMap::new(),
            next_id: initial_id(),
            used: 0,
            reads: 0,
            io,
            open_files: HashMap::new(),
        };
        let report = store.recover()?;
        Ok((store, report))
    }

    /// Bytes a bucket holding `objects` takes on disk (data and metadata).
    pub fn bytes_needed(objects: &[(&str, &[u8])]) -> u64 {
        objects
            .iter()
            .map(|(k, v)| record_len(k, v) + 4 + k.len() as u64 + 16)
            .sum::<u64>()
            + 24
    }

    /// Writes `objects` as one new bucket; returns its id. The room must have been
    /// made (see [`make_room`](StorageBackend::make_room)); a key already on disk is
    /// `AlreadyExists`.
    pub fn write_bucket(&mut self, objects: &[(&str, &[u8])]) -> Result<u64, StoreError> {
        let mut batch = self.prepare_batch(objects)?;
        let id = batch.state.downcast_ref::<NewBucket>().map_or(0, |b| b.id);
        let written = batch.write(objects);
        self.commit_batch(batch, written).map(|()| id)
    }

    fn data_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.bucket"))
    }

    fn meta_path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id}.meta"))
    }

    /// Takes whole buckets out of the index, by the policy's order, until `done` says
    /// the room left is enough.
    fn evict_until(&mut self, done: impl Fn(&Room) -> bool) -> Eviction {
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
        let mut projected = self.room();
        for (_, id) in order {
            if done(&projected) {
                break;
            }
            if let Some(bucket) = self.buckets.get(&id) {
                projected.used -= bucket.bytes;
                projected.keys -= bucket.live;
                eviction.units.push(id);
            }
        }
        for id in &eviction.units {
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
        eviction
    }

    /// Writes bucket `id`'s metadata atomically: temporary file, sync, rename.
    fn commit_meta(&self, id: u64, meta: &[u8]) -> Result<(), StoreError> {
        commit_meta(&self.io, &self.dir, id, meta)
    }

    /// Rewrites bucket `id`'s metadata with only its keys still in the index, so that
    /// a removed object does not come back at the next start.
    fn forget_in_meta(&self, id: u64) {
        let Some(bucket) = self.buckets.get(&id) else {
            return;
        };
        let entries: Vec<(&str, Location)> = bucket
            .keys
            .iter()
            .filter_map(|key| {
                let location = self.index.get(key)?;
                (location.bucket == id).then_some((key.as_str(), *location))
            })
            .collect();
        let data_len = std::fs::metadata(self.data_path(id)).map_or(0, |m| m.len());
        if let Err(error) = self.commit_meta(id, &build_meta(&entries, data_len)) {
            tracing::warn!(bucket = id, %error, "cannot record a removal in the bucket's metadata");
        }
    }

    /// Bucket `id`'s data file, open (kept for the next reads); `None` when it cannot
    /// be opened (the read then opens it by path and reports what it finds).
    fn open_file(&mut self, id: u64) -> Option<Arc<File>> {
        if let Some(file) = self.open_files.get(&id) {
            return Some(Arc::clone(file));
        }
        let file = Arc::new(File::open(self.data_path(id)).ok()?);
        if self.open_files.len() >= OPEN_BUCKETS
            && let Some(oldest) = self.open_files.keys().min().copied()
        {
            self.open_files.remove(&oldest);
        }
        self.open_files.insert(id, Arc::clone(&file));
        Some(file)
    }

    fn delete_files(&mut self, id: u64) {
        self.open_files.remove(&id);
        delete_file(&self.meta_path(id));
        delete_file(&self.data_path(id));
    }
}

impl StorageBackend for BucketStore {
    fn name(&self) -> &'static str {
        "bucket_storage_backend"
    }

    fn room(&self) -> Room {
        Room {
            limits: self.limits,
            used: self.used,
            keys: self.index.len(),
        }
    }

    fn contains(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    fn objects(&self) -> Vec<(String, u64)> {
        self.index
            .iter()
            .map(|(k, l)| (k.clone(), l.value_len))
            .collect()
    }

    /// Evicts whole buckets, oldest first (`fifo`) or least recently read first
    /// (`lru`, never-read buckets first).
    fn make_room(&mut self, objects: &[(&str, &[u8])]) -> Result<Eviction, StoreError> {
        let (bytes, keys) = (Self::bytes_needed(objects), objects.len() as u64);
        if self.room().before_eviction(bytes, keys, self.policy)? {
            return Ok(Eviction::default());
        }
        Ok(self.evict_until(|room| room.fits(bytes, keys)))
    }

    fn shrink_to(&mut self, bytes: u64, keys: u64) -> Eviction {
        if self.policy == EvictionPolicy::None {
            return Eviction::default();
        }
        self.evict_until(|room| room.holds_at_most(bytes, keys))
    }

    /// Deletes the evicted buckets' files, metadata first, so a crash in between
    /// cannot bring a bucket back.
    fn finish_eviction(&mut self, eviction: Eviction) {
        for id in eviction.units {
            self.delete_files(id);
        }
    }

    fn prepare_batch(&mut self, objects: &[(&str, &[u8])]) -> Result<PreparedBatch, StoreError> {
        check_batch(objects, |key| self.index.contains_key(key))?;
        let needed = Self::bytes_needed(objects);
        if !self.room().fits(needed, objects.len() as u64) {
            return Err(self.room().exceeded(needed));
        }
        let id = self.next_id;
        self.next_id += 1;
        let (locations, data_len) = locate_records(id, objects);
        let entries: Vec<(&str, Location)> = objects
            .iter()
            .map(|(k, _)| *k)
            .zip(locations.iter().copied())
            .collect();
        let meta = build_meta(&entries, data_len);
        let state = NewBucket {
            id,
            keys: objects.iter().map(|(k, _)| (*k).to_string()).collect(),
            locations: locations.clone(),
            bytes: data_len + meta.len() as u64,
        };
        let (io, dir, data_path) = (Arc::clone(&self.io), self.dir.clone(), self.data_path(id));
        Ok(PreparedBatch::new(
            objects,
            move |objects| {
                write_data(&io, &data_path, objects, &locations)?;
                commit_meta(&io, &dir, id, &meta)
            },
            state,
        ))
    }

    fn commit_batch(
        &mut self,
        batch: PreparedBatch,
        written: Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let bucket = batch.into_state::<NewBucket>().ok_or_else(foreign_batch)?;
        if let Err(error) = written {
            self.delete_files(bucket.id);
            return Err(error);
        }
        self.used += bucket.bytes;
        for (key, location) in bucket.keys.iter().zip(bucket.locations) {
            self.index.insert(key.clone(), location);
        }
        self.buckets.insert(
            bucket.id,
            Bucket {
                live: bucket.keys.len(),
                keys: bucket.keys,
                bytes: bucket.bytes,
                last_read: 0,
            },
        );
        Ok(())
    }

    fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError> {
        let location = *self.index.get(key).ok_or(StoreError::NotFound)?;
        self.reads += 1;
        if let Some(bucket) = self.buckets.get_mut(&location.bucket) {
            bucket.last_read = self.reads;
        }
        let plan = ReadPlan::in_file(
            self.data_path(location.bucket),
            location.offset,
            key,
            location.value_len,
            Arc::clone(&self.io),
            None,
        );
        Ok(match self.open_file(location.bucket) {
            Some(file) => plan.through(file),
            None => plan,
        })
    }

    /// Drops `key`; a bucket left without live keys is deleted.
    fn remove(&mut self, key: &str) -> bool {
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
        } else {
            self.forget_in_meta(location.bucket);
        }
        true
    }

    fn remove_all(&mut self) -> usize {
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
}

/// Writes bucket `id`'s metadata in `dir` atomically: temporary file, sync, rename,
/// directory sync.
fn commit_meta(io: &IoEngine, dir: &Path, id: u64, meta: &[u8]) -> Result<(), StoreError> {
    let tmp = dir.join(format!("{id}.meta.tmp"));
    write_synced(io, &tmp, meta)?;
    std::fs::rename(&tmp, dir.join(format!("{id}.meta"))).map_err(io_error("rename", &tmp))?;
    sync_dir(dir)
}

/// A bucket prepared for writing: what indexing it needs.
struct NewBucket {
    id: u64,
    keys: Vec<String>,
    locations: Vec<Location>,
    bytes: u64,
}

/// Bucket ids start at `unix seconds << 12`, so ids keep growing across restarts even
/// when the directory was emptied.
fn initial_id() -> u64 {
    let seconds = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    seconds << 12
}

/// Where each record of bucket `id` goes (back to back from offset 0), and the data
/// file's length.
fn locate_records(id: u64, objects: &[(&str, &[u8])]) -> (Vec<Location>, u64) {
    let mut offset = 0u64;
    let locations = objects
        .iter()
        .map(|(key, value)| {
            #[expect(
                clippy::cast_possible_truncation,
                reason = "checked against MAX_KEY_LEN"
            )]
            let location = Location {
                bucket: id,
                offset,
                key_len: key.len() as u32,
                value_len: value.len() as u64,
            };
            offset += record_len(key, value);
            location
        })
        .collect();
    (locations, offset)
}

/// Creates the data file of a bucket at `path` and writes its records (straight from
/// `objects`, placed at `locations`), then syncs it.
fn write_data(
    io: &IoEngine,
    path: &Path,
    objects: &[(&str, &[u8])],
    locations: &[Location],
) -> Result<(), StoreError> {
    let file = File::create(path).map_err(io_error("create", path))?;
    let records: Vec<Placement<'_>> = objects
        .iter()
        .zip(locations)
        .map(|((key, value), location)| Placement {
            offset: location.offset,
            key,
            value,
        })
        .collect();
    write_records(io, &file, &records).map_err(io_error("write", path))?;
    io.sync_data(&file).map_err(io_error("sync", path))
}

fn build_meta(entries: &[(&str, Location)], data_len: u64) -> Vec<u8> {
    let mut meta = Vec::new();
    meta.extend_from_slice(&META_MAGIC);
    meta.extend_from_slice(&META_VERSION.to_le_bytes());
    #[expect(clippy::cast_possible_truncation, reason = "buckets hold few objects")]
    meta.extend_from_slice(&(entries.len() as u32).to_le_bytes());
    meta.extend_from_slice(&data_len.to_le_bytes());
    for (key, location) in entries {
        meta.extend_from_slice(&location.key_len.to_le_bytes());
        meta.extend_from_slice(key.as_bytes());
        meta.extend_from_slice(&location.offset.to_le_bytes());
        meta.extend_from_slice(&location.value_len.to_le_bytes());
    }
    let crc = crc32c(&meta);
    meta.extend_from_slice(&crc.to_le_bytes());
    meta
}

/// One entry of a metadata file: an object of the bucket and where its record is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaEntry {
    /// The object's key.
    pub key: String,
    /// Offset of its record in the bucket's data file.
    pub offset: u64,
    /// Length of its value.
    pub value_len: u64,
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

/// Parses a metadata file (layout in the module documentation), as recovery reads
/// each `.meta`; `None` when it is truncated, corrupt or not one.
pub fn parse_meta(bytes: &[u8]) -> Option<Vec<MetaEntry>> {
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

impl BucketStore {
    /// Rebuilds the index from the directory (see the module documentation).
    fn recover(&mut self) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        let dir = self.dir.clone();
        let entries = std::fs::read_dir(&dir).map_err(io_error("list", &dir))?;
        let mut metas = BTreeMap::new();
        let mut datas = Vec::new();
        let mut progress = Progress::new("bucket_storage_backend");
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
            self.next_id = self.next_id.max(id.saturating_add(1));
            let indexed = self.recover_bucket(id, &meta_path, &mut report, &mut progress);
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
    fn recover_bucket(
        &mut self,
        id: u64,
        meta_path: &Path,
        report: &mut RecoveryReport,
        progress: &mut Progress,
    ) -> usize {
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
            progress.step();
            if check_record(
                &file,
                location.offset,
                Some((&entry.key, location.value_len)),
                &mut buffer,
            )
            .is_some()
            {
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

#[cfg(test)]
mod tests;
