//! The SSD tier of mooncake-rs.
//!
//! This crate will hold the staging buffer, the storage backends (bucket, file per key,
//! offset allocator, distributed KV), the POSIX and io_uring I/O engines, recovery and
//! disk eviction. Today it only names the backends so configuration can refer to them;
//! `mooncake_client --enable_offload` is refused until the tier exists.

/// The storage backends the SSD tier will offer, by their configuration names.
pub const BACKENDS: &[&str] = &[
    "bucket_storage_backend",
    "file_per_key_storage_backend",
    "offset_allocator_storage_backend",
    "distributed_kv_storage_backend",
];
