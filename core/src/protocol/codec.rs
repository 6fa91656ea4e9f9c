//! The postcard codec that tarpc messages are encoded with.

use std::io;
use std::marker::PhantomData;
use std::pin::Pin;

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use super::bounded;

/// Largest RPC frame accepted (requests and replies with inline payloads included):
/// longer frames close the connection before their bytes are read. Payloads that do
/// not fit travel through shared memory (see `rpc::MAX_INLINE_BYTES`).
pub const MAX_RPC_FRAME: usize = 64 << 20;

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
    /// deadlines are clamped to [`MAX_REQUEST_DEADLINE_SECS`] before decoding, and
    /// their lists are decoded within [`bounded::MAX_REQUEST_ELEMENTS`].
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
        if !self.clamp_deadlines {
            return decode(src);
        }
        let (decoded, over) =
            bounded::with_budget(
                bounded::MAX_REQUEST_ELEMENTS,
                || match clamp_request_deadline(src) {
                    Some(clamped) => decode(&clamped),
                    None => decode(src),
                },
            );
        match over {
            Some(over) => Err(io::Error::new(io::ErrorKind::InvalidData, over)),
            None => decoded,
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

    mod requests {
        //! The serving codec on the two request types that arrive from other processes:
        //! a dummy's [`RealClientRpcRequest`]s and a real client's [`MasterRpcRequest`]s.

        use std::time::{Duration, Instant};

        use proptest::prelude::*;
        use serde::de::DeserializeOwned;
        use tokio_serde::Deserializer as _;

        use super::super::*;
        use crate::master_api::{LeaseBudget, MasterRequest};
        use crate::protocol::master_rpc::MasterRpcRequest;
        use crate::protocol::rpc::{
            DeviceBufferDecl, Fragment, GetItem, MemRange, PutItem, PutSource, RangeRead,
            RealClientRpcRequest, WriteMode,
        };
        use crate::types::{ReplicateConfig, SoftPinAction};

        /// Decodes `bytes` as a serving end does, and once more without the guard that
        /// turns a panic into an error, so that a panic the guard would hide fails the
        /// test.
        fn decode_request<R: DeserializeOwned>(
            bytes: &[u8],
        ) -> io::Result<tarpc::ClientMessage<R>> {
            let clamped = clamp_request_deadline(bytes);
            let unguarded = postcard::from_bytes::<tarpc::ClientMessage<R>>(
                clamped.as_deref().unwrap_or(bytes),
            );
            let mut codec = PostcardCodec::<tarpc::ClientMessage<R>, ()>::serving();
            let decoded = Pin::new(&mut codec).deserialize(&BytesMut::from(bytes));
            assert_eq!(decoded.is_ok(), unguarded.is_ok());
            decoded
        }

        /// The bytes of a request for `message`, `deadline` ahead, as tarpc sends it.
        fn request_bytes<R: Serialize>(message: R, deadline: Duration, id: u64) -> Vec<u8> {
            let mut context = tarpc::context::current();
            context.deadline = Instant::now() + deadline;
            let request = tarpc::ClientMessage::Request(tarpc::Request {
                context,
                id,
                message,
            });
            postcard::to_stdvec(&request).expect("encode")
        }

        /// Checks that a valid request decodes to itself, its deadline within the clamp.
        fn round_trips<R: Serialize + DeserializeOwned>(message: &R, bytes: &[u8], id: u64) {
            let before = Instant::now();
            let decoded = decode_request::<R>(bytes).expect("a valid request decodes");
            let tarpc::ClientMessage::Request(request) = decoded else {
                panic!("a request decodes as a cancel");
            };
            assert_eq!(request.id, id);
            assert!(
                request.context.deadline
                    <= Instant::now() + Duration::from_secs(MAX_REQUEST_DEADLINE_SECS + 5)
            );
            assert!(request.context.deadline >= before);
            assert_eq!(
                postcard::to_stdvec(&request.message).expect("encode"),
                postcard::to_stdvec(message).expect("encode"),
                "the message survives the trip"
            );
        }

        fn key() -> impl Strategy<Value = String> {
            ".{0,24}"
        }

        fn keys() -> impl Strategy<Value = Vec<String>> {
            proptest::collection::vec(key(), 0..4)
        }

        fn range() -> impl Strategy<Value = MemRange> {
            (any::<u64>(), any::<u64>()).prop_map(|(addr, len)| MemRange { addr, len })
        }

        fn config() -> impl Strategy<Value = ReplicateConfig> {
            (
                any::<u32>(),
                prop_oneof![
                    Just(SoftPinAction::Preserve),
                    Just(SoftPinAction::Enable),
                    Just(SoftPinAction::Disable)
                ],
                any::<Option<u64>>(),
                any::<bool>(),
                key(),
                keys(),
                any::<bool>(),
            )
                .prop_map(
                    |(replica_num, soft_pin_action, ttl, hard, one, many, local)| ReplicateConfig {
                        replica_num,
                        soft_pin_action,
                        soft_pin_ttl_ms: ttl,
                        with_hard_pin: hard,
                        preferred_segment: one,
                        preferred_segments: many,
                        prefer_alloc_in_same_node: local,
                    },
                )
        }

        fn sized() -> impl Strategy<Value = Vec<(String, u64)>> {
            proptest::collection::vec((key(), any::<u64>()), 0..4)
        }

        fn mode() -> impl Strategy<Value = WriteMode> {
            prop_oneof![Just(WriteMode::Put), Just(WriteMode::Upsert)]
        }

        fn dummy_request() -> impl Strategy<Value = RealClientRpcRequest> {
            let source = prop_oneof![
                proptest::collection::vec(range(), 0..4).prop_map(PutSource::Shared),
                proptest::collection::vec(any::<u8>(), 0..64)
                    .prop_map(|bytes| PutSource::Inline(serde_bytes::ByteBuf::from(bytes))),
            ];
            let put_item = (key(), source).prop_map(|(key, source)| PutItem { key, source });
            let get_item = (key(), proptest::collection::vec(range(), 0..4))
                .prop_map(|(key, dests)| GetItem { key, dests });
            let fragment = (range(), any::<u64>())
                .prop_map(|(dest, src_offset)| Fragment { dest, src_offset });
            let read = (key(), proptest::collection::vec(fragment, 0..4))
                .prop_map(|(key, fragments)| RangeRead { key, fragments });
            let device = (
                any::<u64>(),
                any::<u64>(),
                any::<i32>(),
                any::<u64>(),
                any::<u64>(),
                proptest::collection::vec(any::<u8>(), 64),
                any::<bool>(),
            )
                .prop_map(|(addr, len, device, alloc_base, alloc_len, handle, hip)| {
                    DeviceBufferDecl {
                        addr,
                        len,
                        device,
                        alloc_base,
                        alloc_len,
                        handle: serde_bytes::ByteBuf::from(handle),
                        api: if hip {
                            crate::types::DeviceApi::Hip
                        } else {
                            crate::types::DeviceApi::Cuda
                        },
                    }
                });
            prop_oneof![
                Just(()).prop_map(|()| RealClientRpcRequest::Ping {}),
                keys().prop_map(|keys| RealClientRpcRequest::Exist { keys: keys.into() }),
                key().prop_map(|key| RealClientRpcRequest::ObjectSize { key }),
                (proptest::collection::vec(put_item, 0..3), config(), mode()).prop_map(
                    |(items, config, mode)| RealClientRpcRequest::Put {
                        items: items.into(),
                        config,
                        mode
                    }
                ),
                proptest::collection::vec(get_item, 0..3).prop_map(|items| {
                    RealClientRpcRequest::Get {
                        items: items.into(),
                    }
                }),
                proptest::collection::vec(read, 0..3).prop_map(|reads| {
                    RealClientRpcRequest::GetRanges {
                        reads: reads.into(),
                    }
                }),
                (key(), any::<bool>()).prop_map(|(pattern, force)| {
                    RealClientRpcRequest::RemoveByRegex { pattern, force }
                }),
                (key(), keys()).prop_map(|(key, targets)| {
                    RealClientRpcRequest::CreateCopyTask {
                        key,
                        targets: targets.into(),
                    }
                }),
                any::<u128>().prop_map(|id| RealClientRpcRequest::QueryTask { id }),
                (keys(), any::<bool>()).prop_map(|(keys, force)| RealClientRpcRequest::Remove {
                    keys: keys.into(),
                    force,
                }),
                (keys(), proptest::option::of(key())).prop_map(|(keys, segment)| {
                    RealClientRpcRequest::ClearReplicas {
                        keys: keys.into(),
                        segment,
                    }
                }),
                proptest::collection::vec(range(), 0..4).prop_map(|ranges| {
                    RealClientRpcRequest::DeclareMemory {
                        ranges: ranges.into(),
                    }
                }),
                any::<u64>().prop_map(|addr| RealClientRpcRequest::ForgetMemory { addr }),
                device.prop_map(|buffer| RealClientRpcRequest::DeclareDevice { buffer }),
            ]
        }

        fn master_request() -> impl Strategy<Value = MasterRpcRequest> {
            prop_oneof![
                any::<u32>().prop_map(|version| MasterRpcRequest::Hello { version }),
                master_call().prop_map(|request| MasterRpcRequest::Call { request }),
                (
                    any::<u128>(),
                    key(),
                    any::<u64>(),
                    any::<u64>(),
                    any::<u32>()
                )
                    .prop_map(|(standby, address, epoch, from, wait_ms)| {
                        MasterRpcRequest::HaPull {
                            standby,
                            address,
                            epoch,
                            from,
                            wait_ms,
                        }
                    }),
            ]
        }

        fn master_call() -> impl Strategy<Value = MasterRequest> {
            prop_oneof![
                (any::<u128>(), key(), any::<u64>(), key(), any::<u128>()).prop_map(
                    |(client, name, capacity, endpoint, generation)| {
                        MasterRequest::MountSegment {
                            client,
                            name,
                            capacity,
                            endpoint,
                            generation,
                        }
                    }
                ),
                any::<u128>().prop_map(|client| MasterRequest::Heartbeat { client }),
                (sized(), config(), mode()).prop_map(|(items, config, mode)| {
                    MasterRequest::PutStart {
                        items,
                        config,
                        mode,
                    }
                }),
                sized().prop_map(|items| MasterRequest::PutEnd { items }),
                (keys(), any::<Option<u64>>()).prop_map(|(keys, lease_us)| {
                    MasterRequest::GetReplicaList {
                        keys,
                        lease: lease_us.map(Duration::from_micros),
                    }
                }),
                (keys(), any::<Option<u64>>()).prop_map(|(keys, bytes)| MasterRequest::Exist {
                    keys,
                    budget: LeaseBudget(bytes),
                }),
                (keys(), proptest::option::of(key()))
                    .prop_map(|(keys, segment)| { MasterRequest::ClearReplicas { keys, segment } }),
                (key(), key(), any::<bool>()).prop_map(|(tenant, pattern, force)| {
                    MasterRequest::RemoveByRegex {
                        tenant,
                        pattern,
                        force,
                    }
                }),
                (key(), key(), key(), any::<u128>()).prop_map(|(key, source, target, id)| {
                    MasterRequest::CreateMoveTask {
                        key,
                        source,
                        target,
                        id,
                    }
                }),
                (any::<u128>(), any::<u128>(), any::<Result<(), i32>>()).prop_map(
                    |(client, id, outcome)| MasterRequest::FinishTask {
                        client,
                        id,
                        outcome,
                    }
                ),
                (any::<u128>(), sized())
                    .prop_map(|(client, objects)| MasterRequest::OffloadDone { client, objects }),
                (any::<u128>(), keys())
                    .prop_map(|(client, keys)| MasterRequest::DiskEvicted { client, keys }),
                Just(()).prop_map(|()| MasterRequest::Stats {}),
            ]
        }

        /// A deadline from nothing to far beyond the clock's range.
        fn deadline() -> impl Strategy<Value = Duration> {
            prop_oneof![
                (0..2 * MAX_REQUEST_DEADLINE_SECS).prop_map(Duration::from_secs),
                Just(Duration::from_secs(u64::MAX / 4)),
            ]
        }

        /// Flips bytes of `bytes` and cuts it, as a corrupt or hostile peer would.
        fn mutate(mut bytes: Vec<u8>, flips: &[(usize, u8)], cut: usize) -> Vec<u8> {
            for (at, byte) in flips {
                let at = at % bytes.len();
                bytes[at] ^= byte;
            }
            bytes.truncate(cut % (bytes.len() + 1));
            bytes
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(500))]

            #[test]
            fn no_input_panics_the_dummy_rpc_request_decoder(
                bytes in proptest::collection::vec(any::<u8>(), 0..256),
            ) {
                let _ = decode_request::<RealClientRpcRequest>(&bytes);
            }

            #[test]
            fn no_input_panics_the_master_rpc_request_decoder(
                bytes in proptest::collection::vec(any::<u8>(), 0..256),
            ) {
                let _ = decode_request::<MasterRpcRequest>(&bytes);
            }

            #[test]
            fn dummy_rpc_requests_round_trip_through_the_serving_codec(
                message in dummy_request(),
                deadline in deadline(),
                id in any::<u64>(),
            ) {
                // A deadline beyond the clock's range cannot be encoded: cap what we send.
                let deadline = deadline.min(Duration::from_secs(1 << 40));
                round_trips(&message, &request_bytes(&message, deadline, id), id);
            }

            #[test]
            fn master_rpc_requests_round_trip_through_the_serving_codec(
                message in master_request(),
                deadline in deadline(),
                id in any::<u64>(),
            ) {
                let deadline = deadline.min(Duration::from_secs(1 << 40));
                round_trips(&message, &request_bytes(&message, deadline, id), id);
            }

            #[test]
            fn mutated_rpc_requests_decode_or_fail_cleanly(
                dummy in dummy_request(),
                master in master_request(),
                id in any::<u64>(),
                flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
                cut in any::<usize>(),
            ) {
                let bytes = request_bytes(&dummy, Duration::from_secs(30), id);
                let _ = decode_request::<RealClientRpcRequest>(&mutate(bytes, &flips, cut));
                let bytes = request_bytes(&master, Duration::from_secs(30), id);
                let _ = decode_request::<MasterRpcRequest>(&mutate(bytes, &flips, cut));
            }
        }
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
