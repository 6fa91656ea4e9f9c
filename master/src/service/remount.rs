//! A crashed real client taking its segment back: a segment in a file that outlives
//! the process (`mooncake_client --segment_path`) is not unmounted at once when its
//! owner goes silent; for `--remount_grace` after `--client_ttl` nothing new is placed
//! on it and its objects stay, and an owner that mounts the same name with the same
//! file generation gets the segment back, objects and all.

use std::sync::Arc;
use std::time::Instant;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::types::SegmentId;

use super::MasterService;
use crate::segments::MountedSegment;

impl MasterService {
    /// Gives `stale` to its restarted owner `owner` (same file, proven by its
    /// generation): same id, same space, every object kept; writes in progress into it
    /// end as they would have (their writers fail and revoke them, or they are
    /// discarded as abandoned).
    pub(super) fn take_back(
        &self,
        stale: &MountedSegment,
        owner: u128,
        endpoint: &str,
    ) -> CodeResult<SegmentId> {
        let old_owner = stale.owner;
        self.clients.remove(old_owner);
        self.fail_tasks_of(old_owner);
        self.hand_over_disk(old_owner, owner);
        let segment = self
            .segments
            .remount(stale.id, owner, endpoint)
            .ok_or(ErrorCode::SEGMENT_NOT_FOUND)?;
        let objects = self.rebind_replicas(&segment);
        self.clients.touch(owner, self.clock.now());
        tracing::info!(
            segment = %segment.name,
            id = segment.id,
            objects,
            endpoint,
            "a restarted real client took its segment back (same segment file): its objects are kept"
        );
        Ok(segment.id)
    }

    /// Points every replica in `segment`'s id at `segment` (after a remount); answers
    /// how many objects have one.
    pub(crate) fn rebind_replicas(&self, segment: &Arc<MountedSegment>) -> u64 {
        let mut objects = 0;
        for shard in self.shards.iter() {
            for entry in shard.lock().values_mut() {
                let mut here = false;
                let versions = entry
                    .readable
                    .iter_mut()
                    .chain(entry.pending.iter_mut().map(|p| &mut p.version));
                for version in versions {
                    for replica in version.replicas.as_mut_slice() {
                        if replica.segment.id == segment.id {
                            replica.segment = Arc::clone(segment);
                            here = true;
                        }
                    }
                }
                objects += u64::from(here);
            }
        }
        objects
    }

    /// `client` stopped heartbeating: its segments are unmounted, or, when they all
    /// live in files and `--remount_grace` is set, kept for its return until the grace
    /// ends (no placements meanwhile).
    pub(crate) fn client_went_silent(&self, client: u128, now: Instant) {
        self.fail_tasks_of(client);
        let segments: Vec<Arc<MountedSegment>> = self
            .segments
            .owned_by(client)
            .into_iter()
            .filter_map(|id| self.segments.get(id))
            .collect();
        let grace = self.config.remount_grace;
        if !grace.is_zero() && !segments.is_empty() && segments.iter().all(|s| s.generation != 0) {
            tracing::warn!(
                client = %format!("{client:032x}"),
                ttl = ?self.config.client_ttl,
                ?grace,
                "real client stopped heartbeating; its segment files keep their objects for --remount_grace, for it to come back"
            );
            segments.iter().for_each(|s| s.await_owner());
            self.awaited.lock().push((client, now + grace));
            return;
        }
        tracing::warn!(client = %format!("{client:032x}"), ttl = ?self.config.client_ttl, "real client stopped heartbeating; unmounting its segments");
        for segment in segments {
            let _ = self.unmount_segment(segment.id);
        }
    }

    /// Unmounts the segments of silent clients whose grace ended without their return.
    pub(crate) fn end_expired_graces(&self, now: Instant) {
        let ended: Vec<u128> = {
            let mut awaited = self.awaited.lock();
            if awaited.is_empty() {
                return;
            }
            let (ended, waiting) = awaited.drain(..).partition(|(_, until)| *until <= now);
            *awaited = waiting;
            ended.into_iter().map(|(client, _)| client).collect()
        };
        for client in ended {
            let gone = self.segments.owned_by(client);
            if !gone.is_empty() {
                tracing::warn!(
                    client = %format!("{client:032x}"),
                    "the real client did not come back within --remount_grace; unmounting its segments"
                );
            }
            for id in gone {
                let _ = self.unmount_segment(id);
            }
        }
    }
}
