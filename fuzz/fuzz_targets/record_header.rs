//! SSD-tier records as recovery and reads get them back from disk: the header, its
//! lengths against the bytes there are, then the checksum over key and value. Only a
//! record written for its key and value passes.
//!
//! Input: a mode byte, then the record. In mode 1 the record's checksum is first set
//! to the one its lengths and contents call for, so that the fuzzer gets past it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_offload::record::{HEADER_LEN, Header, MAX_KEY_LEN, MAX_VALUE_LEN, header, read_record};

/// `record` with the checksum its header's lengths and its contents call for.
fn sealed(record: &[u8]) -> Vec<u8> {
    let mut record = record.to_vec();
    if let Ok(parsed) = Header::parse(&record)
        && let Ok(len) = usize::try_from(parsed.record_len())
        && len <= record.len()
    {
        let (key, value) = record[HEADER_LEN..len].split_at(parsed.key_len as usize);
        let crc = header(key, value);
        record[16..20].copy_from_slice(&crc[16..20]);
    }
    record
}

fuzz_target!(|bytes: &[u8]| {
    let Some((&mode, record)) = bytes.split_first() else {
        return;
    };
    let record = if mode == 1 {
        sealed(record)
    } else {
        record.to_vec()
    };
    if let Ok(parsed) = Header::parse(&record) {
        assert!((1..=MAX_KEY_LEN).contains(&parsed.key_len));
        assert!(parsed.value_len <= MAX_VALUE_LEN);
        assert_eq!(
            u128::from(parsed.record_len()),
            HEADER_LEN as u128 + u128::from(parsed.key_len) + u128::from(parsed.value_len),
            "the record length never saturates"
        );
    }
    if let Ok((key, value)) = read_record(&record) {
        // Only the reserved bytes are not checked.
        let mut written = header(key, value);
        written[20..].copy_from_slice(&record[20..HEADER_LEN]);
        assert_eq!(record[..HEADER_LEN], written);
        let _ = std::str::from_utf8(key);
    }
});
