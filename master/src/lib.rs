//! The master of mooncake-rs: object metadata, placement, leases and eviction.
//!
//! `mooncake_client` embeds it (the default, single-node deployment); the standalone
//! `mooncake_master` ([`daemon`]) serves the same code over the network ([`server`]).
//! [`MasterService`] answers the [`Master`](mooncake_core::master_api::Master) seam
//! directly ([`seam`]), so the embedded and the served master are one implementation.
//!
//! Writes are two-phase: [`MasterService::put_start`] allocates space and records the
//! object as *processing*, the writer copies the bytes, then [`MasterService::put_end`]
//! makes it readable (or [`MasterService::put_revoke`] undoes it). A key that exists is
//! never overwritten by a put. Reads ([`MasterService::get_replica_list`],
//! [`MasterService::exist`]) grant a lease during which a non-forced remove is refused
//! with `OBJECT_HAS_LEASE`; space of an object removed by force while leased is held
//! until the lease ends, so an in-flight reader never sees reused memory. Eviction frees
//! the least recently used objects (by last read or write) once memory use passes the
//! high watermark.
//!
//! Crate map: [`service`](MasterService) (the object table and its operations),
//! `eviction` (maintenance and eviction), `segments`, `clients` (liveness), `tasks`
//! (copy and move), `objects` (per-object state); [`server`] (the RPC handler and the
//! maintenance task), [`daemon`] (the `mooncake_master` process), `admin_http`
//! (`/metrics` and the query endpoints), `http_metadata` (upstream's HTTP metadata
//! store), [`command`] (the command-line entry point), [`ha`] (high availability:
//! etcd election, hot standbys, leader-following clients).

mod admin_http;
mod clients;
mod clock;
pub mod command;
mod config;
mod daemon;
mod eviction;
pub mod ha;
mod http_metadata;
pub mod journal;
mod objects;
pub mod running;
mod seam;
mod segments;
mod server;
mod service;
mod tasks;

pub use clock::Clock;
pub use config::{AllocationStrategy, MAX_ENTRY_TTL, MAX_LEASE_TTL, MasterConfig};
pub use eviction::{EvictionReport, MaintenanceReport};
pub use mooncake_core::master_api::{
    ClientStatus, LOCAL_OWNER, MasterStats, OffloadWork, PutStarted, SegmentUsage, TaskInfo,
    TaskKind, TaskStatus, TaskWork,
};
pub use segments::MountedSegment;
pub use service::{DiskCopy, MAX_REGEX_LEN, MasterService, ObjectObserver};
pub use tasks::{MAX_ACTIVE_TASKS, MAX_FINISHED_TASKS};
