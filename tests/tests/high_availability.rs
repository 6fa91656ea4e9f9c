//! High availability with a real etcd: three `mooncake_master --enable_ha` on loopback,
//! real clients that follow the leader through `etcd://`, and leaders killed with -9,
//! paused with SIGSTOP, standbys restarted, etcd restarted. After every failover each
//! acknowledged object reads back byte-exact at the first try, and writes resume.

use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicateConfig};
use mooncake_integration_tests::etcd::EtcdServer;
use mooncake_integration_tests::{MasterProcess, RealClientProcess, cli, eventually, unique_port};

/// etcd, masters and nodes of one test cluster (all killed on drop).
struct Cluster {
    // Dropped first: nodes, then masters, then etcd.
    nodes: Vec<RealClientProcess>,
    masters: Vec<MasterProcess>,
    etcd: EtcdServer,
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            let mixed = i.wrapping_mul(2_654_435_761).wrapping_add(seed);
            mixed.to_le_bytes()[1]
        })
        .collect()
}

fn on(node: &RealClientProcess) -> ReplicateConfig {
    ReplicateConfig {
        preferred_segment: node.segment_name(),
        ..ReplicateConfig::default()
    }
}

impl Cluster {
    fn start(masters: usize, nodes: usize) -> Self {
        Self::start_on(EtcdServer::start(), masters, nodes, &[])
    }

    /// A cluster on `etcd`, every master and node given `etcd_flags` (TLS settings).
    fn start_on(etcd: EtcdServer, masters: usize, nodes: usize, etcd_flags: &[&str]) -> Self {
        let cluster_id = format!("ha-{}-{}", std::process::id(), unique_port());
        let masters: Vec<_> = (0..masters)
            .map(|_| MasterProcess::start_ha(&etcd.endpoint(), &cluster_id, etcd_flags))
            .collect();
        let mut cluster = Cluster {
            nodes: Vec::new(),
            masters,
            etcd,
        };
        cluster.wait_for_leader();
        let master = format!("--master_server_address=etcd://{}", cluster.etcd.endpoint());
        let cluster_flag = format!("--cluster_id={cluster_id}");
        let mut node_flags = vec![master.as_str(), cluster_flag.as_str()];
        node_flags.extend_from_slice(etcd_flags);
        cluster.nodes = (0..nodes)
            .map(|_| RealClientProcess::start("64MB", &node_flags))
            .collect();
        cluster
    }

    fn dummy(&self, node: usize) -> DummyClient {
        DummyClient::setup_dummy(32 << 20, 8 << 20, Some(&self.nodes[node].address()))
            .expect("setup_dummy")
    }

    /// The index of the one leader, waiting up to 15 s for one.
    fn wait_for_leader(&mut self) -> usize {
        let mut leader = None;
        let found = eventually(Duration::from_secs(15), || {
            let leaders: Vec<usize> = (0..self.masters.len())
                .filter(|i| self.masters[*i].is_leader())
                .collect();
            leader = (leaders.len() == 1).then(|| leaders[0]);
            leader.is_some()
        });
        assert!(found, "no single leader among the masters");
        leader.unwrap_or_default()
    }

    /// Waits until the leader counts `standbys` standbys in sync.
    fn wait_for_standbys(&mut self, standbys: usize) {
        let leader = self.wait_for_leader();
        let synced = eventually(Duration::from_secs(20), || {
            self.masters[leader]
                .health()
                .is_some_and(|h| h.matches(r#""in_sync":true"#).count() == standbys)
        });
        assert!(
            synced,
            "the leader does not count {standbys} standbys in sync: {:?}",
            self.masters[leader].health()
        );
    }
}

/// Puts `count` objects through `writer` spread over the nodes; answers the
/// acknowledged ones.
fn write(
    cluster: &Cluster,
    writer: &DummyClient,
    prefix: &str,
    count: usize,
) -> Vec<(String, Vec<u8>)> {
    let mut acked = Vec::new();
    for i in 0..count {
        let key = format!("{prefix}-{i}");
        let size = [4 << 10, 64 << 10, 1 << 20][i % 3];
        let value = pattern(size, i as u64 * 131 + prefix.len() as u64);
        let node = &cluster.nodes[i % cluster.nodes.len()];
        if writer.put(&key, &value, &on(node)).is_ok() {
            acked.push((key, value));
        }
    }
    acked
}

/// Every acknowledged object reads back byte-exact at the first try, from every node.
fn check_all(cluster: &Cluster, acked: &[(String, Vec<u8>)]) {
    for node in 0..cluster.nodes.len() {
        let reader = cluster.dummy(node);
        for (key, value) in acked {
            match reader.get(key) {
                Ok(bytes) => assert!(bytes == *value, "{key} differs when read on node {node}"),
                Err(code) => panic!("{key} unreadable on node {node} after the failover: {code:?}"),
            }
        }
    }
}

/// Time until a put through `writer` succeeds.
fn time_to_first_put(writer: &DummyClient, key: &str, started: Instant) -> Duration {
    let value = pattern(4096, 99);
    loop {
        if writer.put(key, &value, &ReplicateConfig::default()).is_ok() {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no put succeeded within 30 s of the failover"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn killing_the_leader_loses_no_acknowledged_object_and_writes_resume() {
    let mut cluster = Cluster::start(3, 3);
    let writer = cluster.dummy(0);
    let mut acked = Vec::new();
    for round in 0..3 {
        let batch = write(&cluster, &writer, &format!("round{round}"), 30);
        assert_eq!(batch.len(), 30, "every put succeeds while a leader serves");
        acked.extend(batch);
        cluster.wait_for_standbys(2);
        let leader = cluster.wait_for_leader();
        cluster.masters[leader].kill9();
        let started = Instant::now();
        let resumed = time_to_first_put(&writer, &format!("after-{round}"), started);
        eprintln!("failover {round}: first put after {resumed:?}");
        check_all(&cluster, &acked);
        cluster.masters[leader].restart();
    }
}

#[test]
fn a_restarted_standby_catches_up_and_can_take_over_alone() {
    let mut cluster = Cluster::start(3, 2);
    let writer = cluster.dummy(0);
    cluster.wait_for_standbys(2);
    let mut acked = write(&cluster, &writer, "before", 20);
    let leader = cluster.wait_for_leader();
    let standby = (leader + 1) % 3;
    let other = (leader + 2) % 3;
    cluster.masters[standby].kill9();
    acked.extend(write(&cluster, &writer, "while-down", 20));
    cluster.masters[standby].restart();
    cluster.wait_for_standbys(2);
    // mooncake_cli status names the leader and both standbys, in sync.
    let status = cli(&cluster.nodes[0].address(), &["status"]);
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains(&format!(
            "leader {} (term ",
            cluster.masters[leader].address()
        )),
        "{text}"
    );
    for other in [standby, other] {
        let line = format!("standby {}: in sync", cluster.masters[other].address());
        assert!(text.contains(&line), "{line} missing from:\n{text}");
    }
    acked.extend(write(&cluster, &writer, "after", 20));
    assert_eq!(acked.len(), 60);
    // Only the restarted standby is left to take over.
    cluster.masters[other].kill9();
    cluster.masters[leader].kill9();
    assert_eq!(cluster.wait_for_leader(), standby);
    time_to_first_put(&writer, "resumed", Instant::now());
    check_all(&cluster, &acked);
}

/// With no standby listed in sync when the leader dies, the best informed master takes
/// over: one that was in sync with that leader a moment ago, never a restarted empty
/// one (which would forget every object).
#[test]
fn without_an_in_sync_standby_the_best_informed_master_takes_over() {
    use nix::sys::signal::Signal;
    let mut cluster = Cluster::start(3, 2);
    let writer = cluster.dummy(0);
    cluster.wait_for_standbys(2);
    let acked = write(&cluster, &writer, "in-sync", 20);
    let leader = cluster.wait_for_leader();
    let informed = (leader + 1) % 3;
    let empty = (leader + 2) % 3;
    // One standby pauses and the other dies: the next writes drop both from the
    // in-sync list, and the leader acknowledges them alone.
    cluster.masters[informed].signal(Signal::SIGSTOP);
    cluster.masters[empty].kill9();
    write(&cluster, &writer, "alone", 2);
    assert!(
        eventually(Duration::from_secs(10), || cluster.masters[leader]
            .health()
            .is_some_and(|h| !h.contains(r#""in_sync":true"#))),
        "the leader still lists a standby in sync"
    );
    cluster.masters[leader].kill9();
    cluster.masters[empty].restart();
    cluster.masters[informed].signal(Signal::SIGCONT);
    assert_eq!(
        cluster.wait_for_leader(),
        informed,
        "the master holding the index must win"
    );
    time_to_first_put(&writer, "resumed", Instant::now());
    check_all(&cluster, &acked);
}

#[test]
fn a_restarted_etcd_keeps_the_cluster_and_its_objects() {
    let mut cluster = Cluster::start(3, 2);
    let writer = cluster.dummy(0);
    cluster.wait_for_standbys(2);
    let mut acked = write(&cluster, &writer, "before", 20);
    cluster.etcd.kill9();
    std::thread::sleep(Duration::from_millis(300));
    cluster.etcd.restart();
    time_to_first_put(&writer, "resumed", Instant::now());
    acked.extend(write(&cluster, &writer, "after", 20));
    cluster.wait_for_leader();
    check_all(&cluster, &acked);
}

#[test]
fn a_paused_leader_serves_no_write_once_another_leads() {
    let mut cluster = Cluster::start(3, 2);
    let writer = cluster.dummy(0);
    cluster.wait_for_standbys(2);
    let mut acked = write(&cluster, &writer, "before", 20);
    let paused = cluster.wait_for_leader();
    cluster.masters[paused].signal(nix::sys::signal::Signal::SIGSTOP);
    let taken_over = eventually(Duration::from_secs(15), || {
        (0..3).any(|i| i != paused && cluster.masters[i].is_leader())
    });
    cluster.masters[paused].signal(nix::sys::signal::Signal::SIGCONT);
    assert!(taken_over, "no standby took over from the paused leader");
    // Resumed, the old leader refuses every write (its lease lapsed), then exits.
    let old = mooncake_core::protocol::master_client::RemoteMaster::new(
        cluster.masters[paused].address(),
        None,
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let answer = runtime.block_on(mooncake_core::master_api::MasterExt::put_start(
        &old,
        vec![("fenced".into(), 4096)],
        mooncake_core::types::ReplicateConfig::default(),
        mooncake_core::protocol::rpc::WriteMode::Put,
    ));
    assert!(answer[0].is_err(), "the deposed leader accepted a write");
    assert!(
        eventually(Duration::from_secs(10), || !cluster.masters[paused]
            .is_running()),
        "the deposed leader keeps running"
    );
    time_to_first_put(&writer, "resumed", Instant::now());
    acked.extend(write(&cluster, &writer, "after", 20));
    check_all(&cluster, &acked);
}

/// The `--etcd_*` flags presenting `client` (a certificate and key) to a TLS etcd.
fn tls_flags(ca: &str, client: &(String, String)) -> [String; 3] {
    [
        format!("--etcd_ca_file={ca}"),
        format!("--etcd_cert_file={}", client.0),
        format!("--etcd_key_file={}", client.1),
    ]
}

#[test]
fn over_tls_with_client_certificates_masters_elect_and_nodes_follow() {
    let etcd = EtcdServer::start_tls();
    let files = etcd.tls().expect("a TLS etcd").clone();
    let flags = tls_flags(&files.ca, &files.client);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut cluster = Cluster::start_on(etcd, 2, 1, &flags);
    cluster.wait_for_standbys(1);
    let writer = cluster.dummy(0);
    let acked = write(&cluster, &writer, "tls", 6);
    assert_eq!(
        acked.len(),
        6,
        "every put over a TLS-following node succeeds"
    );
    // The leader dies: the standby wins the election over TLS, the node follows.
    let leader = cluster.wait_for_leader();
    cluster.masters[leader].kill9();
    assert!(
        eventually(Duration::from_secs(15), || cluster.masters[1 - leader]
            .is_leader()),
        "the standby does not take over through the TLS etcd"
    );
    check_all(&cluster, &acked);

    // A master presenting no certificate, or one another authority signed, never
    // leads: etcd refuses it.
    let id = format!("tls-strangers-{}", unique_port());
    let stranger = tls_flags(&files.ca, &files.stranger);
    let stranger: Vec<&str> = stranger.iter().map(String::as_str).collect();
    let ca_only = format!("--etcd_ca_file={}", files.ca);
    let endpoint = cluster.etcd.endpoint();
    let mut refused = [
        MasterProcess::start_ha(&endpoint, &id, &stranger),
        MasterProcess::start_ha(&endpoint, &id, &[&ca_only]),
        MasterProcess::start_ha(&endpoint, &id, &[]),
    ];
    std::thread::sleep(Duration::from_secs(4));
    for master in &mut refused {
        assert!(!master.is_leader(), "a master etcd refused leads");
    }
}

#[test]
fn incomplete_etcd_tls_settings_stop_the_master_with_the_flag_named() {
    let dir = mooncake_integration_tests::offload::TempDir::new("tls-flags");
    let files = mooncake_integration_tests::etcd::TlsFiles::generate(dir.path());
    let cases: [(Vec<String>, &str); 3] = [
        (
            vec![format!("--etcd_cert_file={}", files.client.0)],
            "--etcd_cert_file and --etcd_key_file go together",
        ),
        (
            vec![
                format!("--etcd_cert_file={}", files.client.0),
                format!("--etcd_key_file={}", files.client.1),
            ],
            "--etcd_cert_file needs --etcd_ca_file",
        ),
        (
            vec![format!("--etcd_ca_file={}/absent.pem", dir.path())],
            "--etcd_ca_file",
        ),
    ];
    for (flags, expected) in cases {
        let output =
            std::process::Command::new(mooncake_integration_tests::binary("mooncake_master"))
                .args([
                    "--enable_ha",
                    "--etcd_endpoints=127.0.0.1:1",
                    "--rpc_address=127.0.0.1",
                ])
                .args(&flags)
                .output()
                .expect("run mooncake_master");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{flags:?} accepted");
        assert!(stderr.contains(expected), "{flags:?}: {stderr}");
    }
}
