//! Bucket metadata files as recovery reads them back from disk. Whatever decodes is
//! exactly the file the layout calls for (one encoding per content).
//!
//! Input: a mode byte, then the file. In mode 1 the file's checksum is appended
//! first, so that the fuzzer gets past it.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_offload::bucket::{MetaEntry, parse_meta};
use mooncake_offload::checksum::crc32c;

/// The metadata file of `entries` and a data file of `data_len` bytes, by the layout
/// of `bucket_storage_backend`.
fn meta_of(entries: &[MetaEntry], data_len: u64) -> Vec<u8> {
    let mut meta = b"MCBM".to_vec();
    meta.extend_from_slice(&1u32.to_le_bytes());
    let count = u32::try_from(entries.len()).expect("entries of a short input");
    meta.extend_from_slice(&count.to_le_bytes());
    meta.extend_from_slice(&data_len.to_le_bytes());
    for entry in entries {
        let key_len = u32::try_from(entry.key.len()).expect("keys of a short input");
        meta.extend_from_slice(&key_len.to_le_bytes());
        meta.extend_from_slice(entry.key.as_bytes());
        meta.extend_from_slice(&entry.offset.to_le_bytes());
        meta.extend_from_slice(&entry.value_len.to_le_bytes());
    }
    let crc = crc32c(&meta);
    meta.extend_from_slice(&crc.to_le_bytes());
    meta
}

fuzz_target!(|bytes: &[u8]| {
    let Some((&mode, file)) = bytes.split_first() else {
        return;
    };
    let mut file = file.to_vec();
    if mode == 1 {
        let crc = crc32c(&file);
        file.extend_from_slice(&crc.to_le_bytes());
    }
    if let Some(entries) = parse_meta(&file) {
        assert!(entries.iter().all(|entry| !entry.key.is_empty()));
        let data_len = u64::from_le_bytes(file[12..20].try_into().expect("8 bytes"));
        assert_eq!(meta_of(&entries, data_len), file);
    }
});
