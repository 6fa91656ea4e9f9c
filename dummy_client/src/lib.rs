//! The mooncake-rs dummy client: the store client an inference rank embeds.
//!
//! It owns no store resources: it creates shared memory (a pool for zero-copy buffers
//! and a staging buffer for bytes and ordinary memory), registers it with the node's
//! real client (`mooncake_client`) over a Unix socket, and forwards every call there.
//! Payload bytes never cross the socket on the pointer calls (`put_from`, `get_into` and
//! their batch forms): the real client copies them directly between the segment and
//! this process's shared memory, or, for registered ordinary memory it is allowed to
//! reach, straight to and from that memory across processes. Registered GPU buffers are
//! copied by the real client's CUDA driver (their allocation opened from an IPC handle).
//!
//! With the `embedded` feature, [`DummyClient::setup_embedded`] runs the real client in
//! this process instead (the Python `setup()` mode); every call behaves the same.
//!
//! Return conventions follow upstream: every call returns a value or an
//! [`ErrorCode`](mooncake_core::ErrorCode) whose number is upstream's; batch calls return
//! one result per input.

mod buffer;
mod client;
mod connection;
mod declare;
mod device;
#[cfg(feature = "embedded")]
mod embedded;
pub mod host_memory;
mod memory;
mod pool;
mod query;
mod read;
mod slices;
mod spin;
mod user_memory;
mod write;

pub use buffer::BufferHandle;
pub use client::{CLIENT_ADDRESS_ENV, DummyClient, Health, SetupError};
pub use mooncake_core::error::{CodeResult, ErrorCode, ToRet};
pub use mooncake_core::master_api::{TaskInfo, TaskKind, TaskStatus};
pub use mooncake_core::spin::SpinError;
pub use mooncake_core::types::{
    ReplicaDescriptor, ReplicaLocation, ReplicateConfig, SoftPinAction,
};
pub use read::Nested;
pub use user_memory::copied_bytes as copied_through_staging_bytes;
