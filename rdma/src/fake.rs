//! The stand-in verbs provider for tests on machines without an RDMA NIC
//! (`fake_verbs/fake_verbs.c`): devices, protection domains, memory regions, queue
//! pairs with verbs' state machine, and one-sided reads and writes between processes
//! of one machine carried out with cross-memory copies; completion queues that
//! overrun; injected failures. See the source for the rules it enforces.

use std::path::{Path, PathBuf};

/// The C source of the stand-in provider.
pub const SOURCE: &str = include_str!("../fake_verbs/fake_verbs.c");

/// Compiles the stand-in into `dir/libibverbs.so.1` and returns its path; point
/// `MOONCAKE_IBVERBS_LIBRARY` at it before the first RDMA call of a process.
pub fn build(dir: &Path) -> std::io::Result<PathBuf> {
    mooncake_core::stand_in::compile(dir, "libibverbs.so.1", SOURCE)
}
