//! Sending and receiving file descriptors over a Unix stream socket (SCM_RIGHTS), and
//! reading the peer's credentials (SO_PEERCRED).
//!
//! The helpers work on blocking std sockets: the handshake runs before the stream is
//! handed to the async RPC layer. A frame's fds ride on its first byte; the receiver
//! reads exactly the frame's length, so fds never leak into the next frame.

use std::io::{self, IoSlice, IoSliceMut, Write};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{
    ControlMessage, ControlMessageOwned, MsgFlags, getsockopt, recvmsg, sendmsg, sockopt,
};

/// Most descriptors accepted with one frame.
const MAX_FDS_PER_FRAME: usize = 4;

/// Credentials of the process at the other end of a socket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeerCredentials {
    /// Process id.
    pub pid: i32,
    /// Effective user id.
    pub uid: u32,
    /// Effective group id.
    pub gid: u32,
}

/// Reads SO_PEERCRED of a connected socket.
pub fn peer_credentials(stream: &UnixStream) -> io::Result<PeerCredentials> {
    let creds = getsockopt(stream, sockopt::PeerCredentials).map_err(io::Error::from)?;
    Ok(PeerCredentials {
        pid: creds.pid(),
        uid: creds.uid(),
        gid: creds.gid(),
    })
}

/// Writes `bytes`, attaching `fd` (if any) to the first byte.
pub fn send_with_fd(
    stream: &UnixStream,
    bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    let Some(fd) = fd else {
        let mut writer = stream;
        return writer.write_all(bytes);
    };
    let raw = [fd.as_raw_fd()];
    let cmsg = [ControlMessage::ScmRights(&raw)];
    let sent = loop {
        match sendmsg::<()>(
            stream.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &cmsg,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => break n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut writer = stream;
    writer.write_all(&bytes[sent..])
}

/// Reads exactly `buf.len()` bytes, returning any descriptors that arrived with them.
pub fn recv_exact_with_fds(stream: &UnixStream, buf: &mut [u8]) -> io::Result<Vec<OwnedFd>> {
    let mut fds = Vec::new();
    let mut filled = 0;
    while filled < buf.len() {
        let mut space = nix::cmsg_space!([RawFd; MAX_FDS_PER_FRAME]);
        let mut iov = [IoSliceMut::new(&mut buf[filled..])];
        let msg = match recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        };
        for cmsg in msg.cmsgs().map_err(io::Error::from)? {
            if let ControlMessageOwned::ScmRights(received) = cmsg {
                // SAFETY: the kernel just installed these descriptors in our table and
                // nothing else owns them.
                fds.extend(
                    received
                        .into_iter()
                        .map(|raw| unsafe { OwnedFd::from_raw_fd(raw) }),
                );
            }
        }
        if msg.flags.contains(MsgFlags::MSG_CTRUNC) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "too many file descriptors in one frame",
            ));
        }
        if msg.bytes == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "peer closed the connection",
            ));
        }
        filled += msg.bytes;
    }
    Ok(fds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shared_memory::{PageSize, SharedMemory};

    #[test]
    fn passes_a_memfd_between_sockets() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mem = std::sync::Arc::new(
            SharedMemory::create("pass", 4096, PageSize::Normal).expect("create"),
        );
        mem.slice(0, 6).expect("range").write_from(b"shared");
        send_with_fd(&a, b"frame", mem.fd()).expect("send");
        send_with_fd(&a, b"next", None).expect("send");
        let mut buf = [0u8; 5];
        let fds = recv_exact_with_fds(&b, &mut buf).expect("recv");
        assert_eq!(&buf, b"frame");
        assert_eq!(fds.len(), 1);
        let mut next = [0u8; 4];
        assert!(recv_exact_with_fds(&b, &mut next).expect("recv").is_empty());
        let fd = fds.into_iter().next().expect("one fd");
        let peer = std::sync::Arc::new(SharedMemory::map_received(fd, 4096).expect("map"));
        assert_eq!(peer.slice(0, 6).expect("range").to_vec(), b"shared");
        assert_eq!(
            peer_credentials(&a).expect("creds").uid,
            nix::unistd::getuid().as_raw()
        );
    }

    #[test]
    fn eof_is_an_error() {
        let (a, b) = UnixStream::pair().expect("pair");
        drop(a);
        let mut buf = [0u8; 4];
        assert!(recv_exact_with_fds(&b, &mut buf).is_err());
    }
}
