//! `mooncake_bench`: end-to-end figures of one machine, in one run.
//!
//! Prints the memcpy bandwidth of this machine, `is_exist` round-trip latency (p50/p99)
//! and `put_from` / `get_into` throughput for 4 KiB, 1 MiB and 16 MiB values through a
//! real `mooncake_client`, each as the median over `--repeats` rounds, and the ratio of
//! each throughput to memcpy. Without `--client`, it starts its own `mooncake_client`
//! (from the same directory) on a private socket, with a 2 GB segment and a 1 s read
//! lease so that each round's objects free their space soon, and stops it afterwards.
//!
//! With `--sections cluster` it also starts a `mooncake_master` and two more
//! `mooncake_client`s and measures node-to-node `put_from`/`get_into` over the TCP
//! transfer engine next to raw loopback TCP; `--sections master` measures the master's
//! put-start+put-end pairs per second on 1 k and 1 M keys and its memory per key;
//! `--sections offload` measures the SSD tier's bucket store next to the raw disk
//! (in `MOONCAKE_BENCH_DIR`, default the temporary directory); `--sections trace`
//! replays the request trace `--trace FILE` (its first `--trace-requests` requests,
//! default 3000, blocks of `--block` bytes, default 64 KiB) against a real client with
//! a `--trace-segment` memory segment (default 512MB), without and with its SSD tier;
//! `--sections redis` starts a private `redis-server` and measures the
//! distributed-KV backend's writes and read-backs on it next to `redis-benchmark` SET
//! and GET of the same sizes.
//!
//! Three sections run only when named: `--sections failover` starts a private etcd,
//! three `mooncake_master --enable_ha` and two real clients following the leader, kills
//! the leader with -9 `--repeats` times (at least 3) and prints the time until a put
//! succeeds again, the acknowledged objects unreadable at the first read after the
//! switch and those lost; `--sections embedded` starts a real client with
//! its own master inside this process (Python's `setup()` mode, a `--segment` segment),
//! registers an ordinary heap buffer and measures `put_from`/`get_into` of 4 KiB,
//! 1 MiB and 16 MiB, `batch_put_from`/`batch_get_into` of 32 × 4 KiB and 32 × 1 MiB,
//! and `is_exist` p50/p99; `--sections engine` moves the pages of a 256 MiB host KV
//! pool registered once (pages of 64 KiB, 256 KiB and 2 MiB, four per key, batches
//! of 32 keys) with `batch_put_from_multi_buffers`/`batch_get_into_multi_buffers`, as
//! SGLang HiCache and vLLM do, against the embedded client and against a
//! `mooncake_client` (pool from the host-memory allocator, then on the heap). Both
//! print each throughput next to memcpy of the same bytes measured in the same round.
//!
//! Usage: `mooncake_bench [--client ADDR] [--repeats N] [--segment SIZE]
//! [--sections dummy,cluster,master,offload,trace,redis,embedded,engine,failover] [--trace FILE]`

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use mooncake_dummy_client::{DummyClient, ReplicateConfig};

#[path = "../cluster.rs"]
mod cluster;
#[path = "../embedded.rs"]
mod embedded;
#[path = "../engine.rs"]
mod engine;
#[path = "../failover.rs"]
mod failover;
#[path = "../master.rs"]
mod master;
#[path = "../offload.rs"]
mod offload;
#[path = "../processes.rs"]
mod processes;
#[path = "../redis.rs"]
mod redis;
#[path = "../trace.rs"]
mod trace;
#[path = "../workload.rs"]
mod workload;

struct Options {
    client: Option<String>,
    repeats: usize,
    segment: String,
    sections: Vec<String>,
    /// `--backends`: the SSD backends `--sections offload` measures (empty: all).
    backends: Vec<String>,
    trace: trace::TraceOptions,
}

fn parse_options() -> Result<Options, String> {
    let mut options = Options {
        client: None,
        repeats: 5,
        segment: "2GB".into(),
        sections: vec!["dummy".into(), "cluster".into(), "master".into()],
        backends: Vec::new(),
        trace: trace::TraceOptions {
            path: std::path::PathBuf::new(),
            requests: 3000,
            block: 64 << 10,
            segment: "512MB".into(),
        },
    };
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) => (n.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or(format!("{name} needs a value"))
        };
        match name.trim_start_matches('-') {
            "client" => options.client = Some(value()?),
            "repeats" => {
                options.repeats = value()?
                    .parse()
                    .map_err(|_| "--repeats needs a number".to_string())?
            }
            "segment" => options.segment = value()?,
            "trace" => options.trace.path = value()?.into(),
            "trace-requests" => {
                options.trace.requests = value()?
                    .parse()
                    .map_err(|_| "--trace-requests needs a number".to_string())?
            }
            "block" => {
                options.trace.block = mooncake_core::units::parse_size(&value()?)
                    .map_err(|e| format!("--block: {e}"))?
            }
            "trace-segment" => options.trace.segment = value()?,
            "sections" => {
                options.sections = value()?.split(',').map(|s| s.trim().to_string()).collect()
            }
            "backends" => {
                options.backends = value()?.split(',').map(|s| s.trim().to_string()).collect();
                if let Some(unknown) = options
                    .backends
                    .iter()
                    .find(|id| !offload::BACKEND_IDS.contains(&id.as_str()))
                {
                    return Err(format!(
                        "--backends: unknown backend {unknown:?} (one of {})",
                        offload::BACKEND_IDS.join(", ")
                    ));
                }
            }
            "help" | "h" => {
                return Err(
                    "usage: mooncake_bench [--client ADDR] [--repeats N] [--segment SIZE] [--sections dummy,cluster,master,offload,trace,redis,embedded,engine,failover] [--backends bucket,bucket_uring,file_per_key,offset_allocator,offset_allocator_uring] [--trace FILE]".into(),
                );
            }
            other => return Err(format!("unknown option --{other}")),
        }
    }
    if options.repeats == 0 {
        return Err("--repeats must be at least 1".into());
    }
    Ok(options)
}

/// A `mooncake_client` started by the benchmark, stopped on drop.
struct OwnClient(Child);

impl Drop for OwnClient {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_own_client(segment: &str) -> Result<(OwnClient, String), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let binary = exe.with_file_name("mooncake_client");
    let port = 40_000 + (std::process::id() % 20_000);
    let child = Command::new(&binary)
        // A short lease lets forcibly removed objects of one round free their space
        // for the next round soon.
        .args([
            format!("--port={port}"),
            format!("--global_segment_size={segment}"),
            "--default_kv_lease_ttl=1s".into(),
            "--log_level=warn".into(),
        ])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
    let own = OwnClient(child);
    let address = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(client) = DummyClient::setup_dummy(1 << 20, 0, Some(&address)) {
            client.close();
            // Let the segment prefault finish so the first round does not pay page faults.
            std::thread::sleep(Duration::from_millis(500));
            return Ok((own, address));
        }
        if Instant::now() > deadline {
            return Err("mooncake_client did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss,
        reason = "index into a small vector"
    )]
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

#[expect(clippy::cast_precision_loss, reason = "throughput figures")]
fn gbps(bytes: u64, elapsed: Duration) -> f64 {
    bytes as f64 / elapsed.as_secs_f64() / 1e9
}

/// memcpy of a 256 MiB buffer into another, in 16 MiB blocks (both buffers touched
/// beforehand, so neither page faults nor caches flatter the figure). The source goes
/// through `black_box`: the compiler would otherwise see that it holds one repeated
/// byte and turn the copy into a memset, twice as fast as any copy.
fn memcpy_round() -> f64 {
    const TOTAL: usize = 256 << 20;
    const BLOCK: usize = 16 << 20;
    let source = std::hint::black_box(vec![7u8; TOTAL]);
    let mut dest = vec![1u8; TOTAL];
    let started = Instant::now();
    for (to, from) in dest.chunks_exact_mut(BLOCK).zip(source.chunks_exact(BLOCK)) {
        to.copy_from_slice(from);
    }
    std::hint::black_box(&mut dest);
    gbps(TOTAL as u64, started.elapsed())
}

fn exist_round(client: &DummyClient, calls: usize) -> (f64, f64) {
    let mut samples = Vec::with_capacity(calls);
    for i in 0..calls {
        let key = if i % 2 == 0 {
            "bench-present"
        } else {
            "bench-absent"
        };
        let started = Instant::now();
        let _ = std::hint::black_box(client.is_exist(key));
        samples.push(started.elapsed());
    }
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    (
        us(percentile(&samples, 0.5)),
        us(percentile(&samples, 0.99)),
    )
}

struct TransferRound {
    put_gbps: f64,
    get_gbps: f64,
    put_p50_us: f64,
    get_p50_us: f64,
}

fn transfer_round(client: &DummyClient, size: u64, round: usize) -> Result<TransferRound, String> {
    let count = (64u64 << 20).div_ceil(size).clamp(16, 2000);
    let source = client.alloc_from_mem_pool(size);
    let dest = client.alloc_from_mem_pool(size);
    if source == 0 || dest == 0 {
        return Err(format!("pool allocation of {size} bytes failed"));
    }
    let config = ReplicateConfig::default();
    let keys: Vec<String> = (0..count)
        .map(|i| format!("bench-{size}-{round}-{i}"))
        .collect();
    let mut put_times = Vec::with_capacity(keys.len());
    let started = Instant::now();
    for key in &keys {
        let t = Instant::now();
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.put_from(key, source, size, &config) }
            .map_err(|c| format!("put_from: {c}"))?;
        put_times.push(t.elapsed());
    }
    let put_elapsed = started.elapsed();
    let mut get_times = Vec::with_capacity(keys.len());
    let started = Instant::now();
    for key in &keys {
        let t = Instant::now();
        // SAFETY: the ranges are this client's pool memory or buffers registered with it,
        // alive for the call and touched by nothing else meanwhile (or deliberately
        // outside them, which the client refuses without touching).
        unsafe { client.get_into(key, dest, size) }.map_err(|c| format!("get_into: {c}"))?;
        get_times.push(t.elapsed());
    }
    let get_elapsed = started.elapsed();
    client
        .remove_all(true)
        .map_err(|c| format!("remove_all: {c}"))?;
    let _ = client.free_to_mem_pool(source);
    let _ = client.free_to_mem_pool(dest);
    put_times.sort();
    get_times.sort();
    Ok(TransferRound {
        put_gbps: gbps(size * count, put_elapsed),
        get_gbps: gbps(size * count, get_elapsed),
        put_p50_us: percentile(&put_times, 0.5).as_secs_f64() * 1e6,
        get_p50_us: percentile(&get_times, 0.5).as_secs_f64() * 1e6,
    })
}

/// The real client to measure: `--client`, or a `mooncake_client` started here (stopped
/// when the returned guard drops).
fn client_address(options: &Options) -> Result<(Option<OwnClient>, String), String> {
    match &options.client {
        Some(address) => Ok((None, address.clone())),
        None => {
            let (own, address) = start_own_client(&options.segment)?;
            Ok((Some(own), address))
        }
    }
}

fn run(options: &Options) -> Result<(), String> {
    let (_own, address) = client_address(options)?;
    let client =
        DummyClient::setup_dummy(64 << 20, 16 << 20, Some(&address)).map_err(|e| e.to_string())?;
    client
        .put("bench-present", b"x", &ReplicateConfig::default())
        .map_err(|c| c.to_string())?;
    println!(
        "mooncake_bench against {address}, {} repeats, medians",
        options.repeats
    );

    let sizes = [4u64 << 10, 1 << 20, 16 << 20];
    let mut memcpy = Vec::new();
    let mut exist_p50 = Vec::new();
    let mut exist_p99 = Vec::new();
    let mut rounds: Vec<Vec<TransferRound>> = sizes.iter().map(|_| Vec::new()).collect();
    for round in 0..=options.repeats {
        if round == 0 {
            // Warm-up round, not counted: first touches of the pool and segment.
            for &size in &sizes {
                transfer_round(&client, size, usize::MAX)?;
            }
            continue;
        }
        memcpy.push(memcpy_round());
        let (p50, p99) = exist_round(&client, 20_000);
        exist_p50.push(p50);
        exist_p99.push(p99);
        for (index, &size) in sizes.iter().enumerate() {
            rounds[index].push(transfer_round(&client, size, round)?);
        }
    }
    let memcpy = median(&mut memcpy);
    println!("\n| measure | value | vs memcpy |\n|---|---|---|");
    println!("| memcpy 256 MiB (16 MiB blocks) | {memcpy:.2} GB/s | 100% |");
    println!("| is_exist p50 | {:.1} us | |", median(&mut exist_p50));
    println!("| is_exist p99 | {:.1} us | |", median(&mut exist_p99));
    for (index, &size) in sizes.iter().enumerate() {
        let label = match size {
            s if s >= 1 << 20 => format!("{} MiB", s >> 20),
            s => format!("{} KiB", s >> 10),
        };
        let rs = &rounds[index];
        let mut put: Vec<f64> = rs.iter().map(|r| r.put_gbps).collect();
        let mut get: Vec<f64> = rs.iter().map(|r| r.get_gbps).collect();
        let mut put_lat: Vec<f64> = rs.iter().map(|r| r.put_p50_us).collect();
        let mut get_lat: Vec<f64> = rs.iter().map(|r| r.get_p50_us).collect();
        let (put, get) = (median(&mut put), median(&mut get));
        println!(
            "| put_from {label} | {put:.2} GB/s (p50 {:.1} us) | {:.0}% |",
            median(&mut put_lat),
            put / memcpy * 100.0
        );
        println!(
            "| get_into {label} | {get:.2} GB/s (p50 {:.1} us) | {:.0}% |",
            median(&mut get_lat),
            get / memcpy * 100.0
        );
    }
    client.close();
    Ok(())
}

fn main() {
    let result = parse_options().and_then(|options| {
        if options.sections.iter().any(|s| s == "dummy") {
            run(&options)?;
        }
        if options.sections.iter().any(|s| s == "cluster") {
            cluster::run(options.repeats)?;
        }
        if options.sections.iter().any(|s| s == "master") {
            master::run();
        }
        if options.sections.iter().any(|s| s == "offload") {
            offload::run(options.repeats, &options.backends);
        }
        if options.sections.iter().any(|s| s == "redis") {
            redis::run(options.repeats)?;
        }
        if options.sections.iter().any(|s| s == "trace") {
            if options.trace.path.as_os_str().is_empty() {
                return Err("--sections trace needs --trace FILE (a JSONL request trace)".into());
            }
            trace::run(&options.trace, &offload::scratch_dir())?;
        }
        if options.sections.iter().any(|s| s == "embedded") {
            embedded::run(options.repeats, &options.segment)?;
        }
        if options.sections.iter().any(|s| s == "failover") {
            failover::run(options.repeats.max(3))?;
        }
        if options.sections.iter().any(|s| s == "engine") {
            engine::embedded(options.repeats, &options.segment)?;
            // Started after the embedded half, so that it does not share the machine.
            let (_own, address) = client_address(&options)?;
            engine::dummy(options.repeats, &address)?;
        }
        Ok(())
    });
    if let Err(message) = result {
        eprintln!("mooncake_bench: {message}");
        std::process::exit(2);
    }
}
