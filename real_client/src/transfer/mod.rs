//! The TCP transfer engine: moves bytes between this node's memory (its segment, or a
//! dummy's shared memory) and another real client's segment.
//!
//! Each real client serves reads and writes into its own segment to its peers
//! ([`server`]); to reach a peer it keeps a pool of connections ([`client`]), so
//! concurrent transfers use several connections. A transfer is one request followed by
//! the whole payload, streamed straight from or into the mapped memory: no round trip
//! per chunk and no intermediate buffer. TCP_NODELAY is set on every connection.
//!
//! ```text
//! request  := magic "MCTE" | op u8 (1 read, 2 write) | 0 u8 x3 | segment u64 LE
//!             | offset u64 LE | len u64 LE          (32 bytes; a write's payload follows)
//! response := status i32 LE (0 or a negative ErrorCode) | 0 u32 | len u64 LE
//!             (16 bytes; a successful read's payload follows)
//! ```

pub mod client;
pub mod server;
mod wire;

pub use client::TransferClient;
pub use server::TransferServer;
