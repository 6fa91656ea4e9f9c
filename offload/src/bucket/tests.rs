use super::*;
use std::os::unix::fs::FileExt;

use crate::test_dir::TempDir;

fn value(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add(i.to_le_bytes()[0].wrapping_mul(13)))
        .collect()
}

fn read(store: &mut BucketStore, key: &str) -> Result<Vec<u8>, StoreError> {
    let mut dest = vec![0u8; 1 << 20];
    let len = store.read_into(key, &mut dest)?;
    dest.truncate(usize::try_from(len).expect("small"));
    Ok(dest)
}

fn open(dir: &TempDir, quota: u64, policy: EvictionPolicy) -> (BucketStore, RecoveryReport) {
    BucketStore::open(&dir.0, quota, policy).expect("open")
}

/// Writes bucket `b` with keys `b-0..b-<n>` (values of 1000 bytes).
fn write(store: &mut BucketStore, b: u8, n: u8) -> u64 {
    let names: Vec<String> = (0..n).map(|i| format!("{b}-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..n).map(|i| value(b * 16 + i, 1000)).collect();
    let objects: Vec<(&str, &[u8])> = names
        .iter()
        .map(String::as_str)
        .zip(values.iter().map(Vec::as_slice))
        .collect();
    let eviction = store.make_room(&objects).expect("room");
    store.finish_eviction(eviction);
    store.write_bucket(&objects).expect("write")
}

#[test]
fn objects_survive_a_reopen_byte_exact() {
    let dir = TempDir::new("reopen");
    let (mut store, report) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    assert_eq!(report, RecoveryReport::default());
    write(&mut store, 1, 3);
    write(&mut store, 2, 2);
    assert_eq!(read(&mut store, "1-2").expect("read"), value(18, 1000));
    let used = store.used_bytes();
    drop(store);
    let (mut store, report) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    assert_eq!(
        (report.buckets, report.objects, report.corrupt_records),
        (2, 5, 0)
    );
    assert_eq!(store.used_bytes(), used);
    for (key, seed) in [("1-0", 16), ("1-2", 18), ("2-1", 33)] {
        assert_eq!(read(&mut store, key).expect(key), value(seed, 1000));
    }
    let mut sizes: Vec<_> = store.objects();
    sizes.sort();
    assert_eq!(sizes.len(), 5);
    assert!(sizes.iter().all(|(_, s)| *s == 1000));
    assert!(matches!(read(&mut store, "9-9"), Err(StoreError::NotFound)));
}

#[test]
fn a_truncated_bucket_keeps_its_intact_records() {
    let dir = TempDir::new("truncate");
    let (mut store, _) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    write(&mut store, 1, 2);
    let id = write(&mut store, 2, 4);
    drop(store);
    // Cut inside the third record of bucket 2 (each record is 24 + 3 + 1000 bytes).
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.0.join(format!("{id}.bucket")))
        .expect("open data");
    file.set_len(2 * 1027 + 500).expect("truncate");
    let (mut store, report) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    assert_eq!((report.objects, report.corrupt_records), (4, 2));
    assert_eq!(read(&mut store, "2-1").expect("intact"), value(33, 1000));
    assert!(matches!(read(&mut store, "2-2"), Err(StoreError::NotFound)));
    assert!(matches!(read(&mut store, "2-3"), Err(StoreError::NotFound)));
    assert_eq!(
        read(&mut store, "1-1").expect("other bucket"),
        value(17, 1000)
    );
}

#[test]
fn flipped_bits_are_caught_at_recovery_and_at_read() {
    let dir = TempDir::new("flip");
    let (mut store, _) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    let id = write(&mut store, 1, 3);
    let data = dir.0.join(format!("{id}.bucket"));
    let flip = |at: u64| {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&data)
            .expect("open");
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at).expect("read");
        byte[0] ^= 0x10;
        file.write_all_at(&byte, at).expect("write");
    };
    // While open: the read notices, answers Corrupt, and forgets the key.
    flip(1027 + 24 + 3 + 10);
    assert!(matches!(
        read(&mut store, "1-1"),
        Err(StoreError::Corrupt(_))
    ));
    assert!(matches!(read(&mut store, "1-1"), Err(StoreError::NotFound)));
    drop(store);
    // At recovery: the damaged record is left out, the others stay (1-1 was dropped
    // from the metadata when its read failed, so it is not even looked at).
    flip(2 * 1027 + 30);
    let (mut store, report) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    assert_eq!((report.objects, report.corrupt_records), (1, 1));
    assert_eq!(read(&mut store, "1-0").expect("intact"), value(16, 1000));
}

#[test]
fn bad_metadata_and_leftovers_are_removed() {
    let dir = TempDir::new("meta");
    let (mut store, _) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    let first = write(&mut store, 1, 2);
    let second = write(&mut store, 2, 2);
    drop(store);
    let meta = dir.0.join(format!("{first}.meta"));
    let mut bytes = std::fs::read(&meta).expect("read meta");
    bytes[20] ^= 1;
    std::fs::write(&meta, bytes).expect("write meta");
    std::fs::write(dir.0.join("7.bucket"), b"half a bucket").expect("orphan");
    std::fs::write(dir.0.join("8.meta.tmp"), b"unfinished").expect("tmp");
    let (mut store, report) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    assert_eq!(report.dropped_buckets, 1);
    assert_eq!(report.orphan_files, 2);
    assert_eq!((report.buckets, report.objects), (1, 2));
    assert!(!dir.0.join(format!("{first}.bucket")).exists());
    assert!(!dir.0.join("7.bucket").exists());
    assert!(!dir.0.join("8.meta.tmp").exists());
    assert!(matches!(read(&mut store, "1-0"), Err(StoreError::NotFound)));
    assert!(read(&mut store, "2-0").is_ok());
    assert!(dir.0.join(format!("{second}.meta")).exists());
}

#[test]
fn fifo_evicts_the_oldest_bucket_and_stays_under_quota() {
    let dir = TempDir::new("fifo");
    // Room for three buckets of two 1000-byte objects.
    let quota = 3 * 2200;
    let (mut store, _) = open(&dir, quota, EvictionPolicy::Fifo);
    for b in 1..=3 {
        write(&mut store, b, 2);
    }
    let objects: [(&str, &[u8]); 2] = [("4-0", &[4; 1000]), ("4-1", &[4; 1000])];
    let eviction = store.make_room(&objects).expect("room");
    assert_eq!(eviction.keys.len(), 2);
    assert!(
        eviction.keys.iter().all(|k| k.starts_with("1-")),
        "{:?}",
        eviction.keys
    );
    // Phase one: gone from the index, files still there until phase two.
    assert!(!store.contains("1-0"));
    let oldest = eviction.units[0];
    assert!(dir.0.join(format!("{oldest}.bucket")).exists());
    store.finish_eviction(eviction);
    assert!(!dir.0.join(format!("{oldest}.bucket")).exists());
    store.write_bucket(&objects).expect("write");
    assert!(store.used_bytes() <= quota);
    assert_eq!(store.len(), 6);
}

#[test]
fn lru_evicts_never_read_buckets_first_then_the_least_recent() {
    let dir = TempDir::new("lru");
    let (mut store, _) = open(&dir, 3 * 2200, EvictionPolicy::Lru);
    for b in 1..=3 {
        write(&mut store, b, 2);
    }
    read(&mut store, "1-0").expect("read 1");
    read(&mut store, "3-0").expect("read 3");
    read(&mut store, "1-1").expect("read 1 again");
    write(&mut store, 4, 2); // evicts bucket 2 (never read)
    assert!(!store.contains("2-0") && store.contains("1-0") && store.contains("3-0"));
    write(&mut store, 5, 2); // then bucket 4 (never read) goes before 3 and 1
    assert!(!store.contains("4-0"));
    read(&mut store, "5-0").expect("read 5");
    write(&mut store, 6, 2); // now bucket 3, read least recently
    assert!(!store.contains("3-0") && store.contains("1-0") && store.contains("5-0"));
}

#[test]
fn policy_none_refuses_instead_of_evicting() {
    let dir = TempDir::new("none");
    let (mut store, _) = open(&dir, 2200, EvictionPolicy::None);
    write(&mut store, 1, 2);
    let objects: [(&str, &[u8]); 1] = [("x", &[1; 1000])];
    assert!(matches!(
        store.make_room(&objects),
        Err(StoreError::QuotaExceeded { .. })
    ));
    assert!(matches!(
        store.write_bucket(&objects),
        Err(StoreError::QuotaExceeded { .. })
    ));
    assert!(store.contains("1-0"));
}

#[test]
fn removal_and_bad_batches() {
    let dir = TempDir::new("remove");
    let (mut store, _) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    let id = write(&mut store, 1, 2);
    assert!(matches!(
        store.write_bucket(&[("1-0", b"again")]),
        Err(StoreError::AlreadyExists(_))
    ));
    assert!(matches!(
        store.write_bucket(&[("d", b"1"), ("d", b"2")]),
        Err(StoreError::AlreadyExists(_))
    ));
    assert!(matches!(
        store.write_bucket(&[]),
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        store.write_bucket(&[("", b"v")]),
        Err(StoreError::Invalid(_))
    ));
    assert!(matches!(
        store.write_bucket(&[("e", b"")]),
        Err(StoreError::Invalid(_))
    ));
    let mut small = [0u8; 10];
    assert!(matches!(
        store.read_into("1-0", &mut small),
        Err(StoreError::BufferTooSmall {
            need: 1000,
            have: 10
        })
    ));
    assert!(store.remove("1-0"));
    assert!(!store.remove("1-0"));
    assert!(
        dir.0.join(format!("{id}.bucket")).exists(),
        "one key still lives there"
    );
    assert!(store.remove("1-1"));
    assert!(!dir.0.join(format!("{id}.bucket")).exists());
    assert_eq!(store.used_bytes(), 0);
    write(&mut store, 2, 2);
    assert_eq!(store.remove_all(), 2);
    assert!(store.is_empty());
    let (_, report) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    assert_eq!(report.objects, 0);
}

mod foreign_bytes {
    //! Metadata files come back from disk: no bytes may panic their decoder, and what
    //! decodes is exactly what the store writes for those entries.

    use proptest::prelude::*;

    use super::*;

    /// The metadata file the store writes for `entries` and a data file of `data_len`
    /// bytes.
    fn meta_of(entries: &[MetaEntry], data_len: u64) -> Vec<u8> {
        let entries: Vec<(&str, Location)> = entries
            .iter()
            .map(|entry| {
                let location = Location {
                    bucket: 0,
                    offset: entry.offset,
                    key_len: u32::try_from(entry.key.len()).expect("short keys"),
                    value_len: entry.value_len,
                };
                (entry.key.as_str(), location)
            })
            .collect();
        build_meta(&entries, data_len)
    }

    /// Decodes `bytes`; whatever decodes is what the store writes for those entries.
    fn decode(bytes: &[u8]) -> Option<Vec<MetaEntry>> {
        let entries = parse_meta(bytes)?;
        let data_len = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
        assert_eq!(
            meta_of(&entries, data_len),
            bytes,
            "one encoding per content"
        );
        Some(entries)
    }

    /// `body` with its checksum appended, as a valid file ends.
    fn sealed(mut body: Vec<u8>) -> Vec<u8> {
        let crc = crc32c(&body);
        body.extend_from_slice(&crc.to_le_bytes());
        body
    }

    fn entry() -> impl Strategy<Value = MetaEntry> {
        (".{1,12}", any::<u64>(), any::<u64>()).prop_map(|(key, offset, value_len)| MetaEntry {
            key,
            offset,
            value_len,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn no_input_panics_the_bucket_metadata_decoder(
            bytes in proptest::collection::vec(any::<u8>(), 0..160),
            header in any::<bool>(),
            count in 0..4u32,
        ) {
            // Most inputs get past the checksum and half past the header, so that the
            // entries' decoder sees them.
            let mut body = bytes.clone();
            if header && body.len() >= 12 {
                body[..4].copy_from_slice(&META_MAGIC);
                body[4..8].copy_from_slice(&META_VERSION.to_le_bytes());
                body[8..12].copy_from_slice(&count.to_le_bytes());
            }
            decode(&bytes);
            decode(&sealed(body));
        }

        #[test]
        fn bucket_metadata_round_trips(
            entries in proptest::collection::vec(entry(), 0..6),
            data_len in any::<u64>(),
        ) {
            let meta = meta_of(&entries, data_len);
            prop_assert_eq!(decode(&meta), Some(entries));
        }

        #[test]
        fn damaged_bucket_metadata_is_refused(
            entries in proptest::collection::vec(entry(), 0..6),
            at in any::<usize>(),
            flip in 1..=255u8,
        ) {
            let meta = meta_of(&entries, 4096);
            let at = at % meta.len();
            let mut damaged = meta.clone();
            damaged[at] ^= flip;
            prop_assert_eq!(decode(&damaged), None, "a flipped byte");
            prop_assert_eq!(decode(&meta[..at]), None, "a torn file");
            // Damage written with a fresh checksum (a bug, not the disk): refused or
            // read as entries, never a panic.
            decode(&sealed(damaged[..damaged.len() - 4].to_vec()));
        }
    }
}

#[test]
fn a_batch_read_several_at_a_time_answers_each_record_on_its_own() {
    let dir = TempDir::new("batch-read");
    let (mut store, _) = open(&dir, 1 << 30, EvictionPolicy::Fifo);
    // 8 values of 256 KiB: 2 MiB in all, read by several threads.
    let len = 256 << 10;
    let names: Vec<String> = (0..8).map(|i| format!("big-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..8).map(|i| value(i, len)).collect();
    let objects: Vec<(&str, &[u8])> = names
        .iter()
        .map(String::as_str)
        .zip(values.iter().map(Vec::as_slice))
        .collect();
    let id = store.write_bucket(&objects).expect("write");
    // One byte of the sixth value flipped on disk.
    let record = (crate::record::HEADER_LEN + "big-0".len() + len) as u64;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.0.join(format!("{id}.bucket")))
        .expect("open");
    let at = 5 * record + record - 7;
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).expect("read");
    file.write_all_at(&[byte[0] ^ 0x40], at).expect("write");

    let plans: Vec<ReadPlan> = names
        .iter()
        .map(|key| store.locate(key).expect("stored"))
        .collect();
    // In the order written: read by one thread, the kernel's read-ahead ahead of it,
    // checked by another (in hand-offs of 4 records; 6 records make fewer than two,
    // checked by the reader). In the reverse order: several readers. Under
    // `PARALLEL_BYTES`: the caller alone.
    use crate::parallel_reads::{READERS, Schedule, schedule_for};
    let in_order: Vec<usize> = (0..8).collect();
    let reversed: Vec<usize> = (0..8).rev().collect();
    let few: Vec<usize> = vec![6, 5, 3];
    for (order, expected) in [
        (in_order, Schedule::Pipelined { per_handoff: 4 }),
        ((0..6).collect(), Schedule::InTurn),
        (reversed, Schedule::Parallel(READERS)),
        (few, Schedule::InTurn),
    ] {
        let ordered: Vec<ReadPlan> = order.iter().map(|i| plans[*i].clone()).collect();
        assert_eq!(schedule_for(&ordered.iter().collect::<Vec<_>>()), expected);
        let mut dests = vec![0u8; order.len() * len];
        let read = crate::parallel_reads::read_plans(&ordered, dests.chunks_mut(len).collect());
        for ((i, outcome), dest) in order.iter().zip(read).zip(dests.chunks(len)) {
            if *i == 5 {
                assert!(
                    matches!(outcome, Err(StoreError::Corrupt(_))),
                    "{outcome:?}"
                );
            } else {
                assert!(
                    matches!(outcome, Ok(n) if n == len as u64),
                    "item {i}: {outcome:?}"
                );
                assert_eq!(dest, values[*i].as_slice(), "item {i}");
            }
        }
    }
    // Too few destinations: the plans left over are refused, not read.
    let mut one = vec![0u8; len];
    let read = crate::parallel_reads::read_plans(&plans[..2], vec![&mut one[..]]);
    assert!(matches!(read[0], Ok(n) if n == len as u64), "{:?}", read[0]);
    assert!(matches!(read[1], Err(StoreError::Invalid(_))));
}
