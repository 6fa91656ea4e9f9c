//! Replay of a request trace (`conversation_trace.jsonl` of the Mooncake traces): the
//! KV-cache blocks of each request are looked up in order; a hit is read with
//! `get_into` (its bytes checked), a miss is stored with `put_from`. One real client
//! with a memory segment smaller than the working set serves the replay twice: without
//! and with its SSD tier. Reports hit rate (against the ideal one of an unbounded
//! cache), read latency of hits and the replay's wall time.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicateConfig};

use crate::processes::{Processes, spawn_with_env, wait_for};

/// What to replay and with how much memory.
pub struct TraceOptions {
    /// The JSONL trace.
    pub path: PathBuf,
    /// Requests replayed from the start of the trace.
    pub requests: usize,
    /// Bytes per KV-cache block.
    pub block: u64,
    /// The real client's memory segment.
    pub segment: String,
}

/// Reads the `hash_ids` of the first `requests` requests.
fn load(path: &Path, requests: usize) -> Result<Vec<Vec<u64>>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    text.lines()
        .take(requests)
        .enumerate()
        .map(|(line, text)| {
            let ids = text
                .split_once("\"hash_ids\"")
                .and_then(|(_, rest)| rest.split_once('['))
                .and_then(|(_, rest)| rest.split_once(']'))
                .ok_or(format!("line {}: no hash_ids", line + 1))?
                .0;
            ids.split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| s.trim().parse::<u64>())
                .collect::<Result<Vec<u64>, _>>()
                .map_err(|e| format!("line {}: {e}", line + 1))
        })
        .collect()
}

/// Hit rate of an unbounded cache over `trace`.
fn ideal_hit_rate(trace: &[Vec<u64>]) -> f64 {
    let mut seen = std::collections::HashSet::new();
    let (mut hits, mut total) = (0u64, 0u64);
    for id in trace.iter().flatten() {
        total += 1;
        if !seen.insert(*id) {
            hits += 1;
        }
    }
    ratio(hits, total)
}

#[expect(clippy::cast_precision_loss, reason = "ratios of counts")]
fn ratio(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// What one replay measured.
struct Replay {
    blocks: u64,
    hits: u64,
    refused: u64,
    hit_us: Vec<f64>,
    wall: Duration,
}

/// Writes the block's id into every 8-byte word of `buf`.
fn fill(buf: u64, len: u64, id: u64) {
    let words = usize::try_from(len / 8).unwrap_or(0);
    // SAFETY: `buf` is a pool allocation of `len` bytes of this process.
    let slice = unsafe { std::slice::from_raw_parts_mut(buf as *mut u64, words) };
    slice.fill(id);
}

/// Whether `buf` holds block `id` (first and last word).
fn holds(buf: u64, len: u64, id: u64) -> bool {
    let words = usize::try_from(len / 8).unwrap_or(0);
    // SAFETY: `buf` is a pool allocation of `len` bytes of this process.
    let slice = unsafe { std::slice::from_raw_parts(buf as *const u64, words) };
    slice.first() == Some(&id) && slice.last() == Some(&id)
}

/// Stores block `id`, waiting (up to 5 s) while the node's memory is full of objects
/// still on their way to disk.
fn store(client: &DummyClient, key: &str, buf: u64, len: u64) -> bool {
    let config = ReplicateConfig::default();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        match unsafe { client.put_from(key, buf, len, &config) } {
            Ok(()) => return true,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
            Err(_) => return false,
        }
    }
}

fn replay(client: &DummyClient, trace: &[Vec<u64>], block: u64) -> Result<Replay, String> {
    let source = client.alloc_from_mem_pool(block);
    let dest = client.alloc_from_mem_pool(block);
    if source == 0 || dest == 0 {
        return Err("pool allocation failed".into());
    }
    let mut result = Replay {
        blocks: 0,
        hits: 0,
        refused: 0,
        hit_us: Vec::new(),
        wall: Duration::ZERO,
    };
    let started = Instant::now();
    for id in trace.iter().flatten() {
        let key = format!("trace-block-{id}");
        result.blocks += 1;
        let asked = Instant::now();
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        if unsafe { client.get_into(&key, dest, block) }.is_ok() {
            result.hit_us.push(asked.elapsed().as_secs_f64() * 1e6);
            if !holds(dest, block, *id) {
                return Err(format!("block {id} read back with other bytes"));
            }
            result.hits += 1;
        } else {
            fill(source, block, *id);
            if !store(client, &key, source, block) {
                result.refused += 1;
            }
        }
    }
    result.wall = started.elapsed();
    Ok(result)
}

fn percentile(values: &mut [f64], q: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "an index into a short list"
    )]
    let index = ((values.len() - 1) as f64 * q).round() as usize;
    values[index]
}

/// Starts a real client (embedded master), with its SSD tier in `disk` when given.
fn start_node(
    options: &TraceOptions,
    disk: Option<&Path>,
) -> Result<(Processes, DummyClient), String> {
    let port = 30_000 + (std::process::id() % 10_000) as u16 * 2 + u16::from(disk.is_some());
    let mut args = vec![
        format!("--port={port}"),
        "--host=127.0.0.1".into(),
        format!("--global_segment_size={}", options.segment),
        "--embedded_master_port=0".into(),
        "--log_level=warn".into(),
        "--default_kv_lease_ttl=100ms".into(),
    ];
    let mut env = Vec::new();
    if let Some(dir) = disk {
        args.push("--enable_offload".into());
        args.push(format!("--offload_path={}", dir.display()));
        env.push((
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS",
            "1".to_string(),
        ));
    }
    let processes = Processes(vec![spawn_with_env("mooncake_client", &args, &env)?]);
    let client = wait_for(&format!("127.0.0.1:{port}"))?;
    Ok((processes, client))
}

/// Runs the trace section.
pub fn run(options: &TraceOptions, scratch: &Path) -> Result<(), String> {
    let trace = load(&options.path, options.requests)?;
    let blocks: u64 = trace.iter().map(|r| r.len() as u64).sum();
    let unique = trace
        .iter()
        .flatten()
        .collect::<std::collections::HashSet<_>>()
        .len() as u64;
    println!(
        "\ntrace: {} requests of {}, {blocks} block lookups, {unique} distinct blocks of {} KiB ({} MiB), memory segment {}",
        trace.len(),
        options.path.display(),
        options.block >> 10,
        (unique * options.block) >> 20,
        options.segment
    );
    println!(
        "\n| tier | hit rate | ideal | hit p50 µs | hit p99 µs | stores refused | wall s |\n|---|---|---|---|---|---|---|"
    );
    let ideal = ideal_hit_rate(&trace);
    let disk_dir = scratch.join(format!("mooncake-trace-{}", std::process::id()));
    for with_disk in [false, true] {
        let disk = with_disk.then_some(disk_dir.as_path());
        if let Some(dir) = disk {
            let _ = std::fs::remove_dir_all(dir);
            std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        let (processes, client) = start_node(options, disk)?;
        let mut result = replay(&client, &trace, options.block)?;
        client.close();
        drop(processes);
        println!(
            "| {} | {:.1} % | {:.1} % | {:.0} | {:.0} | {} | {:.1} |",
            if with_disk {
                "memory + SSD"
            } else {
                "memory only"
            },
            ratio(result.hits, result.blocks) * 100.0,
            ideal * 100.0,
            percentile(&mut result.hit_us, 0.5),
            percentile(&mut result.hit_us, 0.99),
            result.refused,
            result.wall.as_secs_f64()
        );
    }
    let _ = std::fs::remove_dir_all(&disk_dir);
    Ok(())
}
