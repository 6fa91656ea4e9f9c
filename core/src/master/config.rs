//! Settings of the master service, with upstream's defaults.

use std::time::Duration;

use crate::types::MAX_KEY_LEN;

/// Tunables of [`MasterService`](super::MasterService).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MasterConfig {
    /// How long a read keeps an object from being removed or evicted (`--default_kv_lease_ttl`, 10 s).
    pub default_kv_lease_ttl: Duration,
    /// A write left unfinished this long may be discarded by a new writer of the same key
    /// (`--put_start_discard_timeout_sec`, 30 s).
    pub put_start_discard_timeout: Duration,
    /// Space of a discarded write is reused only after this long, so a slow writer cannot
    /// corrupt a newer object (`--put_start_release_timeout_sec`, 600 s).
    pub put_start_release_timeout: Duration,
    /// Longest accepted key in bytes (4096).
    pub max_key_len: usize,
    /// Number of metadata shards, each with its own lock (64).
    pub shard_count: usize,
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            default_kv_lease_ttl: Duration::from_secs(10),
            put_start_discard_timeout: Duration::from_secs(30),
            put_start_release_timeout: Duration::from_secs(600),
            max_key_len: MAX_KEY_LEN,
            shard_count: 64,
        }
    }
}
