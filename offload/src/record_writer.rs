//! Writes a batch of [records](crate::record) into a file without assembling them:
//! each record's header and key are copied into a small buffer, its value is written
//! from where the caller has it, and consecutive records go out together in windows
//! of about [`WINDOW`] bytes ([`IoEngine::write_gathered`]). A window's checksums are
//! computed just before it is written, so its values are still in the CPU cache when
//! the kernel copies them. The caller syncs once for the whole batch.

use std::fs::File;

use crate::io::{Gathered, IoEngine, MAX_GATHER};
pub use crate::record::Placement;
use crate::record::{self, MAX_PAD};

/// Bytes per gathered window.
pub const WINDOW: usize = 4 << 20;

/// Zeros for the gaps.
static ZEROS: [u8; MAX_PAD] = [0; MAX_PAD];

/// Writes every record of `records` (sorted by offset or not; records that follow
/// each other within [`MAX_PAD`] bytes share a window, the gap written as zeros).
/// A batch of [`MIN_DIRECT_BYTES`](crate::direct_write::MIN_DIRECT_BYTES) or more is
/// written with direct writes where the file allows them
/// ([`crate::direct_write`]). Not synced.
pub fn write_records(io: &IoEngine, file: &File, records: &[Placement<'_>]) -> std::io::Result<()> {
    if let Some(written) = crate::direct_write::write_records(file, records) {
        return written;
    }
    io.write_gathered(file, windows(records))
}

/// The windows of `records`, each built when the writer asks for it.
fn windows<'a>(records: &'a [Placement<'a>]) -> impl Iterator<Item = Gathered<'a>> + 'a {
    let mut next = 0;
    std::iter::from_fn(move || {
        let first = records.get(next)?;
        let mut window = Gathered::new(first.offset);
        let mut end = first.offset;
        while let Some(record) = records.get(next) {
            let gap = record
                .offset
                .checked_sub(end)
                .and_then(|gap| usize::try_from(gap).ok())
                .filter(|gap| *gap < MAX_PAD);
            let joins = window.is_empty()
                || (gap.is_some() && window.len() < WINDOW && window.pieces() + 3 <= MAX_GATHER);
            if !joins {
                break;
            }
            window.push(&ZEROS[..gap.unwrap_or(0)]);
            window.push_copy(&record::header(record.key.as_bytes(), record.value));
            window.push_copy(record.key.as_bytes());
            window.push(record.value);
            end = record.end();
            next += 1;
        }
        Some(window)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::HEADER_LEN;
    use std::os::unix::fs::FileExt;

    fn value(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| i.to_le_bytes()[0].wrapping_mul(31) ^ seed)
            .collect()
    }

    #[test]
    fn records_land_where_placed_with_zeros_between_both_engines() {
        for uring in [false, true] {
            let io = IoEngine::new(uring);
            let (path, file) = crate::io::scratch_file("record-writer", uring);
            let values: Vec<Vec<u8>> = (0..40u8)
                .map(|i| {
                    value(
                        if i == 5 {
                            3 * WINDOW
                        } else {
                            1000 + 977 * usize::from(i)
                        },
                        i,
                    )
                })
                .collect();
            let keys: Vec<String> = (0..40).map(|i| format!("key-{i}")).collect();
            // Back to back, with small gaps, and one record far away.
            let mut placements = Vec::new();
            let mut offset = 0u64;
            for (i, (key, value)) in keys.iter().zip(&values).enumerate() {
                if i == 30 {
                    offset += 1 << 30;
                }
                let placement = Placement { offset, key, value };
                offset = placement.end() + (i as u64 % 3) * 1000;
                placements.push(placement);
            }
            write_records(&io, &file, &placements).expect("write");
            for placement in &placements {
                let len = usize::try_from(placement.end() - placement.offset).expect("length");
                let mut record = vec![0u8; len];
                file.read_exact_at(&mut record, placement.offset)
                    .expect("read");
                let (head, rest) = record.split_at(HEADER_LEN);
                let (key, stored) = rest.split_at(placement.key.len());
                let header = record::Header::parse(head).expect("header");
                header.verify(key, stored).expect("checksum");
                assert_eq!(key, placement.key.as_bytes());
                assert!(stored == placement.value, "uring={uring}");
            }
            let mut gap = vec![1u8; 1000];
            file.read_exact_at(&mut gap, placements[1].end())
                .expect("gap");
            assert!(gap.iter().all(|b| *b == 0), "gaps are zeros");
            let _ = std::fs::remove_file(&path);
        }
    }
}
