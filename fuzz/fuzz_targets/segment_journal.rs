//! A segment file's journal half as a restarted process reads it (bytes an earlier
//! process, a crash, or anything with write access to the file left there): replay
//! never panics, never reads past the half, and every record it accepts survives
//! encoding and decoding again unchanged.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_real_client::segment_file::journal::{decode, encode, replay};

fuzz_target!(|input: (u64, &[u8])| {
    let (epoch, bytes) = input;
    let (_, end) = replay(bytes, epoch);
    assert!(end <= bytes.len());
    if let Some((record, len)) = decode(bytes, epoch) {
        assert!(len <= bytes.len());
        let again = encode(&record, epoch).expect("a decoded key fits the format");
        assert_eq!(decode(&again, epoch), Some((record, again.len())));
    }
});
