//! A real client's part in a handover: giving itself away ([`RealClient::give`]) and
//! starting from what another process gave ([`RealClient::take_over`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use tokio::sync::watch;

use mooncake_core::master_api::LOCAL_OWNER;
use mooncake_core::master_api::replication::SnapshotState;
use mooncake_core::tenant::Tenant;
use mooncake_master::{Clock, MasterService};
use mooncake_shm::SharedMemory;

use super::taking::{TakenFds, take};
use super::{HandedOver, Outcome, giving};
use crate::config::{ConfigError, RealClientConfig};
use crate::segment_file::SegmentFile;
use crate::transfer::TransferServer;
use crate::transfer::served::ServedSegment;
use crate::{
    Background, EmbeddedMaster, MasterChoice, RealClient, StartError, choose_master, master_link,
    open_disk_tier, open_rdma, reservations, server_state, store_for,
};

/// A refusal of `--takeover` for a setting that differs from the running process's.
fn mismatch(reason: String) -> StartError {
    StartError::Config(ConfigError::Invalid {
        flag: "takeover",
        reason,
    })
}

fn duplicate(fd: BorrowedFd<'_>) -> Result<OwnedFd, String> {
    fd.try_clone_to_owned()
        .map_err(|e| format!("cannot duplicate a descriptor to hand over: {e}"))
}

impl RealClient {
    /// Hands this node to the process on `asker` (dummies drained already): stops the
    /// background work and the embedded master, sends the state and descriptors, and
    /// waits for the new process to serve. On failure everything stopped here runs
    /// again and the reason is returned.
    pub(crate) async fn give(
        &mut self,
        dummies: &UnixListener,
        asker: UnixStream,
        background: Background,
        readiness: Option<&OwnedFd>,
    ) -> Result<(), String> {
        let started = Instant::now();
        background.stop().await;
        let stopped_ms = started.elapsed().as_millis();
        let embedded = self.embedded_master.take();
        let mut kept = None;
        let master_state = match embedded {
            Some(EmbeddedMaster {
                running,
                service,
                secret_file,
                listener,
                secret,
            }) => {
                running.stop().await;
                let snapshot = service.snapshot_state();
                kept = Some((service, secret_file, listener, secret));
                Some(snapshot)
            }
            None => None,
        };
        let snapshot_ms = started.elapsed().as_millis();
        let master_listener = kept
            .as_ref()
            .and_then(|(_, _, listener, _)| listener.as_ref());
        let segment = self.state.store.segment();
        let state = HandedOver {
            instance_id: self.state.identity.instance_id,
            client_id: self.client_id,
            segment_name: segment.name.clone(),
            segment_id: segment.id.load(Ordering::Acquire),
            segment_len: segment.memory.len() as u64,
            segment_path: segment.file.as_ref().map(|file| file.path().to_path_buf()),
            contributes: segment.contributes,
            endpoint: self.endpoint.clone(),
            objects: master_state.as_ref().map_or(0, |s| s.objects.len() as u64),
            master: master_state,
            has_readiness: readiness.is_some(),
            has_master_listener: master_listener.is_some(),
        };
        if let Some(file) = &segment.file {
            // The taker writes the journal from now on.
            file.pause_journal();
        }
        let fds = self.descriptors(dummies, readiness, master_listener);
        let outcome = match fds {
            Ok(fds) => tokio::task::spawn_blocking(move || {
                let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(AsFd::as_fd).collect();
                giving::hand_over(&asker, state, &borrowed)
            })
            .await
            .unwrap_or_else(|e| Err(e.to_string())),
            Err(reason) => Err(reason),
        };
        match outcome {
            Ok(()) => {
                if let Some(file) = &self.state.store.segment().file {
                    file.leave_lock_to_successor();
                }
                if let Some((_, secret_file, _, _)) = kept {
                    // The new process serves the embedded master under the same secret.
                    std::mem::forget(secret_file);
                }
                tracing::info!(
                    handover_ms = started.elapsed().as_millis(),
                    stopped_ms,
                    snapshot_ms,
                    "handed over to the new mooncake_client"
                );
                Ok(())
            }
            Err(reason) => {
                if let Some(file) = &self.state.store.segment().file {
                    file.resume_journal();
                }
                if let Some((service, secret_file, listener, secret)) = kept {
                    self.embedded_master = Some(resume_embedded_master(
                        service,
                        secret_file,
                        listener,
                        secret,
                    ));
                }
                Err(reason)
            }
        }
    }

    /// The descriptors a handover sends, in [`HandedOver`]'s order.
    fn descriptors(
        &self,
        dummies: &UnixListener,
        readiness: Option<&OwnedFd>,
        master: Option<&OwnedFd>,
    ) -> Result<Vec<OwnedFd>, String> {
        let segment = self.state.store.segment();
        let memfd = segment
            .memory
            .fd()
            .ok_or("the segment is not shared memory and cannot be handed over")?;
        let handover = self
            .handover
            .as_ref()
            .ok_or("this process has no handover socket")?;
        let mut fds = vec![
            duplicate(memfd)?,
            duplicate(dummies.as_fd())?,
            duplicate(self.transfer.listener().as_fd())?,
            duplicate(handover.as_fd())?,
        ];
        for fd in readiness.into_iter().chain(master) {
            fds.push(duplicate(fd.as_fd())?);
        }
        Ok(fds)
    }

    /// After a handover: the new process serves the sockets, the memory and the
    /// master's objects, so nothing is unmounted or removed; this process just ends.
    pub(crate) fn leave_to_successor(self) {
        tracing::info!("mooncake_client handed over; exiting");
    }

    /// `--takeover`: asks the real client on this node's socket to hand over, and
    /// starts from what it hands over; tells it the outcome.
    pub(crate) async fn take_over(config: RealClientConfig) -> Result<Self, StartError> {
        let started = Instant::now();
        let socket = config.socket.clone().ok_or_else(|| {
            mismatch("needs the dummy socket of the running mooncake_client (--port)".into())
        })?;
        let taken = tokio::task::spawn_blocking(move || take(&socket))
            .await
            .map_err(|e| StartError::Handover(std::io::Error::other(e.to_string())))??;
        let reporter = taken.reporter;
        match Self::start_from(config, taken.state, taken.fds, started).await {
            Ok(client) if reporter.report(&Outcome::Serving) => Ok(client),
            Ok(_) => Err(StartError::Handover(std::io::Error::other(
                "the running mooncake_client went away before it heard that this one serves; it may still serve: stop this one",
            ))),
            Err(error) => {
                reporter.report(&Outcome::Failed(error.to_string()));
                Err(error)
            }
        }
    }

    async fn start_from(
        config: RealClientConfig,
        mut state: HandedOver,
        fds: TakenFds,
        started: Instant,
    ) -> Result<Self, StartError> {
        let received_ms = started.elapsed().as_millis();
        if state.segment_name != config.segment_name() {
            return Err(mismatch(format!(
                "the running mooncake_client's segment is {}, this one's would be {}: give the same --host and --port",
                state.segment_name,
                config.segment_name()
            )));
        }
        let instance_id = state.instance_id;
        let tenant = Tenant::new(&config.tenant_id).map_err(StartError::Tenant)?;
        let snapshot = state.master.take();
        let chosen = adopt_master(&config, &state, snapshot, fds.master).await?;
        let installed_ms = started.elapsed().as_millis();
        let master = master_link::MasterLink::new(
            chosen.master,
            tenant,
            instance_id,
            config.read_cache,
            reservations::budget_for(config.global_segment_size),
        );
        let (memory, file) = taken_segment(&config, &state, fds.segment)?;
        let served = Arc::new(ServedSegment {
            memory,
            id: AtomicU64::new(state.segment_id),
            contributes: state.contributes,
            name: state.segment_name.clone(),
            writes: Default::default(),
            file,
        });
        crate::resume_segment_file(&served, None, chosen.embedded.as_ref());
        let disk = open_disk_tier(&config).await?;
        let rdma = open_rdma(&config, &served)?;
        let transfer = TransferServer::start_on(
            std::net::TcpListener::from(fds.transfer),
            Arc::clone(&served),
            disk.clone(),
            config.transfer_congestion.clone(),
            chosen.secret.clone(),
            rdma.clone(),
        )
        .map_err(StartError::Transfer)?;
        if let Some(disk) = &disk {
            crate::offload_loop::register(disk, &master, chosen.client_id)
                .await
                .map_err(StartError::Offload)?;
        }
        let store = store_for(&config, master, served, disk, rdma, chosen.secret);
        let listener = UnixListener::from(fds.dummies);
        let handover = UnixListener::from(fds.handover);
        let readiness = match fds.readiness {
            Some(fd) => {
                let listener = std::net::TcpListener::from(fd);
                Some(
                    listener
                        .set_nonblocking(true)
                        .and_then(|()| tokio::net::TcpListener::from_std(listener))
                        .map_err(StartError::Handover)?,
                )
            }
            None => None,
        };
        for socket in [&listener, &handover] {
            socket.set_nonblocking(true).map_err(StartError::Handover)?;
        }
        let server = Arc::new(server_state(&config, instance_id, store, started).await);
        *server.taken_over.lock() = Some(mooncake_core::protocol::rpc::TakenOver {
            from_pid: fds.giver_pid,
            segment_bytes: state.segment_len,
            objects: state.objects,
            took_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            at_unix_secs: mooncake_core::protocol::grant::now_secs(),
        });
        tracing::info!(
            segment = %state.segment_name,
            segment_bytes = state.segment_len,
            master_objects = state.objects,
            takeover_ms = started.elapsed().as_millis(),
            received_ms,
            installed_ms,
            "took over the running mooncake_client: same segment, sockets and instance"
        );
        let (shutdown, _) = watch::channel(false);
        Ok(RealClient {
            state: server,
            shutdown,
            listener: Some(listener),
            readiness,
            config,
            embedded_master: chosen.embedded,
            transfer,
            handover: Some(handover),
            client_id: chosen.client_id,
            endpoint: state.endpoint,
        })
    }
}

/// The segment handed over: the same memfd mapped again, or the same segment file
/// (which both processes must name alike).
fn taken_segment(
    config: &RealClientConfig,
    state: &HandedOver,
    fd: OwnedFd,
) -> Result<(Arc<SharedMemory>, Option<Arc<SegmentFile>>), StartError> {
    if state.segment_path != config.segment_path {
        let name = |path: &Option<std::path::PathBuf>| {
            path.as_ref()
                .map_or("none".to_string(), |p| p.display().to_string())
        };
        return Err(mismatch(format!(
            "the running mooncake_client keeps its segment in --segment_path={}, this one would use {}: give the same --segment_path",
            name(&state.segment_path),
            name(&config.segment_path)
        )));
    }
    if let Some(path) = &config.segment_path {
        let file = Arc::new(SegmentFile::from_handed_over(path, fd, state.segment_len)?);
        return Ok((Arc::clone(file.memory()), Some(file)));
    }
    let memory = SharedMemory::map_received(fd, state.segment_len).map_err(|source| {
        StartError::Segment {
            size: mooncake_core::units::format_size(state.segment_len),
            source,
        }
    })?;
    Ok((Arc::new(memory), None))
}

/// The master of a node taken over: the embedded master with the objects it had (on
/// the same loopback listener and secret), or the same remote master.
async fn adopt_master(
    config: &RealClientConfig,
    state: &HandedOver,
    snapshot: Option<SnapshotState>,
    listener: Option<OwnedFd>,
) -> Result<MasterChoice, StartError> {
    match (&config.master_address, snapshot) {
        (None, Some(snapshot)) => {
            let master = Arc::new(MasterService::new(config.master.clone(), Clock::System));
            master
                .install_snapshot(snapshot)
                .map_err(|reason| mismatch(format!("the embedded master's objects: {reason}")))?;
            let (embedded, secret) = match listener {
                None => {
                    let secret = match &config.cluster_secret {
                        Some(secret) => Arc::clone(secret),
                        None => Arc::new(
                            mooncake_core::protocol::auth::ClusterSecret::random(
                                "this process only",
                            )
                            .map_err(StartError::Secret)?,
                        ),
                    };
                    crate::unserved_embedded_master(config, master, secret).await?
                }
                Some(fd) => {
                    let listener = std::net::TcpListener::from(fd);
                    let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
                    let listener = listener
                        .set_nonblocking(true)
                        .and_then(|()| tokio::net::TcpListener::from_std(listener))
                        .map_err(|source| StartError::EmbeddedMasterPort { port, source })?;
                    let (secret, file) = match &config.cluster_secret {
                        Some(secret) => (Arc::clone(secret), None),
                        None => {
                            let (secret, file) =
                                mooncake_core::protocol::auth::adopt_local_master_secret(port)
                                    .ok_or_else(|| {
                                        mismatch(format!(
                                            "the embedded master's secret for port {port} is gone"
                                        ))
                                    })?;
                            (Arc::new(secret), Some(file))
                        }
                    };
                    crate::serve_embedded_master(config, master, listener, secret, file).await?
                }
            };
            Ok(MasterChoice {
                master: embedded.service.clone(),
                embedded: Some(embedded),
                client_id: LOCAL_OWNER,
                secret: Some(secret),
            })
        }
        (Some(_), None) => choose_master(config, state.instance_id).await,
        (Some(_), Some(_)) => Err(mismatch(
            "the running mooncake_client runs the embedded master: give no --master_server_address".into(),
        )),
        (None, None) => Err(mismatch(
            "the running mooncake_client follows a remote master: give the same --master_server_address".into(),
        )),
    }
}

/// Serves the embedded master again after a failed handover.
fn resume_embedded_master(
    service: Arc<MasterService>,
    secret_file: Option<mooncake_core::protocol::auth::LocalSecretFile>,
    listener: Option<OwnedFd>,
    secret: Arc<mooncake_core::protocol::auth::ClusterSecret>,
) -> EmbeddedMaster {
    let running = listener
        .as_ref()
        .and_then(|fd| duplicate(fd.as_fd()).ok())
        .and_then(|fd| {
            let listener = std::net::TcpListener::from(fd);
            listener.set_nonblocking(true).ok()?;
            tokio::net::TcpListener::from_std(listener).ok()
        })
        .and_then(|listener| {
            mooncake_master::running::RunningMaster::serve(
                Arc::clone(&service),
                listener,
                Some(Arc::clone(&secret)),
            )
            .ok()
        })
        .unwrap_or_else(|| mooncake_master::running::RunningMaster::unserved(Arc::clone(&service)));
    EmbeddedMaster {
        running,
        service,
        secret_file,
        listener,
        secret,
    }
}
