//! Planned handover: a new `mooncake_client` (`--takeover`) takes over a running one
//! without losing its node's cache.
//!
//! The running process (the giver) listens on a handover socket next to its dummy
//! socket ([`socket_for`]), answering only processes of its own user. The new process
//! (the taker) asks with its [`HANDOVER_VERSION`]; a different version is refused with
//! a reason and the giver goes on serving as if nothing happened. Otherwise the giver
//! stops accepting dummies and drains their connections: requests already being
//! served finish and are answered, later ones are left unserved and unanswered (the
//! dummy sends them again to the new process, which keeps the instance id: see the
//! dummy's reconnect). It stops its background work (heartbeats, tasks, the SSD
//! tier's feeding, the embedded master's server and maintenance), then sends
//! [`HandedOver`] (the instance and client ids, the segment's name, id and size, the
//! embedded master's objects) followed by its descriptors: the segment's memfd, the
//! dummy listener, the transfer listener, the handover listener, and the readiness and
//! embedded-master listeners when it has them. The taker maps the same memory, installs the master's
//! objects, serves on the same listeners (so no connection is refused meanwhile), and
//! answers [`Outcome::Serving`]; the giver then exits without unmounting anything: the
//! master sees one segment that never left. Should the taker fail instead, the giver
//! resumes serving.
//!
//! ```text
//! taker                                   giver
//!   Ask{version}                 ──────▶
//!                                ◀──────  Refused(reason) | Accepted(HandedOver)
//!                                ◀──────  descriptors, one per 1-byte frame
//!   Outcome                      ──────▶
//! ```
//!
//! Every frame is a u64 LE length and that many bytes of postcard; a state frame may
//! carry at most [`MAX_STATE_BYTES`].

pub mod giving;
mod node;
pub mod taking;

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use mooncake_core::master_api::replication::SnapshotState;
use mooncake_core::protocol::address::SocketAddress;
use mooncake_shm::fd_passing::{recv_exact_with_fds, send_with_fd};

/// Version of this exchange and of [`HandedOver`]; both sides must speak the same.
pub const HANDOVER_VERSION: u32 = 2;
/// Largest frame either side reads (the embedded master's objects of a very large
/// node fit; anything larger is refused, not allocated).
pub const MAX_STATE_BYTES: u64 = 16 << 30;
/// How long the giver waits for the taker's outcome before it resumes serving.
pub const TAKEOVER_DEADLINE: std::time::Duration = std::time::Duration::from_secs(120);
/// Bytes that open an ask.
const MAGIC: [u8; 4] = *b"MCHO";

/// The handover socket of the real client serving dummies at `dummies`.
pub fn socket_for(dummies: &SocketAddress) -> SocketAddress {
    match dummies {
        SocketAddress::Abstract(name) => SocketAddress::Abstract(format!("{name}.handover")),
        SocketAddress::Path(path) => {
            let mut path = path.clone().into_os_string();
            path.push(".handover");
            SocketAddress::Path(path.into())
        }
    }
}

/// The taker's question.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ask {
    /// [`MAGIC`].
    pub magic: [u8; 4],
    /// The taker's [`HANDOVER_VERSION`].
    pub version: u32,
}

impl Ask {
    /// This build's ask.
    pub fn ours() -> Ask {
        Ask {
            magic: MAGIC,
            version: HANDOVER_VERSION,
        }
    }

    /// Why the giver cannot hand over to this ask (`None`: it can).
    pub fn refusal(&self) -> Option<String> {
        if self.magic != MAGIC {
            return Some("not a handover request".into());
        }
        (self.version != HANDOVER_VERSION).then(|| {
            format!(
                "the running mooncake_client speaks handover version {HANDOVER_VERSION}, the new one {}: stop the running one and start the new one (its cache is lost), or upgrade through a release that speaks both",
                self.version
            )
        })
    }
}

/// The giver's answer.
#[derive(Debug, Serialize, Deserialize)]
pub enum Answer {
    /// Not handed over; the giver goes on serving.
    Refused(String),
    /// Handed over: the descriptors follow.
    Accepted(Box<HandedOver>),
}

/// What the taker says once it serves, or why it could not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// Serving: the giver exits.
    Serving,
    /// Failed: the giver resumes serving.
    Failed(String),
}

/// What a giver hands over besides its descriptors.
#[derive(Debug, Serialize, Deserialize)]
pub struct HandedOver {
    /// The real client's instance id (dummies see the same one).
    pub instance_id: u128,
    /// Its id at the master.
    pub client_id: u128,
    /// The segment's name (`host:port`).
    pub segment_name: String,
    /// Its id at the master (0 while not mounted).
    pub segment_id: u64,
    /// Its length (the memfd's).
    pub segment_len: u64,
    /// The file the segment lives in (`--segment_path`; `None`: a memfd).
    pub segment_path: Option<std::path::PathBuf>,
    /// False for a pure client.
    pub contributes: bool,
    /// Where peers reach the transfer engine.
    pub endpoint: String,
    /// The embedded master's state (`None` with a remote master).
    pub master: Option<SnapshotState>,
    /// A readiness listener follows the transfer listener.
    pub has_readiness: bool,
    /// An embedded master's TCP listener follows (last).
    pub has_master_listener: bool,
    /// Objects and bytes in the segment, for the taker's log.
    pub objects: u64,
}

impl HandedOver {
    /// How many descriptors follow the state.
    pub fn descriptor_count(&self) -> usize {
        4 + usize::from(self.has_readiness) + usize::from(self.has_master_listener)
    }
}

/// Writes one frame.
pub fn send_frame(stream: &UnixStream, value: &impl Serialize) -> std::io::Result<()> {
    let bytes = postcard::to_allocvec(value).map_err(std::io::Error::other)?;
    let mut writer = stream;
    writer.write_all(&(bytes.len() as u64).to_le_bytes())?;
    writer.write_all(&bytes)
}

/// Reads one frame of at most [`MAX_STATE_BYTES`].
pub fn read_frame<T: DeserializeOwned>(stream: &UnixStream) -> std::io::Result<T> {
    let mut reader = stream;
    let mut len = [0u8; 8];
    reader.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_STATE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("a handover frame of {len} bytes is over the limit of {MAX_STATE_BYTES}"),
        ));
    }
    let mut bytes = vec![0u8; usize::try_from(len).map_err(std::io::Error::other)?];
    reader.read_exact(&mut bytes)?;
    postcard::from_bytes(&bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()))
}

/// Sends descriptors, one per 1-byte frame.
pub fn send_descriptors(stream: &UnixStream, fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    fds.iter()
        .try_for_each(|fd| send_with_fd(stream, b"F", Some(fd.as_fd())))
}

/// Receives `count` descriptors sent by [`send_descriptors`].
pub fn receive_descriptors(stream: &UnixStream, count: usize) -> std::io::Result<Vec<OwnedFd>> {
    let mut fds = Vec::with_capacity(count);
    for _ in 0..count {
        let mut marker = [0u8; 1];
        let mut received = recv_exact_with_fds(stream, &mut marker)?;
        if marker != *b"F" || received.len() != 1 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "a handover descriptor frame without exactly one descriptor",
            ));
        }
        fds.append(&mut received);
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn asks_of_another_version_are_refused_with_what_to_do() {
        assert_eq!(Ask::ours().refusal(), None);
        let older = Ask {
            version: HANDOVER_VERSION + 1,
            ..Ask::ours()
        };
        let reason = older.refusal().expect("refused");
        assert!(reason.contains("handover version"), "{reason}");
        let stranger = Ask {
            magic: *b"XXXX",
            version: HANDOVER_VERSION,
        };
        assert!(stranger.refusal().is_some());
    }

    #[test]
    fn frames_round_trip_and_oversized_ones_are_refused() {
        let (a, b) = UnixStream::pair().expect("pair");
        send_frame(&a, &Outcome::Failed("no".into())).expect("send");
        assert_eq!(
            read_frame::<Outcome>(&b).expect("read"),
            Outcome::Failed("no".into())
        );
        let mut writer = &a;
        writer
            .write_all(&(MAX_STATE_BYTES + 1).to_le_bytes())
            .expect("write");
        let refused = read_frame::<Outcome>(&b).expect_err("over the limit");
        assert!(refused.to_string().contains("over the limit"), "{refused}");
    }

    #[test]
    fn descriptors_arrive_one_per_frame() {
        let (a, b) = UnixStream::pair().expect("pair");
        let (x, _y) = UnixStream::pair().expect("pair");
        send_descriptors(&a, &[x.as_fd(), x.as_fd()]).expect("send");
        assert_eq!(receive_descriptors(&b, 2).expect("receive").len(), 2);
    }

    #[test]
    fn the_socket_sits_next_to_the_dummy_socket() {
        assert_eq!(
            socket_for(&SocketAddress::Abstract("mooncake_client_50052".into())),
            SocketAddress::Abstract("mooncake_client_50052.handover".into())
        );
        assert_eq!(
            socket_for(&SocketAddress::Path("/run/mc.sock".into())),
            SocketAddress::Path("/run/mc.sock.handover".into())
        );
    }
}
