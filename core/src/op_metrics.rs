//! Per-operation counters rendered as Prometheus text, shared by the real client and
//! the master.
//!
//! Per operation: requests, errors by code, payload bytes, and a latency histogram with
//! fixed buckets. Recording is a few relaxed atomic adds (the error map takes a lock,
//! only on errors).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::error::ErrorCode;

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

/// Per-operation counters of one process, rendered as `mooncake_<prefix>_*` metrics.
#[derive(Debug)]
pub struct OpMetrics {
    prefix: &'static str,
    names: &'static [&'static str],
    ops: Box<[OpCounters]>,
    errors: Mutex<BTreeMap<(usize, i32), u64>>,
}

impl OpMetrics {
    /// Counters for the operations `names` (an operation is its index in `names`),
    /// exported as `mooncake_<prefix>_requests_total{op="<name>"}` and so on.
    pub fn new(prefix: &'static str, names: &'static [&'static str]) -> Self {
        OpMetrics {
            prefix,
            names,
            ops: names.iter().map(|_| OpCounters::default()).collect(),
            errors: Mutex::new(BTreeMap::new()),
        }
    }

    /// Records one item of operation `op` (an index into the names) that took
    /// `elapsed`, moved `bytes`, and ended with `result`. An unknown index is ignored.
    pub fn record<T>(
        &self,
        op: usize,
        elapsed: Duration,
        bytes: u64,
        result: &Result<T, ErrorCode>,
    ) {
        let Some(counters) = self.ops.get(op) else {
            return;
        };
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
        let p = self.prefix;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP mooncake_{p}_requests_total Items served, per call kind.\n# TYPE mooncake_{p}_requests_total counter"
        );
        for (name, counters) in self.names.iter().zip(self.ops.iter()) {
            let _ = writeln!(
                out,
                "mooncake_{p}_requests_total{{op=\"{name}\"}} {}",
                counters.requests.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_{p}_bytes_total Payload bytes moved, per call kind.\n# TYPE mooncake_{p}_bytes_total counter"
        );
        for (name, counters) in self.names.iter().zip(self.ops.iter()) {
            let _ = writeln!(
                out,
                "mooncake_{p}_bytes_total{{op=\"{name}\"}} {}",
                counters.bytes.load(Ordering::Relaxed)
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_{p}_errors_total Failed items, per call kind and error code.\n# TYPE mooncake_{p}_errors_total counter"
        );
        for ((op, code), count) in self.errors.lock().iter() {
            let code = ErrorCode::from_i32(*code).map_or("UNKNOWN", ErrorCode::name);
            let name = self.names.get(*op).copied().unwrap_or("unknown");
            let _ = writeln!(
                out,
                "mooncake_{p}_errors_total{{op=\"{name}\",code=\"{code}\"}} {count}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP mooncake_{p}_latency_seconds Time to serve one item, per call kind.\n# TYPE mooncake_{p}_latency_seconds histogram"
        );
        for (name, counters) in self.names.iter().zip(self.ops.iter()) {
            let mut cumulative = 0;
            for (index, bound) in BUCKETS_US.iter().enumerate() {
                cumulative += counters.buckets[index].load(Ordering::Relaxed);
                #[expect(clippy::cast_precision_loss, reason = "bucket bounds are small")]
                let seconds = *bound as f64 / 1e6;
                let _ = writeln!(
                    out,
                    "mooncake_{p}_latency_seconds_bucket{{op=\"{name}\",le=\"{seconds}\"}} {cumulative}"
                );
            }
            cumulative += counters.buckets[BUCKETS_US.len()].load(Ordering::Relaxed);
            let _ = writeln!(
                out,
                "mooncake_{p}_latency_seconds_bucket{{op=\"{name}\",le=\"+Inf\"}} {cumulative}"
            );
            #[expect(clippy::cast_precision_loss, reason = "display")]
            let sum = counters.latency_sum_us.load(Ordering::Relaxed) as f64 / 1e6;
            let _ = writeln!(
                out,
                "mooncake_{p}_latency_seconds_sum{{op=\"{name}\"}} {sum}\nmooncake_{p}_latency_seconds_count{{op=\"{name}\"}} {cumulative}"
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
        let metrics = OpMetrics::new("client", &["put", "get"]);
        metrics.record::<()>(0, Duration::from_micros(30), 4096, &Ok(()));
        metrics.record::<()>(
            1,
            Duration::from_millis(3),
            0,
            &Err(ErrorCode::OBJECT_NOT_FOUND),
        );
        metrics.record::<()>(7, Duration::from_millis(3), 0, &Ok(()));
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
