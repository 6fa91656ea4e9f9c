//! Operation counters of the real client, rendered as Prometheus text.
//!
//! Per call kind: requests, errors by code, payload bytes, and a latency histogram with
//! fixed buckets. Recording is a few relaxed atomic adds (the error map takes a lock,
//! only on errors).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use mooncake_core::error::ErrorCode;

/// The call kinds that are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Op {
    /// Writes (put and upsert).
    Put,
    /// Whole-object reads.
    Get,
    /// Ranged reads.
    GetRanges,
    /// Existence checks.
    Exist,
    /// Removals.
    Remove,
}

impl Op {
    const ALL: [Op; 5] = [Op::Put, Op::Get, Op::GetRanges, Op::Exist, Op::Remove];

    fn name(self) -> &'static str {
        match self {
            Op::Put => "put",
            Op::Get => "get",
            Op::GetRanges => "get_ranges",
            Op::Exist => "exist",
            Op::Remove => "remove",
        }
    }
}

/// Upper bounds of the latency buckets, in microseconds.
const BUCKETS_US: [u64; 12] = [
    10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 100_000, 1_000_000,
];

#[derive(Debug, Default)]
struct OpCounters {
    requests: AtomicU64,
    bytes: AtomicU64,
    latency_sum_us: AtomicU64,
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
}

/// Counters of one real client.
#[derive(Debug, Default)]
pub struct Metrics {
    ops: [OpCounters; 5],
    errors: Mutex<BTreeMap<(Op, i32), u64>>,
}

impl Metrics {
    /// Records one item of `op` that took `elapsed`, moved `bytes`, and ended with
    /// `result`.
    pub fn record<T>(&self, op: Op, elapsed: Duration, bytes: u64, result: &Result<T, ErrorCode>) {
        let counters = &self.ops[op as usize];
        counters.requests.fetch_add(1, Ordering::Relaxed);
        counters.bytes.fetch_add(bytes, Ordering::Relaxed);
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        counters.latency_sum_us.fetch_add(us, Ordering::Relaxed);
        let bucket = BUCKETS_US
            .iter()
            .position(|b| us <= *b)
            .unwrap_or(BUCKETS_US.len());
        counters.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        if let Err(code) = result {
            *self.errors.lock().entry((op, code.as_i32())).or_default() += 1;
        }
    }

    /// Prometheus text of every counter.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP mooncake_client_requests_total Items served, per call kind.\n# TYPE mooncake_client_requests_total counter"
        );
        for op in Op::ALL {
            let _ = writeln!(
                out,
                "mooncake_client_requests_total{{op=\"{}\"}} {}",
                op.name(),
                self.ops[op as usize].requests.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_client_bytes_total Payload bytes moved, per call kind.\n# TYPE mooncake_client_bytes_total counter"
        );
        for op in Op::ALL {
            let _ = writeln!(
                out,
                "mooncake_client_bytes_total{{op=\"{}\"}} {}",
                op.name(),
                self.ops[op as usize].bytes.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_client_errors_total Failed items, per call kind and error code.\n# TYPE mooncake_client_errors_total counter"
        );
        for ((op, code), count) in self.errors.lock().iter() {
            let name = ErrorCode::from_i32(*code).map_or("UNKNOWN", ErrorCode::name);
            let _ = writeln!(
                out,
                "mooncake_client_errors_total{{op=\"{}\",code=\"{name}\"}} {count}",
                op.name()
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_client_latency_seconds Time to serve one item, per call kind.\n# TYPE mooncake_client_latency_seconds histogram"
        );
        for op in Op::ALL {
            let counters = &self.ops[op as usize];
            let mut cumulative = 0;
            for (index, bound) in BUCKETS_US.iter().enumerate() {
                cumulative += counters.buckets[index].load(Ordering::Relaxed);
                #[expect(clippy::cast_precision_loss, reason = "bucket bounds are small")]
                let seconds = *bound as f64 / 1e6;
                let _ = writeln!(
                    out,
                    "mooncake_client_latency_seconds_bucket{{op=\"{}\",le=\"{seconds}\"}} {cumulative}",
                    op.name()
                );
            }
            cumulative += counters.buckets[BUCKETS_US.len()].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "mooncake_client_latency_seconds_bucket{{op=\"{}\",le=\"+Inf\"}} {cumulative}",
                op.name()
            );
            #[expect(clippy::cast_precision_loss, reason = "display")]
            let sum = counters.latency_sum_us.load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(
                out,
                "mooncake_client_latency_seconds_sum{{op=\"{}\"}} {sum}\nmooncake_client_latency_seconds_count{{op=\"{}\"}} {cumulative}",
                op.name(),
                op.name()
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counts_errors_and_histograms() {
        let metrics = Metrics::default();
        metrics.record::<()>(Op::Put, Duration::from_micros(30), 4096, &Ok(()));
        metrics.record::<()>(
            Op::Get,
            Duration::from_millis(3),
            0,
            &Err(ErrorCode::OBJECT_NOT_FOUND),
        );
        let text = metrics.render();
        assert!(
            text.contains("mooncake_client_requests_total{op=\"put\"} 1"),
            "{text}"
        );
        assert!(text.contains("mooncake_client_bytes_total{op=\"put\"} 4096"));
        assert!(
            text.contains("mooncake_client_errors_total{op=\"get\",code=\"OBJECT_NOT_FOUND\"} 1")
        );
        assert!(
            text.contains("mooncake_client_latency_seconds_bucket{op=\"put\",le=\"0.00005\"} 1")
        );
        assert!(text.contains("mooncake_client_latency_seconds_count{op=\"get\"} 1"));
    }
}
