//! The mooncake-rs real client.
//!
//! One real client runs per node. It owns the node's contribution to the pool (the
//! global segment), runs the master in-process in the default single-node deployment,
//! and serves every dummy client (one per inference rank) on a Unix socket: dummies
//! register their shared memory once, then each request moves bytes directly between
//! that memory and the segment.
//!
//! * [`config`]: flags, environment and validation;
//! * [`server`]: listener, peer credential check, per-dummy tarpc channels;
//! * [`handshake`]: hello and shared-memory registration;
//! * [`session`]: per-dummy state, released when the dummy's connection closes;
//! * [`declared`]: ordinary memory a dummy declared, reached across processes;
//! * [`region`]: a range of a dummy's memory as the store copies it;
//! * [`rpc`]: the request handlers;
//! * [`store`]: puts and gets against the master and the segment.
//!
//! The binary is thin: [`cli::main`] parses flags and calls [`run`]. Embedders (the Python
//! `setup()` mode) call [`RealClient::start`] instead.

mod bounce;
pub mod cli;
mod config;
mod declared;
mod device_buffers;
mod disk;
mod disk_staging;
mod handover;
mod handshake;
mod hard_pins;
pub mod in_process;
mod liveness;
mod master_link;
mod metrics;
mod offload_loop;
mod protocol_choice;
mod read_cache;
mod read_leases;
mod readiness;
mod region;
mod reservations;
mod rpc;
pub mod segment_file;
pub mod server;
mod session;
mod state;
mod status_http;
mod store;
mod tasks;
pub mod transfer;
mod writes_in_flight;

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::watch;

use std::sync::atomic::{AtomicU64, Ordering};

use mooncake_core::ids::random_id;
use mooncake_core::master_api::{LOCAL_OWNER, Master};
use mooncake_core::protocol::auth::{self, ClusterSecret};
use mooncake_core::protocol::master_client::RemoteMaster;
use mooncake_core::tenant::Tenant;
use mooncake_core::units::format_size;
use mooncake_master::ha::follow::LeaderFollower;
use mooncake_master::running::RunningMaster;
use mooncake_master::{Clock, MasterService};
use mooncake_shm::SharedMemory;
use mooncake_shm::shared_memory::PageSize;

pub use config::{ConfigError, EmbeddedOptions, RealClientConfig};
use handshake::ServerIdentity;
use master_link::MasterLink;
use segment_file::SegmentFile;
use server::BindError;
use state::ReadLeaseQuota;
pub use state::ServerState;
use store::Store;
use transfer::rdma::RdmaTransport;
use transfer::rdma::node::RdmaNode;
use transfer::server::ServedSegment;
use transfer::{TransferClient, TransferServer, Transport};

/// Why the real client could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The dummy socket could not be bound.
    #[error(transparent)]
    Bind(#[from] BindError),
    /// The global segment could not be allocated.
    #[error("cannot allocate the global segment of {size}: {source}; lower --global_segment_size")]
    Segment {
        /// Requested size, formatted.
        size: String,
        /// The cause.
        source: mooncake_shm::ShmError,
    },
    /// The master refused the segment (or could not be reached).
    #[error(
        "the master refused to mount the global segment: {0}; check --master_server_address and that mooncake_master runs"
    )]
    Mount(mooncake_core::ErrorCode),
    /// The handover socket could not be bound.
    #[error("cannot listen for a handover: {0}")]
    Handover(std::io::Error),
    /// Taking over a running real client failed.
    #[error("{0}")]
    Takeover(#[from] handover::taking::TakeoverError),
    /// The transfer engine's port could not be bound.
    #[error("cannot start the transfer engine: {0}; check --host and --transfer_port")]
    Transfer(std::io::Error),
    /// The RDMA devices could not be opened, or the segment not registered on them.
    #[error("cannot start RDMA: {0}")]
    Rdma(mooncake_rdma::RdmaError),
    /// The tenant name is not valid.
    #[error("--tenant_id: {0}")]
    Tenant(String),
    /// A setting is unusable at startup (an address that does not resolve).
    #[error(transparent)]
    Config(ConfigError),
    /// The embedded master's loopback port is taken.
    #[error(
        "cannot serve the embedded master on 127.0.0.1:{port}: {source}; is another mooncake_client running on this machine? give it another --embedded_master_port, or 0 to not serve it"
    )]
    EmbeddedMasterPort {
        /// The port.
        port: u16,
        /// The OS error.
        source: std::io::Error,
    },
    /// A port of the embedded master's HTTP endpoints, or the readiness port asked for,
    /// is taken.
    #[error(
        "cannot listen on 127.0.0.1:{port} (--{flag}): {source}; is another process serving there? choose another port"
    )]
    HttpPort {
        /// The flag that named the port.
        flag: &'static str,
        /// The port.
        port: u16,
        /// The OS error.
        source: std::io::Error,
    },
    /// The cluster secret could not be created.
    #[error(transparent)]
    Secret(auth::SecretError),
    /// The SSD tier could not be opened.
    #[error("{0}")]
    Disk(String),
    /// The segment file (`--segment_path`) could not be used.
    #[error(transparent)]
    SegmentFile(#[from] segment_file::SegmentFileError),
    /// The master refused the SSD tier.
    #[error("the master refused the SSD tier: {0}; start mooncake_master with --enable_offload")]
    Offload(mooncake_core::ErrorCode),
}

/// A started real client: its state and the handle to stop it.
#[derive(Debug)]
pub struct RealClient {
    state: Arc<ServerState>,
    shutdown: watch::Sender<bool>,
    listener: Option<std::os::unix::net::UnixListener>,
    /// The readiness port's listener (see [`readiness`]).
    readiness: Option<tokio::net::TcpListener>,
    config: RealClientConfig,
    /// The embedded master's TCP server and maintenance (embedded mode only).
    embedded_master: Option<EmbeddedMaster>,
    /// Serves peers' reads and writes into our segment.
    transfer: TransferServer,
    /// Where a new process asks to take over (see [`handover`]).
    handover: Option<std::os::unix::net::UnixListener>,
    /// Our id at the master.
    client_id: u128,
    /// Where peers reach our transfer engine.
    endpoint: String,
}

/// The embedded master at work.
#[derive(Debug)]
struct EmbeddedMaster {
    /// Its maintenance, and its TCP server when served on loopback.
    running: RunningMaster,
    /// The service itself (its objects are handed over with the node).
    service: Arc<MasterService>,
    /// The secret file local processes read; removed on drop.
    secret_file: Option<auth::LocalSecretFile>,
    /// The loopback listener, kept to hand it to a new process.
    listener: Option<std::os::fd::OwnedFd>,
    /// The secret its connections prove (to serve it again after a failed handover).
    secret: Arc<ClusterSecret>,
}

/// Starts the embedded master: its maintenance loop, and (when a port is set) its TCP
/// server on loopback so other local processes can use it too. A busy port is an error:
/// another real client serves a master there. Connections must prove they know the
/// cluster secret (`--cluster_secret_file`, else a fresh secret written for this user's
/// processes only). Returns the master at work and the secret this node uses.
async fn start_embedded_master(
    config: &RealClientConfig,
    master: Arc<MasterService>,
) -> Result<(EmbeddedMaster, Arc<ClusterSecret>), StartError> {
    let port = config.embedded_master_port;
    if port == 0 {
        // Nobody else can reach this master: the transfer engine admits no peer.
        let secret = match &config.cluster_secret {
            Some(secret) => Arc::clone(secret),
            None => {
                Arc::new(ClusterSecret::random("this process only").map_err(StartError::Secret)?)
            }
        };
        return unserved_embedded_master(config, master, secret).await;
    }
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .map_err(|source| StartError::EmbeddedMasterPort { port, source })?;
    let (secret, secret_file) = match &config.cluster_secret {
        Some(secret) => (Arc::clone(secret), None),
        None => {
            let (secret, file) =
                auth::create_local_master_secret(port).map_err(StartError::Secret)?;
            (Arc::new(secret), Some(file))
        }
    };
    serve_embedded_master(config, master, listener, secret, secret_file).await
}

/// The embedded master without a TCP server: nobody else can reach it.
async fn unserved_embedded_master(
    config: &RealClientConfig,
    master: Arc<MasterService>,
    secret: Arc<ClusterSecret>,
) -> Result<(EmbeddedMaster, Arc<ClusterSecret>), StartError> {
    let mut running = RunningMaster::unserved(Arc::clone(&master));
    serve_master_http(config, &mut running).await?;
    let embedded = EmbeddedMaster {
        running,
        service: master,
        secret_file: None,
        listener: None,
        secret: Arc::clone(&secret),
    };
    Ok((embedded, secret))
}

/// Serves the embedded master on `listener` (loopback) to processes that prove `secret`.
async fn serve_embedded_master(
    config: &RealClientConfig,
    master: Arc<MasterService>,
    listener: tokio::net::TcpListener,
    secret: Arc<ClusterSecret>,
    secret_file: Option<auth::LocalSecretFile>,
) -> Result<(EmbeddedMaster, Arc<ClusterSecret>), StartError> {
    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
    let kept = {
        use std::os::fd::AsFd;
        listener
            .as_fd()
            .try_clone_to_owned()
            .map_err(|source| StartError::EmbeddedMasterPort { port, source })?
    };
    // The transfer engines that join this master check its grants. A master nobody
    // else can reach (port 0, above) has no peers to grant anything to: its reads skip
    // the signing.
    master.sign_transfers(Arc::clone(&secret));
    let mut running =
        RunningMaster::serve(Arc::clone(&master), listener, Some(Arc::clone(&secret))).map_err(
            |error| StartError::EmbeddedMasterPort {
                port,
                source: std::io::Error::other(error.to_string()),
            },
        )?;
    serve_master_http(config, &mut running).await?;
    let embedded = EmbeddedMaster {
        running,
        service: master,
        secret_file,
        listener: Some(kept),
        secret: Arc::clone(&secret),
    };
    Ok((embedded, secret))
}

/// Serves the embedded master's HTTP endpoints (`--metrics_port`) and upstream's HTTP
/// metadata store (`--enable_http_metadata_server`) on loopback, when asked.
async fn serve_master_http(
    config: &RealClientConfig,
    running: &mut RunningMaster,
) -> Result<(), StartError> {
    let bind = |flag: &'static str, port: u16| async move {
        tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .map_err(|source| StartError::HttpPort { flag, port, source })
    };
    if let Some(port) = config.master_http_port {
        running.serve_http(bind("metrics_port", port).await?);
    }
    if let Some(port) = config.metadata_http_port {
        running.serve_metadata(bind("http_metadata_server_port", port).await?);
    }
    Ok(())
}

/// The secret of a node whose master is at `address`: `--cluster_secret_file`, else
/// the secret a local real client wrote for its embedded master on that loopback port;
/// `None` (with a warning) when there is neither.
fn remote_master_secret(config: &RealClientConfig, address: &str) -> Option<Arc<ClusterSecret>> {
    if let Some(secret) = &config.cluster_secret {
        return Some(Arc::clone(secret));
    }
    if let Some(secret) = auth::find_local_master_secret(address) {
        tracing::debug!(secret = secret.origin(), "using the local master's secret");
        return Some(Arc::new(secret));
    }
    tracing::warn!(
        master = address,
        "no --cluster_secret_file: master and transfer connections are unauthenticated, and the transfer engine serves this node's memory to anyone who can reach its port (see docs/security.md)"
    );
    None
}

/// The master a real client found: the seam, the embedded master when there is one,
/// the id this client mounts under and the secret its connections prove.
struct MasterChoice {
    master: Arc<dyn Master>,
    embedded: Option<EmbeddedMaster>,
    client_id: u128,
    secret: Option<Arc<ClusterSecret>>,
}

/// Starts the embedded master, or reaches the one `--master_server_address` names (a
/// `mooncake_master`, or the leader of the moment for `etcd://…`).
async fn choose_master(
    config: &RealClientConfig,
    instance_id: u128,
) -> Result<MasterChoice, StartError> {
    let Some(address) = &config.master_address else {
        let master = Arc::new(MasterService::new(config.master.clone(), Clock::System));
        let (embedded, secret) = start_embedded_master(config, Arc::clone(&master)).await?;
        return Ok(MasterChoice {
            master,
            embedded: Some(embedded),
            client_id: LOCAL_OWNER,
            secret: Some(secret),
        });
    };
    let secret = remote_master_secret(config, address);
    let master: Arc<dyn Master> = match address.strip_prefix("etcd://") {
        Some(endpoints) => Arc::new(LeaderFollower::start(
            config::etcd_endpoints(endpoints).map_err(|reason| {
                StartError::Config(config::ConfigError::Invalid {
                    flag: "master_server_address",
                    reason,
                })
            })?,
            config.cluster_id.clone(),
            config.etcd_tls.clone(),
            secret.clone(),
            mooncake_master::ha::follow::DEFAULT_FAILOVER_WAIT,
        )),
        None => Arc::new(
            RemoteMaster::new(address.clone(), secret.clone()).with_caller_spin(config.caller_spin),
        ),
    };
    Ok(MasterChoice {
        master,
        embedded: None,
        client_id: instance_id,
        secret,
    })
}

/// Allocates this node's segment (one page for a pure client, which contributes no
/// memory) and starts faulting it in; with `--segment_path`, opens its file instead and
/// says what the file holds from an earlier process.
fn allocate_segment(
    config: &RealClientConfig,
) -> Result<(Arc<ServedSegment>, Option<segment_file::Found>), StartError> {
    let contributes = config.global_segment_size > 0;
    if !contributes {
        tracing::info!(
            "--global_segment_size=0: a pure client; it contributes no memory and places every object on other nodes"
        );
    }
    let (memory, file, found) = match &config.segment_path {
        Some(path) => {
            let (file, found) = SegmentFile::open(path, config.global_segment_size)?;
            let file = Arc::new(file);
            (Arc::clone(file.memory()), Some(file), Some(found))
        }
        None => {
            let memory = SharedMemory::create_populated(
                "mooncake_segment",
                // A pure client keeps one unused page, so the transfer engine has a segment.
                config.global_segment_size.max(1),
                PageSize::from_env(),
                false,
            )
            .map_err(|source| StartError::Segment {
                size: format_size(config.global_segment_size),
                source,
            })?;
            (Arc::new(memory), None, None)
        }
    };
    memory.prefault_in_background("segment-prefault");
    Ok((
        Arc::new(ServedSegment {
            memory,
            id: AtomicU64::new(0),
            contributes,
            name: config.segment_name(),
            writes: Default::default(),
            file,
        }),
        found,
    ))
}

/// With `--segment_path`: gives the embedded master the objects an earlier process
/// left whole in the file, then has it journal every change from now on. A remote
/// master keeps the objects itself (it gave the segment back at the mount, or not):
/// the journal is emptied, so that nothing it does not know of comes back later.
fn resume_segment_file(
    served: &ServedSegment,
    found: Option<segment_file::Found>,
    embedded: Option<&EmbeddedMaster>,
) {
    let Some(file) = &served.file else {
        return;
    };
    let Some(master) = embedded else {
        file.clear_journal();
        return;
    };
    let segment = served.id.load(Ordering::Acquire);
    if let Some(segment_file::Found::Kept { committed }) = found {
        let recovered = segment_file::recover(file, committed, &master.service, segment);
        tracing::info!(
            path = %file.path().display(),
            objects = recovered.objects,
            bytes = recovered.bytes,
            damaged = recovered.damaged,
            refused = recovered.refused,
            took_ms = recovered.elapsed.as_millis(),
            "restarted on the segment file: its whole objects are served again; damaged ones were dropped"
        );
        file.set_recovered(recovered);
    } else if let Some(segment_file::Found::Fresh {
        reason: Some(reason),
    }) = found
    {
        tracing::warn!(path = %file.path().display(), reason, "the segment file's objects were dropped");
    }
    let journal = segment_file::SegmentJournal::new(Arc::clone(file), segment);
    master.service.observe_objects(Arc::new(journal));
}

/// Opens the SSD tier when offload is configured (recovering what is on disk).
async fn open_disk_tier(
    config: &RealClientConfig,
) -> Result<Option<Arc<disk::DiskTier>>, StartError> {
    let Some(mut settings) = config.offload.clone() else {
        return Ok(None);
    };
    settings.node = config.segment_name();
    let (tier, _) = tokio::task::spawn_blocking(move || disk::DiskTier::open(settings))
        .await
        .map_err(|e| StartError::Disk(e.to_string()))?
        .map_err(|e| StartError::Disk(e.to_string()))?;
    Ok(Some(Arc::new(tier)))
}

/// Mounts the segment at the master (when it contributes memory) and registers the SSD
/// tier with what it holds.
async fn join_cluster(
    master: &MasterLink,
    client_id: u128,
    served: &ServedSegment,
    endpoint: &str,
    disk: Option<&disk::DiskTier>,
) -> Result<(), StartError> {
    if served.contributes {
        let id = master
            .mount_segment(client_id, served, endpoint)
            .await
            .map_err(StartError::Mount)?;
        served.id.store(id, Ordering::Release);
    }
    if let Some(disk) = disk {
        offload_loop::register(disk, master, client_id)
            .await
            .map_err(StartError::Offload)?;
    }
    Ok(())
}

/// Opens the RDMA devices `--protocol` chose and registers the segment on them (`None`
/// for TCP).
fn open_rdma(
    config: &RealClientConfig,
    served: &Arc<ServedSegment>,
) -> Result<Option<Arc<RdmaNode>>, StartError> {
    let Some(devices) = &config.transport.rdma_devices else {
        return Ok(None);
    };
    RdmaNode::open(devices, served)
        .map(Some)
        .map_err(StartError::Rdma)
}

/// The store over `master` and `served`, reaching peers over RDMA when `rdma` is
/// open, else over TCP.
fn store_for(
    config: &RealClientConfig,
    master: MasterLink,
    served: Arc<ServedSegment>,
    disk: Option<Arc<disk::DiskTier>>,
    rdma: Option<Arc<RdmaNode>>,
    secret: Option<Arc<ClusterSecret>>,
) -> Store {
    let peers = Arc::new(TransferClient::new(
        config.transfer_congestion.clone(),
        secret,
    ));
    let transport: Arc<dyn Transport> = match rdma {
        Some(node) => Arc::new(RdmaTransport::new(node, Arc::clone(&peers))),
        None => Arc::clone(&peers) as Arc<dyn Transport>,
    };
    Store::new(
        master,
        served,
        config.segment_name(),
        disk,
        transport,
        peers,
    )
}

/// What the RPC handlers share: the store, the limits on dummies, the counters.
async fn server_state(
    config: &RealClientConfig,
    instance_id: u128,
    store: Store,
    started: Instant,
) -> ServerState {
    // The master's read lease, for the quota on dummies' leases (the embedded master's
    // when a remote one does not answer yet).
    let read_lease_ttl = store
        .master()
        .read_lease_ttl()
        .await
        .unwrap_or(config.master.default_kv_lease_ttl);
    ServerState {
        identity: ServerIdentity {
            instance_id,
            segment_name: config.segment_name(),
            max_mapped_bytes: config.max_dummy_shm_size,
            max_total_mapped_bytes: config.max_total_dummy_shm_size,
            max_sessions: config.max_dummy_sessions,
        },
        store: Arc::new(store),
        sessions: Default::default(),
        allowed_uids: config.allowed_uids.clone(),
        started,
        metrics: Default::default(),
        admission: Default::default(),
        master_at: config
            .master_address
            .clone()
            .unwrap_or_else(|| "embedded".into()),
        max_hard_pinned_bytes_per_dummy: config.hard_pin_quota(),
        read_leases: ReadLeaseQuota {
            max_bytes_per_dummy: config.read_lease_quota(),
            ttl: read_lease_ttl,
        },
        drain: tokio::sync::watch::Sender::new(false),
        taken_over: parking_lot::Mutex::new(None),
    }
}

impl RealClient {
    /// Allocates and mounts the segment, starts the transfer engine and binds the
    /// socket; serving dummies starts with [`serve`](Self::serve). Must run inside a
    /// multi-threaded tokio runtime.
    pub async fn start(config: RealClientConfig) -> Result<Self, StartError> {
        if config.takeover {
            return Self::take_over(config).await;
        }
        let started = Instant::now();
        // Bind first: a second instance on the same socket must fail before it
        // allocates gigabytes of segment.
        let listener = config.socket.as_ref().map(server::bind).transpose()?;
        let handover = config
            .socket
            .as_ref()
            .map(|socket| handover::giving::listen(&handover::socket_for(socket)))
            .transpose()
            .map_err(StartError::Handover)?;
        let readiness = readiness::bind(config.readiness_port, config.readiness_port_asked)
            .await
            .map_err(|source| StartError::HttpPort {
                flag: "readiness_port",
                port: config.readiness_port,
                source,
            })?;
        let instance_id = random_id();
        let tenant = Tenant::new(&config.tenant_id).map_err(StartError::Tenant)?;
        let transfer_bind = config.transfer_bind().map_err(StartError::Config)?;
        let chosen = choose_master(&config, instance_id).await?;
        let master = MasterLink::new(
            chosen.master,
            tenant,
            instance_id,
            config.read_cache,
            reservations::budget_for(config.global_segment_size),
        );
        let (served, found) = allocate_segment(&config)?;
        let disk = open_disk_tier(&config).await?;
        let rdma = open_rdma(&config, &served)?;
        let transfer = TransferServer::start(
            transfer_bind,
            Arc::clone(&served),
            disk.clone(),
            config.transfer_congestion.clone(),
            chosen.secret.clone(),
            rdma.clone(),
        )
        .map_err(StartError::Transfer)?;
        let endpoint = format!("{}:{}", config.advertised_host(), transfer.address().port());
        join_cluster(
            &master,
            chosen.client_id,
            &served,
            &endpoint,
            disk.as_deref(),
        )
        .await?;
        resume_segment_file(&served, found, chosen.embedded.as_ref());
        let recovered = served.file.as_ref().and_then(|file| file.recovered());
        let store = store_for(&config, master, served, disk, rdma, chosen.secret);
        let state = Arc::new(server_state(&config, instance_id, store, started).await);
        if let Some(recovered) = recovered {
            // A restart after a crash shows like a handover from no process (pid 0).
            *state.taken_over.lock() = Some(mooncake_core::protocol::rpc::TakenOver {
                from_pid: 0,
                segment_bytes: recovered.bytes,
                objects: recovered.objects,
                took_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
                at_unix_secs: mooncake_core::protocol::grant::now_secs(),
            });
        }
        let (shutdown, _) = watch::channel(false);
        Ok(RealClient {
            state,
            shutdown,
            listener,
            readiness,
            config,
            embedded_master: chosen.embedded,
            transfer,
            handover,
            client_id: chosen.client_id,
            endpoint,
        })
    }

    /// The shared state (store, sessions), for embedders.
    pub fn state(&self) -> &Arc<ServerState> {
        &self.state
    }

    /// A handle that stops [`serve`](Self::serve) when sent `true`.
    pub fn shutdown_handle(&self) -> watch::Sender<bool> {
        self.shutdown.clone()
    }

    /// Serves dummies (and heartbeats to a remote master) until the shutdown handle
    /// fires, then unmounts and cleans up.
    pub async fn serve(mut self) {
        let listener = self.listener.take();
        let readiness = self.readiness.take();
        let readiness_at = readiness.as_ref().and_then(|l| l.local_addr().ok());
        let config = &self.config;
        tracing::info!(
            socket = %config.socket.as_ref().map_or("none (in-process only)".to_string(), ToString::to_string),
            segment = %self.state.identity.segment_name,
            transfer_endpoint = %self.endpoint,
            global_segment_size = %format_size(config.global_segment_size),
            master = %config.master_address.as_deref().unwrap_or("embedded"),
            embedded_master_tcp = ?self.embedded_master.as_ref().and_then(|m| m.running.rpc_address),
            readiness = ?readiness_at,
            master_http = ?config.master_http_port,
            http_metadata = ?config.metadata_http_port,
            protocol = if config.transport.rdma_devices.is_some() { "rdma" } else { "tcp" },
            protocol_reason = %config.transport.reason,
            max_dummy_shm_size = %format_size(config.max_dummy_shm_size),
            max_total_dummy_shm_size = %format_size(config.max_total_dummy_shm_size),
            max_dummy_sessions = config.max_dummy_sessions,
            lease_ttl_ms = config.master.default_kv_lease_ttl.as_millis(),
            allowed_uids = ?config.allowed_uids,
            threads = config.threads,
            keep_awake_us = mooncake_core::keep_awake::window().as_micros(),
            tenant = %config.tenant_id,
            instance = %format!("{:032x}", self.state.identity.instance_id),
            startup_ms = self.state.started.elapsed().as_millis(),
            "mooncake_client serving"
        );
        let mut background = self.spawn_background();
        let readiness_copy = readiness.as_ref().and_then(|listener| {
            use std::os::fd::AsFd;
            listener.as_fd().try_clone_to_owned().ok()
        });
        let readiness = readiness.map(|listener| {
            tokio::spawn(mooncake_core::http::serve_listener(
                listener,
                readiness::router(),
            ))
        });
        let http = config.http_port.map(|port| {
            let address = std::net::SocketAddr::new(config.http_host, port);
            tokio::spawn(status_http::serve(address, Arc::clone(&self.state)))
        });
        let (ask, mut asks) = tokio::sync::mpsc::channel(1);
        let asks_task = self
            .handover
            .as_ref()
            .and_then(|listener| listener.try_clone().ok())
            .map(|listener| tokio::spawn(handover::giving::take_asks(listener, ask)));
        let mut listener = listener;
        let handed_over = loop {
            let shutdown = self.shutdown.subscribe();
            let Some(dummies) = listener.take() else {
                let mut shutdown = shutdown;
                let _ = shutdown.wait_for(|stop| *stop).await;
                break Some(background);
            };
            match server::serve(dummies, Arc::clone(&self.state), shutdown, &mut asks).await {
                server::Served::Stopped => break Some(background),
                server::Served::HandingOver {
                    listener: dummies,
                    asker,
                } => {
                    match self
                        .give(&dummies, asker, background, readiness_copy.as_ref())
                        .await
                    {
                        Ok(()) => break None,
                        Err(reason) => {
                            tracing::error!(%reason, "the handover failed; serving on");
                            self.state.drain.send_replace(false);
                            background = self.spawn_background();
                            listener = Some(dummies);
                        }
                    }
                }
            }
        };
        for task in http.into_iter().chain(readiness).chain(asks_task) {
            task.abort();
        }
        let Some(background) = handed_over else {
            self.leave_to_successor();
            return;
        };
        background.stop().await;
        let store = &self.state.store;
        if let Err(code) = store.master().unmount_client(self.client_id).await {
            tracing::warn!(%code, "unmount at shutdown failed");
        }
        if let Some(embedded) = self.embedded_master.take() {
            embedded.running.stop().await;
        }
        if let Some(socket @ mooncake_core::protocol::address::SocketAddress::Path(path)) =
            &self.config.socket
        {
            let _ = std::fs::remove_file(path);
            if let mooncake_core::protocol::address::SocketAddress::Path(handover) =
                handover::socket_for(socket)
            {
                let _ = std::fs::remove_file(handover);
            }
        }
        tracing::info!("mooncake_client stopped");
    }

    /// Starts the work that runs beside serving dummies: heartbeats to a remote
    /// master, the SSD tier's feeding, copy and move tasks.
    fn spawn_background(&self) -> Background {
        let (stop, _) = watch::channel(false);
        let mut tasks = Vec::new();
        if self.state.store.master().is_remote() {
            tasks.push(tokio::spawn(liveness::heartbeat(
                Arc::clone(&self.state),
                self.client_id,
                self.endpoint.clone(),
                stop.subscribe(),
            )));
        }
        if let Some(disk) = self.state.store.disk() {
            tasks.push(tokio::spawn(offload_loop::offload_loop(
                Arc::clone(disk),
                Arc::clone(&self.state.store),
                self.client_id,
                stop.subscribe(),
            )));
        }
        tasks.push(tokio::spawn(tasks::execute(
            Arc::clone(&self.state),
            self.client_id,
            stop.subscribe(),
        )));
        Background { stop, tasks }
    }
}

/// The work beside serving dummies, and the switch that stops it.
#[derive(Debug)]
struct Background {
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Background {
    /// Stops every task and waits for them.
    async fn stop(self) {
        self.stop.send_replace(true);
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// Runs a real client until `shutdown` completes.
pub async fn run(
    config: RealClientConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), StartError> {
    let client = RealClient::start(config).await?;
    let stop = client.shutdown_handle();
    let mut serving = tokio::spawn(client.serve());
    tokio::select! {
        () = shutdown => {
            tracing::info!("shutdown requested: no longer accepting dummies");
            stop.send_replace(true);
            let _ = serving.await;
        }
        // Serving ended on its own: handed over to a new process.
        _ = &mut serving => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stop requested before `serve` subscribes (an embedded store closed right after
    /// setup) must still stop it.
    #[test]
    fn a_stop_requested_before_serving_is_not_lost() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let args = [
            format!("--port={}", 40000 + std::process::id() % 20000),
            "--global_segment_size=16MB".to_string(),
            "--embedded_master_port=0".to_string(),
            "--transfer_port=0".to_string(),
        ];
        let config = RealClientConfig::from_args(args).expect("valid flags");
        runtime.block_on(async {
            let client = RealClient::start(config).await.expect("starts");
            client.shutdown_handle().send_replace(true);
            tokio::time::timeout(std::time::Duration::from_secs(10), client.serve())
                .await
                .expect("serve returns after a stop requested before it ran");
        });
    }
}
