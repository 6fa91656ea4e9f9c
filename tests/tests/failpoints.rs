//! Injected failures (a build with the `failpoints` feature: `.ci/run` builds with it;
//! without it these tests are ignored): each failpoint of `docs/troubleshooting.md#failpoints`
//! is switched on in a running process, the test checks that the documented error
//! reaches the caller, then switches it off and checks that nothing acknowledged was
//! lost. Every process is real and started on loopback; nothing is left running.

use std::time::Duration;

use mooncake_dummy_client::{DummyClient, ErrorCode, ReplicateConfig};
use mooncake_integration_tests::etcd::EtcdServer;
use mooncake_integration_tests::failpoints::FailpointFile;
use mooncake_integration_tests::offload::{
    TempDir, dummy, on_disk, only_on_disk, put_and_offload, put_past_memory, value,
};
use mooncake_integration_tests::{MasterProcess, RealClientProcess, eventually, unique_port};

const MIB: usize = 1 << 20;

/// Puts `count` objects of 64 KiB named `<prefix><i>` through `client` into `segment`.
fn put_all(client: &DummyClient, prefix: &str, count: usize, segment: &str) {
    let config = ReplicateConfig {
        preferred_segment: segment.to_string(),
        ..ReplicateConfig::default()
    };
    for i in 0..count {
        client
            .put(&format!("{prefix}{i}"), &value(i, 64 << 10), &config)
            .unwrap_or_else(|code| panic!("put {prefix}{i}: {code}"));
    }
}

/// Asserts that every object of [`put_all`] reads back byte-exact through `client`.
fn assert_all_back(client: &DummyClient, prefix: &str, count: usize) {
    for i in 0..count {
        let key = format!("{prefix}{i}");
        let got = client
            .get(&key)
            .unwrap_or_else(|code| panic!("{key} was acknowledged and is lost: {code}"));
        assert!(got == value(i, 64 << 10), "{key} reads back other bytes");
    }
}

/// A node with the SSD tier in `dir` (buckets, one round per second) following
/// `failpoints`.
fn disk_node(
    master: &MasterProcess,
    dir: &TempDir,
    failpoints: &FailpointFile,
) -> RealClientProcess {
    RealClientProcess::join_with_env(
        master,
        "16MB",
        &["--enable_offload=true"],
        &[
            ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", dir.path()),
            ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
            ("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "1GiB"),
            failpoints.env(),
        ],
    )
}

/// `offload.disk.read`: a read of an object only on disk fails with `FILE_READ_FAIL`
/// (-1102) while the disk fails; the object stays on disk and reads back whole after.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_failing_disk_read_reaches_the_reader_and_keeps_the_object() {
    let failpoints = FailpointFile::new();
    let dir = TempDir::new("fp-read");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let node = disk_node(&master, &dir, &failpoints);
    let client = dummy(&node);
    put_past_memory(&client, &node);
    let evicted: Vec<usize> = (0..8)
        .filter(|i| only_on_disk(&client, &format!("first-{i}")))
        .collect();
    assert!(!evicted.is_empty(), "nothing was evicted from memory");

    for error in ["eio", "enospc"] {
        failpoints.set(&format!("offload.disk.read=return({error})"));
        for i in &evicted {
            assert_eq!(
                client.get(&format!("first-{i}")).map(|_| ()),
                Err(ErrorCode::FILE_READ_FAIL),
                "first-{i} with reads failing ({error})"
            );
        }
    }
    failpoints.clear();
    for i in &evicted {
        let key = format!("first-{i}");
        assert!(only_on_disk(&client, &key), "{key} left the disk");
        assert!(client.get(&key).expect("read") == value(*i, MIB), "{key}");
    }
}

/// `offload.disk.write` and `offload.disk.fsync`: while the disk fails writes (an
/// error, a short write, a failed sync), objects are acknowledged and stay readable in
/// memory; nothing reaches the disk; once the disk works, new objects reach it again.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn failing_disk_writes_keep_objects_in_memory() {
    let failpoints = FailpointFile::new();
    let dir = TempDir::new("fp-write");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let node = disk_node(&master, &dir, &failpoints);
    let client = dummy(&node);
    put_and_offload(&client, &node, "before-", 2);
    for (round, spec) in [
        "offload.disk.write=return(eio)",
        "offload.disk.write=return(short)",
        "offload.disk.fsync=return(eio)",
    ]
    .into_iter()
    .enumerate()
    {
        failpoints.set(spec);
        let prefix = format!("during{round}-");
        put_all(&client, &prefix, 4, &node.segment_name());
        // Two offload rounds: each fails.
        std::thread::sleep(Duration::from_millis(2500));
        for i in 0..4 {
            assert!(
                !on_disk(&client, &format!("{prefix}{i}")),
                "{prefix}{i} is listed on disk although every write failed ({spec})"
            );
        }
        assert_all_back(&client, &prefix, 4);
    }
    failpoints.clear();
    put_and_offload(&client, &node, "after-", 2);
    for i in 0..2 {
        assert!(client.get(&format!("before-{i}")).expect("before") == value(i, MIB));
    }
}

/// `transfer.answer`: a node whose answers are cut mid-frame fails a peer's read with
/// `TRANSFER_FAIL` (-800); one cut connection is retried on a fresh one and the read
/// succeeds; nothing on the node is lost.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_transfer_connection_reset_mid_frame_fails_the_read_and_loses_nothing() {
    let failpoints = FailpointFile::new();
    let master = MasterProcess::start(&[]);
    let reader_node = RealClientProcess::join(&master, "64MB", &[]);
    let owner = RealClientProcess::join_with_env(&master, "64MB", &[], &[failpoints.env()]);
    let reader = dummy(&reader_node);
    put_all(&reader, "remote-", 8, &owner.segment_name());

    failpoints.set("transfer.answer=return");
    assert_eq!(
        reader.get("remote-0").map(|_| ()),
        Err(ErrorCode::TRANSFER_FAIL),
        "a read from a node resetting every answer"
    );
    failpoints.set("transfer.answer=1*return");
    assert!(
        reader.get("remote-1").expect("one reset is retried") == value(1, 64 << 10),
        "remote-1 after one reset"
    );
    failpoints.clear();
    assert_all_back(&reader, "remote-", 8);
}

/// `master.answer.<call>`: the master carries out a put or a remove and the answer is
/// lost (`RPC_FAIL`, -900, reaches the caller); the put's object then reads back whole
/// or not at all, the remove's object is gone, and the other objects are untouched.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_lost_master_answer_fails_the_call_after_the_change_and_loses_nothing() {
    let failpoints = FailpointFile::new();
    let master = MasterProcess::start_with_env(&[], &[failpoints.env()]);
    let node = RealClientProcess::join(&master, "64MB", &[]);
    let client = dummy(&node);
    put_all(&client, "kept-", 8, &node.segment_name());

    failpoints.set("master.answer.PutEnd=return;master.answer.PutCommit=return");
    let put = client.put("doubt", &value(99, 64 << 10), &ReplicateConfig::default());
    assert_eq!(put, Err(ErrorCode::RPC_FAIL), "a put whose answer was lost");
    failpoints.set("master.answer.Remove=return");
    assert_eq!(
        client.remove("kept-7", true),
        Err(ErrorCode::RPC_FAIL),
        "a remove whose answer was lost"
    );
    failpoints.clear();
    match client.get("doubt") {
        Ok(bytes) => assert!(bytes == value(99, 64 << 10), "doubt reads back torn"),
        Err(code) => assert_eq!(code, ErrorCode::OBJECT_NOT_FOUND),
    }
    assert_eq!(
        client.get("kept-7").map(|_| ()),
        Err(ErrorCode::OBJECT_NOT_FOUND),
        "the remove was carried out"
    );
    assert_all_back(&client, "kept-", 7);
    assert_eq!(
        client.upsert("doubt", &value(98, 64 << 10), &ReplicateConfig::default()),
        Ok(())
    );
}

/// `ha.etcd.renew`: a leader that cannot renew its etcd lease stops leading; the
/// standby takes over, every acknowledged object reads back, writes go on.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_leader_losing_its_etcd_lease_hands_over_and_loses_nothing() {
    let etcd = EtcdServer::start();
    let cluster = format!("fp-{}-{}", std::process::id(), unique_port());
    let files = [FailpointFile::new(), FailpointFile::new()];
    let masters: Vec<MasterProcess> = files
        .iter()
        .map(|file| {
            MasterProcess::start_ha_with_env(&etcd.endpoint(), &cluster, &[], &[file.env()])
        })
        .collect();
    let leader = || (0..2).find(|&i| masters[i].is_leader());
    assert!(eventually(Duration::from_secs(15), || leader().is_some()));
    let first = leader().expect("a leader");
    let node = RealClientProcess::start(
        "64MB",
        &[
            &format!("--master_server_address=etcd://{}", etcd.endpoint()),
            &format!("--cluster_id={cluster}"),
        ],
    );
    let mut client = None;
    eventually(Duration::from_secs(20), || {
        client = DummyClient::setup_dummy(16 << 20, 4 << 20, Some(&node.address())).ok();
        client.is_some()
    });
    let client = client.expect("a dummy attaches");
    assert!(eventually(Duration::from_secs(20), || {
        client
            .put("probe", b"x", &ReplicateConfig::default())
            .is_ok()
    }));
    put_all(&client, "ha-", 8, &node.segment_name());

    files[first].set("ha.etcd.renew=return");
    let other = 1 - first;
    assert!(
        eventually(Duration::from_secs(20), || masters[other].is_leader()
            && !masters[first].is_leader()),
        "the standby did not take over from a leader that lost its lease"
    );
    assert!(
        eventually(Duration::from_secs(20), || client
            .put("after", b"y", &ReplicateConfig::default())
            .is_ok()),
        "writes did not resume under the new leader"
    );
    assert_all_back(&client, "ha-", 8);
}

/// `client.register`: a dummy whose shared memory cannot be mapped fails to attach with
/// the reason; the next attempt attaches, and the objects of the others are untouched.
#[test]
#[cfg_attr(not(feature = "failpoints"), ignore = "needs --features failpoints")]
fn a_failed_memory_registration_fails_the_attach_and_loses_nothing() {
    let failpoints = FailpointFile::new();
    let node = RealClientProcess::start_with_env("64MB", &[], &[failpoints.env()]);
    let first = dummy(&node);
    put_all(&first, "mem-", 8, &node.segment_name());

    failpoints.set("client.register=1*return");
    let Err(refused) = DummyClient::setup_dummy(16 << 20, 4 << 20, Some(&node.address())) else {
        panic!("the attach succeeded while the registration fails");
    };
    assert!(
        refused.to_string().contains("cannot map"),
        "the reason reaches the caller: {refused}"
    );
    let second = dummy(&node);
    assert_all_back(&second, "mem-", 8);
    assert_all_back(&first, "mem-", 8);
}
