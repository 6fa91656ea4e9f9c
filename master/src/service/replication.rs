//! Copy and move tasks on the master's side: creation, hand-off to the executing real
//! client, completion, and cleanup when the executor dies or takes too long.
//!
//! While a task is unfinished its object is marked *replicating*: it cannot be removed
//! or upserted (`OBJECT_HAS_REPLICATION_TASK`) and eviction skips it, so the source
//! replica stays valid until the copy is done.

use std::time::Instant;

use crate::objects::{StoredReplica, Version, describe};
use crate::tasks::TaskRecord;
use mooncake_core::allocator::Allocation;
use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::replication::{Change, TaskImage};
use mooncake_core::master_api::{TaskInfo, TaskKind, TaskStatus, TaskWork};
use mooncake_core::protocol::grant::Access;
use mooncake_core::types::{ReplicaDescriptor, ReplicaStatus, SegmentId};

use super::{MasterService, free_now};

impl MasterService {
    /// Creates a task placing replicas of `key` on each of `targets` (segment names).
    /// Every target must be mounted (`SEGMENT_NOT_FOUND`) and the object readable.
    pub fn create_copy_task(&self, key: &str, targets: &[String], id: u128) -> CodeResult<u128> {
        if targets.is_empty() {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        self.create_task(key, TaskKind::Copy, None, targets, id)
    }

    /// Creates a task moving `key`'s replica from segment `source` to `target` (a move
    /// onto the source itself succeeds at once and changes nothing).
    pub fn create_move_task(
        &self,
        key: &str,
        source: &str,
        target: &str,
        id: u128,
    ) -> CodeResult<u128> {
        self.create_task(key, TaskKind::Move, Some(source), &[target.to_string()], id)
    }

    fn create_task(
        &self,
        key: &str,
        kind: TaskKind,
        source: Option<&str>,
        targets: &[String],
        id: u128,
    ) -> CodeResult<u128> {
        self.check_key(key)?;
        if self.tasks.contains(id) {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        let mut targets = targets.to_vec();
        targets.dedup();
        if let Some(missing) = targets.iter().find(|t| !self.segments.has_name(t)) {
            tracing::debug!(key, target = %missing, "task target is not a mounted segment");
            return Err(ErrorCode::SEGMENT_NOT_FOUND);
        }
        let now = self.clock.now();
        let mut shard = self.shard(key).lock();
        let entry = shard.get_mut(key).ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        if entry.has_task() {
            return Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK);
        }
        let lease_until = entry.lease_until();
        let version = entry
            .readable
            .as_mut()
            .ok_or(ErrorCode::REPLICA_IS_NOT_READY)?;
        let source_replica = match source {
            Some(name) => version
                .replicas
                .iter()
                .find(|r| r.segment.name == name)
                .ok_or(ErrorCode::REPLICA_NOT_FOUND)?,
            None => version
                .replicas
                .as_slice()
                .first()
                .ok_or(ErrorCode::REPLICA_NOT_FOUND)?,
        };
        let (source_id, executor) = (source_replica.segment.id, source_replica.segment.owner);
        let needs_copy = targets
            .iter()
            .any(|t| !version.replicas.iter().any(|r| r.segment.name == *t));
        let info = TaskInfo {
            id,
            kind,
            key: key.to_string(),
            targets,
            status: TaskStatus::Pending,
        };
        if !needs_copy {
            // Every target holds a replica already; a move only drops the source (and
            // a move onto its own source segment changes nothing).
            if kind == TaskKind::Move
                && source.is_some_and(|s| !info.targets.iter().any(|t| t == s))
            {
                self.drop_replica(version, source_id, lease_until, now);
                self.note_object(key, shard.get(key));
            }
            self.tasks.insert_finished(TaskInfo {
                status: TaskStatus::Success,
                ..info
            });
            self.note_task(id);
            return Ok(id);
        }
        let record = TaskRecord {
            info,
            executor,
            source: source_id,
            since: now,
            allocated: Vec::new(),
        };
        if !self.tasks.queue(record) {
            return Err(ErrorCode::TASK_PENDING_LIMIT_EXCEEDED);
        }
        entry.set_task(true);
        drop(shard);
        self.note_task(id);
        tracing::debug!(key, id = %format!("{id:032x}"), ?kind, "task queued");
        Ok(id)
    }

    /// The state of a task.
    pub fn query_task(&self, id: u128) -> CodeResult<TaskInfo> {
        self.tasks.get(id).ok_or(ErrorCode::TASK_NOT_FOUND)
    }

    /// Hands up to `max` pending tasks to real client `executor`, allocating space on
    /// their targets. A task that cannot start (the object or its source replica is
    /// gone, a target is full) fails here and is not returned.
    pub fn fetch_tasks(&self, executor: u128, max: usize) -> Vec<TaskWork> {
        let now = self.clock.now();
        self.tasks
            .take_queued(executor, max)
            .into_iter()
            .filter_map(
                |(id, key, source)| match self.start_task(id, &key, source, now) {
                    Ok(work) => Some(work),
                    Err(code) => {
                        self.end_task(id, None, TaskStatus::Failed(code.as_i32()));
                        None
                    }
                },
            )
            .collect()
    }

    fn start_task(
        &self,
        id: u128,
        key: &str,
        source: SegmentId,
        now: Instant,
    ) -> CodeResult<TaskWork> {
        let info = self.tasks.get(id).ok_or(ErrorCode::TASK_NOT_FOUND)?;
        let shard = self.shard(key).lock();
        let version = shard
            .get(key)
            .and_then(|e| e.readable.as_ref())
            .ok_or(ErrorCode::OBJECT_NOT_FOUND)?;
        let source_replica = version
            .replicas
            .iter()
            .find(|r| r.segment.id == source)
            .ok_or(ErrorCode::REPLICA_IS_GONE)?;
        let mut allocated = Vec::new();
        for name in &info.targets {
            if version.replicas.iter().any(|r| r.segment.name == *name) {
                continue;
            }
            let placed = self.segments.find_by_name(name).and_then(|segment| {
                let allocation = segment.allocate(version.size)?;
                Some(StoredReplica {
                    segment,
                    allocation,
                })
            });
            match placed {
                Some(replica) => allocated.push(replica),
                None => {
                    free_now(allocated);
                    return Err(if self.segments.has_name(name) {
                        ErrorCode::NO_AVAILABLE_HANDLE
                    } else {
                        ErrorCode::SEGMENT_NOT_FOUND
                    });
                }
            }
        }
        let source = describe(
            std::slice::from_ref(source_replica),
            version.size,
            ReplicaStatus::Complete,
        )
        .pop()
        .ok_or(ErrorCode::INTERNAL_ERROR)?;
        let targets: Vec<ReplicaDescriptor> =
            describe(&allocated, version.size, ReplicaStatus::Processing);
        self.tasks.start(id, allocated, now);
        self.note_task(id);
        let ttl = self.config.processing_task_timeout;
        let source = self
            .granted(key, vec![source], Access::Read, ttl)
            .pop()
            .ok_or(ErrorCode::INTERNAL_ERROR)?;
        Ok(TaskWork {
            id,
            kind: info.kind,
            key: key.to_string(),
            source,
            targets: self.granted(key, targets, Access::Write, ttl),
        })
    }

    /// Records the outcome reported by the task's executor: on success the new replicas
    /// become readable (and a move drops its source replica once read leases end); on
    /// failure (`Err(code)`) the space allocated for the task is freed.
    pub fn finish_task(
        &self,
        executor: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> CodeResult<()> {
        let status = match outcome {
            Ok(()) => TaskStatus::Success,
            Err(code) => TaskStatus::Failed(code),
        };
        if self.end_task(id, Some(executor), status) {
            Ok(())
        } else {
            Err(ErrorCode::TASK_NOT_FOUND)
        }
    }

    /// Finishes an unfinished task with `status` (checked against `executor` when
    /// given) and applies it to the object; false when there is no such task.
    pub(super) fn end_task(&self, id: u128, executor: Option<u128>, status: TaskStatus) -> bool {
        let Some((info, source, allocated)) = self.tasks.finish(id, executor, status) else {
            return false;
        };
        self.note_task(id);
        let now = self.clock.now();
        let mut shard = self.shard(&info.key).lock();
        let Some(entry) = shard.get_mut(info.key.as_str()) else {
            free_now(allocated);
            return true;
        };
        entry.set_task(false);
        if status != TaskStatus::Success {
            tracing::warn!(key = %info.key, ?status, "task failed");
            free_now(allocated);
            return true;
        }
        let lease_until = entry.lease_until();
        let Some(version) = entry.readable.as_mut() else {
            free_now(allocated);
            return true;
        };
        // Targets unmounted meanwhile are dropped; their space went with the segment.
        let (live, gone): (Vec<_>, Vec<_>) = allocated
            .into_iter()
            .partition(|r| self.segments.get(r.segment.id).is_some());
        drop(gone);
        let copied = !live.is_empty();
        version.replicas.extend(live);
        if info.kind == TaskKind::Move && copied {
            self.drop_replica(version, source, lease_until, now);
        }
        self.note_object(&info.key, shard.get(info.key.as_str()));
        true
    }

    /// Removes the replica on `segment` from `version` (never the last one); its space
    /// is freed once read leases granted before `lease_until` end.
    fn drop_replica(
        &self,
        version: &mut Version,
        segment: SegmentId,
        lease_until: Instant,
        now: Instant,
    ) {
        if version.replicas.len() < 2 {
            return;
        }
        let dropped = version.replicas.split_off(|r| r.segment.id != segment);
        self.defer_or_free(dropped, lease_until.max(now), now);
    }

    /// Streams task `id`'s state to the standbys (when this master leads them).
    fn note_task(&self, id: u128) {
        if let Some(journal) = self.segments.journal()
            && let Some(image) = self.tasks.image(id)
        {
            journal.record(Change::Task(image));
        }
    }

    /// A leader's task, applied by a standby: the space it names is resolved in this
    /// master's segments (already reserved through the leader's allocations).
    pub(super) fn apply_task(&self, image: TaskImage, now: Instant) {
        let allocated = image
            .allocated
            .iter()
            .filter_map(|space| {
                Some(StoredReplica {
                    segment: self.segments.get(space.segment)?,
                    allocation: Allocation {
                        offset: space.offset,
                        len: space.len,
                    },
                })
            })
            .collect();
        self.tasks.apply(image, allocated, now);
    }

    /// Holds the object of every unfinished task (a standby taking over: the flag is
    /// not part of the objects it received).
    pub(super) fn hold_task_objects(&self) {
        for key in self.tasks.unfinished_keys() {
            if let Some(entry) = self.shard(&key).lock().get_mut(key.as_str()) {
                entry.set_task(true);
            }
        }
    }

    /// Fails every unfinished task of a real client that went away.
    pub(crate) fn fail_tasks_of(&self, executor: u128) {
        for id in self.tasks.unfinished_of(executor) {
            self.end_task(
                id,
                None,
                TaskStatus::Failed(ErrorCode::REPLICA_IS_GONE.as_i32()),
            );
        }
    }

    /// Fails tasks left pending or running past their timeouts.
    pub(crate) fn expire_tasks(&self, now: Instant) {
        let overdue = self.tasks.overdue(
            now,
            self.config.pending_task_timeout,
            self.config.processing_task_timeout,
        );
        for id in overdue {
            self.end_task(
                id,
                None,
                TaskStatus::Failed(ErrorCode::RPC_TIMEOUT.as_i32()),
            );
        }
    }
}
