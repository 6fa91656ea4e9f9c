//! The RDMA transport: one-sided RDMA reads and writes into peers' segments over
//! reliable-connected queue pairs (`mooncake-rdma`).
//!
//! * **Connecting.** A queue pair is connected through the peer's TCP transfer
//!   engine: a new connection (authenticated with the cluster secret when there is
//!   one) carries an [`Offer`] and brings back an [`Acceptance`] with the peer's queue
//!   pair and its segment's key and range ([`exchange`]). That connection then only
//!   holds the pair: the peer destroys its side when it closes ([`node`]).
//! * **Channels.** A connected pair and its connection form a channel; channels are
//!   pooled per peer and device, a few each, and dropped after [`CHANNEL_IDLE_LIMIT`]
//!   unused or once their pair failed (the next batch connects a new one).
//! * **Memory.** The segment is registered for peers at startup; any other local
//!   memory a transfer uses is registered once per mapping ([`registrations`]).
//! * **Batches.** A batch becomes work requests posted in chains and completed by
//!   polling on the calling thread; a batch of 1 MiB or more is split into
//!   [`STRIPE`] pieces dealt over every device, which run at once.
//! * **Failures.** A failed completion fails its transfer with `TRANSFER_FAIL`, the
//!   rest of the chain flushes and fails the same way, the channel is dropped. A
//!   peer that serves only TCP answers the offer with `NOT_SUPPORTED`: its transfers
//!   go over TCP for a minute before RDMA is tried again.
//!
//! Peers read and write the segment without this node's CPU: the grants of a cluster
//! secret are checked when the pair is connected (membership), not per transfer, and
//! the store copies a value into its reservation before committing it (never while
//! the commit travels), since no reader can be made to wait.

pub mod exchange;
pub mod node;
mod registrations;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_rdma::{QueuePair, Work, WorkError};
use mooncake_shm::{Outgoing, send_vectored};

use self::exchange::{Acceptance, Offer};
use self::node::{QUEUE_DEPTH, RdmaNode};
use self::registrations::Registrations;
use super::TransferClient;
use super::seam::{Direction, Transfer, Transport};
use super::stream::BufferedStream;
use super::wire::{CONNECT_LEN, Op, Request, read_response};

/// Idle channels kept per peer and device.
const POOL_PER_PEER_DEVICE: usize = 4;
/// Longest a pooled channel is kept unused.
pub const CHANNEL_IDLE_LIMIT: Duration = Duration::from_secs(300);
/// How often a channel in use tells the peer's connection it is alive (the peer
/// closes connections silent for `TRANSFER_IDLE_TIMEOUT`).
const KEEPALIVE_EVERY: Duration = Duration::from_secs(60);
/// Size of the pieces a large batch is split into over several devices.
pub const STRIPE: u64 = 4 << 20;
/// Batches at least this large are spread over every device.
const STRIPE_FROM: u64 = 1 << 20;
/// Longest single work request (a larger transfer is split).
const MAX_PIECE: u64 = mooncake_rdma::queue_pair::MAX_MESSAGE;
/// How long a peer that answered an offer with `NOT_SUPPORTED` is reached over TCP.
const TCP_ONLY_FOR: Duration = Duration::from_secs(60);

/// A connected queue pair and the connection that holds the peer's side.
#[derive(Debug)]
struct Channel {
    pair: QueuePair,
    remote: Acceptance,
    control: BufferedStream,
    last_keepalive: Instant,
    idle_since: Instant,
}

/// A piece of one transfer: `len` bytes at `offset` into it.
#[derive(Clone, Copy, Debug)]
struct Piece {
    index: usize,
    offset: u64,
    len: u64,
}

/// What one device's share of a batch came to: an outcome per piece (by transfer
/// index), or the code that failed them all.
type GroupOutcome = Result<Vec<(usize, CodeResult<()>)>, ErrorCode>;

/// Moves bytes with one-sided RDMA (see the module above).
#[derive(Debug)]
pub struct RdmaTransport {
    node: Arc<RdmaNode>,
    registrations: Registrations,
    channels: Mutex<HashMap<(String, usize), Vec<Channel>>>,
    /// Connects channels, and carries transfers to peers that serve only TCP.
    tcp: Arc<TransferClient>,
    tcp_only: Mutex<HashMap<String, Instant>>,
    next_device: AtomicUsize,
}

impl RdmaTransport {
    /// A transport over `node`'s devices, connecting through `tcp`.
    pub fn new(node: Arc<RdmaNode>, tcp: Arc<TransferClient>) -> RdmaTransport {
        let registrations = Registrations::default();
        let segment_regions: Vec<_> = (0..node.devices().len())
            .filter_map(|index| node.segment_region(index).cloned())
            .collect();
        if segment_regions.len() == node.devices().len() {
            registrations.seed(&node.segment().memory, &segment_regions);
        }
        RdmaTransport {
            node,
            registrations,
            channels: Mutex::default(),
            tcp,
            tcp_only: Mutex::default(),
            next_device: AtomicUsize::new(0),
        }
    }

    /// Channels pooled now (for status and tests).
    pub fn pooled_channels(&self) -> usize {
        self.channels.lock().values().map(Vec::len).sum()
    }

    /// Local mappings registered with the devices now.
    pub fn registered_mappings(&self) -> usize {
        self.registrations.len()
    }

    fn connect(&self, peer: &str, device: usize) -> CodeResult<Channel> {
        let failed = |what: &str, error: &dyn std::fmt::Display| {
            tracing::warn!(peer, device, %error, "cannot connect an RDMA queue pair: {what}");
            ErrorCode::TRANSFER_FAIL
        };
        let mut control = self.tcp.connect(peer)?;
        let mut pair = QueuePair::create(&self.node.devices()[device], QUEUE_DEPTH)
            .map_err(|e| failed("create", &e))?;
        let offer = Offer {
            device: u32::try_from(device).unwrap_or(0),
            endpoint: pair.endpoint(),
        };
        let header = Request {
            op: Op::RdmaConnect,
            segment: 0,
            offset: 0,
            len: CONNECT_LEN,
            grant: None,
        }
        .encode();
        let offered = offer.encode();
        send_vectored(
            control.socket(),
            &[Outgoing::Bytes(&header), Outgoing::Bytes(&offered)],
        )
        .map_err(|e| failed("send", &e))?;
        match read_response(&mut control).map_err(|e| failed("answer", &e))? {
            Ok(CONNECT_LEN) => {}
            Ok(len) => return Err(failed("answer", &format!("{len} bytes"))),
            Err(code) => return Err(code),
        }
        let mut accepted = [0u8; exchange::LEN];
        std::io::Read::read_exact(&mut control, &mut accepted).map_err(|e| failed("answer", &e))?;
        let remote = Acceptance::decode(&accepted).map_err(|e| failed("answer", &e))?;
        pair.connect(&remote.endpoint)
            .map_err(|e| failed("connect", &e))?;
        let now = Instant::now();
        Ok(Channel {
            pair,
            remote,
            control,
            last_keepalive: now,
            idle_since: now,
        })
    }

    fn checkout(&self, peer: &str, device: usize) -> CodeResult<Channel> {
        let pooled = {
            let mut channels = self.channels.lock();
            channels
                .get_mut(&(peer.to_string(), device))
                .and_then(|pool| {
                    pool.retain(|c| c.idle_since.elapsed() < CHANNEL_IDLE_LIMIT);
                    pool.pop()
                })
        };
        let mut channel = match pooled {
            Some(channel) => channel,
            None => self.connect(peer, device)?,
        };
        if channel.last_keepalive.elapsed() >= KEEPALIVE_EVERY {
            let keepalive = Request {
                op: Op::RdmaKeepalive,
                segment: 0,
                offset: 0,
                len: 0,
                grant: None,
            }
            .encode();
            if send_vectored(channel.control.socket(), &[Outgoing::Bytes(&keepalive)]).is_err() {
                return self.connect(peer, device);
            }
            channel.last_keepalive = Instant::now();
        }
        Ok(channel)
    }

    fn checkin(&self, peer: &str, device: usize, mut channel: Channel) {
        if channel.pair.is_broken() {
            return;
        }
        channel.idle_since = Instant::now();
        let mut channels = self.channels.lock();
        let pool = channels.entry((peer.to_string(), device)).or_default();
        if pool.len() < POOL_PER_PEER_DEVICE {
            pool.push(channel);
        }
    }

    fn is_tcp_only(&self, peer: &str) -> bool {
        let mut tcp_only = self.tcp_only.lock();
        match tcp_only.get(peer) {
            Some(since) if since.elapsed() < TCP_ONLY_FOR => true,
            Some(_) => {
                tcp_only.remove(peer);
                false
            }
            None => false,
        }
    }

    /// Deals the transfers' bytes to devices: everything on one device (taking turns
    /// between batches), or pieces of [`STRIPE`] bytes over every device for a large
    /// batch.
    fn deal(&self, transfers: &[Transfer<'_>]) -> Vec<Vec<Piece>> {
        let devices = self.node.devices().len().max(1);
        let total: u64 = transfers.iter().map(|t| t.local.len() as u64).sum();
        let stripe = devices > 1 && total >= STRIPE_FROM;
        let mut groups = vec![Vec::new(); devices];
        let mut turn = self.next_device.fetch_add(1, Ordering::Relaxed) % devices;
        let piece_len = if stripe { STRIPE } else { MAX_PIECE };
        for (index, transfer) in transfers.iter().enumerate() {
            let len = transfer.local.len() as u64;
            let mut offset = 0;
            while offset < len {
                let piece = Piece {
                    index,
                    offset,
                    len: piece_len.min(len - offset),
                };
                groups[turn].push(piece);
                offset += piece.len;
                if stripe {
                    turn = (turn + 1) % devices;
                }
            }
        }
        groups
    }

    fn run_batch(
        &self,
        peer: &str,
        direction: Direction,
        transfers: &[Transfer<'_>],
        deadline: Instant,
    ) -> Vec<CodeResult<()>> {
        if self.is_tcp_only(peer) {
            return self.tcp.run(peer, direction, transfers, deadline);
        }
        let groups = self.deal(transfers);
        let busy: Vec<(usize, &Vec<Piece>)> = groups
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
            .collect();
        let outcomes: Vec<GroupOutcome> = if busy.len() > 1 {
            std::thread::scope(|scope| {
                let handles: Vec<_> = busy
                    .iter()
                    .map(|(device, pieces)| {
                        scope.spawn(move || {
                            self.run_on(peer, *device, direction, transfers, pieces, deadline)
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().unwrap_or(Err(ErrorCode::TRANSFER_FAIL)))
                    .collect()
            })
        } else {
            busy.iter()
                .map(|(device, pieces)| {
                    self.run_on(peer, *device, direction, transfers, pieces, deadline)
                })
                .collect()
        };
        let mut results: Vec<CodeResult<()>> = vec![Ok(()); transfers.len()];
        for ((_, pieces), outcome) in busy.iter().zip(outcomes) {
            match outcome {
                Ok(items) => {
                    for (index, result) in items {
                        if let (Err(code), Some(slot @ Ok(()))) = (result, results.get_mut(index)) {
                            *slot = Err(code);
                        }
                    }
                }
                Err(ErrorCode::NOT_SUPPORTED) => {
                    tracing::info!(
                        peer,
                        "the peer serves only TCP: its transfers go over TCP for a minute"
                    );
                    self.tcp_only
                        .lock()
                        .insert(peer.to_string(), Instant::now());
                    return self.tcp.run(peer, direction, transfers, deadline);
                }
                Err(code) => {
                    for piece in pieces.iter() {
                        if let Some(slot @ Ok(())) = results.get_mut(piece.index) {
                            *slot = Err(code);
                        }
                    }
                }
            }
        }
        results
    }

    /// Runs `pieces` on a channel of `device`; one outcome per piece (by transfer
    /// index), or the code that failed them all (no channel).
    fn run_on(
        &self,
        peer: &str,
        device: usize,
        direction: Direction,
        transfers: &[Transfer<'_>],
        pieces: &[Piece],
        deadline: Instant,
    ) -> GroupOutcome {
        let mut channel = self.checkout(peer, device)?;
        let stale = pieces
            .iter()
            .any(|p| transfers[p.index].segment != channel.remote.segment);
        if stale {
            // The peer's segment was mounted again since this channel connected.
            channel = self.connect(peer, device)?;
        }
        let mut outcomes = Vec::with_capacity(pieces.len());
        let mut work = Vec::with_capacity(pieces.len());
        let mut worked = Vec::with_capacity(pieces.len());
        for piece in pieces {
            match self.work_for(&channel, device, direction, &transfers[piece.index], piece) {
                Ok(item) => {
                    work.push(item);
                    worked.push(piece.index);
                }
                Err(code) => outcomes.push((piece.index, Err(code))),
            }
        }
        let ran = channel.pair.run(&work, deadline);
        let mut logged = false;
        for (index, result) in worked.into_iter().zip(ran) {
            outcomes.push((
                index,
                result.map_err(|error| {
                    if !std::mem::replace(&mut logged, true) {
                        tracing::warn!(peer, device, %error, "RDMA transfer failed; reconnecting");
                    }
                    transfer_error(&error)
                }),
            ));
        }
        self.checkin(peer, device, channel);
        Ok(outcomes)
    }

    /// The work request for `piece` of `transfer`, or why there is none.
    fn work_for(
        &self,
        channel: &Channel,
        device: usize,
        direction: Direction,
        transfer: &Transfer<'_>,
        piece: &Piece,
    ) -> CodeResult<Work> {
        let remote = &channel.remote;
        if transfer.segment != remote.segment {
            return Err(ErrorCode::SEGMENT_NOT_FOUND);
        }
        let start = transfer.offset.checked_add(piece.offset);
        let inside = start
            .and_then(|s| s.checked_add(piece.len))
            .is_some_and(|end| end <= remote.len);
        let Some(start) = start.filter(|_| inside) else {
            return Err(ErrorCode::INVALID_PARAMS);
        };
        let devices = self.node.devices();
        let region = self
            .registrations
            .region_for(transfer.local, &devices[device], device, devices.len())
            .map_err(|error| {
                tracing::warn!(%error, "cannot register local memory for RDMA");
                ErrorCode::TRANSFER_FAIL
            })?;
        Ok(Work {
            direction: match direction {
                Direction::Read => mooncake_rdma::Direction::Read,
                Direction::Write => mooncake_rdma::Direction::Write,
            },
            local: transfer.local.address() + piece.offset,
            lkey: region.lkey(),
            len: piece.len,
            remote: remote.address + start,
            rkey: remote.rkey,
        })
    }
}

/// The code a failed work request answers with.
fn transfer_error(_error: &WorkError) -> ErrorCode {
    ErrorCode::TRANSFER_FAIL
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn serves_one_sided(&self) -> bool {
        true
    }

    fn run(
        &self,
        peer: &str,
        direction: Direction,
        transfers: &[Transfer<'_>],
        deadline: Instant,
    ) -> Vec<CodeResult<()>> {
        self.run_batch(peer, direction, transfers, deadline)
    }
}
