//! Crash restart: `mooncake_client --segment_path=<file>` killed with `kill -9` while
//! dummies write, then started again, serves the objects committed before the kill:
//! each reads back byte-exact or is reported missing, never torn; nothing removed
//! comes back.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ErrorCode, ReplicateConfig};
use mooncake_integration_tests::RealClientProcess;

const WRITERS: usize = 4;

/// A segment file on tmpfs when the machine has one, else in the temporary directory;
/// removed on drop.
struct SegmentPath(PathBuf);

impl SegmentPath {
    fn new(name: &str) -> Self {
        let dir = PathBuf::from("/dev/shm");
        let dir = if dir.is_dir() {
            dir
        } else {
            std::env::temp_dir()
        };
        let path = dir.join(format!(
            "mooncake-test-{}-{name}.segment",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        SegmentPath(path)
    }

    fn flag(&self) -> String {
        format!("--segment_path={}", self.0.display())
    }
}

impl Drop for SegmentPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn dummy(node: &RealClientProcess) -> DummyClient {
    DummyClient::setup_dummy(32 << 20, 8 << 20, Some(&node.address())).expect("setup_dummy")
}

/// Most objects one writer puts: what the writers leave stays far below the segment's
/// eviction watermark however fast the machine (eviction would remove acknowledged
/// objects, as it may).
const MAX_PUTS: usize = 1000;

/// The bytes of object `index` of writer `owner`: sizes from 1 KiB to 129 KiB, each
/// object's bytes its own.
fn value(owner: usize, index: usize) -> Vec<u8> {
    let len = 1024 + (index * 7919 + owner * 104_729) % (128 << 10);
    let mut state = (owner as u64) << 32 | index as u64 | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state.to_le_bytes()[5]
        })
        .collect()
}

/// What one writer was told: puts and removes acknowledged.
#[derive(Debug, Default)]
struct Acknowledged {
    /// Key → the object index its bytes came from.
    puts: HashMap<String, usize>,
    removed: Vec<String>,
}

/// Puts objects (and removes every fifth soon after) until the node dies or `stop`.
fn write_until_killed(client: &DummyClient, owner: usize, stop: &AtomicBool) -> Acknowledged {
    let mut acknowledged = Acknowledged::default();
    let config = ReplicateConfig::default();
    for index in 0..MAX_PUTS {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let key = format!("crash-{owner}-{index}");
        if client.put(&key, &value(owner, index), &config).is_err() {
            // The node is gone (this put may or may not have been committed).
            break;
        }
        acknowledged.puts.insert(key, index);
        if index % 5 == 4 {
            let victim = format!("crash-{owner}-{}", index - 2);
            if client.remove(&victim, false).is_err() {
                break;
            }
            acknowledged.puts.remove(&victim);
            acknowledged.removed.push(victim);
        }
    }
    acknowledged
}

/// Writers busy on `node`; after `for_how_long`, the node is killed with `kill -9`
/// mid-write. Answers what the writers were told.
fn kill_during_writes(node: &mut RealClientProcess, for_how_long: Duration) -> Vec<Acknowledged> {
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|owner| {
            let client = dummy(node);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || write_until_killed(&client, owner, &stop))
        })
        .collect();
    std::thread::sleep(for_how_long);
    node.kill9();
    stop.store(true, Ordering::Release);
    writers
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect()
}

/// How the acknowledged objects read after the restart.
#[derive(Debug, Default)]
struct ReadBack {
    whole: usize,
    missing: usize,
}

/// Reads every acknowledged object: byte-exact or reported missing, never other bytes;
/// and no removed key readable.
fn read_back(client: &DummyClient, acknowledged: &[Acknowledged]) -> ReadBack {
    let mut read = ReadBack::default();
    for (owner, told) in acknowledged.iter().enumerate() {
        for (key, index) in &told.puts {
            match client.get(key) {
                Ok(bytes) => {
                    assert!(
                        bytes == value(owner, *index),
                        "{key} came back with other bytes (torn)"
                    );
                    read.whole += 1;
                }
                Err(ErrorCode::OBJECT_NOT_FOUND) => read.missing += 1,
                Err(code) => panic!("{key}: {code:?}, neither whole nor reported missing"),
            }
        }
        for key in &told.removed {
            assert_eq!(
                client.get(key).err(),
                Some(ErrorCode::OBJECT_NOT_FOUND),
                "{key} was removed (acknowledged) but reads again after the restart"
            );
        }
    }
    read
}

/// Starts the node again on the same file and answers how long until it serves.
fn restart(node: &mut RealClientProcess) -> Duration {
    let started = Instant::now();
    node.restart();
    started.elapsed()
}

#[test]
fn every_object_acknowledged_before_kill_9_is_served_again_after_a_restart() {
    let file = SegmentPath::new("clean");
    let mut node = RealClientProcess::start("512MB", &[&file.flag()]);
    let acknowledged = kill_during_writes(&mut node, Duration::from_millis(1500));
    let puts: usize = acknowledged.iter().map(|a| a.puts.len()).sum();
    let removed: usize = acknowledged.iter().map(|a| a.removed.len()).sum();
    assert!(puts > 20, "the writers barely wrote ({puts} puts)");

    let to_serve = restart(&mut node);
    let client = dummy(&node);
    let read = read_back(&client, &acknowledged);
    eprintln!(
        "crash restart: {puts} acknowledged objects ({removed} removed), {} whole, {} missing; serving again {to_serve:?} after the restart began",
        read.whole, read.missing
    );
    assert_eq!(
        read.missing, 0,
        "every acknowledged put was journaled before its answer"
    );
    let status = client.status().expect("status");
    let taken = status.taken_over.expect("the restart shows in the status");
    assert_eq!(taken.from_pid, 0, "a restart, not a handover");
    assert!(
        taken.objects >= puts as u64,
        "{} objects recovered, {puts} acknowledged",
        taken.objects
    );

    // The restarted node keeps journaling: a second crash loses nothing either.
    let mut acknowledged = acknowledged;
    client
        .put("after-restart", &value(9, 9), &ReplicateConfig::default())
        .expect("put");
    let victim = acknowledged[0].puts.keys().next().expect("a put").clone();
    // Read just now: its read lease needs `force`.
    client.remove(&victim, true).expect("remove");
    acknowledged[0].puts.remove(&victim);
    acknowledged[0].removed.push(victim);
    drop(client);
    restart(&mut node);
    let client = dummy(&node);
    assert_eq!(client.get("after-restart").expect("kept"), value(9, 9));
    let read = read_back(&client, &acknowledged);
    assert_eq!(read.missing, 0);
}

#[test]
fn bytes_changed_after_the_crash_are_reported_missing_never_served() {
    let file = SegmentPath::new("scribbled");
    let mut node = RealClientProcess::start("256MB", &[&file.flag()]);
    let acknowledged = kill_during_writes(&mut node, Duration::from_millis(800));
    // Something scribbles over the first 4 MiB of the segment while no process runs.
    let mut bytes = std::fs::read(&file.0).expect("read the segment file");
    for byte in &mut bytes[..4 << 20] {
        *byte = byte.wrapping_add(1);
    }
    std::fs::write(&file.0, &bytes).expect("scribble");
    drop(bytes);

    restart(&mut node);
    let client = dummy(&node);
    let read = read_back(&client, &acknowledged);
    assert!(
        read.missing > 0,
        "objects in the scribbled bytes must be dropped"
    );
    assert!(read.whole > 0, "objects elsewhere are served again");
}

#[test]
fn a_second_process_on_the_same_segment_file_is_refused() {
    let file = SegmentPath::new("twice");
    let _node = RealClientProcess::start("64MB", &[&file.flag()]);
    let output = std::process::Command::new(mooncake_integration_tests::binary("mooncake_client"))
        .args([
            &format!("--port={}", mooncake_integration_tests::unique_port()),
            "--global_segment_size=64MB",
            "--embedded_master_port=0",
            "--host=127.0.0.1",
            &file.flag(),
        ])
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("in use by another process"), "{stderr}");
}

#[test]
fn a_handed_over_node_keeps_journaling_into_the_same_file() {
    let file = SegmentPath::new("handover");
    let mut node = RealClientProcess::start("128MB", &[&file.flag()]);
    let client = dummy(&node);
    let config = ReplicateConfig::default();
    client.put("before", &value(1, 1), &config).expect("put");
    drop(client);
    node.take_over(Duration::from_secs(30));
    let client = dummy(&node);
    client.put("after", &value(2, 2), &config).expect("put");
    client.remove("before", false).expect("remove");
    drop(client);
    restart(&mut node);
    let client = dummy(&node);
    assert_eq!(client.get("after").expect("kept"), value(2, 2));
    assert_eq!(
        client.get("before").err(),
        Some(ErrorCode::OBJECT_NOT_FOUND)
    );
}

/// Puts `count` objects through `client`, each placed on the segment `on`.
fn put_on(client: &DummyClient, on: &str, prefix: &str, count: usize) {
    let config = ReplicateConfig {
        preferred_segment: on.to_string(),
        ..ReplicateConfig::default()
    };
    for index in 0..count {
        client
            .put(&format!("{prefix}-{index}"), &value(7, index), &config)
            .expect("put");
    }
}

fn assert_reads(client: &DummyClient, prefix: &str, count: usize) {
    for index in 0..count {
        let key = format!("{prefix}-{index}");
        let got = client
            .get(&key)
            .unwrap_or_else(|code| panic!("{key}: {code:?}"));
        assert!(got == value(7, index), "{key}: other bytes");
    }
}

/// Waits until `key` reads through `peer`: the restarted node mounted again (its dummy
/// socket accepts before that).
fn back_at_the_master(peer: &DummyClient, key: &str) {
    assert!(
        mooncake_integration_tests::eventually(Duration::from_secs(10), || peer.get(key).is_ok()),
        "{key} never read again after the restart"
    );
}

#[test]
fn a_cluster_node_restarted_on_its_segment_file_gets_its_objects_back_from_the_master() {
    let master =
        mooncake_integration_tests::MasterProcess::start(&["--client_ttl=1", "--remount_grace=60"]);
    let file = SegmentPath::new("cluster");
    let mut kept = RealClientProcess::join(&master, "128MB", &[&file.flag()]);
    let reader = RealClientProcess::join(&master, "64MB", &[]);
    let writer = dummy(&kept);
    put_on(&writer, &kept.segment_name(), "at-once", 20);
    drop(writer);

    // Restarted at once, before the master noticed the crash.
    restart(&mut kept);
    let peer = dummy(&reader);
    back_at_the_master(&peer, "at-once-0");
    assert_reads(&peer, "at-once", 20);

    // Restarted after the master declared it dead (--client_ttl), within the grace.
    let writer = dummy(&kept);
    put_on(&writer, &kept.segment_name(), "later", 20);
    drop(writer);
    kept.kill9();
    std::thread::sleep(Duration::from_millis(2500));
    assert!(
        peer.put("while-away", &value(8, 8), &ReplicateConfig::default())
            .is_ok(),
        "writes go to the other node meanwhile"
    );
    restart(&mut kept);
    back_at_the_master(&peer, "later-0");
    assert_reads(&peer, "at-once", 20);
    assert_reads(&peer, "later", 20);
    let local = dummy(&kept);
    assert_reads(&local, "later", 20);
}

#[test]
fn a_cluster_node_past_its_grace_comes_back_empty() {
    let master =
        mooncake_integration_tests::MasterProcess::start(&["--client_ttl=1", "--remount_grace=1"]);
    let file = SegmentPath::new("grace-over");
    let mut kept = RealClientProcess::join(&master, "64MB", &[&file.flag()]);
    let writer = dummy(&kept);
    put_on(&writer, &kept.segment_name(), "gone", 5);
    drop(writer);
    kept.kill9();
    std::thread::sleep(Duration::from_millis(3500));
    restart(&mut kept);
    let client = dummy(&kept);
    assert_eq!(
        client.get("gone-0").err(),
        Some(ErrorCode::OBJECT_NOT_FOUND)
    );
}
