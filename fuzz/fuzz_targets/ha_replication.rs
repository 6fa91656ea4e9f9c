//! What a standby decodes from its leader: a snapshot (installed into a fresh master)
//! and batches of changes (applied one by one). Whatever decodes must install or be
//! refused without a panic, and leave a master that still answers
//! (`mooncake_master::ha::standby::check_foreign_replication_bytes`, which the property
//! test `no_input_panics_the_replication_decoders` runs too).
//!
//! Input: a mode byte (even: a snapshot, odd: a list of changes), then the bytes.

#![no_main]

use libfuzzer_sys::fuzz_target;
use mooncake_master::ha::standby::check_foreign_replication_bytes;

fuzz_target!(|bytes: &[u8]| check_foreign_replication_bytes(bytes));
