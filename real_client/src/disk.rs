//! This node's SSD tier: the storage backend in the offload directory, what it holds,
//! and disk reads for local and remote readers. The loop that feeds it from the
//! segment is [`crate::offload_loop`].
//!
//! Keys here are the master's (tenant-scoped) keys. The backend lives behind a mutex;
//! reads take it only for the lookup and read the file outside it, through a read plan
//! that keeps its bytes from being reused and checks the record's key and checksum, so
//! a concurrent eviction yields the right bytes or "not found".

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use mooncake_shm::MemSlice;
use parking_lot::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::logging::{EVICTION_TARGET, monotonic_us};
use mooncake_offload::backend::{
    Eviction, Limits, ReadPlan, RecoveryReport, StorageBackend, StoreError, UncheckedRead,
};
use mooncake_offload::batch_reader::BatchReader;
use mooncake_offload::config::{BackendKind, OffloadConfig, validate_path};
use mooncake_offload::factory::open_backend;
use mooncake_offload::io::IoEngine;
use mooncake_offload::parallel_reads::{map_checked_reads, schedule_for};

use crate::disk_staging::{StagedBytes, StagingPool};
use crate::master_link::MasterLink;

/// The SSD tier of one real client.
#[derive(Debug)]
pub struct DiskTier {
    store: Mutex<Box<dyn StorageBackend>>,
    config: OffloadConfig,
    /// Where reads served to peers land before they are sent.
    staging: StagingPool,
    /// Objects written by the offload loop (see [`DiskTier::offload_counters`]).
    offloaded: AtomicU64,
    /// Objects whose bytes the backend copied into a buffer of its own to write them.
    copies: AtomicU64,
}

/// Why the tier could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// A setting or the storage path is unusable.
    #[error(transparent)]
    Config(#[from] mooncake_offload::config::ConfigError),
    /// The store could not be opened.
    #[error("cannot open the SSD tier: {0}")]
    Store(#[from] StoreError),
}

/// The disk quota: `MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE`, or 90% of the filesystem,
/// and never more than `MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES`.
fn quota(config: &OffloadConfig) -> u64 {
    if config.backend == BackendKind::DistributedKv {
        // No local filesystem holds the data (the store's capacity caps it instead).
        return config.total_size_limit;
    }
    let configured = if config.bucket_max_total_size > 0 {
        config.bucket_max_total_size
    } else {
        nix::sys::statvfs::statvfs(&config.path).map_or(u64::MAX, |fs| {
            let total = fs.blocks().saturating_mul(fs.fragment_size());
            total / 10 * 9
        })
    };
    configured.min(config.total_size_limit)
}

fn code(error: &StoreError) -> ErrorCode {
    match error {
        StoreError::NotFound | StoreError::Corrupt(_) => ErrorCode::OBJECT_NOT_FOUND,
        StoreError::BufferTooSmall { .. } => ErrorCode::BUFFER_OVERFLOW,
        StoreError::AlreadyExists(_) => ErrorCode::OBJECT_ALREADY_EXISTS,
        StoreError::Invalid(_) | StoreError::Unsupported(_) | StoreError::Setup(_) => {
            ErrorCode::INVALID_PARAMS
        }
        StoreError::Io { op: "read", .. } => ErrorCode::FILE_READ_FAIL,
        StoreError::QuotaExceeded { .. } | StoreError::Io { .. } => ErrorCode::FILE_WRITE_FAIL,
        StoreError::Remote(_) => ErrorCode::TRANSFER_FAIL,
    }
}

/// [`code`], logging what the store said first (the code alone loses it).
fn logged(error: &StoreError) -> ErrorCode {
    tracing::warn!(%error, "SSD tier write failed");
    code(error)
}

impl DiskTier {
    /// Opens the tier in `config.path` (checked first) and recovers its index.
    pub fn open(config: OffloadConfig) -> Result<(Self, RecoveryReport), DiskError> {
        if config.backend != BackendKind::DistributedKv {
            validate_path(&config.path)?;
        }
        let quota = quota(&config);
        let io = Arc::new(IoEngine::new(config.use_uring));
        let limits = Limits {
            bytes: quota,
            keys: config.total_keys_limit,
        };
        let (store, report) = open_backend(&config, limits, io)?;
        tracing::info!(
            path = %config.path.display(),
            backend = store.name(),
            quota,
            keys_limit = limits.keys,
            objects = report.objects,
            buckets = report.buckets,
            corrupt_records = report.corrupt_records,
            dropped_buckets = report.dropped_buckets,
            "SSD tier ready"
        );
        Ok((
            DiskTier {
                store: Mutex::new(store),
                staging: StagingPool::new(config.local_buffer_size),
                offloaded: AtomicU64::new(0),
                copies: AtomicU64::new(0),
                config,
            },
            report,
        ))
    }

    /// The tier's settings.
    pub fn config(&self) -> &OffloadConfig {
        &self.config
    }

    /// Every object on disk with its size.
    pub fn objects(&self) -> Vec<(String, u64)> {
        self.store.lock().objects()
    }

    /// Reads `key`'s value into the start of `dest` (for a local reader: straight into
    /// its destination); returns the value's length. A corrupt record is dropped and
    /// reported as not found.
    ///
    /// `dest` may be a dummy's shared memory, which its owner can change while the
    /// checksum is computed: a record that fails there is read again into private
    /// memory and dropped only when it fails there too.
    pub fn read_into(&self, key: &str, dest: &mut [u8]) -> CodeResult<u64> {
        let plan = self.store.lock().locate(key).map_err(|e| code(&e))?;
        self.read_plan_into(key, &plan, dest)
    }

    /// Reads `key`'s record through `plan` as [`read_into`](Self::read_into) does.
    fn read_plan_into(&self, key: &str, plan: &ReadPlan, dest: &mut [u8]) -> CodeResult<u64> {
        let read = plan.read_unchecked(dest);
        self.finish_plan_read(key, plan, read, dest)
    }

    /// Checks what `plan` read into `dest` ([`ReadPlan::read_unchecked`]): a record
    /// that fails there is read again into private memory (see
    /// [`read_into`](Self::read_into)) and dropped when it fails there too.
    fn finish_plan_read(
        &self,
        key: &str,
        plan: &ReadPlan,
        read: Result<UncheckedRead, StoreError>,
        dest: &mut [u8],
    ) -> CodeResult<u64> {
        match read.and_then(|read| plan.finish_read(read, dest)) {
            Err(StoreError::Corrupt(_)) => {
                let mut private = self.staging.lease(plan.len())?;
                let len = plan
                    .read_into(&mut private)
                    .map_err(|error| self.failed_read(key, &error))?;
                let n = usize::try_from(len).map_err(|_| ErrorCode::INTERNAL_ERROR)?;
                let (Some(to), Some(from)) = (dest.get_mut(..n), private.get(..n)) else {
                    return Err(ErrorCode::INTERNAL_ERROR);
                };
                to.copy_from_slice(from);
                Ok(len)
            }
            other => other.map_err(|error| self.failed_read(key, &error)),
        }
    }

    /// Reads each `(key, destination)` as [`read_into`](Self::read_into) does, every
    /// key located under one lock, the records read and checked on the threads
    /// [`schedule_for`] gives the batch (records in the order they lie on disk: read
    /// in turn, each checked by a helper while the next is read), through a
    /// [`BatchReader`] (streamed from the device when in order and cold, else the next
    /// records hinted to the kernel); answers each
    /// value's length or error, in order. Destinations that overlap (the caller's
    /// choice) end up holding one of the values written there, as with several
    /// readers; no record is dropped for it, since a failed check is read again into
    /// private memory first.
    pub fn read_many_into(&self, items: &[(&str, &MemSlice)]) -> Vec<CodeResult<u64>> {
        let plans: Vec<CodeResult<ReadPlan>> = {
            let mut store = self.store.lock();
            items
                .iter()
                .map(|(key, _)| store.locate(key).map_err(|e| code(&e)))
                .collect()
        };
        let located: Vec<&ReadPlan> = plans.iter().filter_map(|p| p.as_ref().ok()).collect();
        let reader = BatchReader::new(plans.iter().map(|p| p.as_ref().ok()).collect());
        map_checked_reads(
            items.len(),
            schedule_for(&located),
            |index| {
                let plan = plans[index].as_ref().map_err(|code| *code)?;
                Ok(items[index]
                    .1
                    .fill_with(|bytes| reader.read_unchecked(index, plan, bytes)))
            },
            |index, read: CodeResult<Result<UncheckedRead, StoreError>>| {
                let (key, dest) = items[index];
                let plan = plans[index].as_ref().map_err(|code| *code)?;
                let read = read?;
                dest.fill_with(|bytes| self.finish_plan_read(key, plan, read, bytes))
            },
        )
    }

    /// Reads `key`'s value into a block of the staging buffer, leased until the
    /// returned bytes are dropped (for serving a peer).
    pub fn read_staged(&self, key: &str) -> CodeResult<StagedBytes<'_>> {
        let plan = self.store.lock().locate(key).map_err(|e| code(&e))?;
        let mut staged = self.staging.lease(plan.len())?;
        plan.read_into(&mut staged)
            .map_err(|error| self.failed_read(key, &error))?;
        Ok(staged)
    }

    /// Drops `key` when its record turned out corrupt; the read's error code.
    fn failed_read(&self, key: &str, error: &StoreError) -> ErrorCode {
        match error {
            StoreError::Corrupt(_) => {
                tracing::warn!(key, %error, "dropping a corrupt object from the SSD tier");
                self.store.lock().remove(key);
            }
            StoreError::Remote(_) | StoreError::Io { .. } => {
                tracing::warn!(key, %error, "cannot read an object from the SSD tier");
            }
            _ => {}
        }
        code(error)
    }

    /// Deletes `key`'s copy.
    pub fn remove(&self, key: &str) {
        self.store.lock().remove(key);
    }

    /// Writes `objects` (each in this node's segment, leased until `lease_ends`) as one
    /// bucket: makes room (telling the master which disk copies go before deleting
    /// them), writes, and reports the new copies to the master.
    pub(crate) async fn write_bucket(
        &self,
        master: &MasterLink,
        client: u128,
        objects: &[(String, MemSlice)],
        lease_ends: Instant,
    ) -> CodeResult<()> {
        let refs: Vec<(&str, &[u8])> = objects
            .iter()
            .map(|(key, bytes)| {
                // SAFETY: each slice lies in this node's segment, in the space of an
                // object leased until `lease_ends`: the master gives none of it to
                // another object before then, and `finish_and_write` drops the batch
                // when its copy did not finish in time.
                let bytes = unsafe { bytes.as_bytes() };
                (key.as_str(), bytes)
            })
            .collect();
        let eviction = {
            let mut store = self.store.lock();
            let since = monotonic_us();
            let eviction = store.make_room(&refs).map_err(|e| code(&e))?;
            record_evicted(&eviction, since);
            eviction
        };
        if !eviction.keys.is_empty()
            && let Err(code) = master.disk_evicted(client, eviction.keys.clone()).await
        {
            // The victims are out of the index already: delete them anyway. A disk
            // copy the master still lists reads as "not found", never as other bytes.
            self.store.lock().finish_eviction(eviction);
            return Err(code);
        }
        tokio::task::block_in_place(|| self.finish_and_write(eviction, &refs, lease_ends))?;
        let written = objects
            .iter()
            .map(|(key, bytes)| (key.clone(), bytes.len() as u64))
            .collect();
        master.offload_done(client, written).await
    }

    /// Groups `(key, size)` items into buckets within the bucket key and byte limits
    /// (an object larger than the byte limit gets a bucket of its own).
    pub(crate) fn buckets(&self, items: Vec<(String, u64)>) -> Vec<Vec<(String, u64)>> {
        let mut buckets: Vec<Vec<(String, u64)>> = Vec::new();
        let mut bytes = 0u64;
        for (key, size) in items {
            let fits = buckets.last().is_some_and(|bucket| {
                (bucket.len() as u64) < self.config.bucket_keys_limit
                    && bytes < self.config.bucket_size_limit
            });
            if !fits {
                buckets.push(Vec::new());
                bytes = 0;
            }
            bytes = bytes.saturating_add(size);
            if let Some(bucket) = buckets.last_mut() {
                bucket.push((key, size));
            }
        }
        buckets
    }

    /// Objects this node wrote to its SSD tier, and the objects whose bytes were copied
    /// into a buffer of the backend on the way (0 when every backend write goes
    /// straight from the segment).
    pub fn offload_counters(&self) -> (u64, u64) {
        (
            self.offloaded.load(Ordering::Relaxed),
            self.copies.load(Ordering::Relaxed),
        )
    }
}

impl DiskTier {
    /// Deletes the victims and writes `objects`: the backend is held to prepare and to
    /// commit the batch, not while its bytes are written (straight from the segment),
    /// so reads go on meanwhile. A batch whose write finished after `lease_ends` is
    /// dropped: its source space may have held another object's bytes by then.
    fn finish_and_write(
        &self,
        eviction: Eviction,
        objects: &[(&str, &[u8])],
        lease_ends: Instant,
    ) -> CodeResult<()> {
        let (mut batch, copies) = {
            let mut store = self.store.lock();
            store.finish_eviction(eviction);
            let batch = store.prepare_batch(objects).map_err(|e| logged(&e))?;
            (batch, store.copies_values())
        };
        let written = batch.write(objects);
        if copies {
            self.copies
                .fetch_add(objects.len() as u64, Ordering::Relaxed);
        }
        if written.is_ok() && Instant::now() >= lease_ends {
            let late = StoreError::Invalid("the read lease ended during the write".into());
            let _ = self.store.lock().commit_batch(batch, Err(late));
            return Err(ErrorCode::LEASE_EXPIRED);
        }
        self.store
            .lock()
            .commit_batch(batch, written)
            .map_err(|e| logged(&e))?;
        self.offloaded
            .fetch_add(objects.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    /// Watermark eviction: above the high watermark of the byte or key limit, evicts
    /// down to the low one (the master is told first, as for any disk eviction).
    pub(crate) async fn evict_to_watermark(
        &self,
        master: &MasterLink,
        client: u128,
    ) -> CodeResult<()> {
        if !self.config.watermark_eviction {
            return Ok(());
        }
        let eviction = {
            let mut store = self.store.lock();
            let room = store.room();
            let mark = |limit: u64, ratio: f64| {
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    clippy::cast_precision_loss,
                    reason = "a fraction of a limit"
                )]
                let value = (limit as f64 * ratio) as u64;
                value
            };
            let (high, low) = (self.config.high_watermark, self.config.low_watermark);
            let above = room.used > mark(room.limits.bytes, high)
                || room.keys as u64 > mark(room.limits.keys, high);
            if !above {
                return Ok(());
            }
            let since = monotonic_us();
            let eviction =
                store.shrink_to(mark(room.limits.bytes, low), mark(room.limits.keys, low));
            record_evicted(&eviction, since);
            eviction
        };
        if eviction.keys.is_empty() {
            return Ok(());
        }
        tracing::info!(
            objects = eviction.keys.len(),
            "SSD tier above its high watermark: evicting"
        );
        let told = master.disk_evicted(client, eviction.keys.clone()).await;
        // Out of the index already: deleted either way (see `write_bucket`).
        self.store.lock().finish_eviction(eviction);
        told
    }
}

/// Records each object `eviction` took out of the SSD tier's index (see
/// [`EVICTION_TARGET`]), with the time `since` taken before it left; called under the
/// store's lock, so no read finds them gone before the records are written.
fn record_evicted(eviction: &Eviction, since: u64) {
    for key in &eviction.keys {
        tracing::debug!(
            target: EVICTION_TARGET,
            key = ?key,
            monotonic_us = since,
            "evicted from the SSD tier"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use mooncake_shm::SharedMemory;
    use mooncake_shm::shared_memory::PageSize;

    use super::*;

    fn tier(dir: &std::path::Path) -> DiskTier {
        let path = dir.to_string_lossy().into_owned();
        let config = OffloadConfig::from_lookup(&|name| {
            (name == "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH").then(|| path.clone())
        })
        .expect("config");
        DiskTier::open(config).expect("opens").0
    }

    #[test]
    fn a_copy_that_outlives_its_lease_is_not_stored() {
        let dir = std::env::temp_dir().join(format!("mooncake-disk-lease-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let disk = tier(&dir);
        let objects: &[(&str, &[u8])] = &[("k", b"value")];
        let eviction = disk.store.lock().make_room(objects).expect("room");
        let ended = std::time::Instant::now();
        assert_eq!(
            disk.finish_and_write(eviction, objects, ended),
            Err(ErrorCode::LEASE_EXPIRED)
        );
        assert!(disk.objects().is_empty(), "nothing stored");
        assert_eq!(
            disk.offload_counters(),
            (0, 0),
            "no object written, and no copy made"
        );
        let eviction = disk.store.lock().make_room(objects).expect("room");
        let lease_ends = std::time::Instant::now() + std::time::Duration::from_secs(60);
        disk.finish_and_write(eviction, objects, lease_ends)
            .expect("written");
        assert_eq!(disk.objects(), vec![("k".to_string(), 5)]);
        assert_eq!(
            disk.offload_counters(),
            (1, 0),
            "written straight from the caller's memory"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn buckets_keep_to_the_key_and_byte_limits() {
        let dir =
            std::env::temp_dir().join(format!("mooncake-disk-buckets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let mut disk = tier(&dir);
        disk.config.bucket_keys_limit = 3;
        disk.config.bucket_size_limit = 100;
        let items: Vec<(String, u64)> = [10, 10, 10, 10, 200, 50, 60, 1]
            .iter()
            .enumerate()
            .map(|(i, size)| (format!("k{i}"), *size))
            .collect();
        let sizes: Vec<Vec<u64>> = disk
            .buckets(items)
            .iter()
            .map(|bucket| bucket.iter().map(|(_, size)| *size).collect())
            .collect();
        assert_eq!(
            sizes,
            vec![vec![10, 10, 10], vec![10, 200], vec![50, 60], vec![1]]
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Writes `count` objects of `len` bytes as one bucket into `disk`: their keys and
    /// values.
    fn write_one_bucket(disk: &DiskTier, count: usize, len: usize) -> Vec<(String, Vec<u8>)> {
        let stored: Vec<(String, Vec<u8>)> = (0..count)
            .map(|i| {
                let value = (0..len)
                    .map(|j| (j * 7 + i * 13).to_le_bytes()[0])
                    .collect();
                (format!("object-{i}"), value)
            })
            .collect();
        let objects: Vec<(&str, &[u8])> = stored
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_slice()))
            .collect();
        let eviction = disk.store.lock().make_room(&objects).expect("room");
        let lease_ends = std::time::Instant::now() + std::time::Duration::from_secs(60);
        disk.finish_and_write(eviction, &objects, lease_ends)
            .expect("written");
        stored
    }

    #[test]
    fn a_batch_read_in_order_and_checked_beside_answers_each_object_on_its_own() {
        let dir = std::env::temp_dir().join(format!("mooncake-disk-piped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let disk = tier(&dir);
        // 6 values of 512 KiB in one bucket, read back in order: a pipelined batch.
        let len = 512 << 10;
        let stored = write_one_bucket(&disk, 6, len);
        let plans: Vec<ReadPlan> = stored
            .iter()
            .map(|(key, _)| disk.store.lock().locate(key).expect("stored"))
            .collect();
        assert!(matches!(
            schedule_for(&plans.iter().collect::<Vec<_>>()),
            mooncake_offload::parallel_reads::Schedule::Pipelined { .. }
        ));
        // One byte of the fourth value flipped on disk.
        let bucket = std::fs::read_dir(&dir)
            .expect("dir")
            .flatten()
            .map(|entry| entry.path())
            .find(|path| path.extension().is_some_and(|ext| ext == "bucket"))
            .expect("a bucket file");
        let record = (mooncake_offload::record::HEADER_LEN + "object-0".len() + len) as u64;
        let at = 3 * record + record - 100;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&bucket)
            .expect("open");
        let mut byte = [0u8];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut byte, at).expect("read");
        std::os::unix::fs::FileExt::write_all_at(&file, &[byte[0] ^ 1], at).expect("write");

        let memory = Arc::new(
            SharedMemory::create("piped", (6 * len) as u64, PageSize::Normal).expect("memfd"),
        );
        let dests: Vec<MemSlice> = (0..6u64)
            .map(|i| memory.slice(i * len as u64, len as u64).expect("slice"))
            .collect();
        let items: Vec<(&str, &MemSlice)> = stored
            .iter()
            .map(|(key, _)| key.as_str())
            .zip(&dests)
            .collect();
        let read = disk.read_many_into(&items);
        for (i, ((key, value), outcome)) in stored.iter().zip(&read).enumerate() {
            if i == 3 {
                assert_eq!(*outcome, Err(ErrorCode::OBJECT_NOT_FOUND), "{key}");
                continue;
            }
            assert_eq!(*outcome, Ok(len as u64), "{key}");
            // SAFETY: nobody writes the memory meanwhile.
            let landed = unsafe { dests[i].as_bytes() };
            assert_eq!(landed, value.as_slice(), "{key}");
        }
        let left: Vec<String> = disk.objects().into_iter().map(|(key, _)| key).collect();
        assert_eq!(left.len(), 5, "the damaged object was dropped: {left:?}");
        assert!(!left.contains(&"object-3".to_string()));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_destination_changed_during_the_read_does_not_get_a_healthy_object_dropped() {
        let dir =
            std::env::temp_dir().join(format!("mooncake-disk-scribble-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let disk = tier(&dir);
        let value: Vec<u8> = (0..4u32 << 20).map(|i| (i % 251) as u8).collect();
        let objects: &[(&str, &[u8])] = &[("k", &value)];
        let eviction = disk.store.lock().make_room(objects).expect("room");
        let lease_ends = std::time::Instant::now() + std::time::Duration::from_secs(60);
        disk.finish_and_write(eviction, objects, lease_ends)
            .expect("written");

        // The destination is shared memory a (hostile) owner keeps writing to.
        let memory = Arc::new(
            SharedMemory::create("scribbled", value.len() as u64, PageSize::Normal).expect("memfd"),
        );
        let dest = memory.slice(0, value.len() as u64).expect("slice");
        let scribble = memory.slice(0, 4096).expect("slice");
        let stop = Arc::new(AtomicBool::new(false));
        let scribbler = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let junk = [0x5au8; 4096];
                while !stop.load(Ordering::Relaxed) {
                    scribble.write_from(&junk);
                }
            })
        };
        for _ in 0..50 {
            let read = dest.fill_with(|bytes| disk.read_into("k", bytes));
            assert_eq!(read, Ok(value.len() as u64));
        }
        stop.store(true, Ordering::Relaxed);
        scribbler.join().expect("scribbler");

        assert_eq!(disk.objects(), vec![("k".to_string(), value.len() as u64)]);
        let mut check = vec![0u8; value.len()];
        assert_eq!(disk.read_into("k", &mut check), Ok(value.len() as u64));
        assert_eq!(check, value);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
