//! `--sections embedded`: the real client and its master inside the benchmark process
//! (Python's `setup()` mode), moving data between an ordinary heap buffer registered
//! with `register_buffer` and the client's own segment.
//!
//! In embedded mode a registered buffer is lent to the in-process real client, which
//! copies straight between it and the segment: one memcpy per value. Each figure is
//! printed next to memcpy of the same bytes in the same pattern and round.

use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicateConfig};
use mooncake_real_client::RealClientConfig;

use crate::processes::free_port;
use crate::workload::{Form, PageAligned, Reference, Workload, measure, median, size_label};

/// The registered buffer: room for a batch of 32 values of 1 MiB.
const REGION: u64 = 32 << 20;

/// Keys per batch call, as engines send them.
const BATCH: u64 = 32;

/// Starts a real client in this process with its own embedded master (served to no
/// other process) and a `segment`-sized segment, configured the way Python's
/// `setup()` does it, and returns a client attached to it. Reads hold a 1 s lease, so
/// that space removed at the end of a round is free for the next one soon.
pub fn start(segment: &str) -> Result<DummyClient, String> {
    let port = free_port()?;
    let args = [
        "--embedded_master_port=0".to_string(),
        "--enable_http_server=false".into(),
        "--host=127.0.0.1".into(),
        format!("--port={port}"),
        format!("--global_segment_size={segment}"),
        "--master_server_address=embedded".into(),
        "--protocol=tcp".into(),
        "--default_kv_lease_ttl=1s".into(),
    ];
    let mut config =
        RealClientConfig::from_args(args).map_err(|e| format!("embedded real client: {e}"))?;
    config.socket = None;
    let client = DummyClient::setup_embedded(config, 16 << 20, 16 << 20)
        .map_err(|e| format!("embedded real client: {e}"))?;
    wait_for_prefault();
    Ok(client)
}

/// Name of the real client's thread that touches every page of a new segment.
const PREFAULT_THREAD: &str = "segment-prefault";

/// Waits (at most 60 s) until no thread of this process is prefaulting a segment: the
/// real client faults its segment in on a background thread, which would otherwise
/// take one of the cores during the first rounds.
fn wait_for_prefault() {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline && prefault_running() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn prefault_running() -> bool {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return false;
    };
    tasks.flatten().any(|task| {
        std::fs::read_to_string(task.path().join("comm"))
            .is_ok_and(|name| name.trim_end() == PREFAULT_THREAD)
    })
}

fn workloads() -> Vec<Workload> {
    let mut list = Vec::new();
    for size in [4u64 << 10, 1 << 20, 16 << 20] {
        let count = (64u64 << 20).div_ceil(size).clamp(16, 2000);
        list.push(Workload {
            tag: format!("emb-single-{size}"),
            what: size_label(size),
            form: Form::Single,
            parts: (0..count).map(|_| vec![(0, size)]).collect(),
            batch: 1,
        });
    }
    for size in [4u64 << 10, 1 << 20] {
        let batches = ((64u64 << 20) / (BATCH * size)).clamp(4, 200);
        list.push(Workload {
            tag: format!("emb-batch-{size}"),
            what: format!("{BATCH} × {}", size_label(size)),
            form: Form::Batch,
            parts: (0..batches * BATCH)
                .map(|i| vec![((i % BATCH) * size, size)])
                .collect(),
            batch: 32,
        });
    }
    list
}

/// `is_exist` p50 and p99 in µs (half hits, half misses), medians over the rounds.
fn exist_latency(client: &DummyClient, repeats: usize) -> Result<(f64, f64), String> {
    let (mut p50, mut p99) = (Vec::new(), Vec::new());
    for round in 0..=repeats {
        // Each round of `measure` ends with remove_all: put the hit key back.
        client
            .put("bench-present", b"x", &ReplicateConfig::default())
            .map_err(|c| format!("put: {c}"))?;
        let (a, b) = crate::exist_round(client, 20_000);
        if round > 0 {
            p50.push(a);
            p99.push(b);
        }
    }
    Ok((median(&mut p50), median(&mut p99)))
}

/// Runs the embedded section and prints its table.
pub fn run(repeats: usize, segment: &str) -> Result<(), String> {
    let client = start(segment)?;
    let mut region = vec![0x5au8; usize::try_from(REGION).map_err(|e| e.to_string())?];
    let base = region.as_mut_ptr() as u64;
    // SAFETY: the ranges are this client's pool memory or buffers registered with it,
    // alive for the call and touched by nothing else meanwhile (or deliberately
    // outside them, which the client refuses without touching).
    unsafe { client.register_buffer(base, REGION) }.map_err(|c| format!("register_buffer: {c}"))?;
    let workloads = workloads();
    let largest = workloads.iter().map(Workload::bytes).max().unwrap_or(0);
    let mut reference = Reference {
        region: &mut region,
        segment: PageAligned::new(largest)?,
    };
    let mut table = measure(&client, base, &mut reference, &workloads, repeats)?;
    let (p50, p99) = exist_latency(&client, repeats)?;
    let _ = client.unregister_buffer(base);
    client.close();
    println!(
        "\nembedded: real client and master in this process, a registered heap buffer, data on its own segment ({segment}), medians of {repeats}"
    );
    table.print();
    println!("| is_exist p50 / p99 | {p50:.1} / {p99:.1} µs | | | |");
    Ok(())
}
