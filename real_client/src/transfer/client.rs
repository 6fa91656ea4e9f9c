//! Reaching peers: a pool of connections per peer endpoint.

use std::collections::HashMap;
use std::net::TcpStream;
use std::time::Duration;

use parking_lot::Mutex;

use mooncake_core::error::{CodeResult, ErrorCode};
use mooncake_shm::MemSlice;

use super::wire::{Op, Request, read_response};

/// How long connecting to a peer may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest wait for a peer to accept or deliver bytes during a transfer.
const IO_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle connections kept per peer.
const POOL_PER_PEER: usize = 8;

/// Connections to peers' transfer servers, reused across transfers.
#[derive(Debug, Default)]
pub struct TransferClient {
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
}

impl TransferClient {
    fn checkout(&self, endpoint: &str) -> CodeResult<TcpStream> {
        if let Some(stream) = self.idle.lock().get_mut(endpoint).and_then(Vec::pop) {
            return Ok(stream);
        }
        let address = std::net::ToSocketAddrs::to_socket_addrs(endpoint)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or(ErrorCode::TRANSFER_FAIL)?;
        let stream = TcpStream::connect_timeout(&address, CONNECT_TIMEOUT).map_err(|error| {
            tracing::warn!(endpoint, %error, "cannot connect to a peer's transfer engine");
            ErrorCode::TRANSFER_FAIL
        })?;
        let _ = stream.set_nodelay(true);
        // A peer that vanishes must not hold a transfer forever.
        let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
        let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
        Ok(stream)
    }

    fn checkin(&self, endpoint: &str, stream: TcpStream) {
        let mut idle = self.idle.lock();
        let pool = idle.entry(endpoint.to_string()).or_default();
        if pool.len() < POOL_PER_PEER {
            pool.push(stream);
        }
    }

    /// Copies `dest.len()` bytes at `offset` of the peer's segment into `dest`.
    pub fn read(
        &self,
        endpoint: &str,
        segment: u64,
        offset: u64,
        dest: &MemSlice,
    ) -> CodeResult<()> {
        self.transfer(
            endpoint,
            Request {
                op: Op::Read,
                segment,
                offset,
                len: dest.len() as u64,
            },
            dest,
        )
    }

    /// Copies `source` into the peer's segment at `offset`.
    pub fn write(
        &self,
        endpoint: &str,
        segment: u64,
        offset: u64,
        source: &MemSlice,
    ) -> CodeResult<()> {
        self.transfer(
            endpoint,
            Request {
                op: Op::Write,
                segment,
                offset,
                len: source.len() as u64,
            },
            source,
        )
    }

    /// Reads the object stored under `key` on the peer's SSD tier.
    pub fn read_disk(&self, endpoint: &str, key: &str) -> CodeResult<Vec<u8>> {
        let mut value = Vec::new();
        self.disk_request(endpoint, key, |stream, len| {
            value = vec![0u8; usize::try_from(len).map_err(|_| ErrorCode::TRANSFER_FAIL)?];
            std::io::Read::read_exact(stream, &mut value).map_err(|e| disk_io(endpoint, &e))
        })?;
        Ok(value)
    }

    /// Reads the object stored under `key` on the peer's SSD tier straight into `dest`,
    /// which must be exactly its size.
    pub fn read_disk_into(&self, endpoint: &str, key: &str, dest: &MemSlice) -> CodeResult<()> {
        self.disk_request(endpoint, key, |stream, len| {
            if len != dest.len() as u64 {
                return Err(ErrorCode::TRANSFER_FAIL);
            }
            dest.recv_from(stream).map_err(|e| disk_io(endpoint, &e))
        })
    }

    /// Asks the peer for `key` from its SSD tier; `receive` takes the value's length
    /// and reads the value from the stream.
    fn disk_request(
        &self,
        endpoint: &str,
        key: &str,
        receive: impl FnOnce(&mut TcpStream, u64) -> CodeResult<()>,
    ) -> CodeResult<()> {
        let mut stream = self.checkout(endpoint)?;
        let request = Request {
            op: Op::ReadDisk,
            segment: 0,
            offset: 0,
            len: key.len() as u64,
        };
        std::io::Write::write_all(&mut stream, &request.encode())
            .and_then(|()| std::io::Write::write_all(&mut stream, key.as_bytes()))
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

    fn transfer(&self, endpoint: &str, request: Request, local: &MemSlice) -> CodeResult<()> {
        let mut stream = self.checkout(endpoint)?;
        let io = |e: std::io::Error| {
            tracing::warn!(endpoint, error = %e, "transfer failed");
            ErrorCode::TRANSFER_FAIL
        };
        std::io::Write::write_all(&mut stream, &request.encode()).map_err(io)?;
        let status = match request.op {
            Op::Write => {
                local.send_to(&stream).map_err(io)?;
                read_response(&mut stream).map_err(|_| ErrorCode::TRANSFER_FAIL)?
            }
            Op::Read => {
                let status = read_response(&mut stream).map_err(|_| ErrorCode::TRANSFER_FAIL)?;
                if status.is_ok() {
                    local.recv_from(&stream).map_err(io)?;
                }
                status
            }
            Op::ReadDisk => return Err(ErrorCode::INVALID_PARAMS),
        };
        match status {
            Ok(len) if len == request.len => {
                self.checkin(endpoint, stream);
                Ok(())
            }
            Ok(_) => Err(ErrorCode::TRANSFER_FAIL),
            Err(code) => {
                self.checkin(endpoint, stream);
                Err(code)
            }
        }
    }
}

/// Logs a failed disk read from a peer; its error code.
fn disk_io(endpoint: &str, error: &std::io::Error) -> ErrorCode {
    tracing::warn!(endpoint, %error, "disk read from a peer failed");
    ErrorCode::TRANSFER_FAIL
}
