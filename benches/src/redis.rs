//! `distributed_kv_storage_backend` on Redis next to Redis itself, in one run: a
//! private `redis-server` on loopback (no persistence); the backend writes objects of
//! 64 KiB and 1 MiB in batches as the offload loop does (one pipeline per batch) and
//! reads them back as a batched get of the tier does (several objects at a time:
//! `mooncake_offload::parallel_reads`, each checked), and
//! `redis-benchmark` runs SET and GET of the same sizes against the same server: one
//! connection without pipelining (the reference of the ratios), one pipelining 16
//! requests, and 16 connections (its view of the server's limit). Its SETs store new
//! keys (`-r`), as the tier does. An unrecorded pass comes first, and
//! each round measures every row once (medians over rounds).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_offload::backend::Limits;
use mooncake_offload::config::{BackendKind, OffloadConfig};
use mooncake_offload::factory::open_backend;
use mooncake_offload::io::IoEngine;

use crate::offload::{median, read_objects, write_objects};
use crate::processes::{Processes, free_port};

/// Bytes written and read per measurement.
const TOTAL: usize = 256 << 20;

/// Object sizes measured.
const SIZES: [(usize, &str); 2] = [(64 << 10, "64 KiB"), (1 << 20, "1 MiB")];

/// Starts `redis-server` on a free loopback port; waits until it answers.
fn start_server() -> Result<(Processes, u16), String> {
    let port = free_port()?;
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--loglevel", "warning"])
        .stdout(Stdio::null())
        .spawn()
        .map_err(|e| {
            format!("cannot start redis-server (install the redis-server package): {e}")
        })?;
    let processes = Processes(vec![child]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if Instant::now() > deadline {
            return Err("redis-server did not start".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((processes, port))
}

/// The backend on the server at `port` writing and reading back `size`-byte objects:
/// (write GB/s, read GB/s).
fn backend(port: u16, size: usize, round: usize) -> Result<(f64, f64), String> {
    let mut config = OffloadConfig::from_lookup(&|_| None).map_err(|e| e.to_string())?;
    config.backend = BackendKind::DistributedKv;
    config.dkv_url = format!("redis://127.0.0.1:{port}/0");
    config.dkv_namespace = format!("bench-{round}-{size}");
    let io = Arc::new(IoEngine::new(false));
    let (mut store, _) =
        open_backend(&config, Limits::bytes(2 * TOTAL as u64), io).map_err(|e| e.to_string())?;
    let measured = write_objects(store.as_mut(), size, TOTAL)
        .and_then(|(write, written)| Ok((write, read_objects(store.as_mut(), &written, true)?)));
    store.remove_all();
    measured
}

/// One `redis-benchmark` load: `tests` with `size`-byte values, `clients` connections
/// pipelining `pipeline` requests (and `-r`, keys drawn from `keys`, when given).
#[derive(Clone, Copy)]
struct Load<'a> {
    tests: &'a [&'a str],
    size: usize,
    clients: u32,
    pipeline: u32,
    keys: Option<u64>,
}

/// [`redis_benchmark_once`], tried up to three times: now and then a run prints no
/// result.
fn redis_benchmark_run(port: u16, load: Load<'_>) -> Result<Vec<f64>, String> {
    let mut attempt = 1;
    loop {
        match redis_benchmark_once(port, load) {
            Err(error) if attempt < 3 => {
                eprintln!("redis-benchmark, attempt {attempt}: {error}");
                attempt += 1;
            }
            done => return done,
        }
    }
}

/// One `redis-benchmark` run of `load`: the requests per second of each test, in
/// order.
fn redis_benchmark_once(port: u16, load: Load<'_>) -> Result<Vec<f64>, String> {
    let Load {
        tests,
        size,
        clients,
        pipeline,
        keys,
    } = load;
    let requests = (TOTAL / size).max(1000);
    let mut command = Command::new("redis-benchmark");
    command
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-t",
            &tests.join(","),
        ])
        .args(["-d", &size.to_string(), "-n", &requests.to_string()])
        .args(["-c", &clients.to_string(), "-P", &pipeline.to_string()]);
    if let Some(keys) = keys {
        command.args(["-r", &keys.to_string()]);
    }
    let output = command
        .arg("--csv")
        .output()
        .map_err(|e| format!("cannot run redis-benchmark: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    tests
        .iter()
        .map(|test| {
            text.lines()
                .find_map(|line| {
                    let mut fields = line.split(',').map(|f| f.trim_matches('"'));
                    (fields.next() == Some(*test)).then(|| fields.next()?.parse::<f64>().ok())?
                })
                .ok_or_else(|| format!("no {test} result from redis-benchmark: {text}"))
        })
        .collect()
}

/// `redis-benchmark` SET and GET of `size` bytes with `clients` connections pipelining
/// `pipeline` requests: (SET GB/s, GET GB/s). Each SET stores a new key (`-r` over a
/// key space far larger than the requests), as the tier stores new objects: SETs that
/// overwrite one key reuse its memory in the server and run up to three times faster
/// for 1 MiB values. GETs read one existing key. The server is emptied after the SETs.
fn redis_benchmark(
    port: u16,
    size: usize,
    clients: u32,
    pipeline: u32,
) -> Result<(f64, f64), String> {
    let gbps = |rate: f64| rate * size as f64 / 1e9;
    let load = Load {
        tests: &["SET"],
        size,
        clients,
        pipeline,
        keys: Some(100_000_000),
    };
    let set = redis_benchmark_run(port, load)?;
    flush(port)?;
    let get = redis_benchmark_run(
        port,
        Load {
            tests: &["SET", "GET"],
            keys: None,
            ..load
        },
    )?;
    flush(port)?;
    Ok((gbps(set[0]), gbps(get[1])))
}

/// Empties the server at `port`.
fn flush(port: u16) -> Result<(), String> {
    let status = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "FLUSHALL"])
        .stdout(Stdio::null())
        .status()
        .map_err(|e| format!("cannot run redis-cli: {e}"))?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| "redis-cli FLUSHALL failed".to_string())
}

/// Runs the section `repeats` times (rows interleaved in each round) and prints
/// medians, and the backend's ratios to one `redis-benchmark` connection without
/// pipelining (median of the per-round ratios).
pub fn run(repeats: usize) -> Result<(), String> {
    let (_server, port) = start_server()?;
    // One unrecorded pass first: the server's allocator has its memory before the first
    // measurement, as before every later one.
    for (size, _) in SIZES {
        backend(port, size, usize::MAX)?;
    }
    let repeats = repeats.max(1);
    let names = [
        "offload write (backend, batches as the offload loop sends them)",
        "redis-benchmark SET (new keys), 1 connection, no pipeline",
        "redis-benchmark SET (new keys), 1 connection, pipeline 16",
        "redis-benchmark SET (new keys), 16 connections",
        "read back (backend, batches as a batched get reads them, checked)",
        "redis-benchmark GET, 1 connection, no pipeline",
        "redis-benchmark GET, 1 connection, pipeline 16",
        "redis-benchmark GET, 16 connections",
    ];
    let mut rows: Vec<Vec<f64>> = vec![Vec::new(); SIZES.len() * names.len()];
    for round in 0..repeats {
        let mut values = Vec::new();
        for (size, _) in SIZES {
            let (write, read) = backend(port, size, round)?;
            let (set_p1, get_p1) = redis_benchmark(port, size, 1, 1)?;
            let (set_p16, get_p16) = redis_benchmark(port, size, 1, 16)?;
            let (set_c16, get_c16) = redis_benchmark(port, size, 16, 1)?;
            values.extend([
                write, set_p1, set_p16, set_c16, read, get_p1, get_p16, get_c16,
            ]);
        }
        for (row, value) in rows.iter_mut().zip(values) {
            row.push(value);
        }
    }
    println!(
        "\n## distributed_kv_storage_backend on Redis ({} MiB per measurement, median of {repeats})\n\nThe ratio compares the backend with one redis-benchmark connection without pipelining (writes: SETs of new keys; reads: GETs), median of the per-round ratios.\n\n| measurement | GB/s | ratio |\n|---|---|---|",
        TOTAL >> 20
    );
    for ((_, label), rows) in SIZES.iter().zip(rows.chunks(names.len())) {
        for (at, (name, values)) in names.iter().zip(rows).enumerate() {
            let reference = match at {
                0 => Some(&rows[1]),
                4 => Some(&rows[5]),
                _ => None,
            };
            let ratio = reference.map_or_else(String::new, |reference| {
                let ratios = values.iter().zip(reference).map(|(v, r)| v / r).collect();
                format!("{:.2}×", median(ratios))
            });
            println!(
                "| {label}: {name} | {:.2} | {ratio} |",
                median(values.clone())
            );
        }
    }
    Ok(())
}
