//! Settings of `mooncake_client`: flags, their environment fallbacks and defaults, and
//! validation.

use std::sync::Arc;
use std::time::Duration;

use mooncake_core::config_file;
use mooncake_core::flags::{
    self, ARENA_FLAGS, Accepts, Compat, FlagError, FlagSpec, GFLAGS, ParsedFlags, Program,
};
use mooncake_core::keep_awake::{self, KEEP_AWAKE_FLAGS};
use mooncake_core::logging::{LOG_FLAGS, LogError, LogSettings};
use mooncake_core::protocol::address::{DEFAULT_REAL_CLIENT_PORT, SocketAddress};
use mooncake_core::protocol::auth::{self, AUTH_FLAGS, ClusterSecret};
use mooncake_master::MasterConfig;

use crate::protocol_choice::Chosen;

/// The real client's own flags.
pub static CLIENT_FLAGS: &[FlagSpec] = &[
    FlagSpec::value("host", Some("0.0.0.0"), "address other nodes use to reach this one; also names the global segment")
        .env("MOONCAKE_LOCAL_HOSTNAME")
        .compat(Compat::Differs("an IP address or host name; upstream's host:port form is refused (use --transfer_port)")),
    FlagSpec::value("port", Some("50052"), "instance port; dummies find the socket @mooncake_client_<port>.sock")
        .compat(Compat::Differs("names the Unix socket dummies connect to; TCP 127.0.0.1:<port> answers readiness probes only (--readiness_port)")),
    FlagSpec::value("socket_path", None, "serve dummies on this socket file (mode 0600) instead of the abstract socket").ours(),
    FlagSpec::value("allowed_uids", None, "comma-separated uids allowed to attach besides our own").ours(),
    FlagSpec::value("master_server_address", Some("embedded"), "master address host:port, or etcd://host:port[,host:port...] to follow the leader of highly available masters; `embedded` runs the master in-process")
        .env("MOONCAKE_MASTER")
        .compat(Compat::Differs("default embedded (upstream: 127.0.0.1:50051)")),
    FlagSpec::value("cluster_id", Some("mooncake_cluster"), "with an etcd:// master address: the cluster whose leader to follow (the masters' --cluster_id)")
        .env("MC_STORE_CLUSTER_ID")
        .ours(),
    FlagSpec::value("embedded_master_port", Some("50051"), "with the embedded master: also serve it on 127.0.0.1:<port> for other local processes (0: do not)").ours(),
    FlagSpec::value("readiness_port", None, "TCP port on 127.0.0.1 that answers readiness probes (HTTP GET /health, or a bare connect) and nothing else (default: --port; 0: off)")
        .env("MOONCAKE_CLIENT_READINESS_PORT")
        .ours(),
    FlagSpec::value("metrics_port", None, "with the embedded master: serve its HTTP endpoints (/health, /get_all_segments, /query_key, /get_all_keys, /metrics, /metrics/summary) on 127.0.0.1:<port>, as mooncake_master does (default: off)")
        .ours(),
    FlagSpec::boolean("enable_http_metadata_server", false, "with the embedded master: serve upstream's HTTP metadata store (/metadata) on 127.0.0.1:--http_metadata_server_port, as mooncake_master does")
        .ours(),
    FlagSpec::value("http_metadata_server_port", Some("8080"), "port of the HTTP metadata store (--enable_http_metadata_server)").ours(),
    FlagSpec::value("transfer_port", Some("0"), "TCP port of the transfer engine that peers read from and write to (0: any free port)").ours(),
    FlagSpec::value("transfer_tcp_congestion", Some(crate::transfer::tuning::DEFAULT_CONGESTION), "TCP congestion control of transfer connections (`system`: the machine's default)")
        .env("MOONCAKE_TRANSFER_TCP_CONGESTION")
        .ours(),
    FlagSpec::boolean("enable_http_server", false, "serve /health, /metrics (Prometheus) and /status (JSON) over HTTP")
        .env("MOONCAKE_ENABLE_CLIENT_HTTP_SERVER"),
    FlagSpec::value("http_port", Some("9300"), "port of the HTTP server (--enable_http_server)").env("MOONCAKE_CLIENT_HTTP_PORT"),
    FlagSpec::value("http_host", Some("127.0.0.1"), "address the HTTP server listens on (0.0.0.0: every interface)")
        .env("MOONCAKE_CLIENT_HTTP_HOST")
        .ours(),
    FlagSpec::value("metadata_server", Some("http://127.0.0.1:8080/metadata"), "transfer-engine metadata server")
        .env("MOONCAKE_TE_META_DATA_SERVER")
        .compat(Compat::NoEffect("segment and endpoint metadata travel through the master, as with P2PHANDSHAKE", Accepts::Any)),
    FlagSpec::value("protocol", Some("tcp"), "transfer protocol: tcp, rdma, or auto (RDMA where a usable device exists, else TCP)")
        .env("MOONCAKE_PROTOCOL")
        .compat(Compat::Differs("tcp and rdma as upstream, and auto (ours)")),
    FlagSpec::value("device_names", Some(""), "RDMA devices to use, comma separated (empty: those on this process's NUMA node, else all)")
        .env("MOONCAKE_DEVICE"),
    FlagSpec::value("global_segment_size", Some("4 GB"), "memory this node contributes to the pool (e.g. 4GB, 512MB)")
        .env("MOONCAKE_GLOBAL_SEGMENT_SIZE"),
    FlagSpec::value("local_buffer_size", Some("0"), "staging memory of the real client itself")
        .env("MOONCAKE_LOCAL_BUFFER_SIZE")
        .compat(Compat::NoEffect(
            "the real client stages through its global segment and the dummies' own buffers; the size is validated and logged",
            Accepts::Any,
        )),
    FlagSpec::boolean("start_offload_rpc_server", true, "serve SSD-tier reads to other nodes")
        .compat(Compat::NoEffect(
            "SSD-tier reads are always served through the transfer engine",
            Accepts::Only(&["true"]),
        )),
    FlagSpec::value("max_dummy_shm_size", None, "most shared memory one dummy may register (default: physical memory)").ours(),
    FlagSpec::value("max_total_dummy_shm_size", None, "most shared memory all dummies together may register (default: physical memory)").ours(),
    FlagSpec::value("max_dummy_sessions", Some("1024"), "most dummies attached at once").ours(),
    FlagSpec::value("max_hard_pinned_bytes_per_dummy", None, "most bytes of hard-pinned objects one dummy may hold (default: --global_segment_size, or physical memory for a pure client)").ours(),
    FlagSpec::value("max_read_leased_bytes_per_dummy", None, "most bytes of objects one dummy may hold read leases on; its further reads wait for its oldest leases to lapse (default: half of --global_segment_size, or of physical memory for a pure client)").ours(),
    FlagSpec::value("default_kv_lease_ttl", Some("10000"), "read lease of the embedded master in ms (or 10s, 500ms)").ours(),
    FlagSpec::value("client_spin_us", Some("0"), "embedded mode: microseconds a call to a remote master polls for its answer before the calling thread sleeps (0: at once; at most 1000)")
        .env("MOONCAKE_CLIENT_SPIN_US")
        .ours(),
    FlagSpec::value("read_cache_ms", Some("1000"), "how long a read of an object in this node's segment reuses the replica list of an earlier read (at most half the read lease; 0: always ask the master)")
        .env("MOONCAKE_READ_CACHE_MS")
        .ours(),
    FlagSpec::value("threads", Some("0"), "worker threads; 0 means one per core")
        .compat(Compat::Differs("threads of the async runtime; default 0 = one per core (upstream: 1)")),
    FlagSpec::value("tenant_id", Some("default"), "tenant whose key space this node serves (1-64 of A-Z a-z 0-9 _ - .)")
        .env("MOONCAKE_TENANT_ID"),
    FlagSpec::value("offload_path", None, "SSD tier directory; overrides MOONCAKE_OFFLOAD_FILE_STORAGE_PATH").ours(),
    FlagSpec::boolean("enable_offload", false, "enable the SSD tier (settings: MOONCAKE_OFFLOAD_*)").env("MOONCAKE_OFFLOAD_ENABLED"),
    FlagSpec::boolean("takeover", false, "take over the mooncake_client serving the same --port (planned handover: the new process keeps the segment, its objects and the sockets; see docs/deployment.md)").ours(),
    FlagSpec::value("segment_path", None, "keep the segment in this file (on tmpfs such as /dev/shm, or hugetlbfs), so that a mooncake_client restarted after a crash serves its objects again (see docs/deployment.md)").env("MOONCAKE_SEGMENT_PATH").ours(),
    FlagSpec::boolean("offload_on_evict", false, "with --enable_offload and the embedded master: write objects to the SSD tier when they are chosen for eviction, not when written").ours(),
];

/// Every flag `mooncake_client` accepts.
pub static FLAGS: &[&[FlagSpec]] = &[
    CLIENT_FLAGS,
    AUTH_FLAGS,
    mooncake_master::ha::etcd_tls::ETCD_TLS_FLAGS,
    LOG_FLAGS,
    KEEP_AWAKE_FLAGS,
    ARENA_FLAGS,
    GFLAGS,
];

/// `mooncake_client` for the flag parser.
pub static PROGRAM: Program = Program {
    name: "mooncake_client",
    about: "the mooncake-rs real client: serves dummy clients and owns this node's segment",
    table: FLAGS,
};

/// Keys of upstream's `MOONCAKE_CONFIG_PATH` JSON (Python `MooncakeConfig`, and the
/// `setup(dict)` names) that differ from the flag names.
pub const CONFIG_FILE_ALIASES: &[(&str, &str)] = &[
    ("local_hostname", "host"),
    ("device_name", "device_names"),
    ("rdma_devices", "device_names"),
    ("master_server_addr", "master_server_address"),
    ("enable_ssd_offload", "enable_offload"),
    ("ssd_offload_path", "offload_path"),
    ("enable_client_http_server", "enable_http_server"),
    ("client_http_port", "http_port"),
];

/// The variable naming the JSON configuration file.
pub const CONFIG_PATH_VAR: &str = "MOONCAKE_CONFIG_PATH";

/// Validated settings of a real client.
#[derive(Clone, Debug)]
pub struct RealClientConfig {
    /// Host name other nodes use; the segment is named `host:port`.
    pub host: String,
    /// The transport of this node's bytes (RDMA devices, or TCP) and why (see
    /// [`crate::protocol_choice`]).
    pub transport: Chosen,
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
    /// Most shared memory all dummies together may register.
    pub max_total_dummy_shm_size: u64,
    /// Most dummies attached at once.
    pub max_dummy_sessions: usize,
    /// Most bytes of hard-pinned objects one dummy may hold (`None`: see
    /// [`hard_pin_quota`](Self::hard_pin_quota)).
    pub max_hard_pinned_bytes_per_dummy: Option<u64>,
    /// Most bytes of objects one dummy may hold read leases on (`None`: see
    /// [`read_lease_quota`](Self::read_lease_quota)).
    pub max_read_leased_bytes_per_dummy: Option<u64>,
    /// How long a read of an object in this node's segment reuses the replica list of an
    /// earlier read (`--read_cache_ms`; zero: never; see [`crate::read_cache`]).
    pub read_cache: Duration,
    /// How long a call of an application's thread to a remote master polls for its
    /// answer before the thread sleeps (`--client_spin_us`; zero: at once).
    pub caller_spin: Duration,
    /// How long this node's cores are kept awake after each request
    /// (`--keep_awake_us`; see [`mooncake_core::keep_awake`]). Zero in embedded mode,
    /// which keeps no core of the application's awake.
    pub keep_awake: Duration,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Tenant id.
    pub tenant_id: String,
    /// Address of a standalone master (`host:port`, or `etcd://` endpoints to follow the
    /// leader of highly available masters); `None` runs the master in-process.
    pub master_address: Option<String>,
    /// The cluster whose leader an `etcd://` master address follows.
    pub cluster_id: String,
    /// TLS for the connection to etcd of an `etcd://` master address.
    pub etcd_tls: Option<mooncake_master::ha::etcd_tls::EtcdTls>,
    /// Loopback port on which the embedded master is also served (0: not served).
    pub embedded_master_port: u16,
    /// Loopback port of the readiness listener (0: none; see [`crate::readiness`]).
    pub readiness_port: u16,
    /// Whether `--readiness_port` was given: then a busy port stops startup (the
    /// default port, when busy, is only warned about).
    pub readiness_port_asked: bool,
    /// `--takeover`: take over the real client serving the same socket instead of
    /// starting anew ([`crate::handover`]).
    pub takeover: bool,
    /// `--segment_path`: the file that holds the segment and its journal, so that a
    /// restarted process finds its objects again ([`crate::segment_file`]).
    pub segment_path: Option<std::path::PathBuf>,
    /// Loopback port on which the embedded master's HTTP endpoints are served
    /// (`--metrics_port`; `None`: not served).
    pub master_http_port: Option<u16>,
    /// Loopback port of the embedded master's HTTP metadata store
    /// (`--enable_http_metadata_server`; `None`: not served).
    pub metadata_http_port: Option<u16>,
    /// Port of the transfer engine (0: any free port).
    pub transfer_port: u16,
    /// TCP congestion control of transfer connections.
    pub transfer_congestion: crate::transfer::Congestion,
    /// Port of the HTTP server for /health, /metrics and /status (`None`: off).
    pub http_port: Option<u16>,
    /// Address the HTTP server listens on (loopback unless widened).
    pub http_host: std::net::IpAddr,
    /// Settings of the embedded master.
    pub master: MasterConfig,
    /// The SSD tier's settings (`--enable_offload`, then `MOONCAKE_OFFLOAD_*`).
    pub offload: Option<mooncake_offload::config::OffloadConfig>,
    /// Staging memory asked for with `--local_buffer_size` (validated, not used).
    pub local_buffer_size: u64,
    /// The log filter (`log.filter`), for callers that only install a stderr logger.
    pub log_level: String,
    /// Logging: the filter plus upstream's glog flags (log file, stderr threshold).
    pub log: LogSettings,
    /// Upstream flags accepted without effect, for the startup log.
    pub compat_notes: Vec<String>,
    /// The cluster secret of `--cluster_secret_file` (`None`: see
    /// [`RealClient::start`](crate::RealClient::start) for what is used instead).
    pub cluster_secret: Option<Arc<ClusterSecret>>,
}

/// Why the configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A flag or value did not parse.
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// A logging flag was rejected.
    #[error(transparent)]
    Log(#[from] LogError),
    /// The `MOONCAKE_CONFIG_PATH` file is unreadable.
    #[error("{CONFIG_PATH_VAR}: {0}")]
    File(#[from] config_file::ConfigFileError),
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

/// What an application that runs a real client in its own process (the Python
/// `setup()`) sets itself; see [`RealClientConfig::embedded`].
#[derive(Clone, Debug, Default)]
pub struct EmbeddedOptions {
    /// Host part of the segment name (and the address peers reach).
    pub host: String,
    /// Port part of the segment name.
    pub port: u16,
    /// Memory this process contributes to the pool (0: a pure client of a cluster).
    pub global_segment_size: u64,
    /// `host:port` of a cluster's master; empty or `embedded` for a master in this
    /// process.
    pub master_address: String,
    /// Transfer protocol: `tcp`, `rdma` or `auto`.
    pub protocol: String,
    /// RDMA devices (comma separated; empty: those nearest this process).
    pub rdma_devices: String,
    /// Tenant whose key space the process uses (`None`: the environment's or the
    /// default).
    pub tenant_id: Option<String>,
    /// Whether the SSD tier is on.
    pub enable_offload: bool,
    /// The SSD tier's directory (`None`: `MOONCAKE_OFFLOAD_FILE_STORAGE_PATH`).
    pub offload_path: Option<String>,
    /// Port of the HTTP status server (`None`: not served).
    pub http_port: Option<u16>,
}

impl RealClientConfig {
    /// Parses command-line arguments (without the program name) and the environment
    /// (no configuration file: for embedders that pass every setting).
    pub fn from_args(args: impl IntoIterator<Item = String>) -> Result<Self, ConfigError> {
        Self::from_flags(&flags::parse(&PROGRAM, args, |var| {
            std::env::var(var).ok()
        })?)
    }

    /// What the `mooncake_client` command reads: the command line, the environment and
    /// the JSON file named by `MOONCAKE_CONFIG_PATH` (upstream's keys): flag >
    /// environment variable > file > default.
    pub fn from_command_line(args: impl IntoIterator<Item = String>) -> Result<Self, ConfigError> {
        let mut parsed = flags::parse(&PROGRAM, args, |var| std::env::var(var).ok())?;
        if let Some(path) = std::env::var_os(CONFIG_PATH_VAR).filter(|p| !p.is_empty()) {
            let values = config_file::read(std::path::Path::new(&path))?;
            parsed.merge_file(values, CONFIG_FILE_ALIASES)?;
        }
        Self::from_flags(&parsed)
    }

    /// Builds and validates the settings from parsed flags.
    pub fn from_flags(flags: &ParsedFlags) -> Result<Self, ConfigError> {
        let port = checked_port(flags.number("port")?.unwrap_or(DEFAULT_REAL_CLIENT_PORT))?;
        let socket = match flags.string("socket_path") {
            Some(path) => SocketAddress::parse(&format!("unix:{path}"))
                .map_err(|e| invalid("socket_path", e.to_string()))?,
            None => SocketAddress::for_port(port),
        };
        let socket = Some(socket);
        // 0 is a pure client: it contributes no memory and stores on other nodes.
        let global_segment_size = flags.size("global_segment_size")?.unwrap_or(0);
        let master_address =
            parse_master_address(&flags.string("master_server_address").unwrap_or_default())?;
        check_pure_client(global_segment_size, master_address.as_deref())?;
        let segment_path = segment_path(flags, global_segment_size)?;
        let master_http_port = embedded_only(
            flags.number::<u16>("metrics_port")?,
            "metrics_port",
            master_address.as_deref(),
        )?;
        let metadata_http_port = embedded_only(
            flags
                .bool("enable_http_metadata_server")?
                .then(|| flags.number::<u16>("http_metadata_server_port"))
                .transpose()?
                .map(|port| port.unwrap_or(8080)),
            "enable_http_metadata_server",
            master_address.as_deref(),
        )?;
        let transport = check_protocol(
            &flags.string("protocol").unwrap_or_default(),
            &flags.string("device_names").unwrap_or_default(),
        )?;
        let offload = offload_settings(
            flags.bool("enable_offload")?,
            flags.string("offload_path").as_deref(),
        )?;
        let lease = flags
            .duration("default_kv_lease_ttl", true)?
            .unwrap_or(Duration::from_secs(10));
        if lease.is_zero() || lease > mooncake_master::MAX_LEASE_TTL {
            return Err(invalid(
                "default_kv_lease_ttl",
                "must be larger than zero and at most 4294967 ms (71 minutes)",
            ));
        }
        let allowed_uids = parse_uids(flags.string("allowed_uids").as_deref().unwrap_or(""))?;
        let local_buffer_size = flags.size("local_buffer_size")?.unwrap_or(0);
        let log = LogSettings::from_flags(PROGRAM.name, flags)?;
        Ok(RealClientConfig {
            host: checked_host(flags.string("host").unwrap_or_else(|| "0.0.0.0".into()))?,
            transport,
            port,
            socket,
            allowed_uids,
            global_segment_size,
            max_dummy_shm_size: flags
                .size("max_dummy_shm_size")?
                .unwrap_or_else(physical_memory),
            max_total_dummy_shm_size: flags
                .size("max_total_dummy_shm_size")?
                .unwrap_or_else(physical_memory),
            max_dummy_sessions: flags
                .number("max_dummy_sessions")?
                .unwrap_or(DEFAULT_MAX_DUMMY_SESSIONS),
            max_hard_pinned_bytes_per_dummy: flags.size("max_hard_pinned_bytes_per_dummy")?,
            max_read_leased_bytes_per_dummy: flags.size("max_read_leased_bytes_per_dummy")?,
            read_cache: flags
                .duration("read_cache_ms", true)?
                .unwrap_or(crate::read_cache::DEFAULT_READ_CACHE),
            caller_spin: mooncake_core::spin::parse_spin(flags.string("client_spin_us").as_deref())
                .map_err(|error| invalid("client_spin_us", error.to_string()))?,
            keep_awake: keep_awake::window_from_flags(flags)?,
            threads: flags.number("threads")?.unwrap_or(0),
            tenant_id: tenant_flag(flags)?,
            master_address,
            cluster_id: flags
                .string("cluster_id")
                .unwrap_or_else(|| "mooncake_cluster".into()),
            etcd_tls: mooncake_master::ha::etcd_tls::EtcdTls::from_flags(flags)
                .map_err(|error| invalid("etcd_ca_file", error.to_string()))?,
            embedded_master_port: flags.number("embedded_master_port")?.unwrap_or(0),
            readiness_port: match flags.number::<u16>("readiness_port")? {
                Some(asked) => asked,
                None => port,
            },
            readiness_port_asked: flags.number::<u16>("readiness_port")?.is_some(),
            takeover: flags.bool("takeover")?,
            segment_path,
            master_http_port,
            metadata_http_port,
            transfer_port: flags.number("transfer_port")?.unwrap_or(0),
            transfer_congestion: transfer_congestion(flags)?,
            http_host: match flags.string("http_host") {
                Some(host) => host.parse().map_err(|_| {
                    invalid(
                        "http_host",
                        format!("{host:?} is not an IP address (e.g. 127.0.0.1 or 0.0.0.0)"),
                    )
                })?,
                None => std::net::IpAddr::from([127, 0, 0, 1]),
            },
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
            local_buffer_size,
            log_level: log.filter.clone(),
            log,
            compat_notes: flags.compat_notes(),
            cluster_secret: ClusterSecret::from_flags(flags)
                .map_err(|error| invalid("cluster_secret_file", error.to_string()))?
                .map(Arc::new),
        })
    }

    /// The settings of a real client inside an application's process (the Python
    /// `setup()`): what `options` gives, typed, over the environment and the defaults as
    /// `mooncake_client` reads them. Such a real client neither serves its master to
    /// other processes nor listens for dummies.
    pub fn embedded(options: EmbeddedOptions) -> Result<Self, ConfigError> {
        let environment = flags::parse(&PROGRAM, Vec::<String>::new(), |var| {
            std::env::var(var).ok()
        })?;
        let mut config = Self::from_flags(&environment)?;
        config.host = checked_host(options.host)?;
        config.port = checked_port(options.port)?;
        config.socket = None;
        config.embedded_master_port = 0;
        // An application's in-process client opens no port of its own.
        config.readiness_port = 0;
        config.master_http_port = None;
        config.metadata_http_port = None;
        config.keep_awake = Duration::ZERO;
        // An application's restart is not a node's: its segment is not kept.
        config.segment_path = None;
        config.global_segment_size = options.global_segment_size;
        config.master_address = parse_master_address(&options.master_address)?;
        check_pure_client(config.global_segment_size, config.master_address.as_deref())?;
        config.transport = check_protocol(&options.protocol, &options.rdma_devices)?;
        if let Some(tenant) = options.tenant_id {
            config.tenant_id = checked_tenant(tenant)?;
        }
        config.offload = offload_settings(options.enable_offload, options.offload_path.as_deref())?;
        config.master.enable_offload = config.offload.is_some();
        config.http_port = options.http_port;
        Ok(config)
    }

    /// Most bytes of hard-pinned objects one dummy may hold:
    /// `--max_hard_pinned_bytes_per_dummy`, else the segment size, else (a pure client)
    /// the machine's physical memory.
    pub fn hard_pin_quota(&self) -> u64 {
        match (
            self.max_hard_pinned_bytes_per_dummy,
            self.global_segment_size,
        ) {
            (Some(limit), _) => limit,
            (None, 0) => physical_memory(),
            (None, size) => size,
        }
    }

    /// Most bytes of objects one dummy may hold read leases on:
    /// `--max_read_leased_bytes_per_dummy`, else half the segment, else (a pure client)
    /// half the machine's physical memory.
    pub fn read_lease_quota(&self) -> u64 {
        match (
            self.max_read_leased_bytes_per_dummy,
            self.global_segment_size,
        ) {
            (Some(limit), _) => limit,
            (None, 0) => physical_memory() / 2,
            (None, size) => size / 2,
        }
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

    /// Where the transfer engine listens: the address this node advertises, never a
    /// wildcard. With the wildcard `--host` (the default) that is loopback, which serves
    /// a single node and a cluster whose master is on this machine's loopback; a
    /// cluster across machines needs `--host`. A host name binds the address it
    /// resolves to (loopback with the embedded master, which only local processes
    /// reach).
    pub fn transfer_bind(&self) -> Result<std::net::SocketAddr, ConfigError> {
        let ip = match self.host.as_str() {
            "0.0.0.0" | "::" | "" => {
                if let Some(master) = self
                    .master_address
                    .as_deref()
                    .filter(|m| auth::loopback_port(m).is_none())
                {
                    return Err(invalid(
                        "host",
                        format!(
                            "the wildcard {:?} names no address other nodes can reach, and the master {master} is not on this machine's loopback: give this node's address (--host=10.0.0.5 or MOONCAKE_LOCAL_HOSTNAME)",
                            self.host
                        ),
                    ));
                }
                std::net::IpAddr::from([127, 0, 0, 1])
            }
            host => match host.parse() {
                Ok(ip) => ip,
                // Only local processes reach the embedded master, and so this node.
                Err(_) if self.master_address.is_none() => std::net::IpAddr::from([127, 0, 0, 1]),
                Err(_) => resolve(host)?,
            },
        };
        Ok(std::net::SocketAddr::new(ip, self.transfer_port))
    }
}

/// The address a `--host` name resolves to (IPv4 first).
fn resolve(host: &str) -> Result<std::net::IpAddr, ConfigError> {
    let addresses: Vec<_> = std::net::ToSocketAddrs::to_socket_addrs(&(host, 0))
        .map_err(|error| invalid("host", format!("{host:?} does not resolve: {error}")))?
        .map(|a| a.ip())
        .collect();
    addresses
        .iter()
        .find(|ip| ip.is_ipv4())
        .or(addresses.first())
        .copied()
        .ok_or_else(|| invalid("host", format!("{host:?} resolves to no address")))
}

/// `None` for the embedded master, else a checked `host:port`.
fn parse_master_address(text: &str) -> Result<Option<String>, ConfigError> {
    let text = text.trim();
    if text.is_empty() || text == "embedded" {
        return Ok(None);
    }
    if let Some(endpoints) = text.strip_prefix("etcd://") {
        etcd_endpoints(endpoints).map_err(|reason| {
            invalid(
                "master_server_address",
                format!("{text:?}: {reason} (expected etcd://host:port[,host:port...])"),
            )
        })?;
        return Ok(Some(text.to_string()));
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

/// The etcd endpoints of an `etcd://` master address (without the scheme): `host:port`
/// items separated by `,` or `;`.
pub fn etcd_endpoints(list: &str) -> Result<Vec<String>, String> {
    let endpoints: Vec<String> = list
        .split([',', ';'])
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_string)
        .collect();
    if endpoints.is_empty() {
        return Err("no etcd endpoint".into());
    }
    for endpoint in &endpoints {
        match endpoint.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {}
            _ => return Err(format!("{endpoint:?} is not host:port")),
        }
    }
    Ok(endpoints)
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
    checked_tenant(
        flags
            .string("tenant_id")
            .unwrap_or_else(|| mooncake_core::tenant::DEFAULT_TENANT.into()),
    )
}

/// `name` when it is a valid tenant name.
fn checked_tenant(name: String) -> Result<String, ConfigError> {
    mooncake_core::tenant::Tenant::new(&name).map_err(|reason| invalid("tenant_id", reason))?;
    Ok(name)
}

/// `port` when it can name a real client (1 to 65535).
fn checked_port(port: u16) -> Result<u16, ConfigError> {
    if port == 0 {
        return Err(invalid("port", "must be between 1 and 65535"));
    }
    Ok(port)
}

/// `host` when it is a host, not upstream's `ip:port` form.
fn checked_host(host: String) -> Result<String, ConfigError> {
    if host.parse::<std::net::SocketAddr>().is_ok() {
        return Err(invalid(
            "host",
            "upstream's ip:port form is not accepted; give the address in --host and the port in --transfer_port",
        ));
    }
    Ok(host)
}

/// `port` for a server of the embedded master (`flag` asked for it); refused with a
/// remote master, whose own process serves its HTTP endpoints.
fn embedded_only(
    port: Option<u16>,
    flag: &'static str,
    master: Option<&str>,
) -> Result<Option<u16>, ConfigError> {
    match (port, master) {
        (Some(0), _) => Err(invalid(flag, "the port must be between 1 and 65535")),
        (Some(_), Some(master)) => Err(invalid(
            flag,
            format!(
                "serves the embedded master's HTTP endpoints, but the master is {master}: give the flag to that mooncake_master instead"
            ),
        )),
        _ => Ok(port),
    }
}

/// A pure client (no segment) needs a cluster's master to place its objects.
/// `--segment_path`, refused for a pure client (it has no segment to keep).
fn segment_path(
    flags: &ParsedFlags,
    global_segment_size: u64,
) -> Result<Option<std::path::PathBuf>, ConfigError> {
    let Some(path) = flags.string("segment_path").filter(|p| !p.is_empty()) else {
        return Ok(None);
    };
    if global_segment_size == 0 {
        return Err(invalid(
            "segment_path",
            "a pure client (--global_segment_size=0) has no segment to keep",
        ));
    }
    Ok(Some(path.into()))
}

fn check_pure_client(global_segment_size: u64, master: Option<&str>) -> Result<(), ConfigError> {
    if global_segment_size == 0 && master.is_none() {
        return Err(invalid(
            "global_segment_size",
            "0 (a pure client that contributes no memory) needs the master of a cluster (--master_server_address=host:port); with the embedded master give a size such as 4GB",
        ));
    }
    Ok(())
}

/// The transport for `--protocol` with the devices of `--rdma_devices`, and why;
/// `rdma` without a usable device is refused with what was looked for and the fix.
fn check_protocol(protocol: &str, devices: &str) -> Result<Chosen, ConfigError> {
    use crate::protocol_choice::{Protocol, choose, device_list, find_devices};
    let asked = Protocol::parse(protocol).map_err(|reason| invalid("protocol", reason))?;
    choose(asked, &device_list(devices), find_devices).map_err(|reason| invalid("protocol", reason))
}

/// The SSD tier's settings when `enabled`: `MOONCAKE_OFFLOAD_*`, with `path` (when
/// given) as its directory, which must be usable.
fn offload_settings(
    enabled: bool,
    path: Option<&str>,
) -> Result<Option<mooncake_offload::config::OffloadConfig>, ConfigError> {
    if !enabled {
        return Ok(None);
    }
    let mut settings = mooncake_offload::config::OffloadConfig::from_env()
        .map_err(|error| invalid("enable_offload", error.to_string()))?;
    if let Some(path) = path.filter(|path| !path.is_empty()) {
        settings.path = path.into();
    }
    if settings.backend != mooncake_offload::config::BackendKind::DistributedKv {
        mooncake_offload::config::validate_path(&settings.path)
            .map_err(|error| invalid("enable_offload", error.to_string()))?;
    }
    Ok(Some(settings))
}

fn transfer_congestion(flags: &ParsedFlags) -> Result<crate::transfer::Congestion, ConfigError> {
    let name = flags
        .string("transfer_tcp_congestion")
        .unwrap_or_else(|| crate::transfer::tuning::DEFAULT_CONGESTION.into());
    crate::transfer::Congestion::parse(&name)
        .map_err(|reason| invalid("transfer_tcp_congestion", reason))
}

/// Most dummies attached at once unless `--max_dummy_sessions` says otherwise.
pub const DEFAULT_MAX_DUMMY_SESSIONS: usize = 1024;

/// This machine's physical memory in bytes (`MemTotal`), the default limit of shared
/// memory dummies may register; 1 TiB when it cannot be read.
pub fn physical_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|line| line.strip_prefix("MemTotal:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        })
        .map_or(1 << 40, |kib| kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(args: &[&str]) -> Result<RealClientConfig, ConfigError> {
        let parsed = flags::parse(&PROGRAM, args.iter().map(|s| s.to_string()), |_| None)?;
        RealClientConfig::from_flags(&parsed)
    }

    fn bind_of(args: &[&str]) -> Result<std::net::SocketAddr, ConfigError> {
        config(args).expect("valid flags").transfer_bind()
    }

    #[test]
    fn the_transfer_engine_binds_the_advertised_address_never_a_wildcard() {
        let loopback = std::net::IpAddr::from([127, 0, 0, 1]);
        assert_eq!(bind_of(&[]).expect("embedded").ip(), loopback);
        assert_eq!(
            bind_of(&["--host=gpu-node-7"]).expect("name").ip(),
            loopback
        );
        assert_eq!(
            bind_of(&["--master_server_address=127.0.0.1:50051"])
                .expect("local cluster")
                .ip(),
            loopback
        );
        let explicit = bind_of(&["--host=10.1.2.3", "--transfer_port=7000"]).expect("ip");
        assert_eq!(explicit.to_string(), "10.1.2.3:7000");
        let error = bind_of(&["--master_server_address=192.0.2.1:50051"])
            .expect_err("a wildcard names no reachable address");
        assert!(error.to_string().contains("--host"), "{error}");
    }

    /// The flags `mooncake_client --helpfull` lists in upstream's wheel 0.3.13.
    /// Upstream's flags of this binary besides [`flags::UPSTREAM_COMMON_FLAGS`].
    const UPSTREAM: &[&str] = &[
        "enable_http_server",
        "http_port",
        "device_names",
        "enable_offload",
        "global_segment_size",
        "host",
        "local_buffer_size",
        "master_server_address",
        "metadata_server",
        "port",
        "protocol",
        "start_offload_rpc_server",
        "tenant_id",
        "threads",
    ];

    fn options() -> EmbeddedOptions {
        EmbeddedOptions {
            host: "localhost".into(),
            port: 12_345,
            global_segment_size: 64 << 20,
            master_address: "embedded".into(),
            protocol: "tcp".into(),
            ..EmbeddedOptions::default()
        }
    }

    #[test]
    fn an_application_real_client_takes_its_typed_settings() {
        let config = RealClientConfig::embedded(EmbeddedOptions {
            tenant_id: Some("blue".into()),
            http_port: Some(9400),
            ..options()
        })
        .expect("valid");
        assert_eq!(config.segment_name(), "localhost:12345");
        assert!(config.socket.is_none(), "it listens for no dummy");
        assert_eq!(config.embedded_master_port, 0, "nor serves its master");
        assert_eq!(config.global_segment_size, 64 << 20);
        assert_eq!(config.master_address, None);
        assert_eq!(config.tenant_id, "blue");
        assert_eq!(config.http_port, Some(9400));
        assert_eq!(
            config.hard_pin_quota(),
            64 << 20,
            "the segment size by default"
        );
        assert_eq!(
            config.read_lease_quota(),
            32 << 20,
            "half the segment by default"
        );
        let bad = |options: EmbeddedOptions| {
            RealClientConfig::embedded(options)
                .expect_err("refused")
                .to_string()
        };
        assert!(
            bad(EmbeddedOptions {
                tenant_id: Some("a b".into()),
                ..options()
            })
            .contains("tenant_id")
        );
        assert!(
            bad(EmbeddedOptions {
                protocol: "rdma".into(),
                ..options()
            })
            .contains("--protocol tcp")
        );
        let auto = RealClientConfig::embedded(EmbeddedOptions {
            protocol: "auto".into(),
            ..options()
        })
        .expect("auto runs over TCP");
        assert!(!auto.transport.reason.is_empty());
        assert!(
            bad(EmbeddedOptions {
                port: 0,
                ..options()
            })
            .contains("port")
        );
        assert!(
            bad(EmbeddedOptions {
                global_segment_size: 0,
                ..options()
            })
            .contains("global_segment_size"),
            "a pure client needs a cluster's master"
        );
        let pure = RealClientConfig::embedded(EmbeddedOptions {
            global_segment_size: 0,
            master_address: "10.0.0.1:50051".into(),
            ..options()
        })
        .expect("a pure client of a cluster");
        assert_eq!(pure.master_address.as_deref(), Some("10.0.0.1:50051"));
        assert_eq!(pure.hard_pin_quota(), physical_memory());
        assert_eq!(pure.read_lease_quota(), physical_memory() / 2);
    }

    #[test]
    fn table_covers_upstream() {
        assert_eq!(
            flags::upstream_gaps(FLAGS, &[UPSTREAM, flags::UPSTREAM_COMMON_FLAGS].concat()),
            Vec::<String>::new()
        );
    }

    #[test]
    fn upstream_start_command() {
        let parsed = config(&[
            "--metadata_server=http://127.0.0.1:8080/metadata",
            "--protocol",
            "tcp",
            "--master_server_address=127.0.0.1:50051",
            "--global_segment_size=1GB",
            "--local_buffer_size=16MB",
        ])
        .expect("upstream's start command");
        assert_eq!(parsed.global_segment_size, 1 << 30);
        assert_eq!(parsed.local_buffer_size, 16 << 20);
        assert_eq!(parsed.compat_notes.len(), 2, "{:?}", parsed.compat_notes);
        assert!(config(&["--start_offload_rpc_server=false"]).is_err());
        assert!(config(&["--host=10.0.0.1:12345"]).is_err());
    }

    #[test]
    fn transfer_congestion_defaults_to_cubic_and_names_are_checked() {
        use crate::transfer::Congestion;
        let named = |name: &str| Congestion::Named(name.into());
        assert_eq!(
            config(&[]).expect("defaults").transfer_congestion,
            named("cubic")
        );
        let system = config(&["--transfer_tcp_congestion=system"]).expect("system");
        assert_eq!(system.transfer_congestion, Congestion::System);
        let error = config(&["--transfer_tcp_congestion=Cubic!"]).expect_err("refused");
        assert!(
            error.to_string().contains("--transfer_tcp_congestion"),
            "{error}"
        );
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
        assert_eq!(
            config.http_host,
            std::net::IpAddr::from([127, 0, 0, 1]),
            "the HTTP server listens on loopback unless widened"
        );
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
            &["--master_server_address=etcd://"],
            &["--master_server_address=etcd://a"],
            &["--master_server_address=etcd://a:2379,b:0"],
            &["--log_level=infoo"],
            &["--http_host=everywhere"],
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

    #[test]
    fn an_etcd_master_address_names_the_endpoints() {
        let ha = config(&[
            "--master_server_address=etcd://10.0.0.1:2379;10.0.0.2:2379",
            "--host=10.0.0.5",
            "--cluster_id=prod",
        ])
        .expect("valid");
        assert_eq!(ha.cluster_id, "prod");
        assert_eq!(
            etcd_endpoints("10.0.0.1:2379;10.0.0.2:2379"),
            Ok(vec![
                "10.0.0.1:2379".to_string(),
                "10.0.0.2:2379".to_string()
            ])
        );
    }
}
