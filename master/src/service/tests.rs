use super::*;
use crate::{ClientStatus, LOCAL_OWNER, MAX_REGEX_LEN, TaskStatus};
use mooncake_core::types::{ReplicaLocation, SoftPinAction};

fn master(capacity: u64) -> (MasterService, Clock) {
    let clock = Clock::manual();
    let master = MasterService::new(MasterConfig::default(), clock.clone());
    master
        .mount_segment("node-a:50052", capacity, LOCAL_OWNER, "", 0)
        .expect("mount");
    (master, clock)
}

fn end(master: &MasterService, key: &str) -> CodeResult<()> {
    let id = master
        .pending_write_id(key)
        .ok_or(ErrorCode::INVALID_WRITE)?;
    master.put_end(key, id)
}

fn revoke(master: &MasterService, key: &str) -> CodeResult<()> {
    let id = master
        .pending_write_id(key)
        .ok_or(ErrorCode::INVALID_WRITE)?;
    master.put_revoke(key, id)
}

fn put(master: &MasterService, key: &str, size: u64) -> CodeResult<()> {
    master.put_start(key, size, &ReplicateConfig::default())?;
    end(master, key)
}

#[test]
fn two_phase_put_then_read() {
    let (master, _) = master(1 << 20);
    let started = master
        .put_start("k", 100, &ReplicateConfig::default())
        .expect("start");
    assert_eq!(started.replicas.len(), 1);
    assert_eq!(
        master.get_replica_list("k"),
        Err(ErrorCode::REPLICA_IS_NOT_READY)
    );
    assert_eq!(master.exist("k"), Ok(false));
    end(&master, "k").expect("end");
    let (replicas, ttl) = master.get_replica_list("k").expect("readable");
    assert_eq!(replicas[0].size, 100);
    assert_eq!(ttl, Duration::from_secs(10));
    assert_eq!(master.object_size("k"), Ok(100));
}

#[test]
fn put_never_overwrites() {
    let (master, _) = master(1 << 20);
    put(&master, "k", 100).expect("first put");
    assert_eq!(
        master.put_start("k", 200, &ReplicateConfig::default()),
        Err(ErrorCode::OBJECT_ALREADY_EXISTS)
    );
    assert_eq!(master.object_size("k"), Ok(100));
}

#[test]
fn revoke_frees_space() {
    let (master, _) = master(4096);
    master
        .put_start("k", 4096, &ReplicateConfig::default())
        .expect("start");
    assert_eq!(
        master
            .put_start("j", 64, &ReplicateConfig::default())
            .map(|_| ()),
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    );
    revoke(&master, "k").expect("revoke");
    assert_eq!(master.exist("k"), Ok(false));
    put(&master, "j", 4096).expect("space is back");
}

#[test]
fn lease_blocks_remove_until_it_expires() {
    let (master, clock) = master(1 << 20);
    put(&master, "k", 100).expect("put");
    assert_eq!(
        master.remove("k", false),
        Ok(()),
        "no lease right after put"
    );
    put(&master, "k", 100).expect("put again");
    master.get_replica_list("k").expect("read");
    assert_eq!(master.remove("k", false), Err(ErrorCode::OBJECT_HAS_LEASE));
    clock.advance(Duration::from_secs(11));
    assert_eq!(master.remove("k", false), Ok(()));
    assert_eq!(master.remove("k", false), Err(ErrorCode::OBJECT_NOT_FOUND));
}

#[test]
fn forced_remove_under_lease_holds_space_until_lease_ends() {
    let (master, clock) = master(4096);
    put(&master, "k", 4096).expect("put");
    master.get_replica_list("k").expect("read");
    assert_eq!(master.remove("k", true), Ok(()));
    assert_eq!(
        master
            .put_start("j", 4096, &ReplicateConfig::default())
            .map(|_| ()),
        Err(ErrorCode::NO_AVAILABLE_HANDLE),
        "a reader may still be copying"
    );
    clock.advance(Duration::from_secs(11));
    put(&master, "j", 4096).expect("space released after the lease");
}

#[test]
fn stale_write_is_discarded_but_space_waits_for_release_timeout() {
    let (master, clock) = master(8192);
    master
        .put_start("k", 4096, &ReplicateConfig::default())
        .expect("start");
    assert_eq!(
        master
            .put_start("k", 4096, &ReplicateConfig::default())
            .map(|_| ()),
        Err(ErrorCode::OBJECT_ALREADY_EXISTS)
    );
    clock.advance(Duration::from_secs(31));
    master
        .put_start("k", 4096, &ReplicateConfig::default())
        .expect("discarded and restarted");
    assert_eq!(
        master.stats().segments[0].used,
        8192,
        "old space not reused yet"
    );
    end(&master, "k").expect("end");
    clock.advance(Duration::from_secs(601));
    put(&master, "x", 64).expect("put");
    assert_eq!(master.stats().segments[0].used, 4096 + 64);
}

#[test]
fn abandoned_writes_are_discarded_on_time_without_scanning_every_pass() {
    let (master, clock) = master(1 << 20);
    master
        .put_start("early", 4096, &ReplicateConfig::default())
        .expect("start");
    master.maintenance();
    clock.advance(Duration::from_secs(300));
    master
        .put_start("late", 4096, &ReplicateConfig::default())
        .expect("start");
    put(&master, "done", 64).expect("put");
    // Before the earliest write can have expired, a pass does not scan the index.
    master.maintenance();
    assert_eq!(master.stats().writes_in_progress, 2);
    let due = *master.abandoned_scan_due.lock();
    // Past 600 s for "early" only: it alone is discarded and its space freed.
    clock.advance(Duration::from_secs(301));
    master.maintenance();
    assert_eq!(master.stats().writes_in_progress, 1);
    assert_eq!(master.pending_write_id("early"), None);
    assert!(master.pending_write_id("late").is_some());
    assert_eq!(master.stats().segments[0].used, 4096 + 64);
    assert!(
        *master.abandoned_scan_due.lock() > due,
        "the next scan waits for the write left in progress"
    );
    // The remaining write expires 600 s after it started.
    clock.advance(Duration::from_secs(290));
    master.maintenance();
    assert!(master.pending_write_id("late").is_some());
    clock.advance(Duration::from_secs(20));
    master.maintenance();
    assert_eq!(master.stats().writes_in_progress, 0);
    assert_eq!(master.stats().segments[0].used, 64);
    assert_eq!(master.get_replica_list("done").map(|(r, _)| r.len()), Ok(1));
}

#[test]
fn remove_all_and_batch_remove() {
    let (master, _) = master(1 << 20);
    for key in ["a", "b", "c"] {
        put(&master, key, 10).expect("put");
    }
    master.get_replica_list("c").expect("lease c");
    let results = master.batch_remove(&["a".into(), "zz".into()], false);
    assert_eq!(results, vec![Ok(()), Err(ErrorCode::OBJECT_NOT_FOUND)]);
    assert_eq!(master.remove_all(false), 1, "c is leased");
    assert_eq!(master.remove_all(true), 1);
    assert_eq!(master.stats().objects, 0);
    assert_eq!(
        master.stats().segments[0].used,
        64,
        "c's space waits for its lease"
    );
}

#[test]
fn unmount_drops_replicas() {
    let (master, _) = master(1 << 20);
    put(&master, "k", 10).expect("put");
    let id = master.stats().segments[0].id;
    master.unmount_segment(id).expect("unmount");
    assert_eq!(master.exist("k"), Ok(false));
    assert_eq!(
        master
            .put_start("j", 10, &ReplicateConfig::default())
            .map(|_| ()),
        Err(ErrorCode::NO_AVAILABLE_HANDLE)
    );
}

#[test]
fn invalid_input() {
    let (master, _) = master(1 << 20);
    assert_eq!(put(&master, "", 10), Err(ErrorCode::INVALID_KEY));
    assert_eq!(put(&master, "k", 0), Err(ErrorCode::INVALID_PARAMS));
    let config = ReplicateConfig {
        replica_num: 0,
        ..ReplicateConfig::default()
    };
    assert_eq!(
        master.put_start("k", 1, &config).map(|_| ()),
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        master.mount_segment("node-a:50052", 10, LOCAL_OWNER, "", 0),
        Err(ErrorCode::SEGMENT_ALREADY_EXISTS)
    );
}

#[test]
fn upsert_replaces_only_at_the_end() {
    let (master, clock) = master(1 << 20);
    master
        .upsert_start("k", 100, &ReplicateConfig::default())
        .expect("insert");
    end(&master, "k").expect("end");
    let (before, _) = master.get_replica_list("k").expect("readable");
    master
        .upsert_start("k", 300, &ReplicateConfig::default())
        .expect("upsert");
    assert_eq!(
        master
            .upsert_start("k", 300, &ReplicateConfig::default())
            .map(|_| ()),
        Err(ErrorCode::OBJECT_REPLICA_BUSY)
    );
    assert_eq!(
        master.object_size("k"),
        Ok(100),
        "old version readable during the write"
    );
    assert_eq!(
        master.remove("k", true),
        Err(ErrorCode::REPLICA_IS_NOT_READY)
    );
    end(&master, "k").expect("end");
    let (after, _) = master.get_replica_list("k").expect("readable");
    assert_eq!(after[0].size, 300);
    assert_ne!(
        before[0].location, after[0].location,
        "new bytes went to fresh space"
    );
    assert_eq!(
        master.stats().segments[0].used,
        128 + 320,
        "old space held for its reader"
    );
    clock.advance(Duration::from_secs(11));
    put(&master, "x", 64).expect("put");
    assert_eq!(master.stats().segments[0].used, 320 + 64);
}

#[test]
fn upsert_revoke_keeps_the_old_version() {
    let (master, _) = master(1 << 20);
    put(&master, "k", 100).expect("put");
    master
        .upsert_start("k", 50, &ReplicateConfig::default())
        .expect("upsert");
    revoke(&master, "k").expect("revoke");
    assert_eq!(master.object_size("k"), Ok(100));
    assert_eq!(master.stats().writes_in_progress, 0);
}

#[test]
fn remove_by_regex_is_bounded_and_selective() {
    let (master, _) = master(1 << 20);
    for key in ["layer1/a", "layer1/b", "layer2/a"] {
        put(&master, key, 10).expect("put");
    }
    assert_eq!(master.remove_by_regex("^layer1/", false), Ok(2));
    assert_eq!(master.exist("layer2/a"), Ok(true));
    assert_eq!(
        master.remove_by_regex("(", false),
        Err(ErrorCode::INVALID_PARAMS)
    );
    let huge = "a".repeat(MAX_REGEX_LEN + 1);
    assert_eq!(
        master.remove_by_regex(&huge, false),
        Err(ErrorCode::INVALID_PARAMS)
    );
    assert_eq!(
        master.remove_by_regex("(a+)+$", true),
        Ok(1),
        "no catastrophic backtracking"
    );
}

#[test]
fn tasks_are_validated_at_creation() {
    let (master, _) = master(1 << 20);
    put(&master, "k", 10).expect("put");
    let own = vec!["node-a:50052".to_string()];
    assert_eq!(master.create_copy_task("k", &own, 7), Ok(7));
    assert_eq!(
        master.query_task(7).map(|t| t.status),
        Ok(TaskStatus::Success)
    );
    let missing = vec!["node-z:1".to_string()];
    assert_eq!(
        master.create_copy_task("k", &missing, 8),
        Err(ErrorCode::SEGMENT_NOT_FOUND)
    );
    assert_eq!(
        master.create_copy_task("nope", &own, 9),
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
    assert_eq!(
        master.create_move_task("k", "node-z:1", "node-a:50052", 10),
        Err(ErrorCode::REPLICA_NOT_FOUND)
    );
    assert_eq!(master.query_task(8), Err(ErrorCode::TASK_NOT_FOUND));
}

#[test]
fn eviction_takes_unpinned_unleased_objects_oldest_first() {
    let (master, clock) = master(10 * 1024);
    let hard = ReplicateConfig {
        with_hard_pin: true,
        ..ReplicateConfig::default()
    };
    master.put_start("pinned", 1024, &hard).expect("start");
    end(&master, "pinned").expect("end");
    for i in 0..8 {
        put(&master, &format!("k{i}"), 1024).expect("put");
        clock.advance(Duration::from_millis(1));
    }
    master.get_replica_list("k7").expect("lease k7");
    clock.advance(Duration::from_millis(1));
    // Full: a new put evicts the oldest unleased, unpinned objects.
    put(&master, "new", 2048).expect("eviction makes room");
    assert_eq!(master.exist("pinned"), Ok(true));
    assert_eq!(master.exist("k7"), Ok(true), "leased object kept");
    assert_eq!(
        master.object_size("k0"),
        Err(ErrorCode::OBJECT_NOT_FOUND),
        "oldest evicted"
    );
    assert_eq!(master.stats().evicted_objects, 2);
}

#[test]
fn full_of_pinned_data_is_no_available_handle() {
    let (master, _) = master(4096);
    let hard = ReplicateConfig {
        with_hard_pin: true,
        ..ReplicateConfig::default()
    };
    master.put_start("a", 4096, &hard).expect("start");
    end(&master, "a").expect("end");
    assert_eq!(put(&master, "b", 64), Err(ErrorCode::NO_AVAILABLE_HANDLE));
}

#[test]
fn soft_pin_is_second_pass_and_ttl_is_bounded() {
    let (master, clock) = master(2048);
    let soft = ReplicateConfig {
        soft_pin_action: SoftPinAction::Enable,
        ..ReplicateConfig::default()
    };
    master.put_start("soft", 1024, &soft).expect("start");
    end(&master, "soft").expect("end");
    put(&master, "plain", 1024).expect("put");
    clock.advance(Duration::from_millis(1));
    put(&master, "next", 1024).expect("evicts plain first");
    assert_eq!(master.exist("soft"), Ok(true));
    assert_eq!(master.exist("plain"), Ok(false));
    let too_long = ReplicateConfig {
        soft_pin_action: SoftPinAction::Enable,
        soft_pin_ttl_ms: Some(25 * 3600 * 1000),
        ..ReplicateConfig::default()
    };
    assert_eq!(
        master.put_start("x", 1, &too_long).map(|_| ()),
        Err(ErrorCode::INVALID_PARAMS)
    );
}

#[test]
fn silent_clients_lose_their_segments() {
    let (master, clock) = master(4096);
    let remote = 42u128;
    master
        .mount_segment("node-b:1", 4096, remote, "127.0.0.1:9", 0)
        .expect("mount");
    assert_eq!(master.heartbeat(remote), ClientStatus::Ok);
    assert_eq!(master.heartbeat(7), ClientStatus::NeedRemount);
    let only_b = ReplicateConfig {
        preferred_segment: "node-b:1".into(),
        ..ReplicateConfig::default()
    };
    master.put_start("on-b", 100, &only_b).expect("start");
    end(&master, "on-b").expect("end");
    clock.advance(Duration::from_secs(5));
    assert!(master.maintenance().dead_clients.is_empty());
    clock.advance(Duration::from_secs(6));
    assert_eq!(master.maintenance().dead_clients, vec![remote]);
    assert_eq!(master.exist("on-b"), Ok(false));
    assert_eq!(master.stats().segments.len(), 1);
    assert_eq!(master.heartbeat(remote), ClientStatus::NeedRemount);
}

#[test]
fn a_client_whose_segment_name_is_mounted_by_another_is_told_it_is_displaced() {
    let (master, _clock) = master(4096);
    let (old, new) = (42u128, 43u128);
    let first = master
        .mount_segment("node-b:1", 4096, old, "127.0.0.1:9", 0)
        .expect("mount");
    let second = master
        .mount_segment("node-b:1", 4096, new, "127.0.0.1:10", 0)
        .expect("a restarted instance takes the name");
    assert_ne!(first, second);
    assert_eq!(master.heartbeat(old), ClientStatus::Displaced);
    assert_eq!(master.heartbeat(new), ClientStatus::Ok);
    let names: Vec<_> = master
        .stats()
        .segments
        .iter()
        .map(|s| s.endpoint.clone())
        .collect();
    assert!(
        names.contains(&"127.0.0.1:10".to_string()) && !names.contains(&"127.0.0.1:9".to_string()),
        "{names:?}"
    );
}

#[test]
fn watermark_maintenance_evicts_down_below_the_mark() {
    let (master, clock) = master(100 * 1024);
    for i in 0..95 {
        put(&master, &format!("k{i}"), 1024).expect("put");
    }
    clock.advance(Duration::from_millis(1));
    let report = master.maintenance();
    assert!(report.eviction.objects >= 10, "{report:?}");
    let usage = &master.stats().segments[0];
    assert!(usage.used <= 85 * 1024, "{usage:?}");
}

#[test]
fn replica_num_spreads_over_distinct_segments() {
    let (master, _) = master(1 << 20);
    master
        .mount_segment("node-b:1", 1 << 20, LOCAL_OWNER, "", 0)
        .expect("mount");
    let two = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    let started = master.put_start("k", 10, &two).expect("start");
    let names: std::collections::HashSet<_> = started
        .replicas
        .iter()
        .map(|r| r.location.segment_name().to_string())
        .collect();
    assert_eq!(names.len(), 2);
}

#[test]
fn a_restarted_client_replaces_its_stale_segment() {
    let (master, _) = master(4096);
    master
        .mount_segment("node-b:1", 4096, 1, "e", 0)
        .expect("mount");
    put(&master, "x", 10).expect("put");
    let id = master
        .mount_segment("node-b:1", 4096, 2, "e", 0)
        .expect("new instance");
    assert!(master.stats().segments.iter().any(|s| s.id == id));
    assert_eq!(master.stats().segments.len(), 2);
    assert_eq!(
        master.mount_segment("node-b:1", 4096, 2, "e", 0),
        Err(ErrorCode::SEGMENT_ALREADY_EXISTS)
    );
}

#[test]
fn a_discarded_writer_cannot_complete_or_cancel_the_new_write() {
    let (master, clock) = master(1 << 20);
    let slow = master
        .put_start("k", 100, &ReplicateConfig::default())
        .expect("slow writer");
    clock.advance(Duration::from_secs(31));
    let fresh = master
        .put_start("k", 200, &ReplicateConfig::default())
        .expect("replaces it");
    assert_eq!(
        master.put_end("k", slow.write_id),
        Err(ErrorCode::INVALID_WRITE)
    );
    assert_eq!(
        master.put_revoke("k", slow.write_id),
        Err(ErrorCode::INVALID_WRITE)
    );
    master
        .put_end("k", fresh.write_id)
        .expect("the new writer completes");
    assert_eq!(master.object_size("k"), Ok(200));
}

/// A master with segments `a` (owner 1) and `b` (owner 2) and `k` (1000 bytes) on `a`.
fn two_nodes_with_object_on_a() -> MasterService {
    two_nodes_on(Clock::manual())
}

/// [`two_nodes_with_object_on_a`] on `clock`.
fn two_nodes_on(clock: Clock) -> MasterService {
    let master = MasterService::new(MasterConfig::default(), clock);
    master
        .mount_segment("a", 1 << 20, 1, "a:1", 0)
        .expect("mount a");
    master
        .mount_segment("b", 1 << 20, 2, "b:1", 0)
        .expect("mount b");
    let config = ReplicateConfig {
        preferred_segment: "a".into(),
        ..ReplicateConfig::default()
    };
    master.put_start("k", 1000, &config).expect("start");
    end(&master, "k").expect("end");
    master
}

fn holders(master: &MasterService, key: &str) -> Vec<String> {
    let mut names: Vec<String> = master
        .replica_descriptors(key)
        .expect("readable")
        .iter()
        .map(|d| d.location.segment_name().to_string())
        .collect();
    names.sort();
    names
}

fn used(master: &MasterService, name: &str) -> u64 {
    master
        .stats()
        .segments
        .iter()
        .find(|s| s.name == name)
        .map_or(0, |s| s.used)
}

#[test]
fn a_copy_task_is_executed_by_the_source_owner() {
    let master = two_nodes_with_object_on_a();
    let targets = vec!["b".to_string()];
    assert_eq!(master.create_copy_task("k", &targets, 1), Ok(1));
    let status = |id| master.query_task(id).map(|t| t.status);
    assert_eq!(status(1), Ok(TaskStatus::Pending));
    // Busy while the task is unfinished.
    assert_eq!(
        master.remove("k", true),
        Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK)
    );
    assert_eq!(
        master
            .upsert_start("k", 10, &ReplicateConfig::default())
            .map(|_| ()),
        Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK)
    );
    assert_eq!(
        master.create_copy_task("k", &targets, 2),
        Err(ErrorCode::OBJECT_HAS_REPLICATION_TASK)
    );
    assert!(
        master.fetch_tasks(2, 16).is_empty(),
        "b does not own the source"
    );
    let work = master.fetch_tasks(1, 16);
    assert_eq!(work.len(), 1);
    assert_eq!(work[0].source.location.segment_name(), "a");
    assert_eq!(work[0].targets.len(), 1);
    assert_eq!(work[0].targets[0].location.segment_name(), "b");
    assert_eq!(status(1), Ok(TaskStatus::Running));
    assert_eq!(used(&master, "b"), 1024);
    assert_eq!(
        master.finish_task(2, 1, Ok(())),
        Err(ErrorCode::TASK_NOT_FOUND)
    );
    assert_eq!(master.finish_task(1, 1, Ok(())), Ok(()));
    assert_eq!(status(1), Ok(TaskStatus::Success));
    assert_eq!(holders(&master, "k"), ["a", "b"]);
    assert_eq!(
        master.finish_task(1, 1, Ok(())),
        Err(ErrorCode::TASK_NOT_FOUND)
    );
    assert_eq!(master.remove("k", true), Ok(()));
}

#[test]
fn a_move_task_drops_its_source_and_a_failed_one_frees_its_target() {
    let master = two_nodes_with_object_on_a();
    assert_eq!(master.create_move_task("k", "a", "b", 1), Ok(1));
    let work = master.fetch_tasks(1, 16);
    assert_eq!(master.finish_task(1, work[0].id, Err(-800)), Ok(()));
    assert_eq!(
        master.query_task(1).map(|t| t.status),
        Ok(TaskStatus::Failed(-800))
    );
    assert_eq!(
        used(&master, "b"),
        0,
        "a failed task frees its target space"
    );
    assert_eq!(holders(&master, "k"), ["a"]);

    assert_eq!(master.create_move_task("k", "a", "b", 2), Ok(2));
    let work = master.fetch_tasks(1, 16);
    assert_eq!(master.finish_task(1, work[0].id, Ok(())), Ok(()));
    assert_eq!(holders(&master, "k"), ["b"]);
    assert_eq!(
        master.create_move_task("k", "a", "b", 3),
        Err(ErrorCode::REPLICA_NOT_FOUND)
    );
    assert_eq!(master.create_move_task("k", "b", "b", 4), Ok(4));
    assert_eq!(
        holders(&master, "k"),
        ["b"],
        "a move onto its source changes nothing"
    );
}

#[test]
fn tasks_of_a_dead_executor_fail_and_release_the_object() {
    let master = two_nodes_with_object_on_a();
    assert_eq!(master.create_copy_task("k", &["b".to_string()], 1), Ok(1));
    let _work = master.fetch_tasks(1, 16);
    assert_eq!(used(&master, "b"), 1024);
    master.remove_client(1);
    assert_eq!(
        master.query_task(1).map(|t| t.status),
        Ok(TaskStatus::Failed(ErrorCode::REPLICA_IS_GONE.as_i32()))
    );
    assert_eq!(used(&master, "b"), 0);
    assert_eq!(
        master.exist("k"),
        Ok(false),
        "its only replica was on the dead node"
    );
}

#[test]
fn overdue_tasks_fail() {
    let clock = Clock::manual();
    let master = two_nodes_on(clock.clone());
    assert_eq!(master.create_copy_task("k", &["b".to_string()], 1), Ok(1));
    master.heartbeat(1);
    master.heartbeat(2);
    clock.advance(Duration::from_secs(301));
    master.heartbeat(1);
    master.heartbeat(2);
    master.maintenance();
    assert_eq!(
        master.query_task(1).map(|t| t.status),
        Ok(TaskStatus::Failed(ErrorCode::RPC_TIMEOUT.as_i32()))
    );
    assert_eq!(master.remove("k", true), Ok(()), "the object is free again");
}

#[test]
fn an_object_costs_one_80_byte_slot_plus_its_key() {
    // The per-key budget (200 bytes plus the key, hash table overhead included)
    // depends on this; a single replica is stored inline.
    assert!(std::mem::size_of::<(Box<str>, ObjectEntry)>() <= 80);
    let master = two_nodes_with_object_on_a();
    let shard = master.shard("k").lock();
    let entry = shard.get("k").expect("stored");
    assert!(matches!(
        entry.readable.as_ref().map(|v| &v.replicas),
        Some(crate::objects::Replicas::One(_))
    ));
}

#[test]
fn objects_on_disk_outlive_memory_eviction() {
    let refused = two_nodes_with_object_on_a();
    assert_eq!(refused.enable_offload(1), Err(ErrorCode::UNABLE_OFFLOAD));

    let config = MasterConfig {
        enable_offload: true,
        ..MasterConfig::default()
    };
    let clock = Clock::manual();
    let master = MasterService::new(config, clock.clone());
    master.mount_segment("a", 2048, 1, "a:1", 0).expect("mount");
    assert_eq!(
        master.offload_fetch(1, 16),
        Err(ErrorCode::SEGMENT_NOT_FOUND)
    );
    master.enable_offload(1).expect("enable");
    put(&master, "k", 1000).expect("put");
    let work = master.offload_fetch(1, 16).expect("work");
    assert_eq!(work.store, vec![("k".to_string(), 1000)]);
    master.offload_done(1, &work.store).expect("done");
    assert_eq!(master.stats().objects_on_disk, 1);
    // Memory fills up: k is evicted from memory but stays readable from disk.
    clock.advance(Duration::from_millis(1));
    put(&master, "x", 1000).expect("put x");
    clock.advance(Duration::from_millis(1));
    put(&master, "y", 1000).expect("put y evicts k");
    let (replicas, _) = master.get_replica_list("k").expect("on disk");
    assert_eq!(
        replicas[0].location,
        mooncake_core::types::ReplicaLocation::Disk {
            segment_name: "a".into(),
            endpoint: "a:1".into()
        }
    );
    assert_eq!(master.exist("k"), Ok(true));
    assert_eq!(master.object_size("k"), Ok(1000));
    assert_eq!(
        master
            .put_start("k", 10, &ReplicateConfig::default())
            .map(|_| ()),
        Err(ErrorCode::OBJECT_ALREADY_EXISTS)
    );
    // Removal deletes the disk copy and tells the owner to delete the file.
    let _ = master.offload_fetch(1, 16);
    assert_eq!(master.remove("k", false), Ok(()));
    assert_eq!(master.exist("k"), Ok(false));
    assert_eq!(
        master.offload_fetch(1, 16).expect("work").delete,
        vec!["k".to_string()]
    );
    // A stale report (the object was replaced by another size) is refused.
    master
        .offload_done(1, &[("y".to_string(), 5)])
        .expect("report");
    assert_eq!(master.stats().objects_on_disk, 0);
    // Disk eviction and the owner's death forget disk copies.
    master
        .offload_done(1, &[("y".to_string(), 1000)])
        .expect("report");
    master.disk_evicted(1, &["y".to_string()]);
    assert_eq!(master.stats().objects_on_disk, 0);
    master
        .offload_done(1, &[("z".to_string(), 7)])
        .expect("disk-only object");
    assert_eq!(master.object_size("z"), Ok(7));
    assert_eq!(
        master.remove_all(false),
        3,
        "x and y in memory, z only on disk"
    );
    master
        .offload_done(1, &[("w".to_string(), 7)])
        .expect("disk-only object");
    master.remove_client(1);
    assert_eq!(master.exist("w"), Ok(false));
}

/// A master with the SSD tier enabled, on a manual clock.
fn offload_master() -> MasterService {
    let config = MasterConfig {
        enable_offload: true,
        ..MasterConfig::default()
    };
    MasterService::new(config, Clock::manual())
}

#[test]
fn a_disk_copy_written_while_its_object_was_removed_or_replaced_is_not_recorded() {
    let master = offload_master();
    master
        .mount_segment("a", 1 << 20, 1, "a:1", 0)
        .expect("mount");
    master.enable_offload(1).expect("enable");
    put(&master, "removed", 1000).expect("put");
    put(&master, "replaced", 1000).expect("put");
    let work = master.offload_fetch(1, 16).expect("work");
    assert_eq!(work.store.len(), 2, "both are being written to disk");
    // While the owner writes them, one is removed and the other replaced (same size).
    assert_eq!(master.remove("removed", true), Ok(()));
    let started = master
        .upsert_start("replaced", 1000, &ReplicateConfig::default())
        .expect("upsert");
    master
        .put_end("replaced", started.write_id)
        .expect("upsert end");
    master.offload_done(1, &work.store).expect("report");
    assert_eq!(
        master.exist("removed"),
        Ok(false),
        "a removed object does not come back from disk"
    );
    assert_eq!(
        master.stats().objects_on_disk,
        0,
        "neither old copy is recorded"
    );
    let next = master.offload_fetch(1, 16).expect("work");
    assert!(
        next.delete.contains(&"removed".to_string())
            && next.delete.contains(&"replaced".to_string()),
        "the owner deletes both files: {:?}",
        next.delete
    );
    assert_eq!(
        next.store,
        vec![("replaced".to_string(), 1000)],
        "the new version goes to disk"
    );
}

#[test]
fn a_file_removed_while_its_node_restarted_does_not_come_back_with_its_disk() {
    let master = offload_master();
    master
        .mount_segment("node:1", 1 << 20, 1, "node:2", 42)
        .expect("mount a segment file");
    master.enable_offload(1).expect("enable");
    put(&master, "gone", 1000).expect("put");
    let work = master.offload_fetch(1, 16).expect("work");
    master.offload_done(1, &work.store).expect("on disk");
    // The node dies; meanwhile the object is removed (its file is to be deleted).
    assert_eq!(master.remove("gone", true), Ok(()));
    // It restarts (client 2) with the same segment file and reports its disk, which
    // still holds the file.
    master
        .mount_segment("node:1", 1 << 20, 2, "node:2", 42)
        .expect("taken back");
    master.enable_offload(2).expect("enable");
    master
        .offload_done(2, &[("gone".to_string(), 1000)])
        .expect("report");
    assert_eq!(
        master.exist("gone"),
        Ok(false),
        "a removed object stays removed"
    );
    assert_eq!(
        master.offload_fetch(2, 16).expect("work").delete,
        vec!["gone".to_string()],
        "the restarted node deletes the file"
    );
}

#[test]
fn a_node_restarted_on_its_segment_file_keeps_its_disk_copies_readable() {
    let master = offload_master();
    master
        .mount_segment("node:1", 1 << 20, 1, "node:2", 42)
        .expect("mount a segment file");
    master.enable_offload(1).expect("enable");
    master
        .offload_done(1, &[("on-disk".to_string(), 7)])
        .expect("an object only on disk");
    // The node restarts (client 2, a new endpoint) and takes its segment back; until
    // it reports its disk, its copies are still read, from the new endpoint.
    master
        .mount_segment("node:1", 1 << 20, 2, "node:3", 42)
        .expect("taken back");
    let (replicas, _) = master.get_replica_list("on-disk").expect("still readable");
    assert_eq!(
        replicas[0].location,
        mooncake_core::types::ReplicaLocation::Disk {
            segment_name: "node:1".into(),
            endpoint: "node:3".into()
        }
    );
    master.enable_offload(2).expect("enable");
    // Its disk also holds a file of an object removed while the deletion was lost
    // with the previous process: not a copy, deleted.
    master
        .offload_done(2, &[("on-disk".to_string(), 7), ("stale".to_string(), 5)])
        .expect("report");
    assert_eq!(master.object_size("on-disk"), Ok(7));
    assert_eq!(master.exist("stale"), Ok(false), "a stale file stays gone");
    assert_eq!(
        master.stats().objects_on_disk,
        1,
        "one copy, the new node's"
    );
    assert_eq!(
        master.offload_fetch(2, 16).expect("work").delete,
        vec!["stale".to_string()]
    );
}

#[test]
fn with_offload_on_evict_objects_reach_the_disk_only_when_chosen_for_eviction() {
    let config = MasterConfig {
        enable_offload: true,
        offload_on_evict: true,
        ..MasterConfig::default()
    };
    let clock = Clock::manual();
    let master = MasterService::new(config, clock.clone());
    master.mount_segment("a", 2048, 1, "a:1", 0).expect("mount");
    master.enable_offload(1).expect("enable");
    put(&master, "k", 1000).expect("put");
    clock.advance(Duration::from_millis(1));
    put(&master, "x", 1000).expect("put");
    assert!(
        master.offload_fetch(1, 16).expect("work").store.is_empty(),
        "nothing is queued when written"
    );
    // Memory is full: the oldest object is chosen, queued for the disk, and stays
    // in memory (the write waits) until the node has written it.
    clock.advance(Duration::from_millis(1));
    assert_eq!(put(&master, "y", 1000), Err(ErrorCode::NO_AVAILABLE_HANDLE));
    let work = master.offload_fetch(1, 16).expect("work");
    assert_eq!(work.store, vec![("k".to_string(), 1000)]);
    assert_eq!(master.object_size("k"), Ok(1000));
    master.offload_done(1, &work.store).expect("done");
    put(&master, "y", 1000).expect("room once k is on disk");
    let (replicas, _) = master.get_replica_list("k").expect("on disk");
    assert!(matches!(
        replicas[0].location,
        mooncake_core::types::ReplicaLocation::Disk { .. }
    ));
    assert!(
        master.offload_fetch(1, 16).expect("work").store.is_empty(),
        "x was not needed and stays memory-only"
    );
}

#[test]
fn a_reserved_write_is_committed_under_its_key_once_and_survives_an_existing_key() {
    let (master, _) = master(1 << 20);
    let config = ReplicateConfig::default();
    let reserved = master.put_start("__r/1", 100, &config).expect("reserve");
    put(&master, "taken", 100).expect("put");
    assert_eq!(
        master.put_commit("__r/1", reserved.write_id, "taken"),
        Err(ErrorCode::OBJECT_ALREADY_EXISTS)
    );
    assert_eq!(
        master.put_commit("__r/1", reserved.write_id + 1, "fresh"),
        Err(ErrorCode::INVALID_WRITE)
    );
    // The reservation is intact: it commits under another key, with its own space.
    master
        .put_commit("__r/1", reserved.write_id, "fresh")
        .expect("commit");
    let (replicas, _) = master.get_replica_list("fresh").expect("readable");
    assert_eq!(replicas[0].location, reserved.replicas[0].location);
    assert_eq!(master.pending_write_id("__r/1"), None);
    assert_eq!(master.stats().objects, 2);
    assert_eq!(master.stats().writes_in_progress, 0);
    assert_eq!(
        master.put_commit("__r/1", reserved.write_id, "again"),
        Err(ErrorCode::INVALID_WRITE)
    );
    // An object is not a reservation, and a key cannot commit onto itself.
    let other = master.put_start("__r/2", 100, &config).expect("reserve");
    assert_eq!(
        master.put_commit("taken", 1, "third"),
        Err(ErrorCode::INVALID_WRITE)
    );
    assert_eq!(
        master.put_commit("__r/2", other.write_id, "__r/2"),
        Err(ErrorCode::INVALID_PARAMS)
    );
}

#[test]
fn a_read_lease_ends_one_ttl_after_the_read_and_no_later() {
    let (master, clock) = master(1 << 20);
    put(&master, "k", 100).expect("put");
    // A read at an instant between two microseconds.
    clock.advance(Duration::from_nanos(123_456_789));
    master.get_replica_list("k").expect("read");
    clock.advance(Duration::from_secs(10) - Duration::from_micros(2));
    assert_eq!(master.remove("k", false), Err(ErrorCode::OBJECT_HAS_LEASE));
    // Uses in between (an existence check without a lease) keep the end exact.
    assert_eq!(
        master.exist_within("k", &mut LeaseBudget(Some(0))),
        Ok(Some(100))
    );
    clock.advance(Duration::from_micros(2));
    assert_eq!(
        master.remove("k", false),
        Ok(()),
        "the lease outlived one TTL"
    );
}

#[test]
fn a_shorter_lease_asked_for_ends_at_its_own_end() {
    let (master, clock) = master(1 << 20);
    put(&master, "k", 100).expect("put");
    master
        .get_replica_list_leased("k", Some(Duration::from_millis(300)))
        .expect("read");
    clock.advance(Duration::from_millis(299));
    assert_eq!(master.remove("k", false), Err(ErrorCode::OBJECT_HAS_LEASE));
    clock.advance(Duration::from_millis(1));
    assert_eq!(master.remove("k", false), Ok(()));
}

#[test]
fn clearing_skips_objects_read_or_written_within_a_lease() {
    let (master, clock) = master(1 << 20);
    put(&master, "written", 100).expect("put");
    assert_eq!(
        master.clear_replicas("written", None),
        Err(ErrorCode::OBJECT_HAS_LEASE)
    );
    assert_eq!(
        master.remove("written", false),
        Ok(()),
        "a fresh put does not block remove"
    );
    put(&master, "read", 100).expect("put");
    clock.advance(Duration::from_secs(11));
    master.get_replica_list("read").expect("read");
    assert_eq!(
        master.clear_replicas("read", None),
        Err(ErrorCode::OBJECT_HAS_LEASE)
    );
    clock.advance(Duration::from_secs(10));
    assert_eq!(master.clear_replicas("read", None), Ok(()));
    assert_eq!(master.exist("read"), Ok(false));
    assert_eq!(
        master.clear_replicas("read", None),
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
}

#[test]
fn clearing_one_segment_keeps_the_replicas_elsewhere() {
    let (master, clock) = master(1 << 20);
    master
        .mount_segment("node-b:50052", 1 << 20, LOCAL_OWNER, "", 0)
        .expect("mount b");
    let config = ReplicateConfig {
        replica_num: 2,
        ..ReplicateConfig::default()
    };
    master.put_start("k", 100, &config).expect("start");
    end(&master, "k").expect("end");
    clock.advance(Duration::from_secs(11));
    assert_eq!(
        master.clear_replicas("k", Some("node-c:1")),
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
    assert_eq!(master.clear_replicas("k", Some("node-a:50052")), Ok(()));
    let (replicas, _) = master.get_replica_list("k").expect("still readable");
    let names: Vec<_> = replicas
        .iter()
        .filter_map(|r| match &r.location {
            ReplicaLocation::Memory { segment_name, .. } => Some(segment_name.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(names, ["node-b:50052"]);
    clock.advance(Duration::from_secs(11));
    assert_eq!(master.clear_replicas("k", Some("node-b:50052")), Ok(()));
    assert_eq!(master.exist("k"), Ok(false));
}

/// A master with one segment file of generation `generation` owned by client 7, holding
/// object "kept".
fn with_segment_file(generation: u128, config: MasterConfig) -> (MasterService, Clock, SegmentId) {
    let clock = Clock::manual();
    let master = MasterService::new(config, clock.clone());
    let id = master
        .mount_segment("node-b:50052", 1 << 20, 7, "10.0.0.2:1000", generation)
        .expect("mount");
    put(&master, "kept", 4096).expect("put");
    (master, clock, id)
}

/// A 2 s client TTL and a 5 s remount grace.
fn graced_config() -> MasterConfig {
    MasterConfig {
        client_ttl: Duration::from_secs(2),
        remount_grace: Duration::from_secs(5),
        ..MasterConfig::default()
    }
}

fn endpoint_of(master: &MasterService, key: &str) -> String {
    let (replicas, _) = master.get_replica_list(key).expect("readable");
    match &replicas[0].location {
        ReplicaLocation::Memory { endpoint, .. } => endpoint.clone(),
        other => panic!("not in memory: {other:?}"),
    }
}

#[test]
fn a_restarted_owner_with_the_same_segment_file_takes_its_objects_back() {
    let (master, _, id) = with_segment_file(42, MasterConfig::default());
    let again = master
        .mount_segment("node-b:50052", 1 << 20, 8, "10.0.0.2:2000", 42)
        .expect("remount");
    assert_eq!(again, id, "the same segment, under the same id");
    assert_eq!(endpoint_of(&master, "kept"), "10.0.0.2:2000");
    assert_eq!(
        master.heartbeat(7),
        ClientStatus::NeedRemount,
        "the old instance is gone"
    );
    // Its space is still taken: a second object does not land on it.
    put(&master, "next", 4096).expect("put");
    assert_eq!(master.stats().objects, 2);
}

#[test]
fn space_freed_after_the_owner_took_its_segment_back_returns_to_it() {
    let (master, clock, _) = with_segment_file(42, MasterConfig::default());
    // A reader's lease defers the free of the removed object past the remount.
    master.get_replica_list("kept").expect("leased");
    assert_eq!(master.remove("kept", true), Ok(()));
    master
        .mount_segment("node-b:50052", 1 << 20, 8, "10.0.0.2:2000", 42)
        .expect("remount");
    clock.advance(Duration::from_secs(120));
    master.maintenance();
    let used: Vec<u64> = master.stats().segments.iter().map(|s| s.used).collect();
    assert_eq!(used, vec![0], "the freed space is back in the segment");
}

#[test]
fn another_generation_on_the_same_name_starts_empty() {
    let (master, _, id) = with_segment_file(42, MasterConfig::default());
    let again = master
        .mount_segment("node-b:50052", 1 << 20, 8, "10.0.0.2:2000", 43)
        .expect("mount");
    assert_ne!(again, id);
    assert_eq!(master.exist("kept"), Ok(false));
}

#[test]
fn a_silent_segment_file_waits_for_its_owner_through_the_grace() {
    let config = graced_config();
    let (master, clock, id) = with_segment_file(42, config);
    clock.advance(Duration::from_secs(3));
    master.maintenance();
    assert_eq!(master.exist("kept"), Ok(true), "kept through the grace");
    assert_eq!(
        master
            .put_start("new", 4096, &ReplicateConfig::default())
            .err(),
        Some(ErrorCode::NO_AVAILABLE_HANDLE),
        "nothing is placed on a segment whose owner is away"
    );
    clock.advance(Duration::from_secs(3));
    master.maintenance();
    let again = master
        .mount_segment("node-b:50052", 1 << 20, 8, "10.0.0.2:2000", 42)
        .expect("remount");
    assert_eq!(again, id);
    assert_eq!(endpoint_of(&master, "kept"), "10.0.0.2:2000");
    put(&master, "new", 4096).expect("placed again");
}

#[test]
fn a_segment_file_whose_owner_never_returns_goes_after_the_grace() {
    let config = graced_config();
    let (master, clock, _) = with_segment_file(42, config);
    clock.advance(Duration::from_secs(3));
    master.maintenance();
    clock.advance(Duration::from_secs(6));
    master.maintenance();
    assert_eq!(master.exist("kept"), Ok(false));
    assert!(master.segments.all().is_empty(), "unmounted");
}

#[test]
fn a_memfd_segment_goes_at_the_ttl_whatever_the_grace() {
    let config = graced_config();
    let (master, clock, _) = with_segment_file(0, config);
    clock.advance(Duration::from_secs(3));
    master.maintenance();
    assert_eq!(master.exist("kept"), Ok(false));
}
