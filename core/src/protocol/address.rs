//! How a dummy names its real client.
//!
//! Accepted forms: `host:port` or a bare port (upstream style: the port selects the
//! abstract socket `@mooncake_client_<port>.sock`), `unix:/path/to.sock` or an absolute
//! path (a filesystem socket), and `@name` (an abstract socket by name).

use std::fmt;

/// The default `--port` of `mooncake_client`.
pub const DEFAULT_REAL_CLIENT_PORT: u16 = 50052;

/// A Unix socket address of a real client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SocketAddress {
    /// A Linux abstract-namespace socket; the name excludes the leading NUL.
    Abstract(String),
    /// A socket file.
    Path(std::path::PathBuf),
}

/// Why an address string was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid real client address {text:?}: {reason}; use host:port (e.g. 127.0.0.1:50052), unix:/path/to.sock, an absolute path, or @abstract_name"
)]
pub struct AddressError {
    /// The rejected text.
    pub text: String,
    /// What was wrong.
    pub reason: &'static str,
}

impl SocketAddress {
    /// The default abstract socket of the real client serving `port`.
    pub fn for_port(port: u16) -> Self {
        SocketAddress::Abstract(format!("@mooncake_client_{port}.sock"))
    }

    /// Parses any of the accepted forms.
    pub fn parse(text: &str) -> Result<Self, AddressError> {
        let bad = |reason| AddressError {
            text: text.to_string(),
            reason,
        };
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(bad("the address is empty"));
        }
        if let Some(path) = trimmed.strip_prefix("unix:") {
            return Self::path(path).ok_or_else(|| bad("a unix: address needs an absolute path"));
        }
        if trimmed.starts_with('/') {
            return Self::path(trimmed).ok_or_else(|| bad("not an absolute path"));
        }
        if trimmed.starts_with('@') {
            if trimmed.len() > 107 {
                return Err(bad("an abstract socket name is at most 107 bytes"));
            }
            return Ok(SocketAddress::Abstract(trimmed.to_string()));
        }
        let port_text = match trimmed.rsplit_once(':') {
            Some((_host, port)) => port,
            None => trimmed,
        };
        let port: u16 = port_text
            .parse()
            .map_err(|_| bad("the port is not a number between 1 and 65535"))?;
        if port == 0 {
            return Err(bad("port 0 is not a real client port"));
        }
        Ok(Self::for_port(port))
    }

    fn path(path: &str) -> Option<Self> {
        let path = std::path::Path::new(path);
        (path.is_absolute() && path.as_os_str().len() < 108)
            .then(|| SocketAddress::Path(path.to_path_buf()))
    }

    /// The std socket address to bind or connect to.
    pub fn to_std(&self) -> std::io::Result<std::os::unix::net::SocketAddr> {
        use std::os::linux::net::SocketAddrExt;
        match self {
            SocketAddress::Abstract(name) => {
                std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            }
            SocketAddress::Path(path) => std::os::unix::net::SocketAddr::from_pathname(path),
        }
    }
}

impl fmt::Display for SocketAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SocketAddress::Abstract(name) => write!(f, "abstract socket {name}"),
            SocketAddress::Path(path) => write!(f, "socket file {}", path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forms() {
        let port = SocketAddress::for_port(50052);
        assert_eq!(SocketAddress::parse("127.0.0.1:50052"), Ok(port.clone()));
        assert_eq!(SocketAddress::parse("50052"), Ok(port.clone()));
        assert_eq!(SocketAddress::parse("localhost:50052"), Ok(port));
        assert_eq!(
            SocketAddress::parse("unix:/run/mc.sock"),
            Ok(SocketAddress::Path("/run/mc.sock".into()))
        );
        assert_eq!(
            SocketAddress::parse("/run/mc.sock"),
            Ok(SocketAddress::Path("/run/mc.sock".into()))
        );
        assert_eq!(
            SocketAddress::parse("@x"),
            Ok(SocketAddress::Abstract("@x".into()))
        );
        for bad in ["", "host:", "host:99999", "unix:relative", "127.0.0.1:0"] {
            assert!(SocketAddress::parse(bad).is_err(), "{bad:?}");
        }
    }
}
