//! A transfer connection with an input buffer: the frames of a pipelined batch arrive
//! in a few `recv` calls instead of one per header, while long payloads still land
//! straight in their destination mapping.

use std::io::Read;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

use mooncake_shm::MemSlice;
use nix::sys::socket::{MsgFlags, recv};

/// Bytes the input buffer holds.
const BUFFER_LEN: usize = 64 << 10;
/// Payload remainders at least this long skip the buffer and are received in place.
const DIRECT_LEN: usize = 16 << 10;

/// A connected transfer socket read through a buffer.
#[derive(Debug)]
pub struct BufferedStream {
    stream: TcpStream,
    buffer: Box<[u8]>,
    /// Unread bytes are `buffer[start..end]`.
    start: usize,
    end: usize,
}

impl BufferedStream {
    /// Wraps a connected socket.
    pub fn new(stream: TcpStream) -> Self {
        BufferedStream {
            stream,
            buffer: vec![0u8; BUFFER_LEN].into_boxed_slice(),
            start: 0,
            end: 0,
        }
    }

    /// The socket, for writing.
    pub fn socket(&self) -> &TcpStream {
        &self.stream
    }

    /// Bytes received and not read yet.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Moves the unread bytes to the front, so the rest of the buffer can be filled.
    fn compact(&mut self) {
        if self.start > 0 {
            self.buffer.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
    }

    /// Receives what has arrived, waiting for at least one byte. `Ok(false)` at the end
    /// of the stream.
    fn fill(&mut self) -> std::io::Result<bool> {
        self.compact();
        let received = loop {
            match self.stream.read(&mut self.buffer[self.end..]) {
                Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
                other => break other?,
            }
        };
        self.end += received;
        Ok(received > 0)
    }

    /// Receives what has already arrived without waiting: `Ok(true)` when bytes were
    /// added, `Ok(false)` when nothing is there yet (or the peer closed: the next
    /// blocking read reports that).
    pub fn fill_if_ready(&mut self) -> std::io::Result<bool> {
        self.compact();
        if self.end == self.buffer.len() {
            return Ok(true);
        }
        match recv(
            self.stream.as_raw_fd(),
            &mut self.buffer[self.end..],
            MsgFlags::MSG_DONTWAIT,
        ) {
            Ok(received) => {
                self.end += received;
                Ok(received > 0)
            }
            Err(nix::errno::Errno::EAGAIN | nix::errno::Errno::EINTR) => Ok(false),
            Err(errno) => Err(errno.into()),
        }
    }

    /// Fills all of `dest` from the stream: the buffered bytes first, then a long
    /// remainder straight from the socket, a short one through the buffer.
    pub fn read_into(&mut self, dest: &MemSlice) -> std::io::Result<()> {
        let mut done = 0usize;
        while done < dest.len() {
            let want = dest.len() - done;
            if self.buffered() == 0 && want >= DIRECT_LEN {
                return part(dest, done, want)?.recv_from(&self.stream);
            }
            if self.buffered() == 0 && !self.fill()? {
                return Err(closed());
            }
            let take = want.min(self.buffered());
            part(dest, done, take)?.write_from(&self.buffer[self.start..self.start + take]);
            self.start += take;
            done += take;
        }
        Ok(())
    }

    /// Reads and drops `len` bytes.
    pub fn discard(&mut self, mut len: u64) -> std::io::Result<()> {
        while len > 0 {
            if self.buffered() == 0 && !self.fill()? {
                return Err(closed());
            }
            let take = usize::try_from(len)
                .unwrap_or(usize::MAX)
                .min(self.buffered());
            self.start += take;
            len -= take as u64;
        }
        Ok(())
    }
}

impl Read for BufferedStream {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.buffered() == 0 {
            if out.len() >= BUFFER_LEN {
                return self.stream.read(out);
            }
            if !self.fill()? {
                return Ok(0);
            }
        }
        let take = out.len().min(self.buffered());
        out[..take].copy_from_slice(&self.buffer[self.start..self.start + take]);
        self.start += take;
        Ok(take)
    }
}

/// `dest[offset..offset+len]`.
fn part(dest: &MemSlice, offset: usize, len: usize) -> std::io::Result<MemSlice> {
    dest.sub(offset as u64, len as u64)
        .ok_or_else(|| std::io::Error::other("payload range outside its destination"))
}

fn closed() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::UnexpectedEof,
        "peer closed the connection mid-transfer",
    )
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;
    use std::sync::Arc;

    use mooncake_shm::SharedMemory;
    use mooncake_shm::shared_memory::PageSize;

    use super::*;

    fn pair() -> (TcpStream, BufferedStream) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let sender = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (receiver, _) = listener.accept().expect("accept");
        (sender, BufferedStream::new(receiver))
    }

    #[test]
    fn small_and_long_payloads_arrive_byte_exact() {
        let (mut sender, mut receiver) = pair();
        let long: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let writer = std::thread::spawn(move || {
            sender.write_all(b"head").expect("send");
            sender.write_all(&[9u8; 100]).expect("send");
            sender.write_all(&long).expect("send");
            sender.write_all(b"tail").expect("send");
            long
        });
        let memory = Arc::new(SharedMemory::create("t", 300_000, PageSize::Normal).expect("shm"));
        let mut head = [0u8; 4];
        receiver.read_exact(&mut head).expect("head");
        assert_eq!(&head, b"head");
        receiver.discard(100).expect("discard");
        let dest = memory.slice(0, 200_000).expect("slice");
        receiver.read_into(&dest).expect("payload");
        let mut tail = [0u8; 4];
        receiver.read_exact(&mut tail).expect("tail");
        assert_eq!(&tail, b"tail");
        assert_eq!(dest.to_vec(), writer.join().expect("writer"));
    }

    #[test]
    fn nothing_ready_is_not_an_error_and_a_closed_peer_ends_reads() {
        let (sender, mut receiver) = pair();
        assert!(!receiver.fill_if_ready().expect("poll"));
        drop(sender);
        let memory = Arc::new(SharedMemory::create("t", 4096, PageSize::Normal).expect("shm"));
        let dest = memory.slice(0, 4096).expect("slice");
        assert!(receiver.read_into(&dest).is_err());
    }
}
