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
//! A batch's files are written under their final names (four at a time for a batch
//! of 1 MiB or more) and the filesystem is synced once for all of them (`syncfs`);
//! the batch is indexed only then. At startup every
//! `.rec` is read back and checked: a torn or corrupt file (a crash cut its write
//! short) is deleted (and counted); when two files hold the same key the newer wins.
//! Leftover `.tmp` files (of earlier versions, which renamed each file into place)
//! are deleted.
//!
//! # Limits and eviction
//!
//! Each file counts its record length rounded up to 4 KiB (what a filesystem block
//! costs). Eviction takes single objects: the oldest first (`fifo`) or the least
//! recently read first (`lru`, never-read objects first).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{
    Eviction, Limits, PreparedBatch, Progress, ReadPlan, RecoveryReport, Room, StorageBackend,
    StoreError, check_batch, check_record, delete_file, foreign_batch, io_error, record_len,
    sync_dir,
};
use crate::config::EvictionPolicy;
use crate::io::IoEngine;
use crate::object_index::ObjectIndex;
use crate::parallel_reads::{PARALLEL_BYTES, map_on_threads};
use crate::record_writer::{Placement, write_records};

const BLOCK: u64 = 4096;

/// Shard directories, named by the file id modulo this.
const SHARDS: u64 = 256;

/// The file-per-key store in one directory.
#[derive(Debug)]
pub struct FilePerKeyStore {
    root: PathBuf,
    /// Objects by key; the handle is the file's id.
    index: ObjectIndex<u64>,
    next_id: u64,
    io: Arc<IoEngine>,
}

impl FilePerKeyStore {
    /// Opens the store with its files under `root` (created when missing, with its 256
    /// shard directories, so that writes only create files).
    pub fn open_in(
        root: &Path,
        limits: Limits,
        policy: EvictionPolicy,
        io: Arc<IoEngine>,
    ) -> Result<(Self, RecoveryReport), StoreError> {
        std::fs::create_dir_all(root).map_err(io_error("create", root))?;
        let mut store = FilePerKeyStore {
            root: root.to_path_buf(),
            index: ObjectIndex::new(limits, policy),
            next_id: 0,
            io,
        };
        let report = store.recover()?;
        for shard in 0..SHARDS {
            let dir = store.shard(shard);
            std::fs::create_dir_all(&dir).map_err(io_error("create", &dir))?;
        }
        sync_dir(root)?;
        Ok((store, report))
    }

    fn shard(&self, id: u64) -> PathBuf {
        self.root.join(format!("{:02x}", id % SHARDS))
    }

    fn path(&self, id: u64) -> PathBuf {
        self.shard(id).join(format!("{id:016x}.rec"))
    }

    fn cost(key: &str, value: &[u8]) -> u64 {
        record_len(key, value).next_multiple_of(BLOCK)
    }

    /// Rebuilds the index from the files (see the module documentation).
    fn recover(&mut self) -> Result<RecoveryReport, StoreError> {
        let mut report = RecoveryReport::default();
        let mut progress = Progress::new("file_per_key_storage_backend");
        let mut buffer = Vec::new();
        let mut found = Vec::new();
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
                self.next_id = self.next_id.max(id.saturating_add(1));
                match recover_file(&path, &mut buffer) {
                    Some((key, value_len, bytes)) => found.push((id, key, value_len, bytes)),
                    None => {
                        report.corrupt_records += 1;
                        report.dropped_buckets += 1;
                        delete_file(&path);
                    }
                }
            }
        }
        // In write order, so that `fifo` still evicts the oldest first; of two files
        // with one key the newer stays.
        found.sort_unstable_by_key(|(id, ..)| *id);
        for (id, key, value_len, bytes) in found {
            if let Some(stale) =
                self.index
                    .insert(key, id, value_len, bytes.next_multiple_of(BLOCK))
            {
                delete_file(&self.path(stale.handle));
                report.orphan_files += 1;
            }
        }
        report.buckets = self.index.room().keys as u64;
        report.objects = report.buckets;
        if report.corrupt_records > 0 {
            tracing::warn!(?report, "SSD tier: damaged files left out at recovery");
        }
        Ok(report)
    }
}

/// Threads writing the files of a batch of at least [`PARALLEL_BYTES`]: one writer
/// stalled in turn on each file's write-back on the test machine (1 MiB objects at
/// 0.34-1.89 GB/s in a probe of 512 files), four kept the device busy (2.0-2.1 GB/s).
pub const WRITERS: usize = 4;

/// Writes every object of `objects` into its file of `paths` (write-back started as
/// each is written; [`WRITERS`] files at a time for a large batch), then syncs the
/// filesystem once for all of them and their directory entries. A file a crash cut
/// short fails its record's check at the next start and is deleted then; until the
/// batch is committed its files are not indexed.
fn write_files(
    io: &IoEngine,
    root: &Path,
    paths: &[PathBuf],
    objects: &[(&str, &[u8])],
) -> Result<(), StoreError> {
    let bytes: u64 = objects.iter().map(|(_, value)| value.len() as u64).sum();
    let writers = if bytes >= PARALLEL_BYTES { WRITERS } else { 1 };
    let count = paths.len().min(objects.len());
    map_on_threads(count, writers, |i| write_file(io, &paths[i], objects[i]))
        .into_iter()
        .collect::<Result<(), StoreError>>()?;
    let root_dir = File::open(root).map_err(io_error("open", root))?;
    io.sync_filesystem(&root_dir)
        .map_err(io_error("sync", root))
}

/// Creates the file at `path` and writes the record of `(key, value)` into it.
fn write_file(io: &IoEngine, path: &Path, (key, value): (&str, &[u8])) -> Result<(), StoreError> {
    let file = create_file(path)?;
    let record = Placement {
        offset: 0,
        key,
        value,
    };
    write_records(io, &file, &[record]).map_err(io_error("write", path))
}

/// Creates the file at `path`, and its shard directory when it went missing (the store
/// creates them all when it opens).
fn create_file(path: &Path) -> Result<File, StoreError> {
    match File::create(path) {
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            if let Some(shard) = path.parent() {
                std::fs::create_dir_all(shard).map_err(io_error("create", shard))?;
            }
            File::create(path).map_err(io_error("create", path))
        }
        created => created.map_err(io_error("create", path)),
    }
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
        self.index.room()
    }

    fn contains(&self, key: &str) -> bool {
        self.index.contains(key)
    }

    fn objects(&self) -> Vec<(String, u64)> {
        self.index.objects()
    }

    fn make_room(&mut self, objects: &[(&str, &[u8])]) -> Result<Eviction, StoreError> {
        let bytes: u64 = objects.iter().map(|(k, v)| Self::cost(k, v)).sum();
        let mut ids = Vec::new();
        let mut eviction = self
            .index
            .make_room(bytes, objects.len() as u64, &mut ids)?;
        eviction.units = ids;
        Ok(eviction)
    }

    fn shrink_to(&mut self, bytes: u64, keys: u64) -> Eviction {
        let mut ids = Vec::new();
        let mut eviction = self.index.shrink_to(bytes, keys, &mut ids);
        eviction.units = ids;
        eviction
    }

    fn finish_eviction(&mut self, eviction: Eviction) {
        for id in eviction.units {
            delete_file(&self.path(id));
        }
    }

    fn prepare_batch(&mut self, objects: &[(&str, &[u8])]) -> Result<PreparedBatch, StoreError> {
        check_batch(objects, |key| self.index.contains(key))?;
        let bytes: u64 = objects.iter().map(|(k, v)| Self::cost(k, v)).sum();
        if !self.room().fits(bytes, objects.len() as u64) {
            return Err(self.room().exceeded(bytes));
        }
        let first = self.next_id;
        self.next_id += objects.len() as u64;
        let mut paths = Vec::with_capacity(objects.len());
        let mut entries = Vec::with_capacity(objects.len());
        for (id, (key, value)) in (first..self.next_id).zip(objects) {
            paths.push(self.path(id));
            entries.push((
                (*key).to_string(),
                id,
                value.len() as u64,
                Self::cost(key, value),
            ));
        }
        let (io, root) = (Arc::clone(&self.io), self.root.clone());
        Ok(PreparedBatch::new(
            objects,
            move |objects| write_files(&io, &root, &paths, objects),
            entries,
        ))
    }

    fn commit_batch(
        &mut self,
        batch: PreparedBatch,
        written: Result<(), StoreError>,
    ) -> Result<(), StoreError> {
        let entries = batch
            .into_state::<Vec<(String, u64, u64, u64)>>()
            .ok_or_else(foreign_batch)?;
        if let Err(error) = written {
            for (_, id, _, _) in entries {
                let path = self.path(id);
                delete_file(&path.with_extension("rec.tmp"));
                delete_file(&path);
            }
            return Err(error);
        }
        for (key, id, value_len, bytes) in entries {
            self.index.insert(key, id, value_len, bytes);
        }
        Ok(())
    }

    fn locate(&mut self, key: &str) -> Result<ReadPlan, StoreError> {
        let entry = self.index.read(key).ok_or(StoreError::NotFound)?;
        Ok(ReadPlan::in_file(
            self.path(entry.handle),
            0,
            key,
            entry.value_len,
            Arc::clone(&self.io),
            None,
        ))
    }

    fn remove(&mut self, key: &str) -> bool {
        match self.index.forget(key) {
            Some(entry) => {
                delete_file(&self.path(entry.handle));
                true
            }
            None => false,
        }
    }

    fn remove_all(&mut self) -> usize {
        let removed = self.index.clear();
        for (_, entry) in &removed {
            delete_file(&self.path(entry.handle));
        }
        removed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::encode_record;

    use crate::test_dir::TempDir;

    fn write_file(root: &Path, id: u64, bytes: &[u8]) {
        let shard = root.join(format!("{:02x}", id % 256));
        std::fs::create_dir_all(&shard).expect("shard");
        std::fs::write(shard.join(format!("{id:016x}.rec")), bytes).expect("write");
    }

    #[test]
    fn a_corrupt_length_field_is_left_out_at_recovery_without_sizing_a_buffer() {
        let dir = TempDir::new("fpk-corrupt");
        write_file(&dir.0, 1, &encode_record("good", b"intact value"));
        // Valid magic and key length, and a value length that announces a petabyte
        // (before: a buffer of that size was allocated, aborting the process) or that
        // wraps the record length around (before: a panic).
        for (id, value_len) in [(2u64, 1u64 << 50), (3, u64::MAX - 3)] {
            let mut record = encode_record("bad", b"short");
            record[8..16].copy_from_slice(&value_len.to_le_bytes());
            write_file(&dir.0, id, &record);
        }
        let (mut store, report) = FilePerKeyStore::open_in(
            &dir.0,
            Limits::bytes(1 << 30),
            EvictionPolicy::Fifo,
            Arc::new(IoEngine::Posix),
        )
        .expect("the store opens");
        assert_eq!((report.objects, report.corrupt_records), (1, 2));
        let mut dest = vec![0u8; 64];
        let len = store
            .read_into("good", &mut dest)
            .expect("the intact object");
        assert_eq!(
            &dest[..usize::try_from(len).expect("small")],
            b"intact value"
        );
    }

    #[test]
    fn shard_directories_are_made_at_open_and_again_when_one_went_missing() {
        let dir = TempDir::new("fpk-shards");
        let (mut store, _) = FilePerKeyStore::open_in(
            &dir.0,
            Limits::bytes(1 << 30),
            EvictionPolicy::Fifo,
            Arc::new(IoEngine::Posix),
        )
        .expect("the store opens");
        let shards = std::fs::read_dir(&dir.0).expect("list").count();
        assert_eq!(shards, 256, "every shard directory exists after open");
        std::fs::remove_dir_all(dir.0.join("01")).expect("remove a shard");
        let objects: Vec<(String, Vec<u8>)> =
            (0..3).map(|i| (format!("k{i}"), vec![i; 100])).collect();
        let batch: Vec<(&str, &[u8])> = objects
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        store
            .write_batch(&batch)
            .expect("written, the shard made again");
        for (key, value) in &objects {
            let mut dest = vec![0u8; 100];
            store.read_into(key, &mut dest).expect("read");
            assert_eq!(&dest, value);
        }
    }
}
