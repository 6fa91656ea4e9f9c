//! Operation counters of the real client, rendered as Prometheus text
//! (`mooncake_client_*`; see [`OpMetrics`]), and the count of bytes that were not moved
//! zero-copy ([`Metrics::add_staged`]).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
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
pub struct Metrics {
    ops: OpMetrics,
    staged: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            ops: OpMetrics::new("client", OP_NAMES),
            staged: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// Records one item of `op` that took `elapsed`, moved `bytes`, and ended with
    /// `result`.
    pub fn record<T>(&self, op: Op, elapsed: Duration, bytes: u64, result: &Result<T, ErrorCode>) {
        self.ops.record(op as usize, elapsed, bytes, result);
    }

    /// Counts `bytes` a dummy request moved through the dummy's staging buffer or inside
    /// the RPC message itself: bytes the dummy copied once more than a zero-copy transfer
    /// would have.
    pub fn add_staged(&self, bytes: u64) {
        self.staged.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Bytes counted by [`Metrics::add_staged`] since start.
    pub fn staged_bytes(&self) -> u64 {
        self.staged.load(Ordering::Relaxed)
    }

    /// Prometheus text of every counter.
    pub fn render(&self) -> String {
        let mut text = self.ops.render();
        let _ = write!(
            text,
            "# HELP mooncake_client_staged_bytes_total Bytes dummies moved through their staging buffer or inside RPC messages instead of zero-copy.\n\
             # TYPE mooncake_client_staged_bytes_total counter\n\
             mooncake_client_staged_bytes_total {}\n",
            self.staged_bytes()
        );
        let _ = write!(
            text,
            "# HELP mooncake_client_device_handles GPU allocations of dummies held open (CUDA IPC handles).\n\
             # TYPE mooncake_client_device_handles gauge\n\
             mooncake_client_device_handles {}\n",
            mooncake_device::driver::open_handles()
        );
        let _ = write!(
            text,
            "# HELP mooncake_client_segment_pinned_bytes Bytes of the global segment pinned for GPU copies (0 until the first GPU buffer is registered and pinning finished).\n\
             # TYPE mooncake_client_segment_pinned_bytes gauge\n\
             mooncake_client_segment_pinned_bytes {}\n",
            crate::device_buffers::segment_pinned_bytes()
        );
        let _ = write!(
            text,
            "# HELP mooncake_client_rdma_bytes_total Bytes this node moved to and from peers with one-sided RDMA (0 over TCP).\n\
             # TYPE mooncake_client_rdma_bytes_total counter\n\
             mooncake_client_rdma_bytes_total {}\n",
            mooncake_rdma::queue_pair::bytes_moved()
        );
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_bytes_are_summed_and_rendered() {
        let metrics = Metrics::default();
        assert!(
            metrics
                .render()
                .contains("\nmooncake_client_staged_bytes_total 0\n")
        );
        metrics.add_staged(4096);
        metrics.add_staged(10);
        assert_eq!(metrics.staged_bytes(), 4106);
        assert!(
            metrics
                .render()
                .contains("\nmooncake_client_staged_bytes_total 4106\n")
        );
    }
}
