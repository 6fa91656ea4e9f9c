//! The real client's side of the handshake (see `mooncake_core::protocol::handshake`).
//!
//! It runs on a blocking socket with a read timeout, before the stream is handed to the
//! RPC layer, because descriptors arrive as ancillary data that tarpc cannot carry.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use mooncake_core::protocol::PROTOCOL_VERSION;
use mooncake_core::protocol::handshake::{
    DummyFrame, FrameError, Purpose, RealFrame, SegmentKind, SegmentRegistration, decode_len,
    decode_payload, encode_frame,
};
use mooncake_shm::SharedMemory;
use mooncake_shm::fd_passing::{PeerCredentials, recv_exact_with_fds, send_with_fd};

use crate::session::{Session, Sessions};

/// Most segments one dummy may register.
pub const MAX_SEGMENTS_PER_DUMMY: usize = 4096;

/// Why a handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// The socket failed or closed.
    #[error("socket error during handshake: {0}")]
    Io(#[from] std::io::Error),
    /// A frame did not decode.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The peer broke the protocol; it was told why.
    #[error("{0}")]
    Refused(String),
}

/// What the real client tells dummies about itself.
#[derive(Clone, Debug)]
pub struct ServerIdentity {
    /// Random id of this process.
    pub instance_id: u128,
    /// Name of the global segment.
    pub segment_name: String,
    /// Most shared memory one dummy may register.
    pub max_mapped_bytes: u64,
    /// Most shared memory all dummies together may register.
    pub max_total_mapped_bytes: u64,
    /// Most dummies attached at once.
    pub max_sessions: usize,
}

/// What a finished handshake produced.
#[derive(Debug)]
pub enum Outcome {
    /// A new session; RPC follows on the same stream.
    Session(Arc<Session>),
    /// A segment was added to an existing session; the connection is done.
    Attached,
}

/// Sends one frame to the dummy.
pub fn send(stream: &UnixStream, frame: &RealFrame) -> Result<(), HandshakeError> {
    send_with_fd(stream, &encode_frame(frame)?, None)?;
    Ok(())
}

fn receive(stream: &UnixStream) -> Result<(DummyFrame, Vec<OwnedFd>), HandshakeError> {
    let mut prefix = [0u8; 4];
    let mut fds = recv_exact_with_fds(stream, &mut prefix)?;
    let mut payload = vec![0u8; decode_len(prefix)?];
    fds.extend(recv_exact_with_fds(stream, &mut payload)?);
    Ok((decode_payload(&payload)?, fds))
}

fn refuse(stream: &UnixStream, reason: String) -> HandshakeError {
    let _ = send(stream, &RealFrame::Refused(reason.clone()));
    HandshakeError::Refused(reason)
}

/// Runs the handshake of one accepted connection.
pub fn serve(
    stream: &UnixStream,
    peer: PeerCredentials,
    identity: &ServerIdentity,
    sessions: &Sessions,
) -> Result<Outcome, HandshakeError> {
    let (hello, _) = receive(stream)?;
    let DummyFrame::Hello {
        version,
        client_id,
        name,
        purpose,
        ..
    } = hello
    else {
        return Err(refuse(
            stream,
            "protocol error: the first frame must be Hello".into(),
        ));
    };
    if version != PROTOCOL_VERSION {
        return Err(refuse(
            stream,
            format!(
                "protocol version mismatch: dummy speaks {version}, real client speaks {PROTOCOL_VERSION}; install matching versions of mooncake"
            ),
        ));
    }
    let session = match purpose {
        Purpose::Session if sessions.count() >= identity.max_sessions => {
            return Err(refuse(
                stream,
                format!(
                    "too many dummies attached (limit {}, --max_dummy_sessions); close unused ones or raise the limit",
                    identity.max_sessions
                ),
            ));
        }
        Purpose::Session => Arc::new(Session::new(
            client_id,
            u32::try_from(peer.pid).unwrap_or(0),
            peer.uid,
            name,
        )),
        Purpose::Attach => match sessions.get(client_id) {
            Some(session) if session.uid == peer.uid => session,
            _ => {
                return Err(refuse(
                    stream,
                    "no session for this client id; set up the dummy first".into(),
                ));
            }
        },
    };
    send(
        stream,
        &RealFrame::Welcome {
            version: PROTOCOL_VERSION,
            instance_id: identity.instance_id,
            segment_name: identity.segment_name.clone(),
            max_mapped_bytes: identity.max_mapped_bytes,
        },
    )?;
    loop {
        match receive(stream)? {
            (DummyFrame::Register(registration), fds) => {
                let answer = match register(&session, registration, fds, identity, sessions) {
                    Ok(()) => RealFrame::Registered,
                    Err(reason) => RealFrame::Rejected(reason),
                };
                send(stream, &answer)?;
                if purpose == Purpose::Attach {
                    return Ok(Outcome::Attached);
                }
            }
            (DummyFrame::Ready, _) if purpose == Purpose::Session => {
                return Ok(Outcome::Session(session));
            }
            (frame, _) => {
                return Err(refuse(
                    stream,
                    format!("protocol error: unexpected frame {frame:?}"),
                ));
            }
        }
    }
}

/// Failpoint of the registration of a dummy's shared memory (its pool, staging buffer
/// or a host allocation): when it fires the registration is refused as a failed
/// mapping would be, and the dummy's call fails with the reason.
pub const FAILPOINT_REGISTER: &str = "client.register";

fn register(
    session: &Arc<Session>,
    registration: SegmentRegistration,
    fds: Vec<OwnedFd>,
    identity: &ServerIdentity,
    sessions: &Sessions,
) -> Result<(), String> {
    let mut fds = fds.into_iter();
    let (Some(fd), None) = (fds.next(), fds.next()) else {
        return Err("a Register frame must carry exactly one memfd".into());
    };
    // One registration at a time, so that the total is a hard limit; the other
    // sessions' mappings are counted before this session's registry is locked.
    let _registering = sessions.registering();
    let others = sessions.mapped_bytes_except(session);
    let mut registry = session.registry().write();
    if registry.segment_count() >= MAX_SEGMENTS_PER_DUMMY {
        return Err(format!(
            "too many segments (limit {MAX_SEGMENTS_PER_DUMMY})"
        ));
    }
    let total = registry.mapped_bytes().saturating_add(registration.len);
    if total > identity.max_mapped_bytes {
        return Err(format!(
            "registering {} bytes would exceed the per-dummy limit of {} bytes (--max_dummy_shm_size)",
            registration.len, identity.max_mapped_bytes
        ));
    }
    if others.saturating_add(total) > identity.max_total_mapped_bytes {
        return Err(format!(
            "registering {} bytes would exceed the limit of {} bytes for all dummies together (--max_total_dummy_shm_size)",
            registration.len, identity.max_total_mapped_bytes
        ));
    }
    if mooncake_core::failpoint::hit(FAILPOINT_REGISTER).is_some() {
        return Err(format!(
            "cannot map the {} bytes of shared memory: injected failure (failpoint {FAILPOINT_REGISTER})",
            registration.len
        ));
    }
    let memory = SharedMemory::map_received(fd, registration.len).map_err(|e| e.to_string())?;
    registry
        .add(registration.dummy_base, Arc::new(memory))
        .map_err(|e| e.to_string())?;
    drop(registry);
    if registration.kind == SegmentKind::Staging {
        session.mark_staging(registration.dummy_base, registration.len);
    }
    tracing::debug!(client = %format!("{:032x}", session.client_id), ?registration, "segment registered");
    Ok(())
}
