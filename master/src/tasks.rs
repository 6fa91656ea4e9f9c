//! Copy and move tasks: requests to place an object's replica on other segments.
//!
//! The master validates a task when it is created (the key must be readable, every
//! target segment mounted) so a task that can never run is an error at once, not a task
//! that hangs. A target that already holds a replica needs no work. The rest is queued
//! for the real client that owns the source replica, which fetches it, copies the bytes
//! with its transfer engine and reports the outcome (see `MasterService::fetch_tasks`).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use parking_lot::Mutex;

use mooncake_core::master_api::replication::TaskImage;
use mooncake_core::master_api::{TaskInfo, TaskStatus};
use mooncake_core::types::SegmentId;

use super::objects::StoredReplica;

/// Most tasks kept once finished (the oldest are forgotten first).
pub const MAX_FINISHED_TASKS: usize = 10_000;

/// Most tasks waiting for or being executed at once.
pub const MAX_ACTIVE_TASKS: usize = 10_000;

/// A task and what the master holds for it.
#[derive(Debug)]
pub(super) struct TaskRecord {
    pub info: TaskInfo,
    /// The real client that executes it (the owner of the source segment).
    pub executor: u128,
    /// The segment whose replica is copied.
    pub source: SegmentId,
    /// When it was created, then when it started running (for the timeouts).
    pub since: Instant,
    /// Space allocated on the targets while it runs.
    pub allocated: Vec<StoredReplica>,
}

#[derive(Debug, Default)]
struct Tables {
    tasks: HashMap<u128, TaskRecord>,
    /// Pending task ids per executor, oldest first.
    queues: HashMap<u128, VecDeque<u128>>,
    /// Finished task ids, oldest first (bounded by [`MAX_FINISHED_TASKS`]).
    finished: VecDeque<u128>,
    /// Tasks not finished yet.
    active: usize,
}

/// Every task the master knows, by id, and the queue of each executor.
#[derive(Debug, Default)]
pub struct TaskTable {
    tables: Mutex<Tables>,
}

impl TaskTable {
    /// Records a finished task (no work was needed, or it could not be queued).
    pub(super) fn insert_finished(&self, info: TaskInfo) {
        let mut tables = self.tables.lock();
        let id = info.id;
        tables.tasks.insert(
            id,
            TaskRecord {
                info,
                executor: 0,
                source: 0,
                since: Instant::now(),
                allocated: Vec::new(),
            },
        );
        Self::remember_finished(&mut tables, id);
    }

    /// Queues a pending task for its executor; `false` when too many are active.
    pub(super) fn queue(&self, record: TaskRecord) -> bool {
        let mut tables = self.tables.lock();
        if tables.active >= MAX_ACTIVE_TASKS {
            return false;
        }
        let id = record.info.id;
        tables
            .queues
            .entry(record.executor)
            .or_default()
            .push_back(id);
        tables.tasks.insert(id, record);
        tables.active += 1;
        true
    }

    /// Whether a task with this id exists (finished or not).
    pub(super) fn contains(&self, id: u128) -> bool {
        self.tables.lock().tasks.contains_key(&id)
    }

    /// The task with this id.
    pub fn get(&self, id: u128) -> Option<TaskInfo> {
        self.tables.lock().tasks.get(&id).map(|r| r.info.clone())
    }

    /// Takes up to `max` pending tasks of `executor` (their records stay, marked running
    /// by the caller through [`start`](Self::start)).
    pub(super) fn take_queued(&self, executor: u128, max: usize) -> Vec<(u128, String, SegmentId)> {
        let mut tables = self.tables.lock();
        let Some(queue) = tables.queues.get_mut(&executor) else {
            return Vec::new();
        };
        let ids: Vec<u128> = (0..max).map_while(|_| queue.pop_front()).collect();
        if queue.is_empty() {
            tables.queues.remove(&executor);
        }
        ids.into_iter()
            .filter_map(|id| {
                let record = tables.tasks.get(&id)?;
                Some((id, record.info.key.clone(), record.source))
            })
            .collect()
    }

    /// Marks a task running with the space allocated for it.
    pub(super) fn start(&self, id: u128, allocated: Vec<StoredReplica>, now: Instant) {
        if let Some(record) = self.tables.lock().tasks.get_mut(&id) {
            record.info.status = TaskStatus::Running;
            record.since = now;
            record.allocated = allocated;
        }
    }

    /// Takes the allocations of an unfinished task of `executor` and records its
    /// outcome; `None` when there is no such task (unknown, finished, or another
    /// executor's).
    pub(super) fn finish(
        &self,
        id: u128,
        executor: Option<u128>,
        status: TaskStatus,
    ) -> Option<(TaskInfo, SegmentId, Vec<StoredReplica>)> {
        let mut tables = self.tables.lock();
        let record = tables.tasks.get_mut(&id)?;
        if record.info.status.is_finished() || executor.is_some_and(|e| e != record.executor) {
            return None;
        }
        record.info.status = status;
        let taken = (
            record.info.clone(),
            record.source,
            std::mem::take(&mut record.allocated),
        );
        let executor = record.executor;
        if let Some(queue) = tables.queues.get_mut(&executor) {
            queue.retain(|queued| *queued != id);
        }
        tables.active = tables.active.saturating_sub(1);
        Self::remember_finished(&mut tables, id);
        Some(taken)
    }

    /// Unfinished tasks executed by `executor`.
    pub(super) fn unfinished_of(&self, executor: u128) -> Vec<u128> {
        let tables = self.tables.lock();
        tables
            .tasks
            .values()
            .filter(|r| r.executor == executor && !r.info.status.is_finished())
            .map(|r| r.info.id)
            .collect()
    }

    /// Unfinished tasks pending longer than `pending` or running longer than `running`.
    pub(super) fn overdue(
        &self,
        now: Instant,
        pending: std::time::Duration,
        running: std::time::Duration,
    ) -> Vec<u128> {
        let tables = self.tables.lock();
        if tables.active == 0 {
            return Vec::new();
        }
        tables
            .tasks
            .values()
            .filter(|r| match r.info.status {
                TaskStatus::Pending => now.duration_since(r.since) > pending,
                TaskStatus::Running => now.duration_since(r.since) > running,
                _ => false,
            })
            .map(|r| r.info.id)
            .collect()
    }

    /// The task `id` as a leader streams it to its standbys.
    pub(super) fn image(&self, id: u128) -> Option<TaskImage> {
        self.tables.lock().tasks.get(&id).map(image_of)
    }

    /// Every task, finished ones included (a snapshot).
    pub(super) fn images(&self) -> Vec<TaskImage> {
        self.tables.lock().tasks.values().map(image_of).collect()
    }

    /// Keys of the unfinished tasks (their objects are held while the task runs).
    pub(super) fn unfinished_keys(&self) -> Vec<String> {
        let tables = self.tables.lock();
        tables
            .tasks
            .values()
            .filter(|r| !r.info.status.is_finished())
            .map(|r| r.info.key.clone())
            .collect()
    }

    /// Sets a task to its leader's state (a standby applying a change or a snapshot):
    /// queued for its executor while pending, its space held while running, among the
    /// finished ones once done. `allocated` is the image's space, resolved.
    pub(super) fn apply(&self, image: TaskImage, allocated: Vec<StoredReplica>, now: Instant) {
        let mut tables = self.tables.lock();
        let id = image.info.id;
        let was_active = tables
            .tasks
            .get(&id)
            .is_some_and(|r| !r.info.status.is_finished());
        let executor = image.executor;
        if let Some(queue) = tables.queues.get_mut(&executor) {
            queue.retain(|queued| *queued != id);
        }
        let status = image.info.status;
        tables.tasks.insert(
            id,
            TaskRecord {
                info: image.info,
                executor,
                source: image.source,
                since: now,
                allocated,
            },
        );
        match status {
            TaskStatus::Pending => tables.queues.entry(executor).or_default().push_back(id),
            TaskStatus::Running => {}
            _ => {
                if was_active || !tables.finished.contains(&id) {
                    Self::remember_finished(&mut tables, id);
                }
            }
        }
        let is_active = !status.is_finished();
        match (was_active, is_active) {
            (false, true) => tables.active += 1,
            (true, false) => tables.active = tables.active.saturating_sub(1),
            _ => {}
        }
    }

    /// Forgets every task (a standby installing a snapshot).
    pub(super) fn clear(&self) {
        *self.tables.lock() = Tables::default();
    }

    fn remember_finished(tables: &mut Tables, id: u128) {
        tables.finished.push_back(id);
        while tables.finished.len() > MAX_FINISHED_TASKS {
            if let Some(oldest) = tables.finished.pop_front() {
                tables.tasks.remove(&oldest);
            }
        }
    }
}

/// A task record as a leader streams it.
fn image_of(record: &TaskRecord) -> TaskImage {
    TaskImage {
        info: record.info.clone(),
        executor: record.executor,
        source: record.source,
        allocated: record.allocated.iter().map(StoredReplica::space).collect(),
    }
}
