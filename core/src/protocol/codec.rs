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

/// Encodes outgoing items and decodes incoming ones with postcard.
#[derive(Debug)]
pub struct PostcardCodec<In, Out>(Items<In, Out>);

impl<In, Out> Default for PostcardCodec<In, Out> {
    fn default() -> Self {
        PostcardCodec(PhantomData)
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
        postcard::from_bytes(src).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
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
    let framed = tokio_util::codec::LengthDelimitedCodec::builder()
        .max_frame_length(MAX_RPC_FRAME)
        .new_framed(stream);
    tarpc::serde_transport::new(framed, PostcardCodec::default())
}
