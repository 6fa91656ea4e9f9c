//! [`RunningMaster`]: a master at work, whoever runs it (the `mooncake_master` daemon,
//! or a real client's embedded master): its one maintenance task and, when served, its
//! RPC server.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;

use mooncake_core::master_api::Master;
use mooncake_core::protocol::auth::ClusterSecret;

use crate::MasterService;
use crate::server::{self, MasterHandler};

/// The master's RPC port could not be bound (or its address read back).
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot listen on {address}: {source}; is another mooncake_master running? choose another --rpc_port"
)]
pub struct BindError {
    /// The address.
    pub address: SocketAddr,
    /// The OS error.
    #[source]
    pub source: std::io::Error,
}

/// A master at work: its one maintenance task (eviction, lease and client expiry, task
/// timeouts) and, when served, its RPC server. Whatever serves a master, it is
/// maintained by exactly one task: this one.
#[derive(Debug)]
pub struct RunningMaster {
    /// The master.
    pub master: Arc<MasterService>,
    /// Where the RPC server listens (the real port when 0 was asked); `None` when the
    /// master is not served (an embedded master nobody else reaches).
    pub rpc_address: Option<SocketAddr>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    /// Its HTTP servers (aborted when it stops or is dropped).
    http: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for RunningMaster {
    fn drop(&mut self) {
        for task in &self.http {
            task.abort();
        }
    }
}

impl RunningMaster {
    /// Binds the RPC port and starts serving `master` (with maintenance) on the current
    /// runtime; with `secret`, every connection must prove cluster membership.
    pub async fn start(
        master: Arc<MasterService>,
        rpc_address: SocketAddr,
        secret: Option<Arc<ClusterSecret>>,
    ) -> Result<Self, BindError> {
        let listener = TcpListener::bind(rpc_address)
            .await
            .map_err(|source| BindError {
                address: rpc_address,
                source,
            })?;
        Self::serve(master, listener, secret)
    }

    /// Starts serving `master` (with maintenance) on a bound `listener`.
    pub fn serve(
        master: Arc<MasterService>,
        listener: TcpListener,
        secret: Option<Arc<ClusterSecret>>,
    ) -> Result<Self, BindError> {
        let rpc_address = listener.local_addr().map_err(|source| BindError {
            address: SocketAddr::from(([0, 0, 0, 0], 0)),
            source,
        })?;
        let mut running = Self::unserved(master);
        let handler = MasterHandler::new(
            Arc::clone(&running.master) as Arc<dyn Master>,
            Arc::clone(running.master.rpc_metrics()),
        );
        running.tasks.push(tokio::spawn(server::serve(
            listener,
            handler,
            secret,
            running.stop.subscribe(),
        )));
        running.rpc_address = Some(rpc_address);
        Ok(running)
    }

    /// Starts `master`'s maintenance only: a master that is not served (embedded, and
    /// reached by nobody else).
    pub fn unserved(master: Arc<MasterService>) -> Self {
        let (stop, _) = watch::channel(false);
        let tasks = vec![tokio::spawn(server::maintain(
            Arc::clone(&master),
            stop.subscribe(),
        ))];
        RunningMaster {
            master,
            rpc_address: None,
            stop,
            tasks,
            http: Vec::new(),
        }
    }

    /// Also serves the master's HTTP endpoints on `listener` (`/health`,
    /// `/get_all_segments`, `/query_key`, `/get_all_keys`, `/metrics`,
    /// `/metrics/summary`: what `mooncake_master` serves on `--metrics_port`), until it
    /// stops.
    pub fn serve_http(&mut self, listener: TcpListener) {
        let router = crate::admin_http::router(Arc::clone(&self.master), None);
        self.http
            .push(tokio::spawn(mooncake_core::http::serve_listener(
                listener, router,
            )));
    }

    /// Also serves upstream's HTTP metadata store (`/metadata`) on `listener`, until it
    /// stops.
    pub fn serve_metadata(&mut self, listener: TcpListener) {
        let store = Arc::new(crate::http_metadata::MetadataStore::default());
        self.http
            .push(tokio::spawn(mooncake_core::http::serve_listener(
                listener,
                store.router(),
            )));
    }

    /// Stops serving and maintaining, and waits for the background tasks.
    pub async fn stop(mut self) {
        self.stop.send_replace(true);
        for task in self.http.drain(..) {
            task.abort();
        }
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}
