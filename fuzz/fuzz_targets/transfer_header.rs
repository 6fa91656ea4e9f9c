//! Transfer-engine headers as a peer sends them: a request header (server side) and a
//! response header (client side). What decodes is within the protocol's bounds and
//! encodes back to the bytes received (grant fields included).

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_real_client::transfer::wire::{REQUEST_LEN, Request, WireError, read_response};

fuzz_target!(|bytes: &[u8]| {
    let mut frame = [0u8; REQUEST_LEN];
    let n = bytes.len().min(REQUEST_LEN);
    frame[..n].copy_from_slice(&bytes[..n]);
    if let Ok(request) = Request::decode(&frame) {
        assert!(Request::len_fits(request.op, request.len));
        // The two bytes after the flags are padding, not read.
        let mut sent = frame;
        sent[6..8].fill(0);
        assert_eq!(request.encode(), sent);
    }
    let mut stream = bytes;
    let _ = Request::read_from(&mut stream);
    let mut stream = bytes;
    match read_response(&mut stream) {
        Ok(Ok(len)) => assert_eq!(bytes[8..16], len.to_le_bytes()),
        Ok(Err(code)) => assert_ne!(code.as_i32(), 0),
        Err(WireError::Io(_)) => assert!(bytes.len() < 16),
        Err(WireError::Malformed(why)) => panic!("a response header is never malformed: {why}"),
    }
});
