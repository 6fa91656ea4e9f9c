//! The shared vocabulary of mooncake-rs.
//!
//! * [`error`]: upstream-compatible [`ErrorCode`]s;
//! * [`types`]: keys, [`ReplicateConfig`](types::ReplicateConfig), replica descriptors;
//! * [`units`]: human sizes and durations;
//! * [`flags`], [`config_file`]: the gflags-compatible command-line parser both
//!   binaries use, and flat JSON/YAML configuration files;
//! * [`allocator`]: the range allocator behind segments and the dummy pool;
//! * [`master`]: the master service as a library;
//! * [`protocol`]: the dummy ↔ real client handshake and RPC definitions.

pub mod allocator;
pub mod config_file;
pub mod error;
pub mod flags;
pub mod http;
pub mod http_metadata;
pub mod logging;
pub mod master;
pub mod op_metrics;
pub mod process;
pub mod protocol;
pub mod tenant;
pub mod types;
pub mod units;

pub use error::{CodeResult, ErrorCode};
