//! The postcard codec that tarpc messages are encoded with.

use std::io;
use std::marker::PhantomData;
use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// Largest RPC frame accepted (requests with inline payloads included).
pub const MAX_RPC_FRAME: usize = 1 << 31;

/// Marks the item types without owning them (so the codec is `Send` and `Sync`).
type Items<In, Out> = PhantomData<(fn() -> In, fn(Out))>;

/// Longest deadline a server accepts on a request; longer ones are shortened to it
/// while decoding. tarpc turns a request's deadline into `Instant::now() + deadline`,
/// which panics when a peer sends a duration beyond the clock's range.
pub const MAX_REQUEST_DEADLINE_SECS: u64 = 3600;

/// Encodes outgoing items and decodes incoming ones with postcard.
#[derive(Debug)]
pub struct PostcardCodec<In, Out> {
    items: Items<In, Out>,
    /// The incoming items are tarpc `ClientMessage`s (this end serves): their
    /// deadlines are clamped to [`MAX_REQUEST_DEADLINE_SECS`] before decoding.
    clamp_deadlines: bool,
}

impl<In, Out> Default for PostcardCodec<In, Out> {
    fn default() -> Self {
        PostcardCodec {
            items: PhantomData,
            clamp_deadlines: false,
        }
    }
}

impl<In, Out> PostcardCodec<In, Out> {
    /// A codec for the serving end, which decodes tarpc `ClientMessage`s.
    pub fn serving() -> Self {
        PostcardCodec {
            items: PhantomData,
            clamp_deadlines: true,
        }
    }
}

impl<In, Out: Serialize> tokio_serde::Serializer<Out> for PostcardCodec<In, Out> {
    type Error = io::Error;

    fn serialize(self: Pin<&mut Self>, item: &Out) -> Result<Bytes, Self::Error> {
        postcard::to_stdvec(item)
            .map(Bytes::from)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

impl<In: for<'de> Deserialize<'de>, Out> tokio_serde::Deserializer<In> for PostcardCodec<In, Out> {
    type Error = io::Error;

    fn deserialize(self: Pin<&mut Self>, src: &BytesMut) -> Result<In, Self::Error> {
        match self
            .clamp_deadlines
            .then(|| clamp_request_deadline(src))
            .flatten()
        {
            Some(clamped) => decode(&clamped),
            None => decode(src),
        }
    }
}

/// Decodes one frame. A decoder that panics on some input (a bug, or a case the clamp
/// does not know) yields an error that closes the connection, not a dead task.
fn decode<In: for<'de> Deserialize<'de>>(bytes: &[u8]) -> io::Result<In> {
    match std::panic::catch_unwind(|| postcard::from_bytes(bytes)) {
        Ok(decoded) => decoded.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e)),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "a field of the message is out of range",
        )),
    }
}

/// A copy of a tarpc `ClientMessage::Request` frame whose deadline is shortened to
/// [`MAX_REQUEST_DEADLINE_SECS`], or `None` when the frame needs no change (another
/// message, a deadline in range, or bytes too short to tell: the decoder reports those).
///
/// The frame starts with the variant index (0 for `Request`) and the context's deadline,
/// a `Duration` of whole seconds and nanoseconds, all postcard varints.
fn clamp_request_deadline(frame: &[u8]) -> Option<Vec<u8>> {
    let (variant, variant_len) = read_varint(frame)?;
    if variant != 0 {
        return None;
    }
    let (secs, secs_len) = read_varint(&frame[variant_len..])?;
    if secs <= MAX_REQUEST_DEADLINE_SECS {
        return None;
    }
    let mut clamped = Vec::with_capacity(frame.len());
    clamped.extend_from_slice(&frame[..variant_len]);
    write_varint(&mut clamped, MAX_REQUEST_DEADLINE_SECS);
    clamped.extend_from_slice(&frame[variant_len + secs_len..]);
    Some(clamped)
}

/// A postcard (LEB128) varint at the start of `bytes`: its value and its length.
fn read_varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for (index, byte) in bytes.iter().take(10).enumerate() {
        value |= u64::from(byte & 0x7f) << (7 * index);
        if byte & 0x80 == 0 {
            return Some((value, index + 1));
        }
    }
    None
}

fn write_varint(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let low = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(low);
            return;
        }
        out.push(low | 0x80);
    }
}

/// Wraps a connected stream (Unix or TCP) into a tarpc transport that reads `In` and
/// writes `Out`.
pub fn transport<S, In, Out>(
    stream: S,
) -> tarpc::serde_transport::Transport<S, In, Out, PostcardCodec<In, Out>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite,
    In: for<'de> Deserialize<'de>,
    Out: Serialize,
{
    framed(stream, PostcardCodec::default())
}

/// [`transport`] for the serving end of a tarpc service: the incoming `ClientMessage`s'
/// deadlines are clamped to [`MAX_REQUEST_DEADLINE_SECS`].
pub fn serving_transport<S, In, Out>(
    stream: S,
) -> tarpc::serde_transport::Transport<S, In, Out, PostcardCodec<In, Out>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite,
    In: for<'de> Deserialize<'de>,
    Out: Serialize,
{
    framed(stream, PostcardCodec::serving())
}

/// Length-delimited frames of at most [`MAX_RPC_FRAME`] bytes, encoded by `codec`.
fn framed<S, In, Out>(
    stream: S,
    codec: PostcardCodec<In, Out>,
) -> tarpc::serde_transport::Transport<S, In, Out, PostcardCodec<In, Out>>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite,
    In: for<'de> Deserialize<'de>,
    Out: Serialize,
{
    let framed = tokio_util::codec::LengthDelimitedCodec::builder()
        .max_frame_length(MAX_RPC_FRAME)
        .new_framed(stream);
    tarpc::serde_transport::new(framed, codec)
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio_serde::Deserializer as _;

    use super::*;

    type Message = tarpc::ClientMessage<u32>;

    /// The bytes of a request whose deadline lies `secs` seconds ahead (written with the
    /// same layout as tarpc's: the deadline travels as a relative `Duration`).
    fn request_bytes(secs: u64) -> Vec<u8> {
        #[derive(Serialize)]
        enum Frame {
            Request {
                deadline: Duration,
                trace: tarpc::trace::Context,
                id: u64,
                message: u32,
            },
        }
        postcard::to_stdvec(&Frame::Request {
            deadline: Duration::new(secs, 5),
            trace: tarpc::trace::Context::default(),
            id: 7,
            message: 42,
        })
        .expect("encode")
    }

    fn decode_with(codec: PostcardCodec<Message, ()>, bytes: &[u8]) -> io::Result<Message> {
        let mut codec = codec;
        Pin::new(&mut codec).deserialize(&BytesMut::from(bytes))
    }

    fn deadline_of(message: &Message) -> Instant {
        match message {
            tarpc::ClientMessage::Request(request) => request.context.deadline,
            other => panic!("not a request: {other:?}"),
        }
    }

    #[test]
    fn a_huge_deadline_is_clamped_not_a_panic() {
        let before = Instant::now();
        let message =
            decode_with(PostcardCodec::serving(), &request_bytes(u64::MAX)).expect("decoded");
        let deadline = deadline_of(&message);
        assert!(deadline <= Instant::now() + Duration::from_secs(MAX_REQUEST_DEADLINE_SECS + 1));
        assert!(deadline >= before + Duration::from_secs(MAX_REQUEST_DEADLINE_SECS - 1));
        let tarpc::ClientMessage::Request(request) = message else {
            unreachable!()
        };
        assert_eq!(
            (request.id, request.message),
            (7, 42),
            "the rest of the frame is intact"
        );
    }

    #[test]
    fn deadlines_in_range_are_kept() {
        let before = Instant::now();
        let message = decode_with(PostcardCodec::serving(), &request_bytes(30)).expect("decoded");
        let deadline = deadline_of(&message);
        assert!(deadline >= before + Duration::from_secs(29));
        assert!(deadline <= Instant::now() + Duration::from_secs(31));
    }

    #[test]
    fn a_decoder_panic_is_an_error() {
        // Without the clamp, tarpc's deadline arithmetic panics on this frame.
        let error =
            decode_with(PostcardCodec::default(), &request_bytes(u64::MAX)).expect_err("refused");
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn varints_round_trip() {
        for value in [0, 1, 127, 128, 300, MAX_REQUEST_DEADLINE_SECS, u64::MAX] {
            let mut bytes = Vec::new();
            write_varint(&mut bytes, value);
            assert_eq!(read_varint(&bytes), Some((value, bytes.len())));
        }
        assert_eq!(read_varint(&[0x80; 11]), None, "unterminated");
        assert!(clamp_request_deadline(&[]).is_none());
        assert!(clamp_request_deadline(&[0]).is_none());
    }
}
