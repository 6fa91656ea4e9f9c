//! The SSD tier on the master's side: which objects have a copy on which real client's
//! disk, and the work queued for each real client (objects to write, files to delete).
//!
//! A real client with the tier enabled registers with
//! [`enable_offload`](MasterService::enable_offload). Each completed write whose first
//! replica lies in its segment is queued for it; the real client fetches the queue
//! ([`offload_fetch`](MasterService::offload_fetch)), reads the objects from its own
//! segment under a read lease, writes them to disk and reports them
//! ([`offload_done`](MasterService::offload_done)). From then on the object survives
//! memory eviction: once no memory replica is left, readers get a
//! [`ReplicaLocation::Disk`] descriptor pointing at the owner. Disk copies leave the index
//! before their files are deleted ([`disk_evicted`](MasterService::disk_evicted));
//! removal queues the deletion of the file on the owner.

use std::collections::{HashMap, HashSet};

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::OffloadWork;
use mooncake_core::master_api::replication::Change;
use mooncake_core::types::{ReplicaDescriptor, ReplicaLocation, ReplicaStatus};

use super::MasterService;
use crate::objects::ObjectEntry;

/// Where an object's disk copy is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskCopy {
    /// The real client holding it.
    pub owner: u128,
    /// Object size.
    pub size: u64,
}

/// One real client's queue: work not fetched yet, and objects fetched but not reported.
#[derive(Debug, Default)]
pub(super) struct ClientQueue {
    pub(super) work: OffloadWork,
    in_flight: HashSet<String>,
    /// Keys in flight whose object was removed or replaced meanwhile: the copy being
    /// written is of a version that is gone, and must not become the key's disk copy.
    superseded: HashSet<String>,
    /// This master knows every copy on the client's disk (it took the disk over from
    /// the client's previous instance, or took over from a leader that knew it): a
    /// reported file it did not hand out and has no record of is a stale one (of an
    /// object removed or replaced while its deletion or report was lost with a
    /// process), deleted, never recorded. Otherwise (a master that started empty)
    /// every reported file is taken as a copy.
    pub(super) disk_known: bool,
}

/// The queues of every real client with the tier enabled.
pub(super) type OffloadQueues = parking_lot::Mutex<HashMap<u128, ClientQueue>>;

/// Disk copies, sharded like the object table.
pub(super) type DiskShard = parking_lot::Mutex<HashMap<Box<str>, DiskCopy>>;

impl MasterService {
    pub(super) fn disk_shard(&self, key: &str) -> &DiskShard {
        &self.disk[self.shard_index(key)]
    }

    /// The disk copy of `key`, if any.
    pub(super) fn disk_copy(&self, key: &str) -> Option<DiskCopy> {
        if !self.config.enable_offload {
            return None; // no SSD tier can register: nothing to look up
        }
        self.disk_shard(key).lock().get(key).copied()
    }

    /// Registers real client `client`'s SSD tier; `UNABLE_OFFLOAD` when this master
    /// runs without `--enable_offload`.
    pub fn enable_offload(&self, client: u128) -> CodeResult<()> {
        if !self.config.enable_offload {
            return Err(ErrorCode::UNABLE_OFFLOAD);
        }
        self.offload.lock().entry(client).or_default();
        self.note(|| Change::OffloadEnabled { client });
        Ok(())
    }

    /// Queues a completed write for the SSD tier of the owner of its first replica;
    /// the object stays in memory (not evicted) until the owner reports it.
    pub(super) fn queue_offload(&self, key: &str, size: u64, owner: u128) {
        if !self.config.enable_offload {
            return;
        }
        let mut shard = self.shard(key).lock();
        let Some(entry) = shard.get_mut(key) else {
            return;
        };
        if entry.readable.as_ref().is_none_or(|v| v.size != size) {
            return;
        }
        if let Some(queue) = self.offload.lock().get_mut(&owner) {
            queue.work.store.push((key.to_string(), size));
            entry.set_offload_pending(true);
        }
    }

    /// With `--offload_on_evict`: queues an object chosen for eviction for the SSD tier
    /// of its owner instead of dropping it, when it has no disk copy yet and the owner
    /// has a tier. It leaves memory once written. Returns whether it was queued.
    pub(crate) fn offload_instead_of_evicting(&self, key: &str, entry: &mut ObjectEntry) -> bool {
        if !(self.config.enable_offload && self.config.offload_on_evict)
            || self.disk_copy(key).is_some()
        {
            return false;
        }
        let Some((size, owner)) = entry.readable.as_ref().and_then(|v| {
            let owner = v.replicas.iter().next()?.segment.owner;
            Some((v.size, owner))
        }) else {
            return false;
        };
        let mut queues = self.offload.lock();
        let Some(queue) = queues.get_mut(&owner) else {
            return false;
        };
        queue.work.store.push((key.to_string(), size));
        entry.set_offload_pending(true);
        true
    }

    /// Lets `key` leave memory again (its SSD tier write ended, or will not happen).
    fn clear_offload_pending(&self, key: &str) {
        if let Some(entry) = self.shard(key).lock().get_mut(key) {
            entry.set_offload_pending(false);
        }
    }

    /// Drops `key`'s disk copy (it was removed or replaced) and queues the deletion of
    /// its file on the owner.
    pub(super) fn drop_disk_copy(&self, key: &str) -> bool {
        if !self.config.enable_offload {
            return false;
        }
        self.supersede_in_flight(key);
        let Some(copy) = self.remove_disk_copy(key, None) else {
            return false;
        };
        self.queue_delete(copy.owner, key);
        true
    }

    /// Queues the deletion of `key`'s file on `client`'s disk, journaled: a standby
    /// that takes over has it queued too, so the file never comes back with the disk
    /// `client` reports.
    fn queue_delete(&self, client: u128, key: &str) {
        if let Some(queue) = self.offload.lock().get_mut(&client) {
            queue.work.delete.push(key.to_string());
            self.note(|| Change::DiskDeleteQueued {
                client,
                key: key.to_string(),
            });
        }
    }

    /// Marks `key` superseded wherever a copy of it is being written to disk (its
    /// object was removed or replaced): that copy is deleted when reported, never
    /// recorded (it would bring back a removed object, or an old version).
    fn supersede_in_flight(&self, key: &str) {
        for queue in self.offload.lock().values_mut() {
            if queue.in_flight.contains(key) {
                queue.superseded.insert(key.to_string());
            }
        }
    }

    /// Takes the queued work of `client` (at most `max` objects to write);
    /// `SEGMENT_NOT_FOUND` when the client is not registered (this master restarted:
    /// register again and report the objects on disk).
    pub fn offload_fetch(&self, client: u128, max: usize) -> CodeResult<OffloadWork> {
        let mut queues = self.offload.lock();
        let queue = queues
            .get_mut(&client)
            .ok_or(ErrorCode::SEGMENT_NOT_FOUND)?;
        let take = queue.work.store.len().min(max);
        let store: Vec<(String, u64)> = queue.work.store.drain(..take).collect();
        queue.in_flight.extend(store.iter().map(|(k, _)| k.clone()));
        let delete = std::mem::take(&mut queue.work.delete);
        if !delete.is_empty() {
            self.note(|| Change::DiskDeletesFetched {
                client,
                keys: delete.clone(),
            });
        }
        Ok(OffloadWork { store, delete })
    }

    /// Records objects real client `client` has on disk (after writing them, or all of
    /// them after a restart of either side); a size of 0 reports an object fetched but
    /// not written. A report for an object that now has a different size (replaced
    /// meanwhile) is refused and its file queued for deletion.
    pub fn offload_done(&self, client: u128, objects: &[(String, u64)]) -> CodeResult<()> {
        // Per object: superseded (its file is to be deleted), its file is to be deleted
        // already, or it is to be checked against the records (not handed out by
        // this master to this client, whose disk it knows).
        let skipped: Vec<(bool, bool, bool)> = {
            let mut queues = self.offload.lock();
            let queue = queues
                .get_mut(&client)
                .ok_or(ErrorCode::SEGMENT_NOT_FOUND)?;
            objects
                .iter()
                .map(|(key, _)| {
                    let handed_out = queue.in_flight.remove(key);
                    // A file the client is yet to delete (its object was removed) is
                    // no copy either, when a restarted client reports its disk.
                    (
                        queue.superseded.remove(key),
                        queue.work.delete.contains(key),
                        !handed_out && queue.disk_known,
                    )
                })
                .collect()
        };
        for ((key, size), (superseded, deleting, unverified)) in objects.iter().zip(skipped) {
            if self.check_key(key).is_err() {
                continue;
            }
            if unverified && !deleting {
                let recorded = self
                    .disk_copy(key)
                    .is_some_and(|copy| copy.owner == client && copy.size == *size);
                if !recorded && *size != 0 {
                    self.queue_delete(client, key);
                }
                continue;
            }
            if superseded || deleting {
                if superseded && !deleting && *size != 0 {
                    self.queue_delete(client, key);
                }
                continue;
            }
            let current = self.object_size_in_memory(key);
            if current.is_none_or(|s| s == *size || *size == 0) {
                self.clear_offload_pending(key);
            }
            if *size == 0 {
                continue;
            }
            if current.is_some_and(|s| s != *size) {
                self.queue_delete(client, key);
                continue;
            }
            let mut shard = self.disk_shard(key).lock();
            shard.insert(
                key.as_str().into(),
                DiskCopy {
                    owner: client,
                    size: *size,
                },
            );
            self.note(|| Change::Disk {
                key: key.clone(),
                copy: Some((client, *size)),
            });
        }
        Ok(())
    }

    /// Removes `key`'s disk copy (only `owner`'s when given), journaling it.
    fn remove_disk_copy(&self, key: &str, owner: Option<u128>) -> Option<DiskCopy> {
        let mut shard = self.disk_shard(key).lock();
        if owner.is_some_and(|owner| shard.get(key).is_none_or(|c| c.owner != owner)) {
            return None;
        }
        let copy = shard.remove(key)?;
        self.note(|| Change::Disk {
            key: key.to_string(),
            copy: None,
        });
        Some(copy)
    }

    /// Forgets disk copies `client` is about to delete (its disk eviction).
    pub fn disk_evicted(&self, client: u128, keys: &[String]) {
        for key in keys {
            self.remove_disk_copy(key, Some(client));
        }
    }

    /// Gives the SSD tier of `old`, a real client that restarted as `new` on the same
    /// node (it took its segment back), to `new`: `old`'s disk copies are `new`'s (the
    /// same files), so they stay readable through the restart; the files `old` was yet
    /// to delete (objects removed while it was down) are `new`'s to delete, and are no
    /// copies when `new` reports its disk; the writes `old` was yet to do will not
    /// happen (those objects may leave memory again).
    pub(super) fn hand_over_disk(&self, old: u128, new: u128) {
        let Some(deletes) = self.drop_queue(old) else {
            return;
        };
        let mut queues = self.offload.lock();
        let taken_over = queues.entry(new).or_default();
        taken_over.work.delete.extend(deletes);
        taken_over.disk_known = true;
        drop(queues);
        self.reassign_disk(old, new);
        self.note(|| Change::DiskHandedOver { old, new });
    }

    /// Removes `client`'s queue; its pending writes will not happen, so those objects
    /// may leave memory again. Returns the files it was yet to delete (`None`: it had
    /// no queue).
    fn drop_queue(&self, client: u128) -> Option<Vec<String>> {
        let queue = self.offload.lock().remove(&client)?;
        for key in queue.in_flight {
            self.clear_offload_pending(&key);
        }
        for (key, _) in queue.work.store {
            self.clear_offload_pending(&key);
        }
        Some(queue.work.delete)
    }

    /// Makes every disk copy of `old` one of `new`.
    pub(super) fn reassign_disk(&self, old: u128, new: u128) {
        for shard in self.disk.iter() {
            for copy in shard.lock().values_mut() {
                if copy.owner == old {
                    copy.owner = new;
                }
            }
        }
    }

    /// Forgets the SSD tier of a real client that went away (its disk copies come back
    /// when it registers again).
    pub(super) fn forget_disk_of(&self, client: u128) {
        if self.drop_queue(client).is_none() {
            return;
        }
        for shard in self.disk.iter() {
            shard.lock().retain(|_, copy| copy.owner != client);
        }
        self.note(|| Change::DiskClientGone { client });
    }

    /// A descriptor of `key`'s disk copy, when its owner is mounted.
    pub(super) fn disk_descriptor(&self, key: &str) -> Option<ReplicaDescriptor> {
        let copy = self.disk_copy(key)?;
        let segment = self
            .segments
            .owned_by(copy.owner)
            .first()
            .and_then(|id| self.segments.get(*id))?;
        Some(ReplicaDescriptor {
            location: ReplicaLocation::Disk {
                segment_name: segment.name.clone(),
                endpoint: segment.endpoint.clone(),
            },
            size: copy.size,
            status: ReplicaStatus::Complete,
            grant: None,
        })
    }

    /// Keys with a disk copy that `matches` accepts.
    pub(super) fn disk_keys_matching(&self, matches: &dyn Fn(&str) -> bool) -> Vec<String> {
        let mut keys = Vec::new();
        if !self.config.enable_offload {
            return keys;
        }
        for shard in self.disk.iter() {
            keys.extend(
                shard
                    .lock()
                    .keys()
                    .filter(|k| matches(k))
                    .map(|k| k.to_string()),
            );
        }
        keys
    }

    /// Objects with a disk copy.
    pub(super) fn disk_objects(&self) -> u64 {
        self.disk.iter().map(|s| s.lock().len() as u64).sum()
    }
}
