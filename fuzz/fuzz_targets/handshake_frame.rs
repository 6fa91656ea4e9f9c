//! Handshake frames as either end of a dummy ↔ real client connection reads them: a
//! length prefix, then at most that many bytes of payload
//! (`mooncake_core::protocol::fuzzing::handshake_frame`).

#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|frame: &[u8]| mooncake_core::protocol::fuzzing::handshake_frame(frame));
