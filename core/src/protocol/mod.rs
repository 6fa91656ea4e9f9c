//! What the dummy client and the real client say to each other.
//!
//! A connection starts with a short handshake of length-prefixed postcard frames
//! ([`handshake`]), during which shared-memory file descriptors travel as SCM_RIGHTS
//! ancillary data. After it the same stream carries tarpc requests of
//! [`rpc::RealClientRpc`], framed by [`codec`].

pub mod address;
pub mod auth;
pub mod blocking;
pub mod bounded;
pub mod codec;
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod grant;
pub mod handshake;
pub mod master_client;
pub mod master_rpc;
pub mod rpc;
pub mod serving;
pub mod unix_stream;

/// Version of the dummy ↔ real protocol; both sides must agree exactly.
pub const PROTOCOL_VERSION: u32 = 11;
