//! A private `etcd` on loopback for the high-availability tests: free ports, its own
//! data directory (kept across [`EtcdServer::restart`]), killed on drop. Needs the
//! Debian `etcd-server` package (`.ci/run` installs it).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_tcp_port;
use crate::offload::TempDir;

/// Starts tried before a test gives up.
const ATTEMPTS: usize = 3;

/// A running `etcd`, killed on drop.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    /// Client port.
    pub port: u16,
    peer_port: u16,
    dir: TempDir,
}

impl EtcdServer {
    /// Starts a one-member etcd cluster on free loopback ports.
    pub fn start() -> Self {
        let mut server = EtcdServer {
            child: None,
            port: free_tcp_port(),
            peer_port: free_tcp_port(),
            dir: TempDir::new("etcd"),
        };
        // A port found free may be taken (as the local port of some connection) before
        // etcd binds it: then etcd exits, and it starts again on other ports.
        for _ in 0..ATTEMPTS {
            if server.spawn() {
                return server;
            }
            server.kill9();
            server.port = free_tcp_port();
            server.peer_port = free_tcp_port();
        }
        panic!("etcd did not start: {}", server.log());
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts etcd on its ports; false when it exits or is not healthy within 20 s.
    fn spawn(&mut self) -> bool {
        let client = format!("http://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let child = Command::new("etcd")
            .args([
                "--name",
                "test",
                "--data-dir",
                &format!("{}/data", self.dir.path()),
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &format!("test={peer}"),
                "--log-level",
                "error",
            ])
            .stdout(Stdio::null())
            .stderr(self.log_file())
            .spawn()
            .expect("spawn etcd: install the etcd-server package (.ci/run does)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.healthy() {
            let exited = self
                .child
                .as_mut()
                .is_some_and(|c| c.try_wait().ok().flatten().is_some());
            if exited || Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    fn log_path(&self) -> std::path::PathBuf {
        std::path::Path::new(self.dir.path()).join("etcd.log")
    }

    fn log_file(&self) -> Stdio {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_or_else(|_| Stdio::null(), Stdio::from)
    }

    /// What etcd logged (errors only).
    fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn healthy(&self) -> bool {
        crate::try_http_get(self.port, "/health").is_some_and(|h| h.contains("true"))
    }

    /// kill -9.
    pub fn kill9(&mut self) {
        crate::kill9(&mut self.child);
    }

    /// Starts it again on the same ports and data.
    pub fn restart(&mut self) {
        for _ in 0..ATTEMPTS {
            self.kill9();
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!("etcd did not start again: {}", self.log());
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill9();
    }
}
