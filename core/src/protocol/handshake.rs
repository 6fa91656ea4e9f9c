//! Handshake frames exchanged before RPC starts.
//!
//! ```text
//! frame := len: u32 LE (≤ MAX_HANDSHAKE_FRAME) | postcard(message)
//!
//! dummy                                   real client
//!   Hello{Session}               ──────▶
//!                                ◀──────  Welcome | Refused
//!   Register{segment} + memfd    ──────▶   (repeated per segment)
//!                                ◀──────  Registered | Rejected
//!   Ready                        ──────▶
//!                                ◀──────  Attached
//!   ... tarpc on the same stream ...
//! ```
//!
//! A dummy that grows its pool later opens a second, short connection with
//! `Hello{Attach}` naming its session, sends one `Register`, reads the answer and closes.
//! The memfd rides as SCM_RIGHTS ancillary data on the first byte of the `Register` frame.

use serde::{Deserialize, Serialize};

/// Largest handshake frame, in bytes.
pub const MAX_HANDSHAKE_FRAME: usize = 64 * 1024;

/// What a dummy's connection is for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Purpose {
    /// The dummy's main connection: its lifetime is the dummy's lease.
    Session,
    /// A side connection that adds one segment to an existing session.
    Attach,
}

/// The role of a shared-memory segment in the dummy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SegmentKind {
    /// Memory handed to the application by `alloc_from_mem_pool`.
    Pool,
    /// The staging buffer used to copy ordinary memory through.
    Staging,
}

/// A shared-memory segment offered by the dummy (its memfd travels alongside).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentRegistration {
    /// Address of the mapping in the dummy's address space.
    pub dummy_base: u64,
    /// Length of the mapping in bytes.
    pub len: u64,
    /// What it is used for.
    pub kind: SegmentKind,
}

/// Frames sent by the dummy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum DummyFrame {
    /// First frame of every connection.
    Hello {
        /// [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION) of the dummy.
        version: u32,
        /// Random id of the dummy, stable across reconnects.
        client_id: u128,
        /// Process id of the dummy.
        pid: u32,
        /// Human-readable name (program and rank).
        name: String,
        /// What the connection is for.
        purpose: Purpose,
    },
    /// Offers one segment; the memfd is attached to this frame.
    Register(SegmentRegistration),
    /// Ends the handshake of a session connection; RPC follows.
    Ready,
}

/// Frames sent by the real client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RealFrame {
    /// The dummy is accepted.
    Welcome {
        /// [`PROTOCOL_VERSION`](super::PROTOCOL_VERSION) of the real client.
        version: u32,
        /// Random id fixed for the life of the real client process.
        instance_id: u128,
        /// Name of the real client's global segment.
        segment_name: String,
        /// Most bytes of shared memory one dummy may register.
        max_mapped_bytes: u64,
    },
    /// The dummy is refused; the text says why and what to do.
    Refused(String),
    /// The segment is mapped.
    Registered,
    /// The segment was rejected; the text says why.
    Rejected(String),
    /// The session is registered (it shows in status); RPC follows.
    Attached,
}

/// Why a handshake frame could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The length prefix exceeds [`MAX_HANDSHAKE_FRAME`].
    #[error("handshake frame of {len} bytes exceeds the limit of {MAX_HANDSHAKE_FRAME} bytes")]
    TooLong {
        /// The announced length.
        len: usize,
    },
    /// The payload is not a valid message.
    #[error("malformed handshake frame: {0}")]
    Malformed(#[from] postcard::Error),
}

/// Encodes a message as one frame (length prefix included).
pub fn encode_frame<T: Serialize>(message: &T) -> Result<Vec<u8>, FrameError> {
    let payload = postcard::to_stdvec(message)?;
    if payload.len() > MAX_HANDSHAKE_FRAME {
        return Err(FrameError::TooLong { len: payload.len() });
    }
    let len =
        u32::try_from(payload.len()).map_err(|_| FrameError::TooLong { len: payload.len() })?;
    let mut frame = Vec::with_capacity(4 + payload.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&payload);
    Ok(frame)
}

/// Reads a length prefix and checks it against the limit.
pub fn decode_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_HANDSHAKE_FRAME {
        Err(FrameError::TooLong { len })
    } else {
        Ok(len)
    }
}

/// Decodes a frame payload (without its length prefix).
pub fn decode_payload<T: for<'de> Deserialize<'de>>(payload: &[u8]) -> Result<T, FrameError> {
    Ok(postcard::from_bytes(payload)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let hello = DummyFrame::Hello {
            version: 1,
            client_id: 7,
            pid: 42,
            name: "rank0".into(),
            purpose: Purpose::Session,
        };
        let frame = encode_frame(&hello).expect("encode");
        let len = decode_len(frame[..4].try_into().expect("prefix")).expect("len");
        assert_eq!(len, frame.len() - 4);
        assert_eq!(
            decode_payload::<DummyFrame>(&frame[4..]).expect("decode"),
            hello
        );
    }

    #[test]
    fn rejects_oversized_and_garbage() {
        assert!(decode_len(u32::MAX.to_le_bytes()).is_err());
        assert!(decode_payload::<DummyFrame>(&[0xff, 0xff, 0xff]).is_err());
    }

    use proptest::prelude::*;

    fn any_dummy_frame() -> impl Strategy<Value = DummyFrame> {
        let purpose = prop_oneof![Just(Purpose::Session), Just(Purpose::Attach)];
        let kind = prop_oneof![Just(SegmentKind::Pool), Just(SegmentKind::Staging)];
        prop_oneof![
            (
                any::<u32>(),
                any::<u128>(),
                any::<u32>(),
                ".{0,40}",
                purpose
            )
                .prop_map(|(version, client_id, pid, name, purpose)| {
                    DummyFrame::Hello {
                        version,
                        client_id,
                        pid,
                        name,
                        purpose,
                    }
                }),
            (any::<u64>(), any::<u64>(), kind).prop_map(|(dummy_base, len, kind)| {
                DummyFrame::Register(SegmentRegistration {
                    dummy_base,
                    len,
                    kind,
                })
            }),
            Just(DummyFrame::Ready),
        ]
    }

    fn any_real_frame() -> impl Strategy<Value = RealFrame> {
        prop_oneof![
            (any::<u32>(), any::<u128>(), ".{0,40}", any::<u64>()).prop_map(
                |(version, instance_id, segment_name, max_mapped_bytes)| RealFrame::Welcome {
                    version,
                    instance_id,
                    segment_name,
                    max_mapped_bytes,
                }
            ),
            ".{0,80}".prop_map(RealFrame::Refused),
            Just(RealFrame::Registered),
            ".{0,80}".prop_map(RealFrame::Rejected),
            Just(RealFrame::Attached),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn no_input_panics_the_handshake_frame_decoder(
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            crate::protocol::fuzzing::handshake_frame(&bytes);
            let _ = decode_payload::<DummyFrame>(&bytes);
            let _ = decode_payload::<RealFrame>(&bytes);
        }

        #[test]
        fn handshake_frames_of_either_side_round_trip(
            dummy in any_dummy_frame(),
            real in any_real_frame(),
        ) {
            let frame = encode_frame(&dummy).expect("encode");
            let len = decode_len(frame[..4].try_into().expect("prefix")).expect("len");
            prop_assert_eq!(len, frame.len() - 4);
            prop_assert_eq!(decode_payload::<DummyFrame>(&frame[4..]).ok(), Some(dummy));
            let frame = encode_frame(&real).expect("encode");
            let len = decode_len(frame[..4].try_into().expect("prefix")).expect("len");
            prop_assert_eq!(len, frame.len() - 4);
            prop_assert_eq!(decode_payload::<RealFrame>(&frame[4..]).ok(), Some(real));
        }

        #[test]
        fn mutated_handshake_frames_decode_or_fail_cleanly(
            dummy in any_dummy_frame(),
            real in any_real_frame(),
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
            cut in any::<usize>(),
        ) {
            for mut frame in [
                encode_frame(&dummy).expect("encode"),
                encode_frame(&real).expect("encode"),
            ] {
                for (at, byte) in &flips {
                    let at = at % frame.len();
                    frame[at] ^= byte;
                }
                crate::protocol::fuzzing::handshake_frame(&frame);
                crate::protocol::fuzzing::handshake_frame(&frame[..cut % (frame.len() + 1)]);
            }
        }
    }
}
