//! `MOONCAKE_OFFLOAD_DKV_URL`: where the Redis or Valkey store is. One URL names a
//! single server or a seed node of a cluster (told apart when connecting); a
//! comma-separated list names cluster nodes. Passwords never reach a log line or an
//! error message.

/// The variable the address comes from.
pub const URL_VARIABLE: &str = "MOONCAKE_OFFLOAD_DKV_URL";

/// The variable naming a PEM file of CA certificates for `rediss://`.
pub const CA_VARIABLE: &str = "MOONCAKE_OFFLOAD_DKV_TLS_CA_FILE";

/// What the setting looks like, for error messages.
const EXPECTED: &str = "expected redis://[user:password@]host[:port][/db], rediss://... for TLS, \
     redis+unix:///path/to/socket, or a comma-separated list of cluster nodes";

/// Why the Redis client cannot start.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// No address given.
    #[error(
        "{URL_VARIABLE} is empty: set it to the store's address (redis://:password@host:6379/0, \
         rediss://host:6380 for TLS, or a comma-separated list of cluster nodes)"
    )]
    Missing,
    /// An address that is not a Redis URL.
    #[error("{URL_VARIABLE}: {shown:?} is not a Redis URL ({reason}); {EXPECTED}")]
    Syntax {
        /// The address, password hidden.
        shown: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The CA file cannot be read.
    #[error("{CA_VARIABLE}={path}: cannot read the CA certificates ({reason})")]
    CaFile {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
    /// The store did not answer.
    #[error(
        "{URL_VARIABLE}={shown}: cannot reach the store ({reason}); start it, check the address \
         and password, or choose another MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR"
    )]
    Unreachable {
        /// The address, password hidden.
        shown: String,
        /// What the client saw.
        reason: String,
    },
    /// The client's own threads could not start.
    #[error("cannot start the Redis client's I/O thread: {0}")]
    Runtime(#[from] std::io::Error),
}

/// The parsed setting.
#[derive(Debug, Clone)]
pub struct Address {
    /// Every node given, in order.
    pub nodes: Vec<redis::ConnectionInfo>,
    /// The setting with passwords hidden, for logs.
    pub shown: String,
}

impl Address {
    /// Parses the setting (one URL or a comma-separated list).
    pub fn parse(setting: &str) -> Result<Self, SetupError> {
        let urls: Vec<&str> = setting
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .collect();
        if urls.is_empty() {
            return Err(SetupError::Missing);
        }
        let shown = urls
            .iter()
            .map(|u| hide_password(u))
            .collect::<Vec<_>>()
            .join(",");
        let nodes = urls
            .iter()
            .map(|url| parse_one(url))
            .collect::<Result<Vec<_>, _>>()?;
        let unix = urls
            .iter()
            .zip(&nodes)
            .find(|(_, node)| matches!(node.addr(), redis::ConnectionAddr::Unix(_)));
        if let (true, Some((unix, _))) = (nodes.len() > 1, unix) {
            return Err(SetupError::Syntax {
                shown: hide_password(unix),
                reason: "cluster nodes are reached over TCP, not a Unix socket".into(),
            });
        }
        Ok(Address { nodes, shown })
    }

    /// True when the setting lists several nodes (a cluster).
    pub fn is_node_list(&self) -> bool {
        self.nodes.len() > 1
    }

    /// True when the first node is reached over TLS.
    pub fn uses_tls(&self) -> bool {
        matches!(
            self.nodes.first().map(redis::ConnectionInfo::addr),
            Some(redis::ConnectionAddr::TcpTls { .. })
        )
    }
}

fn parse_one(url: &str) -> Result<redis::ConnectionInfo, SetupError> {
    let syntax = |reason: String| SetupError::Syntax {
        shown: hide_password(url),
        reason,
    };
    let scheme = url.split("://").next().unwrap_or_default();
    if !url.contains("://") {
        return Err(syntax("no scheme".into()));
    }
    if !matches!(
        scheme,
        "redis" | "rediss" | "valkey" | "valkeys" | "redis+unix" | "valkey+unix" | "unix"
    ) {
        return Err(syntax(format!("unknown scheme {scheme:?}")));
    }
    redis::IntoConnectionInfo::into_connection_info(url).map_err(|e| {
        // The crate's message may quote the URL: keep only its kind.
        let reason = match e.kind() {
            redis::ErrorKind::InvalidClientConfig => "malformed address".to_string(),
            other => format!("{other:?}"),
        };
        syntax(reason)
    })
}

/// `url` with its password hidden: everything between `user:` and the last `@`, and
/// the value of a `pass=` query parameter, become `***`.
pub fn hide_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let rest = match rest.rfind('@') {
        Some(at) => {
            let user_info = &rest[..at];
            let hidden = match user_info.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_string(),
            };
            format!("{hidden}{}", &rest[at..])
        }
        None => rest.to_string(),
    };
    format!("{scheme}://{}", hide_query_password(&rest))
}

/// `pass=<value>` in a query string replaced by `pass=***`.
fn hide_query_password(text: &str) -> String {
    let Some((path, query)) = text.split_once('?') else {
        return text.to_string();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name @ ("pass" | "password"), _)) => format!("{name}=***"),
            _ => pair.to_string(),
        })
        .collect();
    format!("{path}?{}", query.join("&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            hide_password("redis://:secret@host:6379/0"),
            "redis://:***@host:6379/0"
        );
        assert_eq!(
            hide_password("rediss://alice:p@ss@host/1"),
            "rediss://alice:***@host/1"
        );
        assert_eq!(hide_password("redis://host:6379"), "redis://host:6379");
        assert_eq!(hide_password("redis://token@host"), "redis://***@host");
        assert_eq!(
            hide_password("redis://:ab/cd@e@host:6379/0"),
            "redis://:***@host:6379/0"
        );
        assert_eq!(
            hide_password("redis+unix:///run/r.sock?db=1&pass=xyz"),
            "redis+unix:///run/r.sock?db=1&pass=***"
        );
    }

    #[test]
    fn settings_parse_or_say_what_is_wrong() {
        let one = Address::parse("redis://:pw@127.0.0.1:7000/2").expect("one");
        assert!(!one.is_node_list());
        assert_eq!(one.shown, "redis://:***@127.0.0.1:7000/2");
        let list = Address::parse("redis://a:7000, redis://b:7001").expect("list");
        assert!(Address::parse("redis://unix-a:7000,redis://unix-b:7000").is_ok());
        assert!(list.is_node_list());
        assert!(Address::parse("rediss://h:6380").expect("tls").uses_tls());
        assert!(matches!(Address::parse(" , "), Err(SetupError::Missing)));
        for bad in [
            "localhost:6379",
            "http://host",
            "redis://:pw@host:notaport",
            "redis://a:1,redis+unix:///tmp/s",
        ] {
            let error = Address::parse(bad).expect_err(bad).to_string();
            assert!(error.starts_with(URL_VARIABLE), "{error}");
            assert!(!error.contains("pw@"), "password shown: {error}");
        }
    }
}
