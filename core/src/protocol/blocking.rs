//! A blocking client for a tarpc service, for callers that run on their own thread.
//!
//! A call through a tarpc client hands the request to the client's dispatch task and
//! waits for that task to hand the answer back: two thread wake-ups on top of the peer's,
//! each tens of microseconds on a virtual machine. An application thread that calls the
//! store (embedded mode) gains nothing from that hand-off: it can write the request and
//! read the answer itself, so a round trip wakes it once, when the answer arrives. The
//! frames are exactly those of [`codec::transport`](super::codec::transport) (a 4-byte
//! big-endian length, then a postcard-encoded tarpc message), so the same server serves
//! both kinds of client.

use std::io::{BufReader, Read, Write};
use std::marker::PhantomData;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tarpc::{ClientMessage, Request, Response, ServerError};

/// Largest answer accepted: these calls answer metadata, never payload.
pub const MAX_ANSWER_FRAME: usize = 64 << 20;

/// Why a blocking call failed.
#[derive(Debug, thiserror::Error)]
pub enum BlockingCallError {
    /// The connection failed (or timed out); it must not be used again.
    #[error("connection failed: {0}")]
    Io(#[from] std::io::Error),
    /// The peer's bytes were not the answer to this request; the connection must not be
    /// used again.
    #[error("malformed answer: {0}")]
    Malformed(String),
    /// The server refused the request.
    #[error("the server refused the request: {0}")]
    Server(ServerError),
}

/// Bytes read from the socket at once: an answer's length prefix and a small answer come
/// in one read.
const READ_BUFFER: usize = 16 << 10;

/// A request sent by [`BlockingClient::send`] whose answer is still to be read.
#[derive(Debug)]
#[must_use = "the answer must be received before the connection is used again"]
pub struct Sent {
    id: u64,
}

/// One connection, used by one caller at a time.
#[derive(Debug)]
pub struct BlockingClient<Req, Resp> {
    /// The connection, read through a buffer (written through `get_ref`).
    stream: BufReader<TcpStream>,
    next_id: u64,
    /// How long a call polls for its answer before it sleeps (zero: it sleeps at once).
    spin: Duration,
    /// The read timeout set on the socket (set again only when a call asks for another).
    read_timeout: Option<Duration>,
    types: PhantomData<fn(Req) -> Resp>,
}

impl<Req: Serialize, Resp: for<'de> Deserialize<'de>> BlockingClient<Req, Resp> {
    /// A client over a connected stream (Nagle off: requests are small and urgent).
    pub fn new(stream: TcpStream) -> std::io::Result<Self> {
        stream.set_nodelay(true)?;
        Ok(BlockingClient {
            stream: BufReader::with_capacity(READ_BUFFER, stream),
            next_id: 0,
            spin: Duration::ZERO,
            read_timeout: None,
            types: PhantomData,
        })
    }

    /// The same client, polling up to `spin` for each answer before it sleeps (see
    /// [`crate::spin`]).
    pub fn with_spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Sends `message` and waits at most `timeout` for its answer.
    pub fn call(&mut self, message: Req, timeout: Duration) -> Result<Resp, BlockingCallError> {
        let sent = self.send(message, timeout)?;
        self.receive(sent)
    }

    /// Sends `message` without waiting for its answer, so that the caller can work while
    /// the request travels; [`receive`](Self::receive) then waits at most `timeout`
    /// (counted from when it is called) for the answer. Nothing else may be sent before.
    pub fn send(&mut self, message: Req, timeout: Duration) -> Result<Sent, BlockingCallError> {
        self.next_id += 1;
        let id = self.next_id;
        let mut context = tarpc::context::current();
        context.deadline = Instant::now() + timeout;
        let request = ClientMessage::Request(Request {
            context,
            id,
            message,
        });
        let payload = postcard::to_stdvec(&request)
            .map_err(|e| BlockingCallError::Malformed(e.to_string()))?;
        let len = u32::try_from(payload.len())
            .map_err(|_| BlockingCallError::Malformed("request too large".into()))?;
        let mut frame = Vec::with_capacity(4 + payload.len());
        frame.extend_from_slice(&len.to_be_bytes());
        frame.extend_from_slice(&payload);
        let read_timeout = Some(timeout.max(Duration::from_millis(1)));
        if self.read_timeout != read_timeout {
            self.stream.get_ref().set_read_timeout(read_timeout)?;
            self.read_timeout = read_timeout;
        }
        (&mut self.stream.get_ref()).write_all(&frame)?;
        Ok(Sent { id })
    }

    /// Waits for the answer to the request `sent`.
    pub fn receive(&mut self, sent: Sent) -> Result<Resp, BlockingCallError> {
        let id = sent.id;
        self.spin_for_answer();
        let answer: Response<Resp> = self.read_frame()?;
        if answer.request_id != id {
            return Err(BlockingCallError::Malformed(format!(
                "answer to request {} while waiting for {id}",
                answer.request_id
            )));
        }
        answer.message.map_err(BlockingCallError::Server)
    }

    /// Polls the socket without sleeping for up to the configured spin, so that a quick
    /// answer is read without waking a sleeping thread.
    fn spin_for_answer(&self) {
        if self.spin.is_zero() {
            return;
        }
        use std::os::fd::AsRawFd;
        let fd = self.stream.get_ref().as_raw_fd();
        let until = Instant::now() + self.spin;
        let mut byte = 0u8;
        loop {
            // SAFETY: a one-byte peek into a local byte on a socket this client owns.
            let got = unsafe {
                libc::recv(
                    fd,
                    (&raw mut byte).cast(),
                    1,
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if got != -1 || Instant::now() >= until {
                return;
            }
            std::hint::spin_loop();
        }
    }

    fn read_frame<T: for<'de> Deserialize<'de>>(&mut self) -> Result<T, BlockingCallError> {
        let mut prefix = [0u8; 4];
        self.stream.read_exact(&mut prefix)?;
        let len = u32::from_be_bytes(prefix) as usize;
        if len > MAX_ANSWER_FRAME {
            return Err(BlockingCallError::Malformed(format!(
                "frame of {len} bytes"
            )));
        }
        let mut payload = vec![0u8; len];
        self.stream.read_exact(&mut payload)?;
        postcard::from_bytes(&payload).map_err(|e| BlockingCallError::Malformed(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::master_api::{MasterRequest, MasterResponse};
    use crate::protocol::master_rpc::{MasterRpcRequest, MasterRpcResponse};

    type Client = BlockingClient<MasterRpcRequest, MasterRpcResponse>;

    #[test]
    fn a_silent_peer_times_out_and_a_garbage_answer_is_malformed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let peer = std::thread::spawn(move || {
            let (mut silent, _) = listener.accept().expect("accept");
            let mut request = [0u8; 4];
            silent.read_exact(&mut request).expect("request");
            let (mut garbage, _) = listener.accept().expect("accept");
            garbage.read_exact(&mut request).expect("request");
            garbage
                .write_all(&[0, 0, 0, 3, 0xff, 0xff, 0xff])
                .expect("answer");
            std::thread::sleep(Duration::from_millis(300));
            drop(silent);
        });
        let mut silent =
            Client::new(TcpStream::connect(address).expect("connect")).expect("client");
        let error = silent
            .call(stats(), Duration::from_millis(100))
            .expect_err("no answer");
        assert!(matches!(error, BlockingCallError::Io(_)), "{error:?}");
        let mut garbage =
            Client::new(TcpStream::connect(address).expect("connect")).expect("client");
        let error = garbage
            .call(stats(), Duration::from_secs(5))
            .expect_err("garbage");
        assert!(
            matches!(error, BlockingCallError::Malformed(_)),
            "{error:?}"
        );
        peer.join().expect("peer");
    }

    /// A master call asking for the master's counters.
    fn stats() -> MasterRpcRequest {
        MasterRpcRequest::Call {
            request: MasterRequest::Stats {},
        }
    }

    /// Answers each request read on `stream` with `Stats` after `delays[i]`.
    fn answer_after(mut stream: TcpStream, delays: &[u64]) {
        for (id, delay) in (1u64..).zip(delays) {
            let mut prefix = [0u8; 4];
            stream.read_exact(&mut prefix).expect("request");
            let mut request = vec![0u8; u32::from_be_bytes(prefix) as usize];
            stream.read_exact(&mut request).expect("request");
            std::thread::sleep(Duration::from_micros(*delay));
            let answer: Response<MasterRpcResponse> = Response {
                request_id: id,
                message: Ok(MasterRpcResponse::Call(MasterResponse::Stats(Ok(
                    Default::default(),
                )))),
            };
            let payload = postcard::to_stdvec(&answer).expect("encode");
            let len = u32::try_from(payload.len()).expect("small");
            stream.write_all(&len.to_be_bytes()).expect("answer");
            stream.write_all(&payload).expect("answer");
        }
    }

    #[test]
    fn a_spinning_call_gets_answers_that_come_during_or_after_the_spin() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let address = listener.local_addr().expect("address");
        let delays = [0, 50, 3_000, 0];
        let peer = std::thread::spawn(move || {
            let (stream, _) = listener.accept().expect("accept");
            answer_after(stream, &delays);
        });
        let mut client = Client::new(TcpStream::connect(address).expect("connect"))
            .expect("client")
            .with_spin(Duration::from_micros(200));
        for _ in delays {
            let answer = client
                .call(stats(), Duration::from_secs(5))
                .expect("answer");
            assert!(matches!(
                answer,
                MasterRpcResponse::Call(MasterResponse::Stats(Ok(_)))
            ));
        }
        peer.join().expect("peer");
    }
}
