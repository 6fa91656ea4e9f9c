//! Node-to-node transfers over the TCP transfer engine, next to raw loopback TCP.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use mooncake_dummy_client::ReplicateConfig;

use crate::processes::{Processes, free_port, spawn, wait_for};

/// Raw loopback TCP: one sender streaming 16 MiB messages to one receiver.
fn loopback_tcp_gbps(total: usize) -> Result<f64, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    let receiver = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut stream, _) = listener.accept()?;
        let mut buf = vec![0u8; 16 << 20];
        let mut left = total;
        while left > 0 {
            let n = stream.read(&mut buf[..left.min(16 << 20)])?;
            if n == 0 {
                break;
            }
            left -= n;
        }
        stream.write_all(&[1])
    });
    let mut stream = TcpStream::connect(address).map_err(|e| e.to_string())?;
    let _ = stream.set_nodelay(true);
    let block = vec![7u8; 16 << 20];
    let started = Instant::now();
    let mut sent = 0;
    while sent < total {
        let n = block.len().min(total - sent);
        stream.write_all(&block[..n]).map_err(|e| e.to_string())?;
        sent += n;
    }
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).map_err(|e| e.to_string())?;
    let elapsed = started.elapsed();
    let _ = receiver.join();
    #[expect(clippy::cast_precision_loss, reason = "throughput")]
    Ok(total as f64 / elapsed.as_secs_f64() / 1e9)
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Runs the cluster section: a master and two real clients A and B; a dummy on A
/// writes into and reads from B's segment.
pub fn run(repeats: usize) -> Result<(), String> {
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
        processes.0.push(spawn(
            "mooncake_client",
            &[
                format!("--port={port}"),
                "--host=127.0.0.1".into(),
                format!("--master_server_address={master_address}"),
                "--global_segment_size=1GB".into(),
                "--log_level=warn".into(),
            ],
        )?);
    }
    let node_a = wait_for(&format!("127.0.0.1:{}", ports[0]))?;
    let _node_b = wait_for(&format!("127.0.0.1:{}", ports[1]))?;
    std::thread::sleep(Duration::from_millis(500));
    let on_b = ReplicateConfig {
        preferred_segment: format!("127.0.0.1:{}", ports[1]),
        ..ReplicateConfig::default()
    };
    println!(
        "\ncluster: dummy on node A, data in node B's segment (TCP transfer engine over loopback), medians of {repeats}"
    );
    println!("\n| measure | GB/s | vs raw TCP |\n|---|---|---|");
    let mut tcp = Vec::new();
    let mut rows: Vec<(String, Vec<f64>)> = Vec::new();
    for round in 0..=repeats {
        let raw = loopback_tcp_gbps(512 << 20)?;
        for (index, size) in [1u64 << 20, 16 << 20].into_iter().enumerate() {
            let count = (256u64 << 20) / size;
            let buf = node_a.alloc_from_mem_pool(size);
            let keys: Vec<String> = (0..count)
                .map(|i| format!("cluster-{round}-{size}-{i}"))
                .collect();
            let started = Instant::now();
            for key in &keys {
                node_a
                    .put_from(key, buf, size, &on_b)
                    .map_err(|c| format!("put_from: {c}"))?;
            }
            #[expect(clippy::cast_precision_loss, reason = "throughput")]
            let put = (size * count) as f64 / started.elapsed().as_secs_f64() / 1e9;
            let started = Instant::now();
            for key in &keys {
                node_a
                    .get_into(key, buf, size)
                    .map_err(|c| format!("get_into: {c}"))?;
            }
            #[expect(clippy::cast_precision_loss, reason = "throughput")]
            let get = (size * count) as f64 / started.elapsed().as_secs_f64() / 1e9;
            let _ = node_a.remove_all(true);
            let _ = node_a.free_to_mem_pool(buf);
            std::thread::sleep(Duration::from_millis(1100));
            if round == 0 {
                continue;
            }
            let label = if size >= 16 << 20 { "16 MiB" } else { "1 MiB" };
            if rows.len() < 4 {
                rows.push((format!("put_from A→B {label}"), Vec::new()));
                rows.push((format!("get_into B→A {label}"), Vec::new()));
            }
            rows[index * 2].1.push(put);
            rows[index * 2 + 1].1.push(get);
        }
        if round > 0 {
            tcp.push(raw);
        }
    }
    let tcp = median(&mut tcp);
    println!("| raw loopback TCP, 16 MiB writes | {tcp:.2} | 100% |");
    for (label, mut values) in rows {
        let value = median(&mut values);
        println!("| {label} | {value:.2} | {:.0}% |", value / tcp * 100.0);
    }
    node_a.close();
    Ok(())
}
