//! Private `redis-server` processes on loopback (no persistence, a password), killed
//! on drop, and `redis-cli` against them. Needs the Debian `redis-server` package
//! (`.ci/run` installs it).

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::free_tcp_port;
use crate::offload::TempDir;

/// The password every test server requires.
pub const PASSWORD: &str = "mooncake-test";

/// A running `redis-server`, killed on drop.
#[derive(Debug)]
pub struct RedisServer {
    child: Option<Child>,
    /// Its TCP port.
    pub port: u16,
    args: Vec<String>,
    /// The CA certificate when the server speaks TLS only.
    tls_ca: Option<String>,
    /// Holds `cluster-config-file`, the append-only file or TLS keys (removed with the
    /// server).
    #[expect(dead_code, reason = "held for its Drop, never read")]
    dir: Option<TempDir>,
}

impl RedisServer {
    /// Starts a standalone server on a free port.
    pub fn start() -> Self {
        Self::start_with(&[], None)
    }

    /// Starts a standalone server that writes every change to an append-only file
    /// before replying, so a kill -9 loses nothing.
    pub fn start_persistent() -> Self {
        Self::start_with(
            &["--appendonly", "yes", "--appendfsync", "always"],
            Some(TempDir::new("redis-aof")),
        )
    }

    /// Starts a standalone server with `extra` settings (e.g. `--maxmemory 2mb`).
    pub fn start_with_settings(extra: &[&str]) -> Self {
        Self::start_with(extra, None)
    }

    /// Starts a server that accepts only TLS, with a certificate for 127.0.0.1 signed
    /// by a CA made for it (`openssl` creates both); see [`ca_file`](Self::ca_file).
    pub fn start_tls() -> Self {
        let dir = TempDir::new("redis-tls");
        make_certificates(dir.path());
        let base = dir.path().to_string();
        let file = |name: &str| format!("{base}/{name}");
        let port = free_tcp_port();
        let mut server = Self::configured(
            &[
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--tls-cert-file",
                &file("server.crt"),
                "--tls-key-file",
                &file("server.key"),
                "--tls-ca-cert-file",
                &file("ca.crt"),
                "--tls-auth-clients",
                "no",
            ],
            Some(dir),
        );
        server.port = port;
        server.tls_ca = Some(file("ca.crt"));
        server.spawn();
        server
    }

    /// The CA certificate of a TLS server.
    pub fn ca_file(&self) -> Option<&str> {
        self.tls_ca.as_deref()
    }

    /// The server `.ci/run` started for the whole run (`MOONCAKE_TEST_REDIS_PORT`,
    /// password [`PASSWORD`]), or else one of this test's own. Tests sharing it keep to
    /// their own key prefixes and never stop it.
    pub fn shared_or_start() -> Self {
        let shared = std::env::var("MOONCAKE_TEST_REDIS_PORT")
            .ok()
            .and_then(|p| p.parse().ok());
        match shared {
            Some(port) => RedisServer {
                child: None,
                port,
                args: Vec::new(),
                tls_ca: None,
                dir: None,
            },
            None => Self::start(),
        }
    }

    fn start_with(extra: &[&str], dir: Option<TempDir>) -> Self {
        let mut server = Self::configured(extra, dir);
        server.spawn();
        server
    }

    /// A server with `extra` settings and `dir`, not started yet.
    fn configured(extra: &[&str], dir: Option<TempDir>) -> Self {
        let port = free_tcp_port();
        let mut args: Vec<String> = [
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--requirepass",
            PASSWORD,
            "--masterauth",
            PASSWORD,
            "--loglevel",
            "warning",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|s| s.to_string()));
        if !extra.contains(&"--appendonly") {
            args.extend(["--appendonly".to_string(), "no".to_string()]);
        }
        if let Some(dir) = &dir {
            args.extend(["--dir".to_string(), dir.path().to_string()]);
        }
        let mut server = RedisServer {
            child: None,
            port,
            args,
            tls_ca: None,
            dir,
        };
        if !extra.contains(&"--port") {
            server
                .args
                .splice(0..0, ["--port".to_string(), port.to_string()]);
        }
        server
    }

    fn spawn(&mut self) {
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("redis-server not found: install the redis-server package (.ci/run does)");
        let pid = child.id();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while self.cli(&["PING"]).trim() != "PONG" {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            assert!(
                exited.is_none(),
                "redis-server {:?} exited at startup ({exited:?}; its log is above)",
                self.args
            );
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Another test's server on the same port would answer too: make sure it is ours.
        let info = self.cli(&["INFO", "server"]);
        assert!(
            info.lines()
                .any(|line| line.trim() == format!("process_id:{pid}")),
            "port {} is served by another redis-server",
            self.port
        );
    }

    /// `redis://:<password>@127.0.0.1:<port>/0` (`rediss://` for TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        format!("{scheme}://:{PASSWORD}@127.0.0.1:{}/0", self.port)
    }

    /// Runs `redis-cli` with `args`; its standard output (raw, one reply per line).
    pub fn cli(&self, args: &[&str]) -> String {
        let mut command = Command::new("redis-cli");
        command.args([
            "-p",
            &self.port.to_string(),
            "-a",
            PASSWORD,
            "--no-auth-warning",
        ]);
        if let Some(ca) = &self.tls_ca {
            command.args(["--tls", "--cacert", ca]);
        }
        let output = command
            .args(args)
            .stderr(Stdio::null())
            .output()
            .expect("redis-cli not found: install the redis-server package (.ci/run does)");
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// The keys under `prefix`.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .cli(&["--scan", "--pattern", &format!("{prefix}*")])
            .lines()
            .map(str::to_string)
            .collect();
        keys.sort();
        keys
    }

    /// kill -9 (everything in memory is lost: the servers do not persist).
    pub fn kill9(&mut self) {
        assert!(
            !self.args.is_empty(),
            "the shared server is not this test's to stop"
        );
        crate::kill9(&mut self.child);
    }

    /// Starts the same server again (same port, empty).
    pub fn restart(&mut self) {
        self.kill9();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        crate::kill9(&mut self.child);
    }
}

/// A Redis cluster of three primaries on loopback, killed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes.
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    /// Starts three cluster-enabled servers and joins them (slots spread evenly).
    pub fn start() -> Self {
        let nodes: Vec<RedisServer> = (0..3)
            .map(|i| {
                let dir = TempDir::new(&format!("redis-cluster-{i}"));
                // The bus port must be free too (and the default, port + 10000, is
                // refused above 55535).
                let bus_port = free_tcp_port().to_string();
                RedisServer::start_with(
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-node-timeout",
                        "5000",
                        "--cluster-port",
                        &bus_port,
                    ],
                    Some(dir),
                )
            })
            .collect();
        let addresses: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let status = Command::new("redis-cli")
            .args(["-a", PASSWORD, "--no-auth-warning", "--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .stdout(Stdio::null())
            .status()
            .expect("run redis-cli --cluster create");
        assert!(status.success(), "redis-cli --cluster create failed");
        let cluster = RedisCluster { nodes };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !cluster
            .nodes
            .iter()
            .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
        {
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(50));
        }
        cluster
    }

    /// The nodes as a comma-separated list of URLs.
    pub fn urls(&self) -> String {
        self.nodes
            .iter()
            .map(RedisServer::url)
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Keys under `prefix` on every node.
    pub fn keys(&self, prefix: &str) -> Vec<String> {
        let mut keys: Vec<String> = self.nodes.iter().flat_map(|n| n.keys(prefix)).collect();
        keys.sort();
        keys
    }
}

/// Writes `ca.crt`, and `server.crt`/`server.key` for 127.0.0.1 signed by it, into `dir`.
fn make_certificates(dir: &str) {
    let openssl = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("openssl not found: install the openssl package (.ci/run does)");
        assert!(status.success(), "openssl {args:?} failed");
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=mooncake-test-ca",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        format!("{dir}/san.ext"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\n",
    )
    .expect("write san.ext");
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    ]);
}
