//! The dummy's link to its real client: connect, handshake, register shared memory, and
//! reconnect after the real client restarts.
//!
//! Calls never wait for a dead real client: a closed socket is noticed before each call
//! (a zero-timeout `poll` for hang-up), the call fails with `RPC_FAIL`, and the next call
//! after a short backoff tries to connect again and, on success, registers every segment
//! anew. Handles that point into the old real client's memory are invalidated by the
//! change of instance id.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
#[cfg(feature = "embedded")]
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::socket::{MsgFlags, recv};

use mooncake_core::protocol::PROTOCOL_VERSION;
use mooncake_core::protocol::address::SocketAddress;
use mooncake_core::protocol::codec;
use mooncake_core::protocol::handshake::{
    DummyFrame, Purpose, RealFrame, SegmentRegistration, decode_len, decode_payload, encode_frame,
};
use mooncake_core::protocol::rpc::{
    RealClientRpcClient, RealClientRpcRequest, RealClientRpcResponse,
};
use mooncake_core::protocol::unix_stream::RpcUnixStream;
use mooncake_shm::fd_passing::{peer_credentials, recv_exact_with_fds, send_with_fd};

use crate::memory::Offer;

/// How long connecting and the handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// First wait between reconnect attempts; doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(20);
/// Longest wait between reconnect attempts.
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Why connecting to the real client failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// Nobody listens on the socket, or the socket could not be used.
    #[error(
        "cannot connect to mooncake_client at {address}: {source}; is mooncake_client running with the same --port (or --socket_path)?"
    )]
    Unreachable {
        /// The address tried.
        address: SocketAddress,
        /// The OS error.
        source: std::io::Error,
    },
    /// The real client refused the dummy.
    #[error("mooncake_client at {address} refused this process: {reason}")]
    Refused {
        /// The address.
        address: SocketAddress,
        /// Its explanation.
        reason: String,
    },
    /// The process serving the socket is not one this dummy trusts with its memory.
    #[error(
        "the process serving {address} (pid {pid}) runs as uid {uid}, neither this process's uid {own} nor root: nothing was sent to it. If it is your mooncake_client, list its uid in {CLIENT_UIDS_ENV} (e.g. {CLIENT_UIDS_ENV}={uid}); otherwise another process holds the socket name"
    )]
    Untrusted {
        /// The address.
        address: SocketAddress,
        /// The serving process.
        pid: i32,
        /// Its uid.
        uid: u32,
        /// This process's effective uid.
        own: u32,
    },
    /// `MOONCAKE_CLIENT_UIDS` is not a list of uids.
    #[error("{CLIENT_UIDS_ENV}={value:?} is not a comma-separated list of numeric uids")]
    BadTrustedUids {
        /// The variable's value.
        value: String,
    },
    /// The handshake broke down.
    #[error("handshake with mooncake_client at {address} failed: {reason}")]
    Protocol {
        /// The address.
        address: SocketAddress,
        /// What went wrong.
        reason: String,
    },
}

/// Environment variable: uids a dummy accepts as its real client besides its own
/// effective uid and root (comma-separated).
pub const CLIENT_UIDS_ENV: &str = "MOONCAKE_CLIENT_UIDS";

/// The uids listed in [`CLIENT_UIDS_ENV`] (none when unset or blank).
fn trusted_uids() -> Result<Vec<u32>, ConnectError> {
    let Ok(value) = std::env::var(CLIENT_UIDS_ENV) else {
        return Ok(Vec::new());
    };
    value
        .split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| part.parse::<u32>())
        .collect::<Result<_, _>>()
        .map_err(|_| ConnectError::BadTrustedUids {
            value: value.clone(),
        })
}

/// Checks that the process behind `stream` is one this dummy may share memory with:
/// its own effective uid, root, or a uid of [`CLIENT_UIDS_ENV`]. Runs before anything
/// is sent: while `mooncake_client` is down, any process can bind its socket name.
fn check_server(stream: &UnixStream, address: &SocketAddress) -> Result<(), ConnectError> {
    let peer = peer_credentials(stream).map_err(|source| ConnectError::Unreachable {
        address: address.clone(),
        source,
    })?;
    let own = nix::unistd::geteuid().as_raw();
    if peer.uid == own || peer.uid == 0 || trusted_uids()?.contains(&peer.uid) {
        return Ok(());
    }
    tracing::error!(
        pid = peer.pid,
        uid = peer.uid,
        %address,
        "refusing to share memory with a real client of another user"
    );
    Err(ConnectError::Untrusted {
        address: address.clone(),
        pid: peer.pid,
        uid: peer.uid,
        own,
    })
}

/// Who this dummy is, as told to the real client.
#[derive(Clone, Debug)]
pub struct Identity {
    /// Random id, stable across reconnects.
    pub client_id: u128,
    /// Human-readable name.
    pub name: String,
}

/// How requests reach the real client.
#[derive(Clone, Debug)]
pub enum RealClientStub {
    /// A tarpc channel over the Unix socket.
    Socket(tarpc::client::Channel<RealClientRpcRequest, RealClientRpcResponse>),
    /// Direct calls into the real client of this process, on the caller's thread.
    #[cfg(feature = "embedded")]
    InProcess(Arc<mooncake_real_client::in_process::DirectSession>),
}

impl tarpc::client::stub::Stub for RealClientStub {
    type Req = RealClientRpcRequest;
    type Resp = RealClientRpcResponse;

    async fn call(
        &self,
        ctx: tarpc::context::Context,
        request: RealClientRpcRequest,
    ) -> Result<RealClientRpcResponse, tarpc::client::RpcError> {
        match self {
            RealClientStub::Socket(channel) => channel.call(ctx, request).await,
            // Served right here, on the caller's thread (see `run_in_process`).
            #[cfg(feature = "embedded")]
            RealClientStub::InProcess(direct) => direct.call_blocking(ctx, request),
        }
    }
}

/// The dummy's RPC client, whichever way it reaches its real client.
pub type RealClient = RealClientRpcClient<RealClientStub>;

/// A live session with one real client instance.
#[derive(Debug)]
pub struct Connected {
    /// The RPC client.
    pub rpc: RealClient,
    /// Instance id of the real client.
    pub instance_id: u128,
    /// Name of the real client's segment (its `host:port`).
    pub segment_name: String,
    /// Process id of the real client (from the socket's credentials; none in-process or
    /// when its pid namespace is not visible), named with Yama's `PR_SET_PTRACER`
    /// before declaring ordinary memory.
    pub real_client_pid: Option<u32>,
    /// A duplicate of the socket, used only to notice hang-ups (a peek that reads EOF);
    /// none for an in-process real client.
    watch: Option<OwnedFd>,
}

impl Connected {
    /// Closes the connection now (both directions), so the real client releases this
    /// dummy at once even while clones of the client are still alive.
    pub fn disconnect(&self) {
        if let Some(watch) = &self.watch {
            let _ = nix::sys::socket::shutdown(
                std::os::fd::AsRawFd::as_raw_fd(watch),
                nix::sys::socket::Shutdown::Both,
            );
        }
    }

    /// True when the real client has closed the connection.
    pub fn peer_hung_up(&self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(watch) = &self.watch else {
            return false;
        };
        let mut byte = [0u8; 1];
        let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
        match recv(watch.as_raw_fd(), &mut byte, flags) {
            Ok(0) => true,
            Ok(_) | Err(Errno::EAGAIN | Errno::EINTR) => false,
            Err(_) => true,
        }
    }
}

/// The state of the link.
#[derive(Debug)]
pub enum Link {
    /// Serving calls.
    Up(Connected),
    /// Waiting to reconnect.
    Down {
        /// Earliest next attempt.
        retry_at: Instant,
        /// Current backoff.
        backoff: Duration,
    },
    /// `close()` was called.
    Closed,
}

impl Link {
    /// A link that will try to connect on the next call.
    pub fn down_now() -> Self {
        Link::Down {
            retry_at: Instant::now(),
            backoff: MIN_BACKOFF,
        }
    }

    /// Marks the link down after a failure, keeping the backoff growing.
    pub fn fail(&mut self) {
        let backoff = match self {
            Link::Down { backoff, .. } => (*backoff * 2).min(MAX_BACKOFF),
            _ => MIN_BACKOFF,
        };
        if !matches!(self, Link::Closed) {
            *self = Link::Down {
                retry_at: Instant::now() + backoff,
                backoff,
            };
        }
    }
}

fn send_frame(
    stream: &UnixStream,
    frame: &DummyFrame,
    fd: Option<std::os::fd::BorrowedFd<'_>>,
) -> std::io::Result<()> {
    let bytes = encode_frame(frame).map_err(std::io::Error::other)?;
    send_with_fd(stream, &bytes, fd)
}

fn receive(stream: &UnixStream) -> std::io::Result<RealFrame> {
    let mut prefix = [0u8; 4];
    recv_exact_with_fds(stream, &mut prefix)?;
    let len = decode_len(prefix).map_err(std::io::Error::other)?;
    let mut payload = vec![0u8; len];
    recv_exact_with_fds(stream, &mut payload)?;
    decode_payload(&payload).map_err(std::io::Error::other)
}

struct Handshake<'a> {
    address: &'a SocketAddress,
    stream: UnixStream,
}

impl<'a> Handshake<'a> {
    fn open(
        address: &'a SocketAddress,
        identity: &Identity,
        purpose: Purpose,
    ) -> Result<(Self, u128, String), ConnectError> {
        let unreachable = |source| ConnectError::Unreachable {
            address: address.clone(),
            source,
        };
        let addr = address.to_std().map_err(unreachable)?;
        let stream = UnixStream::connect_addr(&addr).map_err(unreachable)?;
        check_server(&stream, address)?;
        stream
            .set_read_timeout(Some(HANDSHAKE_TIMEOUT))
            .map_err(unreachable)?;
        let handshake = Handshake { address, stream };
        handshake.send(
            &DummyFrame::Hello {
                version: PROTOCOL_VERSION,
                client_id: identity.client_id,
                pid: std::process::id(),
                name: identity.name.clone(),
                purpose,
            },
            None,
        )?;
        match handshake.receive()? {
            RealFrame::Welcome {
                version,
                instance_id,
                segment_name,
                ..
            } if version == PROTOCOL_VERSION => Ok((handshake, instance_id, segment_name)),
            RealFrame::Welcome { version, .. } => Err(handshake.protocol(format!(
                "protocol version mismatch: real client speaks {version}, this dummy speaks {PROTOCOL_VERSION}"
            ))),
            RealFrame::Refused(reason) => Err(ConnectError::Refused {
                address: address.clone(),
                reason,
            }),
            other => Err(handshake.protocol(format!("unexpected answer {other:?}"))),
        }
    }

    fn protocol(&self, reason: String) -> ConnectError {
        ConnectError::Protocol {
            address: self.address.clone(),
            reason,
        }
    }

    fn send(
        &self,
        frame: &DummyFrame,
        fd: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<(), ConnectError> {
        send_frame(&self.stream, frame, fd).map_err(|e| self.protocol(e.to_string()))
    }

    fn receive(&self) -> Result<RealFrame, ConnectError> {
        receive(&self.stream).map_err(|e| self.protocol(e.to_string()))
    }

    fn register(&self, offer: &Offer) -> Result<(), ConnectError> {
        let registration = SegmentRegistration {
            dummy_base: offer.memory.base(),
            len: offer.memory.len() as u64,
            kind: offer.kind,
        };
        let Some(fd) = offer.memory.fd() else {
            return Err(
                self.protocol("application memory cannot be shared with another process".into())
            );
        };
        self.send(&DummyFrame::Register(registration), Some(fd))?;
        match self.receive()? {
            RealFrame::Registered => Ok(()),
            RealFrame::Rejected(reason) => Err(ConnectError::Refused {
                address: self.address.clone(),
                reason: format!("shared memory rejected: {reason}"),
            }),
            other => Err(self.protocol(format!("unexpected answer {other:?}"))),
        }
    }
}

/// Opens a session: handshake, registration of every offered segment, then RPC.
/// Must be called inside the dummy's runtime (the RPC dispatch is spawned on it).
pub fn connect(
    address: &SocketAddress,
    identity: &Identity,
    offers: &[Offer],
) -> Result<Connected, ConnectError> {
    let (handshake, instance_id, segment_name) =
        Handshake::open(address, identity, Purpose::Session)?;
    for offer in offers {
        handshake.register(offer)?;
    }
    handshake.send(&DummyFrame::Ready, None)?;
    match handshake.receive()? {
        RealFrame::Attached => {}
        other => return Err(handshake.protocol(format!("unexpected answer {other:?}"))),
    }
    let stream = handshake.stream;
    let fail = |e: std::io::Error| ConnectError::Protocol {
        address: address.clone(),
        reason: e.to_string(),
    };
    let real_client_pid = peer_credentials(&stream)
        .ok()
        .and_then(|peer| u32::try_from(peer.pid).ok())
        .filter(|pid| *pid > 0);
    let watch = stream.as_fd().try_clone_to_owned().map_err(fail)?;
    stream.set_read_timeout(None).map_err(fail)?;
    let stream = RpcUnixStream::new(stream).map_err(fail)?;
    let transport = codec::transport(stream);
    let channel = tarpc::client::new(tarpc::client::Config::default(), transport).spawn();
    Ok(Connected {
        rpc: RealClientRpcClient::from(RealClientStub::Socket(channel)),
        instance_id,
        segment_name,
        real_client_pid,
        watch: Some(watch),
    })
}

/// Registers one more segment with an existing session over a side connection.
pub fn attach(
    address: &SocketAddress,
    identity: &Identity,
    offer: &Offer,
) -> Result<(), ConnectError> {
    let (handshake, _, _) = Handshake::open(address, identity, Purpose::Attach)?;
    handshake.register(offer)
}

/// Where a dummy's real client is.
#[derive(Clone, Debug)]
pub enum Target {
    /// Another process, behind a Unix socket.
    Socket(SocketAddress),
    /// This process (embedded mode).
    #[cfg(feature = "embedded")]
    InProcess(crate::embedded::Host),
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Socket(address) => write!(f, "{address}"),
            #[cfg(feature = "embedded")]
            Target::InProcess(_) => write!(f, "the in-process real client"),
        }
    }
}

/// Runs a call to an in-process real client. Its stub serves the request on this
/// thread before returning, so the call completes when first polled; a pending poll
/// (never expected) is polled again after yielding the thread.
pub fn run_in_process<F: std::future::Future>(call: F) -> F::Output {
    let mut call = std::pin::pin!(call);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    loop {
        if let std::task::Poll::Ready(output) = call.as_mut().poll(&mut context) {
            return output;
        }
        std::thread::yield_now();
    }
}

impl Target {
    /// True for the real client of this process (calls run on the caller's thread).
    pub fn is_in_process(&self) -> bool {
        match self {
            Target::Socket(_) => false,
            #[cfg(feature = "embedded")]
            Target::InProcess(_) => true,
        }
    }

    /// Opens a session with every offered segment registered. Must run inside the
    /// dummy's runtime (the RPC dispatch is spawned on it).
    pub fn connect(
        &self,
        identity: &Identity,
        offers: &[Offer],
    ) -> Result<Connected, ConnectError> {
        match self {
            Target::Socket(address) => connect(address, identity, offers),
            #[cfg(feature = "embedded")]
            Target::InProcess(host) => connect_in_process(host, identity, offers),
        }
    }

    /// Registers one more segment with the open session.
    pub fn attach(&self, identity: &Identity, offer: &Offer) -> Result<(), ConnectError> {
        match self {
            Target::Socket(address) => attach(address, identity, offer),
            #[cfg(feature = "embedded")]
            Target::InProcess(host) => host
                .attach(identity.client_id, Arc::clone(&offer.memory))
                .map_err(refused_in_process),
        }
    }
}

/// Opens a session with the real client of this process, with `offers` registered.
#[cfg(feature = "embedded")]
fn connect_in_process(
    host: &crate::embedded::Host,
    identity: &Identity,
    offers: &[Offer],
) -> Result<Connected, ConnectError> {
    let memory: Vec<_> = offers.iter().map(|o| Arc::clone(&o.memory)).collect();
    let (direct, instance_id, segment_name) = host
        .connect(identity.client_id, identity.name.clone(), &memory)
        .map_err(refused_in_process)?;
    Ok(Connected::in_process(direct, instance_id, segment_name))
}

/// The in-process real client refused a session or a segment, for `reason`.
#[cfg(feature = "embedded")]
fn refused_in_process(reason: String) -> ConnectError {
    ConnectError::Refused {
        address: SocketAddress::Abstract("in-process".into()),
        reason,
    }
}

#[cfg(feature = "embedded")]
impl Connected {
    /// A session with an in-process real client.
    pub fn in_process(
        direct: mooncake_real_client::in_process::DirectSession,
        instance_id: u128,
        segment_name: String,
    ) -> Self {
        Connected {
            rpc: RealClientRpcClient::from(RealClientStub::InProcess(Arc::new(direct))),
            instance_id,
            segment_name,
            real_client_pid: None,
            watch: None,
        }
    }
}
