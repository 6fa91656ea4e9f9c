//! Memory eviction and periodic maintenance of the master.
//!
//! Eviction frees space in near-LRU order: the read lease doubles as the recency stamp
//! (a read extends it, a write sets it to the write's end), so the objects whose lease
//! ended longest ago go first. It never takes a hard-pinned object, an object under a
//! read lease, or one with a write in progress; soft-pinned objects go only in a second
//! pass, when `allow_evict_soft_pinned_objects` is set and the first pass did not free
//! enough. Eviction counts bytes, not objects.

use std::sync::atomic::Ordering;
use std::time::Instant;

use mooncake_core::logging::{EVICTION_TARGET, monotonic_us};
use serde::{Deserialize, Serialize};

use super::objects::{ObjectEntry, Stamp};
use super::service::{MasterService, free_now};

/// What one eviction round did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EvictionReport {
    /// Objects evicted.
    pub objects: u64,
    /// Bytes freed (replica bytes, all replicas counted).
    pub bytes: u64,
    /// Objects queued for the SSD tier instead (`--offload_on_evict`); their bytes are
    /// freed once they are written.
    pub offloading: u64,
}

/// What one maintenance pass did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MaintenanceReport {
    /// Real clients declared dead (their segments were unmounted).
    pub dead_clients: Vec<u128>,
    /// Eviction done because memory use passed the high watermark.
    pub eviction: EvictionReport,
}

fn evictable(entry: &ObjectEntry, now: Instant, soft_pinned_pass: bool) -> bool {
    entry.is_readable()
        && entry.pending.is_none()
        && !entry.is_hard_pinned()
        && !entry.has_task()
        && !entry.is_offload_pending()
        && !entry.has_lease(now)
        && entry.is_soft_pinned(now) == soft_pinned_pass
}

fn replica_bytes(entry: &ObjectEntry) -> u64 {
    entry
        .readable
        .as_ref()
        .map_or(0, |v| v.replicas.iter().map(|r| r.allocation.len).sum())
}

impl MasterService {
    /// Evicts objects until at least `target` bytes are freed or nothing evictable is
    /// left.
    pub fn evict(&self, target: u64) -> EvictionReport {
        let now = self.clock.now();
        let mut report = self.evict_pass(target, now, false);
        if report.bytes < target && self.config.allow_evict_soft_pinned_objects {
            let second = self.evict_pass(target - report.bytes, now, true);
            report.objects += second.objects;
            report.bytes += second.bytes;
            report.offloading += second.offloading;
        }
        if report.objects > 0 {
            self.evicted_objects
                .fetch_add(report.objects, Ordering::Relaxed);
            tracing::info!(
                objects = report.objects,
                bytes = report.bytes,
                "evicted objects"
            );
        }
        report
    }

    fn evict_pass(&self, target: u64, now: Instant, soft_pinned: bool) -> EvictionReport {
        let mut candidates: Vec<(Stamp, usize, Box<str>)> = Vec::new();
        for (index, shard) in self.shards.iter().enumerate() {
            let shard = shard.lock();
            candidates.extend(
                shard
                    .iter()
                    .filter(|(_, e)| evictable(e, now, soft_pinned))
                    .map(|(k, e)| (e.last_used(), index, k.clone())),
            );
        }
        candidates.sort_unstable_by_key(|(stamp, _, _)| *stamp);
        let mut report = EvictionReport::default();
        for (_, index, key) in candidates {
            if report.bytes >= target {
                break;
            }
            let mut shard = self.shards[index].lock();
            // Re-check: the object may have been read or rewritten since the scan.
            if !shard
                .get(&key)
                .is_some_and(|e| evictable(e, now, soft_pinned))
            {
                continue;
            }
            // With --offload_on_evict, the victim goes to disk first (its bytes count
            // toward the target: they are freed once written).
            if let Some(entry) = shard.get_mut(&key)
                && self.offload_instead_of_evicting(&key, entry)
            {
                report.bytes += replica_bytes(entry);
                report.offloading += 1;
                continue;
            }
            // Recorded before the object leaves the index, under its shard's lock: no
            // read can find it gone earlier than the record's time.
            tracing::debug!(
                target: EVICTION_TARGET,
                key = ?key,
                monotonic_us = monotonic_us(),
                "evicted from memory"
            );
            if let Some(entry) = shard.remove(&key) {
                report.bytes += replica_bytes(&entry);
                report.objects += 1;
                if let Some(version) = entry.readable {
                    free_now(version.replicas.into_vec());
                }
                self.note_object(&key, None);
            }
        }
        report
    }

    /// Periodic work (every few tens of milliseconds): declares silent real clients
    /// dead, releases space whose hold expired, discards writes left unfinished past
    /// the release timeout, and evicts when memory use passes the high watermark.
    pub fn maintenance(&self) -> MaintenanceReport {
        // A leader's snapshot waits for the pass (its changes are journaled).
        let journal = self.journal().cloned();
        let _mutation = journal.as_ref().map(|j| j.mutation());
        self.maintenance_rounds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let now = self.clock.now();
        let dead_clients = self.clients.take_expired(now, self.config.client_ttl);
        for client in &dead_clients {
            self.client_went_silent(*client, now);
        }
        self.end_expired_graces(now);
        self.expire_tasks(now);
        self.release_deferred(now);
        self.discard_abandoned_writes(now);
        let (used, capacity) = self.segments.totals();
        #[expect(clippy::cast_precision_loss, reason = "ratios of byte counts")]
        let used_ratio = used as f64 / capacity.max(1) as f64;
        let mut eviction = EvictionReport::default();
        if capacity > 0 && used_ratio > self.config.eviction_high_watermark_ratio {
            let goal =
                (self.config.eviction_high_watermark_ratio - self.config.eviction_ratio).max(0.0);
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                clippy::cast_precision_loss,
                reason = "a byte target from ratios"
            )]
            let target = used.saturating_sub((capacity as f64 * goal) as u64);
            eviction = self.evict(target);
        }
        MaintenanceReport {
            dead_clients,
            eviction,
        }
    }

    /// Writes started longer than the release timeout ago are abandoned: their space is
    /// freed (no writer can still be copying after that long). The whole index is
    /// scanned only when the oldest write in progress at the previous scan (or one
    /// started since) can have passed the timeout, so a busy master with millions of
    /// objects does not scan them at every pass.
    pub(super) fn discard_abandoned_writes(&self, now: Instant) {
        let limit = self.config.put_start_release_timeout;
        let mut due = self.abandoned_scan_due.lock();
        if due.is_some_and(|due| now < due) {
            return;
        }
        // Writes started after this scan cannot expire before `now + limit`.
        let mut oldest = now;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let mut discarded = Vec::new();
            shard.retain(|key, entry| {
                if entry
                    .pending
                    .as_ref()
                    .is_some_and(|p| now.duration_since(p.started) > limit)
                    && let Some(pending) = entry.pending.take()
                {
                    free_now(pending.version.replicas.into_vec());
                    discarded.push(key.clone());
                }
                if let Some(pending) = &entry.pending {
                    oldest = oldest.min(pending.started);
                }
                entry.readable.is_some() || entry.pending.is_some()
            });
            for key in discarded {
                self.note_object(&key, shard.get(&key));
            }
        }
        // Just past the deadline: a write is abandoned once *more* than `limit` old.
        *due = oldest
            .checked_add(limit)
            .and_then(|at| at.checked_add(std::time::Duration::from_millis(1)));
    }
}
