//! A private `etcd` on loopback for the high-availability tests: free ports, its own
//! data directory (kept across [`EtcdServer::restart`]), killed on drop. Needs the
//! Debian `etcd-server` package (`.ci/run` installs it).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_tcp_port;
use crate::offload::TempDir;

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
        server.spawn();
        server
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn spawn(&mut self) {
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
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn etcd: install the etcd-server package (.ci/run does)");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.healthy() {
            assert!(Instant::now() < deadline, "etcd did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
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
        self.kill9();
        self.spawn();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.kill9();
    }
}
