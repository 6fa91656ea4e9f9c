//! The offset allocator's journal as recovery replays it from disk: entries up to the
//! first torn or corrupt one. The valid prefix is exactly the bytes the layout calls
//! for with the entries found.
//!
//! Input: a mode byte, then the journal. Mode 1 puts the magic in front; mode 2 also
//! sets each entry's checksum to the one its bytes call for, so that the fuzzer gets
//! past them.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_offload::checksum::crc32c;
use mooncake_offload::offset_allocator::{JournalEntry, parse_journal};

const MAGIC: &[u8; 4] = b"MCJ1";

/// The journal of `entries`, by the layout of `offset_allocator_storage_backend`.
fn journal_of(entries: &[JournalEntry]) -> Vec<u8> {
    let mut journal = MAGIC.to_vec();
    for entry in entries {
        let start = journal.len();
        journal.push(entry.kind);
        let key_len = u32::try_from(entry.key.len()).expect("keys of a short input");
        journal.extend_from_slice(&key_len.to_le_bytes());
        journal.extend_from_slice(entry.key.as_bytes());
        journal.extend_from_slice(&entry.offset.to_le_bytes());
        journal.extend_from_slice(&entry.value_len.to_le_bytes());
        let crc = crc32c(&journal[start..]);
        journal.extend_from_slice(&crc.to_le_bytes());
    }
    journal
}

/// `journal` with each entry's checksum set to the one its bytes call for.
fn sealed(mut journal: Vec<u8>) -> Vec<u8> {
    let mut at = MAGIC.len();
    while let Some(len) = journal.get(at + 1..at + 5) {
        let key_len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        let end = at + 5 + key_len + 20;
        if end > journal.len() {
            break;
        }
        let crc = crc32c(&journal[at..end - 4]);
        journal[end - 4..end].copy_from_slice(&crc.to_le_bytes());
        at = end;
    }
    journal
}

fuzz_target!(|bytes: &[u8]| {
    let Some((&mode, rest)) = bytes.split_first() else {
        return;
    };
    let journal = match mode {
        1 | 2 => {
            let mut journal = MAGIC.to_vec();
            journal.extend_from_slice(rest);
            if mode == 2 { sealed(journal) } else { journal }
        }
        _ => rest.to_vec(),
    };
    let (entries, valid) = parse_journal(&journal);
    let valid = usize::try_from(valid).expect("within the input");
    assert!(valid <= journal.len());
    if valid == 0 {
        assert!(entries.is_empty());
    } else {
        assert!(
            entries
                .iter()
                .all(|e| matches!(e.kind, 1 | 2) && !e.key.is_empty())
        );
        assert_eq!(journal_of(&entries), journal[..valid]);
    }
});
