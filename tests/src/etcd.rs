//! A private `etcd` on loopback for the high-availability tests: free ports, its own
//! data directory (kept across [`EtcdServer::restart`]), killed on drop; optionally
//! serving clients over TLS only, asking for client certificates
//! ([`EtcdServer::start_tls`], with [`TlsFiles`] made by `openssl`). Needs the Debian
//! `etcd-server` package (`.ci/run` installs it).

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
    /// Plain-HTTP port of `/health` when clients are served over TLS.
    health_port: Option<u16>,
    tls: Option<TlsFiles>,
    dir: TempDir,
}

/// A certificate authority and the certificates it signed (PEM files), made with
/// `openssl`: etcd's server certificate (for 127.0.0.1) and a client certificate; and
/// a second authority's client certificate, which etcd must refuse.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// The authority's certificate.
    pub ca: String,
    /// etcd's certificate and key.
    pub server: (String, String),
    /// A client certificate and key the authority signed.
    pub client: (String, String),
    /// A client certificate and key another authority signed.
    pub stranger: (String, String),
}

impl TlsFiles {
    /// Makes the files in `dir`.
    pub fn generate(dir: &str) -> Self {
        let at = |name: &str| format!("{dir}/{name}");
        let openssl = |args: &[&str]| {
            let output = Command::new("openssl")
                .args(args)
                .output()
                .expect("openssl runs (.ci/run installs it)");
            assert!(
                output.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        };
        let authority = |name: &str| {
            let (key, cert) = (at(&format!("{name}.key")), at(&format!("{name}.pem")));
            openssl(&[
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-days",
                "2",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &key,
                "-out",
                &cert,
            ]);
            (cert, key)
        };
        let (ca, ca_key) = authority("ca");
        let (other_ca, other_key) = authority("other-ca");
        let signed = |name: &str, by: (&str, &str), extension: &str| {
            let (key, csr, cert) = (
                at(&format!("{name}.key")),
                at(&format!("{name}.csr")),
                at(&format!("{name}.pem")),
            );
            let ext = at(&format!("{name}.ext"));
            std::fs::write(&ext, extension).expect("extension file");
            openssl(&[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
                "-subj",
                &format!("/CN={name}"),
                "-keyout",
                &key,
                "-out",
                &csr,
            ]);
            openssl(&[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                by.0,
                "-CAkey",
                by.1,
                "-CAcreateserial",
                "-days",
                "2",
                "-extfile",
                &ext,
                "-out",
                &cert,
            ]);
            (cert, key)
        };
        let server_ext =
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n";
        let client_ext = "extendedKeyUsage=clientAuth\n";
        TlsFiles {
            server: signed("server", (&ca, &ca_key), server_ext),
            client: signed("client", (&ca, &ca_key), client_ext),
            stranger: signed("stranger", (&other_ca, &other_key), client_ext),
            ca,
        }
    }
}

impl EtcdServer {
    /// Starts a one-member etcd cluster on free loopback ports.
    pub fn start() -> Self {
        Self::start_with(None, TempDir::new("etcd"))
    }

    /// Starts a one-member etcd cluster serving clients over TLS only, with its
    /// certificates made anew in its directory; it asks every client for a
    /// certificate its authority signed.
    pub fn start_tls() -> Self {
        let dir = TempDir::new("etcd-tls");
        let files = TlsFiles::generate(dir.path());
        Self::start_with(Some(files), dir)
    }

    /// The certificates of a TLS etcd.
    pub fn tls(&self) -> Option<&TlsFiles> {
        self.tls.as_ref()
    }

    fn start_with(tls: Option<TlsFiles>, dir: TempDir) -> Self {
        let mut server = EtcdServer {
            child: None,
            port: free_tcp_port(),
            peer_port: free_tcp_port(),
            health_port: tls.as_ref().map(|_| free_tcp_port()),
            tls,
            dir,
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
            server.health_port = server.health_port.map(|_| free_tcp_port());
        }
        panic!("etcd did not start: {}", server.log());
    }

    /// `127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts etcd on its ports; false when it exits or is not healthy within 20 s.
    fn spawn(&mut self) -> bool {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", self.port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new("etcd");
        if let (Some(tls), Some(health)) = (&self.tls, self.health_port) {
            command.args([
                "--cert-file",
                &tls.server.0,
                "--key-file",
                &tls.server.1,
                "--trusted-ca-file",
                &tls.ca,
                "--client-cert-auth",
                "--listen-metrics-urls",
                &format!("http://127.0.0.1:{health}"),
            ]);
        }
        let child = command
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
        crate::try_http_get(self.health_port.unwrap_or(self.port), "/health")
            .is_some_and(|h| h.contains("true"))
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
