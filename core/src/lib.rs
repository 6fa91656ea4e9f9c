//! The shared vocabulary of mooncake-rs.
//!
//! * [`error`]: upstream-compatible [`ErrorCode`]s;
//! * [`types`]: keys, [`ReplicateConfig`](types::ReplicateConfig), replica descriptors;
//! * [`units`]: human sizes and durations;
//! * [`flags`], [`config_file`]: the gflags-compatible command-line parser both
//!   binaries use, and flat JSON/YAML configuration files;
//! * [`allocator`]: the range allocator behind segments and the dummy pool;
//! * [`master_api`]: the master seam ([`Master`](master_api::Master)), every master
//!   call declared once ([`MasterRequest`](master_api::MasterRequest)), typed helpers
//!   ([`MasterExt`](master_api::MasterExt)) and the values they carry (the master
//!   service itself lives in the `mooncake-master` crate);
//! * [`protocol`]: the dummy ↔ real client handshake, the RPC definitions and
//!   [`RemoteMaster`](protocol::master_client::RemoteMaster), a master reached over TCP;
//! * [`failpoint`]: named places where tests make production failures happen
//!   (evaluated only in builds with the `failpoints` feature);
//! * [`ids`]: random identifiers of processes, clients and tasks;
//! * [`stand_in`]: stand-in native libraries compiled for tests (GPU drivers, verbs).

pub mod allocator;
pub mod config_file;
pub mod error;
pub mod failpoint;
pub mod flags;
pub mod http;
pub mod ids;
pub mod keep_awake;
pub mod logging;
pub mod master_api;
pub mod op_metrics;
pub mod process;
pub mod protocol;
pub mod spin;
pub mod stand_in;
pub mod tenant;
pub mod types;
pub mod units;

pub use error::{CodeResult, ErrorCode};
