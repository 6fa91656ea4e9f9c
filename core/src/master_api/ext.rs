//! [`MasterExt`]: one typed helper per master call, for every [`Master`]. Each builds
//! the call's [`MasterRequest`], splits batches larger than [`MAX_MASTER_BATCH`], and
//! takes the answer out of the [`MasterResponse`].

use std::future::Future;
use std::time::Duration;

use super::call::{Answer, MasterRequest, MasterResponse};
use super::wire::{ClientStatus, MasterStats, OffloadWork, PutStarted, TaskInfo, TaskWork};
use super::{LeaseBudget, LeasedReplicas, MAX_MASTER_BATCH, Master};
use crate::error::{CodeResult, ErrorCode};
use crate::tenant::Tenant;
use crate::types::{ReplicaDescriptor, ReplicateConfig, SegmentId, WriteMode};

/// Takes the answer of call `$call` out of `$response`; an answer of another call or
/// shape (a faulty master) fails the `$items` items with `INTERNAL_ERROR`.
macro_rules! answer {
    ($response:expr, $call:ident, $items:expr) => {{
        let items = $items;
        match $response {
            MasterResponse::$call(answer) if answer.fits(items) => answer,
            other => {
                tracing::error!(
                    asked = stringify!($call),
                    answered = other.call().name(),
                    "a master answered another call"
                );
                Answer::failed(ErrorCode::INTERNAL_ERROR, items)
            }
        }
    }};
}

/// Sends `items` in calls of at most [`MAX_MASTER_BATCH`] items, one after another,
/// and joins their answers in order.
async fn chunked<I, T, F>(items: Vec<I>, mut call: impl FnMut(Vec<I>) -> F) -> Vec<CodeResult<T>>
where
    F: Future<Output = Vec<CodeResult<T>>>,
{
    if items.len() <= MAX_MASTER_BATCH {
        return call(items).await;
    }
    let mut results = Vec::with_capacity(items.len());
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        let chunk: Vec<I> = items.by_ref().take(MAX_MASTER_BATCH).collect();
        results.extend(call(chunk).await);
    }
    results
}

/// The typed calls of a [`Master`] (implemented for every one). Batch calls answer
/// one result per item, in order.
pub trait MasterExt: Master {
    /// Mounts a segment of `capacity` bytes owned by real client `client`, whose
    /// transfer engine listens at `endpoint`. A name another live client mounted is
    /// taken over (that client is told `Displaced`). A nonzero `generation` names a
    /// segment file: when the master still holds a segment of that name, size and
    /// generation (a restart after a crash, within `--remount_grace`), the new owner
    /// gets it back with its objects, under the same id.
    fn mount_segment(
        &self,
        client: u128,
        name: String,
        capacity: u64,
        endpoint: String,
        generation: u128,
    ) -> impl Future<Output = CodeResult<SegmentId>> + Send + '_ {
        let request = MasterRequest::MountSegment {
            client,
            name,
            capacity,
            endpoint,
            generation,
        };
        async move { answer!(self.call(request).await, MountSegment, 1) }
    }

    /// Unmounts every segment of `client` (its clean shutdown).
    fn unmount_client(&self, client: u128) -> impl Future<Output = CodeResult<()>> + Send + '_ {
        async move {
            let request = MasterRequest::UnmountClient { client };
            answer!(self.call(request).await, UnmountClient, 1)
        }
    }

    /// Liveness of `client`: `NeedRemount` when the master does not know it.
    fn heartbeat(
        &self,
        client: u128,
    ) -> impl Future<Output = CodeResult<ClientStatus>> + Send + '_ {
        async move {
            let request = MasterRequest::Heartbeat { client };
            answer!(self.call(request).await, Heartbeat, 1)
        }
    }

    /// Starts writes (puts or upserts) of `(key, size)` items.
    fn put_start(
        &self,
        items: Vec<(String, u64)>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> impl Future<Output = Vec<CodeResult<PutStarted>>> + Send + '_ {
        chunked(items, move |items| {
            let n = items.len();
            let request = MasterRequest::PutStart {
                items,
                config: config.clone(),
                mode,
            };
            async move { answer!(self.call(request).await, PutStart, n) }
        })
    }

    /// Completes writes, each named by `(key, write id)`.
    fn put_end(
        &self,
        items: Vec<(String, u64)>,
    ) -> impl Future<Output = Vec<CodeResult<()>>> + Send + '_ {
        chunked(items, move |items| {
            let n = items.len();
            async move { answer!(self.call(MasterRequest::PutEnd { items }).await, PutEnd, n) }
        })
    }

    /// Abandons writes, each named by `(key, write id)`: their space is freed.
    fn put_revoke(
        &self,
        items: Vec<(String, u64)>,
    ) -> impl Future<Output = Vec<CodeResult<()>>> + Send + '_ {
        chunked(items, move |items| {
            let n = items.len();
            let request = MasterRequest::PutRevoke { items };
            async move { answer!(self.call(request).await, PutRevoke, n) }
        })
    }

    /// Completes writes started under another name (a client's reservation), each named
    /// by `(reserved name, write id, key)`: the write becomes the readable object `key`.
    /// `OBJECT_ALREADY_EXISTS` when `key` exists (the reservation is left as it was).
    fn put_commit(
        &self,
        items: Vec<(String, u64, String)>,
    ) -> impl Future<Output = Vec<CodeResult<()>>> + Send + '_ {
        chunked(items, move |items| {
            let n = items.len();
            let request = MasterRequest::PutCommit { items };
            async move { answer!(self.call(request).await, PutCommit, n) }
        })
    }

    /// [`put_commit`](MasterExt::put_commit), running `work` (exactly once, whatever
    /// the outcome) while the request travels (see [`Master::call_during`]).
    fn put_commit_during<'a>(
        &'a self,
        items: Vec<(String, u64, String)>,
        work: Box<dyn FnOnce() + Send + 'a>,
    ) -> impl Future<Output = Vec<CodeResult<()>>> + Send + 'a {
        async move {
            if items.len() > MAX_MASTER_BATCH {
                work();
                return self.put_commit(items).await;
            }
            let n = items.len();
            let response = self
                .call_during(MasterRequest::PutCommit { items }, work)
                .await;
            answer!(response, PutCommit, n)
        }
    }

    /// The replicas of each readable object, with a read lease of `lease` (`None`: the
    /// master's default; a longer one than the default is cut to it).
    fn get_replica_list(
        &self,
        keys: Vec<String>,
        lease: Option<Duration>,
    ) -> impl Future<Output = Vec<CodeResult<LeasedReplicas>>> + Send + '_ {
        chunked(keys, move |keys| {
            let n = keys.len();
            let request = MasterRequest::GetReplicaList { keys, lease };
            async move { answer!(self.call(request).await, GetReplicaList, n) }
        })
    }

    /// The size of each readable key (`None`: not stored); the objects found are leased
    /// for the master's read lease within `budget` (see [`LeaseBudget`]). Batches
    /// larger than one call go one after another, each with what the ones before left
    /// of the budget.
    fn exist(
        &self,
        keys: Vec<String>,
        budget: LeaseBudget,
    ) -> impl Future<Output = Vec<CodeResult<Option<u64>>>> + Send + '_ {
        async move {
            if keys.len() <= MAX_MASTER_BATCH {
                let n = keys.len();
                let request = MasterRequest::Exist { keys, budget };
                return answer!(self.call(request).await, Exist, n);
            }
            let mut left = budget;
            let mut results = Vec::with_capacity(keys.len());
            let mut keys = keys.into_iter().peekable();
            while keys.peek().is_some() {
                let chunk: Vec<String> = keys.by_ref().take(MAX_MASTER_BATCH).collect();
                let n = chunk.len();
                let request = MasterRequest::Exist {
                    keys: chunk,
                    budget: left,
                };
                let found = answer!(self.call(request).await, Exist, n);
                for size in found
                    .iter()
                    .filter_map(|f| f.as_ref().ok().copied().flatten())
                {
                    left.take(size);
                }
                results.extend(found);
            }
            results
        }
    }

    /// The size of a readable object.
    fn object_size(&self, key: String) -> impl Future<Output = CodeResult<u64>> + Send + '_ {
        async move {
            answer!(
                self.call(MasterRequest::ObjectSize { key }).await,
                ObjectSize,
                1
            )
        }
    }

    /// The replica descriptors of each key, without a lease.
    fn replica_desc(
        &self,
        keys: Vec<String>,
    ) -> impl Future<Output = Vec<CodeResult<Vec<ReplicaDescriptor>>>> + Send + '_ {
        chunked(keys, move |keys| {
            let n = keys.len();
            let request = MasterRequest::ReplicaDesc { keys };
            async move { answer!(self.call(request).await, ReplicaDesc, n) }
        })
    }

    /// Removes objects (`force`: even while leased).
    fn remove(
        &self,
        keys: Vec<String>,
        force: bool,
    ) -> impl Future<Output = Vec<CodeResult<()>>> + Send + '_ {
        chunked(keys, move |keys| {
            let n = keys.len();
            let request = MasterRequest::Remove { keys, force };
            async move { answer!(self.call(request).await, Remove, n) }
        })
    }

    /// Clears objects nobody read or wrote for one lease TTL: their memory replicas on
    /// the segment named `segment`, or (`None`) the whole objects (upstream's
    /// `BatchReplicaClear`). One result per key: `OBJECT_HAS_LEASE` when it was used
    /// within the TTL, `OBJECT_NOT_FOUND` when it has no replica to clear.
    fn clear_replicas(
        &self,
        keys: Vec<String>,
        segment: Option<String>,
    ) -> impl Future<Output = Vec<CodeResult<()>>> + Send + '_ {
        chunked(keys, move |keys| {
            let n = keys.len();
            let request = MasterRequest::ClearReplicas {
                keys,
                segment: segment.clone(),
            };
            async move { answer!(self.call(request).await, ClearReplicas, n) }
        })
    }

    /// Removes the objects of `tenant` whose key (without the tenant's prefix) matches
    /// `pattern`; answers how many were removed.
    fn remove_by_regex(
        &self,
        tenant: Tenant,
        pattern: String,
        force: bool,
    ) -> impl Future<Output = CodeResult<u64>> + Send + '_ {
        let request = MasterRequest::RemoveByRegex {
            tenant: tenant.name().to_string(),
            pattern,
            force,
        };
        async move { answer!(self.call(request).await, RemoveByRegex, 1) }
    }

    /// Removes every object of `tenant`; answers how many were removed.
    fn remove_all(
        &self,
        tenant: Tenant,
        force: bool,
    ) -> impl Future<Output = CodeResult<u64>> + Send + '_ {
        let request = MasterRequest::RemoveAll {
            tenant: tenant.name().to_string(),
            force,
        };
        async move { answer!(self.call(request).await, RemoveAll, 1) }
    }

    /// Creates task `id`: copy `key` to the segments named `targets`.
    fn create_copy_task(
        &self,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> impl Future<Output = CodeResult<u128>> + Send + '_ {
        let request = MasterRequest::CreateCopyTask { key, targets, id };
        async move { answer!(self.call(request).await, CreateCopyTask, 1) }
    }

    /// Creates task `id`: move `key`'s replica from segment `source` to `target`.
    fn create_move_task(
        &self,
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> impl Future<Output = CodeResult<u128>> + Send + '_ {
        let request = MasterRequest::CreateMoveTask {
            key,
            source,
            target,
            id,
        };
        async move { answer!(self.call(request).await, CreateMoveTask, 1) }
    }

    /// The state of a task.
    fn query_task(&self, id: u128) -> impl Future<Output = CodeResult<TaskInfo>> + Send + '_ {
        async move {
            answer!(
                self.call(MasterRequest::QueryTask { id }).await,
                QueryTask,
                1
            )
        }
    }

    /// Up to `max` tasks for `client` to execute (space on the targets allocated).
    fn fetch_tasks(
        &self,
        client: u128,
        max: u32,
    ) -> impl Future<Output = CodeResult<Vec<TaskWork>>> + Send + '_ {
        let request = MasterRequest::FetchTasks { client, max };
        async move { answer!(self.call(request).await, FetchTasks, 1) }
    }

    /// Reports the outcome of a task `client` executed (`Err(code)`: it failed).
    fn finish_task(
        &self,
        client: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> impl Future<Output = CodeResult<()>> + Send + '_ {
        let request = MasterRequest::FinishTask {
            client,
            id,
            outcome,
        };
        async move { answer!(self.call(request).await, FinishTask, 1) }
    }

    /// Registers the SSD tier of `client` (`UNABLE_OFFLOAD` when the master runs
    /// without offload).
    fn enable_offload(&self, client: u128) -> impl Future<Output = CodeResult<()>> + Send + '_ {
        let request = MasterRequest::EnableOffload { client };
        async move { answer!(self.call(request).await, EnableOffload, 1) }
    }

    /// Work queued for `client`'s SSD tier (at most `max` objects to write).
    fn offload_fetch(
        &self,
        client: u128,
        max: u32,
    ) -> impl Future<Output = CodeResult<OffloadWork>> + Send + '_ {
        let request = MasterRequest::OffloadFetch { client, max };
        async move { answer!(self.call(request).await, OffloadFetch, 1) }
    }

    /// Objects `client` has on disk, as `(key, size)` (written, or found at startup).
    fn offload_done(
        &self,
        client: u128,
        objects: Vec<(String, u64)>,
    ) -> impl Future<Output = CodeResult<()>> + Send + '_ {
        let request = MasterRequest::OffloadDone { client, objects };
        async move { answer!(self.call(request).await, OffloadDone, 1) }
    }

    /// Disk copies `client` is about to delete.
    fn disk_evicted(
        &self,
        client: u128,
        keys: Vec<String>,
    ) -> impl Future<Output = CodeResult<()>> + Send + '_ {
        let request = MasterRequest::DiskEvicted { client, keys };
        async move { answer!(self.call(request).await, DiskEvicted, 1) }
    }

    /// Object counts and segment usage.
    fn stats(&self) -> impl Future<Output = CodeResult<MasterStats>> + Send + '_ {
        async move { answer!(self.call(MasterRequest::Stats {}).await, Stats, 1) }
    }

    /// Whether the master answers now (a remote one: a round trip on the connection,
    /// unlike [`Master::hello`], which a live connection answers from memory).
    fn ping(&self) -> impl Future<Output = CodeResult<()>> + Send + '_ {
        async move { answer!(self.call(MasterRequest::Ping {}).await, Ping, 1) }
    }
}

impl<M: Master + ?Sized> MasterExt for M {}
