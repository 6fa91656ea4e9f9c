//! The dummy-facing server: the Unix socket listener, peer checks, the handshake and
//! one tarpc channel per dummy. What the connections share is [`ServerState`].

use std::os::unix::net::{UnixListener as StdListener, UnixStream as StdStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tarpc::server::BaseChannel;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use mooncake_core::protocol::address::SocketAddress;
use mooncake_core::protocol::codec;
use mooncake_core::protocol::handshake::{RealFrame, encode_frame};
use mooncake_core::protocol::rpc::{
    PutSource, RealClientRpc, RealClientRpcRequest, RealClientRpcResponse,
};
use mooncake_core::protocol::serving::serve_until_drained;
use mooncake_core::protocol::unix_stream::RpcUnixStream;
use mooncake_shm::fd_passing::{PeerCredentials, peer_credentials};

use crate::handshake::{self, Outcome};
use crate::rpc::DummyHandler;
use crate::session::Session;
use crate::state::{Admission, MAX_HANDSHAKES, MAX_REFUSALS, ServerState};

/// How long a dummy may take for its whole handshake (every frame together); then the
/// connection is closed.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// How long a refused peer may take to send its hello before it gets its refusal.
const REFUSAL_WAIT: Duration = Duration::from_secs(1);

/// Counts one refusal in progress until dropped.
struct Refusing<'a>(&'a AtomicUsize);

impl<'a> Refusing<'a> {
    fn enter(count: &'a AtomicUsize) -> Option<Self> {
        if count.fetch_add(1, Ordering::Relaxed) >= MAX_REFUSALS {
            count.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Refusing(count))
    }
}

impl Drop for Refusing<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why the listener could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Another process serves this socket.
    #[error(
        "{socket} is already in use: another mooncake_client is serving it; stop it or choose another --port / --socket_path"
    )]
    InUse {
        /// The socket.
        socket: SocketAddress,
    },
    /// Something that is not a socket exists at the path (it is left alone).
    #[error(
        "{socket} exists and is not a socket: mooncake_client replaces only a stale socket file; choose another --socket_path or remove the file yourself"
    )]
    NotASocket {
        /// The socket.
        socket: SocketAddress,
    },
    /// Any other failure.
    #[error("cannot listen on {socket}: {source}")]
    Other {
        /// The socket.
        socket: SocketAddress,
        /// The OS error.
        source: std::io::Error,
    },
}

/// Binds the dummy socket. A stale socket file (nobody listening) is replaced; a live
/// one is `InUse`; any other file at the path is left alone (`NotASocket`). Socket
/// files get mode 0600.
pub fn bind(socket: &SocketAddress) -> Result<StdListener, BindError> {
    let other = |source| BindError::Other {
        socket: socket.clone(),
        source,
    };
    if let SocketAddress::Path(path) = socket
        && let Ok(existing) = std::fs::symlink_metadata(path)
    {
        use std::os::unix::fs::FileTypeExt;
        if !existing.file_type().is_socket() {
            return Err(BindError::NotASocket {
                socket: socket.clone(),
            });
        }
        if StdStream::connect(path).is_ok() {
            return Err(BindError::InUse {
                socket: socket.clone(),
            });
        }
        std::fs::remove_file(path).map_err(other)?;
    }
    let addr = socket.to_std().map_err(other)?;
    let listener = StdListener::bind_addr(&addr).map_err(|e| match e.kind() {
        std::io::ErrorKind::AddrInUse => BindError::InUse {
            socket: socket.clone(),
        },
        _ => other(e),
    })?;
    if let SocketAddress::Path(path) = socket {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(other)?;
    }
    listener.set_nonblocking(true).map_err(other)?;
    Ok(listener)
}

/// How [`serve`] ended.
#[derive(Debug)]
pub enum Served {
    /// `shutdown` turned true.
    Stopped,
    /// A new process asked to take over (see `handover`): no dummy is served any more,
    /// and the listener is handed back to give away.
    HandingOver {
        /// The dummy listener, not accepting.
        listener: StdListener,
        /// The asking process.
        asker: StdStream,
    },
}

/// Longest wait for the dummies' connections to drain before a handover goes on.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

/// Accepts dummies until `shutdown` turns true, or until a process that will take
/// over arrives on `asks`: then the dummies' connections are drained (every request
/// being served is answered; later ones are left unserved) and the listener returned.
pub async fn serve(
    listener: StdListener,
    state: Arc<ServerState>,
    mut shutdown: watch::Receiver<bool>,
    asks: &mut tokio::sync::mpsc::Receiver<StdStream>,
) -> Served {
    let listener = match UnixListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, "cannot register the listener with the runtime");
            return Served::Stopped;
        }
    };
    let asker = loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    tokio::spawn(connection(stream, Arc::clone(&state)));
                }
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(asker) = asks.recv() => break asker,
            () = mooncake_core::process::stop_requested(&mut shutdown) => return Served::Stopped,
        }
    };
    let listener = match listener.into_std() {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, "cannot take the dummy listener back from the runtime");
            return Served::Stopped;
        }
    };
    drain(&state).await;
    Served::HandingOver { listener, asker }
}

/// Drains every dummy connection (see [`serve`]) and waits until none is left.
async fn drain(state: &ServerState) {
    let started = std::time::Instant::now();
    let attached = state.sessions.count();
    state.drain.send_replace(true);
    while state.sessions.count() > 0 && started.elapsed() < DRAIN_DEADLINE {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    tracing::info!(
        dummies = attached,
        left = state.sessions.count(),
        drain_ms = started.elapsed().as_millis(),
        "dummy connections drained for a handover"
    );
}

/// Serves one accepted connection from handshake to close. The peer's credentials are
/// checked first: a disallowed uid gets its refusal from this task (no thread, one small
/// read bounded by [`REFUSAL_WAIT`]); an allowed one gets a blocking thread for its
/// handshake (at most [`MAX_HANDSHAKES`] at once) for at most [`HANDSHAKE_DEADLINE`].
async fn connection(stream: UnixStream, state: Arc<ServerState>) {
    let peer = match stream.peer_cred() {
        Ok(peer) => peer,
        Err(error) => {
            tracing::debug!(%error, "no credentials for an accepted connection");
            return;
        }
    };
    let uid = peer.uid();
    if !state.is_allowed(uid) {
        tracing::warn!(
            pid = peer.pid(),
            uid,
            "refused a dummy with a disallowed uid"
        );
        let reason = format!(
            "uid {uid} is not allowed to use this mooncake_client (it runs as uid {}); start it with --allowed_uids={uid} or run the dummy as the same user",
            nix::unistd::geteuid().as_raw(),
        );
        refuse(stream, &state.admission, reason).await;
        return;
    }
    let Ok(permit) = Arc::clone(&state.admission.handshakes).try_acquire_owned() else {
        tracing::warn!(
            pid = peer.pid(),
            uid,
            "refused a connection: {MAX_HANDSHAKES} handshakes are in progress"
        );
        let reason = format!(
            "mooncake_client is busy: {MAX_HANDSHAKES} handshakes are in progress; try again"
        );
        refuse(stream, &state.admission, reason).await;
        return;
    };
    let Ok(std_stream) = stream.into_std() else {
        return;
    };
    let Ok(watchdog) = std_stream.try_clone() else {
        return;
    };
    let handshake_state = Arc::clone(&state);
    let handshake = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let outcome = handshake_blocking(&std_stream, &handshake_state);
        (std_stream, outcome)
    });
    let result = match tokio::time::timeout(HANDSHAKE_DEADLINE, handshake).await {
        Ok(joined) => joined,
        Err(_) => {
            // Unblocks the handshake thread's read: it returns and frees its slot.
            let _ = watchdog.shutdown(std::net::Shutdown::Both);
            tracing::warn!(
                pid = peer.pid(),
                uid,
                "a peer did not finish its handshake within {HANDSHAKE_DEADLINE:?}; closed"
            );
            return;
        }
    };
    drop(watchdog);
    let Ok((std_stream, outcome)) = result else {
        return;
    };
    let session = match outcome {
        Ok(Outcome::Session(session)) => session,
        Ok(Outcome::Attached) => return,
        Err(handshake::HandshakeError::Io(error))
            if error.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            tracing::debug!("a peer connected and closed without a handshake (a liveness probe?)");
            return;
        }
        Err(error) => {
            tracing::warn!(%error, "dummy handshake failed");
            return;
        }
    };
    // Listed in status before the dummy's setup returns.
    let _listed = Listed::new(&state, &session);
    if let Err(error) = handshake::send(&std_stream, &RealFrame::Attached) {
        tracing::warn!(%error, "dummy left during the handshake");
        return;
    }
    let stream = match std_stream
        .set_read_timeout(None)
        .and_then(|()| RpcUnixStream::new(std_stream))
    {
        Ok(stream) => stream,
        Err(error) => {
            tracing::warn!(%error, "cannot switch the dummy connection to RPC");
            return;
        }
    };
    serve_session(state, session, codec::serving_transport(stream)).await;
}

/// Serves one dummy session over `transport` until it closes, then releases everything
/// the dummy registered.
pub async fn serve_session<T>(state: Arc<ServerState>, session: Arc<Session>, transport: T)
where
    T: tarpc::Transport<
            tarpc::Response<RealClientRpcResponse>,
            tarpc::ClientMessage<RealClientRpcRequest>,
        > + Send
        + 'static,
{
    let _listed = Listed::new(&state, &session);
    let info = session.info();
    tracing::info!(pid = info.pid, uid = info.uid, name = %info.name, segments = info.segments, mapped_bytes = info.mapped_bytes, "dummy attached");
    let handler = DummyHandler {
        state: Arc::clone(&state),
        session: Arc::clone(&session),
    };
    let mut drained = state.drain.subscribe();
    serve_until_drained(
        BaseChannel::with_defaults(transport),
        handler.serve(),
        is_quick,
        |request, serve| {
            tokio::spawn(request.execute(serve));
        },
        async move {
            let _ = drained.wait_for(|drain| *drain).await;
        },
    )
    .await;
    tracing::info!(pid = info.pid, name = %info.name, "dummy detached; its shared memory is released");
}

/// Lists a session with the server while it is served, and unlists it however serving
/// ends (a return, an error or a panic), which releases its shared memory once its last
/// request is done.
struct Listed {
    state: Arc<ServerState>,
    session: Arc<Session>,
}

impl Listed {
    fn new(state: &Arc<ServerState>, session: &Arc<Session>) -> Self {
        state.sessions.insert(Arc::clone(session));
        Listed {
            state: Arc::clone(state),
            session: Arc::clone(session),
        }
    }
}

impl Drop for Listed {
    fn drop(&mut self) {
        self.state.sessions.remove(&self.session);
    }
}

/// Reads and writes that move at most this many bytes in total run in the session's
/// task: handing them to a task of their own costs more than their copies.
pub const INLINE_COPY_LIMIT: u64 = 256 << 10;

/// Calls that only ask the master (embedded: a function call), only change the session
/// (declared memory), or copy at most [`INLINE_COPY_LIMIT`] bytes run in the session's
/// task; larger copies and scans of the index run in tasks of their own.
fn is_quick(request: &RealClientRpcRequest) -> bool {
    match request {
        RealClientRpcRequest::Ping { .. }
        | RealClientRpcRequest::Exist { .. }
        | RealClientRpcRequest::ObjectSize { .. }
        | RealClientRpcRequest::ReplicaDesc { .. }
        | RealClientRpcRequest::Remove { .. }
        | RealClientRpcRequest::QueryTask { .. }
        | RealClientRpcRequest::DeclareMemory { .. }
        | RealClientRpcRequest::ForgetMemory { .. } => true,
        RealClientRpcRequest::Get { items } => {
            moves_little(items.iter().flat_map(|item| &item.dests).map(|r| r.len))
        }
        RealClientRpcRequest::GetRanges { reads } => moves_little(
            reads
                .iter()
                .flat_map(|read| &read.fragments)
                .map(|f| f.dest.len),
        ),
        RealClientRpcRequest::Put { items, .. } => {
            moves_little(items.iter().map(|item| match &item.source {
                PutSource::Shared(ranges) => {
                    ranges.iter().fold(0u64, |sum, r| sum.saturating_add(r.len))
                }
                PutSource::Inline(bytes) => bytes.len() as u64,
            }))
        }
        _ => false,
    }
}

/// True when `lengths` add up to at most [`INLINE_COPY_LIMIT`].
fn moves_little(lengths: impl Iterator<Item = u64>) -> bool {
    let mut total = 0u64;
    for len in lengths {
        total = total.saturating_add(len);
        if total > INLINE_COPY_LIMIT {
            return false;
        }
    }
    true
}

/// Answers a peer that may not attach: waits at most [`REFUSAL_WAIT`] for its hello (so
/// the refusal is its first answer), sends the reason and closes. Past
/// [`MAX_REFUSALS`] refusals in progress, closes at once.
async fn refuse(mut stream: UnixStream, admission: &Admission, reason: String) {
    let Some(_refusing) = Refusing::enter(&admission.refusals) else {
        return;
    };
    let Ok(frame) = encode_frame(&RealFrame::Refused(reason)) else {
        return;
    };
    let answer = async {
        let mut hello = [0u8; 1024];
        let _ = stream.read(&mut hello).await;
        let _ = stream.write_all(&frame).await;
    };
    let _ = tokio::time::timeout(REFUSAL_WAIT, answer).await;
}

fn handshake_blocking(
    stream: &StdStream,
    state: &ServerState,
) -> Result<Outcome, handshake::HandshakeError> {
    stream.set_nonblocking(false)?;
    // Each read is bounded too; the whole handshake by `HANDSHAKE_DEADLINE`.
    stream.set_read_timeout(Some(HANDSHAKE_DEADLINE))?;
    let peer: PeerCredentials = peer_credentials(stream)?;
    handshake::serve(stream, peer, &state.identity, &state.sessions)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mooncake_core::protocol::bounded::Batch;
    use mooncake_core::protocol::rpc::{GetItem, MemRange, PutItem, WriteMode};
    use mooncake_core::types::ReplicateConfig;

    fn get(lengths: &[u64]) -> RealClientRpcRequest {
        let items = lengths
            .iter()
            .map(|&len| GetItem {
                key: "k".into(),
                dests: vec![MemRange { addr: 4096, len }],
            })
            .collect();
        RealClientRpcRequest::Get {
            items: Batch(items),
        }
    }

    #[test]
    fn a_socket_path_that_is_not_a_socket_is_left_alone() {
        let dir = std::env::temp_dir().join(format!("mooncake-bind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("precious.txt");
        std::fs::write(&file, b"keep me").expect("write");
        let socket = SocketAddress::Path(file.clone());
        assert!(matches!(bind(&socket), Err(BindError::NotASocket { .. })));
        assert_eq!(std::fs::read(&file).expect("still there"), b"keep me");
        // A stale socket file is replaced.
        let stale = dir.join("stale.sock");
        drop(StdListener::bind(&stale).expect("bind"));
        assert!(bind(&SocketAddress::Path(stale.clone())).is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn small_copies_run_inline_and_large_ones_in_their_own_task() {
        assert!(is_quick(&get(&[4096; 32])));
        assert!(is_quick(&get(&[INLINE_COPY_LIMIT])));
        assert!(!is_quick(&get(&[INLINE_COPY_LIMIT, 1])));
        assert!(!is_quick(&get(&[u64::MAX, u64::MAX])), "no overflow");
        let put = |len: usize| RealClientRpcRequest::Put {
            items: Batch(vec![PutItem {
                key: "k".into(),
                source: PutSource::Inline(serde_bytes::ByteBuf::from(vec![0; len])),
            }]),
            config: ReplicateConfig::default(),
            mode: WriteMode::Put,
        };
        assert!(is_quick(&put(1000)));
        assert!(!is_quick(&put(300 << 10)));
        assert!(!is_quick(&RealClientRpcRequest::RemoveAll { force: false }));
    }
}
