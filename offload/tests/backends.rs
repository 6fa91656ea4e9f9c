//! One suite, every local-disk backend: round trips, recovery after a reopen, damaged
//! files found at recovery, limits and eviction order, removal, and reads racing an
//! eviction. Writes and reads run with both I/O engines (POSIX, and io_uring).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mooncake_offload::backend::{Limits, StorageBackend, StoreError};
use mooncake_offload::config::{BackendKind, EvictionPolicy, OffloadConfig};
use mooncake_offload::factory::open_backend;
use mooncake_offload::io::IoEngine;

const BACKENDS: [BackendKind; 3] = [
    BackendKind::Bucket,
    BackendKind::FilePerKey,
    BackendKind::OffsetAllocator,
];

/// A fresh directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str, kind: BackendKind) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "mooncake-backends-{name}-{kind:?}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A value whose bytes identify it (seed in every 8-byte word).
fn value(seed: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            let word = (u64::from(seed) << 32) | (i as u64 / 8);
            word.to_le_bytes()[i % 8]
        })
        .collect()
}

struct Opened {
    store: Box<dyn StorageBackend>,
    report: mooncake_offload::backend::RecoveryReport,
}

fn open_with(
    dir: &TempDir,
    kind: BackendKind,
    limits: Limits,
    policy: EvictionPolicy,
    uring: bool,
) -> Opened {
    let mut config = OffloadConfig::from_lookup(&|_| None).expect("defaults");
    config.backend = kind;
    config.path = dir.0.clone();
    config.eviction_policy = policy;
    let io = Arc::new(IoEngine::new(uring));
    let (store, report) = open_backend(&config, limits, io).expect("open");
    Opened { store, report }
}

/// Byte limit of most tests (the one-file backend's data file is this large, sparse).
const LIMIT: u64 = 32 << 20;

fn open(dir: &TempDir, kind: BackendKind) -> Opened {
    open_with(dir, kind, Limits::bytes(LIMIT), EvictionPolicy::Fifo, false)
}

/// Makes room for and writes `keys` with values of `len` bytes; returns evicted keys.
fn write(store: &mut dyn StorageBackend, keys: &[(&str, u32)], len: usize) -> Vec<String> {
    let values: Vec<Vec<u8>> = keys.iter().map(|(_, seed)| value(*seed, len)).collect();
    let objects: Vec<(&str, &[u8])> = keys
        .iter()
        .map(|(k, _)| *k)
        .zip(values.iter().map(Vec::as_slice))
        .collect();
    let eviction = store.make_room(&objects).expect("room");
    let evicted = eviction.keys.clone();
    store.finish_eviction(eviction);
    store.write_batch(&objects).expect("write");
    evicted
}

fn read(store: &mut dyn StorageBackend, key: &str) -> Result<Vec<u8>, StoreError> {
    let mut dest = vec![0u8; 1 << 20];
    let len = store.read_into(key, &mut dest)?;
    dest.truncate(usize::try_from(len).expect("small"));
    Ok(dest)
}

/// Every file under `dir` (recursively).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("list").flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// The file and offset holding `needle`.
fn find(dir: &Path, needle: &[u8]) -> (PathBuf, u64) {
    for path in files(dir) {
        let bytes = std::fs::read(&path).expect("read");
        if let Some(at) = bytes.windows(needle.len()).position(|w| w == needle) {
            return (path, at as u64);
        }
    }
    panic!("value not found on disk");
}

fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .expect("open");
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).expect("read");
    file.write_all_at(&[byte[0] ^ 0x10], at).expect("write");
}

#[test]
fn objects_survive_a_reopen_byte_exact() {
    for uring in [false, true] {
        for kind in BACKENDS {
            let dir = TempDir::new(&format!("reopen-{uring}"), kind);
            let policy = EvictionPolicy::Fifo;
            let limits = Limits::bytes(LIMIT);
            let mut opened = open_with(&dir, kind, limits, policy, uring);
            assert_eq!(opened.report.objects, 0, "{kind:?}");
            write(&mut *opened.store, &[("a", 1), ("b/with/slashes", 2)], 5000);
            write(&mut *opened.store, &[("c\u{1f}tenant", 3)], 70_000);
            let used = opened.store.used_bytes();
            drop(opened);
            let mut opened = open_with(&dir, kind, limits, policy, uring);
            assert_eq!(
                (opened.report.objects, opened.report.corrupt_records),
                (3, 0),
                "{kind:?}"
            );
            let store = &mut *opened.store;
            assert_eq!(store.used_bytes(), used, "{kind:?}");
            assert_eq!(read(store, "a").expect("a"), value(1, 5000));
            assert_eq!(read(store, "b/with/slashes").expect("b"), value(2, 5000));
            assert_eq!(read(store, "c\u{1f}tenant").expect("c"), value(3, 70_000));
            assert!(matches!(read(store, "zz"), Err(StoreError::NotFound)));
            let mut objects = store.objects();
            objects.sort();
            assert_eq!(objects[0], ("a".to_string(), 5000), "{kind:?}");
        }
    }
}

#[test]
fn a_bit_flip_and_a_truncation_are_found_at_recovery_and_the_rest_survives() {
    for kind in BACKENDS {
        let dir = TempDir::new("damage", kind);
        let mut opened = open(&dir, kind);
        for (seed, key) in (10..).zip(["k0", "k1", "k2", "k3"]) {
            write(&mut *opened.store, &[(key, seed)], 9000);
        }
        drop(opened);
        let (flipped, at) = find(&dir.0, &value(11, 9000)[..64]);
        flip_byte(&flipped, at + 4000);
        let (cut, at) = find(&dir.0, &value(13, 9000)[..64]);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&cut)
            .expect("open");
        if kind == BackendKind::OffsetAllocator {
            // One preallocated file: zero the record's tail instead (a torn write).
            use std::os::unix::fs::FileExt;
            file.write_all_at(&[0u8; 4000], at + 5000).expect("tear");
        } else {
            file.set_len(at + 5000).expect("truncate");
        }
        let mut opened = open(&dir, kind);
        assert_eq!(opened.report.corrupt_records, 2, "{kind:?}");
        let store = &mut *opened.store;
        assert_eq!(store.len(), 2, "{kind:?}");
        assert_eq!(read(store, "k0").expect("k0"), value(10, 9000));
        assert_eq!(read(store, "k2").expect("k2"), value(12, 9000));
        for gone in ["k1", "k3"] {
            assert!(
                matches!(read(store, gone), Err(StoreError::NotFound)),
                "{kind:?} {gone}"
            );
        }
    }
}

#[test]
fn a_bit_flipped_while_running_is_caught_at_read() {
    for (kind, uring) in BACKENDS.into_iter().flat_map(|k| [(k, false), (k, true)]) {
        let dir = TempDir::new(&format!("flip-live-{uring}"), kind);
        let limits = Limits::bytes(LIMIT);
        let mut opened = open_with(&dir, kind, limits, EvictionPolicy::Fifo, uring);
        let store = &mut *opened.store;
        write(store, &[("x", 7), ("y", 8)], 3000);
        let (path, at) = find(&dir.0, &value(7, 3000)[..64]);
        flip_byte(&path, at + 100);
        assert!(
            matches!(read(store, "x"), Err(StoreError::Corrupt(_))),
            "{kind:?}"
        );
        assert!(
            !store.contains("x"),
            "{kind:?}: dropped after the failed read"
        );
        assert_eq!(read(store, "y").expect("y"), value(8, 3000));
    }
}

#[test]
fn fifo_evicts_the_oldest_and_the_limits_hold() {
    for kind in BACKENDS {
        let dir = TempDir::new("fifo", kind);
        // Room for about four objects of 20 000 bytes in every backend.
        let limits = Limits::bytes(100_000);
        let mut opened = open_with(&dir, kind, limits, EvictionPolicy::Fifo, false);
        let store = &mut *opened.store;
        let mut evicted = Vec::new();
        for i in 0..8u32 {
            let key = format!("o{i}");
            evicted.extend(write(store, &[(&key, i)], 20_000));
            assert!(store.used_bytes() <= limits.bytes, "{kind:?}");
        }
        assert!(!evicted.is_empty(), "{kind:?}");
        let expected: Vec<String> = (0..evicted.len()).map(|i| format!("o{i}")).collect();
        assert_eq!(evicted, expected, "{kind:?}: oldest first");
        assert_eq!(read(store, "o7").expect("newest"), value(7, 20_000));
    }
}

#[test]
fn lru_evicts_the_least_recently_read() {
    for kind in BACKENDS {
        let dir = TempDir::new("lru", kind);
        let limits = Limits {
            bytes: LIMIT,
            keys: 3,
        };
        let mut opened = open_with(&dir, kind, limits, EvictionPolicy::Lru, false);
        let store = &mut *opened.store;
        for (seed, key) in (0..).zip(["a", "b", "c"]) {
            write(store, &[(key, seed)], 1000);
        }
        read(store, "a").expect("a");
        read(store, "c").expect("c");
        read(store, "b").expect("b");
        read(store, "a").expect("a again");
        // c is now the least recently read.
        let evicted = write(store, &[("d", 9)], 1000);
        assert_eq!(evicted, ["c"], "{kind:?}");
        assert_eq!(store.len(), 3, "{kind:?}: the key limit holds");
    }
}

#[test]
fn the_key_limit_holds_and_policy_none_refuses() {
    for kind in BACKENDS {
        let dir = TempDir::new("keys", kind);
        let limits = Limits {
            bytes: LIMIT,
            keys: 2,
        };
        let mut opened = open_with(&dir, kind, limits, EvictionPolicy::None, false);
        let store = &mut *opened.store;
        write(store, &[("a", 1), ("b", 2)], 100);
        let v = value(3, 100);
        assert!(
            matches!(
                store.make_room(&[("c", &v)]),
                Err(StoreError::QuotaExceeded {
                    keys: 2,
                    keys_limit: 2,
                    ..
                })
            ),
            "{kind:?}"
        );
        assert!(
            matches!(
                store.write_batch(&[("c", &v)]),
                Err(StoreError::QuotaExceeded { .. })
            ),
            "{kind:?}"
        );
        assert!(
            matches!(
                store.write_batch(&[("a", &v)]),
                Err(StoreError::AlreadyExists(_))
            ),
            "{kind:?}"
        );
        assert!(store.remove("a"), "{kind:?}");
        write(store, &[("c", 3)], 100);
        assert_eq!(read(store, "c").expect("c"), v);
    }
}

#[test]
fn removal_deletes_the_bytes_and_survives_a_reopen() {
    for kind in BACKENDS {
        let dir = TempDir::new("remove", kind);
        let mut opened = open(&dir, kind);
        write(&mut *opened.store, &[("a", 1), ("b", 2), ("c", 3)], 4000);
        assert!(opened.store.remove("b"));
        assert!(!opened.store.remove("b"));
        drop(opened);
        let mut opened = open(&dir, kind);
        assert_eq!(opened.store.len(), 2, "{kind:?}");
        assert!(matches!(
            read(&mut *opened.store, "b"),
            Err(StoreError::NotFound)
        ));
        assert_eq!(opened.store.remove_all(), 2);
        assert_eq!(opened.store.used_bytes(), 0, "{kind:?}");
        drop(opened);
        let opened = open(&dir, kind);
        assert_eq!(opened.store.len(), 0, "{kind:?}: nothing comes back");
    }
}

#[test]
fn a_read_racing_an_eviction_gets_the_right_bytes_or_not_found() {
    for (kind, uring) in BACKENDS.into_iter().flat_map(|k| [(k, false), (k, true)]) {
        let dir = TempDir::new(&format!("race-{uring}"), kind);
        let limits = Limits {
            bytes: LIMIT,
            keys: 1,
        };
        let mut opened = open_with(&dir, kind, limits, EvictionPolicy::Fifo, uring);
        let store = &mut *opened.store;
        write(store, &[("old", 1)], 50_000);
        // A reader looked the key up; then the key is evicted, its bytes deleted and
        // new data written (where the one-file backend could reuse the space).
        let plan = store.locate("old").expect("locate");
        let evicted = write(store, &[("new", 2)], 50_000);
        assert_eq!(evicted, ["old"]);
        let mut dest = vec![0u8; 50_000];
        match plan.read_into(&mut dest) {
            Ok(_) => assert_eq!(dest, value(1, 50_000), "{kind:?}: never other bytes"),
            Err(StoreError::NotFound) => {}
            Err(other) => panic!("{kind:?}: {other}"),
        }
        drop(plan);
        write(store, &[("newer", 3)], 50_000);
        assert_eq!(read(store, "newer").expect("newer"), value(3, 50_000));
    }
}

#[test]
fn shrinking_to_a_watermark_evicts_the_oldest_and_none_keeps_everything() {
    for kind in BACKENDS {
        for policy in [EvictionPolicy::Fifo, EvictionPolicy::None] {
            let dir = TempDir::new(&format!("shrink-{policy:?}"), kind);
            let mut opened = open_with(&dir, kind, Limits::bytes(LIMIT), policy, false);
            let store = &mut *opened.store;
            for (seed, key) in (0..).zip(["s0", "s1", "s2", "s3", "s4", "s5"]) {
                write(store, &[(key, seed)], 20_000);
            }
            let full = store.used_bytes();
            let eviction = store.shrink_to(full / 2, u64::MAX);
            let evicted = eviction.keys.clone();
            store.finish_eviction(eviction);
            if policy == EvictionPolicy::None {
                assert!(evicted.is_empty(), "{kind:?}");
                assert_eq!(store.len(), 6, "{kind:?}");
                continue;
            }
            assert_eq!(evicted, ["s0", "s1", "s2"], "{kind:?}: oldest first");
            assert!(store.used_bytes() <= full / 2, "{kind:?}");
            let eviction = store.shrink_to(u64::MAX, 1);
            assert_eq!(eviction.keys, ["s3", "s4"], "{kind:?}: down to one key");
            store.finish_eviction(eviction);
            assert_eq!(read(store, "s5").expect("s5"), value(5, 20_000));
        }
    }
}

#[test]
fn a_prepared_batch_is_written_without_the_backend_and_a_failed_one_leaves_nothing() {
    for kind in BACKENDS {
        let dir = TempDir::new("phases", kind);
        let mut opened = open(&dir, kind);
        let store = &mut *opened.store;
        write(store, &[("old", 1)], 8000);
        let v = value(2, 8000);
        let mut batch = store.prepare_batch(&[("new", &v)]).expect("prepare");
        // Between the phases the backend serves reads; the new key is not visible yet.
        assert_eq!(read(store, "old").expect("old"), value(1, 8000));
        assert!(matches!(read(store, "new"), Err(StoreError::NotFound)));
        let other = value(9, 7999);
        assert!(
            matches!(batch.write(&[("new", &other)]), Err(StoreError::Invalid(_))),
            "a batch is written only with the objects it was prepared for"
        );
        let written = batch.write(&[("new", &v)]);
        store.commit_batch(batch, written).expect("commit");
        assert_eq!(read(store, "new").expect("new"), v);
        // A batch whose write failed is undone: nothing indexed, its space back.
        let used = store.used_bytes();
        let w = value(3, 8000);
        let batch = store.prepare_batch(&[("lost", &w)]).expect("prepare");
        let failed = Err(StoreError::Invalid("simulated write failure".into()));
        assert!(store.commit_batch(batch, failed).is_err());
        assert!(!store.contains("lost"), "{kind:?}");
        assert_eq!(store.used_bytes(), used, "{kind:?}");
        write(store, &[("lost", 3)], 8000);
        assert_eq!(read(store, "lost").expect("written again"), w);
        drop(opened);
        let opened = open(&dir, kind);
        assert_eq!(
            opened.store.len(),
            3,
            "{kind:?}: old, new and lost after a reopen"
        );
    }
}
