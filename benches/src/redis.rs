//! `distributed_kv_storage_backend` on Redis next to Redis itself, in one run: a
//! private `redis-server` on loopback (no persistence); the backend writes objects of
//! 64 KiB and 1 MiB in batches as the offload loop does (one pipeline per batch) and
//! reads each back as a read of the tier does (one object per call, checked), and
//! `redis-benchmark` runs SET and GET of the same sizes against the same server: one
//! connection pipelining 16 requests, one connection without pipelining, and 16
//! connections (its view of the server's limit). An unrecorded pass comes first, and
//! each round measures every row once (medians over rounds).

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mooncake_offload::backend::Limits;
use mooncake_offload::config::{BackendKind, OffloadConfig};
use mooncake_offload::factory::open_backend;
use mooncake_offload::io::IoEngine;

use crate::offload::{median, round_trip};
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
    let measured = round_trip(store.as_mut(), size, TOTAL, || {});
    store.remove_all();
    measured
}

/// `redis-benchmark` SET and GET of `size` bytes with `clients` connections pipelining
/// `pipeline` requests: (SET GB/s, GET GB/s).
fn redis_benchmark(
    port: u16,
    size: usize,
    clients: u32,
    pipeline: u32,
) -> Result<(f64, f64), String> {
    let requests = (TOTAL / size).max(1000);
    let output = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", "set,get"])
        .args(["-d", &size.to_string(), "-n", &requests.to_string()])
        .args(["-c", &clients.to_string(), "-P", &pipeline.to_string()])
        .arg("--csv")
        .output()
        .map_err(|e| format!("cannot run redis-benchmark: {e}"))?;
    let text = String::from_utf8_lossy(&output.stdout);
    let rate = |test: &str| -> Result<f64, String> {
        text.lines()
            .find_map(|line| {
                let mut fields = line.split(',').map(|f| f.trim_matches('"'));
                (fields.next() == Some(test)).then(|| fields.next()?.parse::<f64>().ok())?
            })
            .ok_or_else(|| format!("no {test} result from redis-benchmark: {text}"))
    };
    Ok((
        rate("SET")? * size as f64 / 1e9,
        rate("GET")? * size as f64 / 1e9,
    ))
}

/// Runs the section `repeats` times (rows interleaved in each round) and prints
/// medians.
pub fn run(repeats: usize) -> Result<(), String> {
    let (_server, port) = start_server()?;
    // One unrecorded pass first: the server's allocator has its memory before the first
    // measurement, as before every later one.
    for (size, _) in SIZES {
        backend(port, size, usize::MAX)?;
    }
    let repeats = repeats.max(1);
    let mut rows: Vec<(String, Vec<f64>)> = Vec::new();
    for round in 0..repeats {
        let mut values = Vec::new();
        for (size, _) in SIZES {
            let (write, read) = backend(port, size, round)?;
            let (set_p16, get_p16) = redis_benchmark(port, size, 1, 16)?;
            let (set_p1, get_p1) = redis_benchmark(port, size, 1, 1)?;
            let (set_c16, get_c16) = redis_benchmark(port, size, 16, 1)?;
            values.extend([
                write, set_p16, set_p1, set_c16, read, get_p1, get_p16, get_c16,
            ]);
        }
        if rows.is_empty() {
            for (_, label) in SIZES {
                for name in [
                    "offload write (backend, batches of one pipeline)",
                    "redis-benchmark SET, 1 connection, pipeline 16",
                    "redis-benchmark SET, 1 connection, no pipeline",
                    "redis-benchmark SET, 16 connections",
                    "read back (backend, one object per call, checked)",
                    "redis-benchmark GET, 1 connection, no pipeline",
                    "redis-benchmark GET, 1 connection, pipeline 16",
                    "redis-benchmark GET, 16 connections",
                ] {
                    rows.push((format!("{label}: {name}"), Vec::new()));
                }
            }
        }
        for (row, value) in rows.iter_mut().zip(values) {
            row.1.push(value);
        }
    }
    println!(
        "\n## distributed_kv_storage_backend on Redis ({} MiB per measurement, median of {repeats})\n\n| measurement | GB/s |\n|---|---|",
        TOTAL >> 20
    );
    for (name, values) in rows {
        println!("| {name} | {:.2} |", median(values));
    }
    Ok(())
}
