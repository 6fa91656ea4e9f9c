//! The standalone master process (`mooncake_master`): flags, configuration file,
//! validation and the serving loop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use mooncake_core::config_file;
use mooncake_core::flags::{
    self, ARENA_FLAGS, Accepts, Compat, FlagError, FlagSpec, GFLAGS, ParsedFlags, Program,
};
use mooncake_core::keep_awake::{self, KEEP_AWAKE_FLAGS};
use mooncake_core::logging::{LOG_FLAGS, LogError, LogSettings};
use mooncake_core::protocol::auth::{AUTH_FLAGS, ClusterSecret, SecretError};

use super::ha::HaSettings;
use super::ha::etcd::Etcd;
use super::ha::etcd_tls::{ETCD_TLS_FLAGS, EtcdTls};
use super::ha::node::HaNode;
use super::ha::supervisor::{Supervision, supervise};
use super::running::{BindError, RunningMaster};
use super::server::{self, MasterHandler};
use super::{AllocationStrategy, Clock, MasterConfig, MasterService};

const ETCD_ONLY: &str =
    "etcd is the only high-availability backend (--enable_ha with --etcd_endpoints)";
const NO_OPLOG: &str = "standbys receive the leader's changes directly from it (no operation log in etcd); --ha_sync_timeout_ms bounds the wait for them";
const NO_SNAPSHOT: &str = "the master keeps its index in memory only; snapshots are not available";
const NO_NOF: &str =
    "NVMe-oF segments are not available; SSD copies live on real clients (--enable_offload)";
const NO_KV_EVENTS: &str = "the KV-event publisher is not available";
const NO_CXL: &str = "CXL memory is not available";
const NO_PROMOTION: &str = "promotion of SSD-only objects back to memory is not available; a read is served from the SSD tier";
const NO_DYNAMIC_REPLICATION: &str =
    "dynamic replication is not available; ask for replica_num per write";
const NO_LEGACY_DISK: &str = "the shared-filesystem DISK tier is not available; use --enable_offload (SSD tier on real clients)";
const TASK_LIMITS: &str = "copy/move tasks are bounded by fixed limits (see docs/configuration.md)";

/// The master's own flags, with upstream's names and defaults.
pub static MASTER_FLAGS: &[FlagSpec] = &[
    FlagSpec::value(
        "config_path",
        Some(""),
        "JSON or YAML file with flag values (flag > environment > file > default)",
    ),
    FlagSpec::value("rpc_port", Some("0"), "RPC port; 0 means --port"),
    FlagSpec::value("port", Some("50051"), "RPC port (older name of --rpc_port)"),
    FlagSpec::value(
        "rpc_address",
        Some("0.0.0.0"),
        "IP address the RPC server binds",
    ),
    FlagSpec::value(
        "rpc_interface",
        Some(""),
        "IP address that overrides --rpc_address",
    )
    .compat(Compat::Differs(
        "takes an IP address; an interface name is refused (give its address)",
    )),
    FlagSpec::value(
        "rpc_thread_num",
        Some("0"),
        "worker threads; 0 means min(--max_threads, cores)",
    )
    .compat(Compat::Differs(
        "threads of the async runtime serving every connection",
    )),
    FlagSpec::value(
        "max_threads",
        Some("16"),
        "worker-thread cap when --rpc_thread_num is 0",
    ),
    FlagSpec::value(
        "rpc_conn_timeout_seconds",
        Some("0"),
        "idle connection timeout",
    )
    .compat(Compat::Refused(
        "connections stay open; a silent real client loses its segments after --client_ttl",
    )),
    FlagSpec::boolean(
        "rpc_enable_tcp_no_delay",
        true,
        "TCP_NODELAY on RPC connections",
    )
    .compat(Compat::NoEffect(
        "TCP_NODELAY is always on",
        Accepts::Only(&["true"]),
    )),
    FlagSpec::value(
        "default_kv_lease_ttl",
        Some("10000"),
        "read lease in ms (or 10s, 500ms)",
    ),
    FlagSpec::value(
        "default_kv_soft_pin_ttl",
        Some("1800000"),
        "soft-pin TTL in ms when a write asks for none",
    ),
    FlagSpec::value(
        "max_kv_soft_pin_ttl",
        Some("86400000"),
        "longest soft-pin TTL in ms",
    ),
    FlagSpec::boolean(
        "allow_evict_soft_pinned_objects",
        true,
        "let eviction take soft-pinned objects when nothing else is left",
    ),
    FlagSpec::value(
        "eviction_ratio",
        Some("0.05"),
        "fraction of capacity one eviction round frees",
    ),
    FlagSpec::value(
        "eviction_high_watermark_ratio",
        Some("0.90"),
        "memory use that starts eviction",
    ),
    FlagSpec::value(
        "client_ttl",
        Some("10"),
        "seconds without heartbeat after which a real client's segments are unmounted (file key: client_live_ttl_sec)",
    ),
    FlagSpec::value(
        "remount_grace",
        Some("5"),
        "seconds a silent real client's segment file (mooncake_client --segment_path) and its objects are kept after --client_ttl, for the restarted client to take back; 0 unmounts at once",
    )
    .ours(),
    FlagSpec::value(
        "put_start_discard_timeout_sec",
        Some("30"),
        "an unfinished write may be replaced after this many seconds",
    ),
    FlagSpec::value(
        "put_start_release_timeout_sec",
        Some("600"),
        "space of a replaced write is reused after this many seconds",
    ),
    FlagSpec::value(
        "pending_task_timeout_sec",
        Some("300"),
        "a copy/move task not started by its real client within this many seconds fails",
    ),
    FlagSpec::value(
        "processing_task_timeout_sec",
        Some("300"),
        "a started copy/move task not finished within this many seconds fails",
    ),
    FlagSpec::value(
        "max_total_finished_tasks",
        Some("10000"),
        "finished tasks kept",
    )
    .compat(Compat::NoEffect(TASK_LIMITS, Accepts::Any)),
    FlagSpec::value(
        "max_total_pending_tasks",
        Some("10000"),
        "pending tasks kept",
    )
    .compat(Compat::NoEffect(TASK_LIMITS, Accepts::Any)),
    FlagSpec::value(
        "max_total_processing_tasks",
        Some("10000"),
        "processing tasks kept",
    )
    .compat(Compat::NoEffect(TASK_LIMITS, Accepts::Any)),
    FlagSpec::value("max_retry_attempts", Some("10"), "retries of failed tasks").compat(
        Compat::NoEffect("a failed task is reported, not retried", Accepts::Any),
    ),
    FlagSpec::value(
        "allocation_strategy",
        Some("random"),
        "random or free_ratio_first",
    )
    .compat(Compat::Differs(
        "random and free_ratio_first; cxl, ssd_free_ratio_first and local_first are refused",
    )),
    FlagSpec::value(
        "memory_allocator",
        Some("offset"),
        "allocator of segment space",
    )
    .compat(Compat::NoEffect(
        "segments use our own offset allocator",
        Accepts::Only(&["offset", "cachelib"]),
    )),
    FlagSpec::value("cluster_id", Some("mooncake_cluster"), "cluster name")
        .env("MC_STORE_CLUSTER_ID"),
    FlagSpec::value(
        "metrics_port",
        Some("9003"),
        "HTTP port for /metrics, /metrics/summary, /health, /get_all_segments, /get_all_keys, /query_key; 0 disables",
    ),
    FlagSpec::value(
        "metrics_host",
        Some("0.0.0.0"),
        "address of the metrics HTTP server",
    ),
    FlagSpec::boolean(
        "enable_metric_reporting",
        true,
        "log a metrics summary every 10 s",
    ),
    FlagSpec::boolean(
        "enable_http_metadata_server",
        false,
        "serve upstream's HTTP metadata store (/metadata) on --http_metadata_server_host:port",
    ),
    FlagSpec::value(
        "http_metadata_server_host",
        Some("0.0.0.0"),
        "address of the HTTP metadata server",
    ),
    FlagSpec::value(
        "http_metadata_server_port",
        Some("8080"),
        "port of the HTTP metadata server",
    ),
    FlagSpec::boolean(
        "enable_metadata_cleanup_on_timeout",
        false,
        "drop a dead client's HTTP metadata",
    )
    .compat(Compat::Refused(
        "real clients keep no transfer metadata in the HTTP metadata server; nothing to clean up",
    )),
    FlagSpec::boolean(
        "enable_offload",
        false,
        "let real clients with --enable_offload keep copies of objects on their SSD tier",
    ),
    FlagSpec::boolean(
        "offload_on_evict",
        false,
        "with --enable_offload: write objects to the SSD tier when they are chosen for eviction, not when written",
    ),
    FlagSpec::boolean(
        "offload_force_evict",
        false,
        "evict past the offload cap without writing to disk",
    )
    .compat(Compat::Refused(
        "eviction waits for the SSD tier; there is no offload cap",
    )),
    FlagSpec::value(
        "offloading_queue_limit",
        Some("50000"),
        "objects queued for the SSD tier per real client",
    )
    .compat(Compat::NoEffect(
        "the offload queue is bounded by the memory it refers to",
        Accepts::Any,
    )),
    FlagSpec::value("offload_cap_ratio", Some("0.5"), "per-cycle offload cap")
        .compat(Compat::NoEffect("there is no offload cap", Accepts::Any)),
    FlagSpec::boolean(
        "promotion_on_hit",
        false,
        "promote SSD-only objects on read",
    )
    .compat(Compat::Refused(NO_PROMOTION)),
    FlagSpec::value(
        "promotion_admission_threshold",
        Some("2"),
        "reads before promotion",
    )
    .compat(Compat::NoEffect(NO_PROMOTION, Accepts::Any)),
    FlagSpec::value(
        "promotion_queue_limit",
        Some("50000"),
        "in-flight promotions",
    )
    .compat(Compat::NoEffect(NO_PROMOTION, Accepts::Any)),
    FlagSpec::value(
        "promotion_max_per_heartbeat",
        Some("1"),
        "promotions per heartbeat",
    )
    .compat(Compat::NoEffect(NO_PROMOTION, Accepts::Any)),
    FlagSpec::value(
        "dynamic_replication_mode",
        Some("off"),
        "off, observe or enforce",
    )
    .compat(Compat::Refused(NO_DYNAMIC_REPLICATION)),
    FlagSpec::value(
        "dynamic_replication_heat_window_seconds",
        Some("10"),
        "heat window",
    )
    .compat(Compat::NoEffect(NO_DYNAMIC_REPLICATION, Accepts::Any)),
    FlagSpec::value(
        "dynamic_replication_admission_qps_threshold",
        Some("0.8"),
        "admission threshold",
    )
    .compat(Compat::NoEffect(NO_DYNAMIC_REPLICATION, Accepts::Any)),
    FlagSpec::value(
        "dynamic_replication_max_memory_replicas",
        Some("2"),
        "replica cap",
    )
    .compat(Compat::NoEffect(NO_DYNAMIC_REPLICATION, Accepts::Any)),
    FlagSpec::boolean(
        "enable_ha",
        false,
        "campaign for leadership in etcd (--etcd_endpoints); standbys keep a hot copy of the leader's metadata",
    ),
    FlagSpec::value(
        "etcd_endpoints",
        Some(""),
        "etcd endpoints host:port, separated by ; or , (with --enable_ha)",
    ),
    FlagSpec::value("ha_backend_type", Some("etcd"), "etcd, redis or k8s")
        .compat(Compat::NoEffect(ETCD_ONLY, Accepts::Only(&["etcd"]))),
    FlagSpec::value(
        "ha_backend_connstring",
        Some(""),
        "etcd endpoints (when --etcd_endpoints is empty)",
    ),
    FlagSpec::value(
        "ha_lease_ttl_sec",
        Some("2"),
        "etcd lease of the leader in seconds: a dead leader is replaced within about this long",
    )
    .ours(),
    FlagSpec::value(
        "ha_sync_timeout_ms",
        Some("500"),
        "how long a write waits for an in-sync standby before that standby leaves the in-sync set",
    )
    .ours(),
    FlagSpec::value("pod_name", Some(""), "k8s leader label")
        .compat(Compat::NoEffect(ETCD_ONLY, Accepts::Any)),
    FlagSpec::value("pod_namespace", Some(""), "k8s leader label")
        .compat(Compat::NoEffect(ETCD_ONLY, Accepts::Any)),
    FlagSpec::boolean("enable_oplog", false, "HA metadata replication")
        .compat(Compat::NoEffect(NO_OPLOG, Accepts::Any)),
    FlagSpec::value(
        "oplog_poll_interval_ms",
        Some("1000"),
        "standby poll interval",
    )
    .compat(Compat::NoEffect(NO_OPLOG, Accepts::Any)),
    FlagSpec::value("oplog_batch_max_entries", Some("1024"), "oplog batch")
        .compat(Compat::NoEffect(NO_OPLOG, Accepts::Any)),
    FlagSpec::value("batch_oplog_retry_timeout_sec", Some("180"), "oplog retry")
        .compat(Compat::NoEffect(NO_OPLOG, Accepts::Any)),
    FlagSpec::boolean("enable_snapshot", false, "periodic snapshots")
        .compat(Compat::Refused(NO_SNAPSHOT)),
    FlagSpec::boolean("enable_snapshot_restore", false, "restore from a snapshot")
        .compat(Compat::Refused(NO_SNAPSHOT)),
    FlagSpec::value(
        "snapshot_interval_seconds",
        Some("600"),
        "snapshot interval",
    )
    .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value(
        "snapshot_child_timeout_seconds",
        Some("300"),
        "snapshot timeout",
    )
    .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value("snapshot_retention_count", Some("2"), "snapshots kept")
        .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value("snapshot_backup_dir", Some(""), "snapshot backup")
        .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value("snapshot_object_store_type", Some(""), "snapshot store")
        .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value(
        "snapshot_payload_store_type",
        Some(""),
        "snapshot store (old name)",
    )
    .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value(
        "snapshot_payload_backend_type",
        Some(""),
        "snapshot store (old name)",
    )
    .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value("snapshot_catalog_store_type", Some(""), "snapshot catalog")
        .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value(
        "snapshot_catalog_backend_type",
        Some(""),
        "snapshot catalog (old name)",
    )
    .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value(
        "snapshot_catalog_store_connstring",
        Some(""),
        "snapshot catalog address",
    )
    .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value(
        "snapshot_catalog_backend_connstring",
        Some(""),
        "snapshot catalog address (old name)",
    )
    .compat(Compat::NoEffect(NO_SNAPSHOT, Accepts::Any)),
    FlagSpec::value("nof_eviction_ratio", Some("0.05"), "NoF eviction ratio")
        .compat(Compat::NoEffect(NO_NOF, Accepts::Any)),
    FlagSpec::value(
        "nof_eviction_high_watermark_ratio",
        Some("0.90"),
        "NoF eviction watermark",
    )
    .compat(Compat::NoEffect(NO_NOF, Accepts::Any)),
    FlagSpec::value(
        "nof_heartbeat_interval_sec",
        Some("10"),
        "NoF probe interval",
    )
    .compat(Compat::NoEffect(NO_NOF, Accepts::Any)),
    FlagSpec::value(
        "nof_heartbeat_probe_timeout_ms",
        Some("1000"),
        "NoF probe timeout",
    )
    .compat(Compat::NoEffect(NO_NOF, Accepts::Any)),
    FlagSpec::value(
        "nof_heartbeat_failures_threshold",
        Some("3"),
        "NoF probe failures",
    )
    .compat(Compat::NoEffect(NO_NOF, Accepts::Any)),
    FlagSpec::boolean("enable_kv_events", false, "publish KV events over ZMQ")
        .compat(Compat::Refused(NO_KV_EVENTS)),
    FlagSpec::value("kv_events_bind_endpoint", Some(""), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_backend_id", Some(""), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_model_name", Some(""), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_tenant_id", Some("default"), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_additional_salt", Some(""), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_lora_name", Some(""), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_block_size", Some("0"), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_dp_rank", Some("0"), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::boolean("kv_events_emit_legacy_compat", true, "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::boolean("kv_events_emit_object_key", true, "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::value("kv_events_queue_capacity", Some("65536"), "KV events")
        .compat(Compat::NoEffect(NO_KV_EVENTS, Accepts::Any)),
    FlagSpec::boolean("enable_cxl", false, "CXL memory").compat(Compat::Refused(NO_CXL)),
    FlagSpec::value("cxl_path", Some("/dev/dax0.0"), "CXL device")
        .compat(Compat::NoEffect(NO_CXL, Accepts::Any)),
    FlagSpec::value("cxl_size", Some("8589934592"), "CXL size")
        .compat(Compat::NoEffect(NO_CXL, Accepts::Any)),
    FlagSpec::value("root_fs_dir", Some(""), "shared-filesystem DISK tier")
        .compat(Compat::Refused(NO_LEGACY_DISK)),
    FlagSpec::value(
        "global_file_segment_size",
        Some("9223372036854775807"),
        "DISK tier size (metrics)",
    )
    .compat(Compat::NoEffect(NO_LEGACY_DISK, Accepts::Any)),
    FlagSpec::boolean("enable_disk_eviction", true, "DISK tier eviction")
        .compat(Compat::NoEffect(NO_LEGACY_DISK, Accepts::Any)),
    FlagSpec::value("quota_bytes", Some("0"), "DISK tier quota")
        .compat(Compat::NoEffect(NO_LEGACY_DISK, Accepts::Any)),
    FlagSpec::boolean("enable_multi_tenants", false, "tenant quotas").compat(Compat::Refused(
        "tenants are always separated (real client --tenant_id); quota admission is not available",
    )),
    FlagSpec::value("tenant_quota_connector_type", Some("file"), "tenant quotas").compat(
        Compat::NoEffect("tenant quotas are not available", Accepts::Any),
    ),
    FlagSpec::value("tenant_quota_connector_uri", Some(""), "tenant quotas").compat(
        Compat::NoEffect("tenant quotas are not available", Accepts::Any),
    ),
];

/// Every flag of `mooncake_master`.
pub static FLAGS: &[&[FlagSpec]] = &[
    MASTER_FLAGS,
    AUTH_FLAGS,
    ETCD_TLS_FLAGS,
    LOG_FLAGS,
    KEEP_AWAKE_FLAGS,
    ARENA_FLAGS,
    GFLAGS,
];

/// `mooncake_master` for the flag parser.
pub static PROGRAM: Program = Program {
    name: "mooncake_master",
    about: "the mooncake-rs master: object metadata, placement and leases for a cluster",
    table: FLAGS,
};

/// Validated settings of a standalone master.
#[derive(Clone, Debug)]
pub struct MasterDaemonConfig {
    /// Where the RPC server listens.
    pub rpc_address: SocketAddr,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// How long this node's cores are kept awake after each request
    /// (`--keep_awake_us`; see [`mooncake_core::keep_awake`]).
    pub keep_awake: std::time::Duration,
    /// Where the metrics server listens (`None`: disabled).
    pub metrics_address: Option<SocketAddr>,
    /// Log a metrics summary every 10 s.
    pub metric_reporting: bool,
    /// Cluster name.
    pub cluster_id: String,
    /// The master's own settings.
    pub master: MasterConfig,
    /// Where upstream's HTTP metadata server (`/metadata`) listens (`None`: off).
    pub http_metadata_address: Option<SocketAddr>,
    /// Logging: the filter plus upstream's glog flags (log file, stderr threshold).
    pub log: LogSettings,
    /// Upstream flags accepted without effect, for the startup log.
    pub compat_notes: Vec<String>,
    /// The cluster secret every connection must prove (`None`: unauthenticated, as
    /// upstream).
    pub cluster_secret: Option<Arc<ClusterSecret>>,
    /// High availability (`--enable_ha`; `None`: a single master).
    pub ha: Option<HaSettings>,
}

/// Why the master configuration was rejected.
#[derive(Debug, thiserror::Error)]
pub enum DaemonConfigError {
    /// A flag or value did not parse.
    #[error(transparent)]
    Flag(#[from] FlagError),
    /// The configuration file is unreadable.
    #[error(transparent)]
    File(#[from] config_file::ConfigFileError),
    /// A logging flag was rejected.
    #[error(transparent)]
    Log(#[from] LogError),
    /// A value parsed but is not acceptable.
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// `--cluster_secret_file` is unusable.
    #[error("--cluster_secret_file: {0}")]
    Secret(#[from] SecretError),
}

fn number<T: std::str::FromStr + Default>(
    flags: &ParsedFlags,
    name: &str,
) -> Result<T, DaemonConfigError> {
    Ok(flags.number(name)?.unwrap_or_default())
}

fn millis(flags: &ParsedFlags, name: &str) -> Result<Duration, DaemonConfigError> {
    Ok(flags.duration(name, true)?.unwrap_or_default())
}

fn seconds(flags: &ParsedFlags, name: &str) -> Result<Duration, DaemonConfigError> {
    Ok(flags.duration(name, false)?.unwrap_or_default())
}

fn address(host: &str, port: u16, flag: &str) -> Result<SocketAddr, DaemonConfigError> {
    format!("{host}:{port}")
        .parse()
        .or_else(|_| format!("[{host}]:{port}").parse())
        .map_err(|_| DaemonConfigError::Invalid(format!("--{flag}: {host:?} is not an IP address")))
}

impl MasterDaemonConfig {
    /// Parses the command line (without the program name), the configuration file it
    /// names, and the environment.
    pub fn from_args(args: impl IntoIterator<Item = String>) -> Result<Self, DaemonConfigError> {
        let mut flags = flags::parse(&PROGRAM, args, |var| std::env::var(var).ok())?;
        if let Some(path) = flags.string("config_path").filter(|p| !p.is_empty()) {
            let values = config_file::read(std::path::Path::new(&path))?;
            flags.merge_file(values, &[("client_live_ttl_sec", "client_ttl")])?;
        }
        Self::from_flags(&flags)
    }

    /// Builds and validates the settings.
    pub fn from_flags(flags: &ParsedFlags) -> Result<Self, DaemonConfigError> {
        let log = LogSettings::from_flags(PROGRAM.name, flags)?;
        let master = master_config(flags)?;
        master.validate().map_err(DaemonConfigError::Invalid)?;
        let metrics_port: u16 = number(flags, "metrics_port")?;
        let metadata_port: u16 = number(flags, "http_metadata_server_port")?;
        let http_metadata_address = if flags.bool("enable_http_metadata_server")? {
            let host = flags
                .string("http_metadata_server_host")
                .unwrap_or_default();
            Some(address(&host, metadata_port, "http_metadata_server_host")?)
        } else {
            None
        };
        let rpc_address = rpc_address(flags)?;
        let cluster_id = flags.string("cluster_id").unwrap_or_default();
        Ok(MasterDaemonConfig {
            ha: ha_settings(flags, rpc_address, &cluster_id)?,
            rpc_address,
            threads: threads(flags)?,
            keep_awake: keep_awake::window_from_flags(flags)?,
            metrics_address: if metrics_port == 0 {
                None
            } else {
                let host = flags.string("metrics_host").unwrap_or_default();
                Some(address(&host, metrics_port, "metrics_host")?)
            },
            metric_reporting: flags.bool("enable_metric_reporting")?,
            cluster_id,
            master,
            http_metadata_address,
            log,
            compat_notes: flags.compat_notes(),
            cluster_secret: ClusterSecret::from_flags(flags)?.map(Arc::new),
        })
    }
}

/// `--enable_ha` and its settings: etcd endpoints, the lease, the sync timeout, and
/// the address published for real clients (the RPC address, which must name this host).
fn ha_settings(
    flags: &ParsedFlags,
    rpc_address: SocketAddr,
    cluster_id: &str,
) -> Result<Option<HaSettings>, DaemonConfigError> {
    if !flags.bool("enable_ha")? {
        return Ok(None);
    }
    let listed = flags
        .string("etcd_endpoints")
        .filter(|e| !e.trim().is_empty())
        .or_else(|| flags.string("ha_backend_connstring"))
        .unwrap_or_default();
    let listed = listed.trim().trim_start_matches("etcd://");
    let etcd_endpoints: Vec<String> = listed
        .split([',', ';'])
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .map(str::to_string)
        .collect();
    if etcd_endpoints.is_empty() {
        return Err(DaemonConfigError::Invalid(
            "--enable_ha needs --etcd_endpoints (host:port of the etcd cluster, e.g. 10.0.0.1:2379;10.0.0.2:2379)".into(),
        ));
    }
    if rpc_address.ip().is_unspecified() {
        return Err(DaemonConfigError::Invalid(format!(
            "--enable_ha publishes the leader's RPC address in etcd, and {} names no host: give --rpc_address the IP real clients reach (e.g. --rpc_address=10.0.0.11)",
            rpc_address.ip()
        )));
    }
    let lease_ttl = seconds(flags, "ha_lease_ttl_sec")?;
    if lease_ttl.is_zero() || lease_ttl > Duration::from_secs(60) {
        return Err(DaemonConfigError::Invalid(
            "--ha_lease_ttl_sec must be 1 to 60 seconds".into(),
        ));
    }
    let sync_timeout = millis(flags, "ha_sync_timeout_ms")?;
    if sync_timeout < Duration::from_millis(10) || sync_timeout > Duration::from_secs(60) {
        return Err(DaemonConfigError::Invalid(
            "--ha_sync_timeout_ms must be 10 to 60000 ms".into(),
        ));
    }
    let etcd_tls = EtcdTls::from_flags(flags)
        .map_err(|error| DaemonConfigError::Invalid(error.to_string()))?;
    Ok(Some(HaSettings {
        etcd_endpoints,
        etcd_tls,
        cluster_id: cluster_id.to_string(),
        lease_ttl,
        sync_timeout,
        advertised: rpc_address.to_string(),
    }))
}

/// The master's own settings from the flags.
fn master_config(flags: &ParsedFlags) -> Result<MasterConfig, DaemonConfigError> {
    let strategy_text = flags.string("allocation_strategy").unwrap_or_default();
    let allocation_strategy = AllocationStrategy::parse(&strategy_text).ok_or_else(|| {
        DaemonConfigError::Invalid(format!(
            "--allocation_strategy {strategy_text:?}: use random or free_ratio_first"
        ))
    })?;
    Ok(MasterConfig {
        default_kv_lease_ttl: millis(flags, "default_kv_lease_ttl")?,
        default_kv_soft_pin_ttl: millis(flags, "default_kv_soft_pin_ttl")?,
        max_kv_soft_pin_ttl: millis(flags, "max_kv_soft_pin_ttl")?,
        allow_evict_soft_pinned_objects: flags.bool("allow_evict_soft_pinned_objects")?,
        eviction_ratio: number(flags, "eviction_ratio")?,
        eviction_high_watermark_ratio: number(flags, "eviction_high_watermark_ratio")?,
        client_ttl: seconds(flags, "client_ttl")?,
        remount_grace: seconds(flags, "remount_grace")?,
        put_start_discard_timeout: seconds(flags, "put_start_discard_timeout_sec")?,
        put_start_release_timeout: seconds(flags, "put_start_release_timeout_sec")?,
        pending_task_timeout: seconds(flags, "pending_task_timeout_sec")?,
        processing_task_timeout: seconds(flags, "processing_task_timeout_sec")?,
        enable_offload: flags.bool("enable_offload")?,
        offload_on_evict: flags.bool("offload_on_evict")?,
        allocation_strategy,
        ..MasterConfig::default()
    })
}

/// `--rpc_interface` (an IP address) when set, else `--rpc_address`; `--rpc_port`, or
/// `--port` when it is 0.
fn rpc_address(flags: &ParsedFlags) -> Result<SocketAddr, DaemonConfigError> {
    let rpc_port: u16 = number(flags, "rpc_port")?;
    let port = if rpc_port == 0 {
        number(flags, "port")?
    } else {
        rpc_port
    };
    let interface = flags.string("rpc_interface").unwrap_or_default();
    if !interface.is_empty() {
        if interface.parse::<std::net::IpAddr>().is_err() {
            return Err(DaemonConfigError::Invalid(format!(
                "--rpc_interface {interface:?}: interface names are not resolved in this build; give the interface's IP address (--rpc_interface=10.0.0.11 or --rpc_address=10.0.0.11)"
            )));
        }
        return address(&interface, port, "rpc_interface");
    }
    let host = flags.string("rpc_address").unwrap_or_default();
    address(&host, port, "rpc_address")
}

/// `--rpc_thread_num`, or `min(--max_threads, cores)` when it is 0 (as upstream).
fn threads(flags: &ParsedFlags) -> Result<usize, DaemonConfigError> {
    let threads: usize = number(flags, "rpc_thread_num")?;
    if threads > 0 {
        return Ok(threads);
    }
    let max: usize = number(flags, "max_threads")?;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    Ok(max.clamp(1, cores))
}

/// Why the master could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The RPC port could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// etcd could not be reached at startup.
    #[error("--enable_ha: {0}; is etcd running at --etcd_endpoints?")]
    Etcd(#[from] crate::ha::etcd::EtcdError),
    /// This master led and lost its lease.
    #[error(transparent)]
    LostLeadership(#[from] crate::ha::supervisor::HaError),
    /// The HTTP metadata server's port could not be bound.
    #[error(
        "cannot listen on {address} for the HTTP metadata server: {source}; choose another --http_metadata_server_port"
    )]
    MetadataBind {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Runs a standalone master until `shutdown` completes.
pub async fn run(
    config: MasterDaemonConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    if let Some(ha) = config.ha.clone() {
        return run_highly_available(config, ha, shutdown).await;
    }
    let master = Arc::new(MasterService::new(config.master.clone(), Clock::System));
    let metadata = match config.http_metadata_address {
        Some(address) => Some(serve_metadata(address).await?),
        None => None,
    };
    let running = RunningMaster::start(
        Arc::clone(&master),
        config.rpc_address,
        config.cluster_secret.clone(),
    )
    .await?;
    let rpc_address = running.rpc_address.unwrap_or(config.rpc_address);
    match &config.cluster_secret {
        Some(secret) => {
            master.sign_transfers(Arc::clone(secret));
            tracing::info!(
                secret = secret.origin(),
                "every master connection must prove cluster membership; replicas handed out carry transfer grants"
            );
        }
        None => tracing::warn!(
            rpc = %rpc_address,
            "no --cluster_secret_file: the master port is unauthenticated; anyone who can reach it can read, overwrite and wipe the store (see docs/security.md)"
        ),
    }
    tracing::info!(
        rpc = %rpc_address,
        cluster_id = %config.cluster_id,
        threads = config.threads,
        keep_awake_us = keep_awake::window().as_micros(),
        lease_ttl_ms = config.master.default_kv_lease_ttl.as_millis(),
        client_ttl_s = config.master.client_ttl.as_secs(),
        eviction_high_watermark_ratio = config.master.eviction_high_watermark_ratio,
        eviction_ratio = config.master.eviction_ratio,
        allocation_strategy = ?config.master.allocation_strategy,
        enable_offload = config.master.enable_offload,
        metrics = ?config.metrics_address,
        http_metadata = ?config.http_metadata_address,
        log_filter = %config.log.filter,
        log_dir = ?config.log.log_dir,
        "mooncake_master serving"
    );
    let metrics = config.metrics_address.map(|address| {
        tokio::spawn(mooncake_core::http::serve(
            address,
            super::admin_http::router(Arc::clone(&master), None),
        ))
    });
    let reporting = config
        .metric_reporting
        .then(|| tokio::spawn(report_periodically(Arc::clone(&master))));
    shutdown.await;
    tracing::info!("shutdown requested");
    for task in metrics.into_iter().chain(reporting).chain(metadata) {
        task.abort();
    }
    running.stop().await;
    Ok(())
}

/// Runs a master under high availability until `shutdown` completes (resigning when it
/// leads) or until it loses leadership (an error: the process exits, and its
/// supervisor restarts it as a standby).
async fn run_highly_available(
    config: MasterDaemonConfig,
    ha: HaSettings,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    let master = Arc::new(MasterService::new(config.master.clone(), Clock::System));
    if let Some(secret) = &config.cluster_secret {
        master.sign_transfers(Arc::clone(secret));
    }
    let etcd = Etcd::connect(&ha.etcd_endpoints, &ha.cluster_id, ha.etcd_tls.as_ref()).await?;
    let node = Arc::new(HaNode::new(
        Arc::clone(&master),
        etcd,
        ha.advertised.clone(),
    ));
    let listener = TcpListener::bind(config.rpc_address)
        .await
        .map_err(|source| BindError {
            address: config.rpc_address,
            source,
        })?;
    let metadata = match config.http_metadata_address {
        Some(address) => Some(serve_metadata(address).await?),
        None => None,
    };
    let (stop, _) = watch::channel(false);
    let server = tokio::spawn(server::serve(
        listener,
        MasterHandler::highly_available(Arc::clone(&node)),
        config.cluster_secret.clone(),
        stop.subscribe(),
    ));
    let metrics = config.metrics_address.map(|address| {
        tokio::spawn(mooncake_core::http::serve(
            address,
            super::admin_http::router(Arc::clone(&master), Some(Arc::clone(&node))),
        ))
    });
    tracing::info!(
        rpc = %config.rpc_address,
        cluster_id = %ha.cluster_id,
        etcd = %ha.etcd_endpoints.join(","),
        lease_ttl_s = ha.lease_ttl.as_secs(),
        sync_timeout_ms = ha.sync_timeout.as_millis(),
        "mooncake_master started with --enable_ha: standing by until elected"
    );
    let supervision = Supervision {
        settings: ha,
        secret: config.cluster_secret.clone(),
    };
    let supervisor = supervise(Arc::clone(&node), supervision, stop.subscribe());
    tokio::pin!(supervisor);
    let outcome = tokio::select! {
        () = shutdown => {
            tracing::info!("shutdown requested");
            stop.send_replace(true);
            (&mut supervisor).await
        }
        outcome = &mut supervisor => outcome,
    };
    stop.send_replace(true);
    for task in metrics.into_iter().chain(metadata) {
        task.abort();
    }
    let _ = server.await;
    outcome.map_err(DaemonError::from)
}

/// Binds and serves upstream's HTTP metadata store.
async fn serve_metadata(address: SocketAddr) -> Result<tokio::task::JoinHandle<()>, DaemonError> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|source| DaemonError::MetadataBind { address, source })?;
    let store = Arc::new(crate::http_metadata::MetadataStore::default());
    Ok(tokio::spawn(mooncake_core::http::serve_listener(
        listener,
        store.router(),
    )))
}

async fn report_periodically(master: Arc<MasterService>) {
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    tick.tick().await;
    loop {
        tick.tick().await;
        let stats = master.stats();
        let (used, capacity) = stats
            .segments
            .iter()
            .fold((0, 0), |(u, c), s| (u + s.used, c + s.capacity));
        tracing::info!(
            objects = stats.objects,
            segments = stats.segments.len(),
            clients = stats.clients,
            used,
            capacity,
            evicted = stats.evicted_objects,
            "master metrics"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The flags `mooncake_master --helpfull` lists in upstream's wheel 0.3.13.
    /// Upstream's flags of this binary besides [`flags::UPSTREAM_COMMON_FLAGS`].
    const UPSTREAM: &[&str] = &[
        "allocation_strategy",
        "allow_evict_soft_pinned_objects",
        "batch_oplog_retry_timeout_sec",
        "client_ttl",
        "cluster_id",
        "config_path",
        "cxl_path",
        "cxl_size",
        "default_kv_lease_ttl",
        "default_kv_soft_pin_ttl",
        "dynamic_replication_admission_qps_threshold",
        "dynamic_replication_heat_window_seconds",
        "dynamic_replication_max_memory_replicas",
        "dynamic_replication_mode",
        "enable_cxl",
        "enable_disk_eviction",
        "enable_ha",
        "enable_http_metadata_server",
        "enable_kv_events",
        "enable_metadata_cleanup_on_timeout",
        "enable_metric_reporting",
        "enable_multi_tenants",
        "enable_offload",
        "enable_oplog",
        "enable_snapshot",
        "enable_snapshot_restore",
        "etcd_endpoints",
        "eviction_high_watermark_ratio",
        "eviction_ratio",
        "global_file_segment_size",
        "ha_backend_connstring",
        "ha_backend_type",
        "http_metadata_server_host",
        "http_metadata_server_port",
        "kv_events_additional_salt",
        "kv_events_backend_id",
        "kv_events_bind_endpoint",
        "kv_events_block_size",
        "kv_events_dp_rank",
        "kv_events_emit_legacy_compat",
        "kv_events_emit_object_key",
        "kv_events_lora_name",
        "kv_events_model_name",
        "kv_events_queue_capacity",
        "kv_events_tenant_id",
        "max_kv_soft_pin_ttl",
        "max_retry_attempts",
        "max_threads",
        "max_total_finished_tasks",
        "max_total_pending_tasks",
        "max_total_processing_tasks",
        "memory_allocator",
        "metrics_host",
        "metrics_port",
        "nof_eviction_high_watermark_ratio",
        "nof_eviction_ratio",
        "nof_heartbeat_failures_threshold",
        "nof_heartbeat_interval_sec",
        "nof_heartbeat_probe_timeout_ms",
        "offload_cap_ratio",
        "offload_force_evict",
        "offload_on_evict",
        "offloading_queue_limit",
        "oplog_batch_max_entries",
        "oplog_poll_interval_ms",
        "pending_task_timeout_sec",
        "pod_name",
        "pod_namespace",
        "port",
        "processing_task_timeout_sec",
        "promotion_admission_threshold",
        "promotion_max_per_heartbeat",
        "promotion_on_hit",
        "promotion_queue_limit",
        "put_start_discard_timeout_sec",
        "put_start_release_timeout_sec",
        "quota_bytes",
        "root_fs_dir",
        "rpc_address",
        "rpc_conn_timeout_seconds",
        "rpc_enable_tcp_no_delay",
        "rpc_interface",
        "rpc_port",
        "rpc_thread_num",
        "snapshot_backup_dir",
        "snapshot_catalog_backend_connstring",
        "snapshot_catalog_backend_type",
        "snapshot_catalog_store_connstring",
        "snapshot_catalog_store_type",
        "snapshot_child_timeout_seconds",
        "snapshot_interval_seconds",
        "snapshot_object_store_type",
        "snapshot_payload_backend_type",
        "snapshot_payload_store_type",
        "snapshot_retention_count",
        "tenant_quota_connector_type",
        "tenant_quota_connector_uri",
    ];

    fn config(args: &[&str]) -> Result<MasterDaemonConfig, DaemonConfigError> {
        MasterDaemonConfig::from_flags(&flags::parse(
            &PROGRAM,
            args.iter().map(|s| s.to_string()),
            |_| None,
        )?)
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
        let config = config(&[
            "--rpc_interface=0.0.0.0",
            "--rpc_port=50051",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            "--http_metadata_server_port=8080",
            "-v=1",
            "--logtostderr",
        ])
        .expect("upstream's start command");
        assert_eq!(config.rpc_address, "0.0.0.0:50051".parse().expect("addr"));
        assert_eq!(
            config.http_metadata_address,
            Some("127.0.0.1:8080".parse().expect("addr"))
        );
        assert_eq!(config.log.filter, "debug");
        assert!(config.compat_notes.is_empty());
    }

    #[test]
    fn documented_defaults() {
        let config = config(&[]).expect("defaults");
        assert_eq!(config.rpc_address, "0.0.0.0:50051".parse().expect("addr"));
        assert_eq!(
            config.metrics_address,
            Some("0.0.0.0:9003".parse().expect("addr"))
        );
        assert_eq!(config.http_metadata_address, None);
        assert_eq!(config.master, MasterConfig::default());
        assert!(config.threads >= 1);
    }

    #[test]
    fn high_availability_settings() {
        let ha = config(&[
            "--enable_ha",
            "--etcd_endpoints=10.0.0.1:2379;10.0.0.2:2379",
            "--rpc_address=10.0.0.11",
            "--cluster_id=prod",
        ])
        .expect("valid")
        .ha
        .expect("high availability on");
        assert_eq!(ha.etcd_endpoints, vec!["10.0.0.1:2379", "10.0.0.2:2379"]);
        assert_eq!(ha.advertised, "10.0.0.11:50051");
        assert_eq!(ha.cluster_id, "prod");
        assert_eq!(ha.lease_ttl, Duration::from_secs(2));
        assert_eq!(ha.sync_timeout, Duration::from_millis(500));
        let connstring = config(&[
            "--enable_ha",
            "--ha_backend_connstring=etcd://h:2379",
            "--rpc_address=10.0.0.11",
        ])
        .expect("valid")
        .ha
        .expect("high availability on");
        assert_eq!(connstring.etcd_endpoints, vec!["h:2379"]);
        assert!(config(&[]).expect("defaults").ha.is_none());
        for bad in ["--ha_lease_ttl_sec=0", "--ha_sync_timeout_ms=1"] {
            let args = [
                "--enable_ha",
                "--etcd_endpoints=h:1",
                "--rpc_address=10.0.0.1",
                bad,
            ];
            assert!(config(&args).is_err(), "{bad}");
        }
    }

    #[test]
    fn refusals_name_the_flag() {
        for (args, flag) in [
            (&["--rpc_interface=eth0"][..], "rpc_interface"),
            (&["--enable_ha"], "etcd_endpoints"),
            (
                &["--enable_ha", "--etcd_endpoints=127.0.0.1:2379"],
                "rpc_address",
            ),
            (&["--ha_backend_type=k8s"], "ha_backend_type"),
            (&["--memory_allocator=jemalloc"], "memory_allocator"),
            (
                &["--allocation_strategy=local_first"],
                "allocation_strategy",
            ),
            (
                &["--rpc_enable_tcp_no_delay=false"],
                "rpc_enable_tcp_no_delay",
            ),
            (
                &["--dynamic_replication_mode=enforce"],
                "dynamic_replication_mode",
            ),
        ] {
            let error = config(args).expect_err("refused").to_string();
            assert!(error.contains(flag), "{args:?}: {error}");
        }
        let config = config(&["--memory_allocator=cachelib", "--max_total_pending_tasks=5"])
            .expect("compatible values");
        assert_eq!(config.compat_notes.len(), 2);
    }
}
