//! Replies of a Redis server (or of anything answering on its port) as the direct
//! connections read them: `GET` replies into a destination of a given size, and status
//! replies to `SET`s. None may panic, and no value read is longer than its destination.
//!
//! Input: the destination's size (first byte), then the reply's bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_offload::dkv::redis::read_replies;

fuzz_target!(|input: &[u8]| {
    let Some((&capacity, bytes)) = input.split_first() else {
        return;
    };
    let (values, _) = read_replies(bytes, usize::from(capacity));
    for length in values.into_iter().flatten() {
        assert!(length <= u64::from(capacity), "{length} > {capacity}");
    }
});
