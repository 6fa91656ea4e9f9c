//! The new process's side of a handover (`mooncake_client --takeover`): asking the
//! running one, and what it receives.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use mooncake_core::protocol::address::SocketAddress;
use mooncake_shm::fd_passing::peer_credentials;

use super::{
    Answer, Ask, HandedOver, Outcome, read_frame, receive_descriptors, send_frame, socket_for,
};

/// Why taking over did not start.
#[derive(Debug, thiserror::Error)]
pub enum TakeoverError {
    /// Nothing answers on the handover socket.
    #[error(
        "--takeover: no mooncake_client to take over at {socket} ({source}); start without --takeover"
    )]
    Connect {
        /// The handover socket.
        socket: SocketAddress,
        /// Why connecting failed.
        source: std::io::Error,
    },
    /// The running process runs as another user.
    #[error(
        "--takeover: the mooncake_client at {socket} runs as uid {uid}; take it over as that user"
    )]
    OtherUser {
        /// The handover socket.
        socket: SocketAddress,
        /// Its uid.
        uid: u32,
    },
    /// The running process refused; it goes on serving.
    #[error("--takeover refused by the running mooncake_client (it goes on serving): {0}")]
    Refused(String),
    /// The exchange broke.
    #[error("--takeover: the exchange with the running mooncake_client failed: {0}")]
    Io(#[from] std::io::Error),
}

/// What was taken over: the state, the descriptors, and the stream to report on.
#[derive(Debug)]
pub struct Taken {
    /// The state.
    pub state: HandedOver,
    /// The descriptors.
    pub fds: TakenFds,
    /// Where to report the outcome.
    pub reporter: Reporter,
}

/// The descriptors a handover carries.
#[derive(Debug)]
pub struct TakenFds {
    /// The segment's memfd.
    pub segment: OwnedFd,
    /// The dummy socket's listener.
    pub dummies: OwnedFd,
    /// The transfer engine's TCP listener.
    pub transfer: OwnedFd,
    /// The handover socket's listener.
    pub handover: OwnedFd,
    /// The readiness port's listener.
    pub readiness: Option<OwnedFd>,
    /// The embedded master's TCP listener.
    pub master: Option<OwnedFd>,
    /// Process id of the giver.
    pub giver_pid: u32,
}

/// The connection to the process taken over, to tell it the outcome.
#[derive(Debug)]
pub struct Reporter {
    stream: UnixStream,
}

impl Reporter {
    /// Tells the giver how taking over went (it exits on `Serving`); false when it
    /// could not be told (it then serves on, and this process must not).
    pub fn report(&self, outcome: &Outcome) -> bool {
        match send_frame(&self.stream, outcome) {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "could not tell the old mooncake_client how the takeover went");
                false
            }
        }
    }
}

/// Asks the real client serving dummies at `dummies` to hand over, and receives what
/// it hands over.
pub fn take(dummies: &SocketAddress) -> Result<Taken, TakeoverError> {
    let socket = socket_for(dummies);
    let stream = socket
        .to_std()
        .and_then(|address| UnixStream::connect_addr(&address))
        .map_err(|source| TakeoverError::Connect {
            socket: socket.clone(),
            source,
        })?;
    let giver = peer_credentials(&stream)?;
    let uid = giver.uid;
    if uid != nix::unistd::geteuid().as_raw() {
        return Err(TakeoverError::OtherUser { socket, uid });
    }
    send_frame(&stream, &Ask::ours())?;
    let state = match read_frame::<Answer>(&stream)? {
        Answer::Refused(reason) => return Err(TakeoverError::Refused(reason)),
        Answer::Accepted(state) => *state,
    };
    let mut fds = receive_descriptors(&stream, state.descriptor_count())?.into_iter();
    let mut next = || {
        fds.next().ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, "a descriptor is missing")
        })
    };
    let segment = next()?;
    let dummies = next()?;
    let transfer = next()?;
    let handover = next()?;
    let readiness = state.has_readiness.then(&mut next).transpose()?;
    let master = state.has_master_listener.then(&mut next).transpose()?;
    Ok(Taken {
        state,
        fds: TakenFds {
            segment,
            dummies,
            transfer,
            handover,
            readiness,
            master,
            giver_pid: u32::try_from(giver.pid).unwrap_or(0),
        },
        reporter: Reporter { stream },
    })
}
