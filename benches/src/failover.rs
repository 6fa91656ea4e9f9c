//! Leader failover under high availability: a private etcd, three `mooncake_master
//! --enable_ha`, two real clients following the leader through `etcd://`, and a dummy
//! writing. Each round writes objects, kills the leader with -9, and measures the time
//! until a put succeeds again, the acknowledged objects unreadable at the first read
//! after the switch, and those lost (still unreadable 10 s later). The killed master
//! comes back as a standby before the next round.

use std::process::Child;
use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicateConfig};

use crate::processes::{free_port, spawn, wait_for};

/// Objects written per round, and their size.
const OBJECTS: usize = 60;
const OBJECT_BYTES: usize = 256 << 10;

/// How long a lost-looking object is read again before it counts as lost.
const RECHECK: Duration = Duration::from_secs(10);

/// The body of `GET path` on loopback `port`, if it answers.
fn http_body(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream =
        std::net::TcpStream::connect_timeout(&address, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\n\r\n").ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    answer
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
}

/// One master: its process and ports.
struct MasterNode {
    child: Option<Child>,
    args: Vec<String>,
    metrics_port: u16,
}

impl MasterNode {
    fn start(args: Vec<String>, metrics_port: u16) -> Result<Self, String> {
        let child = spawn("mooncake_master", &args)?;
        Ok(MasterNode {
            child: Some(child),
            args,
            metrics_port,
        })
    }

    fn health(&self) -> String {
        http_body(self.metrics_port, "/health").unwrap_or_default()
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn restart(&mut self) -> Result<(), String> {
        self.kill();
        self.child = Some(spawn("mooncake_master", &self.args)?);
        Ok(())
    }
}

impl Drop for MasterNode {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A child process killed on drop.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Polls `condition` every 50 ms for up to `limit`.
fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if condition() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A private one-member etcd in a fresh directory.
fn start_etcd(dir: &std::path::Path) -> Result<(Guard, u16), String> {
    let (client, peer) = (free_port()?, free_port()?);
    let client_url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = std::process::Command::new("etcd")
        .args(["--name", "bench", "--data-dir"])
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &client_url])
        .args(["--advertise-client-urls", &client_url])
        .args(["--listen-peer-urls", &peer_url])
        .args(["--initial-advertise-peer-urls", &peer_url])
        .args(["--initial-cluster", &format!("bench={peer_url}")])
        .args(["--log-level", "error"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start etcd (install etcd-server): {e}"))?;
    let guard = Guard(child);
    if !eventually(Duration::from_secs(20), || {
        http_body(client, "/health").is_some_and(|h| h.contains("true"))
    }) {
        return Err("etcd did not start".into());
    }
    Ok((guard, client))
}

fn pattern(key: &str) -> Vec<u8> {
    let seed = key
        .bytes()
        .fold(7u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..OBJECT_BYTES)
        .map(|i| u8::try_from(i % 251).unwrap_or(0) ^ seed)
        .collect()
}

/// Outcome of one failover.
struct Round {
    resume: Duration,
    unreadable_first: usize,
    lost: usize,
    acknowledged: usize,
}

/// The leader's index, waiting up to `limit` for exactly one.
fn leader(masters: &[MasterNode], limit: Duration) -> Option<usize> {
    let mut found = None;
    eventually(limit, || {
        let leaders: Vec<usize> = (0..masters.len())
            .filter(|i| masters[*i].health().contains(r#""role":"leader""#))
            .collect();
        found = (leaders.len() == 1).then(|| leaders[0]);
        found.is_some()
    });
    found
}

fn failover_round(
    masters: &mut [MasterNode],
    writer: &DummyClient,
    acked: &mut Vec<String>,
    round: usize,
) -> Result<Round, String> {
    for i in 0..OBJECTS {
        let key = format!("failover-{round}-{i}");
        if writer
            .put(&key, &pattern(&key), &ReplicateConfig::default())
            .is_ok()
        {
            acked.push(key);
        }
    }
    let index = leader(masters, Duration::from_secs(20)).ok_or("no leader")?;
    let standbys = masters.len() - 1;
    let synced = eventually(Duration::from_secs(30), || {
        masters[index].health().matches(r#""in_sync":true"#).count() == standbys
    });
    if !synced {
        return Err("the standbys did not get in sync".into());
    }
    masters[index].kill();
    let killed_at = Instant::now();
    let probe = vec![1u8; 4096];
    let resume = loop {
        let key = format!("failover-probe-{round}-{}", killed_at.elapsed().as_millis());
        if writer
            .put(&key, &probe, &ReplicateConfig::default())
            .is_ok()
        {
            break killed_at.elapsed();
        }
        if killed_at.elapsed() > Duration::from_secs(60) {
            return Err("no put succeeded within 60 s of the kill".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let unreadable: Vec<&String> = acked
        .iter()
        .filter(|key| writer.get(key).ok() != Some(pattern(key)))
        .collect();
    let unreadable_first = unreadable.len();
    let recheck_until = Instant::now() + RECHECK;
    let mut lost = unreadable;
    while !lost.is_empty() && Instant::now() < recheck_until {
        std::thread::sleep(Duration::from_millis(500));
        lost.retain(|key| writer.get(key).ok() != Some(pattern(key)));
    }
    masters[index].restart()?;
    Ok(Round {
        resume,
        unreadable_first,
        lost: lost.len(),
        acknowledged: acked.len(),
    })
}

/// Runs `rounds` failovers and prints the table.
pub fn run(rounds: usize) -> Result<(), String> {
    let dir = std::env::temp_dir().join(format!("mooncake-failover-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let (_etcd, etcd_port) = start_etcd(&dir)?;
    let cluster = format!("bench-{}", std::process::id());
    let lease_ttl = 2;
    let mut masters = Vec::new();
    for _ in 0..3 {
        let (rpc, metrics) = (free_port()?, free_port()?);
        let args = vec![
            "--enable_ha".to_string(),
            format!("--etcd_endpoints=127.0.0.1:{etcd_port}"),
            format!("--cluster_id={cluster}"),
            format!("--ha_lease_ttl_sec={lease_ttl}"),
            "--rpc_address=127.0.0.1".to_string(),
            format!("--rpc_port={rpc}"),
            "--metrics_host=127.0.0.1".to_string(),
            format!("--metrics_port={metrics}"),
            "--enable_metric_reporting=false".to_string(),
            "--log_level=error".to_string(),
        ];
        masters.push(MasterNode::start(args, metrics)?);
    }
    leader(&masters, Duration::from_secs(20)).ok_or("no leader elected")?;
    let mut nodes = Vec::new();
    let mut addresses = Vec::new();
    for _ in 0..2 {
        let port = free_port()?;
        nodes.push(Guard(spawn(
            "mooncake_client",
            &[
                format!("--port={port}"),
                "--host=127.0.0.1".to_string(),
                "--global_segment_size=256MB".to_string(),
                "--embedded_master_port=0".to_string(),
                format!("--master_server_address=etcd://127.0.0.1:{etcd_port}"),
                format!("--cluster_id={cluster}"),
                "--log_level=error".to_string(),
            ],
        )?));
        addresses.push(format!("127.0.0.1:{port}"));
    }
    let writer = wait_for(&addresses[0])?;
    println!(
        "\nfailover (3 masters, 2 nodes, etcd lease {lease_ttl} s; {OBJECTS} x {} KiB objects per round; leader killed with -9)",
        OBJECT_BYTES >> 10
    );
    println!(
        "\n| round | first put after the kill | unreadable at the first read | lost | acknowledged |\n|---|---|---|---|---|"
    );
    let mut acked = Vec::new();
    let mut resumes = Vec::new();
    for round in 1..=rounds {
        let outcome = failover_round(&mut masters, &writer, &mut acked, round)?;
        println!(
            "| {round} | {:.2} s | {} | {} | {} |",
            outcome.resume.as_secs_f64(),
            outcome.unreadable_first,
            outcome.lost,
            outcome.acknowledged
        );
        resumes.push(outcome.resume);
    }
    resumes.sort();
    if let Some(median) = resumes.get(resumes.len() / 2) {
        println!(
            "\nmedian time to the first put: {:.2} s",
            median.as_secs_f64()
        );
    }
    drop(writer);
    drop(nodes);
    drop(masters);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
