//! Keys and the buffers their values live in, moved through a store client and, for
//! reference, through plain memcpy of the same bytes in the same round.
//!
//! A [`Workload`] lists, per key, the parts of its value as (offset, length) in one
//! registered region, and the calls that move them: `put_from`/`get_into`, their batch
//! forms, or the multi-buffer forms engines use. The store copies each value between the
//! region and its segment; the reference copies the same parts between a heap region and
//! consecutive slots of a heap buffer standing for the segment, so every figure has a
//! memcpy of the same bytes, in the same pattern, measured in the same round.

use std::time::{Duration, Instant};

use mooncake_dummy_client::{CodeResult, DummyClient, ErrorCode, ReplicateConfig};

/// Which client calls move a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `put_from` / `get_into`, one key per call (one part per key).
    Single,
    /// `batch_put_from` / `batch_get_into` (one part per key).
    Batch,
    /// `batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`.
    MultiBuffers,
}

impl Form {
    fn names(self) -> (&'static str, &'static str) {
        match self {
            Form::Single => ("put_from", "get_into"),
            Form::Batch => ("batch_put_from", "batch_get_into"),
            Form::MultiBuffers => (
                "batch_put_from_multi_buffers",
                "batch_get_into_multi_buffers",
            ),
        }
    }
}

/// What one measurement moves, and with which calls.
pub struct Workload {
    /// Key prefix, unique per workload.
    pub tag: String,
    /// Shape shown after the call's name (`1 MiB`, `32 × 4 KiB`, ...).
    pub what: String,
    /// Calls that move it.
    pub form: Form,
    /// Per key: the parts of its value as (offset in the region, length).
    pub parts: Vec<Vec<(u64, u64)>>,
    /// Keys per call.
    pub batch: usize,
}

impl Workload {
    /// Bytes moved in one direction.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().flatten().map(|&(_, len)| len).sum()
    }
}

/// `4 KiB`, `1 MiB`: sizes as the tables print them.
pub fn size_label(size: u64) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

/// Median of `values` (sorted in place); 0 for none.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

#[expect(clippy::cast_precision_loss, reason = "throughput figures")]
fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64().max(1e-9) / 1e9
}

fn p50_us(mut samples: Vec<Duration>) -> f64 {
    samples.sort();
    samples
        .get(samples.len() / 2)
        .map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// One direction of one workload in one round.
struct Pass {
    elapsed: Duration,
    per_call: Vec<Duration>,
    failed: usize,
    first_error: Option<ErrorCode>,
}

impl Pass {
    fn new(calls: usize) -> Self {
        Pass {
            elapsed: Duration::ZERO,
            per_call: Vec::with_capacity(calls),
            failed: 0,
            first_error: None,
        }
    }

    fn count<T>(&mut self, results: &[CodeResult<T>]) {
        for result in results {
            if let Err(code) = result {
                self.failed += 1;
                self.first_error.get_or_insert(*code);
            }
        }
    }
}

/// Absolute addresses and lengths of each key's parts.
struct Addresses {
    keys: Vec<String>,
    ptrs: Vec<Vec<u64>>,
    sizes: Vec<Vec<u64>>,
}

impl Addresses {
    fn new(workload: &Workload, base: u64, round: usize) -> Self {
        let keys = (0..workload.parts.len())
            .map(|i| format!("{}-{round}-{i}", workload.tag))
            .collect();
        let ptrs = workload
            .parts
            .iter()
            .map(|parts| parts.iter().map(|&(offset, _)| base + offset).collect())
            .collect();
        let sizes = workload
            .parts
            .iter()
            .map(|parts| parts.iter().map(|&(_, len)| len).collect())
            .collect();
        Addresses { keys, ptrs, sizes }
    }

    /// Index ranges of the calls, `batch` keys each.
    fn calls(&self, batch: usize) -> Vec<std::ops::Range<usize>> {
        let total = self.keys.len();
        let batch = batch.max(1);
        (0..total)
            .step_by(batch)
            .map(|start| start..(start + batch).min(total))
            .collect()
    }
}

/// The first part of each key (the single-buffer forms).
fn firsts(lists: &[Vec<u64>]) -> Vec<u64> {
    lists
        .iter()
        .map(|list| list.first().copied().unwrap_or(0))
        .collect()
}

fn put_call(
    client: &DummyClient,
    form: Form,
    a: &Addresses,
    range: std::ops::Range<usize>,
    config: &ReplicateConfig,
) -> Vec<CodeResult<()>> {
    let (keys, ptrs, sizes) = (
        &a.keys[range.clone()],
        &a.ptrs[range.clone()],
        &a.sizes[range],
    );
    match form {
        Form::Single => {
            let (p, s) = (firsts(ptrs), firsts(sizes));
            keys.iter()
                .zip(p.iter().zip(&s))
                // SAFETY: the ranges are this client's pool memory or buffers registered with it,
                // alive for the call and touched by nothing else meanwhile (or deliberately
                // outside them, which the client refuses without touching).
                .map(|(key, (&ptr, &size))| unsafe { client.put_from(key, ptr, size, config) })
                .collect()
        }
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        Form::Batch => unsafe {
            client.batch_put_from(keys, &firsts(ptrs), &firsts(sizes), config)
        },
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        Form::MultiBuffers => unsafe {
            client.batch_put_from_multi_buffers(keys, ptrs, sizes, config)
        },
    }
}

fn get_call(
    client: &DummyClient,
    form: Form,
    a: &Addresses,
    range: std::ops::Range<usize>,
) -> Vec<CodeResult<u64>> {
    let (keys, ptrs, sizes) = (
        &a.keys[range.clone()],
        &a.ptrs[range.clone()],
        &a.sizes[range],
    );
    match form {
        Form::Single => {
            let (p, s) = (firsts(ptrs), firsts(sizes));
            keys.iter()
                .zip(p.iter().zip(&s))
                // SAFETY: the ranges are this client's pool memory or buffers registered with it,
                // alive for the call and touched by nothing else meanwhile (or deliberately
                // outside them, which the client refuses without touching).
                .map(|(key, (&ptr, &size))| unsafe { client.get_into(key, ptr, size) })
                .collect()
        }
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        Form::Batch => unsafe { client.batch_get_into(keys, &firsts(ptrs), &firsts(sizes)) },
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        Form::MultiBuffers => unsafe {
            client.batch_get_into_multi_buffers(keys, ptrs, sizes, false)
        },
    }
}

/// Stores every key of the workload (`put` true) or reads every key back.
fn store_pass(
    client: &DummyClient,
    workload: &Workload,
    a: &Addresses,
    put: bool,
    config: &ReplicateConfig,
) -> Pass {
    let mut pass = Pass::new(a.keys.len().div_ceil(workload.batch.max(1)));
    let started = Instant::now();
    for range in a.calls(workload.batch) {
        let t = Instant::now();
        if put {
            let results = put_call(client, workload.form, a, range, config);
            pass.per_call.push(t.elapsed());
            pass.count(&results);
        } else {
            let results = get_call(client, workload.form, a, range);
            pass.per_call.push(t.elapsed());
            pass.count(&results);
        }
    }
    pass.elapsed = started.elapsed();
    pass
}

fn to_usize(value: u64) -> Result<usize, String> {
    usize::try_from(value).map_err(|_| format!("{value} does not fit in usize"))
}

/// memcpy of the workload's parts between `region` and consecutive slots of `segment`
/// (`into_segment`: the direction of a put). Both sides go through `black_box`, so the
/// compiler can neither see their contents nor drop the copies.
fn memcpy_pass(
    region: &mut [u8],
    segment: &mut [u8],
    workload: &Workload,
    into_segment: bool,
) -> Result<Duration, String> {
    let region = std::hint::black_box(region);
    let started = Instant::now();
    let mut cursor = 0usize;
    for &(offset, len) in workload.parts.iter().flatten() {
        let (offset, len) = (to_usize(offset)?, to_usize(len)?);
        let (Some(r), Some(s)) = (
            region.get_mut(offset..offset + len),
            segment.get_mut(cursor..cursor + len),
        ) else {
            return Err(format!(
                "{}: a part lies outside the reference buffers",
                workload.tag
            ));
        };
        if into_segment {
            s.copy_from_slice(r);
        } else {
            r.copy_from_slice(s);
        }
        cursor += len;
    }
    std::hint::black_box(&mut *segment);
    Ok(started.elapsed())
}

const PAGE: usize = 4096;

/// Heap memory that starts at a page boundary, as a segment or a mapped pool does (a
/// large `Vec` starts 16 bytes past one). The offset matters: glibc's memmove copies
/// 64-256 KiB blocks 2-3× slower when the destination lies a few bytes after the
/// source modulo 4096 (4K aliasing), so the reference must keep the real layout.
pub struct PageAligned {
    bytes: Vec<u8>,
    start: usize,
    len: usize,
}

impl PageAligned {
    /// `len` bytes, every page touched.
    pub fn new(len: u64) -> Result<Self, String> {
        let len = to_usize(len)?;
        let bytes = vec![0x5au8; len + PAGE];
        let start = bytes.as_ptr().align_offset(PAGE);
        Ok(PageAligned { bytes, start, len })
    }

    /// The aligned bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.bytes[self.start..self.start + self.len]
    }
}

/// Heap buffers for the memcpy reference.
pub struct Reference<'a> {
    /// Region with the workload's layout and the registered buffer's page offset: the
    /// registered buffer itself when it is ordinary memory, heap memory otherwise.
    pub region: &'a mut [u8],
    /// Stands for the segment (page-aligned, as the segment is): at least the bytes
    /// of the largest workload.
    pub segment: PageAligned,
}

/// One row of a table: a call's figures and memcpy's, per round.
#[derive(Default)]
struct Row {
    label: String,
    gbps: Vec<f64>,
    p50_us: Vec<f64>,
    memcpy: Vec<f64>,
    failed: usize,
    first_error: Option<ErrorCode>,
}

impl Row {
    fn add(&mut self, bytes: u64, pass: Pass, memcpy: Duration) {
        self.gbps.push(gbps(bytes, pass.elapsed));
        self.memcpy.push(gbps(bytes, memcpy));
        self.p50_us.push(p50_us(pass.per_call));
        self.failed += pass.failed;
        if self.first_error.is_none() {
            self.first_error = pass.first_error;
        }
    }

    /// A row where keys failed shows the failures instead of a throughput: the bytes
    /// of failed keys were not moved.
    fn print(&mut self) {
        let (call, memcpy) = (median(&mut self.gbps), median(&mut self.memcpy));
        let p50 = median(&mut self.p50_us);
        let label = &self.label;
        match self.first_error {
            Some(code) if self.failed > 0 => println!(
                "| {label}: {} keys failed, first: {code} | – | {p50:.1} | {memcpy:.2} | – |",
                self.failed
            ),
            _ => println!(
                "| {label} | {call:.2} | {p50:.1} | {memcpy:.2} | {:.0}% |",
                call / memcpy.max(1e-9) * 100.0
            ),
        }
    }
}

/// The rows of a section: two per workload (put, get).
pub struct Table {
    rows: Vec<Row>,
}

impl Table {
    /// Prints the rows as a markdown table.
    pub fn print(&mut self) {
        println!(
            "\n| measure | GB/s | p50 per call (µs) | memcpy of the same bytes (GB/s) | vs memcpy |"
        );
        println!("|---|---:|---:|---:|---:|");
        for row in &mut self.rows {
            row.print();
        }
    }
}

/// How long a read's lease keeps removed objects' space (the clients run with a 1 s
/// lease), plus a margin: waited after each round so the next round finds it free.
pub const LEASE_WAIT: Duration = Duration::from_millis(1100);

/// Runs every workload once per round, one warm-up round and `repeats` counted ones,
/// with `region_base` the address of the registered region the parts are offsets into.
/// After each round every object is removed and the lease allowed to lapse.
pub fn measure(
    client: &DummyClient,
    region_base: u64,
    reference: &mut Reference<'_>,
    workloads: &[Workload],
    repeats: usize,
) -> Result<Table, String> {
    let config = ReplicateConfig {
        preferred_segment: client.get_hostname(),
        ..ReplicateConfig::default()
    };
    let mut rows: Vec<Row> = workloads
        .iter()
        .flat_map(|w| {
            let (put, get) = w.form.names();
            [put, get].map(|name| Row {
                label: format!("{name} {}", w.what),
                ..Row::default()
            })
        })
        .collect();
    for round in 0..=repeats {
        for (index, workload) in workloads.iter().enumerate() {
            let a = Addresses::new(workload, region_base, round);
            let copy_in = memcpy_pass(
                reference.region,
                reference.segment.as_mut_slice(),
                workload,
                true,
            )?;
            let put = store_pass(client, workload, &a, true, &config);
            let copy_out = memcpy_pass(
                reference.region,
                reference.segment.as_mut_slice(),
                workload,
                false,
            )?;
            let get = store_pass(client, workload, &a, false, &config);
            if round > 0 {
                rows[index * 2].add(workload.bytes(), put, copy_in);
                rows[index * 2 + 1].add(workload.bytes(), get, copy_out);
            }
        }
        client
            .remove_all(true)
            .map_err(|c| format!("remove_all: {c}"))?;
        std::thread::sleep(LEASE_WAIT);
    }
    Ok(Table { rows })
}
