//! `kill -9` of a process in the middle of writing batches, for every local-disk
//! backend and both I/O engines: the store reopened afterwards holds only whole
//! records, each holding the value written for its key, and every batch the writer
//! had committed before the kill.
//!
//! The writer is this test binary again, started with [`WRITER`] set: it writes
//! batches of 48 objects (sizes from 4 KiB to 1 MiB) until it is killed, printing the
//! number of each batch once it is committed.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_offload::backend::{Limits, StorageBackend};
use mooncake_offload::config::{BackendKind, EvictionPolicy, OffloadConfig};
use mooncake_offload::factory::open_backend;
use mooncake_offload::io::IoEngine;

/// Set in the writer process: `<backend>,<uring>,<directory>,<round>`.
const WRITER: &str = "MOONCAKE_KILLED_WRITER";

/// Objects per batch.
const BATCH: usize = 48;

/// Batches the writer writes at most (the limit holds them all: nothing is evicted).
const MOST_BATCHES: usize = 60;

/// Byte limit of the store.
const LIMIT: u64 = 2 << 30;

const CASES: [(BackendKind, &str, bool); 5] = [
    (BackendKind::Bucket, "bucket", false),
    (BackendKind::Bucket, "bucket", true),
    (BackendKind::FilePerKey, "file_per_key", false),
    (BackendKind::OffsetAllocator, "offset_allocator", false),
    (BackendKind::OffsetAllocator, "offset_allocator", true),
];

fn kind_named(name: &str) -> BackendKind {
    CASES
        .iter()
        .find(|(_, n, _)| *n == name)
        .map(|(kind, _, _)| *kind)
        .expect("a backend of CASES")
}

fn open(dir: &Path, kind: BackendKind, uring: bool) -> Box<dyn StorageBackend> {
    let mut config = OffloadConfig::from_lookup(&|_| None).expect("defaults");
    config.backend = kind;
    config.path = dir.to_path_buf();
    config.eviction_policy = EvictionPolicy::Fifo;
    let io = Arc::new(IoEngine::new(uring));
    open_backend(&config, Limits::bytes(LIMIT), io)
        .expect("open")
        .0
}

/// Object `i` of batch `batch` of round `round`: its key and value length.
fn object(round: usize, batch: usize, i: usize) -> (String, usize) {
    let len = [4 << 10, 60_000, 256 << 10, 1 << 20][(batch + i) % 4] + i;
    (format!("r{round}-b{batch}-{i}"), len)
}

/// The value written for `key`: its bytes derive from the key.
fn value_of(key: &str, len: usize) -> Vec<u8> {
    let seed = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    });
    (0..len)
        .map(|i| {
            (seed.rotate_left(u32::from((i % 64).to_le_bytes()[0])) ^ (i as u64 / 64)).to_le_bytes()
                [i % 8]
        })
        .collect()
}

/// The writer: batches until killed (or [`MOST_BATCHES`]).
fn write_until_killed(spec: &str) {
    let fields: Vec<&str> = spec.split(',').collect();
    let [name, uring, dir, round] = fields[..] else {
        panic!("bad {WRITER}: {spec}");
    };
    let round: usize = round.parse().expect("round");
    let mut store = open(Path::new(dir), kind_named(name), uring == "true");
    for batch in 0..MOST_BATCHES {
        let keys: Vec<(String, Vec<u8>)> = (0..BATCH)
            .map(|i| {
                let (key, len) = object(round, batch, i);
                let value = value_of(&key, len);
                (key, value)
            })
            .collect();
        let objects: Vec<(&str, &[u8])> = keys
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        let eviction = store.make_room(&objects).expect("room");
        store.finish_eviction(eviction);
        store.write_batch(&objects).expect("write");
        println!("committed {batch}");
    }
    // Killed before this, or the parent sees the end of the output.
    std::thread::sleep(Duration::from_secs(60));
}

/// A pseudo-random delay up to `most`, different in every run.
fn random_delay(most: Duration, salt: usize) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mixed = u64::from(nanos).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ salt as u64;
    most.mul_f64((mixed % 1000) as f64 / 1000.0)
}

/// Starts a writer, kills it (`kill -9`) a random moment after its first commit, and
/// returns the batches it reported committed.
fn kill_a_writer(dir: &Path, name: &str, uring: bool, round: usize) -> Vec<usize> {
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "--exact",
            "a_writer_killed_mid_batch_leaves_whole_records_and_every_committed_batch",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WRITER, format!("{name},{uring},{},{round}", dir.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the writer");
    let stdout = child.stdout.take().expect("piped");
    let (lines, committed) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(batch) = line.strip_prefix("committed ") {
                let _ = lines.send(batch.parse::<usize>().expect("a batch number"));
            }
        }
    });
    let first = committed
        .recv_timeout(Duration::from_secs(60))
        .expect("the writer commits a batch");
    std::thread::sleep(random_delay(Duration::from_millis(400), round));
    let _ = child.kill();
    let _ = child.wait();
    let started = Instant::now();
    let mut batches = vec![first];
    while let Ok(batch) = committed.recv_timeout(Duration::from_millis(200)) {
        batches.push(batch);
        assert!(started.elapsed() < Duration::from_secs(10), "output ends");
    }
    batches
}

#[test]
fn a_writer_killed_mid_batch_leaves_whole_records_and_every_committed_batch() {
    if let Ok(spec) = std::env::var(WRITER) {
        write_until_killed(&spec);
        return;
    }
    for (kind, name, uring) in CASES {
        let dir: PathBuf = std::env::temp_dir().join(format!(
            "mooncake-killed-writer-{name}-{uring}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        let mut committed_before = 0;
        for round in 0..3 {
            let committed = kill_a_writer(&dir, name, uring, round);
            let mut store = open(&dir, kind, uring);
            // Every object found is whole and holds the value written for its key.
            let objects: std::collections::HashMap<String, u64> =
                store.objects().into_iter().collect();
            let mut found = 0;
            for (key, len) in &objects {
                let mut dest = vec![0u8; usize::try_from(*len).expect("length")];
                store
                    .read_into(key, &mut dest)
                    .unwrap_or_else(|e| panic!("{name} uring={uring}: {key}: {e}"));
                assert!(
                    dest == value_of(key, dest.len()),
                    "{name} uring={uring}: {key} holds other bytes"
                );
                found += 1;
            }
            // Every committed batch is there, whole.
            for batch in &committed {
                for i in 0..BATCH {
                    let (key, len) = object(round, *batch, i);
                    assert_eq!(
                        objects.get(&key),
                        Some(&(len as u64)),
                        "{name} uring={uring}: {key} of committed batch {batch} lost"
                    );
                }
            }
            assert!(found >= committed_before + committed.len() * BATCH);
            committed_before = found;
            drop(store);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
