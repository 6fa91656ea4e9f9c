//! Serving peers: reads from and writes into this node's segment.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use mooncake_core::error::ErrorCode;
use mooncake_core::protocol::auth::{self, ClusterSecret};
use mooncake_core::protocol::grant::{Access, GrantError, Scope, now_secs};
use mooncake_shm::{MemSlice, Outgoing, send_vectored};

use super::rdma::exchange::{self, Offer};
use super::rdma::node::RdmaNode;
pub use super::served::ServedSegment;
use super::stream::BufferedStream;
use super::tuning::Congestion;
use super::wire::{Op, REQUEST_LEN, Request, WireError, encode_response};
use crate::disk::DiskTier;

/// The transfer listener of one real client.
#[derive(Debug)]
pub struct TransferServer {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
    /// The listening socket, kept to hand it to a new process (`handover`).
    listener: TcpListener,
}

impl TransferServer {
    /// Binds `bind` and serves `segment` (and `disk`, this node's SSD tier, when
    /// enabled) on background threads (one per connection, at most
    /// [`MAX_TRANSFER_CONNECTIONS`]), answering with `congestion`. With `secret`, a
    /// peer must prove cluster membership before its first request, and every request
    /// must carry the master's grant for the bytes it reaches (`protocol::grant`).
    pub fn start(
        bind: SocketAddr,
        segment: Arc<ServedSegment>,
        disk: Option<Arc<DiskTier>>,
        congestion: Congestion,
        secret: Option<Arc<ClusterSecret>>,
        rdma: Option<Arc<RdmaNode>>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(bind)?;
        Self::start_on(listener, segment, disk, congestion, secret, rdma)
    }

    /// [`start`](Self::start) on a socket already listening (one handed over by the
    /// process this one took over from).
    pub fn start_on(
        listener: TcpListener,
        segment: Arc<ServedSegment>,
        disk: Option<Arc<DiskTier>>,
        congestion: Congestion,
        secret: Option<Arc<ClusterSecret>>,
        rdma: Option<Arc<RdmaNode>>,
    ) -> std::io::Result<Self> {
        listener.set_nonblocking(false)?;
        let kept = listener.try_clone()?;
        let address = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let open = Arc::new(AtomicUsize::new(0));
        std::thread::Builder::new()
            .name("transfer-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if stop_flag.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let Some(slot) = ConnectionSlot::take(&open) else {
                        tracing::warn!(
                            peer = ?stream.peer_addr().ok(),
                            "refusing a transfer connection: {MAX_TRANSFER_CONNECTIONS} are open"
                        );
                        continue;
                    };
                    congestion.prepare(&stream);
                    let segment = Arc::clone(&segment);
                    let disk = disk.clone();
                    let secret = secret.clone();
                    let rdma = rdma.clone();
                    let spawned = std::thread::Builder::new()
                        .name("transfer-peer".into())
                        .spawn(move || {
                            let _slot = slot;
                            if admitted(&stream, secret.as_deref()) {
                                let served = Served {
                                    segment: &segment,
                                    disk: disk.as_deref(),
                                    grants: secret.as_deref(),
                                    rdma: rdma.as_deref(),
                                    warned: std::cell::Cell::new(false),
                                };
                                serve_connection(stream, &served);
                            }
                        });
                    if let Err(error) = spawned {
                        tracing::warn!(%error, "cannot start a transfer connection thread");
                    }
                }
            })?;
        Ok(TransferServer {
            address,
            stop,
            listener: kept,
        })
    }

    /// The listening socket, to hand to a new process.
    pub fn listener(&self) -> &TcpListener {
        &self.listener
    }

    /// The bound address (the real port when 0 was asked).
    pub fn address(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for TransferServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.address);
    }
}

/// Most transfer connections served at once (each holds a thread); further ones are
/// closed at once.
pub const MAX_TRANSFER_CONNECTIONS: usize = 512;
/// Longest wait for the next request on an idle connection before it is closed (the
/// peer reconnects when it needs to).
pub const TRANSFER_IDLE_TIMEOUT: Duration = Duration::from_secs(600);

/// One of the [`MAX_TRANSFER_CONNECTIONS`], given back when dropped.
struct ConnectionSlot(Arc<AtomicUsize>);

impl ConnectionSlot {
    fn take(open: &Arc<AtomicUsize>) -> Option<Self> {
        open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < MAX_TRANSFER_CONNECTIONS).then_some(n + 1)
        })
        .ok()
        .map(|_| ConnectionSlot(Arc::clone(open)))
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// True when the peer may send requests: there is no secret, or it proved membership
/// within [`auth::AUTH_DEADLINE`].
fn admitted(stream: &TcpStream, secret: Option<&ClusterSecret>) -> bool {
    let Some(secret) = secret else {
        return true;
    };
    let _ = stream.set_read_timeout(Some(auth::AUTH_DEADLINE));
    let _ = stream.set_write_timeout(Some(auth::AUTH_DEADLINE));
    let mut socket = stream;
    match auth::authenticate_server(&mut socket, secret, auth::Channel::Transfer) {
        Ok(()) => true,
        Err(error) => {
            tracing::warn!(peer = ?stream.peer_addr().ok(), %error, "refused a transfer connection that did not prove cluster membership");
            false
        }
    }
}

/// Answers queued on a connection before they are sent together: while more requests
/// of a pipelined batch have already arrived, their answers wait here, so a batch of
/// small transfers costs a few system calls and wake-ups instead of one per transfer.
#[derive(Debug, Default)]
struct Outbox {
    answers: Vec<Answer>,
    payload_bytes: usize,
}

/// One queued answer: its header and the payload that follows it.
#[derive(Debug)]
struct Answer {
    header: [u8; 16],
    payload: AnswerPayload,
}

#[derive(Debug)]
enum AnswerPayload {
    None,
    Slice(MemSlice),
}

/// Queued answers beyond which the outbox is sent without waiting for the batch's end.
const OUTBOX_ANSWERS: usize = 64;
/// Queued payload bytes beyond which the outbox is sent.
const OUTBOX_BYTES: usize = 256 << 10;

impl Outbox {
    fn push(&mut self, status: Result<u64, ErrorCode>, payload: AnswerPayload) {
        self.payload_bytes += match &payload {
            AnswerPayload::None => 0,
            AnswerPayload::Slice(slice) => slice.len(),
        };
        self.answers.push(Answer {
            header: encode_response(status),
            payload,
        });
    }

    fn is_full(&self) -> bool {
        self.answers.len() >= OUTBOX_ANSWERS || self.payload_bytes >= OUTBOX_BYTES
    }

    /// Sends every queued answer in order.
    fn flush(&mut self, stream: &TcpStream) -> std::io::Result<()> {
        if self.answers.is_empty() {
            return Ok(());
        }
        let mut pieces = Vec::with_capacity(self.answers.len() * 2);
        for answer in &self.answers {
            pieces.push(Outgoing::Bytes(&answer.header));
            match &answer.payload {
                AnswerPayload::None => {}
                AnswerPayload::Slice(slice) => pieces.push(Outgoing::Slice(slice)),
            }
        }
        let sent = match mooncake_core::failpoint::hit(FAILPOINT_ANSWER) {
            Some(_) => reset_mid_frame(stream, &self.answers[0].header),
            None => send_vectored(stream, &pieces),
        };
        self.answers.clear();
        self.payload_bytes = 0;
        sent
    }
}

/// Failpoint of the answers a node sends on a transfer connection: when it fires the
/// connection is reset in the middle of an answer (half its header sent), as when the
/// node dies or the network drops it; `sleep(ms)` stalls the answers instead.
pub const FAILPOINT_ANSWER: &str = "transfer.answer";

/// Sends half of `header`, then resets the connection (for [`FAILPOINT_ANSWER`]).
fn reset_mid_frame(stream: &TcpStream, header: &[u8]) -> std::io::Result<()> {
    let half = &header[..header.len() / 2];
    let _ = send_vectored(stream, &[Outgoing::Bytes(half)]);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset))
}

/// What one connection serves, and the secret grants are checked with (`None`: an
/// unauthenticated cluster, no checks).
struct Served<'a> {
    segment: &'a ServedSegment,
    disk: Option<&'a DiskTier>,
    grants: Option<&'a ClusterSecret>,
    /// This node's RDMA side, when it moves bytes with RDMA.
    rdma: Option<&'a RdmaNode>,
    /// A refusal was logged on this connection (later ones are not, so a peer cannot
    /// flood the log).
    warned: std::cell::Cell<bool>,
}

impl Served<'_> {
    /// Checks a segment request against its grant; the code a refusal answers with.
    fn check_grant(&self, request: &Request, peer: Option<SocketAddr>) -> Result<(), ErrorCode> {
        let Some(secret) = self.grants else {
            return Ok(());
        };
        let wanted = if request.op == Op::Write {
            Access::Write
        } else {
            Access::Read
        };
        let checked = match &request.grant {
            None => Err(GrantError::Missing),
            Some(granted) => {
                granted.check(secret, request.segment, request.offset, request.len, wanted)
            }
        };
        checked.map_err(|error| self.refused(&error, peer))
    }

    /// Checks a disk read of `key` against its grant.
    fn check_disk_grant(
        &self,
        request: &Request,
        key: &str,
        peer: Option<SocketAddr>,
    ) -> Result<(), ErrorCode> {
        let Some(secret) = self.grants else {
            return Ok(());
        };
        let scope = Scope::Disk {
            segment_name: &self.segment.name,
            key,
        };
        let checked = match &request.grant {
            None => Err(GrantError::Missing),
            Some(granted) => secret.check_grant(&granted.grant, &scope, Access::Read, now_secs()),
        };
        checked.map_err(|error| self.refused(&error, peer))
    }

    /// Logs a refused grant (once per connection); the code the peer gets
    /// (`LEASE_EXPIRED` for an expired one, `ILLEGAL_CLIENT` otherwise).
    fn refused(&self, error: &GrantError, peer: Option<SocketAddr>) -> ErrorCode {
        if self.warned.replace(true) {
            tracing::debug!(?peer, %error, "refused a transfer the master did not grant");
        } else {
            tracing::warn!(?peer, %error, "refused a transfer the master did not grant (further refusals on this connection are not logged)");
        }
        match error {
            GrantError::Expired => ErrorCode::LEASE_EXPIRED,
            _ => ErrorCode::ILLEGAL_CLIENT,
        }
    }
}

fn serve_connection(stream: TcpStream, served: &Served<'_>) {
    let peer = stream.peer_addr().ok();
    // Idle pooled connections may wait long between requests, but not forever; a
    // stalled peer mid-frame is dropped after the write timeout.
    let _ = stream.set_read_timeout(Some(TRANSFER_IDLE_TIMEOUT));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
    let mut stream = BufferedStream::new(stream);
    let mut outbox = Outbox::default();
    loop {
        // Answers wait while the next request has already arrived; before waiting for
        // one, everything queued goes out.
        if !outbox.answers.is_empty()
            && !next_request_ready(&mut stream).unwrap_or(false)
            && outbox.flush(stream.socket()).is_err()
        {
            return;
        }
        let request = match Request::read_from(&mut stream) {
            Ok(request) => request,
            Err(WireError::Io(_)) => return,
            Err(error) => {
                tracing::warn!(%error, "closing a transfer connection");
                outbox.push(Err(ErrorCode::INVALID_PARAMS), AnswerPayload::None);
                let _ = outbox.flush(stream.socket());
                return;
            }
        };
        mooncake_core::keep_awake::touch();
        let answered = match request.op {
            Op::ReadDisk => serve_disk_read(&mut stream, &mut outbox, served, &request, peer),
            Op::RdmaConnect => {
                return serve_rdma_connect(stream, &mut outbox, served, peer);
            }
            // Only meaningful on a connection that holds a queue pair.
            Op::RdmaKeepalive => Ok(()),
            Op::Read | Op::Write => serve_request(&mut stream, &mut outbox, served, &request, peer),
        };
        if answered.is_err() || (outbox.is_full() && outbox.flush(stream.socket()).is_err()) {
            return;
        }
    }
}

/// True when a whole request header has arrived (receiving what is there, without
/// waiting).
fn next_request_ready(stream: &mut BufferedStream) -> std::io::Result<bool> {
    while stream.buffered() < REQUEST_LEN {
        if !stream.fill_if_ready()? {
            return Ok(false);
        }
    }
    Ok(true)
}

fn serve_request(
    stream: &mut BufferedStream,
    outbox: &mut Outbox,
    served: &Served<'_>,
    request: &Request,
    peer: Option<SocketAddr>,
) -> std::io::Result<()> {
    let segment = served.segment;
    let slice = if request.segment == segment.id.load(Ordering::Acquire) {
        served.check_grant(request, peer).and_then(|()| {
            if request.op == Op::Read {
                segment.writes.settle(request.offset, request.len)?;
            }
            segment
                .memory
                .slice(request.offset, request.len)
                .ok_or(ErrorCode::INVALID_PARAMS)
        })
    } else {
        Err(ErrorCode::SEGMENT_NOT_FOUND)
    };
    match (request.op, slice) {
        (Op::Read, Ok(slice)) => outbox.push(Ok(request.len), AnswerPayload::Slice(slice)),
        (Op::Write, Ok(slice)) => {
            stream.read_into(&slice)?;
            outbox.push(Ok(request.len), AnswerPayload::None);
        }
        (Op::Read, Err(code)) => outbox.push(Err(code), AnswerPayload::None),
        (Op::ReadDisk | Op::RdmaConnect | Op::RdmaKeepalive, _) => {
            outbox.push(Err(ErrorCode::INVALID_PARAMS), AnswerPayload::None)
        }
        (Op::Write, Err(code)) => {
            // Drain the payload so the connection stays usable, then refuse.
            stream.discard(request.len)?;
            outbox.push(Err(code), AnswerPayload::None);
        }
    }
    Ok(())
}

/// Reads a key of `key_len` bytes from the peer and answers with that object from this
/// node's SSD tier.
fn serve_disk_read(
    stream: &mut BufferedStream,
    outbox: &mut Outbox,
    served: &Served<'_>,
    request: &Request,
    peer: Option<SocketAddr>,
) -> std::io::Result<()> {
    let mut key = vec![0u8; usize::try_from(request.len).unwrap_or(0)];
    std::io::Read::read_exact(stream, &mut key)?;
    let value = match (served.disk, std::str::from_utf8(&key)) {
        (Some(disk), Ok(key)) => served
            .check_disk_grant(request, key, peer)
            .and_then(|()| disk.read_staged(key)),
        (None, _) => Err(ErrorCode::OBJECT_NOT_FOUND),
        (_, Err(_)) => Err(ErrorCode::INVALID_KEY),
    };
    match value {
        // The value holds a staging lease: it goes out now, after the queued answers.
        Ok(value) => {
            outbox.flush(stream.socket())?;
            let header = encode_response(Ok(value.len() as u64));
            send_vectored(
                stream.socket(),
                &[Outgoing::Bytes(&header), Outgoing::Bytes(&value)],
            )
        }
        Err(code) => {
            outbox.push(Err(code), AnswerPayload::None);
            Ok(())
        }
    }
}

/// Connects a queue pair to the peer's offer that follows the header, answers with
/// ours, then holds the pair until the peer closes the connection (or stays silent
/// for [`TRANSFER_IDLE_TIMEOUT`]: it sends keepalives while it uses the pair).
fn serve_rdma_connect(
    mut stream: BufferedStream,
    outbox: &mut Outbox,
    served: &Served<'_>,
    peer: Option<SocketAddr>,
) {
    if outbox.flush(stream.socket()).is_err() {
        return;
    }
    let mut offered = [0u8; exchange::LEN];
    if std::io::Read::read_exact(&mut stream, &mut offered).is_err() {
        return;
    }
    let accepted = match (served.rdma, Offer::decode(&offered)) {
        (None, _) => Err(ErrorCode::NOT_SUPPORTED),
        (Some(_), Err(error)) => {
            tracing::warn!(?peer, %error, "closing a transfer connection");
            Err(ErrorCode::INVALID_PARAMS)
        }
        (Some(node), Ok(offer)) => node.accept(&offer),
    };
    let (acceptance, pair) = match accepted {
        Ok(accepted) => accepted,
        Err(code) => {
            let _ = send_vectored(
                stream.socket(),
                &[Outgoing::Bytes(&encode_response(Err(code)))],
            );
            return;
        }
    };
    let header = encode_response(Ok(exchange::LEN as u64));
    let answer = acceptance.encode();
    if send_vectored(
        stream.socket(),
        &[Outgoing::Bytes(&header), Outgoing::Bytes(&answer)],
    )
    .is_err()
    {
        return;
    }
    tracing::debug!(?peer, "RDMA queue pair connected");
    // Only keepalives may follow; anything else, silence or a close ends the pair.
    while let Ok(request) = Request::read_from(&mut stream) {
        if request.op != Op::RdmaKeepalive {
            break;
        }
    }
    drop(pair);
    tracing::debug!(?peer, "RDMA queue pair closed");
}
