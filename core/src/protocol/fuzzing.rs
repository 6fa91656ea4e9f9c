//! What every decoder of foreign bytes in this crate must satisfy, written once for the
//! proptests and the fuzz targets (`fuzz/`): any input decodes or fails cleanly, and
//! whatever decodes encodes back to the same message. Built for tests and with the
//! `fuzzing` feature only.

use std::pin::Pin;
use std::time::{Duration, Instant};

use bytes::BytesMut;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_serde::Deserializer as _;

use super::codec::{MAX_REQUEST_DEADLINE_SECS, PostcardCodec};
use super::handshake::{
    DummyFrame, MAX_HANDSHAKE_FRAME, RealFrame, decode_len, decode_payload, encode_frame,
};

/// Decodes `frame` (length prefix included) as either end of a dummy ↔ real client
/// connection reads it; whatever decodes encodes again to a frame that decodes to the
/// same message.
pub fn handshake_frame(frame: &[u8]) {
    let mut prefix = [0u8; 4];
    let announced = frame.len().min(4);
    prefix[..announced].copy_from_slice(&frame[..announced]);
    let Ok(len) = decode_len(prefix) else {
        return;
    };
    assert!(len <= MAX_HANDSHAKE_FRAME);
    let payload = &frame[announced..];
    let payload = &payload[..len.min(payload.len())];
    if let Ok(message) = decode_payload::<DummyFrame>(payload) {
        let again = encode_frame(&message).expect("a decoded frame encodes");
        assert_eq!(
            decode_payload::<DummyFrame>(&again[4..]).ok(),
            Some(message)
        );
    }
    if let Ok(message) = decode_payload::<RealFrame>(payload) {
        let again = encode_frame(&message).expect("a decoded frame encodes");
        assert_eq!(decode_payload::<RealFrame>(&again[4..]).ok(), Some(message));
    }
}

/// Decodes `bytes` as a serving end's codec decodes a tarpc request of `Req` (a dummy's
/// request to its real client, or a real client's to the master): the deadline comes
/// out clamped, and a decoded request encodes and decodes again to the same bytes.
pub fn serving_request<Req: Serialize + DeserializeOwned>(bytes: &[u8]) {
    let mut codec = PostcardCodec::<tarpc::ClientMessage<Req>, ()>::serving();
    let Ok(tarpc::ClientMessage::Request(request)) =
        Pin::new(&mut codec).deserialize(&BytesMut::from(bytes))
    else {
        return;
    };
    assert!(
        request.context.deadline
            <= Instant::now() + Duration::from_secs(MAX_REQUEST_DEADLINE_SECS + 5),
        "the deadline is clamped"
    );
    let encoded = postcard::to_stdvec(&request.message).expect("a decoded request encodes");
    let again: Req = postcard::from_bytes(&encoded).expect("and decodes");
    assert_eq!(postcard::to_stdvec(&again).expect("encodes"), encoded);
}
