//! `file_per_key_storage_backend`: one file per object in sharded directories.
//!
//! # On disk
//!
//! Under `<storage path>/<MOONCAKE_OFFLOAD_FSDIR>` (default `file_per_key_dir`), object
//! number `<id>` (ids grow with write order, also across restarts) lives in
//! `<id % 256 as two hex digits>/<id as 16 hex digits>.rec`: one
//! [record](crate::record) holding the key and the value. Names come from ids, not
//! keys, so any key (slashes, the tenant separator, 1 MiB of text) is safe.
//!
//! A file is written as `<name>.tmp`, synced, renamed, and its directory synced, so a
//! file with the final name is always whole. At startup every `.tmp` is deleted and
//! every `.rec` is read back and checked: a torn or corrupt file is deleted (and
//! counted); when two files hold the same key the newer wins.
//!
//! # Limits and eviction
//!
//! Each file counts its record length rounded up to 4 KiB (what a filesystem block
//! costs). Eviction takes single objects: the oldest first (`fifo`) or the least
//! recently read first (`lru`, never-read objects first).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{
    Eviction, Limits, PreparedBatch, Progress, ReadPlan, RecoveryReport, Room, StorageBackend,
    StoreError, append_record, check_batch, check_record, delete_file, foreign_batch, io_error,
    record_len, sync_dir, write_synced,
};
use crate::config::EvictionPolicy;
use crate::io::IoEngine;

/// Default name of the directory of files, `MOONCAKE_OFFLOAD_FSDIR`.
pub const DEFAULT_FSDIR: &str = "file_per_key_dir";

const BLOCK: u64 = 4096;

#[derive(Clone, Copy, Debug)]
struct Entry {
    id: u64,
    value_len: u64,
    bytes: u64,
    /// Position in the eviction order: `(last read, id)` under `lru`, `(0, id)` else.
    rank: (u64, u64),
}

/// The file-per-key store in one directory.
#[derive(Debug)]
pub struct FilePerKeyStore {
    root: PathBuf,
    limits: Limits,
    policy: EvictionPolicy,
    index: HashMap<String, Entry>,
    /// Eviction order: rank → key.
    order: BTreeMap<(u64, u64), String>,
    next_id: u64,
    used: u64,
    reads: u64,
    io: Arc<IoEngine>,
}

impl FilePerKeyStore {
    /// Opens the store in `dir/file_per_key_dir` (created when missing).
    pub fn open(
        dir: &Path,
        limits: Limits,
        policy: EvictionPolicy,
        io: Arc<IoEngine>,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        Self::open_in(&dir.join(DEFAULT_FSDIR), limits, policy, io)
    }

    /// Opens the store with its files under `root` (created when missing).
    pub fn open_in(
        root: &Path,
        limits: Limits,
        policy: EvictionPolicy,
        io: Arc<IoEngine>,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        std::fs::create_dir_all(root).map_err(io_error("create", root))?;
        let mut store = FilePerKeyStore {
            root: root.to_path_buf(),
            limits,
            policy,
            index: HashMap::new(),
            order: BTreeMap::new(),
            next_id: 0,
            used: 0,
            reads: 0,
            io,
        };
        let report = store.recover()?;
        Ok((store, report))
    }

    fn shard(&self, id: u64) -> PathBuf {
        self.root.join(format!("{:02x}", id % 256))
    }

    fn path(&self, id: u64) -> PathBuf {
        self.shard(id).join(format!("{id:016x}.rec"))
    }

    fn cost(key: &str, value: &[u8]) -> u64 {
        record_len(key, value).next_multiple_of(BLOCK)
    }

    fn insert(&mut self, key: String, entry: Entry) {
        self.used += entry.bytes;
        self.order.insert(entry.rank, key.clone());
        self.index.insert(key, entry);
    }

    /// Takes `key` out of the index; returns its entry.
    fn forget(&mut self, key: &str) -> Option<Entry> {
        let entry = self.index.remove(key)?;
        self.order.remove(&entry.rank);
        self.used -= entry.bytes;
        Some(entry)
    }

    /// Takes objects out of the index, by the policy's order, until `done` says the
    /// room left is enough.
    fn evict_until(&mut self, done: impl Fn(&Room) -> bool) -> Eviction {
        let mut eviction = Eviction::default();
        while !done(&self.room()) {
            let Some((_, key)) = self.order.pop_first() else {
                break;
            };
            if let Some(entry) = self.index.remove(&key) {
                self.used -= entry.bytes;
                eviction.units.push(entry.id);
                eviction.keys.push(key);
            }
        }
        eviction
    }

    /// Rebuilds the index from the files (see the module documentation).
    fn recover(&mut self) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        let mut progress = Progress::new("file_per_key_storage_backend");
        let mut buffer = Vec::new();
        let shards = std::fs::read_dir(&self.root).map_err(io_error("list", &self.root))?;
        for shard in shards.flatten() {
            let Ok(files) = std::fs::read_dir(shard.path()) else {
                continue;
            };
            for file in files.flatten() {
                let path = file.path();
                let name = file.file_name().to_string_lossy().into_owned();
                let Some(id) = name
                    .strip_suffix(".rec")
                    .and_then(|hex| u64::from_str_radix(hex, 16).ok())
                else {
                    if name.ends_with(".tmp") {
                        delete_file(&path);
                        report.orphan_files += 1;
                    }
                    continue;
                };
                progress.step();
                self.next_id = self.next_id.max(id + 1);
                match recover_file(&path, &mut buffer) {
                    Some((key, value_len, bytes)) => {
                        self.recover_entry(key, id, value_len, bytes, &mut report);
                    }
                    None => {
                        report.corrupt_records += 1;
                        report.dropped_buckets += 1;
                        delete_file(&path);
                    }
                }
            }
        }
        report.buckets = self.index.len() as u64;
        report.objects = self.index.len() as u64;
        if report.corrupt_records > 0 {
            tracing::warn!(?report, "SSD tier: damaged files left out at recovery");
        }
        Ok(report)
    }

    /// Indexes a recovered file; of two files with one key the newer stays.
    fn recover_entry(
        &mut self,
        key: String,
        id: u64,
        value_len: u64,
        bytes: u64,
        report: &mut RecoveryReport,
    ) {
        if let Some(old) = self.index.get(&key).copied() {
            let (stale, keep_new) = if old.id < id {
                (old.id, true)
            } else {
                (id, false)
            };
            delete_file(&self.path(stale));
            report.orphan_files += 1;
            if !keep_new {
                return;
            }
            self.forget(&key);
        }
        let entry = Entry {
            id,
            value_len,
            bytes: bytes.next_multiple_of(BLOCK),
            rank: (0, id),
        };
        self.insert(key, entry);
    }
}

/// Writes each `(path, record)` of `files`: temporary name, sync, rename; then syncs
/// the directories touched.
fn write_files(io: &IoEngine, files: &[(PathBuf, Vec<u8>)]) -> Result<(), StoreError> {
    let mut shards = std::collections::BTreeSet::new();
    for (path, record) in files {
        if let Some(shard) = path.parent()
            && shards.insert(shard.to_path_buf())
        {
            std::fs::create_dir_all(shard).map_err(io_error("create", shard))?;
        }
        let tmp = path.with_extension("rec.tmp");
        write_synced(io, &tmp, record)?;
        std::fs::rename(&tmp, path).map_err(io_error("rename", &tmp))?;
    }
    shards.iter().try_for_each(|dir| sync_dir(dir))
}

/// Checks one object file; `Some((key, value length, file length))` when it holds
/// exactly one valid record.
fn recover_file(path: &Path, buffer: &mut Vec<u8>) -> Option<(String, u64, u64)> {
    let file = File::open(path).ok()?;
    let len = file.metadata().ok()?.len();
    let (key, value_len) = check_record(&file, 0, None, buffer)?;
    (buffer.len() as u64 == len).then_some((key, value_len, len))
}

impl StorageBackend for FilePerKeyStore {
    fn name(&self) -> &'static str {
        "file_per_key_storage_backend"
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
            .map(|(k, e)| (k.clone(), e.value_len))
            .collect()
    }

    fn make_room(&mut self, objects: &[(&str, &[u8])]) -> Result<Eviction, StoreError> {
        let bytes: u64 = objects.iter().map(|(k, v)| Self::cost(k, v)).sum();
        let keys = objects.len() as u64;
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

    fn finish_eviction(&mut self, eviction: Eviction) {
        for id in eviction.units {
            delete_file(&self.path(id));
        }
    }

    fn prepare_batch(&mut self, objects: &[(&str, &[u8])]) -> Result<PreparedBatch, StoreError> {
        check_batch(objects, |key| self.index.contains_key(key))?;
        let bytes: u64 = objects.iter().map(|(k, v)| Self::cost(k, v)).sum();
        if !self.room().fits(bytes, objects.len() as u64) {
            return Err(self.room().exceeded(bytes));
        }
        let first = self.next_id;
        self.next_id += objects.len() as u64;
        let mut files = Vec::with_capacity(objects.len());
        let mut entries = Vec::with_capacity(objects.len());
        for (id, (key, value)) in (first..self.next_id).zip(objects) {
            let mut record =
                Vec::with_capacity(usize::try_from(record_len(key, value)).unwrap_or(0));
            append_record(&mut record, key, value);
            files.push((self.path(id), record));
            let entry = Entry {
                id,
                value_len: value.len() as u64,
                bytes: Self::cost(key, value),
                rank: (0, id),
            };
            entries.push(((*key).to_string(), entry));
        }
        let io = Arc::clone(&self.io);
        Ok(PreparedBatch::new(
            move || write_files(&io, &files),
            entries,
        ))
    }

    fn commit_batch(
        &mut self,
        batch: PreparedBatch,
        written: Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let entries = batch
            .into_state::<Vec<(String, Entry)>>()
            .ok_or_else(foreign_batch)?;
        if let Err(error) = written {
            for (_, entry) in entries {
                let path = self.path(entry.id);
                delete_file(&path.with_extension("rec.tmp"));
                delete_file(&path);
            }
            return Err(error);
        }
        for (key, entry) in entries {
            self.insert(key, entry);
        }
        Ok(())
    }

    fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError> {
        let entry = *self.index.get(key).ok_or(StoreError::NotFound)?;
        if self.policy == EvictionPolicy::Lru {
            self.reads += 1;
            let rank = (self.reads, entry.id);
            if let Some(slot) = self.index.get_mut(key) {
                slot.rank = rank;
            }
            if let Some(name) = self.order.remove(&entry.rank) {
                self.order.insert(rank, name);
            }
        }
        Ok(ReadPlan {
            path: self.path(entry.id),
            offset: 0,
            key: key.to_string(),
            value_len: entry.value_len,
            io: Arc::clone(&self.io),
            pin: None,
        })
    }

    fn remove(&mut self, key: &str) -> bool {
        match self.forget(key) {
            Some(entry) => {
                delete_file(&self.path(entry.id));
                true
            }
            None => false,
        }
    }

    fn remove_all(&mut self) -> usize {
        let keys: Vec<String> = self.index.keys().cloned().collect();
        for key in &keys {
            self.remove(key);
        }
        keys.len()
    }
}
