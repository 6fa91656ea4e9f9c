//! Replies of a Redis server (or of anything answering on its port) as the
//! distributed-KV backend reads them: RESP parsed by the `redis` crate, then this
//! backend's readings of `CLUSTER SLOTS`, `INFO` and `SCAN` replies. None may panic.
//!
//! Input: the reply's bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_offload::dkv::redis::read_reply;

fuzz_target!(|bytes: &[u8]| {
    let (primaries, _, _) = read_reply(bytes);
    // A primary is only read from a reply long enough to name one.
    assert!(primaries.is_empty() || bytes.len() >= 8);
});
