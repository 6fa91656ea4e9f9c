//! Test harness: starts real `mooncake_client` processes on private sockets and kills
//! them when the guard drops, even when a test fails.
//!
//! The binaries come from the same target directory as the test executable, so build
//! them first (`cargo build --release` before `cargo test --release`, as `.ci/run` does).

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use mooncake_core::protocol::address::SocketAddress;

pub mod etcd;
pub mod eviction_log;
pub mod failpoints;
pub mod history;
pub mod offload;
pub mod redis;

/// Path of a binary built in this workspace.
pub fn binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target directory");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} not found: build the workspace binaries first (cargo build --release)",
        path.display()
    );
    path
}

static NEXT_PORT: AtomicU16 = AtomicU16::new(0);

/// A port number (naming an abstract socket) that no other test of this process has
/// had, and that nothing serves now: each test process counts through its own block of
/// 512 numbers.
pub fn unique_port() -> u16 {
    let block = 20_000 + (std::process::id() % 80) as u16 * 512;
    loop {
        let port = block + NEXT_PORT.fetch_add(1, Ordering::Relaxed) % 512;
        if !socket_accepts(&SocketAddress::for_port(port)) {
            return port;
        }
    }
}

/// A free TCP port on loopback (bound once to find it, then released) that this test
/// process has not handed out before: the kernel may offer a released port again while
/// the process it was meant for has not bound it yet, and two processes of parallel
/// tests then fight over one port (an HTTP probe reached another test's RPC port).
pub fn free_tcp_port() -> u16 {
    static HANDED_OUT: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut handed_out = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
        if !handed_out.contains(&port) {
            handed_out.push(port);
            return port;
        }
    }
}

/// kill -9 of `child`, if any, and waits until it is gone.
pub fn kill9(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A running `mooncake_master`, killed on drop.
#[derive(Debug)]
pub struct MasterProcess {
    child: Option<Child>,
    /// Its RPC port.
    pub port: u16,
    /// Its HTTP port (`/health`, `/metrics`; 0: none).
    pub metrics_port: u16,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl MasterProcess {
    /// Starts `mooncake_master` on a free loopback port with `extra` flags.
    pub fn start(extra: &[&str]) -> Self {
        Self::start_serving_http(extra, 0, &[])
    }

    /// Starts a master with `--enable_ha` in the cluster `cluster_id` of the etcd at
    /// `etcd_endpoint` (see [`etcd::EtcdServer::endpoint`]), with its HTTP server on a
    /// free port.
    pub fn start_ha(etcd_endpoint: &str, cluster_id: &str, extra: &[&str]) -> Self {
        Self::start_ha_with_env(etcd_endpoint, cluster_id, extra, &[])
    }

    /// [`start_ha`](Self::start_ha) with extra environment variables.
    pub fn start_ha_with_env(
        etcd_endpoint: &str,
        cluster_id: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut flags = vec![
            "--enable_ha".to_string(),
            format!("--etcd_endpoints={etcd_endpoint}"),
            format!("--cluster_id={cluster_id}"),
            "--ha_lease_ttl_sec=1".to_string(),
        ];
        flags.extend(extra.iter().map(|s| s.to_string()));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        Self::start_serving_http(&flags, free_tcp_port(), env)
    }

    /// [`start`](Self::start) with extra environment variables.
    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_serving_http(extra, 0, env)
    }

    fn start_serving_http(extra: &[&str], metrics_port: u16, env: &[(&str, &str)]) -> Self {
        let port = free_tcp_port();
        let mut args = vec![
            format!("--rpc_port={port}"),
            "--rpc_address=127.0.0.1".to_string(),
            format!("--metrics_port={metrics_port}"),
            "--metrics_host=127.0.0.1".to_string(),
            "--enable_metric_reporting=false".to_string(),
            "--log_level=warn".to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut master = MasterProcess {
            child: None,
            port,
            metrics_port,
            args,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
        };
        master.spawn();
        master
    }

    /// Its `/health` answer (`None` when it does not answer).
    pub fn health(&self) -> Option<String> {
        try_http_get(self.metrics_port, "/health")
    }

    /// True when its `/health` says it leads.
    pub fn is_leader(&self) -> bool {
        self.health()
            .is_some_and(|h| h.contains(r#""role":"leader""#))
    }

    /// Process id of the running instance.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// True while the process runs.
    pub fn is_running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }

    /// Sends `signal` (SIGSTOP, SIGCONT).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        if let Some(pid) = self.pid() {
            let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).expect("pid"));
            nix::sys::signal::kill(pid, signal).expect("signal");
        }
    }

    /// `127.0.0.1:<port>`.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
        let child = Command::new(binary("mooncake_master"))
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn mooncake_master");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "mooncake_master did not start");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// kill -9.
    pub fn kill9(&mut self) {
        kill9(&mut self.child);
    }

    /// Starts the same command again (same port).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }
}

impl Drop for MasterProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A running `mooncake_client`, killed on drop.
#[derive(Debug)]
pub struct RealClientProcess {
    child: Option<Child>,
    /// Its `--port`.
    pub port: u16,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

/// True once something accepts connections on the socket.
pub fn socket_accepts(address: &SocketAddress) -> bool {
    let Ok(addr) = address.to_std() else {
        return false;
    };
    std::os::unix::net::UnixStream::connect_addr(&addr).is_ok()
}

impl RealClientProcess {
    /// Starts `mooncake_client --port=<unique> --global_segment_size=<segment>` plus
    /// `extra` flags, and waits until it serves. Its embedded master (if any) is not
    /// served over TCP.
    pub fn start(segment: &str, extra: &[&str]) -> Self {
        Self::start_with_env(segment, extra, &[])
    }

    /// [`start`](Self::start) with extra environment variables.
    pub fn start_with_env(segment: &str, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let port = unique_port();
        let mut args = vec![
            format!("--port={port}"),
            format!("--global_segment_size={segment}"),
            "--embedded_master_port=0".to_string(),
            "--host=127.0.0.1".to_string(),
            "--log_level=warn".to_string(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut process = RealClientProcess {
            child: None,
            port,
            args,
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
                .collect(),
        };
        process.spawn();
        process
    }

    /// Starts a real client of the cluster run by `master`.
    pub fn join(master: &MasterProcess, segment: &str, extra: &[&str]) -> Self {
        Self::join_with_env(master, segment, extra, &[])
    }

    /// [`join`](Self::join) with extra environment variables.
    pub fn join_with_env(
        master: &MasterProcess,
        segment: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let address = format!("--master_server_address={}", master.address());
        let mut flags = vec![address.as_str()];
        flags.extend_from_slice(extra);
        Self::start_with_env(segment, &flags, env)
    }

    /// The name of its segment (`127.0.0.1:<port>`).
    pub fn segment_name(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The address dummies use.
    pub fn address(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Process id of the running instance.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).expect("running")
    }

    fn spawn(&mut self) {
        let child = Command::new(binary("mooncake_client"))
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn mooncake_client");
        self.child = Some(child);
        let address = SocketAddress::for_port(self.port);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !socket_accepts(&address) {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("mooncake_client exited during startup: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "mooncake_client did not start serving"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// kill -9, and wait for the process to be gone.
    pub fn kill9(&mut self) {
        kill9(&mut self.child);
    }

    /// Starts the same command again (same port).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }

    /// Starts the same command with `--takeover` (a new process taking this one over)
    /// and waits until the old process has handed over and exited; answers how long
    /// that took. Panics when the old process exits with an error or the handover
    /// does not finish within `limit`.
    pub fn take_over(&mut self, limit: Duration) -> Duration {
        let mut old = self.child.take().expect("running");
        let started = Instant::now();
        let new = Command::new(binary("mooncake_client"))
            .args(&self.args)
            .arg("--takeover")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn mooncake_client --takeover");
        self.child = Some(new);
        loop {
            if let Some(status) = old.try_wait().expect("wait") {
                assert!(
                    status.success(),
                    "the old mooncake_client exited with {status}"
                );
                return started.elapsed();
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                let _ = old.kill();
                panic!("mooncake_client --takeover exited: {status}");
            }
            if started.elapsed() > limit {
                let _ = old.kill();
                let _ = old.wait();
                panic!("the handover did not finish within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
        child.wait().expect("wait")
    }
}

impl Drop for RealClientProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A helper dummy process (`dummy_holder`) that attaches and waits; killed on drop.
#[derive(Debug)]
pub struct DummyProcess {
    child: Child,
}

impl DummyProcess {
    /// Starts a dummy with a pool of `pool_bytes` attached to `address`, and waits until
    /// it reports being attached.
    pub fn start(address: &str, pool_bytes: u64) -> Self {
        Self::try_start(address, pool_bytes).expect("dummy_holder failed to attach")
    }

    /// [`start`](Self::start), `None` when it could not attach (the real client is not
    /// serving yet, for example).
    pub fn try_start(address: &str, pool_bytes: u64) -> Option<Self> {
        Self::try_start_as(address, pool_bytes, false)
    }

    /// [`try_start`](Self::try_start) of a dummy that, once attached, calls without a
    /// pause (puts, reads and removes of keys of its own) until killed, when `busy`.
    pub fn try_start_as(address: &str, pool_bytes: u64, busy: bool) -> Option<Self> {
        let mut child = Command::new(binary("dummy_holder"))
            .args([address, &pool_bytes.to_string()])
            .args(busy.then_some("busy"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn dummy_holder");
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take();
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        if line.trim() != "ready" {
            let mut why = String::new();
            if let Some(mut stderr) = stderr {
                let _ = child.wait();
                let _ = std::io::Read::read_to_string(&mut stderr, &mut why);
            }
            eprintln!("dummy_holder did not attach to {address}: {}", why.trim());
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        Some(DummyProcess { child })
    }

    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// kill -9 and reap.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for DummyProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs `mooncake_cli` with `args` against `address`.
pub fn cli(address: &str, args: &[&str]) -> Output {
    Command::new(binary("mooncake_cli"))
        .arg("--client")
        .arg(address)
        .args(args)
        .output()
        .expect("run mooncake_cli")
}

/// Number of mappings of memfds named `name` in process `pid`.
pub fn memfd_mappings(pid: u32, name: &str) -> usize {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let needle = format!("/memfd:{name}");
    maps.lines().filter(|l| l.contains(&needle)).count()
}

/// Polls `condition` every 10 ms until it holds or `limit` passes; returns whether it held.
pub fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The body of `GET path` from an HTTP server on loopback `port`.
pub fn http_get(port: u16, path: &str) -> String {
    try_http_get(port, path).unwrap_or_else(|| panic!("no HTTP answer on port {port} for {path}"))
}

/// The body of `GET path` from an HTTP server on loopback `port`, `None` when it does
/// not answer (within a second).
pub fn try_http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let mut stream = std::net::TcpStream::connect_timeout(&address, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(1))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    assert!(answer.starts_with("HTTP/1."), "{answer}");
    Some(
        answer
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_string())
            .unwrap_or_default(),
    )
}

/// The value of the Prometheus sample whose line starts with `series`.
pub fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no sample {series} in:\n{text}"))
}
