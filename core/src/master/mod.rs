//! The master service as a library: object metadata, placement and leases.
//!
//! `mooncake_client` embeds it (the default, single-node deployment); the standalone
//! `mooncake_master` serves the same code over the network.
//!
//! Writes are two-phase: [`MasterService::put_start`] allocates space and records the
//! object as *processing*, the writer copies the bytes, then [`MasterService::put_end`]
//! makes it readable (or [`MasterService::put_revoke`] undoes it). A key that exists is
//! never overwritten by a put. Reads ([`MasterService::get_replica_list`],
//! [`MasterService::exist`]) grant a lease during which a non-forced remove is refused
//! with `OBJECT_HAS_LEASE`; space of an object removed by force while leased is held
//! until the lease ends, so an in-flight reader never sees reused memory.

mod admin_http;
mod clients;
mod clock;
pub mod command;
mod config;
pub mod daemon;
mod eviction;
mod objects;
mod segments;
pub mod server;
mod service;
mod tasks;

pub use clients::ClientStatus;
pub use clock::Clock;
pub use config::{AllocationStrategy, MasterConfig};
pub use eviction::{EvictionReport, MaintenanceReport};
pub use segments::{MountedSegment, SegmentUsage};
pub use service::{
    DiskCopy, LOCAL_OWNER, MAX_REGEX_LEN, MasterService, MasterStats, OffloadWork, PutStarted,
};
pub use tasks::{MAX_ACTIVE_TASKS, MAX_FINISHED_TASKS, TaskInfo, TaskKind, TaskStatus, TaskWork};
