//! [`ServerState`]: what every connection of one real client shares (the store, the
//! attached dummies, the bounds on peers, the counters), and the status report built
//! from it.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use mooncake_core::protocol::rpc::StatusReport;

use crate::handshake::ServerIdentity;
use crate::session::Sessions;
use crate::store::Store;

/// Handshakes in progress at once, each on a blocking thread; more connections are
/// refused ("busy") until one finishes.
pub const MAX_HANDSHAKES: usize = 64;

/// Refusals in progress at once; past it, a refused connection is closed without an
/// answer.
pub const MAX_REFUSALS: usize = 256;

/// Bounds on what connecting peers may spend before they are dummies: checked with the
/// peer's credentials, before any thread or buffer is given to it.
#[derive(Debug)]
pub struct Admission {
    pub(crate) handshakes: Arc<Semaphore>,
    pub(crate) refusals: AtomicUsize,
}

impl Default for Admission {
    fn default() -> Self {
        Admission {
            handshakes: Arc::new(Semaphore::new(MAX_HANDSHAKES)),
            refusals: AtomicUsize::new(0),
        }
    }
}

/// The read-lease quota of each dummy (see [`crate::read_leases`]).
#[derive(Debug, Clone, Copy)]
pub struct ReadLeaseQuota {
    /// Most bytes of objects one dummy may hold read leases on.
    pub max_bytes_per_dummy: u64,
    /// How long the master leases an object to a read.
    pub ttl: Duration,
}

/// State shared by every connection of one real client.
#[derive(Debug)]
pub struct ServerState {
    /// What dummies are told about this process.
    pub identity: ServerIdentity,
    /// Reads and writes.
    pub store: Arc<Store>,
    /// Attached dummies.
    pub sessions: Sessions,
    /// Uids allowed to attach (our own is always allowed).
    pub allowed_uids: Vec<u32>,
    /// When the process started serving.
    pub started: Instant,
    /// Operation counters.
    pub metrics: crate::metrics::Metrics,
    /// Bounds on connecting peers.
    pub admission: Admission,
    /// Most bytes of hard-pinned objects one dummy may hold.
    pub max_hard_pinned_bytes_per_dummy: u64,
    /// How much one dummy's reads may hold under read leases.
    pub read_leases: ReadLeaseQuota,
    /// Where the master is (`embedded`, `host:port` or `etcd://…`), for status reports.
    pub master_at: String,
    /// True while the dummies' connections drain for a handover (each session stops
    /// serving new requests and closes once those in flight are answered).
    pub drain: tokio::sync::watch::Sender<bool>,
    /// What this process took over, when it replaced another (`--takeover`).
    pub taken_over: parking_lot::Mutex<Option<mooncake_core::protocol::rpc::TakenOver>>,
}

impl ServerState {
    /// The status report served to `mooncake_cli status`.
    pub async fn status(&self) -> StatusReport {
        let dummies = self.sessions.infos();
        StatusReport {
            instance_id: self.identity.instance_id,
            pid: std::process::id(),
            segment_name: self.identity.segment_name.clone(),
            uptime_secs: self.started.elapsed().as_secs(),
            mapped_bytes: dummies.iter().map(|d| d.mapped_bytes).sum(),
            dummies,
            master: self.store.master().stats().await.unwrap_or_default(),
            master_at: self.master_at.clone(),
            remote_disk_reads: self.store.remote_disk_reads(),
            segment_bytes: self.store.segment().memory.len() as u64,
            segment_resident_bytes: self.store.segment().memory.resident_bytes(),
            staged_bytes: self.metrics.staged_bytes(),
            read_cache_hits: self.store.master().read_cache().hits(),
            reserved_puts: self.store.master().reservations().commits(),
            device_handles: mooncake_device::driver::open_handles(),
            segment_pinned_bytes: crate::device_buffers::segment_pinned_bytes(),
            taken_over: self.taken_over.lock().clone(),
        }
    }

    pub(crate) fn is_allowed(&self, uid: u32) -> bool {
        uid == nix::unistd::geteuid().as_raw() || self.allowed_uids.contains(&uid)
    }
}
