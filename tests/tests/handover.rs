//! Planned handover: `mooncake_client --takeover` takes a running node over while its
//! dummies keep working; nothing acknowledged is lost and no call fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicateConfig};
use mooncake_integration_tests::{MasterProcess, RealClientProcess, eventually};

const DUMMIES: usize = 8;

fn dummy(node: &RealClientProcess) -> DummyClient {
    DummyClient::setup_dummy(64 << 20, 16 << 20, Some(&node.address())).expect("setup_dummy")
}

/// The bytes of object `index` of dummy `owner` (`len` of them): a window of a fixed
/// pattern that starts elsewhere for every object, opened by the owner and index.
fn value(owner: usize, index: usize, len: usize) -> Vec<u8> {
    static PATTERN: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let pattern = PATTERN.get_or_init(|| {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        (0..(8usize << 20) + 8192)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state.to_le_bytes()[3]
            })
            .collect()
    });
    let start = (owner * 131 + index * 4099) % 8192;
    let mut bytes = pattern[start..start + len].to_vec();
    let tag = ((owner as u64) << 32 | index as u64).to_le_bytes();
    let n = tag.len().min(len);
    bytes[..n].copy_from_slice(&tag[..n]);
    bytes
}

/// What one dummy did while the node was handed over.
#[derive(Debug, Default)]
struct Worked {
    calls: u64,
    failures: Vec<String>,
    longest: Duration,
    written: Vec<(String, usize)>,
}

/// Most objects one dummy writes while the node is handed over (then it only reads):
/// a fast machine would otherwise fill the segment and have objects evicted.
const MAX_WRITES_DURING: usize = 2000;

/// Puts and reads small objects until `stop`, timing every call.
fn keep_working(client: &DummyClient, owner: usize, tag: usize, stop: &AtomicBool) -> Worked {
    let mut worked = Worked::default();
    let config = ReplicateConfig::default();
    let mut round = 0usize;
    while !stop.load(Ordering::Acquire) {
        if round >= MAX_WRITES_DURING {
            reread(client, owner, tag, round, &mut worked);
            round += 1;
            continue;
        }
        let key = format!("during-{tag}-{owner}-{round}");
        let bytes = value(owner, 10_000 + round, 4096 + round % 5000);
        let started = Instant::now();
        let put = client.put(&key, &bytes, &config);
        worked.longest = worked.longest.max(started.elapsed());
        worked.calls += 1;
        match put {
            Ok(()) => worked.written.push((key.clone(), 10_000 + round)),
            Err(code) => worked.failures.push(format!("put {key}: {code:?}")),
        }
        let started = Instant::now();
        let read = client.get(&key);
        worked.longest = worked.longest.max(started.elapsed());
        worked.calls += 1;
        match read {
            Ok(got) if got == bytes => {}
            Ok(_) => worked.failures.push(format!("get {key}: other bytes")),
            Err(code) => worked.failures.push(format!("get {key}: {code:?}")),
        }
        round += 1;
    }
    worked
}

/// Reads back one of the objects this dummy wrote during the handover (chosen by
/// `round`), timing the call.
fn reread(client: &DummyClient, owner: usize, tag: usize, round: usize, worked: &mut Worked) {
    let index = round * 7919 % MAX_WRITES_DURING;
    let key = format!("during-{tag}-{owner}-{index}");
    let started = Instant::now();
    let read = client.get(&key);
    worked.longest = worked.longest.max(started.elapsed());
    worked.calls += 1;
    match read {
        Ok(got) if got == value(owner, 10_000 + index, 4096 + index % 5000) => {}
        Ok(_) => worked.failures.push(format!("get {key}: other bytes")),
        Err(code) => worked.failures.push(format!("get {key}: {code:?}")),
    }
}

/// Fills the segment with `per_dummy` objects of `len` bytes from each dummy.
fn fill(clients: &[Arc<DummyClient>], round: usize, per_dummy: usize, len: usize) {
    std::thread::scope(|scope| {
        for (owner, client) in clients.iter().enumerate() {
            scope.spawn(move || {
                for index in 0..per_dummy {
                    client
                        .put(
                            &format!("big-{round}-{owner}-{index}"),
                            &value(owner, index, len),
                            &ReplicateConfig::default(),
                        )
                        .expect("fill");
                }
            });
        }
    });
}

/// Reads back every object and compares.
fn verify(client: &DummyClient, round: usize, per_dummy: usize, len: usize, during: &[Worked]) {
    for owner in 0..DUMMIES {
        for index in 0..per_dummy {
            let key = format!("big-{round}-{owner}-{index}");
            let got = client
                .get(&key)
                .unwrap_or_else(|code| panic!("{key} lost: {code:?}"));
            assert!(got == value(owner, index, len), "{key}: other bytes");
        }
    }
    for (owner, worked) in during.iter().enumerate() {
        for (key, index) in &worked.written {
            let got = client
                .get(key)
                .unwrap_or_else(|code| panic!("{key} lost: {code:?}"));
            let round = index - 10_000;
            assert!(
                got == value(owner, *index, 4096 + round % 5000),
                "{key}: other bytes"
            );
        }
    }
}

fn handover_under_load(node: &mut RealClientProcess, round: usize, per_dummy: usize, len: usize) {
    let clients: Vec<Arc<DummyClient>> = (0..DUMMIES).map(|_| Arc::new(dummy(node))).collect();
    fill(&clients, round, per_dummy, len);
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = clients
        .iter()
        .enumerate()
        .map(|(owner, client)| {
            let (client, stop) = (Arc::clone(client), Arc::clone(&stop));
            std::thread::spawn(move || keep_working(&client, owner, round, &stop))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let took = node.take_over(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Release);
    let during: Vec<Worked> = workers
        .into_iter()
        .map(|w| w.join().expect("worker"))
        .collect();
    let failures: Vec<&String> = during.iter().flat_map(|w| &w.failures).collect();
    let calls: u64 = during.iter().map(|w| w.calls).sum();
    let longest = during.iter().map(|w| w.longest).max().unwrap_or_default();
    println!(
        "handover of {} MiB in {} objects under {DUMMIES} dummies: took {took:?}, {calls} calls, longest call {longest:?}",
        (per_dummy * len * DUMMIES) >> 20,
        per_dummy * DUMMIES
    );
    assert!(
        failures.is_empty(),
        "calls failed during the handover: {failures:?}"
    );
    assert!(calls > DUMMIES as u64 * 4, "the dummies kept calling");
    verify(&clients[0], round, per_dummy, len, &during);
    // A dummy that attaches now meets the new process, with the same objects.
    let late = dummy(node);
    assert!(late.get(&format!("big-{round}-{}-0", DUMMIES - 1)).is_ok());
    let taken = late
        .status()
        .expect("status")
        .taken_over
        .expect("status shows the handover");
    assert_eq!(taken.segment_bytes, 3 << 30);
    assert!(taken.objects >= (per_dummy * DUMMIES) as u64, "{taken:?}");
}

#[test]
fn a_node_with_its_embedded_master_is_handed_over_without_losing_anything() {
    // 2 GiB of objects in a 3 GiB segment.
    let mut node = RealClientProcess::start("3GB", &[]);
    handover_under_load(&mut node, 0, 32, 8 << 20);
    // And handed over again, by the process that took it over.
    handover_under_load(&mut node, 1, 2, 1 << 20);
}

#[test]
fn a_cluster_node_is_handed_over_while_a_peer_reads_its_objects() {
    let master = MasterProcess::start(&[]);
    let mut a = RealClientProcess::join(&master, "512MB", &[]);
    let b = RealClientProcess::join(&master, "64MB", &[]);
    let writer = dummy(&a);
    let mounted = eventually(Duration::from_secs(10), || {
        writer.status().is_ok_and(|s| s.master.segments.len() == 2)
    });
    assert!(mounted);
    let on_a = ReplicateConfig {
        preferred_segment: a.segment_name(),
        ..ReplicateConfig::default()
    };
    let values: Vec<(String, Vec<u8>)> = (0..32)
        .map(|i| (format!("peer-read-{i}"), value(9, i, 1 << 20)))
        .collect();
    for (key, bytes) in &values {
        writer.put(key, bytes, &on_a).expect("put on a");
    }
    let reader = Arc::new(dummy(&b));
    let stop = Arc::new(AtomicBool::new(false));
    let reading = {
        let (reader, stop, values) = (Arc::clone(&reader), Arc::clone(&stop), values.clone());
        std::thread::spawn(move || {
            let mut failures = Vec::new();
            let mut reads = 0u64;
            while !stop.load(Ordering::Acquire) {
                for (key, bytes) in &values {
                    match reader.get(key) {
                        Ok(got) if &got == bytes => {}
                        Ok(_) => failures.push(format!("{key}: other bytes")),
                        Err(code) => failures.push(format!("{key}: {code:?}")),
                    }
                    reads += 1;
                }
            }
            (reads, failures)
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    a.take_over(Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Release);
    let (reads, failures) = reading.join().expect("reader");
    assert!(
        failures.is_empty(),
        "peer reads failed during the handover: {failures:?}"
    );
    assert!(reads > 32, "the peer kept reading");
    let segments = writer.status().expect("status").master.segments.len();
    assert_eq!(segments, 2, "the node's segment never left the master");
}

#[test]
fn a_takeover_with_nothing_to_take_over_says_so() {
    let node = RealClientProcess::start("16MB", &[]);
    let other_port = mooncake_integration_tests::unique_port();
    let output = std::process::Command::new(mooncake_integration_tests::binary("mooncake_client"))
        .args([
            format!("--port={other_port}"),
            "--takeover".into(),
            "--global_segment_size=16MB".into(),
        ])
        .output()
        .expect("run");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("no mooncake_client to take over"),
        "{stderr}"
    );
    drop(node);
}
