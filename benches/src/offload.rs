//! The SSD tier's storage backends next to the raw disk of this machine, in one run:
//! sequential write (with `fdatasync`) and reads (1 MiB and 64 KiB) of a plain file,
//! random 64 KiB reads,
//! and each backend writing and reading back 64 KiB and 1 MiB objects. Each backend
//! writes its objects [`WRITE_PASSES`] times into a fresh store, each write compared
//! with the faster of raw writes just before and just after it (this disk's speed
//! drifts by several times within minutes; medians of each), the filesystem flushed
//! before every write, untimed (blocks freed by the step before are discarded then,
//! not during the measurement); each backend reads its
//! objects back in batches, as a batched get does, [`READ_PASSES`] times, alternating
//! with raw reads into destinations as large as a batch (medians of each), and as
//! often through the page cache alone (no direct streams, no read-ahead hints: see
//! `mooncake_offload::batch_reader`), for comparison in the same run. Page-cache
//! copies are dropped (`posix_fadvise(DONTNEED)`) before every read pass, so reads come
//! from the device.

use std::fs::File;
use std::io::Write as _;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mooncake_offload::backend::{Limits, StorageBackend};
use mooncake_offload::config::{BackendKind, OffloadConfig};
use mooncake_offload::factory::open_backend;
use mooncake_offload::io::IoEngine;
use mooncake_offload::parallel_reads::{read_plans_as, schedule_for};

/// Bytes moved per measurement.
const TOTAL: usize = 512 << 20;

fn drop_cache(path: &Path) {
    if let Ok(file) = File::open(path) {
        let _ = file.sync_all();
        let _ = nix::fcntl::posix_fadvise(
            &file,
            0,
            0,
            nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
        );
    }
}

fn drop_dir_cache(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                drop_dir_cache(&path);
            } else {
                drop_cache(&path);
            }
        }
    }
}

/// `bytes` moved in `seconds`, in GB/s.
pub fn gbps(bytes: usize, seconds: f64) -> f64 {
    #[expect(clippy::cast_precision_loss, reason = "display")]
    let bytes = bytes as f64;
    bytes / seconds / 1e9
}

fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i.wrapping_mul(131) ^ seed).to_le_bytes()[0])
        .collect()
}

/// Flushes the filesystem holding `dir` (`syncfs`), outside any timing: blocks freed
/// by an earlier step are discarded then (the filesystem may be mounted with
/// `discard`) and its dirty pages written, rather than during the next measurement.
fn settle(dir: &Path) {
    if let Ok(handle) = File::open(dir) {
        let _ = IoEngine::new(false).sync_filesystem(&handle);
    }
}

/// Writes `TOTAL` bytes to a new file at `path` (the old one removed and the
/// filesystem settled first, untimed) in 1 MiB blocks, then `fdatasync`: GB/s.
fn raw_write(path: &Path) -> f64 {
    let block = pattern(1 << 20, 1);
    let _ = std::fs::remove_file(path);
    if let Some(dir) = path.parent() {
        settle(dir);
    }
    let started = Instant::now();
    let mut file = File::create(path).expect("create raw file");
    for _ in 0..TOTAL >> 20 {
        file.write_all(&block).expect("write");
    }
    file.sync_data().expect("sync");
    gbps(TOTAL, started.elapsed().as_secs_f64())
}

/// Objects of `size` bytes per batch, written or read (500, or fewer to stay within
/// 256 MiB).
fn per_batch(size: usize) -> usize {
    ((256usize << 20) / size).clamp(1, 500)
}

/// Memory that reads land in, starting at a page boundary as an engine's registered
/// buffers do, and touched beforehand (a fresh allocation would time the page faults
/// of its first use). The start matters: the kernel's copy out of the page cache ran
/// 2-3 times slower here into memory a few bytes past a page boundary (reading from
/// one) than into memory at the boundary.
struct Destinations {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl Destinations {
    /// `len` bytes, page-aligned.
    fn new(len: usize) -> Self {
        const PAGE: usize = 4096;
        let storage = vec![1u8; len + PAGE];
        let start = storage.as_ptr().align_offset(PAGE).min(PAGE);
        Destinations {
            storage,
            start,
            len,
        }
    }

    fn bytes(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

/// Reads `path` (cold) in `block`-byte reads from start to end, each into the next
/// block of [`Destinations`] as large as a batch of `block`-byte objects, as a batched
/// get spreads its objects over the engine's buffers; GB/s. (Read into one reused
/// block, the copies out of the page cache stay in the CPU's cache and run about 1.6
/// times faster than into memory a get fills.)
fn sequential_read(path: &Path, block: usize) -> f64 {
    drop_cache(path);
    let file = File::open(path).expect("open");
    let blocks = per_batch(block);
    let mut destinations = Destinations::new(blocks * block);
    let dests = destinations.bytes_mut();
    let started = Instant::now();
    for i in 0..TOTAL / block {
        let at = i % blocks * block;
        file.read_exact_at(&mut dests[at..at + block], (i * block) as u64)
            .expect("read");
    }
    gbps(TOTAL, started.elapsed().as_secs_f64())
}

/// Reads 2048 blocks of 64 KiB of `path` (cold) at random offsets; GB/s.
fn random_read(path: &Path) -> f64 {
    drop_cache(path);
    let file = File::open(path).expect("open");
    let mut small = vec![0u8; 64 << 10];
    let reads = 2048usize;
    let mut offset = 0x9e37_79b9u64;
    let started = Instant::now();
    for _ in 0..reads {
        offset = offset
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        let at = (offset >> 20) % (TOTAL as u64 / (64 << 10)) * (64 << 10);
        file.read_exact_at(&mut small, at).expect("read");
    }
    gbps(reads * (64 << 10), started.elapsed().as_secs_f64())
}

/// Read passes per backend and object size, alternating with raw reads.
const READ_PASSES: usize = 5;

/// One backend's figures and the raw figures measured around them, in GB/s.
struct Paired {
    /// The median over the write passes of the faster of the raw writes just before
    /// and just after the backend's write.
    raw_write: f64,
    /// The median of the backend's write passes.
    write: f64,
    /// The median of the raw reads (in blocks of the objects' size) alternating with
    /// the backend's read passes.
    raw_read: f64,
    /// The median of the backend's passes reading every object back.
    read: f64,
    /// The same through the page cache alone, passes alternating with the others.
    read_unaided: f64,
}

/// Backend writes per backend and object size, each between raw writes.
const WRITE_PASSES: usize = 3;

/// Writes `TOTAL` bytes of `size`-byte objects through backend `kind` into a fresh
/// store [`WRITE_PASSES`] times, each between two raw writes of the file `raw` (the
/// pass's reference is the faster of the two, taken moments apart on a disk whose
/// speed drifts; the write figures are the medians), the filesystem settled before
/// each. Then reads the last store's objects back (cold, checking every value)
/// [`READ_PASSES`] times through the tier's batch reader and through the page cache
/// alone, and `raw` before each
/// pair, after one read that is not counted (so that every read, raw or not, follows
/// a read): the read figures are the medians of each series.
fn store(dir: &Path, raw: &Path, kind: BackendKind, size: usize, uring: bool) -> Paired {
    let store_dir = dir.join(format!("store-{size}"));
    let io = std::sync::Arc::new(IoEngine::new(uring));
    let mut config = OffloadConfig::from_lookup(&|_| None).expect("default settings");
    config.backend = kind;
    config.path.clone_from(&store_dir);
    let limits = Limits::bytes(2 * TOTAL as u64);
    let mut writes = Vec::new();
    let mut raw_writes = Vec::new();
    let mut raw_before = raw_write(raw);
    let mut written = None;
    for _ in 0..WRITE_PASSES {
        drop(written.take());
        let _ = std::fs::remove_dir_all(&store_dir);
        std::fs::create_dir_all(&store_dir).expect("mkdir");
        let (mut store, _) =
            open_backend(&config, limits, std::sync::Arc::clone(&io)).expect("open store");
        settle(dir);
        let (write, objects) = write_objects(store.as_mut(), size, TOTAL).expect("write");
        let raw_after = raw_write(raw);
        writes.push(write);
        raw_writes.push(raw_before.max(raw_after));
        raw_before = raw_after;
        written = Some((store, objects));
    }
    let (mut store, objects) = written.expect("at least one write pass");
    sequential_read(raw, size);
    let mut raw_reads = Vec::new();
    let mut reads = Vec::new();
    let mut reads_unaided = Vec::new();
    for pass in 0..READ_PASSES {
        raw_reads.push(sequential_read(raw, size));
        // Aided and unaided reads take turns going first: this disk drifts
        // within seconds.
        for aided in [pass % 2 == 0, pass % 2 == 1] {
            drop_dir_cache(&store_dir);
            let read = read_objects(store.as_mut(), &objects, aided).expect("read back");
            if aided {
                &mut reads
            } else {
                &mut reads_unaided
            }
            .push(read);
        }
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&store_dir);
    Paired {
        raw_write: median(raw_writes),
        write: median(writes),
        raw_read: median(raw_reads),
        read: median(reads),
        read_unaided: median(reads_unaided),
    }
}

/// What [`write_objects`] wrote: the keys, and the values they hold in turn.
pub struct Written {
    keys: Vec<String>,
    values: Vec<Vec<u8>>,
    size: usize,
}

impl Written {
    /// Objects per batch, written or read (500, or fewer to stay within 256 MiB).
    fn per_batch(&self) -> usize {
        self.values.len()
    }
}

/// Writes `total` bytes of `size`-byte objects through `store` in batches as the
/// offload loop does (500 objects or 256 MiB each): (write GB/s, what was written).
pub fn write_objects(
    store: &mut dyn StorageBackend,
    size: usize,
    total: usize,
) -> Result<(f64, Written), String> {
    let count = total / size;
    let per_batch = per_batch(size);
    let keys: Vec<String> = (0..count).map(|i| format!("bench-{size}-{i}")).collect();
    let values: Vec<Vec<u8>> = (0..per_batch).map(|i| pattern(size, i)).collect();
    let started = Instant::now();
    for chunk in keys.chunks(per_batch) {
        let objects: Vec<(&str, &[u8])> = chunk
            .iter()
            .zip(&values)
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        store.write_batch(&objects).map_err(|e| e.to_string())?;
    }
    let write = gbps(count * size, started.elapsed().as_secs_f64());
    Ok((write, Written { keys, values, size }))
}

/// Reads every object `written` back in batches of the size it was written in, as a
/// batched get does (located, then read several at a time on the threads
/// [`schedule_for`] gives, through the tier's batch reader unless `aided` is false),
/// checking each (the check is not timed): GB/s.
pub fn read_objects(
    store: &mut dyn StorageBackend,
    written: &Written,
    aided: bool,
) -> Result<f64, String> {
    let size = written.size;
    let mut dests = Destinations::new(written.per_batch() * size);
    let mut reading = std::time::Duration::ZERO;
    for chunk in written.keys.chunks(written.per_batch()) {
        let started = Instant::now();
        let plans = chunk
            .iter()
            .map(|key| store.locate(key))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let schedule = schedule_for(&plans.iter().collect::<Vec<_>>());
        let read = read_plans_as(
            &plans,
            dests.bytes_mut().chunks_mut(size).collect(),
            schedule,
            aided,
        );
        reading += started.elapsed();
        for ((key, outcome), (dest, value)) in chunk
            .iter()
            .zip(read)
            .zip(dests.bytes().chunks(size).zip(&written.values))
        {
            outcome.map_err(|e| format!("{key}: {e}"))?;
            if dest != value.as_slice() {
                return Err(format!("{key}: wrong bytes read back"));
            }
        }
    }
    Ok(gbps(written.keys.len() * size, reading.as_secs_f64()))
}

/// Where disk measurements happen: `MOONCAKE_BENCH_DIR`, else the system's temporary
/// directory.
pub fn scratch_dir() -> PathBuf {
    std::env::var_os("MOONCAKE_BENCH_DIR").map_or_else(std::env::temp_dir, PathBuf::from)
}

/// This run's directory under [`scratch_dir`].
fn bench_dir() -> PathBuf {
    let base = scratch_dir();
    let dir = base.join(format!("mooncake-bench-offload-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the benchmark directory");
    dir
}

/// The median of `values` (not empty).
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One row of the section: a figure per round, and the raw reference of each round.
struct Row {
    name: String,
    values: Vec<f64>,
    raw: Vec<f64>,
}

impl Row {
    fn new(name: String) -> Self {
        Row {
            name,
            values: Vec::new(),
            raw: Vec::new(),
        }
    }

    /// The median figure and the median of its ratios to the raw reference of the
    /// same round.
    fn medians(&self) -> (f64, Option<f64>) {
        let ratios: Vec<f64> = self
            .values
            .iter()
            .zip(&self.raw)
            .map(|(value, raw)| value / raw)
            .collect();
        (
            median(self.values.clone()),
            (!ratios.is_empty()).then(|| median(ratios)),
        )
    }
}

/// One backend measured by the section.
struct Case {
    kind: BackendKind,
    /// The name `--backends` selects it by.
    id: &'static str,
    /// The name printed.
    label: &'static str,
    uring: bool,
}

/// The backends measured.
const CASES: [Case; 5] = [
    Case {
        kind: BackendKind::Bucket,
        id: "bucket",
        label: "bucket",
        uring: false,
    },
    Case {
        kind: BackendKind::Bucket,
        id: "bucket_uring",
        label: "bucket, io_uring",
        uring: true,
    },
    Case {
        kind: BackendKind::FilePerKey,
        id: "file_per_key",
        label: "file_per_key",
        uring: false,
    },
    Case {
        kind: BackendKind::OffsetAllocator,
        id: "offset_allocator",
        label: "offset_allocator",
        uring: false,
    },
    Case {
        kind: BackendKind::OffsetAllocator,
        id: "offset_allocator_uring",
        label: "offset_allocator, io_uring",
        uring: true,
    },
];

/// The names `--backends` accepts.
pub const BACKEND_IDS: [&str; 5] = [
    CASES[0].id,
    CASES[1].id,
    CASES[2].id,
    CASES[3].id,
    CASES[4].id,
];

/// Runs the section `repeats` times and prints medians: each backend's write and read
/// next to raw writes and reads of the same disk measured around them (see [`store`]),
/// and its ratio to them (writes to the sequential write of 1 MiB blocks, reads to the
/// sequential read in blocks of the objects' size). `backends` names the cases to run
/// (see [`BACKEND_IDS`]); empty runs them all.
pub fn run(repeats: usize, backends: &[String]) {
    let cases: Vec<&Case> = CASES
        .iter()
        .filter(|case| backends.is_empty() || backends.iter().any(|id| id == case.id))
        .collect();
    let dir = bench_dir();
    let repeats = repeats.max(1);
    let mut raw_rows: Vec<Row> = [
        "raw file: sequential write 1 MiB + fdatasync",
        "raw file: sequential read 1 MiB (cold)",
        "raw file: sequential read 64 KiB (cold)",
        "raw file: random read 64 KiB (cold)",
    ]
    .into_iter()
    .map(|name| Row::new(name.to_string()))
    .collect();
    let mut rows: Vec<Row> = Vec::new();
    for case in &cases {
        let name = case.label;
        for size in ["64 KiB", "1 MiB"] {
            rows.push(Row::new(format!("{name}: write {size} objects")));
            rows.push(Row::new(format!(
                "{name}: read {size} objects (cold, checked)"
            )));
            rows.push(Row::new(format!(
                "{name}: read {size} objects, page cache alone"
            )));
        }
    }
    let raw_path = dir.join("raw.bin");
    for _ in 0..repeats {
        let mut row = rows.iter_mut();
        for case in &cases {
            for size in [64 << 10, 1 << 20] {
                let paired = store(&dir, &raw_path, case.kind, size, case.uring);
                raw_rows[0].values.push(paired.raw_write);
                raw_rows[if size < 1 << 20 { 2 } else { 1 }]
                    .values
                    .push(paired.raw_read);
                for (value, raw) in [
                    (paired.write, paired.raw_write),
                    (paired.read, paired.raw_read),
                    (paired.read_unaided, paired.raw_read),
                ] {
                    if let Some(row) = row.next() {
                        row.values.push(value);
                        row.raw.push(raw);
                    }
                }
            }
        }
        raw_rows[3].values.push(random_read(&raw_path));
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "\n## SSD tier ({} MiB per measurement, median of {repeats}, in {})\n\nEach backend writes its objects {WRITE_PASSES} times into a fresh store, each write compared with the faster of two raw sequential writes of 1 MiB blocks of the same disk, one just before and one just after it (medians; the filesystem flushed before every write, untimed); each backend's reads ({READ_PASSES} passes over its objects, median) with raw sequential reads in blocks of the objects' size alternating with them (median); the rows \"page cache alone\" read the same objects in passes alternating with those, each record through the page cache, without direct streams or read-ahead hints. The ratio is the median of the per-round ratios; the raw rows are medians of those references.\n\n| measurement | GB/s | of raw |\n|---|---|---|",
        TOTAL >> 20,
        dir.parent()
            .map_or_else(String::new, |p| p.display().to_string())
    );
    for row in raw_rows.iter().chain(&rows) {
        let (value, ratio) = row.medians();
        let ratio = ratio.map_or_else(String::new, |r| format!("{:.0} %", r * 100.0));
        println!("| {} | {value:.2} | {ratio} |", row.name);
    }
}
