//! Operation counters of the real client, rendered as Prometheus text
//! (`mooncake_client_*`; see [`OpMetrics`]).

use std::time::Duration;

use mooncake_core::error::ErrorCode;
use mooncake_core::op_metrics::OpMetrics;

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

/// Metric label of each [`Op`], in declaration order.
const OP_NAMES: &[&str] = &["put", "get", "get_ranges", "exist", "remove"];

/// Counters of one real client.
#[derive(Debug)]
pub struct Metrics(OpMetrics);

impl Default for Metrics {
    fn default() -> Self {
        Metrics(OpMetrics::new("client", OP_NAMES))
    }
}

impl Metrics {
    /// Records one item of `op` that took `elapsed`, moved `bytes`, and ended with
    /// `result`.
    pub fn record<T>(&self, op: Op, elapsed: Duration, bytes: u64, result: &Result<T, ErrorCode>) {
        self.0.record(op as usize, elapsed, bytes, result);
    }

    /// Prometheus text of every counter.
    pub fn render(&self) -> String {
        self.0.render()
    }
}
