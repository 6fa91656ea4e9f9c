//! The standalone master process (`mooncake_master`): flags, configuration file,
//! validation and the serving loop.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config_file;
use crate::flags::{self, FlagError, FlagKind, FlagSpec, ParsedFlags};

use super::server::{self, MasterHandler};
use super::{AllocationStrategy, Clock, MasterConfig, MasterService};

/// Every flag of `mooncake_master`, with upstream's names and defaults.
pub static FLAGS: &[FlagSpec] = &[
    FlagSpec {
        name: "config_path",
        kind: FlagKind::Value,
        env: None,
        default: None,
        help: "JSON or YAML file with flag values (a flag given on the command line wins)",
    },
    FlagSpec {
        name: "rpc_port",
        kind: FlagKind::Value,
        env: None,
        default: Some("0"),
        help: "RPC port; 0 means --port",
    },
    FlagSpec {
        name: "port",
        kind: FlagKind::Value,
        env: None,
        default: Some("50051"),
        help: "RPC port (older name of --rpc_port)",
    },
    FlagSpec {
        name: "rpc_address",
        kind: FlagKind::Value,
        env: None,
        default: Some("0.0.0.0"),
        help: "address the RPC server binds",
    },
    FlagSpec {
        name: "rpc_thread_num",
        kind: FlagKind::Value,
        env: None,
        default: Some("0"),
        help: "RPC worker threads; 0 means one per core",
    },
    FlagSpec {
        name: "max_threads",
        kind: FlagKind::Value,
        env: None,
        default: Some("16"),
        help: "accepted for compatibility (see --rpc_thread_num)",
    },
    FlagSpec {
        name: "default_kv_lease_ttl",
        kind: FlagKind::Value,
        env: None,
        default: Some("10000"),
        help: "read lease in ms (or 10s, 500ms)",
    },
    FlagSpec {
        name: "default_kv_soft_pin_ttl",
        kind: FlagKind::Value,
        env: None,
        default: Some("1800000"),
        help: "soft-pin TTL in ms when a write asks for none",
    },
    FlagSpec {
        name: "max_kv_soft_pin_ttl",
        kind: FlagKind::Value,
        env: None,
        default: Some("86400000"),
        help: "longest soft-pin TTL in ms",
    },
    FlagSpec {
        name: "allow_evict_soft_pinned_objects",
        kind: FlagKind::Bool,
        env: None,
        default: Some("true"),
        help: "let eviction take soft-pinned objects when nothing else is left",
    },
    FlagSpec {
        name: "eviction_ratio",
        kind: FlagKind::Value,
        env: None,
        default: Some("0.05"),
        help: "fraction of capacity one eviction round frees",
    },
    FlagSpec {
        name: "eviction_high_watermark_ratio",
        kind: FlagKind::Value,
        env: None,
        default: Some("0.90"),
        help: "memory use that starts eviction",
    },
    FlagSpec {
        name: "client_ttl",
        kind: FlagKind::Value,
        env: None,
        default: Some("10"),
        help: "seconds without heartbeat after which a real client's segments are unmounted",
    },
    FlagSpec {
        name: "put_start_discard_timeout_sec",
        kind: FlagKind::Value,
        env: None,
        default: Some("30"),
        help: "an unfinished write may be replaced after this many seconds",
    },
    FlagSpec {
        name: "put_start_release_timeout_sec",
        kind: FlagKind::Value,
        env: None,
        default: Some("600"),
        help: "space of a replaced write is reused after this many seconds",
    },
    FlagSpec {
        name: "pending_task_timeout_sec",
        kind: FlagKind::Value,
        env: None,
        default: Some("300"),
        help: "a copy/move task not started by its real client within this many seconds fails",
    },
    FlagSpec {
        name: "processing_task_timeout_sec",
        kind: FlagKind::Value,
        env: None,
        default: Some("300"),
        help: "a started copy/move task not finished within this many seconds fails",
    },
    FlagSpec {
        name: "allocation_strategy",
        kind: FlagKind::Value,
        env: None,
        default: Some("random"),
        help: "random or free_ratio_first",
    },
    FlagSpec {
        name: "cluster_id",
        kind: FlagKind::Value,
        env: Some("MC_STORE_CLUSTER_ID"),
        default: Some("mooncake_cluster"),
        help: "cluster name (HA namespace)",
    },
    FlagSpec {
        name: "metrics_port",
        kind: FlagKind::Value,
        env: None,
        default: Some("9003"),
        help: "HTTP port for /metrics (Prometheus text) and /health; 0 disables",
    },
    FlagSpec {
        name: "metrics_host",
        kind: FlagKind::Value,
        env: None,
        default: Some("0.0.0.0"),
        help: "address of the metrics HTTP server",
    },
    FlagSpec {
        name: "enable_metric_reporting",
        kind: FlagKind::Bool,
        env: None,
        default: Some("true"),
        help: "log a metrics summary every 10 s",
    },
    FlagSpec {
        name: "enable_ha",
        kind: FlagKind::Bool,
        env: None,
        default: Some("false"),
        help: "high availability through etcd (not available in this build)",
    },
    FlagSpec {
        name: "etcd_endpoints",
        kind: FlagKind::Value,
        env: None,
        default: Some(""),
        help: "etcd endpoints for --enable_ha",
    },
    FlagSpec {
        name: "enable_offload",
        kind: FlagKind::Bool,
        env: None,
        default: Some("false"),
        help: "let real clients with --enable_offload keep copies of objects on their SSD tier",
    },
    FlagSpec {
        name: "offload_on_evict",
        kind: FlagKind::Bool,
        env: None,
        default: Some("false"),
        help: "with --enable_offload: write objects to the SSD tier when they are chosen for eviction, not when written",
    },
    FlagSpec {
        name: "enable_http_metadata_server",
        kind: FlagKind::Bool,
        env: None,
        default: Some("false"),
        help: "accepted for compatibility; metadata travels through the master RPC",
    },
    FlagSpec {
        name: "log_level",
        kind: FlagKind::Value,
        env: None,
        default: Some("info"),
        help: "error, warn, info, debug or trace (RUST_LOG overrides)",
    },
];

/// Validated settings of a standalone master.
#[derive(Clone, Debug)]
pub struct MasterDaemonConfig {
    /// Where the RPC server listens.
    pub rpc_address: SocketAddr,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Where the metrics server listens (`None`: disabled).
    pub metrics_address: Option<SocketAddr>,
    /// Log a metrics summary every 10 s.
    pub metric_reporting: bool,
    /// Cluster name.
    pub cluster_id: String,
    /// The master's own settings.
    pub master: MasterConfig,
    /// Log filter.
    pub log_level: String,
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
    /// A value parsed but is not acceptable.
    #[error("invalid configuration: {0}")]
    Invalid(String),
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
        let mut flags = flags::parse(
            FLAGS,
            "mooncake_master",
            "the mooncake-rs master: object metadata, placement and leases for a cluster",
            args,
            |var| std::env::var(var).ok(),
        )?;
        if let Some(path) = flags.string("config_path") {
            let values = config_file::read(std::path::Path::new(&path))?;
            flags.merge_file(values, &[("client_live_ttl_sec", "client_ttl")])?;
        }
        Self::from_flags(&flags)
    }

    /// Builds and validates the settings.
    pub fn from_flags(flags: &ParsedFlags) -> Result<Self, DaemonConfigError> {
        if flags.bool("enable_ha")? {
            return Err(DaemonConfigError::Invalid(
                "--enable_ha: high availability through etcd is not available in this build".into(),
            ));
        }
        let rpc_port: u16 = number(flags, "rpc_port")?;
        let port = if rpc_port == 0 {
            number(flags, "port")?
        } else {
            rpc_port
        };
        let host = flags
            .string("rpc_address")
            .unwrap_or_else(|| "0.0.0.0".into());
        let metrics_port: u16 = number(flags, "metrics_port")?;
        let metrics_host = flags
            .string("metrics_host")
            .unwrap_or_else(|| "0.0.0.0".into());
        let strategy_text = flags.string("allocation_strategy").unwrap_or_default();
        let allocation_strategy = AllocationStrategy::parse(&strategy_text).ok_or_else(|| {
            DaemonConfigError::Invalid(format!(
                "--allocation_strategy {strategy_text:?}: use random or free_ratio_first"
            ))
        })?;
        let master = MasterConfig {
            default_kv_lease_ttl: millis(flags, "default_kv_lease_ttl")?,
            default_kv_soft_pin_ttl: millis(flags, "default_kv_soft_pin_ttl")?,
            max_kv_soft_pin_ttl: millis(flags, "max_kv_soft_pin_ttl")?,
            allow_evict_soft_pinned_objects: flags.bool("allow_evict_soft_pinned_objects")?,
            eviction_ratio: number(flags, "eviction_ratio")?,
            eviction_high_watermark_ratio: number(flags, "eviction_high_watermark_ratio")?,
            client_ttl: seconds(flags, "client_ttl")?,
            put_start_discard_timeout: seconds(flags, "put_start_discard_timeout_sec")?,
            put_start_release_timeout: seconds(flags, "put_start_release_timeout_sec")?,
            pending_task_timeout: seconds(flags, "pending_task_timeout_sec")?,
            processing_task_timeout: seconds(flags, "processing_task_timeout_sec")?,
            enable_offload: flags.bool("enable_offload")?,
            offload_on_evict: flags.bool("offload_on_evict")?,
            allocation_strategy,
            ..MasterConfig::default()
        };
        master.validate().map_err(DaemonConfigError::Invalid)?;
        let log_level = flags.string("log_level").unwrap_or_else(|| "info".into());
        if !flags::is_log_filter(&log_level) {
            return Err(DaemonConfigError::Invalid(format!(
                "--log_level {log_level:?}: use error, warn, info, debug or trace"
            )));
        }
        Ok(MasterDaemonConfig {
            rpc_address: address(&host, port, "rpc_address")?,
            threads: number(flags, "rpc_thread_num")?,
            metrics_address: if metrics_port == 0 {
                None
            } else {
                Some(address(&metrics_host, metrics_port, "metrics_host")?)
            },
            metric_reporting: flags.bool("enable_metric_reporting")?,
            cluster_id: flags.string("cluster_id").unwrap_or_default(),
            master,
            log_level,
        })
    }
}

/// Why the master could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The RPC port could not be bound.
    #[error(
        "cannot listen on {address}: {source}; is another mooncake_master running? choose another --rpc_port"
    )]
    Bind {
        /// The address.
        address: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

/// A master serving on its sockets, with its background tasks.
#[derive(Debug)]
pub struct RunningMaster {
    /// The master.
    pub master: Arc<MasterService>,
    /// Where the RPC server listens (the real port when 0 was asked).
    pub rpc_address: SocketAddr,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningMaster {
    /// Binds the RPC port and starts serving `master` (with maintenance) on the current
    /// runtime.
    pub async fn start(
        master: Arc<MasterService>,
        rpc_address: SocketAddr,
        master_id: u128,
    ) -> Result<Self, DaemonError> {
        let listener =
            TcpListener::bind(rpc_address)
                .await
                .map_err(|source| DaemonError::Bind {
                    address: rpc_address,
                    source,
                })?;
        let rpc_address = listener.local_addr().map_err(|source| DaemonError::Bind {
            address: rpc_address,
            source,
        })?;
        let (stop, _) = watch::channel(false);
        let handler = MasterHandler {
            master: Arc::clone(&master),
            master_id,
        };
        let tasks = vec![
            tokio::spawn(server::serve(listener, handler, stop.subscribe())),
            tokio::spawn(server::maintain(Arc::clone(&master), stop.subscribe())),
        ];
        Ok(RunningMaster {
            master,
            rpc_address,
            stop,
            tasks,
        })
    }

    /// Stops serving and waits for the background tasks.
    pub async fn stop(self) {
        self.stop.send_replace(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Runs a standalone master until `shutdown` completes.
pub async fn run(
    config: MasterDaemonConfig,
    master_id: u128,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), DaemonError> {
    let master = Arc::new(MasterService::new(config.master.clone(), Clock::System));
    let running = RunningMaster::start(Arc::clone(&master), config.rpc_address, master_id).await?;
    tracing::info!(
        rpc = %running.rpc_address,
        cluster_id = %config.cluster_id,
        lease_ttl_ms = config.master.default_kv_lease_ttl.as_millis(),
        client_ttl_s = config.master.client_ttl.as_secs(),
        eviction_high_watermark_ratio = config.master.eviction_high_watermark_ratio,
        eviction_ratio = config.master.eviction_ratio,
        allocation_strategy = ?config.master.allocation_strategy,
        metrics = ?config.metrics_address,
        "mooncake_master serving"
    );
    let metrics = config.metrics_address.map(|address| {
        tokio::spawn(crate::http::serve_master_metrics(
            address,
            Arc::clone(&master),
        ))
    });
    let reporting = config
        .metric_reporting
        .then(|| tokio::spawn(report_periodically(Arc::clone(&master))));
    shutdown.await;
    tracing::info!("shutdown requested");
    for task in metrics.into_iter().chain(reporting) {
        task.abort();
    }
    running.stop().await;
    Ok(())
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
