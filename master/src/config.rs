//! Settings of the master service, with upstream's defaults.

use std::time::Duration;

use mooncake_core::types::MAX_KEY_LEN;

/// Longest soft pin an object entry records: `u32::MAX` milliseconds (49.7 days); longer ones
/// are cut to it (the configuration refuses longer TTLs).
pub const MAX_ENTRY_TTL: Duration = Duration::from_millis(u32::MAX as u64);

/// Longest read lease an object entry records: `u32::MAX` microseconds (71.5 minutes); longer
/// ones are cut to it (the configuration refuses longer TTLs). Leases are kept to the
/// microsecond so that a lease ends no later than one TTL after the read that took it:
/// a `remove` sent once the TTL has passed is never refused.
pub const MAX_LEASE_TTL: Duration = Duration::from_micros(u32::MAX as u64);

/// How the master picks segments for new replicas (after any preferred segments).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AllocationStrategy {
    /// A random order per allocation (`random`, the default).
    #[default]
    Random,
    /// The segments with the largest free fraction first (`free_ratio_first`).
    FreeRatioFirst,
}

impl AllocationStrategy {
    /// Parses upstream's names.
    pub fn parse(text: &str) -> Option<Self> {
        match text.trim() {
            "random" => Some(AllocationStrategy::Random),
            "free_ratio_first" => Some(AllocationStrategy::FreeRatioFirst),
            _ => None,
        }
    }
}

/// Tunables of [`MasterService`](super::MasterService).
#[derive(Clone, Debug, PartialEq)]
pub struct MasterConfig {
    /// How long a read keeps an object from being removed or evicted (`--default_kv_lease_ttl`, 10 s).
    pub default_kv_lease_ttl: Duration,
    /// Soft-pin TTL when a write enables soft pin without one (`--default_kv_soft_pin_ttl`, 30 min).
    pub default_kv_soft_pin_ttl: Duration,
    /// Longest soft-pin TTL a write may ask for (`--max_kv_soft_pin_ttl`, 24 h).
    pub max_kv_soft_pin_ttl: Duration,
    /// Whether eviction may take soft-pinned objects when nothing else is left
    /// (`--allow_evict_soft_pinned_objects`, true).
    pub allow_evict_soft_pinned_objects: bool,
    /// Fraction of capacity freed by one eviction round (`--eviction_ratio`, 0.05).
    pub eviction_ratio: f64,
    /// Eviction starts when this fraction of all memory is used
    /// (`--eviction_high_watermark_ratio`, 0.90).
    pub eviction_high_watermark_ratio: f64,
    /// A real client silent this long loses its segments (`--client_ttl`, 10 s).
    pub client_ttl: Duration,
    /// How long after `client_ttl` a silent client's segment file stays mounted, with
    /// its objects, for its restarted process to take back (`--remount_grace`, 5 s).
    pub remount_grace: Duration,
    /// A write left unfinished this long may be discarded by a new writer of the same key
    /// (`--put_start_discard_timeout_sec`, 30 s).
    pub put_start_discard_timeout: Duration,
    /// Space of a discarded write is reused only after this long, so a slow writer cannot
    /// corrupt a newer object (`--put_start_release_timeout_sec`, 600 s).
    pub put_start_release_timeout: Duration,
    /// Placement order of segments (`--allocation_strategy`, random).
    pub allocation_strategy: AllocationStrategy,
    /// A copy or move task not started by its real client within this time fails
    /// (`--pending_task_timeout_sec`, 300 s).
    pub pending_task_timeout: Duration,
    /// A started copy or move task not reported within this time fails and its space is
    /// freed (`--processing_task_timeout_sec`, 300 s).
    pub processing_task_timeout: Duration,
    /// Real clients may keep copies of objects on their SSD tier (`--enable_offload`).
    pub enable_offload: bool,
    /// Objects reach the SSD tier when chosen for eviction, not when written
    /// (`--offload_on_evict`).
    pub offload_on_evict: bool,
    /// Longest accepted key in bytes (4096).
    pub max_key_len: usize,
    /// Number of metadata shards, each with its own lock (64).
    pub shard_count: usize,
}

impl Default for MasterConfig {
    fn default() -> Self {
        MasterConfig {
            default_kv_lease_ttl: Duration::from_secs(10),
            default_kv_soft_pin_ttl: Duration::from_secs(30 * 60),
            max_kv_soft_pin_ttl: Duration::from_secs(24 * 3600),
            allow_evict_soft_pinned_objects: true,
            eviction_ratio: 0.05,
            eviction_high_watermark_ratio: 0.90,
            client_ttl: Duration::from_secs(10),
            remount_grace: Duration::from_secs(5),
            put_start_discard_timeout: Duration::from_secs(30),
            put_start_release_timeout: Duration::from_secs(600),
            pending_task_timeout: Duration::from_secs(300),
            processing_task_timeout: Duration::from_secs(300),
            enable_offload: false,
            offload_on_evict: false,
            allocation_strategy: AllocationStrategy::Random,
            max_key_len: MAX_KEY_LEN,
            shard_count: 64,
        }
    }
}

impl MasterConfig {
    /// Rejects inconsistent settings, naming the flag.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.eviction_ratio) {
            return Err("--eviction_ratio must be between 0 and 1".into());
        }
        if !(0.0..=1.0).contains(&self.eviction_high_watermark_ratio)
            || self.eviction_high_watermark_ratio == 0.0
        {
            return Err("--eviction_high_watermark_ratio must be in (0, 1]".into());
        }
        if self.max_kv_soft_pin_ttl < self.default_kv_soft_pin_ttl {
            return Err("--max_kv_soft_pin_ttl must be at least --default_kv_soft_pin_ttl".into());
        }
        if self.put_start_release_timeout <= self.put_start_discard_timeout {
            return Err("--put_start_release_timeout_sec must be larger than --put_start_discard_timeout_sec".into());
        }
        if self.default_kv_lease_ttl.is_zero() || self.client_ttl.is_zero() {
            return Err("--default_kv_lease_ttl and --client_ttl must be larger than zero".into());
        }
        if self.default_kv_lease_ttl > MAX_LEASE_TTL {
            return Err("--default_kv_lease_ttl must be at most 4294967 ms (71 minutes)".into());
        }
        if self.max_kv_soft_pin_ttl > MAX_ENTRY_TTL {
            return Err("--max_kv_soft_pin_ttl must be at most 4294967295 ms (49 days)".into());
        }
        Ok(())
    }
}
