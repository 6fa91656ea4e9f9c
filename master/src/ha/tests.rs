//! A standby that installs a snapshot and applies the journal ends up with exactly its
//! leader's metadata: objects, writes in progress, disk copies, segments and every
//! allocator's free space.

use std::sync::Arc;
use std::time::Duration;

use mooncake_core::master_api::replication::SnapshotState;
use mooncake_core::master_api::{LOCAL_OWNER, MasterExt};
use mooncake_core::types::ReplicateConfig;

use crate::journal::Journal;
use crate::{Clock, MasterConfig, MasterService};

const STANDBY: u128 = 7;

fn config() -> MasterConfig {
    MasterConfig {
        enable_offload: true,
        eviction_high_watermark_ratio: 1.0,
        ..MasterConfig::default()
    }
}

/// The state with the fields that depend on when it was taken cleared, in order.
fn normalized(mut state: SnapshotState) -> SnapshotState {
    state.objects.sort_by(|a, b| a.0.cmp(&b.0));
    for (_, image) in &mut state.objects {
        image.soft_pin_left_ms = u32::from(image.soft_pin_left_ms > 0);
        if let Some(pending) = &mut image.pending {
            pending.age_ms = 0;
        }
    }
    state.segments.sort_by_key(|s| s.segment.id);
    state.disk.sort();
    state.offload_clients.sort_unstable();
    state.disk_deletes.sort();
    state.tasks.sort_by_key(|t| t.info.id);
    // A leader's own waiting frees; a standby holds its leader's apart until it leads.
    state.deferred.clear();
    state
}

/// Pulls everything the journal has for the standby and applies it.
async fn catch_up(journal: &Journal, standby: &MasterService, next: &mut u64) {
    loop {
        let batch = journal
            .pull(STANDBY, "standby", journal.epoch(), *next, Duration::ZERO)
            .await
            .expect("pull")
            .batch;
        if batch.changes.is_empty() {
            return;
        }
        *next += batch.changes.len() as u64;
        for change in batch.changes {
            standby.apply_change(change);
        }
    }
}

fn put(master: &MasterService, key: &str, size: u64, config: &ReplicateConfig) {
    let started = master.put_start(key, size, config).expect("put_start");
    master.put_end(key, started.write_id).expect("put_end");
}

/// Writes, upserts, revocations, removals, an unmount and disk copies.
async fn workload(leader: &MasterService, round: u64) {
    let client = 1000 + u128::from(round);
    let name = format!("node-{round}:1");
    MasterExt::mount_segment(leader, client, name.clone(), 1 << 22, format!("{name}x"), 0)
        .await
        .expect("mount");
    leader.enable_offload(client).expect("offload");
    let on_node = ReplicateConfig {
        preferred_segment: name.clone(),
        ..ReplicateConfig::default()
    };
    for i in 0..60u64 {
        let key = format!("r{round}-k{i}");
        put(leader, &key, 1000 + i * 37, &ReplicateConfig::default());
        if i % 3 == 0 {
            put(leader, &format!("{key}-on-node"), 4096, &on_node);
        }
        if i % 5 == 0 {
            let started = leader
                .upsert_start(&key, 2000, &ReplicateConfig::default())
                .expect("upsert");
            leader.put_end(&key, started.write_id).expect("upsert end");
        }
        if i % 7 == 0 {
            leader.remove(&key, true).expect("remove");
        }
        if i % 11 == 0 {
            let started = leader
                .put_start(&format!("{key}-revoked"), 512, &ReplicateConfig::default())
                .expect("start");
            leader
                .put_revoke(&format!("{key}-revoked"), started.write_id)
                .expect("revoke");
        }
    }
    leader
        .put_start(
            &format!("r{round}-in-progress"),
            999,
            &ReplicateConfig::default(),
        )
        .expect("a write left in progress");
    tasks(leader, round, client, &name).await;
    leader
        .offload_done(client, &[(format!("r{round}-k1-on-node"), 4096)])
        .expect("disk copy");
    // Removed disk copies leave files to delete; a fetch takes those queued so far.
    for i in [3, 6] {
        let key = format!("r{round}-k{i}-on-node");
        leader
            .offload_done(client, &[(key.clone(), 4096)])
            .expect("disk copy");
        leader.remove(&key, true).expect("remove");
        if i == 3 {
            let taken = leader.offload_fetch(client, 0).expect("fetch").delete;
            assert_eq!(taken, vec![key]);
        }
    }
    leader.evict(1 << 20);
    if round > 0 {
        leader.remove_client(client - 1);
    }
}

/// Id of task `n` of `round`: 1 running, 2 pending, 3 finished.
fn task_id(round: u64, n: u64) -> u128 {
    u128::from(10_000 + round * 10 + n)
}

/// Copy tasks from segment `name` of `client` to a second segment of it: one running,
/// one pending, one finished.
async fn tasks(leader: &MasterService, round: u64, client: u128, name: &str) {
    let target = format!("{name}-b");
    MasterExt::mount_segment(
        leader,
        client,
        target.clone(),
        1 << 20,
        format!("{name}y"),
        0,
    )
    .await
    .expect("mount a second segment");
    let on_node = ReplicateConfig {
        preferred_segment: name.to_string(),
        ..ReplicateConfig::default()
    };
    let targets = [target];
    // The pending one last: fetching takes the oldest queued task.
    for n in [1, 3, 2] {
        let key = format!("r{round}-task{n}");
        put(leader, &key, 3000, &on_node);
        let id = task_id(round, n);
        assert_eq!(leader.create_copy_task(&key, &targets, id), Ok(id));
        if n != 2 {
            assert_eq!(leader.fetch_tasks(client, 1).len(), 1, "task {n} starts");
        }
        if n == 3 {
            leader.finish_task(client, id, Ok(())).expect("finished");
        }
    }
}

#[tokio::test]
async fn a_standby_applying_the_journal_matches_its_leader() {
    let leader = MasterService::new(config(), Clock::System);
    leader
        .mount_segment("local:1", 1 << 22, LOCAL_OWNER, "", 0)
        .expect("mount");
    workload(&leader, 0).await;
    let journal = Arc::new(Journal::new(3, Duration::from_millis(100)));
    leader.take_over(Arc::clone(&journal));
    // The standby joins with a snapshot taken mid-way, as a leader hands it out.
    let standby = MasterService::new(config(), Clock::System);
    let mut next = {
        let _quiet = journal.quiesce();
        let at = journal.head();
        journal.attach(STANDBY, at).expect("attach");
        standby
            .install_snapshot(leader.snapshot_state())
            .expect("install");
        at
    };
    for round in 1..4 {
        workload(&leader, round).await;
        catch_up(&journal, &standby, &mut next).await;
    }
    assert_eq!(
        normalized(standby.snapshot_state()),
        normalized(leader.snapshot_state())
    );
    let state = leader.snapshot_state();
    assert!(state.objects.len() > 20, "{} objects", state.objects.len());
    assert!(
        state
            .objects
            .iter()
            .any(|(_, image)| image.pending.is_some())
    );
    assert!(!state.disk.is_empty() && state.segments.len() >= 2);
    assert!(
        !state.disk_deletes.is_empty(),
        "files to delete are replicated"
    );
    assert!(state.tasks.len() >= 9, "{} tasks", state.tasks.len());
}

#[tokio::test]
async fn a_promoted_standby_continues_where_its_leader_stopped() {
    let leader = MasterService::new(config(), Clock::System);
    let journal = Arc::new(Journal::new(1, Duration::from_millis(100)));
    leader.take_over(Arc::clone(&journal));
    journal.attach(STANDBY, 0).expect("attach");
    let standby = MasterService::new(config(), Clock::System);
    let mut next = 0;
    workload(&leader, 0).await;
    catch_up(&journal, &standby, &mut next).await;
    let in_progress = leader.pending_write_id("r0-in-progress").expect("pending");
    // An upsert of an object being read: its old version's space waits for the lease.
    put(&leader, "leased", 4096, &ReplicateConfig::default());
    leader.get_replica_list("leased").expect("a read lease");
    let started = leader
        .upsert_start("leased", 4096, &ReplicateConfig::default())
        .expect("upsert");
    leader
        .put_end("leased", started.write_id)
        .expect("upsert end");
    let waiting = leader.snapshot_state().deferred;
    assert_eq!(waiting.len(), 1, "the old version waits for its reader");
    catch_up(&journal, &standby, &mut next).await;
    standby.take_over(Arc::new(Journal::new(2, Duration::from_millis(100))));
    assert_eq!(
        standby
            .snapshot_state()
            .deferred
            .iter()
            .map(|(space, _)| *space)
            .collect::<Vec<_>>(),
        waiting.iter().map(|(space, _)| *space).collect::<Vec<_>>(),
        "the new leader frees what its predecessor was waiting to free"
    );
    // The write in progress completes on the new leader, and new writes get new ids
    // and space the old leader had not given out.
    standby
        .put_end("r0-in-progress", in_progress)
        .expect("put_end of a write the old leader started");
    let fresh = standby
        .put_start("fresh", 4096, &ReplicateConfig::default())
        .expect("put_start");
    assert!(fresh.write_id > in_progress);
    // A readable object no copy or move task names (those answer that first).
    let state = standby.snapshot_state();
    let tasked: std::collections::HashSet<&str> =
        state.tasks.iter().map(|t| t.info.key.as_str()).collect();
    let kept = state
        .objects
        .iter()
        .find(|(key, image)| {
            image.readable.is_some() && image.pending.is_none() && !tasked.contains(key.as_str())
        })
        .map(|(key, _)| key.clone())
        .expect("a readable object");
    assert_eq!(
        standby.remove(&kept, false),
        Err(mooncake_core::error::ErrorCode::OBJECT_HAS_LEASE),
        "objects are held for one lease after a takeover"
    );
    // Copy tasks survive the failover: the running one is finished by its executor's
    // report to the new leader, the pending one is handed out by it.
    let (running, pending) = (task_id(0, 1), task_id(0, 2));
    standby
        .finish_task(1000, running, Ok(()))
        .expect("the new leader knows the running task");
    assert_eq!(
        standby.query_task(running).map(|t| t.status),
        Ok(mooncake_core::master_api::TaskStatus::Success)
    );
    let (replicas, _) = standby.get_replica_list("r0-task1").expect("readable");
    assert_eq!(replicas.len(), 2, "the copy is a replica now");
    let work = standby.fetch_tasks(1000, 10);
    assert_eq!(
        work.iter().map(|w| w.id).collect::<Vec<_>>(),
        vec![pending],
        "the pending task is handed out by the new leader"
    );
    assert_eq!(
        standby.remove("r0-task2", true),
        Err(mooncake_core::error::ErrorCode::OBJECT_HAS_REPLICATION_TASK),
        "the object of an unfinished task is held"
    );
}

#[test]
fn replication_decoders_refuse_garbage() {
    for bytes in [&b""[..], b"\x00", b"\xff\xff\xff\xff\xff", b"\x01\x05\x00"] {
        super::standby::check_foreign_replication_bytes(bytes);
    }
}

proptest::proptest! {
    #[test]
    fn no_input_panics_the_replication_decoders(
        bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)
    ) {
        super::standby::check_foreign_replication_bytes(&bytes);
    }
}
