//! The on-disk record: one object (key and value) with a checksum.
//!
//! ```text
//! offset  size  field
//!      0     4  magic "MCR1"
//!      4     4  key length (u32, little endian)
//!      8     8  value length (u64, little endian)
//!     16     4  CRC-32C of bytes 4..16, the key and the value
//!     20     4  reserved, 0
//!     24     k  key (UTF-8)
//!   24+k     v  value
//! ```
//!
//! A record is valid only if its magic, lengths and checksum all agree, so a torn write
//! (a crash mid-record) or a flipped bit is detected when the record is read back.

use crate::checksum::Crc32c;

/// Bytes before the key.
pub const HEADER_LEN: usize = 24;

/// First bytes of every record.
pub const MAGIC: [u8; 4] = *b"MCR1";

/// Longest key a record holds.
pub const MAX_KEY_LEN: u32 = 1 << 20;

/// Longest value length a header may announce: with it, a record's length always fits
/// a `u64` (a corrupt length field can never wrap around).
pub const MAX_VALUE_LEN: u64 = u64::MAX >> 1;

/// Why bytes are not a valid record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Fewer bytes than the header or the lengths it announces.
    #[error("truncated record")]
    Truncated,
    /// The magic is wrong: not a record, or not at a record boundary.
    #[error("bad record magic")]
    BadMagic,
    /// The key length is above [`MAX_KEY_LEN`] or the key is not UTF-8.
    #[error("bad record key")]
    BadKey,
    /// The checksum does not match the contents.
    #[error("record checksum mismatch")]
    Checksum,
    /// The value length is above [`MAX_VALUE_LEN`], or the record runs past the end of
    /// its file.
    #[error("bad record length")]
    BadLength,
}

/// The fixed part of a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Key length in bytes.
    pub key_len: u32,
    /// Value length in bytes.
    pub value_len: u64,
    /// Stored checksum.
    pub crc: u32,
}

impl Header {
    /// Total length of the record this header starts (never wraps: [`Header::parse`]
    /// bounds both lengths).
    pub fn record_len(&self) -> u64 {
        (HEADER_LEN as u64)
            .saturating_add(u64::from(self.key_len))
            .saturating_add(self.value_len)
    }

    /// Parses and sanity-checks the first [`HEADER_LEN`] bytes of a record.
    pub fn parse(bytes: &[u8]) -> Result<Header, RecordError> {
        let bytes: &[u8; HEADER_LEN] = bytes
            .get(..HEADER_LEN)
            .and_then(|b| b.try_into().ok())
            .ok_or(RecordError::Truncated)?;
        if bytes[..4] != MAGIC {
            return Err(RecordError::BadMagic);
        }
        let key_len = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        let mut value_len = [0u8; 8];
        value_len.copy_from_slice(&bytes[8..16]);
        let crc = u32::from_le_bytes([bytes[16], bytes[17], bytes[18], bytes[19]]);
        if key_len == 0 || key_len > MAX_KEY_LEN {
            return Err(RecordError::BadKey);
        }
        let value_len = u64::from_le_bytes(value_len);
        if value_len > MAX_VALUE_LEN {
            return Err(RecordError::BadLength);
        }
        Ok(Header {
            key_len,
            value_len,
            crc,
        })
    }

    /// Checks the stored checksum against `key` and `value`.
    pub fn verify(&self, key: &[u8], value: &[u8]) -> Result<(), RecordError> {
        if key.len() != self.key_len as usize || value.len() as u64 != self.value_len {
            return Err(RecordError::Truncated);
        }
        if checksum(key, value) == self.crc {
            Ok(())
        } else {
            Err(RecordError::Checksum)
        }
    }
}

fn checksum(key: &[u8], value: &[u8]) -> u32 {
    let mut crc = Crc32c::default();
    #[expect(
        clippy::cast_possible_truncation,
        reason = "keys are at most MAX_KEY_LEN"
    )]
    crc.update(&(key.len() as u32).to_le_bytes());
    crc.update(&(value.len() as u64).to_le_bytes());
    crc.update(key);
    crc.update(value);
    crc.finish()
}

/// The header of a record holding `key` and `value` (the caller checks the key
/// length against [`MAX_KEY_LEN`]).
pub fn header(key: &[u8], value: &[u8]) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[..4].copy_from_slice(&MAGIC);
    #[expect(
        clippy::cast_possible_truncation,
        reason = "keys are at most MAX_KEY_LEN"
    )]
    out[4..8].copy_from_slice(&(key.len() as u32).to_le_bytes());
    out[8..16].copy_from_slice(&(value.len() as u64).to_le_bytes());
    out[16..20].copy_from_slice(&checksum(key, value).to_le_bytes());
    out
}

/// The key and value of the record at the start of `bytes`, read as recovery reads one
/// from its file: the header, its lengths against the bytes there are, then the
/// checksum over key and value.
pub fn read_record(bytes: &[u8]) -> Result<(&[u8], &[u8]), RecordError> {
    let header = Header::parse(bytes)?;
    let len = usize::try_from(header.record_len()).map_err(|_| RecordError::BadLength)?;
    let record = bytes.get(..len).ok_or(RecordError::BadLength)?;
    let key_len = usize::try_from(header.key_len).map_err(|_| RecordError::BadLength)?;
    let (key, value) = record[HEADER_LEN..].split_at(key_len);
    header.verify(key, value)?;
    Ok((key, value))
}

/// The largest gap between two records of a batch that is written as zeros, keeping
/// them in one write (records of the one-file backend start at 4 KiB boundaries; a
/// larger gap holds other records).
pub(crate) const MAX_PAD: usize = 4096;

/// One record of a batch and where it goes in the file.
#[derive(Clone, Copy, Debug)]
pub struct Placement<'a> {
    /// Offset of the record in the file.
    pub offset: u64,
    /// The object's key.
    pub key: &'a str,
    /// The object's value.
    pub value: &'a [u8],
}

impl Placement<'_> {
    /// Where the record ends in the file.
    pub(crate) fn end(&self) -> u64 {
        self.offset + (HEADER_LEN + self.key.len() + self.value.len()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_length_field_that_would_wrap_is_refused() {
        let mut head = header(b"key", b"value");
        head[8..16].copy_from_slice(&(u64::MAX - 3).to_le_bytes());
        assert_eq!(Header::parse(&head), Err(RecordError::BadLength));
        head[8..16].copy_from_slice(&MAX_VALUE_LEN.to_le_bytes());
        let parsed = Header::parse(&head).expect("the largest length parses");
        assert_eq!(parsed.record_len(), 24 + 3 + MAX_VALUE_LEN);
    }

    #[test]
    fn round_trip_and_every_corruption_is_caught() {
        let head = header(b"key", b"value");
        let parsed = Header::parse(&head).expect("valid");
        assert_eq!(parsed.record_len(), 24 + 3 + 5);
        assert_eq!(parsed.verify(b"key", b"value"), Ok(()));
        assert_eq!(parsed.verify(b"key", b"valuf"), Err(RecordError::Checksum));
        assert_eq!(parsed.verify(b"kez", b"value"), Err(RecordError::Checksum));
        assert_eq!(parsed.verify(b"key", b"valu"), Err(RecordError::Truncated));
        assert_eq!(Header::parse(&head[..10]), Err(RecordError::Truncated));
        let mut bad = head;
        bad[0] = b'X';
        assert_eq!(Header::parse(&bad), Err(RecordError::BadMagic));
        let mut flipped = head;
        flipped[9] ^= 1; // value length changes: the checksum no longer matches
        let parsed = Header::parse(&flipped).expect("parses");
        assert!(parsed.verify(b"key", b"value").is_err());
    }

    mod foreign_bytes {
        //! Records come back from disk or from another store: no bytes may panic their
        //! decoder, and only a record written for its key and value passes it.

        use proptest::prelude::*;

        use super::*;

        fn record(key: &[u8], value: &[u8]) -> Vec<u8> {
            let mut record = header(key, value).to_vec();
            record.extend_from_slice(key);
            record.extend_from_slice(value);
            record
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1000))]

            #[test]
            fn no_input_panics_the_record_header_decoder(
                mut bytes in proptest::collection::vec(any::<u8>(), 0..96),
                magic in any::<bool>(),
            ) {
                if magic && bytes.len() >= 4 {
                    bytes[..4].copy_from_slice(&MAGIC);
                }
                if let Ok(header) = Header::parse(&bytes) {
                    prop_assert!((1..=MAX_KEY_LEN).contains(&header.key_len));
                    prop_assert!(header.value_len <= MAX_VALUE_LEN);
                    prop_assert_eq!(
                        u128::from(header.record_len()),
                        HEADER_LEN as u128
                            + u128::from(header.key_len)
                            + u128::from(header.value_len),
                        "the record length never saturates"
                    );
                }
                if let Ok((key, value)) = read_record(&bytes) {
                    prop_assert_eq!(&bytes[..HEADER_LEN], &header(key, value)[..]);
                }
            }

            #[test]
            fn records_round_trip_and_any_corrupt_byte_is_caught(
                key in proptest::collection::vec(any::<u8>(), 1..48),
                value in proptest::collection::vec(any::<u8>(), 0..200),
                at in any::<usize>(),
                flip in 1..=255u8,
            ) {
                let written = record(&key, &value);
                prop_assert_eq!(read_record(&written), Ok((&key[..], &value[..])));
                // Every byte but the reserved ones is covered by the magic, a bound or
                // the checksum.
                let at = at % written.len();
                if !(20..HEADER_LEN).contains(&at) {
                    let mut damaged = written.clone();
                    damaged[at] ^= flip;
                    prop_assert!(read_record(&damaged).is_err());
                }
                prop_assert!(read_record(&written[..at]).is_err(), "a torn record");
            }
        }
    }
}
