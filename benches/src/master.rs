//! Master metadata throughput: put-start + put-end pairs per second, at 1 k and 1 M
//! keys, with both cores writing, and the memory each key costs.

use std::sync::Arc;
use std::time::Instant;

use mooncake_core::master_api::LOCAL_OWNER;
use mooncake_core::types::ReplicateConfig;
use mooncake_master::{Clock, MasterConfig, MasterService};

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| {
            s.split_whitespace()
                .nth(1)
                .and_then(|p| p.parse::<u64>().ok())
        })
        .map_or(0, |pages| pages * 4096)
}

/// Pairs per second for `keys` keys written by `threads` threads.
fn pairs_per_second(keys: u64, threads: u64) -> (f64, f64) {
    let master = Arc::new(MasterService::new(MasterConfig::default(), Clock::System));
    master
        .mount_segment("bench:1", 1 << 40, LOCAL_OWNER, "", 0)
        .expect("mount");
    let before = rss_bytes();
    let started = Instant::now();
    let workers: Vec<_> = (0..threads)
        .map(|t| {
            let master = Arc::clone(&master);
            std::thread::spawn(move || {
                let config = ReplicateConfig::default();
                for i in (t..keys).step_by(usize::try_from(threads).unwrap_or(1)) {
                    let key = format!("layer-{i:012}");
                    if let Ok(started) = master.put_start(&key, 4096, &config) {
                        let _ = master.put_end(&key, started.write_id);
                    }
                }
            })
        })
        .collect();
    for worker in workers {
        let _ = worker.join();
    }
    let elapsed = started.elapsed();
    #[expect(clippy::cast_precision_loss, reason = "rates")]
    let rate = keys as f64 / elapsed.as_secs_f64();
    #[expect(clippy::cast_precision_loss, reason = "rates")]
    let per_key = rss_bytes().saturating_sub(before) as f64 / keys as f64;
    (rate, per_key)
}

/// Prints the master table.
pub fn run() {
    println!("\nmaster (in-process, 2 writer threads): put_start + put_end pairs");
    println!("\n| keys | pairs/s | bytes per key (RSS growth; key is 18 bytes) |\n|---|---|---|");
    for keys in [1_000u64, 1_000_000] {
        let (rate, per_key) = pairs_per_second(keys, 2);
        println!("| {keys} | {rate:.0} | {per_key:.0} |");
    }
}
