//! Settings of `mooncake_client`: flags, their environment fallbacks and defaults, and
//! validation.

use std::time::Duration;

use mooncake_core::flags::{self, FlagError, FlagKind, FlagSpec, ParsedFlags};
use mooncake_core::master::MasterConfig;
use mooncake_core::protocol::address::{DEFAULT_REAL_CLIENT_PORT, SocketAddress};

/// Every flag `mooncake_client` accepts.
pub static FLAGS: &[FlagSpec] = &[
    FlagSpec {
        name: "host",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_LOCAL_HOSTNAME"),
        default: Some("0.0.0.0"),
        help: "address other nodes use to reach this one; also names the global segment",
    },
    FlagSpec {
        name: "port",
        kind: FlagKind::Value,
        env: None,
        default: Some("50052"),
        help: "instance port; dummies find the socket @mooncake_client_<port>.sock",
    },
    FlagSpec {
        name: "socket_path",
        kind: FlagKind::Value,
        env: None,
        default: None,
        help: "serve dummies on this socket file (mode 0600) instead of the abstract socket",
    },
    FlagSpec {
        name: "allowed_uids",
        kind: FlagKind::Value,
        env: None,
        default: None,
        help: "comma-separated uids allowed to attach besides our own",
    },
    FlagSpec {
        name: "master_server_address",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_MASTER"),
        default: Some("embedded"),
        help: "master address; `embedded` runs the master in-process",
    },
    FlagSpec {
        name: "embedded_master_port",
        kind: FlagKind::Value,
        env: None,
        default: Some("50051"),
        help: "with the embedded master: also serve it on 127.0.0.1:<port> for other local processes (0: do not)",
    },
    FlagSpec {
        name: "transfer_port",
        kind: FlagKind::Value,
        env: None,
        default: Some("0"),
        help: "TCP port of the transfer engine that peers read from and write to (0: any free port)",
    },
    FlagSpec {
        name: "enable_http_server",
        kind: FlagKind::Bool,
        env: Some("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER"),
        default: Some("false"),
        help: "serve /health, /metrics (Prometheus) and /status (JSON) over HTTP",
    },
    FlagSpec {
        name: "http_port",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_CLIENT_HTTP_PORT"),
        default: Some("9300"),
        help: "port of the HTTP server (--enable_http_server)",
    },
    FlagSpec {
        name: "metadata_server",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_TE_META_DATA_SERVER"),
        default: Some("P2PHANDSHAKE"),
        help: "accepted for compatibility; placement metadata travels through the master",
    },
    FlagSpec {
        name: "protocol",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_PROTOCOL"),
        default: Some("tcp"),
        help: "transfer protocol: tcp",
    },
    FlagSpec {
        name: "device_names",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_DEVICE"),
        default: Some(""),
        help: "RDMA devices (rdma protocol only)",
    },
    FlagSpec {
        name: "global_segment_size",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_GLOBAL_SEGMENT_SIZE"),
        default: Some("4 GB"),
        help: "memory this node contributes to the pool (e.g. 4GB, 512MB)",
    },
    FlagSpec {
        name: "local_buffer_size",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_LOCAL_BUFFER_SIZE"),
        default: Some("16 MB"),
        help: "staging memory of the real client itself",
    },
    FlagSpec {
        name: "max_dummy_shm_size",
        kind: FlagKind::Value,
        env: None,
        default: Some("1 TB"),
        help: "most shared memory one dummy may register",
    },
    FlagSpec {
        name: "default_kv_lease_ttl",
        kind: FlagKind::Value,
        env: None,
        default: Some("10000"),
        help: "read lease in ms (or with a unit: 10s, 500ms)",
    },
    FlagSpec {
        name: "threads",
        kind: FlagKind::Value,
        env: None,
        default: Some("0"),
        help: "worker threads; 0 means one per core",
    },
    FlagSpec {
        name: "tenant_id",
        kind: FlagKind::Value,
        env: Some("MOONCAKE_TENANT_ID"),
        default: Some("default"),
        help: "tenant whose key space this node serves (1-64 of A-Z a-z 0-9 _ - .); other tenants' keys are invisible",
    },
    FlagSpec {
        name: "offload_path",
        kind: FlagKind::Value,
        env: None,
        default: None,
        help: "SSD tier directory; overrides MOONCAKE_OFFLOAD_FILE_STORAGE_PATH",
    },
    FlagSpec {
        name: "enable_offload",
        kind: FlagKind::Bool,
        env: Some("MOONCAKE_OFFLOAD_ENABLED"),
        default: Some("false"),
        help: "enable the SSD tier (settings: MOONCAKE_OFFLOAD_*)",
    },
    FlagSpec {
        name: "offload_on_evict",
        kind: FlagKind::Bool,
        env: None,
        default: Some("false"),
        help: "with --enable_offload and the embedded master: write objects to the SSD tier when they are chosen for eviction, not when written",
    },
    FlagSpec {
        name: "log_level",
        kind: FlagKind::Value,
        env: None,
        default: Some("info"),
        help: "error, warn, info, debug or trace (RUST_LOG overrides)",
    },
];

/// Validated settings of a real client.
#[derive(Clone, Debug)]
pub struct RealClientConfig {
    /// Host name other nodes use; the segment is named `host:port`.
    pub host: String,
    /// Instance port.
    pub port: u16,
    /// Where dummies connect; `None` serves only in-process dummies (embedded mode).
    pub socket: Option<SocketAddress>,
    /// Uids allowed besides our own.
    pub allowed_uids: Vec<u32>,
    /// Size of the global segment in bytes.
    pub global_segment_size: u64,
    /// Most shared memory one dummy may register.
    pub max_dummy_shm_size: u64,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Tenant id.
    pub tenant_id: String,
    /// Address of a standalone master (`host:port`); `None` runs the master in-process.
    pub master_address: Option<String>,
    /// Loopback port on which the embedded master is also served (0: not served).
    pub embedded_master_port: u16,
    /// Port of the transfer engine (0: any free port).
    pub transfer_port: u16,
    /// Port of the HTTP server for /health, /metrics and /status (`None`: off).
    pub http_port: Option<u16>,
    /// Settings of the embedded master.
    pub master: MasterConfig,
    /// The SSD tier's settings (`--enable_offload`, then `MOONCAKE_OFFLOAD_*`).
    pub offload: Option<mooncake_offload::config::OffloadConfig>,
    /// Log filter.
    pub log_level: String,
}

/// Why the configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A flag or value did not parse.
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// A value parsed but is not acceptable.
    #[error("invalid --{flag}: {reason}")]
    Invalid {
        /// Flag name.
        flag: &'static str,
        /// Why.
        reason: String,
    },
}

fn invalid(flag: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        flag,
        reason: reason.into(),
    }
}

impl RealClientConfig {
    /// Parses command-line arguments (without the program name) and the environment.
    pub fn from_args(args: impl IntoIterator<Item = String>) -> Result<Self, ConfigError> {
        let parsed = flags::parse(
            FLAGS,
            "mooncake_client",
            "the mooncake-rs real client: serves dummy clients and owns this node's segment",
            args,
            |var| std::env::var(var).ok(),
        )?;
        Self::from_flags(&parsed)
    }

    /// Builds and validates the settings from parsed flags.
    pub fn from_flags(flags: &ParsedFlags) -> Result<Self, ConfigError> {
        let port: u16 = flags.number("port")?.unwrap_or(DEFAULT_REAL_CLIENT_PORT);
        if port == 0 {
            return Err(invalid("port", "must be between 1 and 65535"));
        }
        let socket = match flags.string("socket_path") {
            Some(path) => SocketAddress::parse(&format!("unix:{path}"))
                .map_err(|e| invalid("socket_path", e.to_string()))?,
            None => SocketAddress::for_port(port),
        };
        let socket = Some(socket);
        let global_segment_size = flags.size("global_segment_size")?.unwrap_or(0);
        if global_segment_size == 0 {
            return Err(invalid(
                "global_segment_size",
                "must be larger than zero (e.g. 4GB)",
            ));
        }
        let master_address =
            parse_master_address(&flags.string("master_server_address").unwrap_or_default())?;
        let protocol = flags.string("protocol").unwrap_or_default();
        if protocol != "tcp" {
            return Err(invalid(
                "protocol",
                format!("{protocol:?}: only tcp is available in this build"),
            ));
        }
        let offload = if flags.bool("enable_offload")? {
            let mut settings = mooncake_offload::config::OffloadConfig::from_env()
                .map_err(|error| invalid("enable_offload", error.to_string()))?;
            if let Some(path) = flags.string("offload_path") {
                settings.path = path.into();
            }
            if settings.backend != mooncake_offload::config::BackendKind::DistributedKv {
                mooncake_offload::config::validate_path(&settings.path)
                    .map_err(|error| invalid("enable_offload", error.to_string()))?;
            }
            Some(settings)
        } else {
            None
        };
        let lease = flags
            .duration("default_kv_lease_ttl", true)?
            .unwrap_or(Duration::from_secs(10));
        if lease.is_zero() {
            return Err(invalid("default_kv_lease_ttl", "must be larger than zero"));
        }
        let log_level = flags.string("log_level").unwrap_or_else(|| "info".into());
        if !flags::is_log_filter(&log_level) {
            return Err(invalid(
                "log_level",
                format!(
                    "{log_level:?}: use error, warn, info, debug or trace (or a RUST_LOG-style filter such as info,mooncake_real_client=debug)"
                ),
            ));
        }
        let allowed_uids = parse_uids(flags.string("allowed_uids").as_deref().unwrap_or(""))?;
        // The value is validated here but the engine is loaded lazily by later tiers.
        let _local_buffer = flags.size("local_buffer_size")?;
        Ok(RealClientConfig {
            host: flags.string("host").unwrap_or_else(|| "0.0.0.0".into()),
            port,
            socket,
            allowed_uids,
            global_segment_size,
            max_dummy_shm_size: flags.size("max_dummy_shm_size")?.unwrap_or(u64::MAX),
            threads: flags.number("threads")?.unwrap_or(0),
            tenant_id: tenant_flag(flags)?,
            master_address,
            embedded_master_port: flags.number("embedded_master_port")?.unwrap_or(0),
            transfer_port: flags.number("transfer_port")?.unwrap_or(0),
            http_port: if flags.bool("enable_http_server")? {
                Some(flags.number("http_port")?.unwrap_or(9300))
            } else {
                None
            },
            master: MasterConfig {
                default_kv_lease_ttl: lease,
                enable_offload: offload.is_some(),
                offload_on_evict: flags.bool("offload_on_evict")?,
                ..MasterConfig::default()
            },
            offload,
            log_level,
        })
    }

    /// The name of this node's global segment.
    pub fn segment_name(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }

    /// The host peers use to reach this node: `--host`, or loopback when `--host` is
    /// the wildcard address (set `--host` on a real cluster).
    pub fn advertised_host(&self) -> String {
        match self.host.as_str() {
            "0.0.0.0" | "::" | "" => "127.0.0.1".to_string(),
            host => host.to_string(),
        }
    }

    /// Where the transfer engine listens.
    pub fn transfer_bind(&self) -> std::net::SocketAddr {
        let ip: std::net::IpAddr = self
            .host
            .parse()
            .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        std::net::SocketAddr::new(ip, self.transfer_port)
    }
}

/// `None` for the embedded master, else a checked `host:port`.
fn parse_master_address(text: &str) -> Result<Option<String>, ConfigError> {
    let text = text.trim();
    if text.is_empty() || text == "embedded" {
        return Ok(None);
    }
    if text.starts_with("etcd://") {
        return Err(invalid(
            "master_server_address",
            format!(
                "{text:?}: high availability through etcd is not available in this build; give the master's host:port"
            ),
        ));
    }
    match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
            Ok(Some(text.to_string()))
        }
        _ => Err(invalid(
            "master_server_address",
            format!("{text:?}: expected host:port (e.g. 10.0.0.1:50051) or embedded"),
        )),
    }
}

fn parse_uids(text: &str) -> Result<Vec<u32>, ConfigError> {
    text.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            t.parse::<u32>()
                .map_err(|_| invalid("allowed_uids", format!("{t:?} is not a numeric uid")))
        })
        .collect()
}

fn tenant_flag(flags: &ParsedFlags) -> Result<String, ConfigError> {
    let name = flags
        .string("tenant_id")
        .unwrap_or_else(|| mooncake_core::tenant::DEFAULT_TENANT.into());
    mooncake_core::tenant::Tenant::new(&name).map_err(|reason| invalid("tenant_id", reason))?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Result<RealClientConfig, ConfigError> {
        let parsed = flags::parse(FLAGS, "t", "t", args.iter().map(|s| s.to_string()), |_| {
            None
        })?;
        RealClientConfig::from_flags(&parsed)
    }

    #[test]
    fn documented_defaults() {
        let config = config(&[]).expect("defaults are valid");
        assert_eq!(config.port, 50052);
        assert_eq!(config.global_segment_size, 4 << 30);
        assert_eq!(
            config.socket,
            Some(SocketAddress::Abstract(
                "@mooncake_client_50052.sock".into()
            ))
        );
        assert_eq!(config.master.default_kv_lease_ttl, Duration::from_secs(10));
        assert_eq!(config.host, "0.0.0.0");
        assert!(config.allowed_uids.is_empty());
    }

    #[test]
    fn rejects_bad_values() {
        for args in [
            &["--global_segment_size=lots"][..],
            &["--global_segment_size=0"],
            &["--port=0"],
            &["--allowed_uids=root"],
            &["--default_kv_lease_ttl=0"],
            &["--master_server_address=10.0.0.1"],
            &["--master_server_address=etcd://a:2379"],
            &["--log_level=infoo"],
        ] {
            assert!(config(args).is_err(), "{args:?}");
        }
        let config =
            config(&["--socket_path=/tmp/x.sock", "--allowed-uids", "1,2"]).expect("valid");
        assert_eq!(
            config.socket,
            Some(SocketAddress::Path("/tmp/x.sock".into()))
        );
        assert_eq!(config.allowed_uids, vec![1, 2]);
    }
}
