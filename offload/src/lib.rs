//! The SSD tier of mooncake-rs: configuration, the on-disk record format and the
//! storage backends.
//!
//! The settings (upstream's `MOONCAKE_OFFLOAD_*` variables and path rules,
//! [`config`]), checksummed records ([`record`]), the I/O engines (POSIX, io_uring with
//! a fallback, [`io`]), large batches written with direct writes ([`direct_write`]),
//! the contract of a storage backend ([`backend`]), batches read
//! several records at a time ([`parallel_reads`]), streamed from the device when they
//! lie in order and are not cached ([`direct_run`]), else with their next records
//! hinted to the kernel ([`read_ahead`]), one reader choosing per batch
//! ([`batch_reader`]), the factory that opens the configured one ([`factory`]) and the
//! three
//! local-disk backends: `bucket_storage_backend` ([`bucket`], the default),
//! `file_per_key_storage_backend` ([`file_per_key`]) and
//! `offset_allocator_storage_backend` ([`offset_allocator`]), each with recovery and
//! FIFO/LRU disk eviction under byte and key limits. The real client drives them (its
//! `disk` module).

pub mod backend;
pub mod batch_reader;
pub mod bucket;
pub mod checksum;
pub mod config;
pub mod direct_run;
pub mod direct_write;
pub mod dkv;
pub mod factory;
mod file_per_key;
pub mod io;
mod object_index;
pub mod offset_allocator;
pub mod parallel_reads;
pub mod read_ahead;
pub mod record;
mod record_writer;
#[cfg(test)]
mod test_dir;

/// The storage backends the SSD tier offers, by their configuration names.
pub const BACKENDS: &[&str] = &[
    "bucket_storage_backend",
    "file_per_key_storage_backend",
    "offset_allocator_storage_backend",
    "distributed_kv_storage_backend",
];
