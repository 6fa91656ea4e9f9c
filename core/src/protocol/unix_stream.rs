//! A Unix stream for RPC that the runtime watches for incoming bytes only.
//!
//! Tokio registers its own `UnixStream` for read and write readiness. On a Unix socket
//! every read by the peer frees send-buffer space and signals "writable" to us, so each
//! answer the peer drains wakes our sleeping runtime thread for nothing: two wasted
//! context switches per round trip, a third of the cost of a small RPC on a busy node.
//! [`RpcUnixStream`] registers for read readiness alone and writes without waiting; only
//! when the send buffer is full (a write would block) does it register a duplicate of
//! the descriptor for write readiness, and it drops that registration as soon as the
//! write goes through.

use std::io::{self, IoSlice, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

/// A connected, non-blocking Unix stream registered with the runtime for reads only.
#[derive(Debug)]
pub struct RpcUnixStream {
    stream: AsyncFd<UnixStream>,
    /// A duplicate of the descriptor watched for write readiness while a write waits for
    /// send-buffer space; `None` the rest of the time.
    write_wait: Option<AsyncFd<OwnedFd>>,
}

impl RpcUnixStream {
    /// Takes over a connected stream: switches it to non-blocking mode and registers it
    /// with the current runtime for read readiness.
    pub fn new(stream: UnixStream) -> io::Result<Self> {
        stream.set_nonblocking(true)?;
        Ok(RpcUnixStream {
            stream: register(stream, Interest::READABLE)?,
            write_wait: None,
        })
    }

    /// Runs a non-blocking write; when the send buffer is full, waits for space on a
    /// temporary write-readiness registration and tries again.
    fn poll_write_with(
        &mut self,
        cx: &mut Context<'_>,
        mut write: impl FnMut(&UnixStream) -> io::Result<usize>,
    ) -> Poll<io::Result<usize>> {
        loop {
            match write(self.stream.get_ref()) {
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => {}
                done => {
                    self.write_wait = None;
                    return Poll::Ready(done);
                }
            }
            let waiter = match &mut self.write_wait {
                Some(waiter) => waiter,
                None => {
                    let duplicate = self.stream.get_ref().try_clone()?;
                    let waiter = register(OwnedFd::from(duplicate), Interest::WRITABLE)?;
                    self.write_wait.insert(waiter)
                }
            };
            let mut guard = ready!(waiter.poll_write_ready(cx))?;
            // Space may be gone again by the time we write: forget this readiness so the
            // next `WouldBlock` waits for a fresh edge.
            guard.clear_ready();
        }
    }
}

/// Registers a descriptor this value owns with the current runtime for `interest`.
fn register<T: AsRawFd>(owner: T, interest: Interest) -> io::Result<AsyncFd<T>> {
    // SAFETY: `owner` (a `UnixStream` or an `OwnedFd`) owns its descriptor, keeps it open
    // until it is dropped together with the `AsyncFd`, and always returns the same one.
    unsafe { AsyncFd::register_with_interest(owner, interest) }.map_err(|e| e.into_parts().1)
}

impl AsyncRead for RpcUnixStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            let mut guard = ready!(this.stream.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            let room = unfilled.len();
            match guard.try_io(|stream| stream.get_ref().read(unfilled)) {
                Ok(Ok(read)) => {
                    if read > 0 && read < room {
                        // A short read drained the socket: the next poll waits for the
                        // next edge instead of spending a system call on `WouldBlock`.
                        guard.clear_ready();
                    }
                    buf.advance(read);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(error)) => return Poll::Ready(Err(error)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for RpcUnixStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, |mut stream| stream.write(buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.get_mut()
            .poll_write_with(cx, |mut stream| stream.write_vectored(bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.stream.get_ref().shutdown(std::net::Shutdown::Write))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .expect("runtime")
    }

    #[test]
    fn bytes_arrive_in_order_in_both_directions() {
        runtime().block_on(async {
            let (a, b) = UnixStream::pair().expect("pair");
            let mut a = RpcUnixStream::new(a).expect("a");
            let mut b = RpcUnixStream::new(b).expect("b");
            a.write_all(b"ping").await.expect("write");
            let mut got = [0u8; 4];
            b.read_exact(&mut got).await.expect("read");
            assert_eq!(&got, b"ping");
            b.write_all(b"pong").await.expect("write");
            a.read_exact(&mut got).await.expect("read");
            assert_eq!(&got, b"pong");
        });
    }

    #[test]
    fn a_write_larger_than_the_send_buffer_waits_for_the_reader() {
        runtime().block_on(async {
            let (a, b) = UnixStream::pair().expect("pair");
            let mut a = RpcUnixStream::new(a).expect("a");
            let mut b = RpcUnixStream::new(b).expect("b");
            // Far above any default socket buffer: the writer must block and resume.
            let sent: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
            let expected = sent.clone();
            let writer = async move {
                a.write_all(&sent).await.expect("write");
                a.shutdown().await.expect("shutdown");
                a
            };
            let reader = async move {
                let mut got = Vec::new();
                b.read_to_end(&mut got).await.expect("read");
                got
            };
            let (a, got) = tokio::join!(writer, reader);
            assert!(got == expected, "bytes differ after a blocked write");
            assert!(
                a.write_wait.is_none(),
                "the write registration outlived the write"
            );
        });
    }

    #[test]
    fn a_closed_peer_reads_as_end_of_stream() {
        runtime().block_on(async {
            let (a, b) = UnixStream::pair().expect("pair");
            drop(a);
            let mut b = RpcUnixStream::new(b).expect("b");
            let mut got = Vec::new();
            assert_eq!(b.read_to_end(&mut got).await.expect("read"), 0);
        });
    }
}
