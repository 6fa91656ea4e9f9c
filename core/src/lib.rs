//! The shared vocabulary of mooncake-rs.
//!
//! * [`error`]: upstream-compatible [`ErrorCode`]s;
//! * [`types`]: keys, [`ReplicateConfig`](types::ReplicateConfig), replica descriptors;
//! * [`units`]: human sizes and durations;
//! * [`flags`]: the gflags-compatible command-line parser both binaries use;
//! * [`allocator`]: the range allocator behind segments and the dummy pool;
//! * [`master`]: the master service as a library;
//! * [`protocol`]: the dummy ↔ real client handshake and RPC definitions.

pub mod allocator;
pub mod error;
pub mod flags;
pub mod master;
pub mod protocol;
pub mod types;
pub mod units;

pub use error::{CodeResult, ErrorCode};
