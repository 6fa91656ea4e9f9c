//! The running process's side of a handover: its handover socket, the asks it takes,
//! and sending what it hands over.

use std::os::fd::BorrowedFd;
use std::os::unix::net::{UnixListener as StdListener, UnixStream};
use std::time::Duration;

use tokio::sync::mpsc;

use mooncake_core::protocol::address::SocketAddress;
use mooncake_shm::fd_passing::peer_credentials;

use super::{
    Answer, Ask, HandedOver, Outcome, TAKEOVER_DEADLINE, read_frame, send_descriptors, send_frame,
};

/// How long an asking process may take to send its ask.
const ASK_DEADLINE: Duration = Duration::from_secs(5);

/// Binds the handover socket `socket` (mode 0600 for a socket file; a stale file is
/// replaced).
pub fn listen(socket: &SocketAddress) -> std::io::Result<StdListener> {
    if let SocketAddress::Path(path) = socket
        && UnixStream::connect(path).is_err()
    {
        let _ = std::fs::remove_file(path);
    }
    let listener = StdListener::bind_addr(&socket.to_std()?)?;
    if let SocketAddress::Path(path) = socket {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    }
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// Takes asks on `listener`: a process of another user, or one whose ask is not ours,
/// gets a refusal and the running process goes on; an acceptable ask is passed to
/// `asks` (one at a time: the next waits until the serving loop took this one).
pub async fn take_asks(listener: StdListener, asks: mpsc::Sender<UnixStream>) {
    let Ok(listener) = tokio::net::UnixListener::from_std(listener) else {
        return;
    };
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(stream) = stream.into_std() else {
            continue;
        };
        let checked = tokio::task::spawn_blocking(move || check_ask(stream)).await;
        if let Ok(Some(stream)) = checked
            && asks.send(stream).await.is_err()
        {
            return;
        }
    }
}

/// The stream when its ask may be answered; refuses it otherwise.
fn check_ask(stream: UnixStream) -> Option<UnixStream> {
    // Accepted by the runtime, hence non-blocking: the exchange blocks, with deadlines.
    stream.set_nonblocking(false).ok()?;
    let ours = nix::unistd::geteuid().as_raw();
    let uid = peer_credentials(&stream).ok()?.uid;
    if uid != ours {
        tracing::warn!(uid, "refused a handover asked by another user");
        let _ = stream.set_write_timeout(Some(ASK_DEADLINE));
        let _ = send_frame(
            &stream,
            &Answer::Refused(format!(
                "only uid {ours} may take this mooncake_client over"
            )),
        );
        return None;
    }
    let _ = stream.set_read_timeout(Some(ASK_DEADLINE));
    let ask: Ask = read_frame(&stream).ok()?;
    if let Some(reason) = ask.refusal() {
        tracing::warn!(%reason, "refused a handover; still serving");
        let _ = send_frame(&stream, &Answer::Refused(reason));
        return None;
    }
    Some(stream)
}

/// Sends `state` and `fds` to the taker on `stream` and waits for its outcome: `Ok`
/// once it serves, the reason otherwise (the caller then serves on).
pub fn hand_over(
    stream: &UnixStream,
    state: HandedOver,
    fds: &[BorrowedFd<'_>],
) -> Result<(), String> {
    let io = |e: std::io::Error| format!("the new process went away: {e}");
    let _ = stream.set_read_timeout(Some(TAKEOVER_DEADLINE));
    send_frame(stream, &Answer::Accepted(Box::new(state))).map_err(io)?;
    send_descriptors(stream, fds).map_err(io)?;
    match read_frame::<Outcome>(stream).map_err(io)? {
        Outcome::Serving => Ok(()),
        Outcome::Failed(reason) => Err(reason),
    }
}
