//! Replies of a Redis server (or of anything answering on its port) as the
//! distributed-KV backend reads them: RESP parsed by the `redis` crate, then this
//! backend's readings of `CLUSTER SLOTS`, `INFO` and `SCAN` replies. None may panic,
//! and a primary read from a reply is a node it names: a host found in the reply's
//! bytes and a port other than 0.
//!
//! Input: the reply's bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_offload::dkv::redis::read_reply;

fuzz_target!(|bytes: &[u8]| {
    let (primaries, _, _) = read_reply(bytes);
    for (host, port) in primaries {
        assert!(!host.is_empty() && port != 0, "{host:?}:{port}");
        assert!(
            bytes.windows(host.len()).any(|w| w == host.as_bytes()),
            "{host:?} is not in the reply"
        );
    }
});
