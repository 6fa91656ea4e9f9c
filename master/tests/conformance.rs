//! The master conformance suite: every scenario runs against each implementation of the
//! [`Master`] seam (the embedded `MasterService`, a `RemoteMaster` talking to a served
//! master over loopback TCP with a cluster secret, and a standby promoted after a
//! failover: it installed its leader's snapshot and took over with its own journal),
//! and must pass on all three. Another master joins by adding a [`Kind`].
//!
//! Both subjects run on a manual clock and with their one maintenance task, so
//! scenarios advance time and wait for maintenance passes deterministically.

use std::sync::Arc;
use std::time::Duration;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::master_api::{
    ClientStatus, LOCAL_OWNER, LeaseBudget, LeasedReplicas, Master, MasterExt, PutStarted,
    TaskKind, TaskStatus,
};
use mooncake_core::protocol::auth::ClusterSecret;
use mooncake_core::protocol::master_client::RemoteMaster;
use mooncake_core::tenant::Tenant;
use mooncake_core::types::{ReplicaLocation, ReplicateConfig, SegmentId, SoftPinAction, WriteMode};
use mooncake_master::journal::Journal;
use mooncake_master::running::RunningMaster;
use mooncake_master::{Clock, MasterConfig, MasterService};

/// Which implementation a scenario runs against.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// `MasterService` in this process.
    Embedded,
    /// A served `MasterService` reached through `RemoteMaster` over loopback TCP.
    Remote,
    /// A standby promoted to leader (high availability): it installed its leader's
    /// snapshot, then took over with a journal of its own term, so every change it
    /// makes is journaled for the standbys that follow it.
    Promoted,
}

/// A master under test, its clock, and its maintenance (and server).
struct Subject {
    master: Arc<dyn Master>,
    service: Arc<MasterService>,
    clock: Clock,
    running: RunningMaster,
}

/// Lease of reads in every scenario (the default).
const LEASE: Duration = Duration::from_secs(10);

impl Subject {
    async fn start(kind: Kind, config: MasterConfig) -> Subject {
        let clock = Clock::manual();
        let service = Arc::new(MasterService::new(config, clock.clone()));
        let (master, running): (Arc<dyn Master>, RunningMaster) = match kind {
            Kind::Embedded => (
                Arc::clone(&service) as Arc<dyn Master>,
                RunningMaster::unserved(Arc::clone(&service)),
            ),
            Kind::Remote => {
                let secret = Arc::new(ClusterSecret::random("conformance").expect("secret"));
                let address = "127.0.0.1:0".parse().expect("address");
                let running =
                    RunningMaster::start(Arc::clone(&service), address, Some(Arc::clone(&secret)))
                        .await
                        .expect("master serves");
                let address = running.rpc_address.expect("served").to_string();
                let remote = RemoteMaster::new(address, Some(secret));
                (Arc::new(remote) as Arc<dyn Master>, running)
            }
            Kind::Promoted => {
                let leader = MasterService::new(config_of(&service), clock.clone());
                service
                    .install_snapshot(leader.snapshot_state())
                    .expect("the leader's snapshot installs");
                let journal = Journal::new(2, Duration::from_millis(100));
                service.take_over(Arc::new(journal));
                (
                    Arc::clone(&service) as Arc<dyn Master>,
                    RunningMaster::unserved(Arc::clone(&service)),
                )
            }
        };
        Subject {
            master,
            service,
            clock,
            running,
        }
    }

    async fn with_segment(kind: Kind, config: MasterConfig, capacity: u64) -> Subject {
        let subject = Subject::start(kind, config).await;
        subject.mount("node-a:1", capacity, LOCAL_OWNER).await;
        subject
    }

    async fn stop(self) {
        self.running.stop().await;
    }

    async fn mount(&self, name: &str, capacity: u64, client: u128) -> SegmentId {
        self.master
            .mount_segment(client, name.into(), capacity, "127.0.0.1:1".into(), 0)
            .await
            .expect("mount")
    }

    async fn start_write(
        &self,
        key: &str,
        size: u64,
        config: &ReplicateConfig,
        mode: WriteMode,
    ) -> CodeResult<PutStarted> {
        let items = vec![(key.to_string(), size)];
        one(self.master.put_start(items, config.clone(), mode).await)
    }

    async fn end(&self, key: &str, write_id: u64) -> CodeResult<()> {
        one(self.master.put_end(vec![(key.to_string(), write_id)]).await)
    }

    async fn revoke(&self, key: &str, write_id: u64) -> CodeResult<()> {
        one(self
            .master
            .put_revoke(vec![(key.to_string(), write_id)])
            .await)
    }

    async fn put_with(&self, key: &str, size: u64, config: &ReplicateConfig) -> CodeResult<()> {
        let started = self.start_write(key, size, config, WriteMode::Put).await?;
        self.end(key, started.write_id).await
    }

    async fn put(&self, key: &str, size: u64) -> CodeResult<()> {
        self.put_with(key, size, &ReplicateConfig::default()).await
    }

    async fn read(&self, key: &str) -> CodeResult<LeasedReplicas> {
        one(self.master.get_replica_list(vec![key.into()], None).await)
    }

    async fn exist(&self, key: &str) -> CodeResult<bool> {
        one(self.master.exist(vec![key.into()], LeaseBudget(None)).await).map(|size| size.is_some())
    }

    async fn size(&self, key: &str) -> CodeResult<u64> {
        self.master.object_size(key.into()).await
    }

    async fn remove(&self, key: &str, force: bool) -> CodeResult<()> {
        one(self.master.remove(vec![key.into()], force).await)
    }

    /// Waits until the maintenance task has run two more passes (so one full pass ran
    /// after this call).
    async fn maintained(&self) {
        let start = self.service.stats().maintenance_rounds;
        for _ in 0..400 {
            if self.service.stats().maintenance_rounds >= start + 2 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("no maintenance pass in 2 s");
    }
}

/// The only result of a batch of one.
fn one<T>(results: Vec<CodeResult<T>>) -> CodeResult<T> {
    assert_eq!(results.len(), 1, "one answer per item");
    results.into_iter().next().expect("one result")
}

/// The default settings without watermark eviction in maintenance: scenarios that fill
/// memory see eviction only where a write needs room, not at a random moment between
/// two steps.
fn filling() -> MasterConfig {
    MasterConfig {
        eviction_high_watermark_ratio: 1.0,
        ..MasterConfig::default()
    }
}

fn replicas(n: u32) -> ReplicateConfig {
    ReplicateConfig {
        replica_num: n,
        ..ReplicateConfig::default()
    }
}

fn preferring(segment: &str) -> ReplicateConfig {
    ReplicateConfig {
        preferred_segment: segment.into(),
        ..ReplicateConfig::default()
    }
}

/// The segment name of each replica.
fn segment_names(replicas: &LeasedReplicas) -> Vec<String> {
    replicas
        .0
        .iter()
        .map(|r| r.location.segment_name().to_string())
        .collect()
}

async fn identity_and_lease(kind: Kind) {
    let s = Subject::start(kind, MasterConfig::default()).await;
    let hello = s.master.hello().await.expect("hello");
    assert_eq!(hello.master_id, s.service.id());
    assert_eq!(hello.lease_ttl_ms, 10_000);
    assert_eq!(s.master.is_remote(), matches!(kind, Kind::Remote));
    s.stop().await;
}

async fn a_ping_is_answered_and_changes_nothing(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 1 << 20).await;
    s.put("k", 100).await.expect("put");
    // Maintenance passes go on meanwhile: everything else stays as it was.
    let stats = || async {
        let mut stats = s.master.stats().await.expect("stats");
        stats.maintenance_rounds = 0;
        stats
    };
    let before = stats().await;
    assert_eq!(s.master.ping().await, Ok(()));
    assert_eq!(stats().await, before);
    s.stop().await;
}

async fn two_phase_put(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 1 << 20).await;
    let config = ReplicateConfig::default();
    let started = s
        .start_write("k", 100, &config, WriteMode::Put)
        .await
        .expect("start");
    assert_eq!(started.replicas.len(), 1);
    assert_eq!(s.read("k").await, Err(ErrorCode::REPLICA_IS_NOT_READY));
    assert_eq!(s.exist("k").await, Ok(false));
    assert_eq!(
        s.end("k", started.write_id + 1).await,
        Err(ErrorCode::INVALID_WRITE),
        "another writer's id completes nothing"
    );
    s.end("k", started.write_id).await.expect("end");
    let (found, lease) = s.read("k").await.expect("readable");
    assert_eq!((found[0].size, lease), (100, LEASE));
    assert_eq!(s.size("k").await, Ok(100));
    assert_eq!(s.exist("k").await, Ok(true));
    assert_eq!(
        s.start_write("k", 200, &config, WriteMode::Put).await,
        Err(ErrorCode::OBJECT_ALREADY_EXISTS),
        "a put never overwrites"
    );
    assert_eq!(s.size("k").await, Ok(100));
    s.stop().await;
}

async fn revoke_frees_space(kind: Kind) {
    let s = Subject::with_segment(kind, filling(), 4096).await;
    let config = ReplicateConfig::default();
    let started = s
        .start_write("k", 4096, &config, WriteMode::Put)
        .await
        .expect("start");
    assert_eq!(
        s.start_write("j", 64, &config, WriteMode::Put)
            .await
            .map(|_| ()),
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    );
    s.revoke("k", started.write_id).await.expect("revoke");
    assert_eq!(s.exist("k").await, Ok(false));
    assert_eq!(
        s.revoke("k", started.write_id).await,
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
    s.put("j", 4096).await.expect("the space is back");
    s.stop().await;
}

async fn upsert_replaces_once_complete(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 1 << 20).await;
    let config = ReplicateConfig::default();
    let first = s
        .start_write("k", 100, &config, WriteMode::Upsert)
        .await
        .expect("an upsert of a new key is a put");
    s.end("k", first.write_id).await.expect("end");
    let second = s
        .start_write("k", 300, &config, WriteMode::Upsert)
        .await
        .expect("upsert");
    assert_eq!(
        s.size("k").await,
        Ok(100),
        "readers see the old version meanwhile"
    );
    s.end("k", second.write_id).await.expect("end");
    assert_eq!(s.size("k").await, Ok(300));
    s.stop().await;
}

async fn leases_hold_off_removal(kind: Kind) {
    let s = Subject::with_segment(kind, filling(), 4096).await;
    s.put("k", 100).await.expect("put");
    assert_eq!(
        s.remove("k", false).await,
        Ok(()),
        "no lease right after a put"
    );
    s.put("k", 100).await.expect("put again");
    s.read("k").await.expect("read");
    assert_eq!(s.remove("k", false).await, Err(ErrorCode::OBJECT_HAS_LEASE));
    s.clock.advance(LEASE + Duration::from_secs(1));
    assert_eq!(s.remove("k", false).await, Ok(()));
    assert_eq!(s.remove("k", false).await, Err(ErrorCode::OBJECT_NOT_FOUND));

    // A forced remove under a lease keeps the space until the lease ends.
    s.put("big", 4096).await.expect("put");
    s.read("big").await.expect("read");
    assert_eq!(s.remove("big", true).await, Ok(()));
    assert_eq!(
        s.put("next", 4096).await,
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    );
    s.clock.advance(LEASE + Duration::from_secs(1));
    s.put("next", 4096)
        .await
        .expect("space released after the lease");
    s.stop().await;
}

async fn shorter_leases_on_request(kind: Kind) {
    let s = Subject::with_segment(kind, filling(), 4096).await;
    s.put("k", 100).await.expect("put");
    let short = s
        .master
        .get_replica_list(vec!["k".into()], Some(Duration::from_secs(1)))
        .await;
    assert_eq!(one(short).expect("read").1, Duration::from_secs(1));
    s.clock.advance(Duration::from_millis(1500));
    assert_eq!(s.remove("k", false).await, Ok(()), "the short lease ended");
    s.put("k", 100).await.expect("put");
    let long = s
        .master
        .get_replica_list(vec!["k".into()], Some(Duration::from_secs(3600)))
        .await;
    assert_eq!(
        one(long).expect("read").1,
        LEASE,
        "cut to the master's lease"
    );
    s.stop().await;
}

async fn existence_answers_sizes_and_leases_within_a_budget(kind: Kind) {
    let s = Subject::with_segment(kind, filling(), 4096).await;
    let keys: Vec<String> = ["a", "none", "b", "c"].map(String::from).into();
    for key in ["a", "b", "c"] {
        s.put(key, 100).await.expect("put");
    }
    let found = s.master.exist(keys.clone(), LeaseBudget(Some(150))).await;
    assert_eq!(
        found,
        vec![Ok(Some(100)), Ok(None), Ok(Some(100)), Ok(Some(100))]
    );
    let removed = s.master.remove(keys.clone(), false).await;
    assert_eq!(
        removed,
        vec![
            Err(ErrorCode::OBJECT_HAS_LEASE),
            Err(ErrorCode::OBJECT_NOT_FOUND),
            Err(ErrorCode::OBJECT_HAS_LEASE),
            Ok(())
        ],
        "leased while the bytes leased before stayed below 150"
    );
    s.clock.advance(LEASE + Duration::from_secs(1));
    for key in ["a", "b"] {
        s.remove(key, false).await.expect("the leases ended");
        s.put(key, 100).await.expect("put again");
    }
    let found = s.master.exist(keys.clone(), LeaseBudget(Some(0))).await;
    assert_eq!(found[0], Ok(Some(100)));
    assert_eq!(
        s.remove("a", false).await,
        Ok(()),
        "a zero budget leases nothing"
    );
    assert_eq!(
        s.master.exist(keys, LeaseBudget(None)).await[2],
        Ok(Some(100))
    );
    assert_eq!(
        s.remove("b", false).await,
        Err(ErrorCode::OBJECT_HAS_LEASE),
        "no budget: every object found is leased"
    );
    s.stop().await;
}

async fn hard_pins_are_never_evicted(kind: Kind) {
    let s = Subject::with_segment(kind, filling(), 4096).await;
    let hard = ReplicateConfig {
        with_hard_pin: true,
        ..ReplicateConfig::default()
    };
    s.put_with("pinned", 4096, &hard).await.expect("put");
    s.clock.advance(Duration::from_secs(60));
    assert_eq!(
        s.put("other", 64).await,
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    );
    assert_eq!(s.exist("pinned").await, Ok(true));
    s.stop().await;
}

async fn soft_pins_go_last(kind: Kind) {
    let config = MasterConfig {
        allow_evict_soft_pinned_objects: true,
        ..filling()
    };
    let s = Subject::with_segment(kind, config, 3 * 1024).await;
    let soft = ReplicateConfig {
        soft_pin_action: SoftPinAction::Enable,
        ..ReplicateConfig::default()
    };
    s.put_with("soft", 1024, &soft).await.expect("put");
    s.clock.advance(Duration::from_millis(1));
    s.put("plain", 1024).await.expect("put");
    s.clock.advance(Duration::from_millis(1));
    s.put("filler", 1024).await.expect("put");
    s.clock.advance(Duration::from_millis(1));
    s.put("new", 1024).await.expect("eviction makes room");
    assert_eq!(
        s.exist("soft").await,
        Ok(true),
        "the older soft-pinned object stays"
    );
    assert_eq!(
        s.exist("plain").await,
        Ok(false),
        "the unpinned one goes first"
    );
    let too_long = ReplicateConfig {
        soft_pin_action: SoftPinAction::Enable,
        soft_pin_ttl_ms: Some(u64::MAX / 2),
        ..ReplicateConfig::default()
    };
    assert_eq!(
        s.put_with("x", 10, &too_long).await,
        Err(ErrorCode::INVALID_PARAMS)
    );
    s.stop().await;
}

async fn replicas_land_on_distinct_and_preferred_segments(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 1 << 20).await;
    s.mount("node-b:1", 1 << 20, LOCAL_OWNER).await;
    s.mount("node-c:1", 1 << 20, LOCAL_OWNER).await;
    s.put_with("two", 10, &replicas(2)).await.expect("put");
    let mut names = segment_names(&s.read("two").await.expect("read"));
    names.sort();
    names.dedup();
    assert_eq!(names.len(), 2, "{names:?}");
    for i in 0..4 {
        let key = format!("on-c-{i}");
        s.put_with(&key, 10, &preferring("node-c:1"))
            .await
            .expect("put");
        let found = s.read(&key).await.expect("read");
        assert_eq!(segment_names(&found), vec!["node-c:1".to_string()]);
        s.remove(&key, true).await.expect("remove");
    }
    let descriptors = one(s.master.replica_desc(vec!["two".into()]).await).expect("desc");
    assert_eq!(descriptors.len(), 2);
    s.stop().await;
}

async fn idle_objects_clear_whole_or_by_segment(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 1 << 20).await;
    s.mount("node-b:1", 1 << 20, LOCAL_OWNER).await;
    s.put_with("two", 10, &replicas(2)).await.expect("put");
    s.put("one", 10).await.expect("put");
    let clear = |keys: &[&str], segment: Option<&str>| {
        let keys = keys.iter().map(|k| k.to_string()).collect();
        s.master.clear_replicas(keys, segment.map(str::to_string))
    };
    assert_eq!(
        clear(&["two", "one", "none"], None).await,
        vec![
            Err(ErrorCode::OBJECT_HAS_LEASE),
            Err(ErrorCode::OBJECT_HAS_LEASE),
            Err(ErrorCode::OBJECT_NOT_FOUND)
        ],
        "written within a lease"
    );
    s.clock.advance(LEASE + Duration::from_secs(1));
    let named = segment_names(&s.read("two").await.expect("read"));
    let first = named[0].clone();
    s.clock.advance(LEASE + Duration::from_secs(1));
    assert_eq!(clear(&["two"], Some(&first)).await, vec![Ok(())]);
    let left = segment_names(&s.read("two").await.expect("still readable"));
    assert_eq!(left.len(), 1);
    assert_ne!(left[0], first);
    assert_eq!(
        clear(&["two"], None).await,
        vec![Err(ErrorCode::OBJECT_HAS_LEASE)],
        "read within a lease"
    );
    s.clock.advance(LEASE + Duration::from_secs(1));
    assert_eq!(clear(&["two", "one"], None).await, vec![Ok(()), Ok(())]);
    assert_eq!(s.exist("two").await, Ok(false));
    assert_eq!(s.exist("one").await, Ok(false));
    s.stop().await;
}

async fn eviction_is_least_recently_used_by_last_access(kind: Kind) {
    let s = Subject::with_segment(kind, filling(), 3 * 1024).await;
    s.put("read-early", 1024).await.expect("put");
    s.read("read-early").await.expect("read: leased for 10 s");
    s.clock.advance(Duration::from_secs(5));
    s.put("written-later", 1024).await.expect("put");
    s.clock.advance(Duration::from_secs(6));
    s.put("filler", 1024).await.expect("put");
    s.clock.advance(Duration::from_millis(1));
    // Full, and no lease is active: the object used longest ago goes first.
    s.put("new", 1024).await.expect("eviction makes room");
    assert_eq!(s.exist("read-early").await, Ok(false), "last used 11 s ago");
    assert_eq!(s.exist("written-later").await, Ok(true), "written 6 s ago");
    s.stop().await;
}

async fn watermark_eviction_runs_in_maintenance(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 100 * 1024).await;
    for i in 0..95 {
        s.put(&format!("k{i}"), 1024).await.expect("put");
        s.clock.advance(Duration::from_millis(1));
    }
    s.clock.advance(Duration::from_millis(1));
    s.maintained().await;
    let stats = s.master.stats().await.expect("stats");
    assert!(stats.segments[0].used <= 85 * 1024, "{stats:?}");
    assert!(stats.evicted_objects >= 10, "{stats:?}");
    assert_eq!(s.exist("k0").await, Ok(false), "the oldest went first");
    assert_eq!(s.exist("k94").await, Ok(true), "the newest stayed");
    s.stop().await;
}

async fn silent_clients_expire_and_remount(kind: Kind) {
    let s = Subject::start(kind, MasterConfig::default()).await;
    let client = 7;
    s.mount("node-x:1", 4096, client).await;
    assert_eq!(s.master.heartbeat(client).await, Ok(ClientStatus::Ok));
    assert_eq!(
        s.master.heartbeat(8).await,
        Ok(ClientStatus::NeedRemount),
        "an unknown client"
    );
    s.clock.advance(Duration::from_secs(11));
    s.maintained().await;
    assert_eq!(
        s.master.heartbeat(client).await,
        Ok(ClientStatus::NeedRemount)
    );
    assert!(s.master.stats().await.expect("stats").segments.is_empty());
    s.mount("node-x:1", 4096, client).await;
    assert_eq!(s.master.heartbeat(client).await, Ok(ClientStatus::Ok));
    // Another instance under the same name displaces the first.
    s.mount("node-x:1", 4096, 9).await;
    assert_eq!(
        s.master.heartbeat(client).await,
        Ok(ClientStatus::Displaced)
    );
    s.master.unmount_client(9).await.expect("unmount");
    assert!(s.master.stats().await.expect("stats").segments.is_empty());
    s.stop().await;
}

async fn copy_tasks_run_on_the_source_owner(kind: Kind) {
    let s = Subject::start(kind, MasterConfig::default()).await;
    let (owner_a, owner_b) = (11, 12);
    s.mount("node-a:1", 1 << 20, owner_a).await;
    s.mount("node-b:1", 1 << 20, owner_b).await;
    s.put_with("k", 100, &preferring("node-a:1"))
        .await
        .expect("put");
    let targets = vec!["node-b:1".to_string()];
    let id = s
        .master
        .create_copy_task("k".into(), targets.clone(), 42)
        .await
        .expect("task");
    assert_eq!(id, 42);
    let info = s.master.query_task(id).await.expect("query");
    assert_eq!(
        (info.kind, info.status),
        (TaskKind::Copy, TaskStatus::Pending)
    );
    assert_eq!(s.master.fetch_tasks(owner_b, 8).await, Ok(Vec::new()));
    let work = s.master.fetch_tasks(owner_a, 8).await.expect("fetch");
    assert_eq!(work.len(), 1);
    assert_eq!(work[0].targets.len(), 1);
    s.master
        .finish_task(owner_a, id, Ok(()))
        .await
        .expect("finish");
    assert_eq!(
        s.master.query_task(id).await.map(|i| i.status),
        Ok(TaskStatus::Success)
    );
    let mut names = segment_names(&s.read("k").await.expect("read"));
    names.sort();
    assert_eq!(names, vec!["node-a:1".to_string(), "node-b:1".to_string()]);
    assert_eq!(
        s.master
            .create_copy_task("k".into(), vec!["nowhere".into()], 43)
            .await,
        Err(ErrorCode::SEGMENT_NOT_FOUND)
    );
    assert_eq!(
        s.master
            .create_copy_task("missing".into(), targets, 44)
            .await,
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
    assert_eq!(
        s.master.query_task(99).await,
        Err(ErrorCode::TASK_NOT_FOUND)
    );
    s.stop().await;
}

async fn tenants_remove_only_their_own(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 1 << 20).await;
    let red = Tenant::new("red").expect("tenant");
    let blue = Tenant::new("blue").expect("tenant");
    for key in ["a1", "a2", "b1"] {
        s.put(&red.scope(key), 10).await.expect("put");
        s.put(&blue.scope(key), 10).await.expect("put");
        s.put(key, 10).await.expect("put");
    }
    let removed = s
        .master
        .remove_by_regex(red.clone(), "^a".into(), false)
        .await;
    assert_eq!(removed, Ok(2));
    assert_eq!(s.exist(&red.scope("b1")).await, Ok(true));
    assert_eq!(s.exist(&blue.scope("a1")).await, Ok(true));
    assert_eq!(
        s.master.remove_all(blue.clone(), false).await,
        Ok(2),
        "blue a1 is leased by the read above"
    );
    assert_eq!(s.master.remove_all(blue.clone(), true).await, Ok(1));
    assert_eq!(s.exist(&blue.scope("b1")).await, Ok(false));
    assert_eq!(
        s.exist("a1").await,
        Ok(true),
        "the default tenant is untouched"
    );
    assert_eq!(s.master.remove_all(Tenant::default(), true).await, Ok(3));
    assert_eq!(s.exist(&red.scope("b1")).await, Ok(true));
    s.stop().await;
}

async fn offload_bookkeeping(kind: Kind) {
    let config = MasterConfig {
        enable_offload: true,
        ..MasterConfig::default()
    };
    let s = Subject::start(kind, config).await;
    let owner = 21;
    s.mount("node-a:1", 1 << 20, owner).await;
    assert_eq!(
        s.master.offload_fetch(owner, 8).await,
        Err(ErrorCode::SEGMENT_NOT_FOUND)
    );
    s.master.enable_offload(owner).await.expect("enable");
    s.put("k", 100).await.expect("put");
    let work = s.master.offload_fetch(owner, 8).await.expect("fetch");
    assert_eq!(work.store, vec![("k".to_string(), 100)]);
    s.master
        .offload_done(owner, vec![("k".into(), 100)])
        .await
        .expect("done");
    assert_eq!(s.master.stats().await.expect("stats").objects_on_disk, 1);
    s.remove("k", true).await.expect("remove");
    let work = s.master.offload_fetch(owner, 8).await.expect("fetch");
    assert_eq!(
        work.delete,
        vec!["k".to_string()],
        "the file is deleted on the owner"
    );
    assert_eq!(s.master.stats().await.expect("stats").objects_on_disk, 0);
    s.stop().await;

    let off = Subject::start(kind, MasterConfig::default()).await;
    assert_eq!(
        off.master.enable_offload(owner).await,
        Err(ErrorCode::UNABLE_OFFLOAD)
    );
    off.stop().await;
}

async fn disk_copies_serve_reads_after_memory_eviction(kind: Kind) {
    let config = MasterConfig {
        enable_offload: true,
        ..filling()
    };
    let s = Subject::start(kind, config).await;
    let owner = 22;
    s.mount("node-a:1", 2048, owner).await;
    s.master.enable_offload(owner).await.expect("enable");
    s.put("k", 1024).await.expect("put");
    s.master.offload_fetch(owner, 8).await.expect("fetch");
    s.master
        .offload_done(owner, vec![("k".into(), 1024)])
        .await
        .expect("done");
    s.clock.advance(Duration::from_millis(1));
    s.put("j", 2048).await.expect("evicts k from memory");
    let (found, _) = s.read("k").await.expect("k is still readable");
    assert!(
        matches!(found[0].location, ReplicaLocation::Disk { .. }),
        "{found:?}"
    );
    s.master
        .disk_evicted(owner, vec!["k".into()])
        .await
        .expect("disk evicted");
    assert_eq!(
        s.read("k").await.map(|_| ()),
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
    s.stop().await;
}

async fn bad_input_gets_error_codes(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 1 << 20).await;
    assert_eq!(s.put("", 10).await, Err(ErrorCode::INVALID_KEY));
    assert_eq!(
        s.put(&"k".repeat(5000), 10).await,
        Err(ErrorCode::INVALID_KEY)
    );
    assert_eq!(s.put("k", 0).await, Err(ErrorCode::INVALID_PARAMS));
    assert_eq!(
        s.put_with("k", 10, &replicas(0)).await,
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(s.read("missing").await, Err(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(s.size("missing").await, Err(ErrorCode::OBJECT_NOT_FOUND));
    assert_eq!(
        s.remove("missing", false).await,
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
    assert_eq!(
        s.master
            .remove_by_regex(Tenant::default(), "(".into(), false)
            .await,
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        s.master.finish_task(1, 12345, Ok(())).await,
        Err(ErrorCode::TASK_NOT_FOUND)
    );
    s.stop().await;
}

async fn batches_answer_every_item_in_order(kind: Kind) {
    let s = Subject::with_segment(kind, MasterConfig::default(), 64 << 20).await;
    // More items than one remote call carries: the remote side splits, the answer is
    // the same.
    let n = 5000;
    let items: Vec<(String, u64)> = (0..n).map(|i| (format!("k{i}"), 16)).collect();
    let started = s
        .master
        .put_start(items.clone(), ReplicateConfig::default(), WriteMode::Put)
        .await;
    assert_eq!(started.len(), n);
    let ends: Vec<(String, u64)> = items
        .iter()
        .zip(&started)
        .map(|((key, _), started)| (key.clone(), started.as_ref().expect("started").write_id))
        .collect();
    assert!(s.master.put_end(ends).await.iter().all(Result::is_ok));
    let mut keys: Vec<String> = items.into_iter().map(|(key, _)| key).collect();
    keys.push(String::new());
    let found = s.master.exist(keys.clone(), LeaseBudget(None)).await;
    assert_eq!(found.len(), n + 1);
    assert!(found[..n].iter().all(|r| *r == Ok(Some(16))));
    assert_eq!(found[n], Err(ErrorCode::INVALID_KEY));
    let removed = s.master.remove(keys, true).await;
    assert_eq!(removed.len(), n + 1);
    assert_eq!(s.master.stats().await.expect("stats").objects, 0);
    s.stop().await;
}

/// The settings `service` runs with (its leader had the same).
fn config_of(service: &MasterService) -> MasterConfig {
    service.config().clone()
}

/// Runs each scenario against every implementation.
macro_rules! conformance {
    ($($scenario:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Kind::Embedded).await;
                }
            )*
        }
        mod remote {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Kind::Remote).await;
                }
            )*
        }
        mod promoted {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario(super::Kind::Promoted).await;
                }
            )*
        }
    };
}

conformance!(
    identity_and_lease,
    a_ping_is_answered_and_changes_nothing,
    two_phase_put,
    revoke_frees_space,
    upsert_replaces_once_complete,
    leases_hold_off_removal,
    shorter_leases_on_request,
    existence_answers_sizes_and_leases_within_a_budget,
    hard_pins_are_never_evicted,
    soft_pins_go_last,
    replicas_land_on_distinct_and_preferred_segments,
    idle_objects_clear_whole_or_by_segment,
    eviction_is_least_recently_used_by_last_access,
    watermark_eviction_runs_in_maintenance,
    silent_clients_expire_and_remount,
    copy_tasks_run_on_the_source_owner,
    tenants_remove_only_their_own,
    offload_bookkeeping,
    disk_copies_serve_reads_after_memory_eviction,
    bad_input_gets_error_codes,
    batches_answer_every_item_in_order,
);
