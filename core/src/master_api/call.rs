//! The master's calls, declared once: [`MasterRequest`] (what is asked),
//! [`MasterResponse`] (what is answered, the same variant) and [`MasterCall`] (which
//! call, without its arguments). Every implementation of [`Master`](super::Master)
//! answers a request with one `match`; transports forward the enum as it is; callers
//! use the typed helpers of [`MasterExt`](super::MasterExt).
//!
//! Adding a call: one entry in the table below, one arm in `MasterService::handle`, one
//! helper in `MasterExt`, one conformance scenario.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::wire::{ClientStatus, MasterStats, OffloadWork, PutStarted, TaskInfo, TaskWork};
use super::{LeaseBudget, LeasedReplicas};
use crate::error::{CodeResult, ErrorCode};
use crate::types::{ReplicaDescriptor, ReplicateConfig, SegmentId, WriteMode};

/// What a call does to the master's state; decides how it is served.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// Changes nothing a standby keeps; answered at once.
    Read,
    /// Changes the index; under high availability answered once replicated.
    Write,
    /// Changes the index and walks all of it: served off the connection's task.
    IndexScan,
}

/// An answer of a master call: one result, or one result per item of a batch.
pub trait Answer: Sized {
    /// The answer that fails a call of `items` items with `code`.
    fn failed(code: ErrorCode, items: usize) -> Self;
    /// Whether it has the shape of an answer to `items` items.
    fn fits(&self, items: usize) -> bool;
    /// Calls `each` with every result's outcome, in order.
    fn for_each_outcome(&self, each: &mut dyn FnMut(Result<(), ErrorCode>));
}

impl<T> Answer for CodeResult<T> {
    fn failed(code: ErrorCode, _items: usize) -> Self {
        Err(code)
    }

    fn fits(&self, _items: usize) -> bool {
        true
    }

    fn for_each_outcome(&self, each: &mut dyn FnMut(Result<(), ErrorCode>)) {
        each(self.as_ref().map(|_| ()).map_err(|code| *code));
    }
}

impl<T> Answer for Vec<CodeResult<T>> {
    fn failed(code: ErrorCode, items: usize) -> Self {
        (0..items).map(|_| Err(code)).collect()
    }

    fn fits(&self, items: usize) -> bool {
        self.len() == items
    }

    fn for_each_outcome(&self, each: &mut dyn FnMut(Result<(), ErrorCode>)) {
        for result in self {
            result.for_each_outcome(each);
        }
    }
}

/// Which call a request or response is, and how many items it carries: enough to
/// answer it without its arguments (a transport failure, a refusal).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallShape {
    /// The call.
    pub call: MasterCall,
    /// Items of a batch call; 1 for the others.
    pub items: usize,
}

impl CallShape {
    /// The answer that fails this call (every item of a batch) with `code`.
    pub fn failed(self, code: ErrorCode) -> MasterResponse {
        self.call.failed(code, self.items)
    }

    /// Whether `response` answers this call: the same call, one result per item.
    pub fn answered_by(self, response: &MasterResponse) -> bool {
        response.call() == self.call && response.fits(self.items)
    }
}

/// Declares the master's calls: the request, response and call-id enums and what can
/// be said of a call without knowing which one it is.
macro_rules! master_calls {
    ($(
        $(#[doc = $doc:literal])*
        $call:ident ($kind:ident $(, batch $batch:ident)?)
            { $($field:ident: $ty:ty),* $(,)? } -> $answer:ty;
    )*) => {
        /// One call to a master, with its arguments (the helper of the same name in
        /// [`MasterExt`](super::MasterExt) documents each one).
        #[allow(missing_docs)]
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        pub enum MasterRequest {
            $( $(#[doc = $doc])* $call { $($field: $ty),* }, )*
        }

        /// The answer to a [`MasterRequest`]: the variant of the same name.
        #[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
        pub enum MasterResponse {
            $( $(#[doc = $doc])* $call($answer), )*
        }

        /// Which master call, without its arguments.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum MasterCall {
            $( $(#[doc = $doc])* $call, )*
        }

        impl MasterCall {
            /// Every call, in declaration order.
            pub const ALL: &[MasterCall] = &[$(MasterCall::$call),*];

            /// The call's name, as logs show it.
            pub fn name(self) -> &'static str {
                match self { $( MasterCall::$call => stringify!($call), )* }
            }

            /// What the call does to the master's state.
            pub fn kind(self) -> CallKind {
                match self { $( MasterCall::$call => CallKind::$kind, )* }
            }

            /// The answer that fails a call of `items` items with `code`.
            pub fn failed(self, code: ErrorCode, items: usize) -> MasterResponse {
                match self {
                    $( MasterCall::$call => MasterResponse::$call(Answer::failed(code, items)), )*
                }
            }
        }

        impl MasterRequest {
            /// Which call this is and how many items it carries.
            pub fn shape(&self) -> CallShape {
                match self {
                    $( MasterRequest::$call { $($batch,)? .. } => CallShape {
                        call: MasterCall::$call,
                        items: master_calls!(@items $($batch)?),
                    }, )*
                }
            }
        }

        impl MasterResponse {
            /// Which call this answers.
            pub fn call(&self) -> MasterCall {
                match self { $( MasterResponse::$call(_) => MasterCall::$call, )* }
            }

            /// Whether it has the shape of an answer to `items` items.
            pub fn fits(&self, items: usize) -> bool {
                match self { $( MasterResponse::$call(answer) => answer.fits(items), )* }
            }

            /// Calls `each` with every result's outcome, in order.
            pub fn for_each_outcome(&self, mut each: impl FnMut(Result<(), ErrorCode>)) {
                match self {
                    $( MasterResponse::$call(answer) => answer.for_each_outcome(&mut each), )*
                }
            }
        }
    };
    (@items $batch:ident) => { $batch.len() };
    (@items) => { 1 };
}

master_calls! {
    /// Mounts a segment of `capacity` bytes owned by real client `client`; a nonzero
    /// `generation` names memory that outlives the process (a segment file), so that a
    /// restarted owner takes its objects back.
    MountSegment(Write) { client: u128, name: String, capacity: u64, endpoint: String, generation: u128 }
        -> CodeResult<SegmentId>;
    /// Unmounts every segment of `client`.
    UnmountClient(Write) { client: u128 } -> CodeResult<()>;
    /// Liveness of `client`.
    Heartbeat(Read) { client: u128 } -> CodeResult<ClientStatus>;
    /// Starts writes of `(key, size)` items.
    PutStart(Write, batch items) {
        items: Vec<(String, u64)>,
        config: ReplicateConfig,
        mode: WriteMode,
    } -> Vec<CodeResult<PutStarted>>;
    /// Completes writes named by `(key, write id)`.
    PutEnd(Write, batch items) { items: Vec<(String, u64)> } -> Vec<CodeResult<()>>;
    /// Abandons writes named by `(key, write id)`.
    PutRevoke(Write, batch items) { items: Vec<(String, u64)> } -> Vec<CodeResult<()>>;
    /// Completes writes started under a reserved name as `(reserved, write id, key)`.
    PutCommit(Write, batch items) { items: Vec<(String, u64, String)> }
        -> Vec<CodeResult<()>>;
    /// Replicas of readable objects, with a read lease.
    GetReplicaList(Read, batch keys) { keys: Vec<String>, lease: Option<Duration> }
        -> Vec<CodeResult<LeasedReplicas>>;
    /// Sizes of readable objects, leased within a budget.
    Exist(Read, batch keys) { keys: Vec<String>, budget: LeaseBudget }
        -> Vec<CodeResult<Option<u64>>>;
    /// Size of a readable object.
    ObjectSize(Read) { key: String } -> CodeResult<u64>;
    /// Replica descriptors, without a lease.
    ReplicaDesc(Read, batch keys) { keys: Vec<String> }
        -> Vec<CodeResult<Vec<ReplicaDescriptor>>>;
    /// Removes objects.
    Remove(Write, batch keys) { keys: Vec<String>, force: bool } -> Vec<CodeResult<()>>;
    /// Clears idle objects, whole or one segment's replicas.
    ClearReplicas(Write, batch keys) { keys: Vec<String>, segment: Option<String> }
        -> Vec<CodeResult<()>>;
    /// Removes a tenant's objects whose key matches a regex.
    RemoveByRegex(IndexScan) { tenant: String, pattern: String, force: bool }
        -> CodeResult<u64>;
    /// Removes every object of a tenant.
    RemoveAll(IndexScan) { tenant: String, force: bool } -> CodeResult<u64>;
    /// Creates a copy task.
    CreateCopyTask(Write) { key: String, targets: Vec<String>, id: u128 } -> CodeResult<u128>;
    /// Creates a move task.
    CreateMoveTask(Write) { key: String, source: String, target: String, id: u128 }
        -> CodeResult<u128>;
    /// The state of a task.
    QueryTask(Read) { id: u128 } -> CodeResult<TaskInfo>;
    /// Tasks for a real client to execute.
    FetchTasks(Write) { client: u128, max: u32 } -> CodeResult<Vec<TaskWork>>;
    /// The outcome of a task a real client executed.
    FinishTask(Write) { client: u128, id: u128, outcome: Result<(), i32> } -> CodeResult<()>;
    /// Registers a real client's SSD tier.
    EnableOffload(Write) { client: u128 } -> CodeResult<()>;
    /// Work queued for a real client's SSD tier.
    OffloadFetch(Read) { client: u128, max: u32 } -> CodeResult<OffloadWork>;
    /// Objects a real client has on disk.
    OffloadDone(Write) { client: u128, objects: Vec<(String, u64)> } -> CodeResult<()>;
    /// Disk copies a real client is about to delete.
    DiskEvicted(Write) { client: u128, keys: Vec<String> } -> CodeResult<()>;
    /// Object counts and segment usage.
    Stats(Read) {} -> CodeResult<MasterStats>;
    /// Whether the master answers now: one round trip, nothing changed.
    Ping(Read) {} -> CodeResult<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_batch_answer_has_one_error_per_item() {
        let request = MasterRequest::Remove {
            keys: vec!["a".into(), "b".into()],
            force: false,
        };
        let shape = request.shape();
        assert_eq!(shape.items, 2);
        let answer = shape.failed(ErrorCode::RPC_FAIL);
        assert!(shape.answered_by(&answer));
        assert_eq!(
            answer,
            MasterResponse::Remove(vec![Err(ErrorCode::RPC_FAIL), Err(ErrorCode::RPC_FAIL)])
        );
    }

    #[test]
    fn an_answer_of_another_call_or_length_does_not_answer() {
        let shape = MasterRequest::PutEnd {
            items: vec![("a".into(), 1)],
        }
        .shape();
        assert!(!shape.answered_by(&MasterResponse::PutRevoke(vec![Ok(())])));
        assert!(!shape.answered_by(&MasterResponse::PutEnd(vec![Ok(()), Ok(())])));
        assert!(shape.answered_by(&MasterResponse::PutEnd(vec![Ok(())])));
    }

    #[test]
    fn every_call_has_a_distinct_name_and_fails_as_itself() {
        let mut names = std::collections::HashSet::new();
        for &call in MasterCall::ALL {
            assert!(names.insert(call.name()));
            assert_eq!(call.failed(ErrorCode::RPC_FAIL, 3).call(), call);
        }
    }

    #[test]
    fn outcomes_are_listed_per_item() {
        let mut seen = Vec::new();
        MasterResponse::Exist(vec![Ok(Some(1)), Err(ErrorCode::OBJECT_NOT_FOUND)])
            .for_each_outcome(|outcome| seen.push(outcome));
        assert_eq!(seen, vec![Ok(()), Err(ErrorCode::OBJECT_NOT_FOUND)]);
    }
}
