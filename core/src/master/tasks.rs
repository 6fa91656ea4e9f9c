//! Copy and move tasks: requests to place an object's replica on other segments.
//!
//! The master validates a task when it is created (the key must be readable, every
//! target segment mounted) so a task that can never run is an error at once, not a task
//! that hangs. A target that already holds a replica needs no work.

use std::collections::HashMap;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// What a task does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskKind {
    /// Add replicas on the target segments.
    Copy,
    /// Move the replica from a source segment to a target segment.
    Move,
}

/// Progress of a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum TaskStatus {
    /// Waiting for its executor.
    Pending,
    /// Being executed.
    Running,
    /// Done.
    Success,
    /// Failed with the given error code value.
    Failed(i32),
}

/// A task as reported by `query_task`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskInfo {
    /// Task id.
    pub id: u128,
    /// Copy or move.
    pub kind: TaskKind,
    /// The object.
    pub key: String,
    /// Target segment names.
    pub targets: Vec<String>,
    /// Progress.
    pub status: TaskStatus,
}

/// Every task the master knows, by id.
#[derive(Debug, Default)]
pub struct TaskTable {
    tasks: Mutex<HashMap<u128, TaskInfo>>,
}

impl TaskTable {
    /// Records a task.
    pub fn insert(&self, info: TaskInfo) {
        self.tasks.lock().insert(info.id, info);
    }

    /// The task with this id.
    pub fn get(&self, id: u128) -> Option<TaskInfo> {
        self.tasks.lock().get(&id).cloned()
    }
}
