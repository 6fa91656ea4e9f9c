//! Node-to-node transfers over the TCP transfer engine, next to raw loopback TCP.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use mooncake_dummy_client::ReplicateConfig;
use mooncake_real_client::transfer::Congestion;
use mooncake_real_client::transfer::tuning::DEFAULT_CONGESTION as TRANSFER_CONGESTION;

use crate::processes::{Processes, free_port, spawn, wait_for};

/// Raw loopback TCP: one sender streaming 16 MiB messages to one receiver, both
/// sockets prepared as `congestion` says. The messages come from `source_len` bytes
/// of memory in turn: 16 MiB stays in the cache between sends, 256 MiB is read from
/// memory as a real client reads its segment.
fn loopback_tcp_gbps(
    total: usize,
    congestion: &Congestion,
    source_len: usize,
) -> Result<f64, String> {
    const MESSAGE: usize = 16 << 20;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    let receiver_congestion = congestion.clone();
    let receiver = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut stream, _) = listener.accept()?;
        receiver_congestion.prepare(&stream);
        let mut buf = vec![0u8; MESSAGE];
        let mut left = total;
        while left > 0 {
            let n = stream.read(&mut buf[..left.min(MESSAGE)])?;
            if n == 0 {
                break;
            }
            left -= n;
        }
        stream.write_all(&[1])
    });
    let mut stream = TcpStream::connect(address).map_err(|e| e.to_string())?;
    congestion.prepare(&stream);
    let source: Vec<u8> = (0..source_len.max(MESSAGE))
        .map(|i| u8::try_from(i % 251).unwrap_or(0))
        .collect();
    let started = Instant::now();
    let mut sent = 0;
    let mut at = 0;
    while sent < total {
        let n = MESSAGE.min(total - sent);
        if at + n > source.len() {
            at = 0;
        }
        stream
            .write_all(&source[at..at + n])
            .map_err(|e| e.to_string())?;
        at += n;
        sent += n;
    }
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).map_err(|e| e.to_string())?;
    let elapsed = started.elapsed();
    let _ = receiver.join();
    #[expect(clippy::cast_precision_loss, reason = "throughput")]
    Ok(total as f64 / elapsed.as_secs_f64() / 1e9)
}

/// Raw TCP runs: congestion control and source size.
struct RawRun {
    congestion: Congestion,
    source_len: usize,
    results: Vec<f64>,
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// The protocol both real clients run (`MOONCAKE_BENCH_PROTOCOL`, default `tcp`) and
/// the flags that choose it (with `MOONCAKE_BENCH_RDMA_DEVICES` as `--device_names`).
fn protocol_flags() -> (String, Vec<String>) {
    let protocol = std::env::var("MOONCAKE_BENCH_PROTOCOL").unwrap_or_else(|_| "tcp".into());
    let mut flags = vec![format!("--protocol={protocol}")];
    if let Ok(devices) = std::env::var("MOONCAKE_BENCH_RDMA_DEVICES") {
        flags.push(format!("--device_names={devices}"));
    }
    (protocol, flags)
}

/// The object sizes measured (`MOONCAKE_BENCH_SIZES`, comma separated sizes such as
/// `4KiB,64KiB,1MiB,64MiB`; default 1 MiB and 16 MiB).
fn object_sizes() -> Result<Vec<u64>, String> {
    let Ok(list) = std::env::var("MOONCAKE_BENCH_SIZES") else {
        return Ok(vec![1 << 20, 16 << 20]);
    };
    list.split(',')
        .map(|size| {
            mooncake_core::units::parse_size(size.trim())
                .map_err(|e| format!("MOONCAKE_BENCH_SIZES: {size:?}: {e}"))
        })
        .collect()
}

/// A size as the rows name it (`4 KiB`, `1 MiB`).
fn size_label(size: u64) -> String {
    if size >= 1 << 20 {
        format!("{} MiB", size >> 20)
    } else {
        format!("{} KiB", size >> 10)
    }
}

/// Runs the cluster section: a master and two real clients A and B; a dummy on A
/// writes into and reads from B's segment.
pub fn run(repeats: usize) -> Result<(), String> {
    let (protocol, protocol_flags) = protocol_flags();
    let sizes = object_sizes()?;
    let master_port = free_port()?;
    let master_address = format!("127.0.0.1:{master_port}");
    let mut processes = Processes::default();
    processes.0.push(spawn(
        "mooncake_master",
        &[
            format!("--rpc_port={master_port}"),
            "--rpc_address=127.0.0.1".into(),
            "--metrics_port=0".into(),
            "--enable_metric_reporting=false".into(),
            "--log_level=warn".into(),
            "--default_kv_lease_ttl=1s".into(),
        ],
    )?);
    std::thread::sleep(Duration::from_millis(200));
    let ports = [
        40_000 + (std::process::id() % 10_000) as u16 * 2,
        40_001 + (std::process::id() % 10_000) as u16 * 2,
    ];
    for port in ports {
        let mut flags = vec![
            format!("--port={port}"),
            "--host=127.0.0.1".into(),
            format!("--master_server_address={master_address}"),
            "--global_segment_size=1GB".into(),
            "--log_level=warn".into(),
        ];
        flags.extend(protocol_flags.iter().cloned());
        processes.0.push(spawn("mooncake_client", &flags)?);
    }
    let node_a = wait_for(&format!("127.0.0.1:{}", ports[0]))?;
    let _node_b = wait_for(&format!("127.0.0.1:{}", ports[1]))?;
    std::thread::sleep(Duration::from_millis(500));
    let on_b = ReplicateConfig {
        preferred_segment: format!("127.0.0.1:{}", ports[1]),
        ..ReplicateConfig::default()
    };
    println!(
        "\ncluster: dummy on node A, data in node B's segment ({protocol} transfer engine over loopback), medians of {repeats}"
    );
    // Raw TCP with the transfer sockets' congestion control and with the system's, from
    // a cache-resident block and from memory; each reference is the faster of the two.
    let mut raw_runs: Vec<RawRun> = [16usize << 20, 256 << 20]
        .into_iter()
        .flat_map(|source_len| {
            [
                Congestion::Named(TRANSFER_CONGESTION.into()),
                Congestion::System,
            ]
            .map(|congestion| RawRun {
                congestion,
                source_len,
                results: Vec::new(),
            })
        })
        .collect();
    let mut rows: Vec<(String, Vec<f64>)> = Vec::new();
    for round in 0..=repeats {
        for run in &mut raw_runs {
            let raw = loopback_tcp_gbps(512 << 20, &run.congestion, run.source_len)?;
            if round > 0 {
                run.results.push(raw);
            }
        }
        for (index, &size) in sizes.iter().enumerate() {
            // 256 MiB of objects, at most 4096 of them.
            let count = ((256u64 << 20) / size).clamp(1, 4096);
            let buf = node_a.alloc_from_mem_pool(size);
            let keys: Vec<String> = (0..count)
                .map(|i| format!("cluster-{round}-{size}-{i}"))
                .collect();
            let started = Instant::now();
            for key in &keys {
                // SAFETY: the ranges are this client's pool memory or buffers registered with it,
                // alive for the call and touched by nothing else meanwhile (or deliberately
                // outside them, which the client refuses without touching).
                unsafe { node_a.put_from(key, buf, size, &on_b) }
                    .map_err(|c| format!("put_from: {c}"))?;
            }
            #[expect(clippy::cast_precision_loss, reason = "throughput")]
            let put = (size * count) as f64 / started.elapsed().as_secs_f64() / 1e9;
            let started = Instant::now();
            for key in &keys {
                // SAFETY: the ranges are this client's pool memory or buffers registered with it,
                // alive for the call and touched by nothing else meanwhile (or deliberately
                // outside them, which the client refuses without touching).
                unsafe { node_a.get_into(key, buf, size) }.map_err(|c| format!("get_into: {c}"))?;
            }
            #[expect(clippy::cast_precision_loss, reason = "throughput")]
            let get = (size * count) as f64 / started.elapsed().as_secs_f64() / 1e9;
            let _ = node_a.remove_all(true);
            let _ = node_a.free_to_mem_pool(buf);
            std::thread::sleep(Duration::from_millis(1100));
            if round == 0 {
                continue;
            }
            let label = size_label(size);
            if rows.len() < 2 * sizes.len() {
                rows.push((format!("put_from A→B {label}"), Vec::new()));
                rows.push((format!("get_into B→A {label}"), Vec::new()));
            }
            rows[index * 2].1.push(put);
            rows[index * 2 + 1].1.push(get);
        }
    }
    print_rows(&mut raw_runs, rows);
    node_a.close();
    Ok(())
}

/// Prints the raw TCP runs and every measured row next to the faster raw run of each
/// source size.
fn print_rows(raw_runs: &mut [RawRun], rows: Vec<(String, Vec<f64>)>) {
    let system_name = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .map_or_else(|_| "unknown".into(), |s| s.trim().to_string());
    let reference = |runs: &mut [RawRun], source_len: usize| {
        runs.iter_mut()
            .filter(|run| run.source_len == source_len)
            .map(|run| median(&mut run.results))
            .fold(0.0, f64::max)
    };
    let cached = reference(raw_runs, 16 << 20);
    let from_memory = reference(raw_runs, 256 << 20);
    println!(
        "\n| measure | GB/s | vs raw TCP from a cached 16 MiB block | vs raw TCP from 256 MiB of memory |\n|---|---|---|---|"
    );
    for run in raw_runs.iter_mut() {
        let name = match &run.congestion {
            Congestion::Named(name) => format!("{name} (the transfer sockets')"),
            Congestion::System => format!("{system_name} (the system's)"),
        };
        let value = median(&mut run.results);
        println!(
            "| raw loopback TCP from {} MiB, {name} | {value:.2} | {:.0}% | {:.0}% |",
            run.source_len >> 20,
            value / cached * 100.0,
            value / from_memory * 100.0
        );
    }
    for (label, mut values) in rows {
        let value = median(&mut values);
        println!(
            "| {label} | {value:.2} | {:.0}% | {:.0}% |",
            value / cached * 100.0,
            value / from_memory * 100.0
        );
    }
}
