//! Chaos under high availability, bounded in time (`MOONCAKE_CHAOS_SECS`, default 90):
//! a real etcd, three masters, three nodes, helper dummies, and a mixed put/get load
//! while random processes die with kill -9: the leader master, a standby, a node other
//! than the writer's, a dummy. Killed processes come back. At the end every
//! acknowledged object whose copy survived (its node was not killed since it was
//! written) reads back byte-exact, the cluster serves, and nothing the test started is
//! left running.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicaLocation, ReplicateConfig};
use mooncake_integration_tests::etcd::EtcdServer;
use mooncake_integration_tests::{
    DummyProcess, MasterProcess, RealClientProcess, eventually, unique_port,
};

/// A small deterministic generator (the seed is printed, so a failure replays).
struct Dice(u64);

impl Dice {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap_or(0)
    }
}

fn value_of(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (0..len as u64)
        .map(|i| (seed.wrapping_add(i.wrapping_mul(0x9e37_79b9))).to_le_bytes()[3])
        .collect()
}

/// The leader, once it counts both other (running) masters in sync. A master is
/// killed only then: the promise holds while an in-sync standby survives, and a standby
/// killed a moment ago still counts as in sync until a write waits for it in vain.
fn healthy_leader(masters: &mut [MasterProcess]) -> Option<usize> {
    let mut found = None;
    eventually(Duration::from_secs(10), || {
        found = leader_of(masters).filter(|&leader| {
            let health = masters[leader].health().unwrap_or_default();
            (0..masters.len()).filter(|&i| i != leader).all(|i| {
                let line = format!(r#""address":"{}","in_sync":true"#, masters[i].address());
                masters[i].is_running() && health.contains(&line)
            })
        });
        found.is_some()
    });
    found
}

fn leader_of(masters: &[MasterProcess]) -> Option<usize> {
    let leaders: Vec<usize> = (0..masters.len())
        .filter(|i| masters[*i].is_leader())
        .collect();
    (leaders.len() == 1).then(|| leaders[0])
}

/// The segment holding `key` now, if the writer can see one.
fn segment_of(client: &DummyClient, key: &str) -> Option<String> {
    client.get_replica_desc(key).ok().and_then(|replicas| {
        replicas.iter().find_map(|r| match &r.location {
            ReplicaLocation::Memory { segment_name, .. } => Some(segment_name.clone()),
            _ => None,
        })
    })
}

#[test]
fn chaos_of_kills_loses_no_acknowledged_object_with_a_live_copy() {
    let seconds = std::env::var("MOONCAKE_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(90u64);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| {
            u64::try_from(d.as_nanos() % u128::from(u64::MAX)).unwrap_or(1)
        })
        | 1;
    eprintln!("chaos: {seconds} s, seed {seed}");
    let mut dice = Dice(seed);
    let etcd = EtcdServer::start();
    let cluster = format!("chaos-{}-{}", std::process::id(), unique_port());
    let mut masters: Vec<MasterProcess> = (0..3)
        .map(|_| MasterProcess::start_ha(&etcd.endpoint(), &cluster, &[]))
        .collect();
    assert!(eventually(Duration::from_secs(15), || leader_of(&masters).is_some()));
    let master_flag = format!("--master_server_address=etcd://{}", etcd.endpoint());
    let cluster_flag = format!("--cluster_id={cluster}");
    let mut nodes: Vec<RealClientProcess> = (0..3)
        .map(|_| RealClientProcess::start("64MB", &[&master_flag, &cluster_flag]))
        .collect();
    let writer =
        DummyClient::setup_dummy(32 << 20, 8 << 20, Some(&nodes[0].address())).expect("writer");
    let mut holders: Vec<DummyProcess> = (1..3)
        .map(|n| DummyProcess::start(&nodes[n].address(), 4 << 20))
        .collect();
    // Acknowledged objects that must survive: key -> (size, segment).
    let mut acked: HashMap<String, (usize, String)> = HashMap::new();
    let mut kills = HashMap::<&str, usize>::new();
    let started = Instant::now();
    let mut n = 0usize;
    while started.elapsed() < Duration::from_secs(seconds) {
        // Load: a few puts spread over the nodes and a few reads.
        for _ in 0..8 {
            n += 1;
            let key = format!("chaos-{n}");
            let size = [1 << 10, 16 << 10, 256 << 10][dice.below(3)];
            let node = &nodes[dice.below(nodes.len())];
            let config = ReplicateConfig {
                preferred_segment: node.segment_name(),
                ..ReplicateConfig::default()
            };
            if writer.put(&key, &value_of(&key, size), &config).is_ok()
                && let Some(segment) = segment_of(&writer, &key)
            {
                acked.insert(key, (size, segment));
            }
        }
        let keys: Vec<&String> = acked.keys().collect();
        for _ in 0..4 {
            if keys.is_empty() {
                break;
            }
            let key = keys[dice.below(keys.len())];
            if let Ok(bytes) = writer.get(key) {
                assert!(
                    bytes == value_of(key, acked[key].0),
                    "{key} read wrong bytes"
                );
            }
        }
        // Chaos: one action in three rounds.
        let action = dice.below(12);
        if std::env::var("MOONCAKE_CHAOS_TRACE").is_ok() && action < 4 {
            let objects = leader_of(&masters).and_then(|l| {
                mooncake_integration_tests::try_http_get(masters[l].metrics_port, "/metrics")
            });
            let count = objects
                .as_deref()
                .and_then(|m| {
                    m.lines()
                        .find(|l| l.starts_with("mooncake_master_objects "))
                })
                .unwrap_or("?")
                .to_string();
            eprintln!(
                "chaos: action {action}, acked {}, leader says {count}",
                acked.len()
            );
        }
        match action {
            0 => {
                if let Some(leader) = healthy_leader(&mut masters) {
                    masters[leader].kill9();
                    *kills.entry("leader").or_default() += 1;
                    std::thread::sleep(Duration::from_millis(200));
                    masters[leader].restart();
                }
            }
            1 => {
                if let Some(leader) = healthy_leader(&mut masters) {
                    let standby = (leader + 1 + dice.below(2)) % 3;
                    masters[standby].kill9();
                    *kills.entry("standby").or_default() += 1;
                    masters[standby].restart();
                }
            }
            2 => {
                let node = 1 + dice.below(2);
                let segment = nodes[node].segment_name();
                nodes[node].kill9();
                *kills.entry("node").or_default() += 1;
                acked.retain(|_, (_, on)| *on != segment);
                nodes[node].restart();
            }
            3 => {
                let holder = dice.below(holders.len());
                holders[holder].kill9();
                *kills.entry("dummy").or_default() += 1;
                // The node may be restarting (it serves once its segment is mounted).
                let node = 1 + dice.below(2);
                let mut attached = None;
                eventually(Duration::from_secs(20), || {
                    attached = DummyProcess::try_start(&nodes[node].address(), 4 << 20);
                    attached.is_some()
                });
                holders[holder] = attached.expect("a dummy attaches to a restarted node");
            }
            _ => {}
        }
    }
    eprintln!(
        "chaos: {n} puts, {} acknowledged alive, kills {kills:?}",
        acked.len()
    );
    // The cluster serves: a leader, and a put goes through.
    assert!(eventually(Duration::from_secs(20), || leader_of(&masters).is_some()));
    assert!(
        eventually(Duration::from_secs(20), || writer
            .put("after-chaos", b"served", &ReplicateConfig::default())
            .is_ok()),
        "the cluster does not serve after the chaos"
    );
    let mut wrong = Vec::new();
    for (key, (size, segment)) in &acked {
        match writer.get(key) {
            Ok(bytes) if bytes == value_of(key, *size) => {}
            other => wrong.push(format!("{key} on {segment}: {:?}", other.map(|b| b.len()))),
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} acknowledged objects with a live copy are not readable: {:?}",
        wrong.len(),
        acked.len(),
        &wrong[..wrong.len().min(10)]
    );
    drop(writer);
    let pids: Vec<u32> = holders
        .iter()
        .map(DummyProcess::pid)
        .chain(nodes.iter().map(RealClientProcess::pid))
        .chain(masters.iter().filter_map(MasterProcess::pid))
        .collect();
    drop(holders);
    drop(nodes);
    drop(masters);
    drop(etcd);
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists()
                || std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| s.contains(") Z ")),
            "process {pid} still runs after the test"
        );
    }
}
