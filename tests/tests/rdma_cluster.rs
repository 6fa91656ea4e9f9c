//! A cluster moving its bytes with RDMA: one `mooncake_master`, three `mooncake_client`s
//! with `--protocol=rdma` on the stand-in verbs provider (one-sided reads and writes
//! between the processes), dummies attached to different nodes.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicateConfig};
use mooncake_integration_tests::{
    MasterProcess, RealClientProcess, eventually, free_tcp_port, http_get, sample,
};

fn stand_in() -> &'static PathBuf {
    static LIBRARY: OnceLock<PathBuf> = OnceLock::new();
    LIBRARY.get_or_init(|| {
        // Under the target directory, shared by test processes (the same source is
        // built once) and left for the next run rather than in the temporary directory.
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("stand-in-verbs");
        mooncake_rdma::fake::build(&dir).expect("build the stand-in verbs provider")
    })
}

/// A node of `master`'s cluster moving bytes with RDMA; its metrics on `http_port`.
fn rdma_node(master: &MasterProcess, http_port: u16) -> RealClientProcess {
    let library = stand_in().to_string_lossy().into_owned();
    RealClientProcess::join_with_env(
        master,
        "64MB",
        &[
            "--protocol=rdma",
            "--enable_http_server=true",
            &format!("--http_port={http_port}"),
        ],
        &[(mooncake_rdma::library::LIBRARY_VARIABLE, &library)],
    )
}

fn dummy(node: &RealClientProcess) -> DummyClient {
    DummyClient::setup_dummy(64 << 20, 8 << 20, Some(&node.address())).expect("setup_dummy")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| i.to_le_bytes()[0].wrapping_mul(13).wrapping_add(seed))
        .collect()
}

fn rdma_bytes(port: u16) -> f64 {
    sample(
        &http_get(port, "/metrics"),
        "mooncake_client_rdma_bytes_total",
    )
}

#[test]
fn replicated_puts_and_peer_reads_move_over_rdma_and_survive_a_killed_peer() {
    let master = MasterProcess::start(&["--client_ttl=2"]);
    let ports: Vec<u16> = (0..3).map(|_| free_tcp_port()).collect();
    let a = rdma_node(&master, ports[0]);
    let b = rdma_node(&master, ports[1]);
    let mut c = rdma_node(&master, ports[2]);
    let writer = dummy(&a);
    let mounted = eventually(Duration::from_secs(10), || {
        writer.status().is_ok_and(|s| s.master.segments.len() == 3)
    });
    assert!(mounted, "three segments mounted");
    // Two replicas on the peers: every byte leaves `a` by RDMA write.
    let two = ReplicateConfig {
        replica_num: 2,
        preferred_segments: vec![c.segment_name(), b.segment_name()],
        ..ReplicateConfig::default()
    };
    let values: Vec<(String, Vec<u8>)> = (0..24u8)
        .map(|i| (format!("rdma-{i}"), pattern(256 << 10, i)))
        .collect();
    for (key, value) in &values {
        writer.put(key, value, &two).expect("put with two replicas");
    }
    let written = rdma_bytes(ports[0]);
    assert!(
        written >= (24 * 2 * (256 << 10)) as f64,
        "a wrote {written} bytes by RDMA"
    );
    // Reads from peers, byte-exact, on the node that holds no replica and on one that
    // holds one.
    for (key, value) in &values {
        assert_eq!(&writer.get(key).expect("read on a"), value, "{key}");
    }
    let keys: Vec<&str> = values.iter().map(|(k, _)| k.as_str()).collect();
    let reader = Arc::new(dummy(&b));
    for (got, (key, value)) in reader.get_batch(&keys).into_iter().zip(&values) {
        assert_eq!(&got.expect("batch read on b"), value, "{key}");
    }
    assert!(rdma_bytes(ports[0]) > written, "a read by RDMA too");
    // A peer killed while `a` reads: the items it held fail over to the surviving
    // replica; nothing is read wrong and nothing hangs.
    let reading = {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        let values = values.clone();
        let a_reader = dummy(&a);
        std::thread::spawn(move || {
            let until = Instant::now() + Duration::from_secs(2);
            let mut rounds = 0;
            while Instant::now() < until {
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                for (got, (key, value)) in a_reader.get_batch(&keys).into_iter().zip(&values) {
                    if let Ok(got) = got {
                        assert_eq!(&got, value, "{key}: wrong bytes");
                    }
                }
                rounds += 1;
            }
            rounds
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    c.kill9();
    let rounds = reading.join().expect("reads during the kill");
    assert!(rounds > 1, "reads went on after the kill");
    // The next reads go to the surviving replica on b, at once and once c is dropped.
    for (key, value) in &values {
        assert_eq!(
            &writer.get(key).expect("read from the survivor"),
            value,
            "{key}"
        );
    }
    let dropped = eventually(Duration::from_secs(15), || {
        writer.status().is_ok_and(|s| s.master.segments.len() == 2)
    });
    assert!(dropped, "the master drops the dead node");
    for (got, (key, value)) in writer.get_batch(&keys).into_iter().zip(&values) {
        assert_eq!(&got.expect("read from b"), value, "{key}");
    }
}

#[test]
fn rdma_without_a_device_is_refused_with_the_fix_and_auto_runs_tcp() {
    let missing = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("libibverbs-missing.so.1");
    let output = std::process::Command::new(mooncake_integration_tests::binary("mooncake_client"))
        .args(["--protocol=rdma", "--global_segment_size=16MB"])
        .arg(format!(
            "--port={}",
            mooncake_integration_tests::unique_port()
        ))
        .env(mooncake_rdma::library::LIBRARY_VARIABLE, &missing)
        .output()
        .expect("run mooncake_client");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("libibverbs-missing.so.1"), "{stderr}");
    assert!(stderr.contains("--protocol tcp"), "{stderr}");
    // The stand-in with no device: the library loads, lists nothing.
    let library = stand_in().to_string_lossy().into_owned();
    let output = std::process::Command::new(mooncake_integration_tests::binary("mooncake_client"))
        .args(["--protocol=rdma", "--global_segment_size=16MB"])
        .arg(format!(
            "--port={}",
            mooncake_integration_tests::unique_port()
        ))
        .env(mooncake_rdma::library::LIBRARY_VARIABLE, &library)
        .env("FAKE_VERBS_DEVICES", "0")
        .output()
        .expect("run mooncake_client");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("lists no device"), "{stderr}");
    let auto = RealClientProcess::start_with_env(
        "16MB",
        &["--protocol=auto"],
        &[(
            mooncake_rdma::library::LIBRARY_VARIABLE,
            missing.to_str().expect("path"),
        )],
    );
    drop(auto);
}
