//! Reaching peers: a pool of connections per peer endpoint.

use std::collections::HashMap;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_core::protocol::auth::{self, ClusterSecret};
use mooncake_core::protocol::grant::{Grant, GrantedRange};
use mooncake_shm::{MemSlice, Outgoing, send_vectored};

use super::seam::{Direction, Transfer, Transport};
use super::stream::BufferedStream;
use super::tuning::Congestion;
use super::wire::{Op, REQUEST_LEN, Request, read_response};

/// How long connecting to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait for a peer to accept or deliver bytes during a transfer.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle connections kept per peer.
const POOL_PER_PEER: usize = 8;
/// Requests sent on one connection before their answers are read. The peer answers in
/// order; a window's requests (72 bytes each) always fit in the socket buffers, so
/// neither side blocks the other.
const PIPELINE_WINDOW: usize = 64;

/// Longest a pooled connection is kept unused; older ones are closed instead of
/// reused (well before the peer's [`TRANSFER_IDLE_TIMEOUT`] closes them).
///
/// [`TRANSFER_IDLE_TIMEOUT`]: super::server::TRANSFER_IDLE_TIMEOUT
const POOLED_IDLE_LIMIT: Duration = Duration::from_secs(300);

/// Connections to peers' transfer servers, reused across transfers.
#[derive(Debug, Default)]
pub struct TransferClient {
    /// Idle connections per endpoint, with when each was last used.
    idle: Mutex<HashMap<String, Vec<(BufferedStream, Instant)>>>,
    congestion: Congestion,
    /// Proves our cluster membership to peers (`None`: unauthenticated).
    secret: Option<Arc<ClusterSecret>>,
}

impl TransferClient {
    /// A client whose connections use `congestion` and prove membership with `secret`.
    pub fn new(congestion: Congestion, secret: Option<Arc<ClusterSecret>>) -> Self {
        TransferClient {
            idle: Mutex::default(),
            congestion,
            secret,
        }
    }

    fn checkout(&self, endpoint: &str) -> CodeResult<BufferedStream> {
        self.pooled(endpoint)
            .map_or_else(|| self.connect(endpoint), Ok)
    }

    /// An idle pooled connection to `endpoint`, if there is one.
    fn pooled(&self, endpoint: &str) -> Option<BufferedStream> {
        let mut idle = self.idle.lock();
        let pool = idle.get_mut(endpoint)?;
        pool.retain(|(_, since)| since.elapsed() < POOLED_IDLE_LIMIT);
        pool.pop().map(|(stream, _)| stream)
    }

    /// A new connection to `endpoint`'s transfer engine (authenticated with the
    /// cluster secret, when there is one), not taken from the pool.
    pub(super) fn connect(&self, endpoint: &str) -> CodeResult<BufferedStream> {
        let address = std::net::ToSocketAddrs::to_socket_addrs(endpoint)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or(ErrorCode::TRANSFER_FAIL)?;
        let stream = TcpStream::connect_timeout(&address, CONNECT_TIMEOUT).map_err(|error| {
            tracing::warn!(endpoint, %error, "cannot connect to a peer's transfer engine");
            ErrorCode::TRANSFER_FAIL
        })?;
        self.congestion.prepare(&stream);
        if let Some(secret) = &self.secret {
            let _ = stream.set_read_timeout(Some(auth::AUTH_DEADLINE));
            let _ = stream.set_write_timeout(Some(auth::AUTH_DEADLINE));
            auth::authenticate_client(&mut &stream, secret, auth::Channel::Transfer).map_err(
                |error| {
                    tracing::error!(endpoint, %error, "a peer's transfer engine did not accept our cluster secret (or we did not accept its proof): check --cluster_secret_file on both nodes");
                    ErrorCode::TRANSFER_FAIL
                },
            )?;
        }
        // A peer that vanishes must not hold a transfer forever.
        let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
        let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
        Ok(BufferedStream::new(stream))
    }

    fn checkin(&self, endpoint: &str, stream: BufferedStream) {
        let mut idle = self.idle.lock();
        let pool = idle.entry(endpoint.to_string()).or_default();
        if pool.len() < POOL_PER_PEER {
            pool.push((stream, Instant::now()));
        }
    }

    /// Sends the transfers a window at a time on one connection (requests go out
    /// before their answers are read); windows that would start after `deadline`
    /// fail, and no socket waits past it.
    fn pipelined(
        &self,
        endpoint: &str,
        op: Op,
        transfers: &[Transfer<'_>],
        deadline: Instant,
    ) -> Vec<CodeResult<()>> {
        let mut results = Vec::with_capacity(transfers.len());
        for window in transfers.chunks(PIPELINE_WINDOW) {
            let Some(left) = deadline
                .checked_duration_since(Instant::now())
                .filter(|left| !left.is_zero())
            else {
                results.extend(window.iter().map(|_| Err(ErrorCode::TRANSFER_FAIL)));
                continue;
            };
            let timeout = left.min(IO_TIMEOUT);
            // A pooled connection may have died while idle (the peer restarted, or
            // handed its engine over to a new process): a window that breaks on one
            // goes again once on a new connection. Transfers are idempotent.
            let outcome = match self.pooled(endpoint) {
                Some(stream) => self
                    .pipeline_window(stream, endpoint, op, window, timeout)
                    .or_else(|_| {
                        let stream = self.connect(endpoint)?;
                        self.pipeline_window(stream, endpoint, op, window, timeout)
                    }),
                None => self
                    .connect(endpoint)
                    .and_then(|stream| self.pipeline_window(stream, endpoint, op, window, timeout)),
            };
            match outcome {
                Ok(answers) => results.extend(answers),
                Err(code) => results.extend(window.iter().map(|_| Err(code))),
            }
        }
        results
    }

    /// Sends a window of requests (with their payloads, for writes) in as few system
    /// calls as the socket allows, then reads the answers in order (with their payloads,
    /// for reads). A broken or desynchronized connection fails the whole window and is
    /// dropped; a peer's refusal of one request fails only that one.
    fn pipeline_window(
        &self,
        mut stream: BufferedStream,
        endpoint: &str,
        op: Op,
        window: &[Transfer<'_>],
        timeout: Duration,
    ) -> CodeResult<Vec<CodeResult<()>>> {
        let _ = stream.socket().set_read_timeout(Some(timeout));
        let _ = stream.socket().set_write_timeout(Some(timeout));
        let io = |e: std::io::Error| {
            tracing::warn!(endpoint, error = %e, "transfer failed");
            ErrorCode::TRANSFER_FAIL
        };
        let headers: Vec<[u8; REQUEST_LEN]> = window
            .iter()
            .map(|transfer| {
                Request {
                    op,
                    segment: transfer.segment,
                    offset: transfer.offset,
                    len: transfer.local.len() as u64,
                    grant: transfer.grant,
                }
                .encode()
            })
            .collect();
        let mut pieces = Vec::with_capacity(window.len() * 2);
        for (header, transfer) in headers.iter().zip(window) {
            pieces.push(Outgoing::Bytes(header));
            if op == Op::Write {
                pieces.push(Outgoing::Slice(transfer.local));
            }
        }
        send_vectored(stream.socket(), &pieces).map_err(io)?;
        let mut answers = Vec::with_capacity(window.len());
        for transfer in window {
            match read_response(&mut stream).map_err(|_| ErrorCode::TRANSFER_FAIL)? {
                Ok(len) if len == transfer.local.len() as u64 => {
                    if op == Op::Read {
                        stream.read_into(transfer.local).map_err(io)?;
                    }
                    answers.push(Ok(()));
                }
                Ok(_) => return Err(ErrorCode::TRANSFER_FAIL),
                Err(code) => answers.push(Err(code)),
            }
        }
        self.checkin(endpoint, stream);
        Ok(answers)
    }

    /// Reads the object stored under `key` on the peer's SSD tier, which the master
    /// says holds `expected` bytes (a peer announcing another length is refused before
    /// anything is allocated).
    pub fn read_disk(
        &self,
        endpoint: &str,
        key: &str,
        grant: Option<Grant>,
        expected: u64,
    ) -> CodeResult<Vec<u8>> {
        let mut value = Vec::new();
        self.disk_request(endpoint, key, grant, |stream, len| {
            if len != expected {
                tracing::warn!(
                    endpoint,
                    key,
                    len,
                    expected,
                    "a peer announced a disk object of the wrong size"
                );
                return Err(ErrorCode::TRANSFER_FAIL);
            }
            value = vec![0u8; usize::try_from(len).map_err(|_| ErrorCode::TRANSFER_FAIL)?];
            std::io::Read::read_exact(stream, &mut value).map_err(|e| disk_io(endpoint, &e))
        })?;
        Ok(value)
    }

    /// Reads the object stored under `key` on the peer's SSD tier straight into `dest`,
    /// which must be exactly its size.
    pub fn read_disk_into(
        &self,
        endpoint: &str,
        key: &str,
        grant: Option<Grant>,
        dest: &MemSlice,
    ) -> CodeResult<()> {
        self.disk_request(endpoint, key, grant, |stream, len| {
            if len != dest.len() as u64 {
                return Err(ErrorCode::TRANSFER_FAIL);
            }
            stream.read_into(dest).map_err(|e| disk_io(endpoint, &e))
        })
    }

    /// Asks the peer for `key` from its SSD tier; `receive` takes the value's length
    /// and reads the value from the stream.
    fn disk_request(
        &self,
        endpoint: &str,
        key: &str,
        grant: Option<Grant>,
        receive: impl FnOnce(&mut BufferedStream, u64) -> CodeResult<()>,
    ) -> CodeResult<()> {
        let mut stream = self.checkout(endpoint)?;
        let request = Request {
            op: Op::ReadDisk,
            segment: 0,
            offset: 0,
            len: key.len() as u64,
            grant: grant.map(|grant| GrantedRange {
                offset: 0,
                len: 0,
                grant,
            }),
        };
        let header = request.encode();
        send_vectored(
            stream.socket(),
            &[Outgoing::Bytes(&header), Outgoing::Bytes(key.as_bytes())],
        )
        .map_err(|e| disk_io(endpoint, &e))?;
        let len = match read_response(&mut stream).map_err(|_| ErrorCode::TRANSFER_FAIL)? {
            Ok(len) => len,
            Err(code) => {
                self.checkin(endpoint, stream);
                return Err(code);
            }
        };
        // A stream left mid-value is dropped, not reused.
        receive(&mut stream, len)?;
        self.checkin(endpoint, stream);
        Ok(())
    }
}

impl Transport for TransferClient {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn run(
        &self,
        peer: &str,
        direction: Direction,
        transfers: &[Transfer<'_>],
        deadline: Instant,
    ) -> Vec<CodeResult<()>> {
        let op = match direction {
            Direction::Read => Op::Read,
            Direction::Write => Op::Write,
        };
        self.pipelined(peer, op, transfers, deadline)
    }
}

/// Logs a failed disk read from a peer; its error code.
fn disk_io(endpoint: &str, error: &std::io::Error) -> ErrorCode {
    tracing::warn!(endpoint, %error, "disk read from a peer failed");
    ErrorCode::TRANSFER_FAIL
}
