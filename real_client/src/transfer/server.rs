//! Serving peers: reads from and writes into this node's segment.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use mooncake_core::error::ErrorCode;
use mooncake_shm::SharedMemory;

use super::wire::{Op, Request, WireError, write_response};
use crate::disk::DiskTier;

/// The transfer listener of one real client.
#[derive(Debug)]
pub struct TransferServer {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
}

/// What the server serves: the segment and its current id at the master (it changes
/// when the segment is mounted again).
#[derive(Debug)]
pub struct ServedSegment {
    /// The memory.
    pub memory: Arc<SharedMemory>,
    /// Current segment id (0 while not mounted).
    pub id: AtomicU64,
    /// False for a pure client (`--global_segment_size=0`): it mounts nothing and
    /// every object it writes lives on other nodes.
    pub contributes: bool,
}

impl TransferServer {
    /// Binds `bind` and serves `segment` (and `disk`, this node's SSD tier, when
    /// enabled) on background threads (one per connection).
    pub fn start(
        bind: SocketAddr,
        segment: Arc<ServedSegment>,
        disk: Option<Arc<DiskTier>>,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(bind)?;
        let address = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("transfer-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if stop_flag.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let segment = Arc::clone(&segment);
                    let disk = disk.clone();
                    let spawned = std::thread::Builder::new()
                        .name("transfer-peer".into())
                        .spawn(move || serve_connection(stream, &segment, disk.as_deref()));
                    if let Err(error) = spawned {
                        tracing::warn!(%error, "cannot start a transfer connection thread");
                    }
                }
            })?;
        Ok(TransferServer { address, stop })
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

fn serve_connection(mut stream: TcpStream, segment: &ServedSegment, disk: Option<&DiskTier>) {
    let _ = stream.set_nodelay(true);
    // Idle pooled connections may wait long between requests; a stalled peer mid-frame
    // is dropped after the write timeout.
    let _ = stream.set_write_timeout(Some(std::time::Duration::from_secs(30)));
    loop {
        let request = match Request::read_from(&mut stream) {
            Ok(request) => request,
            Err(WireError::Io(_)) => return,
            Err(error) => {
                tracing::warn!(%error, "closing a transfer connection");
                let _ = write_response(&mut stream, Err(ErrorCode::INVALID_PARAMS));
                return;
            }
        };
        let served = if request.op == Op::ReadDisk {
            serve_disk_read(&mut stream, disk, request.len)
        } else {
            serve_request(&mut stream, segment, request)
        };
        if served.is_err() {
            return;
        }
    }
}

fn serve_request(
    stream: &mut TcpStream,
    segment: &ServedSegment,
    request: Request,
) -> std::io::Result<()> {
    let slice = if request.segment == segment.id.load(Ordering::Acquire) {
        segment
            .memory
            .slice(request.offset, request.len)
            .ok_or(ErrorCode::INVALID_PARAMS)
    } else {
        Err(ErrorCode::SEGMENT_NOT_FOUND)
    };
    match (request.op, slice) {
        (Op::Read, Ok(slice)) => {
            write_response(stream, Ok(request.len))?;
            slice.send_to(stream)
        }
        (Op::Write, Ok(slice)) => {
            slice.recv_from(stream)?;
            write_response(stream, Ok(request.len))
        }
        (Op::Read, Err(code)) => write_response(stream, Err(code)),
        (Op::ReadDisk, _) => write_response(stream, Err(ErrorCode::INVALID_PARAMS)),
        (Op::Write, Err(code)) => {
            // Drain the payload so the connection stays usable, then refuse.
            std::io::copy(
                &mut std::io::Read::take(&mut *stream, request.len),
                &mut std::io::sink(),
            )?;
            write_response(stream, Err(code))
        }
    }
}

/// Reads a key of `key_len` bytes from the peer and answers with that object from this
/// node's SSD tier.
fn serve_disk_read(
    stream: &mut TcpStream,
    disk: Option<&DiskTier>,
    key_len: u64,
) -> std::io::Result<()> {
    let mut key = vec![0u8; usize::try_from(key_len).unwrap_or(0)];
    std::io::Read::read_exact(stream, &mut key)?;
    let value = match (disk, std::str::from_utf8(&key)) {
        (Some(disk), Ok(key)) => disk.read_staged(key),
        (None, _) => Err(ErrorCode::OBJECT_NOT_FOUND),
        (_, Err(_)) => Err(ErrorCode::INVALID_KEY),
    };
    match value {
        Ok(value) => {
            write_response(stream, Ok(value.len() as u64))?;
            std::io::Write::write_all(stream, &value)
        }
        Err(code) => write_response(stream, Err(code)),
    }
}
