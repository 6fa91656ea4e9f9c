//! [`MasterService`]: the sharded object table and its operations.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::op_metrics::OpMetrics;
use mooncake_core::protocol::auth::ClusterSecret;
use mooncake_core::protocol::grant::{Access, Scope, now_secs};
use mooncake_core::tenant::{Tenant, validate_stored_key};
use mooncake_core::types::{
    ReplicaDescriptor, ReplicaStatus, ReplicateConfig, SegmentId, SoftPinAction,
};

use mooncake_core::master_api::replication::{Change, ObjectImage, ReplicaSpace};
use mooncake_core::master_api::{ClientStatus, LOCAL_OWNER, LeaseBudget, MasterStats, PutStarted};

use super::clients::ClientTable;
use super::clock::Clock;
use super::config::MasterConfig;
use super::objects::{ObjectEntry, PendingWrite, StoredReplica, Version};
use super::segments::{MountedSegment, SegmentTable};
use super::tasks::TaskTable;

pub(super) type Shard = Mutex<HashMap<Box<str>, ObjectEntry>>;

/// Space whose release waits for a deadline (a lease or the zombie-write timeout).
struct DeferredFree {
    release_at: Instant,
    replica: StoredReplica,
}

/// Object metadata, placement and leases for a cluster (or one node, embedded).
pub struct MasterService {
    /// Random id of this master (changes when it restarts): clients notice a new one.
    id: u128,
    pub(super) config: MasterConfig,
    pub(super) clock: Clock,
    hasher: RandomState,
    pub(super) shards: Box<[Shard]>,
    pub(super) segments: SegmentTable,
    deferred: Mutex<Vec<DeferredFree>>,
    has_deferred: AtomicBool,
    /// A standby's copy of its leader's deferred frees, by segment and offset, with the
    /// length and when each may be freed: removed as the leader's frees arrive, freed
    /// by this master when it takes over.
    pub(super) leader_deferred: Mutex<HashMap<(SegmentId, u64), (u64, Instant)>>,
    /// When a write in progress can next have outlived the release timeout (`None`: at
    /// once); the index is scanned for abandoned writes only then, not at every
    /// maintenance pass.
    pub(super) abandoned_scan_due: Mutex<Option<Instant>>,
    tasks: TaskTable,
    pub(super) clients: ClientTable,
    pub(super) evicted_objects: AtomicU64,
    /// Maintenance passes run (see [`MasterStats::maintenance_rounds`]).
    pub(super) maintenance_rounds: AtomicU64,
    placement_seed: AtomicU64,
    write_ids: AtomicU64,
    rpc_metrics: Arc<OpMetrics>,
    disk: Box<[offload::DiskShard]>,
    offload: offload::OffloadQueues,
    /// Signs the replicas handed out (see [`sign_transfers`](MasterService::sign_transfers)).
    grants: std::sync::OnceLock<Arc<ClusterSecret>>,
    /// Told of every object change (see [`observe_objects`](MasterService::observe_objects)).
    pub(super) observer: std::sync::OnceLock<Arc<dyn ObjectObserver>>,
    /// Silent clients whose segment files wait for them, and until when.
    pub(super) awaited: Mutex<Vec<(u128, Instant)>>,
}

/// Something that follows every change to the object table as it happens: an embedded
/// master's node journals the objects of its own segment with it, so that a restarted
/// process finds them again.
pub trait ObjectObserver: Send + Sync {
    /// `key`'s entry is now `image` (`None`: the key is gone). Called with the key's
    /// shard locked, in the order the key's changes happen; keep it short.
    fn object_changed(&self, key: &str, image: Option<&ObjectImage>);
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
        let disk = (0..config.shard_count.max(1))
            .map(|_| Mutex::new(HashMap::new()))
            .collect();
        MasterService {
            id: mooncake_core::ids::random_id(),
            config,
            clock,
            hasher: RandomState::new(),
            shards,
            segments: SegmentTable::default(),
            deferred: Mutex::new(Vec::new()),
            has_deferred: AtomicBool::new(false),
            leader_deferred: Mutex::new(HashMap::new()),
            abandoned_scan_due: Mutex::new(None),
            tasks: TaskTable::default(),
            clients: ClientTable::default(),
            evicted_objects: AtomicU64::new(0),
            maintenance_rounds: AtomicU64::new(0),
            placement_seed: AtomicU64::new(0),
            write_ids: AtomicU64::new(0),
            rpc_metrics: Arc::new(OpMetrics::new("master", super::server::RPC_NAMES)),
            disk,
            offload: Mutex::new(HashMap::new()),
            grants: std::sync::OnceLock::new(),
            observer: std::sync::OnceLock::new(),
            awaited: Mutex::new(Vec::new()),
        }
    }

    /// From now on, signs every replica it hands out with a transfer grant under
    /// `secret` (`protocol::grant`): the cluster's transfer engines, which authenticate
    /// with the same secret, serve only granted transfers. Set once, at startup.
    pub fn sign_transfers(&self, secret: Arc<ClusterSecret>) {
        let _ = self.grants.set(secret);
    }

    /// `replicas` of `key` with grants of `access` for `ttl` from now (unchanged when
    /// grants are off).
    pub(super) fn granted(
        &self,
        key: &str,
        mut replicas: Vec<ReplicaDescriptor>,
        access: Access,
        ttl: Duration,
    ) -> Vec<ReplicaDescriptor> {
        let Some(secret) = self.grants.get() else {
            return replicas;
        };
        let expires = now_secs().saturating_add(ttl.as_secs()).saturating_add(1);
        for replica in &mut replicas {
            let scope = match &replica.location {
                mooncake_core::types::ReplicaLocation::Memory {
                    segment, offset, ..
                } => Scope::Memory {
                    segment: *segment,
                    offset: *offset,
                    len: replica.size,
                },
                mooncake_core::types::ReplicaLocation::Disk { segment_name, .. } => {
                    Scope::Disk { segment_name, key }
                }
            };
            replica.grant = Some(secret.grant(access, &scope, expires));
        }
        replicas
    }

    /// Counters of the calls served over the network (see `server`).
    pub fn rpc_metrics(&self) -> &Arc<OpMetrics> {
        &self.rpc_metrics
    }

    /// Random id of this master (changes when it restarts).
    pub fn id(&self) -> u128 {
        self.id
    }

    /// The settings this master runs with.
    pub fn config(&self) -> &MasterConfig {
        &self.config
    }

    fn shard_index(&self, key: &str) -> usize {
        let hash = self.hasher.hash_one(key);
        let len = self.shards.len() as u64;
        #[expect(
            clippy::cast_possible_truncation,
            reason = "the remainder is below shards.len()"
        )]
        let index = (hash % len) as usize;
        index
    }

    fn shard(&self, key: &str) -> &Shard {
        &self.shards[self.shard_index(key)]
    }

    fn check_key(&self, key: &str) -> CodeResult<()> {
        validate_stored_key(key, self.config.max_key_len)
    }

    /// Mounts a segment of `capacity` bytes (its name must be unique) owned by real
    /// client `owner` ([`LOCAL_OWNER`] for this process), whose transfer engine listens
    /// at `endpoint`. A remote owner is then expected to heartbeat.
    pub fn mount_segment(
        &self,
        name: &str,
        capacity: u64,
        owner: u128,
        endpoint: &str,
        generation: u128,
    ) -> CodeResult<SegmentId> {
        // A restarted real client comes back under the same name before its old
        // instance's TTL (or its --remount_grace) runs out: the old segment went away
        // with that process, unless it lives in a file the new one mapped again.
        if let Some(stale) = self.segments.find_by_name(name)
            && stale.owner != owner
            && owner != LOCAL_OWNER
            && stale.owner != LOCAL_OWNER
        {
            if generation != 0 && stale.generation == generation {
                return self.take_back(&stale, owner, endpoint);
            }
            tracing::warn!(
                segment = name,
                old_endpoint = %stale.endpoint,
                endpoint,
                "a new instance mounts a segment name held by another; the old instance loses its segment and is told so at its next heartbeat"
            );
            self.remove_client(stale.owner);
            self.clients.displace(stale.owner);
        }
        let id = self
            .segments
            .mount(name, capacity, owner, endpoint, generation)?;
        if owner != LOCAL_OWNER {
            self.clients.touch(owner, self.clock.now());
        }
        tracing::info!(segment = name, id, capacity, endpoint, "segment mounted");
        Ok(id)
    }

    /// Records a heartbeat of `client`; `NeedRemount` when this master does not know it.
    pub fn heartbeat(&self, client: u128) -> ClientStatus {
        self.clients.heartbeat(client, self.clock.now())
    }

    /// Unmounts every segment of `client` (it exited or stopped heartbeating).
    pub fn remove_client(&self, client: u128) {
        self.clients.remove(client);
        self.fail_tasks_of(client);
        self.forget_disk_of(client);
        for id in self.segments.owned_by(client) {
            let _ = self.unmount_segment(id);
        }
    }

    /// Unmounts a segment and drops every replica it held; objects left without a
    /// replica disappear.
    pub fn unmount_segment(&self, id: SegmentId) -> CodeResult<()> {
        let segment = self.segments.unmount(id)?;
        let mut dropped = 0u64;
        for shard in self.shards.iter() {
            shard.lock().retain(|_, entry| {
                for version in entry
                    .readable
                    .iter_mut()
                    .chain(entry.pending.iter_mut().map(|p| &mut p.version))
                {
                    // The segment's space went away with it: nothing to free.
                    let _gone = version.replicas.split_off(|r| r.segment.id != id);
                }
                if entry
                    .readable
                    .as_ref()
                    .is_some_and(|v| v.replicas.is_empty())
                {
                    entry.readable = None;
                }
                if entry
                    .pending
                    .as_ref()
                    .is_some_and(|p| p.version.replicas.is_empty())
                {
                    entry.pending = None;
                }
                let keep = entry.readable.is_some() || entry.pending.is_some();
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
        self.write_start(key, size, config, false)
            .map(|started| self.write_granted(key, started))
    }

    /// A started write's replicas with write grants until it is discarded.
    fn write_granted(&self, key: &str, mut started: PutStarted) -> PutStarted {
        let replicas = std::mem::take(&mut started.replicas);
        let ttl = self.config.put_start_release_timeout;
        started.replicas = self.granted(key, replicas, Access::Write, ttl);
        started
    }

    /// Starts an upsert: like [`put_start`](Self::put_start), but an existing object is
    /// replaced when [`put_end`](Self::put_end) runs. Until then readers keep getting the
    /// old version; the new bytes go to fresh space, so no reader sees a half-written
    /// value. A write already in progress on the key is `OBJECT_REPLICA_BUSY`.
    pub fn upsert_start(
        &self,
        key: &str,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<PutStarted> {
        self.write_start(key, size, config, true)
            .map(|started| self.write_granted(key, started))
    }

    fn write_start(
        &self,
        key: &str,
        size: u64,
        config: &ReplicateConfig,
        overwrite: bool,
    ) -> CodeResult<PutStarted> {
        self.check_key(key)?;
        config.validate()?;
        if size == 0 {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let now = self.clock.now();
        let soft_pin = self.soft_pin_change(config)?;
        if !overwrite && self.disk_copy(key).is_some() {
            return Err(ErrorCode::OBJECT_ALREADY_EXISTS);
        }
        self.release_deferred(now);
        // Check before allocating (cheap refusal), and again after: eviction may have
        // run in between without the shard lock held.
        self.check_writable(&mut self.shard(key).lock(), key, now, overwrite)?;
        let replicas = self.allocate_with_eviction(size, config)?;
        let mut shard = self.shard(key).lock();
        if let Err(code) = self.check_writable(&mut shard, key, now, overwrite) {
            free_now(replicas);
            return Err(code);
        }
        let version = Version {
            size,
            replicas: replicas.into(),
        };
        let descriptors = version.descriptors(ReplicaStatus::Processing);
        let write_id = self.write_ids.fetch_add(1, Ordering::Relaxed) + 1;
        let pending = PendingWrite {
            version,
            started: now,
            soft_pin,
            write_id,
        };
        let entry = shard
            .entry(key.into())
            .or_insert_with(|| ObjectEntry::new(now));
        if config.with_hard_pin {
            entry.pin_hard();
        }
        entry.pending = Some(Box::new(pending));
        self.note_object(key, Some(entry));
        Ok(PutStarted {
            replicas: descriptors,
            write_id,
        })
    }

    /// Refuses a write that would overwrite (for a put) or race another writer, and
    /// discards a write left unfinished past the discard timeout.
    fn check_writable(
        &self,
        shard: &mut HashMap<Box<str>, ObjectEntry>,
        key: &str,
        now: Instant,
        overwrite: bool,
    ) -> CodeResult<()> {
        let Some(existing) = shard.get_mut(key) else {
            return Ok(());
        };
        if existing.is_readable() && !overwrite {
            return Err(ErrorCode::OBJECT_ALREADY_EXISTS);
        }
        if existing.has_task() {
            return Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK);
        }
        if let Some(pending) = &existing.pending {
            if now.duration_since(pending.started) < self.config.put_start_discard_timeout {
                return Err(if overwrite {
                    ErrorCode::OBJECT_REPLICA_BUSY
                } else {
                    ErrorCode::OBJECT_ALREADY_EXISTS
                });
            }
            tracing::warn!(
                key,
                "discarding a write left unfinished past the discard timeout"
            );
            if let Some(stale) = existing.pending.take() {
                self.defer_free(
                    stale.version.replicas.into_vec(),
                    now + self.config.put_start_release_timeout,
                );
            }
            if !existing.is_readable() {
                shard.remove(key);
            }
            self.note_object(key, shard.get(key));
        }
        Ok(())
    }

    /// The soft-pin change a write asks for, validated against the limits.
    fn soft_pin_change(&self, config: &ReplicateConfig) -> CodeResult<Option<Option<Duration>>> {
        Ok(match config.soft_pin_action {
            SoftPinAction::Preserve => None,
            SoftPinAction::Disable => Some(None),
            SoftPinAction::Enable => {
                let ttl = config
                    .soft_pin_ttl_ms
                    .map_or(self.config.default_kv_soft_pin_ttl, Duration::from_millis);
                if ttl > self.config.max_kv_soft_pin_ttl {
                    return Err(ErrorCode::INVALID_PARAMS);
                }
                Some((!ttl.is_zero()).then_some(ttl))
            }
        })
    }

    /// Allocates the replicas of a new version; when memory is full, evicts and tries
    /// once more.
    fn allocate_with_eviction(
        &self,
        size: u64,
        config: &ReplicateConfig,
    ) -> CodeResult<Vec<StoredReplica>> {
        let count = usize::try_from(config.replica_num).unwrap_or(usize::MAX);
        let preferred = config.preferred();
        let attempt = || {
            let seed = self.placement_seed.fetch_add(1, Ordering::Relaxed);
            self.segments.allocate_replicas(
                size,
                count,
                &preferred,
                self.config.allocation_strategy,
                seed,
            )
        };
        let allocated = match attempt() {
            Ok(allocated) => allocated,
            Err(ErrorCode::NO_AVAILABLE_HANDLE) => {
                let (_, capacity) = self.segments.totals();
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    clippy::cast_precision_loss,
                    reason = "a byte target from a ratio"
                )]
                let ratio_bytes = (capacity as f64 * self.config.eviction_ratio) as u64;
                let wanted = size.saturating_mul(count as u64).max(ratio_bytes);
                self.evict(wanted);
                attempt()?
            }
            Err(code) => return Err(code),
        };
        Ok(allocated
            .into_iter()
            .map(|(segment, allocation)| StoredReplica {
                segment,
                allocation,
            })
            .collect())
    }

    /// Completes a write: the new version becomes readable (an upsert's old version is
    /// released once its readers' leases end).
    pub fn put_end(&self, key: &str, write_id: u64) -> CodeResult<()> {
        let now = self.clock.now();
        let mut shard = self.shard(key).lock();
        let entry = shard.get_mut(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        let pending = take_pending(entry, write_id)?;
        if let Some(pin) = pending.soft_pin {
            entry.set_soft_pin(pin.map(|ttl| now + ttl));
        }
        let size = pending.version.size;
        let owner = pending
            .version
            .replicas
            .iter()
            .next()
            .map(|r| r.segment.owner);
        if let Some(old) = entry.readable.replace(pending.version) {
            let release_at = entry.lease_until().max(now);
            self.defer_or_free(old.replicas.into_vec(), release_at, now);
        }
        entry.touch(now);
        self.note_object(key, Some(entry));
        drop(shard);
        // A disk copy of the replaced version is stale (dropped before the new version
        // is queued, so its deletion reaches the disk first).
        self.drop_disk_copy(key);
        if let Some(owner) = owner
            && !self.config.offload_on_evict
        {
            self.queue_offload(key, size, owner);
        }
        Ok(())
    }

    /// Completes the write `write_id` started under the name `reserved` (a client's
    /// reservation: space it asked for ahead of the key) as the object `key`, as
    /// [`put_end`](Self::put_end) would have under `key`. `OBJECT_ALREADY_EXISTS` when
    /// `key` exists (the reservation stays as it was); `INVALID_WRITE` when `reserved`
    /// holds no such write, or holds an object or a pin (it was not a reservation).
    pub fn put_commit(&self, reserved: &str, write_id: u64, key: &str) -> CodeResult<()> {
        self.check_key(key)?;
        if reserved == key {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        if self.disk_copy(key).is_some() {
            return Err(ErrorCode::OBJECT_ALREADY_EXISTS);
        }
        let now = self.clock.now();
        let pending = self.take_reservation(reserved, write_id)?;
        let mut shard = self.shard(key).lock();
        if let Err(code) = self.check_writable(&mut shard, key, now, false) {
            drop(shard);
            self.restore_reservation(reserved, pending, now);
            return Err(code);
        }
        let entry = shard
            .entry(key.into())
            .or_insert_with(|| ObjectEntry::new(now));
        entry.pending = Some(pending);
        self.note_object(key, Some(entry));
        drop(shard);
        self.put_end(key, write_id)
    }

    /// Takes the write `write_id` of a reservation (an entry holding only that write).
    fn take_reservation(&self, reserved: &str, write_id: u64) -> CodeResult<Box<PendingWrite>> {
        let mut shard = self.shard(reserved).lock();
        let entry = shard.get_mut(reserved).ok_or(ErrorCode::INVALID_WRITE)?;
        if entry.is_readable() || entry.is_hard_pinned() {
            return Err(ErrorCode::INVALID_WRITE);
        }
        let pending = take_pending(entry, write_id)?;
        shard.remove(reserved);
        self.note_object(reserved, None);
        Ok(pending)
    }

    /// Puts a reservation's write back under its name (its key turned out to exist).
    fn restore_reservation(&self, reserved: &str, pending: Box<PendingWrite>, now: Instant) {
        let mut shard = self.shard(reserved).lock();
        let entry = shard
            .entry(reserved.into())
            .or_insert_with(|| ObjectEntry::new(now));
        if let Some(other) = entry.pending.replace(pending) {
            // Names of reservations are the client's own: never two writes at once.
            self.defer_free(
                other.version.replicas.into_vec(),
                now + self.config.put_start_release_timeout,
            );
        }
        self.note_object(reserved, Some(entry));
    }

    /// Abandons a write in progress and frees its space; an upsert's old version stays.
    pub fn put_revoke(&self, key: &str, write_id: u64) -> CodeResult<()> {
        let mut shard = self.shard(key).lock();
        let entry = shard.get_mut(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        let pending = take_pending(entry, write_id)?;
        free_now(pending.version.replicas.into_vec());
        if !entry.is_readable() {
            shard.remove(key);
        }
        self.note_object(key, shard.get(key));
        Ok(())
    }

    /// Where a readable object's replicas are; grants a read lease. Returns the replicas
    /// and the lease length.
    pub fn get_replica_list(&self, key: &str) -> CodeResult<(Vec<ReplicaDescriptor>, Duration)> {
        self.get_replica_list_leased(key, None)
    }

    /// [`get_replica_list`](Self::get_replica_list) with a lease of `lease` (at most
    /// `--default_kv_lease_ttl`; `None` for that): short internal reads, like the SSD
    /// tier copying an object to disk, do not hold it for a whole lease.
    pub fn get_replica_list_leased(
        &self,
        key: &str,
        lease: Option<Duration>,
    ) -> CodeResult<(Vec<ReplicaDescriptor>, Duration)> {
        self.check_key(key)?;
        let ttl = lease.map_or(self.config.default_kv_lease_ttl, |l| {
            l.min(self.config.default_kv_lease_ttl)
        });
        let mut shard = self.shard(key).lock();
        match shard.get_mut(key) {
            Some(entry) if entry.is_readable() => {
                let descriptors = entry
                    .readable
                    .as_ref()
                    .map(|v| v.descriptors(ReplicaStatus::Complete))
                    .unwrap_or_default();
                entry.grant_lease(self.clock.now(), ttl);
                drop(shard);
                Ok((self.granted(key, descriptors, Access::Read, ttl), ttl))
            }
            found => {
                let code = if found.is_some() {
                    ErrorCode::REPLICA_IS_NOT_READY
                } else {
                    ErrorCode::OBJECT_NOT_FOUND
                };
                drop(shard);
                // Only on disk: the owner reads it for the caller.
                let disk = self.disk_descriptor(key).ok_or(code)?;
                Ok((self.granted(key, vec![disk], Access::Read, ttl), ttl))
            }
        }
    }

    /// Where a readable object's replicas are, without granting a lease (for
    /// inspection, not for reading the bytes).
    pub fn replica_descriptors(&self, key: &str) -> CodeResult<Vec<ReplicaDescriptor>> {
        self.check_key(key)?;
        let memory = {
            let shard = self.shard(key).lock();
            shard.get(key).map(|entry| {
                entry
                    .readable
                    .as_ref()
                    .map(|v| v.descriptors(ReplicaStatus::Complete))
            })
        };
        let disk = self.disk_descriptor(key);
        let ttl = self.config.default_kv_lease_ttl;
        match (memory, disk) {
            (Some(Some(mut replicas)), disk) => {
                replicas.extend(disk);
                Ok(self.granted(key, replicas, Access::Read, ttl))
            }
            (_, Some(disk)) => Ok(self.granted(key, vec![disk], Access::Read, ttl)),
            (Some(None), None) => Err(ErrorCode::REPLICA_IS_NOT_READY),
            (None, None) => Err(ErrorCode::OBJECT_NOT_FOUND),
        }
    }

    /// Whether a readable object exists; grants a read lease when it does (as upstream).
    pub fn exist(&self, key: &str) -> CodeResult<bool> {
        Ok(self.exist_within(key, &mut LeaseBudget(None))?.is_some())
    }

    /// The size of `key` when it is readable (in memory or on disk). A memory copy is
    /// leased when `budget` allows (see [`LeaseBudget`]); otherwise the check only
    /// counts as a use for the eviction order.
    pub fn exist_within(&self, key: &str, budget: &mut LeaseBudget) -> CodeResult<Option<u64>> {
        self.check_key(key)?;
        let mut shard = self.shard(key).lock();
        match shard.get_mut(key) {
            Some(entry) if entry.is_readable() => {
                let size = entry.readable.as_ref().map_or(0, |v| v.size);
                let now = self.clock.now();
                if budget.take(size) {
                    entry.grant_lease(now, self.config.default_kv_lease_ttl);
                } else {
                    entry.touch(now);
                }
                Ok(Some(size))
            }
            _ => {
                drop(shard);
                let size = self.disk_descriptor(key).map(|disk| disk.size);
                if let Some(size) = size {
                    budget.take(size);
                }
                Ok(size)
            }
        }
    }

    /// Size of the readable memory version of `key`, if any.
    fn object_size_in_memory(&self, key: &str) -> Option<u64> {
        let shard = self.shard(key).lock();
        shard.get(key)?.readable.as_ref().map(|v| v.size)
    }

    /// Size of a readable object, without granting a lease.
    pub fn object_size(&self, key: &str) -> CodeResult<u64> {
        self.check_key(key)?;
        let in_memory = match self.shard(key).lock().get(key) {
            Some(ObjectEntry {
                readable: Some(version),
                ..
            }) => return Ok(version.size),
            Some(_) => ErrorCode::REPLICA_IS_NOT_READY,
            None => ErrorCode::OBJECT_NOT_FOUND,
        };
        self.disk_descriptor(key).map(|d| d.size).ok_or(in_memory)
    }

    /// Removes an object. Under a read lease this is `OBJECT_HAS_LEASE` unless `force`;
    /// a write in progress is `REPLICA_IS_NOT_READY` even with `force`.
    pub fn remove(&self, key: &str, force: bool) -> CodeResult<()> {
        self.check_key(key)?;
        let now = self.clock.now();
        let mut shard = self.shard(key).lock();
        let Some(entry) = shard.get(key) else {
            drop(shard);
            // Only on disk: the owner deletes the file.
            return if self.drop_disk_copy(key) {
                Ok(())
            } else {
                Err(ErrorCode::OBJECT_NOT_FOUND)
            };
        };
        Self::check_removable(entry, now, force)?;
        if let Some(entry) = shard.remove(key) {
            self.release_entry(entry, now);
            self.note_object(key, None);
        }
        drop(shard);
        self.drop_disk_copy(key);
        Ok(())
    }

    /// [`remove`](Self::remove) for each key.
    pub fn batch_remove(&self, keys: &[String], force: bool) -> Vec<CodeResult<()>> {
        keys.iter().map(|key| self.remove(key, force)).collect()
    }

    /// Clears `key` when nobody used it for one lease TTL (upstream's
    /// `BatchReplicaClear`): with `segment`, only its memory replicas on the segment of
    /// that name (the object stays readable from the others; with none left, its memory
    /// version goes and a disk copy stays), else the whole object as `remove` does.
    /// A key read or written within the last TTL is `OBJECT_HAS_LEASE`: a fresh put
    /// counts as leased here, although it does not block `remove`.
    pub fn clear_replicas(&self, key: &str, segment: Option<&str>) -> CodeResult<()> {
        self.check_key(key)?;
        let now = self.clock.now();
        let mut shard = self.shard(key).lock();
        let Some(entry) = shard.get_mut(key) else {
            drop(shard);
            return match segment {
                None if self.drop_disk_copy(key) => Ok(()),
                _ => Err(ErrorCode::OBJECT_NOT_FOUND),
            };
        };
        Self::check_removable(entry, now, false)?;
        if entry.used_within(now, self.config.default_kv_lease_ttl) {
            return Err(ErrorCode::OBJECT_HAS_LEASE);
        }
        let lease_until = entry.lease_until();
        let Some(name) = segment else {
            if let Some(entry) = shard.remove(key) {
                self.release_entry(entry, now);
                self.note_object(key, None);
            }
            drop(shard);
            self.drop_disk_copy(key);
            return Ok(());
        };
        let version = entry.readable.as_mut().ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        let on_segment = |r: &StoredReplica| r.segment.name == name;
        match version.replicas.iter().filter(|r| on_segment(r)).count() {
            0 => return Err(ErrorCode::OBJECT_NOT_FOUND),
            all if all == version.replicas.len() => {
                if let Some(entry) = shard.remove(key) {
                    self.release_entry(entry, now);
                }
                self.note_object(key, None);
            }
            _ => {
                let dropped = version.replicas.split_off(|r| !on_segment(r));
                self.defer_or_free(dropped, lease_until.max(now), now);
                self.note_object(key, shard.get(key));
            }
        }
        Ok(())
    }

    /// [`clear_replicas`](Self::clear_replicas) for each key.
    pub fn batch_clear_replicas(
        &self,
        keys: &[String],
        segment: Option<&str>,
    ) -> Vec<CodeResult<()>> {
        keys.iter()
            .map(|key| self.clear_replicas(key, segment))
            .collect()
    }

    /// Removes every readable object (leased ones only with `force`); returns how many.
    pub fn remove_all(&self, force: bool) -> u64 {
        self.remove_matching(|_| true, force)
    }

    /// [`remove_all`](Self::remove_all) for the objects of one tenant.
    pub fn remove_all_of(&self, tenant: &Tenant, force: bool) -> u64 {
        self.remove_matching(|key| tenant.unscope(key).is_some(), force)
    }

    /// [`remove_by_regex`](Self::remove_by_regex) for the objects of one tenant; the
    /// pattern sees the keys as the tenant wrote them.
    pub fn remove_by_regex_of(
        &self,
        tenant: &Tenant,
        pattern: &str,
        force: bool,
    ) -> CodeResult<u64> {
        let regex = compile_regex(pattern)?;
        Ok(self.remove_matching(
            |key| tenant.unscope(key).is_some_and(|key| regex.is_match(key)),
            force,
        ))
    }

    /// Removes every readable object whose key matches `pattern` (leased ones only with
    /// `force`); returns how many. The regex engine runs in linear time, and patterns
    /// longer than [`MAX_REGEX_LEN`] bytes or compiling to more than 1 MiB are
    /// `INVALID_PARAMS`, so a pattern cannot make the master spin.
    pub fn remove_by_regex(&self, pattern: &str, force: bool) -> CodeResult<u64> {
        let regex = compile_regex(pattern)?;
        Ok(self.remove_matching(|key| regex.is_match(key), force))
    }

    fn remove_matching(&self, matches: impl Fn(&str) -> bool, force: bool) -> u64 {
        let now = self.clock.now();
        // Disk copies to consider, with whether their object is in memory now: those
        // removed with their object count with it, disk-only ones count on their own.
        let on_disk: Vec<(String, bool)> = self
            .disk_keys_matching(&matches)
            .into_iter()
            .map(|key| {
                let in_memory = self.shard(&key).lock().contains_key(key.as_str());
                (key, in_memory)
            })
            .collect();
        let mut removed = 0u64;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let keys: Vec<Box<str>> = shard
                .iter()
                .filter(|(k, e)| matches(k) && Self::check_removable(e, now, force).is_ok())
                .map(|(k, _)| k.clone())
                .collect();
            for key in keys {
                if let Some(entry) = shard.remove(&key) {
                    self.release_entry(entry, now);
                    self.note_object(&key, None);
                    removed += 1;
                }
            }
        }
        for (key, was_in_memory) in on_disk {
            if self.shard(&key).lock().contains_key(key.as_str()) {
                continue; // kept in memory (leased or busy): its disk copy stays too
            }
            if self.drop_disk_copy(&key) && !was_in_memory {
                removed += 1;
            }
        }
        removed
    }

    /// The id of the write in progress on `key`, if any (tests and tools).
    pub fn pending_write_id(&self, key: &str) -> Option<u64> {
        self.shard(key)
            .lock()
            .get(key)
            .and_then(|e| e.pending.as_ref())
            .map(|p| p.write_id)
    }

    /// Object counts and segment usage.
    pub fn stats(&self) -> MasterStats {
        let mut stats = MasterStats {
            objects_on_disk: self.disk_objects(),
            segments: self.segments.usage(),
            clients: self.clients.count() as u64,
            evicted_objects: self.evicted_objects.load(Ordering::Relaxed),
            maintenance_rounds: self.maintenance_rounds.load(Ordering::Relaxed),
            ..MasterStats::default()
        };
        for shard in self.shards.iter() {
            for (key, entry) in shard.lock().iter() {
                stats.objects += u64::from(entry.is_readable());
                if entry.pending.is_some() {
                    if mooncake_core::master_api::is_reservation(key) {
                        stats.reserved_writes += 1;
                    } else {
                        stats.writes_in_progress += 1;
                    }
                }
            }
        }
        stats
    }

    fn check_removable(entry: &ObjectEntry, now: Instant, force: bool) -> CodeResult<()> {
        if !entry.is_readable() || entry.pending.is_some() {
            Err(ErrorCode::REPLICA_IS_NOT_READY)
        } else if entry.has_task() {
            Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK)
        } else if !force && entry.has_lease(now) {
            Err(ErrorCode::OBJECT_HAS_LEASE)
        } else {
            Ok(())
        }
    }

    /// Frees a removed object's space, after its lease if one is still running.
    fn release_entry(&self, entry: ObjectEntry, now: Instant) {
        let lease_until = entry.lease_until();
        if let Some(version) = entry.readable {
            self.defer_or_free(version.replicas.into_vec(), lease_until, now);
        }
    }

    fn defer_or_free(&self, replicas: Vec<StoredReplica>, release_at: Instant, now: Instant) {
        if release_at > now {
            self.defer_free(replicas, release_at);
        } else {
            free_now(replicas);
        }
    }

    pub(super) fn defer_free(&self, replicas: Vec<StoredReplica>, release_at: Instant) {
        if let Some(journal) = self.segments.journal() {
            let now = self.clock.now();
            journal.record(Change::Deferred {
                spaces: replicas.iter().map(StoredReplica::space).collect(),
                release_in_ms: millis_between(now, release_at),
            });
        }
        let mut deferred = self.deferred.lock();
        deferred.extend(replicas.into_iter().map(|replica| DeferredFree {
            release_at,
            replica,
        }));
        self.has_deferred.store(true, Ordering::Release);
    }

    /// The space waiting to be freed, with the milliseconds left (a snapshot).
    pub(super) fn deferred_spaces(&self, now: Instant) -> Vec<(ReplicaSpace, u64)> {
        self.deferred
            .lock()
            .iter()
            .map(|d| (d.replica.space(), millis_between(now, d.release_at)))
            .collect()
    }

    pub(super) fn release_deferred(&self, now: Instant) {
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

/// Takes the entry's write in progress if it is the write `write_id`; a write that was
/// discarded and replaced is `INVALID_WRITE` (the newer write stays untouched).
fn take_pending(entry: &mut ObjectEntry, write_id: u64) -> CodeResult<Box<PendingWrite>> {
    match &entry.pending {
        Some(pending) if pending.write_id == write_id => {
            entry.pending.take().ok_or(ErrorCode::INVALID_WRITE)
        }
        _ => Err(ErrorCode::INVALID_WRITE),
    }
}

/// Longest regular expression accepted by [`MasterService::remove_by_regex`].
pub const MAX_REGEX_LEN: usize = 4096;

fn compile_regex(pattern: &str) -> CodeResult<regex::Regex> {
    if pattern.len() > MAX_REGEX_LEN {
        return Err(ErrorCode::INVALID_PARAMS);
    }
    regex::RegexBuilder::new(pattern)
        .size_limit(1 << 20)
        .dfa_size_limit(1 << 20)
        .build()
        .map_err(|_| ErrorCode::INVALID_PARAMS)
}

/// Whole milliseconds from `now` to `later` (0 when it passed).
pub(super) fn millis_between(now: Instant, later: Instant) -> u64 {
    u64::try_from(later.saturating_duration_since(now).as_millis()).unwrap_or(u64::MAX)
}

pub(super) fn free_now(replicas: Vec<StoredReplica>) {
    for StoredReplica {
        segment,
        allocation,
    } in replicas
    {
        segment.free(allocation);
    }
}

mod journaling;
mod offload;
mod remount;
mod replication;

pub use offload::DiskCopy;
#[cfg(test)]
mod tests;
