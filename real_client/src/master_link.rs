//! The real client's link to its master, seen through the client's tenant: keys are
//! scoped on the way out and unscoped on the way back (see [`mooncake_core::tenant`]).
//! The master itself is any [`Master`]: the embedded `MasterService`, or a
//! [`RemoteMaster`](mooncake_core::protocol::master_client::RemoteMaster), which reconnects on its own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::{
    ClientStatus, LeaseBudget, LeasedReplicas, Master, MasterExt, MasterStats, OffloadWork,
    PutStarted, TaskInfo, TaskWork,
};
use mooncake_core::tenant::Tenant;
use mooncake_core::types::WriteMode;
use mooncake_core::types::{ReplicaDescriptor, ReplicateConfig, SegmentId};

use crate::read_cache::{Located, Lookup, ReadCache};
use crate::reservations::Reservations;
use crate::transfer::served::ServedSegment;

/// The master a real client uses, for the keys of one tenant.
#[derive(Debug, Clone)]
pub struct MasterLink {
    master: Arc<dyn Master>,
    tenant: Tenant,
    /// Keys are the master's already (no scoping): the SSD tier's view.
    unscoped: bool,
    /// Lease asked for by reads (`None`: the master's default).
    read_lease: Option<Duration>,
    /// Replica lists of recent reads of objects in this node's segment (shared by
    /// every view of this link).
    reads: Arc<ReadCache>,
    /// Space this client asked for ahead of its keys (shared by every view of this link).
    reservations: Arc<Reservations>,
}

/// How much shorter than the time left a lease renewed at a remote master is asked
/// for: the renewal's way to the master, during which its lease is not yet counted.
pub const RENEWAL_MARGIN: Duration = Duration::from_millis(1);

/// The only result of a batch of one.
fn first<T>(results: Vec<CodeResult<T>>) -> CodeResult<T> {
    results
        .into_iter()
        .next()
        .unwrap_or(Err(ErrorCode::RPC_FAIL))
}

impl MasterLink {
    /// A link of the real client `client` (a random id of this process: it names the
    /// reservations) to `master` for the keys of `tenant`, whose
    /// reads of objects in this node's segment reuse a replica list for up to
    /// `read_cache` (see [`crate::read_cache`]; zero: never) and whose puts reserve at
    /// most `reserve_budget` bytes ahead (see [`crate::reservations`]).
    pub fn new(
        master: Arc<dyn Master>,
        tenant: Tenant,
        client: u128,
        read_cache: Duration,
        reserve_budget: u64,
    ) -> Self {
        MasterLink {
            master,
            tenant,
            unscoped: false,
            read_lease: None,
            reads: Arc::new(ReadCache::new(read_cache)),
            reservations: Arc::new(Reservations::new(client, reserve_budget)),
        }
    }

    /// The space this client reserved for writes (see [`crate::reservations`]).
    pub fn reservations(&self) -> &Arc<Reservations> {
        &self.reservations
    }

    /// The read cache of this link.
    pub fn read_cache(&self) -> &ReadCache {
        &self.reads
    }

    /// The same master, for keys that are the master's own (tenant-scoped already),
    /// with reads leased for at most a second: the SSD tier's quick copies to disk.
    pub fn unscoped(&self) -> MasterLink {
        MasterLink {
            unscoped: true,
            read_lease: Some(Duration::from_secs(1)),
            ..self.clone()
        }
    }

    /// The master's name for `key`.
    pub fn scope<'a>(&self, key: &'a str) -> std::borrow::Cow<'a, str> {
        if self.unscoped {
            std::borrow::Cow::Borrowed(key)
        } else {
            self.tenant.scope(key)
        }
    }

    fn scope_all(&self, keys: Vec<String>) -> Vec<String> {
        if self.unscoped {
            keys
        } else {
            self.tenant.scope_all(keys)
        }
    }

    fn scope_items(&self, items: &[(&str, u64)]) -> Vec<(String, u64)> {
        items
            .iter()
            .map(|(key, value)| (self.scope(key).into_owned(), *value))
            .collect()
    }

    /// True when the master is a separate process (it expects heartbeats).
    pub fn is_remote(&self) -> bool {
        self.master.is_remote()
    }

    /// The tenant whose keys this link sees.
    pub fn tenant(&self) -> &Tenant {
        &self.tenant
    }

    /// Whether the master answers.
    pub async fn is_reachable(&self) -> bool {
        // A round trip: a live connection answers `hello` from memory.
        self.master.ping().await.is_ok()
    }

    /// How long the master leases an object to a read (`None`: it does not answer).
    pub async fn read_lease_ttl(&self) -> Option<Duration> {
        let hello = self.master.hello().await.ok()?;
        Some(Duration::from_millis(hello.lease_ttl_ms))
    }

    /// Mounts `segment` for `client`, whose transfer engine listens at `endpoint`. A
    /// segment file's generation goes with it: a master still holding the segment of
    /// this file (a restart after a crash) gives it back with its objects.
    pub async fn mount_segment(
        &self,
        client: u128,
        segment: &ServedSegment,
        endpoint: &str,
    ) -> CodeResult<SegmentId> {
        // Cached replica lists and reservations may be stale after a mount.
        self.reads.clear();
        self.reservations.clear();
        self.master
            .mount_segment(
                client,
                segment.name.clone(),
                segment.memory.len() as u64,
                endpoint.to_string(),
                segment.generation(),
            )
            .await
    }

    /// Unmounts everything `client` mounted.
    pub async fn unmount_client(&self, client: u128) -> CodeResult<()> {
        self.reads.clear();
        self.reservations.clear();
        self.master.unmount_client(client).await
    }

    /// Heartbeat.
    pub async fn heartbeat(&self, client: u128) -> CodeResult<ClientStatus> {
        self.master.heartbeat(client).await
    }

    /// Starts a write.
    pub async fn put_start(
        &self,
        key: &str,
        size: u64,
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> CodeResult<PutStarted> {
        first(self.put_start_many(&[(key, size)], config, mode).await)
    }

    /// Starts writes of `(key, size)` items: one master round trip per batch.
    pub async fn put_start_many(
        &self,
        items: &[(&str, u64)],
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<PutStarted>> {
        let items = self.scope_items(items);
        if mode == WriteMode::Upsert {
            self.reads.forget(items.iter().map(|(key, _)| key.as_str()));
        }
        self.master.put_start(items, config.clone(), mode).await
    }

    /// Completes a write.
    pub async fn put_end(&self, key: &str, write_id: u64) -> CodeResult<()> {
        first(self.put_end_many(&[(key, write_id)]).await)
    }

    /// Completes writes named by `(key, write id)`: one round trip per batch.
    pub async fn put_end_many(&self, items: &[(&str, u64)]) -> Vec<CodeResult<()>> {
        let items = self.scope_items(items);
        let results = self.master.put_end(items.clone()).await;
        // A version read before this write (an upsert's, or one removed by another
        // client since) is stale.
        self.reads.forget(items.iter().map(|(key, _)| key.as_str()));
        results
    }

    /// Completes writes started under a reservation's name, each named by `(reserved
    /// name, write id, key)`: one round trip per batch.
    pub async fn put_commit_many(&self, items: &[(&str, u64, &str)]) -> Vec<CodeResult<()>> {
        self.put_commit_many_during(items, Box::new(|| {})).await
    }

    /// [`put_commit_many`](Self::put_commit_many), running `work` (exactly once) while
    /// the request travels (see `Master::put_commit_during`: the keys may be readable
    /// before `work` returns).
    pub async fn put_commit_many_during<'a>(
        &'a self,
        items: &[(&str, u64, &str)],
        work: Box<dyn FnOnce() + Send + 'a>,
    ) -> Vec<CodeResult<()>> {
        let items: Vec<(String, u64, String)> = items
            .iter()
            .map(|(reserved, id, key)| {
                (
                    self.scope(reserved).into_owned(),
                    *id,
                    self.scope(key).into_owned(),
                )
            })
            .collect();
        let results = self.master.put_commit_during(items.clone(), work).await;
        self.reads
            .forget(items.iter().map(|(_, _, key)| key.as_str()));
        results
    }

    /// Abandons a write.
    pub async fn put_revoke(&self, key: &str, write_id: u64) -> CodeResult<()> {
        first(self.put_revoke_many(&[(key, write_id)]).await)
    }

    /// Abandons writes named by `(key, write id)`: one round trip per batch.
    pub async fn put_revoke_many(&self, items: &[(&str, u64)]) -> Vec<CodeResult<()>> {
        self.master.put_revoke(self.scope_items(items)).await
    }

    /// Replicas and lease of a readable object.
    pub async fn get_replica_list(&self, key: &str) -> CodeResult<LeasedReplicas> {
        first(self.get_replica_lists(&[key]).await)
    }

    /// Replicas, lease and asking time of each readable object, for a read: one master
    /// round trip for the keys not in the read cache. A kept list is used only if
    /// `keep` still accepts its replicas; a list from the master that `keep` accepts is
    /// kept.
    pub async fn locate(
        &self,
        keys: &[&str],
        keep: impl Fn(&[ReplicaDescriptor]) -> bool,
    ) -> Vec<CodeResult<Located>> {
        let now = Instant::now();
        let scoped: Vec<std::borrow::Cow<'_, str>> = keys.iter().map(|k| self.scope(k)).collect();
        let mut found: Vec<CodeResult<Located>> = Vec::with_capacity(keys.len());
        let mut missing = Vec::new();
        let mut hits = Vec::new();
        for (index, key) in scoped.iter().enumerate() {
            match self.reads.lookup(key, now, |l| keep(&l.replicas)) {
                Lookup::Hit(located) => {
                    hits.push((key.to_string(), located.lease));
                    found.push(Ok(located));
                }
                Lookup::Miss(ask) => {
                    found.push(Err(ErrorCode::RPC_FAIL));
                    missing.push((index, ask));
                }
            }
        }
        if !hits.is_empty() {
            self.renew_leases(hits, now).await;
        }
        if missing.is_empty() {
            return found;
        }
        let asked: Vec<String> = missing
            .iter()
            .map(|&(index, _)| scoped[index].to_string())
            .collect();
        let mut answers = self
            .master
            .get_replica_list(asked, self.read_lease)
            .await
            .into_iter();
        for (index, ask) in missing {
            let answer = answers.next().unwrap_or(Err(ErrorCode::RPC_FAIL));
            let located = answer.map(|(replicas, lease)| Located {
                replicas,
                lease,
                asked_at: now,
            });
            let kept = located
                .as_ref()
                .ok()
                .filter(|l| ask.is_some() && keep(&l.replicas));
            self.reads.keep(&scoped[index], ask, kept);
            found[index] = located;
        }
        found
    }

    /// Renews at the master the read leases of objects read from the read cache at
    /// `hit`, so that each lease runs one TTL from that read as if the master had been
    /// asked (removal refused, no eviction), and ends no later. A remote master is told
    /// without waiting for its answer, for a lease shortened by the time already passed
    /// and [`RENEWAL_MARGIN`] (the message's way there); the master in this process is
    /// told at once, before the copy and so before the read is answered (an existence
    /// check: a lease of one TTL, no replica list to build; or this link's shorter
    /// lease).
    async fn renew_leases(&self, hits: Vec<(String, Duration)>, hit: Instant) {
        let keys: Vec<String> = hits.iter().map(|(key, _)| key.clone()).collect();
        let runtime = tokio::runtime::Handle::try_current();
        let (true, Ok(runtime)) = (self.master.is_remote(), runtime) else {
            match self.read_lease {
                None => drop(self.master.exist(keys, LeaseBudget(None)).await),
                short => drop(self.master.get_replica_list(keys, short).await),
            }
            return;
        };
        let Some(ttl) = hits.iter().map(|(_, lease)| *lease).min() else {
            return;
        };
        let master = Arc::clone(&self.master);
        runtime.spawn(async move {
            // Counted when it leaves, however late its task ran.
            let left = ttl.saturating_sub(hit.elapsed() + RENEWAL_MARGIN);
            if !left.is_zero() {
                let _ = master.get_replica_list(keys, Some(left)).await;
            }
        });
    }

    /// Replicas and lease of each readable object: one round trip per batch.
    pub async fn get_replica_lists(&self, keys: &[&str]) -> Vec<CodeResult<LeasedReplicas>> {
        let keys = keys.iter().map(|k| self.scope(k).into_owned()).collect();
        self.master.get_replica_list(keys, self.read_lease).await
    }

    /// The size of each readable key (`None`: not stored); the objects found are leased
    /// within `budget`.
    pub async fn exist(
        &self,
        keys: Vec<String>,
        budget: LeaseBudget,
    ) -> Vec<CodeResult<Option<u64>>> {
        self.master.exist(self.scope_all(keys), budget).await
    }

    /// Size of an object.
    pub async fn object_size(&self, key: &str) -> CodeResult<u64> {
        self.master.object_size(self.scope(key).into_owned()).await
    }

    /// Replica descriptors per key.
    pub async fn replica_desc(&self, keys: Vec<String>) -> Vec<CodeResult<Vec<ReplicaDescriptor>>> {
        self.master.replica_desc(self.scope_all(keys)).await
    }

    /// Removes objects.
    pub async fn remove(&self, keys: Vec<String>, force: bool) -> Vec<CodeResult<()>> {
        let keys = self.scope_all(keys);
        self.reads.forget(keys.iter().map(String::as_str));
        let results = self.master.remove(keys.clone(), force).await;
        // A read asked for before the removal and finished after it kept nothing (the
        // generation changed); one finished before it is forgotten here.
        self.reads.forget(keys.iter().map(String::as_str));
        results
    }

    /// Clears objects nobody used for one lease TTL: their memory replicas on the
    /// segment named `segment`, or (`None`) whole (see [`Master::clear_replicas`]).
    pub async fn clear_replicas(
        &self,
        keys: Vec<String>,
        segment: Option<String>,
    ) -> Vec<CodeResult<()>> {
        let keys = self.scope_all(keys);
        self.reads.forget(keys.iter().map(String::as_str));
        let results = self.master.clear_replicas(keys.clone(), segment).await;
        self.reads.forget(keys.iter().map(String::as_str));
        results
    }

    /// Removes this tenant's objects matching a regex.
    pub async fn remove_by_regex(&self, pattern: String, force: bool) -> CodeResult<u64> {
        self.reads.clear();
        let removed = self
            .master
            .remove_by_regex(self.tenant.clone(), pattern, force)
            .await;
        self.reads.clear();
        removed
    }

    /// Removes every object of this tenant.
    pub async fn remove_all(&self, force: bool) -> CodeResult<u64> {
        self.reads.clear();
        let removed = self.master.remove_all(self.tenant.clone(), force).await;
        self.reads.clear();
        removed
    }

    /// Creates a copy task.
    pub async fn create_copy_task(
        &self,
        key: String,
        targets: Vec<String>,
        id: u128,
    ) -> CodeResult<u128> {
        let key = self.scope(&key).into_owned();
        self.master.create_copy_task(key, targets, id).await
    }

    /// Creates a move task.
    pub async fn create_move_task(
        &self,
        key: String,
        source: String,
        target: String,
        id: u128,
    ) -> CodeResult<u128> {
        let key = self.scope(&key).into_owned();
        self.master.create_move_task(key, source, target, id).await
    }

    /// The state of a task.
    pub async fn query_task(&self, id: u128) -> CodeResult<TaskInfo> {
        let mut info = self.master.query_task(id).await?;
        // Another tenant's task is not this tenant's business.
        info.key = self
            .tenant
            .unscope(&info.key)
            .ok_or(ErrorCode::TASK_NOT_FOUND)?
            .to_string();
        Ok(info)
    }

    /// Up to `max` copy/move tasks for `client` to execute.
    pub async fn fetch_tasks(&self, client: u128, max: u32) -> CodeResult<Vec<TaskWork>> {
        self.master.fetch_tasks(client, max).await
    }

    /// Reports the outcome of a task `client` executed.
    pub async fn finish_task(
        &self,
        client: u128,
        id: u128,
        outcome: Result<(), i32>,
    ) -> CodeResult<()> {
        self.master.finish_task(client, id, outcome).await
    }

    /// Registers this node's SSD tier.
    pub async fn enable_offload(&self, client: u128) -> CodeResult<()> {
        self.master.enable_offload(client).await
    }

    /// Work queued for this node's SSD tier.
    pub async fn offload_fetch(&self, client: u128, max: u32) -> CodeResult<OffloadWork> {
        self.master.offload_fetch(client, max).await
    }

    /// Reports objects on this node's disk.
    pub async fn offload_done(&self, client: u128, objects: Vec<(String, u64)>) -> CodeResult<()> {
        self.master.offload_done(client, objects).await
    }

    /// Reports disk copies about to be deleted.
    pub async fn disk_evicted(&self, client: u128, keys: Vec<String>) -> CodeResult<()> {
        self.master.disk_evicted(client, keys).await
    }

    /// Object counts and segment usage.
    pub async fn stats(&self) -> CodeResult<MasterStats> {
        self.master.stats().await
    }
}
