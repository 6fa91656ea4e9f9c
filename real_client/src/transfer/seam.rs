//! The transport seam: how this node's memory and a peer's segment exchange bytes,
//! whatever carries them. One [`Transport`] is chosen at startup (`--protocol`):
//! [`TransferClient`](super::TransferClient) over TCP, or
//! [`RdmaTransport`](super::rdma::RdmaTransport) with one-sided RDMA reads and
//! writes. Copies within this node never reach a transport (they are memcpy).
//!
//! Every implementation keeps the same promises, which the conformance suite
//! (`real_client/tests/transport_conformance.rs`) checks against each:
//! * one result per transfer, in order; a refused or failed transfer fails alone
//!   unless the channel to the peer broke, which fails the transfers still on it;
//! * a transfer outside the peer's segment is refused (`INVALID_PARAMS`), a segment
//!   the peer no longer serves is `SEGMENT_NOT_FOUND`, anything that breaks on the
//!   way is `TRANSFER_FAIL`;
//! * nothing waits past the deadline: what is unfinished then fails with
//!   `TRANSFER_FAIL`;
//! * with a cluster secret, a peer that cannot prove membership reaches nothing.

use std::time::{Duration, Instant};

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::grant::GrantedRange;
use mooncake_shm::MemSlice;

/// Longest a batch of peer transfers may take before its unfinished items fail.
pub const TRANSFER_DEADLINE: Duration = Duration::from_secs(30);

/// One copy between local memory and a range of a peer's segment.
#[derive(Clone, Copy, Debug)]
pub struct Transfer<'a> {
    /// The peer's segment id.
    pub segment: u64,
    /// Offset in that segment.
    pub offset: u64,
    /// The master's grant for the replica the range lies in (with a cluster secret).
    pub grant: Option<GrantedRange>,
    /// The local memory: read from for a write, filled by a read.
    pub local: &'a MemSlice,
}

/// Which way a transfer's bytes go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// From the peer's segment into local memory.
    Read,
    /// From local memory into the peer's segment.
    Write,
}

/// Moves bytes between this node's memory and peers' segments.
pub trait Transport: Send + Sync + std::fmt::Debug {
    /// The protocol's name, as `--protocol` spells it (`tcp`, `rdma`).
    fn name(&self) -> &'static str;

    /// True when peers read and write this node's segment without its CPU (one-sided
    /// RDMA): the store must then finish copying a value before its key becomes
    /// readable, since no reader can be made to wait for the copy.
    fn serves_one_sided(&self) -> bool {
        false
    }

    /// Moves every transfer in `direction` between its local memory and the peer's
    /// segment; `peer` is the peer's transfer endpoint (`host:port`). One result per
    /// transfer, in order.
    fn run(
        &self,
        peer: &str,
        direction: Direction,
        transfers: &[Transfer<'_>],
        deadline: Instant,
    ) -> Vec<CodeResult<()>>;

    /// Fills every transfer's local memory from the peer's segment.
    fn read_many(
        &self,
        peer: &str,
        transfers: &[Transfer<'_>],
        deadline: Instant,
    ) -> Vec<CodeResult<()>> {
        self.run(peer, Direction::Read, transfers, deadline)
    }

    /// One transfer in `direction`, with the default deadline.
    fn run_one(&self, peer: &str, direction: Direction, transfer: Transfer<'_>) -> CodeResult<()> {
        self.run(peer, direction, std::slice::from_ref(&transfer), deadline())
            .into_iter()
            .next()
            .unwrap_or(Err(ErrorCode::TRANSFER_FAIL))
    }

    /// Copies every transfer's local memory into the peer's segment.
    fn write_many(
        &self,
        peer: &str,
        transfers: &[Transfer<'_>],
        deadline: Instant,
    ) -> Vec<CodeResult<()>> {
        self.run(peer, Direction::Write, transfers, deadline)
    }
}

/// The deadline of a batch that starts now.
pub fn deadline() -> Instant {
    Instant::now() + TRANSFER_DEADLINE
}
