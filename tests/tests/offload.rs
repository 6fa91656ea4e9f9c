//! SSD tier tests: a real `mooncake_master --enable_offload`, real clients with
//! `--enable_offload` writing to temporary directories, dummies reading through them.

use std::time::Duration;

use mooncake_dummy_client::{DummyClient, ErrorCode, ReplicateConfig};
use mooncake_integration_tests::offload::{
    TempDir, assert_batch_reads_from_disk, assert_gone, assert_reads_into_pool,
    assert_reads_through, batch_get_into_pool, comes_back, dummy, on_disk, only_on_disk,
    put_and_offload, put_past_memory, value,
};
use mooncake_integration_tests::{
    MasterProcess, RealClientProcess, eventually, free_tcp_port, http_get, sample,
};

/// A node with the SSD tier in `dir` (one offload round per second, 1 GiB of disk at
/// most) on `backend`, through io_uring when `uring`. Otherwise the node inherits
/// `MOONCAKE_OFFLOAD_USE_URING` from the test's environment: `.ci/run` runs this suite
/// a second time with it set, so every test also runs through io_uring.
fn disk_node_with(
    master: &MasterProcess,
    segment: &str,
    dir: &TempDir,
    backend: &str,
    uring: bool,
) -> RealClientProcess {
    RealClientProcess::join_with_env(
        master,
        segment,
        &["--enable_offload=true"],
        &[
            ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", dir.path()),
            ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
            ("MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR", backend),
            ("MOONCAKE_OFFLOAD_TOTAL_SIZE_LIMIT_BYTES", "1GiB"),
        ]
        .into_iter()
        .chain(uring.then_some(("MOONCAKE_OFFLOAD_USE_URING", "1")))
        .collect::<Vec<_>>(),
    )
}

const BUCKETS: &str = "bucket_storage_backend";
const FILE_PER_KEY: &str = "file_per_key_storage_backend";
const ONE_FILE: &str = "offset_allocator_storage_backend";

#[test]
fn evicted_objects_are_read_from_disk_through_any_node_and_survive_restarts() {
    evicted_objects_survive(BUCKETS, false);
}

#[test]
fn the_file_per_key_backend_keeps_evicted_objects_across_restarts() {
    evicted_objects_survive(FILE_PER_KEY, false);
}

#[test]
fn the_offset_allocator_backend_keeps_evicted_objects_across_restarts_with_io_uring() {
    evicted_objects_survive(ONE_FILE, true);
}

/// With a segment smaller than the data: evicted objects are read byte-exact from
/// disk through the owner (one by one and in batches) and another node (also
/// zero-copy), after kill -9 of the
/// node and after a restart of the master; removed objects do not come back.
fn evicted_objects_survive(backend: &str, uring: bool) {
    let dir = TempDir::new("evict");
    let mut master = MasterProcess::start(&["--enable_offload=true"]);
    let mut a = disk_node_with(&master, "16MB", &dir, backend, uring);
    let via_a = dummy(&a);
    put_past_memory(&via_a, &a);
    let evicted: Vec<usize> = (0..8)
        .filter(|i| only_on_disk(&via_a, &format!("first-{i}")))
        .collect();
    assert!(!evicted.is_empty(), "nothing was evicted from memory");
    assert_batch_reads_from_disk(&via_a, &evicted);
    // A second node (joining now: while A filled up, new objects had to stay on A).
    let b = RealClientProcess::join(&master, "64MB", &[]);
    let via_b = dummy(&b);
    for i in 0..8 {
        let key = format!("first-{i}");
        assert_reads_through(&[(&via_a, "A"), (&via_b, "B")], &key, i);
        assert_reads_into_pool(&via_b, &key, i);
    }

    // kill -9 of the node: after its restart everything on its disk is readable again.
    drop(via_a);
    a.restart();
    let via_a = dummy(&a);
    let back = eventually(Duration::from_secs(10), || {
        via_a.get("first-0").is_ok_and(|v| v == value(0, 1 << 20))
    });
    assert!(
        back,
        "objects on disk did not come back after a restart of the node"
    );
    for i in 0..4 {
        assert!(via_b.get(&format!("more0-{i}")).expect("more") == value(i, 1 << 20));
    }

    // A master restart loses memory, not the disk: the node registers its disk again.
    master.restart();
    let back = eventually(Duration::from_secs(15), || {
        via_b.get("first-3").is_ok_and(|v| v == value(3, 1 << 20))
    });
    assert!(
        back,
        "objects on disk did not come back after a restart of the master"
    );
    // Removal deletes disk copies too, for good: they do not come back with the node.
    assert_eq!(via_b.remove("first-3", true), Ok(()));
    assert_eq!(
        via_b.get("first-3").map(|_| ()),
        Err(ErrorCode::OBJECT_NOT_FOUND)
    );
    // Let the node's next round delete the file, then kill -9 and restart it.
    std::thread::sleep(Duration::from_millis(2500));
    drop(via_a);
    a.restart();
    let via_a = dummy(&a);
    assert!(
        comes_back(&via_a, "first-2", 2),
        "{backend}: the node's disk did not come back"
    );
    assert_gone(
        &via_a,
        "first-3",
        "a removed object came back after a restart",
    );
}

#[test]
fn objects_reach_the_disk_straight_from_the_segment_without_a_copy() {
    let dir = TempDir::new("one-copy");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let http_port = free_tcp_port();
    let node = RealClientProcess::join_with_env(
        &master,
        "64MB",
        &[
            "--enable_offload=true",
            "--enable_http_server=true",
            &format!("--http_port={http_port}"),
        ],
        &[
            ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", dir.path()),
            ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
            ("MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT", "3"),
        ],
    );
    let client = dummy(&node);
    put_and_offload(&client, &node, "copied-", 8);
    let text = http_get(http_port, "/metrics");
    let objects = sample(&text, "mooncake_client_offload_objects_total");
    let copies = sample(&text, "mooncake_client_offload_copies_total");
    assert!(objects >= 8.0, "{text}");
    assert_eq!(
        copies, 0.0,
        "no object copied into a buffer on its way to the disk"
    );
    for i in 0..8 {
        let key = format!("copied-{i}");
        assert_eq!(client.get(&key).expect("get"), value(i, 1 << 20));
    }
}

#[test]
fn a_damaged_bucket_loses_only_its_damaged_objects() {
    let dir = TempDir::new("damage");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    // Through io_uring (where the kernel allows it; else the logged POSIX fallback).
    let mut node = disk_node_with(&master, "64MB", &dir, BUCKETS, true);
    let client = dummy(&node);
    put_and_offload(&client, &node, "k", 4);
    drop(client);
    node.kill9();
    // Flip one byte in the value of some object of every bucket file.
    for entry in std::fs::read_dir(dir.path()).expect("list") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "bucket") {
            let mut bytes = std::fs::read(&path).expect("read");
            let at = bytes.len() - 100;
            bytes[at] ^= 0xFF;
            std::fs::write(&path, bytes).expect("write");
        }
    }
    node.restart();
    let client = dummy(&node);
    let mut damaged = 0;
    for i in 0..4 {
        match client.get(&format!("k{i}")) {
            Ok(bytes) => assert!(bytes == value(i, 1 << 20), "k{i}: wrong bytes"),
            Err(code) => {
                assert_eq!(code, ErrorCode::OBJECT_NOT_FOUND, "k{i}");
                damaged += 1;
            }
        }
    }
    assert!(damaged >= 1, "the damaged object was served");
    assert!(damaged < 4, "intact objects were lost");
}

/// A batched get of objects whose records on disk are damaged (found at read time),
/// together with an object in memory: the damaged ones fail, the one in memory is
/// read; none answers success with bytes that were never read.
#[test]
fn a_batch_of_damaged_disk_objects_and_one_in_memory_fails_only_the_damaged() {
    let dir = TempDir::new("batch-damage");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let node = disk_node_with(&master, "16MB", &dir, BUCKETS, false);
    let client = dummy(&node);
    put_past_memory(&client, &node);
    let evicted: Vec<String> = (0..8)
        .map(|i| format!("first-{i}"))
        .filter(|key| only_on_disk(&client, key))
        .collect();
    assert!(evicted.len() >= 2, "fewer than two objects left memory");
    let (in_memory, i) = (0..4)
        .map(|i| (format!("more5-{i}"), i))
        .find(|(key, _)| !only_on_disk(&client, key))
        .expect("an object of the last wave in memory");
    // One byte in every 64 KiB of every bucket file flipped, in place, while the node
    // runs: every record on disk fails its check when read.
    for entry in std::fs::read_dir(dir.path()).expect("list") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "bucket") {
            let mut bytes = std::fs::read(&path).expect("read");
            for at in (100..bytes.len()).step_by(64 << 10) {
                bytes[at] ^= 0xFF;
            }
            std::fs::write(&path, bytes).expect("write");
        }
    }
    let mut keys = evicted.clone();
    keys.push(in_memory.clone());
    let read = batch_get_into_pool(&client, &keys);
    for (key, (result, _)) in evicted.iter().zip(&read) {
        assert_eq!(
            *result,
            Err(ErrorCode::OBJECT_NOT_FOUND),
            "{key}: damaged on disk"
        );
    }
    let (result, got) = read.last().expect("one per key");
    assert_eq!(*result, Ok(1 << 20), "{in_memory}");
    assert!(*got == value(i, 1 << 20), "{in_memory}: wrong bytes");
}

fn dir_bytes(dir: &TempDir) -> u64 {
    std::fs::read_dir(dir.path())
        .expect("list")
        .filter_map(|e| e.ok()?.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[test]
fn the_disk_quota_holds_and_fifo_evicts_the_oldest_bucket_first() {
    let dir = TempDir::new("quota");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let quota = SMALL_DISK;
    let node = small_disk_node(&master, &dir, "64MB", "fifo");
    let client = dummy(&node);
    for wave in 0..6 {
        put_and_offload(&client, &node, &format!("w{wave}-"), 2);
        assert!(
            dir_bytes(&dir) <= quota,
            "{} bytes on disk",
            dir_bytes(&dir)
        );
    }
    // Two 1 MiB objects per bucket, room for two buckets: the oldest waves left the disk
    // (still readable from memory), the newest are there.
    assert!(!on_disk(&client, "w0-0") && !on_disk(&client, "w0-1"));
    assert!(!on_disk(&client, "w3-0"));
    assert!(on_disk(&client, "w4-0") && on_disk(&client, "w5-1"));
    assert!(client.get("w0-0").expect("in memory") == value(0, 1 << 20));
}

/// A disk quota of two buckets of two 1 MiB objects.
const SMALL_DISK: u64 = 5 * (1 << 20) + (1 << 19);

/// A node whose disk holds two buckets of two 1 MiB objects, evicting by `policy`.
fn small_disk_node(
    master: &MasterProcess,
    dir: &TempDir,
    segment: &str,
    policy: &str,
) -> RealClientProcess {
    let quota = SMALL_DISK;
    RealClientProcess::join_with_env(
        master,
        segment,
        &["--enable_offload=true"],
        &[
            ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", dir.path()),
            ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
            ("MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT", "2"),
            ("MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE", &quota.to_string()),
            ("MOONCAKE_OFFLOAD_BUCKET_EVICTION_POLICY", policy),
        ],
    )
}

#[test]
fn lru_evicts_the_bucket_read_least_recently() {
    let dir = TempDir::new("lru");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let mut node = small_disk_node(&master, &dir, "64MB", "lru");
    let client = dummy(&node);
    put_and_offload(&client, &node, "w0-", 2);
    put_and_offload(&client, &node, "w1-", 2);
    // After a kill -9 the objects are on disk only; reading w0 makes w1 the bucket
    // read least recently (fifo would evict w0, the oldest).
    drop(client);
    node.restart();
    let client = dummy(&node);
    assert!(
        comes_back(&client, "w0-0", 0),
        "w0 did not come back from disk"
    );
    assert!(client.get("w0-1").expect("w0-1") == value(1, 1 << 20));
    put_and_offload(&client, &node, "w2-", 2);
    assert!(
        on_disk(&client, "w0-0") && on_disk(&client, "w0-1"),
        "lru evicted the bucket just read"
    );
    assert!(
        !on_disk(&client, "w1-0") && !on_disk(&client, "w1-1"),
        "lru kept the bucket not read"
    );
    assert_gone(
        &client,
        "w1-0",
        "evicted from disk and gone from memory after the restart",
    );
}

#[test]
fn reads_racing_disk_evictions_get_the_right_bytes_or_not_found() {
    let dir = TempDir::new("race");
    // Short read leases: objects read all the time must still be able to leave memory.
    let master = MasterProcess::start(&["--enable_offload=true", "--default_kv_lease_ttl=100ms"]);
    // A small segment: objects leave memory soon and are read from disk.
    let node = small_disk_node(&master, &dir, "8MB", "fifo");
    // The peer reads through the transfer engine; its segment is too small for any
    // object, so every object lives on the disk node.
    let peer = RealClientProcess::join(&master, "1MB", &[]);
    let writer = dummy(&node);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let written = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let readers: Vec<_> = [node.address(), peer.address()]
        .into_iter()
        .map(|address| {
            let (stop, written) = (stop.clone(), written.clone());
            std::thread::spawn(move || {
                let client = DummyClient::setup_dummy(64 << 20, 8 << 20, Some(&address))
                    .expect("setup_dummy");
                let (mut good, mut gone) = (0, 0);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // The older objects: out of memory by now, read from disk (reading
                    // the newest ones would hold them in memory under read leases).
                    let upto = written.load(std::sync::atomic::Ordering::Relaxed);
                    for i in 0..upto.saturating_sub(6) {
                        match client.get(&format!("r{i}")) {
                            Ok(bytes) => {
                                assert!(bytes == value(i, 1 << 20), "r{i}: wrong bytes");
                                good += 1;
                            }
                            // Gone, or (on a loaded machine) a copy that outlasted
                            // the 100 ms lease: an error, never other bytes.
                            Err(ErrorCode::LEASE_EXPIRED) => {}
                            Err(code) => {
                                assert_eq!(code, ErrorCode::OBJECT_NOT_FOUND, "r{i}");
                                gone += 1;
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                (good, gone)
            })
        })
        .collect();
    let config = ReplicateConfig {
        preferred_segment: node.segment_name(),
        ..ReplicateConfig::default()
    };
    for i in 0..40 {
        let stored = eventually(Duration::from_secs(10), || {
            writer
                .put(&format!("r{i}"), &value(i, 1 << 20), &config)
                .is_ok()
        });
        assert!(stored, "r{i} could not be stored");
        written.store(i + 1, std::sync::atomic::Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for reader in readers {
        let (good, gone) = reader.join().expect("a reader saw wrong bytes");
        assert!(
            good > 0 && gone > 0,
            "no race was exercised ({good} good, {gone} gone)"
        );
    }
}

#[test]
fn above_the_high_watermark_the_disk_is_evicted_down_to_the_low_one() {
    let dir = TempDir::new("watermark");
    let master = MasterProcess::start(&["--enable_offload=true"]);
    let quota = 10u64 << 20;
    let node = RealClientProcess::join_with_env(
        &master,
        "64MB",
        &["--enable_offload=true"],
        &[
            ("MOONCAKE_OFFLOAD_FILE_STORAGE_PATH", dir.path()),
            ("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1"),
            ("MOONCAKE_OFFLOAD_BUCKET_KEYS_LIMIT", "1"),
            ("MOONCAKE_OFFLOAD_BUCKET_MAX_TOTAL_SIZE", &quota.to_string()),
            ("MOONCAKE_OFFLOAD_DISK_EVICTION_HIGH_WATERMARK_RATIO", "0.6"),
            ("MOONCAKE_OFFLOAD_DISK_EVICTION_LOW_WATERMARK_RATIO", "0.25"),
        ],
    );
    let client = dummy(&node);
    // Six 1 MiB objects (and their metadata): under the quota, above its high
    // watermark (6 MiB), which five of them stay under.
    put_and_offload(&client, &node, "m", 6);
    let evicted = eventually(Duration::from_secs(5), || dir_bytes(&dir) <= quota / 4);
    assert!(evicted, "{} bytes still on disk", dir_bytes(&dir));
    assert!(
        !on_disk(&client, "m0") && !on_disk(&client, "m3"),
        "oldest first"
    );
    assert!(on_disk(&client, "m5"), "the newest stays");
    assert!(client.get("m0").expect("still in memory") == value(0, 1 << 20));
}

#[test]
fn with_offload_on_evict_only_objects_leaving_memory_are_written() {
    let dir = TempDir::new("on-evict");
    let master = MasterProcess::start(&["--enable_offload=true", "--offload_on_evict=true"]);
    let node = disk_node_with(&master, "8MB", &dir, BUCKETS, false);
    let client = dummy(&node);
    let config = ReplicateConfig {
        preferred_segment: node.segment_name(),
        ..ReplicateConfig::default()
    };
    let put = |i: usize| {
        let stored = eventually(Duration::from_secs(10), || {
            client
                .put(&format!("e{i}"), &value(i, 1 << 20), &config)
                .is_ok()
        });
        assert!(stored, "e{i} could not be stored");
    };
    for i in 0..3 {
        put(i);
    }
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        (0..3).all(|i| !on_disk(&client, &format!("e{i}"))),
        "objects were written before memory ran out"
    );
    // Three times the segment: the first objects leave memory through the disk.
    for i in 3..24 {
        put(i);
    }
    assert!(only_on_disk(&client, "e0"), "e0 did not move to disk");
    assert!(
        !on_disk(&client, "e23"),
        "the newest object was written early"
    );
    for i in [0, 1, 2] {
        assert!(client.get(&format!("e{i}")).expect("from disk") == value(i, 1 << 20));
    }
}
