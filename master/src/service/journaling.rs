//! The master's side of high availability: journaling every metadata change while it
//! leads, taking and installing snapshots, applying a leader's changes while it stands
//! by, and taking over.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use mooncake_core::allocator::Allocation;
use mooncake_core::master_api::LOCAL_OWNER;
use mooncake_core::master_api::replication::{
    Change, ObjectImage, PendingImage, ReplicaSpace, SnapshotState, VersionImage,
};

use super::MasterService;
use super::offload::DiskCopy;
use crate::journal::Journal;
use crate::objects::{ObjectEntry, PendingWrite, StoredReplica, Version};

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn version_image(version: &Version) -> VersionImage {
    VersionImage {
        size: version.size,
        replicas: version
            .replicas
            .iter()
            .map(|r| ReplicaSpace {
                segment: r.segment.id,
                offset: r.allocation.offset,
                len: r.allocation.len,
            })
            .collect(),
    }
}

/// An entry as the journal records it at `now`.
fn image_of(entry: &ObjectEntry, now: Instant) -> ObjectImage {
    ObjectImage {
        readable: entry.readable.as_ref().map(version_image),
        pending: entry.pending.as_ref().map(|p| PendingImage {
            version: version_image(&p.version),
            write_id: p.write_id,
            age_ms: millis(now.saturating_duration_since(p.started)),
            soft_pin_ms: p.soft_pin.map(|pin| pin.map(millis)),
        }),
        hard_pinned: entry.is_hard_pinned(),
        soft_pin_left_ms: entry.soft_pin_left_ms(now),
    }
}

impl MasterService {
    /// Journals a change, when this master leads under high availability.
    pub(crate) fn note(&self, change: impl FnOnce() -> Change) {
        if let Some(journal) = self.segments.journal() {
            journal.record(change());
        }
    }

    /// Journals the entry of `key` as it is now (`None`: gone); called with its shard
    /// locked, so the journal orders a key's changes as they happened.
    pub(crate) fn note_object(&self, key: &str, entry: Option<&ObjectEntry>) {
        let journal = self.segments.journal();
        let observer = self.observer.get();
        if journal.is_none() && observer.is_none() {
            return;
        }
        let now = self.clock.now();
        let image = entry.map(|e| image_of(e, now));
        if let Some(observer) = observer {
            observer.object_changed(key, image.as_ref());
        }
        if let Some(journal) = journal {
            journal.record(Change::Object {
                key: key.to_string(),
                image,
            });
        }
    }

    /// From now on, tells `observer` of every object change (set once; a second call is
    /// refused with `false`).
    pub fn observe_objects(&self, observer: Arc<dyn super::ObjectObserver>) -> bool {
        self.observer.set(observer).is_ok()
    }

    /// Installs `key` as a readable object of `size` bytes at `offset..offset+len` of
    /// segment `segment`, taking that space from its free list: what a restarted node
    /// found whole in its segment. `false` (nothing changed) when the segment is not
    /// mounted, the space is not free or the key exists.
    pub fn adopt_object(
        &self,
        key: &str,
        segment: mooncake_core::types::SegmentId,
        offset: u64,
        len: u64,
        size: u64,
    ) -> bool {
        let Some(mounted) = self.segments.get(segment) else {
            return false;
        };
        let shard = self.shard(key).lock();
        if shard.contains_key(key) || !mounted.reserve(Allocation { offset, len }) {
            return false;
        }
        drop(shard);
        let image = ObjectImage {
            readable: Some(VersionImage {
                size,
                replicas: vec![ReplicaSpace {
                    segment,
                    offset,
                    len,
                }],
            }),
            pending: None,
            hard_pinned: false,
            soft_pin_left_ms: 0,
        };
        self.put_image(key, Some(image), self.clock.now());
        true
    }

    /// The journal of this master's term, when it leads under high availability.
    pub fn journal(&self) -> Option<&Arc<Journal>> {
        self.segments.journal()
    }

    /// Every object, segment (with its free space) and disk copy, as of now. Take it
    /// with the journal quiesced, so that it matches one journal position.
    pub fn snapshot_state(&self) -> SnapshotState {
        let now = self.clock.now();
        let (offload_clients, disk_deletes) = {
            let queues = self.offload.lock();
            let deletes = queues
                .iter()
                .filter(|(_, queue)| !queue.work.delete.is_empty())
                .map(|(client, queue)| (*client, queue.work.delete.clone()))
                .collect();
            (queues.keys().copied().collect(), deletes)
        };
        let mut state = SnapshotState {
            segments: self.segments.states(),
            offload_clients,
            disk_deletes,
            tasks: self.tasks.images(),
            deferred: self.deferred_spaces(now),
            ..SnapshotState::default()
        };
        for shard in self.shards.iter() {
            let shard = shard.lock();
            state.objects.reserve(shard.len());
            state
                .objects
                .extend(shard.iter().map(|(k, e)| (k.to_string(), image_of(e, now))));
        }
        for shard in self.disk.iter() {
            let shard = shard.lock();
            state
                .disk
                .extend(shard.iter().map(|(k, c)| (k.to_string(), c.owner, c.size)));
        }
        state
    }

    /// Replaces everything this (standby) master knows with a leader's snapshot.
    pub fn install_snapshot(&self, state: SnapshotState) -> Result<(), String> {
        for shard in self.shards.iter() {
            shard.lock().clear();
        }
        for shard in self.disk.iter() {
            shard.lock().clear();
        }
        self.offload.lock().clear();
        self.segments.clear();
        for segment in &state.segments {
            if !self
                .segments
                .mount_copy(&segment.segment, Some(&segment.free))
            {
                return Err(format!(
                    "segment {} ({}) has an invalid free list",
                    segment.segment.id, segment.segment.name
                ));
            }
        }
        let now = self.clock.now();
        for (key, image) in state.objects {
            self.put_image(&key, Some(image), now);
        }
        for (key, owner, size) in state.disk {
            self.disk_shard(&key)
                .lock()
                .insert(key.as_str().into(), DiskCopy { owner, size });
        }
        let mut queues = self.offload.lock();
        for client in state.offload_clients {
            queues.entry(client).or_default();
        }
        for (client, keys) in state.disk_deletes {
            queues.entry(client).or_default().work.delete = keys;
        }
        drop(queues);
        self.tasks.clear();
        for task in state.tasks {
            self.apply_task(task, now);
        }
        let mut deferred = self.leader_deferred.lock();
        deferred.clear();
        for (space, left_ms) in state.deferred {
            deferred.insert(
                (space.segment, space.offset),
                (space.len, now + Duration::from_millis(left_ms)),
            );
        }
        Ok(())
    }

    /// Applies one of the leader's changes (a standby).
    pub fn apply_change(&self, change: Change) {
        let now = self.clock.now();
        match change {
            Change::Object { key, image } => self.put_image(&key, image, now),
            Change::Disk { key, copy } => {
                let mut shard = self.disk_shard(&key).lock();
                match copy {
                    Some((owner, size)) => {
                        shard.insert(key.as_str().into(), DiskCopy { owner, size });
                    }
                    None => {
                        shard.remove(key.as_str());
                    }
                }
            }
            Change::DiskClientGone { client } => {
                self.offload.lock().remove(&client);
                for shard in self.disk.iter() {
                    shard.lock().retain(|_, copy| copy.owner != client);
                }
            }
            Change::DiskHandedOver { old, new } => {
                let deletes = self
                    .offload
                    .lock()
                    .remove(&old)
                    .map(|queue| queue.work.delete)
                    .unwrap_or_default();
                self.offload
                    .lock()
                    .entry(new)
                    .or_default()
                    .work
                    .delete
                    .extend(deletes);
                self.reassign_disk(old, new);
            }
            Change::DiskDeleteQueued { client, key } => {
                if let Some(queue) = self.offload.lock().get_mut(&client) {
                    queue.work.delete.push(key);
                }
            }
            Change::DiskDeletesFetched { client, keys } => {
                if let Some(queue) = self.offload.lock().get_mut(&client) {
                    let taken: std::collections::HashSet<String> = keys.into_iter().collect();
                    queue.work.delete.retain(|key| !taken.contains(key));
                }
            }
            Change::OffloadEnabled { client } => {
                self.offload.lock().entry(client).or_default();
            }
            Change::Mounted(image) => {
                self.segments.mount_copy(&image, None);
            }
            Change::Remounted(image) => {
                if let Some(segment) = self
                    .segments
                    .remount(image.id, image.owner, &image.endpoint)
                {
                    self.rebind_replicas(&segment);
                }
            }
            Change::Unmounted { id } => {
                // Its waiting frees went with it (a later segment may reuse the id).
                self.leader_deferred
                    .lock()
                    .retain(|&(segment, _), _| segment != id);
                let _ = self.unmount_segment(id);
            }
            Change::Allocated(space) => {
                if let Some(segment) = self.segments.get(space.segment)
                    && !segment.reserve(allocation(space))
                {
                    tracing::error!(
                        ?space,
                        "the leader allocated space this standby sees in use; resynchronising is advised"
                    );
                }
            }
            Change::Freed(space) => {
                self.leader_deferred
                    .lock()
                    .remove(&(space.segment, space.offset));
                if let Some(segment) = self.segments.get(space.segment) {
                    segment.free(allocation(space));
                }
            }
            Change::Task(image) => self.apply_task(image, now),
            Change::Deferred {
                spaces,
                release_in_ms,
            } => {
                let at = now + Duration::from_millis(release_in_ms);
                let mut deferred = self.leader_deferred.lock();
                for space in spaces {
                    deferred.insert((space.segment, space.offset), (space.len, at));
                }
            }
        }
    }

    /// Sets the entry of `key` to `image` (`None`, or no replica left: removes it).
    fn put_image(&self, key: &str, image: Option<ObjectImage>, now: Instant) {
        let mut shard = self.shard(key).lock();
        let Some(image) = image else {
            shard.remove(key);
            return;
        };
        let readable = image.readable.and_then(|v| self.version_from(v));
        let pending = image.pending.and_then(|p| {
            let version = self.version_from(p.version)?;
            self.write_ids.fetch_max(p.write_id, Ordering::Relaxed);
            Some(Box::new(PendingWrite {
                version,
                started: now
                    .checked_sub(Duration::from_millis(p.age_ms))
                    .unwrap_or(now),
                soft_pin: p.soft_pin_ms.map(|pin| pin.map(Duration::from_millis)),
                write_id: p.write_id,
            }))
        });
        if readable.is_none() && pending.is_none() {
            shard.remove(key);
            return;
        }
        let mut entry = ObjectEntry::new(now);
        entry.readable = readable;
        entry.pending = pending;
        if image.hard_pinned {
            entry.pin_hard();
        }
        if image.soft_pin_left_ms > 0 {
            let left = Duration::from_millis(u64::from(image.soft_pin_left_ms));
            entry.set_soft_pin(Some(now + left));
        }
        shard.insert(key.into(), entry);
    }

    /// A version on the segments this master has mounted (replicas on others dropped).
    fn version_from(&self, image: VersionImage) -> Option<Version> {
        let replicas: Vec<StoredReplica> = image
            .replicas
            .iter()
            .filter_map(|r| {
                Some(StoredReplica {
                    segment: self.segments.get(r.segment)?,
                    allocation: allocation(*r),
                })
            })
            .collect();
        (!replicas.is_empty()).then(|| Version {
            size: image.size,
            replicas: replicas.into(),
        })
    }

    /// Becomes the leader of a new term: from now on changes go to `journal`. What the
    /// predecessor may have granted is honoured conservatively: every object is held
    /// for one read lease (no eviction, no unforced removal, space not reused), copy
    /// and move tasks carry on (queued ones are handed out, running ones are finished
    /// by their executors' reports; their timeouts count from when this master learned
    /// of them), every
    /// segment owner counts as alive from now, objects not on disk yet are queued for
    /// their owner's SSD tier again, and writes in progress keep their age (they are
    /// discarded like any abandoned write).
    pub fn take_over(&self, journal: Arc<Journal>) {
        let now = self.clock.now();
        let hold = now + self.config.default_kv_lease_ttl;
        let mut readable = Vec::new();
        for shard in self.shards.iter() {
            for (key, entry) in shard.lock().iter_mut() {
                entry.hold_lease_until(hold);
                if let Some(version) = &entry.readable
                    && let Some(first) = version.replicas.iter().next()
                {
                    readable.push((key.to_string(), version.size, first.segment.owner));
                }
            }
        }
        for segment in self.segments.all() {
            if segment.owner != LOCAL_OWNER {
                self.clients.touch(segment.owner, now);
            }
        }
        self.hold_task_objects();
        let _ = self.segments.start_journal(journal);
        // The disk copies came with the state: what the nodes report from now on is
        // checked against them.
        for queue in self.offload.lock().values_mut() {
            queue.disk_known = true;
        }
        self.adopt_leader_deferred(now);
        *self.abandoned_scan_due.lock() = None;
        if self.config.enable_offload && !self.config.offload_on_evict {
            for (key, size, owner) in readable {
                if self.disk_copy(&key).is_none() {
                    self.queue_offload(&key, size, owner);
                }
            }
        }
    }

    /// Frees, when due, the space the previous leader was waiting to free (a standby
    /// taking over): without this it would stay allocated for good.
    fn adopt_leader_deferred(&self, now: Instant) {
        let waiting: Vec<_> = self.leader_deferred.lock().drain().collect();
        for ((segment, offset), (len, release_at)) in waiting {
            let Some(segment) = self.segments.get(segment) else {
                continue;
            };
            let replica = StoredReplica {
                segment,
                allocation: Allocation { offset, len },
            };
            self.defer_or_free(vec![replica], release_at, now);
        }
    }
}

fn allocation(space: ReplicaSpace) -> Allocation {
    Allocation {
        offset: space.offset,
        len: space.len,
    }
}
