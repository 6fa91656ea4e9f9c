//! RDMA for mooncake-rs: the verbs a transfer engine needs, with libibverbs loaded at
//! run time so that nothing links against it.
//!
//! * [`library`]: loading libibverbs (or the library `MOONCAKE_IBVERBS_LIBRARY`
//!   names);
//! * [`device`]: listing and choosing devices, an opened [`Device`] with its
//!   protection domain and port address;
//! * [`memory`]: registered [`MemoryRegion`]s;
//! * [`queue_pair`]: reliable-connected [`QueuePair`]s running batches of one-sided
//!   reads and writes, completions polled by the caller;
//! * [`fake`]: the stand-in provider the tests run on;
//! * `verbs`: the binary interface of libibverbs we rely on.
//!
//! The transport that moves a real client's bytes over these lives in the real
//! client (`transfer::rdma`).

pub mod device;
mod error;
pub mod fake;
pub mod library;
pub mod memory;
pub mod queue_pair;
mod verbs;

pub use device::{Device, PortAddress, choose_devices, device_names};
pub use error::RdmaError;
pub use memory::{MemoryRegion, Reach};
pub use queue_pair::{Direction, Endpoint, QueuePair, Work, WorkError};
