//! How transfer connections are set up: no Nagle delay, and the TCP congestion control
//! they send with.
//!
//! A transfer is a burst (a request, then megabytes at once) after an idle pause. With
//! BBR, the default of many distributions, such a burst is paced at the rate BBR last
//! estimated, and on a busy node that estimate stays far below what the link (or
//! loopback) carries: 16 MiB reads between two real clients on one machine ran at
//! 49 % of raw loopback TCP with BBR and at 83 % with CUBIC. So transfer sockets ask
//! for CUBIC unless told otherwise (`--transfer_tcp_congestion`); `system` keeps the
//! machine's choice.

use std::ffi::OsString;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::sys::socket::{setsockopt, sockopt};

/// Default of `--transfer_tcp_congestion`.
pub const DEFAULT_CONGESTION: &str = "cubic";
/// Value of `--transfer_tcp_congestion` that keeps the system's default.
pub const SYSTEM: &str = "system";
/// Longest congestion-control name Linux accepts (`TCP_CA_NAME_MAX` less the NUL).
const NAME_MAX: usize = 15;

/// The congestion control of transfer connections.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// The system's default (`net.ipv4.tcp_congestion_control`).
    #[default]
    System,
    /// A named algorithm (`cubic`, `reno`, `bbr`, `dctcp`, ...).
    Named(String),
}

impl Congestion {
    /// Parses a flag value: `system` or an algorithm's name (1-15 of a-z 0-9 _).
    pub fn parse(text: &str) -> Result<Self, String> {
        let name = text.trim();
        if name == SYSTEM {
            return Ok(Congestion::System);
        }
        let valid = !name.is_empty()
            && name.len() <= NAME_MAX
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if valid {
            Ok(Congestion::Named(name.to_string()))
        } else {
            Err(format!(
                "{text:?} is not a congestion control name: use `system` or a name of 1-{NAME_MAX} of a-z 0-9 _ (see net.ipv4.tcp_available_congestion_control)"
            ))
        }
    }

    /// Prepares a connected transfer socket: no Nagle delay, and this congestion
    /// control. A refused algorithm (not loaded, or not in
    /// `net.ipv4.tcp_allowed_congestion_control` for an unprivileged process) leaves the
    /// system's default and is logged once per process.
    pub fn prepare(&self, stream: &TcpStream) {
        let _ = stream.set_nodelay(true);
        let Congestion::Named(name) = self else {
            return;
        };
        if let Err(errno) = setsockopt(stream, sockopt::TcpCongestion, &OsString::from(name)) {
            static WARNED: AtomicBool = AtomicBool::new(false);
            if !WARNED.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    algorithm = %name,
                    error = %errno,
                    "transfer connections keep the system's TCP congestion control: the kernel refused the one asked for; load it or add it to net.ipv4.tcp_allowed_congestion_control, or set --transfer_tcp_congestion=system to stop asking"
                );
            }
        }
    }
}

/// The congestion control a connected socket uses, for tests and diagnostics.
pub fn congestion_of(stream: &TcpStream) -> Option<String> {
    let name = nix::sys::socket::getsockopt(stream, sockopt::TcpCongestion).ok()?;
    Some(name.to_string_lossy().trim_end_matches('\0').to_string())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn connected() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (server, _) = listener.accept().expect("accept");
        (client, server)
    }

    #[test]
    fn names_are_checked() {
        assert_eq!(Congestion::parse("system"), Ok(Congestion::System));
        assert_eq!(
            Congestion::parse(" cubic "),
            Ok(Congestion::Named("cubic".into()))
        );
        for bad in ["", "CUBIC", "cu bic", "a-b", "abcdefghijklmnop"] {
            let error = Congestion::parse(bad).expect_err(bad);
            assert!(error.contains("congestion control"), "{error}");
        }
    }

    #[test]
    fn reno_is_always_allowed_and_is_applied() {
        let (client, _server) = connected();
        Congestion::Named("reno".into()).prepare(&client);
        assert_eq!(congestion_of(&client).as_deref(), Some("reno"));
        assert!(client.nodelay().expect("nodelay"));
    }

    #[test]
    fn an_unknown_algorithm_keeps_the_system_default() {
        let (client, _server) = connected();
        let before = congestion_of(&client);
        Congestion::Named("no_such_cc".into()).prepare(&client);
        assert_eq!(congestion_of(&client), before);
        assert!(client.nodelay().expect("nodelay"));
    }
}
