//! The journal of a segment file: which objects are committed where in the segment, as
//! an append-only list of records in one of two halves.
//!
//! A record says "`key` is committed at `offset..offset+len`, its `size` bytes having
//! checksum `value_crc`" or "`key` is gone". Records are appended to the active half;
//! when it is full, the objects still committed are written to the other half, which
//! then becomes active (its epoch, one higher, is stored in the header last, so a crash
//! during the rewrite leaves the old half in force). Each record's checksum covers its
//! half's epoch, so records left over from an earlier use of a half never count.
//!
//! Record layout (little endian, 8-byte aligned):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | total length of the record |
//! | 4..8 | CRC-32C of the epoch (8 bytes) and bytes 8..total |
//! | 8 | kind: 1 committed, 2 gone |
//! | 9 | zero |
//! | 10..12 | key length |
//! | 12..16 | CRC-32C of the value's bytes |
//! | 16..24 | offset in the segment |
//! | 24..32 | length of the space |
//! | 32..40 | size of the value |
//! | 40.. | key, zero-padded to 8 bytes |

use std::collections::HashMap;

use mooncake_offload::checksum::Crc32c;

/// Bytes before a record's key.
const RECORD_HEAD: usize = 40;
const KIND_COMMITTED: u8 = 1;
const KIND_GONE: u8 = 2;

/// Where an object's value lies in the segment, as the journal records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Start of its space in the segment.
    pub offset: u64,
    /// Length of its space (at least `size`).
    pub len: u64,
    /// Bytes of the value.
    pub size: u64,
    /// CRC-32C of the value's bytes.
    pub value_crc: u32,
}

/// One change the journal records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// `key` is committed at `placement`.
    Committed(String, Placement),
    /// `key` is gone.
    Gone(String),
}

fn record_crc(epoch: u64, body: &[u8]) -> u32 {
    let mut crc = Crc32c::default();
    crc.update(&epoch.to_le_bytes());
    crc.update(body);
    crc.finish()
}

/// `record` encoded for a half of epoch `epoch`; `None` for a key longer than the
/// format allows.
pub fn encode(record: &Record, epoch: u64) -> Option<Vec<u8>> {
    let (kind, key, placement) = match record {
        Record::Committed(key, placement) => (KIND_COMMITTED, key, *placement),
        Record::Gone(key) => (
            KIND_GONE,
            key,
            Placement {
                offset: 0,
                len: 0,
                size: 0,
                value_crc: 0,
            },
        ),
    };
    let key_len = u16::try_from(key.len()).ok()?;
    let total = (RECORD_HEAD + key.len()).next_multiple_of(8);
    let mut out = vec![0u8; total];
    out[0..4].copy_from_slice(&u32::try_from(total).ok()?.to_le_bytes());
    out[8] = kind;
    out[10..12].copy_from_slice(&key_len.to_le_bytes());
    out[12..16].copy_from_slice(&placement.value_crc.to_le_bytes());
    out[16..24].copy_from_slice(&placement.offset.to_le_bytes());
    out[24..32].copy_from_slice(&placement.len.to_le_bytes());
    out[32..40].copy_from_slice(&placement.size.to_le_bytes());
    out[RECORD_HEAD..RECORD_HEAD + key.len()].copy_from_slice(key.as_bytes());
    let crc = record_crc(epoch, &out[8..]);
    out[4..8].copy_from_slice(&crc.to_le_bytes());
    Some(out)
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// The record at the start of `bytes` and its length, when one written in epoch
/// `epoch` is there whole; `None` marks the end of the half (never written, torn, or
/// left from another epoch).
pub fn decode(bytes: &[u8], epoch: u64) -> Option<(Record, usize)> {
    let total = usize::try_from(u32_at(bytes, 0)?).ok()?;
    if total < RECORD_HEAD || total % 8 != 0 || total > bytes.len() {
        return None;
    }
    let body = &bytes[8..total];
    if u32_at(bytes, 4)? != record_crc(epoch, body) {
        return None;
    }
    let key_len = usize::from(u16::from_le_bytes(bytes.get(10..12)?.try_into().ok()?));
    if RECORD_HEAD + key_len > total {
        return None;
    }
    let key = &bytes[RECORD_HEAD..RECORD_HEAD + key_len];
    let key = std::str::from_utf8(key).ok()?.to_string();
    let record = match bytes[8] {
        KIND_COMMITTED => Record::Committed(
            key,
            Placement {
                value_crc: u32_at(bytes, 12)?,
                offset: u64_at(bytes, 16)?,
                len: u64_at(bytes, 24)?,
                size: u64_at(bytes, 32)?,
            },
        ),
        KIND_GONE => Record::Gone(key),
        _ => return None,
    };
    Some((record, total))
}

/// Every object committed according to the half `bytes` of epoch `epoch`, and where
/// its records end.
pub fn replay(bytes: &[u8], epoch: u64) -> (HashMap<String, Placement>, usize) {
    let mut live = HashMap::new();
    let mut at = 0;
    while let Some((record, len)) = bytes.get(at..).and_then(|rest| decode(rest, epoch)) {
        match record {
            Record::Committed(key, placement) => {
                live.insert(key, placement);
            }
            Record::Gone(key) => {
                live.remove(&key);
            }
        }
        at += len;
    }
    (live, at)
}

/// Bytes the records of `live` take in a half.
pub fn compacted_len(live: &HashMap<String, Placement>) -> usize {
    live.keys()
        .map(|key| (RECORD_HEAD + key.len()).next_multiple_of(8))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn placement(offset: u64) -> Placement {
        Placement {
            offset,
            len: 4096,
            size: 4000,
            value_crc: 0xDEAD_BEEF,
        }
    }

    #[test]
    fn records_read_back_in_their_epoch_only() {
        let record = Record::Committed("tenant/key".into(), placement(8192));
        let bytes = encode(&record, 7).expect("encodes");
        assert_eq!(bytes.len() % 8, 0);
        assert_eq!(decode(&bytes, 7), Some((record, bytes.len())));
        assert_eq!(
            decode(&bytes, 6),
            None,
            "a record of another epoch never counts"
        );
    }

    #[test]
    fn replay_applies_records_in_order_and_stops_at_a_torn_one() {
        let mut half = Vec::new();
        for record in [
            Record::Committed("a".into(), placement(0)),
            Record::Committed("b".into(), placement(4096)),
            Record::Gone("a".into()),
            Record::Committed("c".into(), placement(8192)),
        ] {
            half.extend(encode(&record, 1).expect("encodes"));
        }
        let whole = half.len();
        let mut torn = encode(&Record::Committed("d".into(), placement(0)), 1).expect("encodes");
        torn[20] ^= 1;
        half.extend(torn);
        half.resize(half.len() + 128, 0);
        let (live, end) = replay(&half, 1);
        assert_eq!(end, whole);
        assert_eq!(live.len(), 2);
        assert_eq!(live["b"], placement(4096));
        assert_eq!(live["c"], placement(8192));
        assert_eq!(
            compacted_len(&live),
            2 * (RECORD_HEAD + 8),
            "one-byte keys pad to 8"
        );
    }

    proptest! {
        #[test]
        fn any_bytes_replay_without_panicking(bytes in proptest::collection::vec(any::<u8>(), 0..512), epoch in any::<u64>()) {
            let (_, end) = replay(&bytes, epoch);
            prop_assert!(end <= bytes.len());
        }

        #[test]
        fn every_record_round_trips(key in "[a-z/]{0,80}", offset in any::<u64>(), size in any::<u64>(), gone in any::<bool>()) {
            let record = if gone {
                Record::Gone(key)
            } else {
                Record::Committed(key, Placement { offset, len: size, size, value_crc: 3 })
            };
            let bytes = encode(&record, 9).expect("encodes");
            prop_assert_eq!(decode(&bytes, 9), Some((record, bytes.len())));
        }
    }
}
