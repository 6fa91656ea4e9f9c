//! [`MasterService`]: the sharded object table and its operations.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::error::{CodeResult, ErrorCode};
use crate::types::{ReplicaDescriptor, ReplicateConfig, SegmentId, validate_key};

use super::clock::Clock;
use super::config::MasterConfig;
use super::objects::{ObjectEntry, StoredReplica, WriteState};
use super::segments::{MountedSegment, SegmentTable, SegmentUsage};

/// What a successful [`MasterService::put_start`] hands the writer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutStarted {
    /// Where to copy the bytes (one entry per replica).
    pub replicas: Vec<ReplicaDescriptor>,
}

/// Counters for status reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MasterStats {
    /// Readable objects.
    pub objects: u64,
    /// Objects whose write is in progress.
    pub writes_in_progress: u64,
    /// Every mounted segment.
    pub segments: Vec<SegmentUsage>,
}

type Shard = Mutex<HashMap<Box<str>, ObjectEntry>>;

/// Space whose release waits for a deadline (a lease or the zombie-write timeout).
struct DeferredFree {
    release_at: Instant,
    replica: StoredReplica,
}

/// Object metadata, placement and leases for a cluster (or one node, embedded).
pub struct MasterService {
    config: MasterConfig,
    clock: Clock,
    hasher: RandomState,
    shards: Box<[Shard]>,
    segments: SegmentTable,
    deferred: Mutex<Vec<DeferredFree>>,
    has_deferred: AtomicBool,
}

impl std::fmt::Debug for MasterService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MasterService")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl MasterService {
    /// A master with no segments and no objects.
    pub fn new(config: MasterConfig, clock: Clock) -> Self {
        let shards = (0..config.shard_count.max(1))
            .map(|_| Mutex::new(HashMap::new()))
            .collect();
        MasterService {
            config,
            clock,
            hasher: RandomState::new(),
            shards,
            segments: SegmentTable::default(),
            deferred: Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
        }
    }

    /// The settings this master runs with.
    pub fn config(&self) -> &MasterConfig {
        &self.config
    }

    fn shard(&self, key: &str) -> &Shard {
        let hash = self.hasher.hash_one(key);
        let len = self.shards.len() as u64;
        #[expect(
            clippy::cast_possible_truncation,
            reason = "the remainder is below shards.len()"
        )]
        let index = (hash % len) as usize;
        &self.shards[index]
    }

    fn check_key(&self, key: &str) -> CodeResult<()> {
        validate_key(key, self.config.max_key_len)
    }

    /// Mounts a segment of `capacity` bytes; its name must be unique.
    pub fn mount_segment(&self, name: &str, capacity: u64) -> CodeResult<SegmentId> {
        let id = self.segments.mount(name, capacity)?;
        tracing::info!(segment = name, id, capacity, "segment mounted");
        Ok(id)
    }

    /// Unmounts a segment and drops every replica it held; objects left without a
    /// replica disappear.
    pub fn unmount_segment(&self, id: SegmentId) -> CodeResult<()> {
        let segment = self.segments.unmount(id)?;
        let mut dropped = 0u64;
        for shard in self.shards.iter() {
            shard.lock().retain(|_, entry| {
                entry.replicas.retain(|r| r.segment.id != id);
                let keep = !entry.replicas.is_empty();
                dropped += u64::from(!keep);
                keep
            });
        }
        tracing::info!(segment = %segment.name, id, dropped, "segment unmounted");
        Ok(())
    }

    /// Starts a write of `size` bytes under `key`: allocates space and returns where to
    /// copy. An existing key is `OBJECT_ALREADY_EXISTS` (puts never overwrite).
    pub fn put_start(
        &self,
        key: &str,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<PutStarted> {
        self.check_key(key)?;
        config.validate()?;
        if size == 0 {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let now = self.clock.now();
        self.release_deferred(now);
        let mut shard = self.shard(key).lock();
        if let Some(existing) = shard.get(key) {
            match existing.state {
                WriteState::Processing { started }
                    if now.duration_since(started) >= self.config.put_start_discard_timeout =>
                {
                    let stale = shard.remove(key).map(|e| e.replicas).unwrap_or_default();
                    tracing::warn!(
                        key,
                        "discarding a write left unfinished past the discard timeout"
                    );
                    self.defer_free(stale, now + self.config.put_start_release_timeout);
                }
                _ => return Err(ErrorCode::OBJECT_ALREADY_EXISTS),
            }
        }
        let count = usize::try_from(config.replica_num).unwrap_or(usize::MAX);
        let allocated = self
            .segments
            .allocate_replicas(size, count, &config.preferred())?;
        let entry = ObjectEntry {
            size,
            replicas: allocated
                .into_iter()
                .map(|(segment, allocation)| StoredReplica {
                    segment,
                    allocation,
                })
                .collect(),
            state: WriteState::Processing { started: now },
            lease_until: now,
        };
        let replicas = entry.descriptors();
        shard.insert(key.into(), entry);
        Ok(PutStarted { replicas })
    }

    /// Completes a write: the object becomes readable.
    pub fn put_end(&self, key: &str) -> CodeResult<()> {
        let mut shard = self.shard(key).lock();
        let entry = shard.get_mut(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        if entry.is_complete() {
            return Err(ErrorCode::INVALID_WRITE);
        }
        entry.state = WriteState::Complete;
        entry.lease_until = self.clock.now();
        Ok(())
    }

    /// Abandons a write in progress and frees its space.
    pub fn put_revoke(&self, key: &str) -> CodeResult<()> {
        let mut shard = self.shard(key).lock();
        match shard.get(key) {
            None => Err(ErrorCode::OBJECT_NOT_FOUND),
            Some(entry) if entry.is_complete() => Err(ErrorCode::INVALID_WRITE),
            Some(_) => {
                if let Some(entry) = shard.remove(key) {
                    free_now(entry.replicas);
                }
                Ok(())
            }
        }
    }

    /// Where a readable object's replicas are; grants a read lease. Returns the replicas
    /// and the lease length.
    pub fn get_replica_list(&self, key: &str) -> CodeResult<(Vec<ReplicaDescriptor>, Duration)> {
        self.check_key(key)?;
        let ttl = self.config.default_kv_lease_ttl;
        let mut shard = self.shard(key).lock();
        let entry = shard.get_mut(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        if !entry.is_complete() {
            return Err(ErrorCode::REPLICA_IS_NOT_READY);
        }
        entry.grant_lease(self.clock.now() + ttl);
        Ok((entry.descriptors(), ttl))
    }

    /// Whether a readable object exists; grants a read lease when it does (as upstream).
    pub fn exist(&self, key: &str) -> CodeResult<bool> {
        self.check_key(key)?;
        let mut shard = self.shard(key).lock();
        match shard.get_mut(key) {
            Some(entry) if entry.is_complete() => {
                entry.grant_lease(self.clock.now() + self.config.default_kv_lease_ttl);
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Size of a readable object, without granting a lease.
    pub fn object_size(&self, key: &str) -> CodeResult<u64> {
        self.check_key(key)?;
        let shard = self.shard(key).lock();
        match shard.get(key) {
            Some(entry) if entry.is_complete() => Ok(entry.size),
            Some(_) => Err(ErrorCode::REPLICA_IS_NOT_READY),
            None => Err(ErrorCode::OBJECT_NOT_FOUND),
        }
    }

    /// Removes an object. Under a read lease this is `OBJECT_HAS_LEASE` unless `force`;
    /// a write in progress is `REPLICA_IS_NOT_READY` even with `force`.
    pub fn remove(&self, key: &str, force: bool) -> CodeResult<()> {
        self.check_key(key)?;
        let now = self.clock.now();
        let mut shard = self.shard(key).lock();
        let entry = shard.get(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        Self::check_removable(entry, now, force)?;
        if let Some(entry) = shard.remove(key) {
            self.release_entry(entry, now);
        }
        Ok(())
    }

    /// [`remove`](Self::remove) for each key.
    pub fn batch_remove(&self, keys: &[String], force: bool) -> Vec<CodeResult<()>> {
        keys.iter().map(|key| self.remove(key, force)).collect()
    }

    /// Removes every readable object (leased ones only with `force`); returns how many.
    pub fn remove_all(&self, force: bool) -> u64 {
        let now = self.clock.now();
        let mut removed = 0u64;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let keys: Vec<Box<str>> = shard
                .iter()
                .filter(|(_, e)| Self::check_removable(e, now, force).is_ok())
                .map(|(k, _)| k.clone())
                .collect();
            for key in keys {
                if let Some(entry) = shard.remove(&key) {
                    self.release_entry(entry, now);
                    removed += 1;
                }
            }
        }
        removed
    }

    /// Object counts and segment usage.
    pub fn stats(&self) -> MasterStats {
        let mut stats = MasterStats {
            segments: self.segments.usage(),
            ..MasterStats::default()
        };
        for shard in self.shards.iter() {
            for entry in shard.lock().values() {
                if entry.is_complete() {
                    stats.objects += 1;
                } else {
                    stats.writes_in_progress += 1;
                }
            }
        }
        stats
    }

    fn check_removable(entry: &ObjectEntry, now: Instant, force: bool) -> CodeResult<()> {
        if !entry.is_complete() {
            Err(ErrorCode::REPLICA_IS_NOT_READY)
        } else if !force && entry.has_lease(now) {
            Err(ErrorCode::OBJECT_HAS_LEASE)
        } else {
            Ok(())
        }
    }

    /// Frees a removed object's space, after its lease if one is still running.
    fn release_entry(&self, entry: ObjectEntry, now: Instant) {
        if entry.has_lease(now) {
            self.defer_free(entry.replicas, entry.lease_until);
        } else {
            free_now(entry.replicas);
        }
    }

    fn defer_free(&self, replicas: Vec<StoredReplica>, release_at: Instant) {
        let mut deferred = self.deferred.lock();
        deferred.extend(replicas.into_iter().map(|replica| DeferredFree {
            release_at,
            replica,
        }));
        self.has_deferred.store(true, Ordering::Release);
    }

    fn release_deferred(&self, now: Instant) {
        if !self.has_deferred.load(Ordering::Acquire) {
            return;
        }
        let mut deferred = self.deferred.lock();
        deferred.retain(|d| {
            let due = d.release_at <= now;
            if due {
                d.replica.segment.free(d.replica.allocation);
            }
            !due
        });
        self.has_deferred
            .store(!deferred.is_empty(), Ordering::Release);
    }

    /// The mounted segment with this id.
    pub fn segment(&self, id: SegmentId) -> Option<Arc<MountedSegment>> {
        self.segments.get(id)
    }
}

fn free_now(replicas: Vec<StoredReplica>) {
    for StoredReplica {
        segment,
        allocation,
    } in replicas
    {
        segment.free(allocation);
    }
}

#[cfg(test)]
mod tests;
