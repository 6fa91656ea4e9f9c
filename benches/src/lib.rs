//! Benchmarks of mooncake-rs. The end-to-end tool is the `mooncake_bench` binary; see
//! its module documentation for what it measures.
