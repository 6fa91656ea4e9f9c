//! The store's vocabulary: object keys, write options and replica descriptors.

use serde::{Deserialize, Serialize};

use crate::error::ErrorCode;

/// Separates the tenant from the key in the master's key space (see
/// [`crate::tenant`]); no key may contain it.
pub const TENANT_SEPARATOR: char = '\u{1f}';

/// Longest key accepted unless the master is configured otherwise.
pub const MAX_KEY_LEN: usize = 4096;

/// Checks that `key` is non-empty and at most `max_len` bytes.
pub fn validate_key(key: &str, max_len: usize) -> Result<(), ErrorCode> {
    if key.is_empty() || key.len() > max_len || key.contains(TENANT_SEPARATOR) {
        Err(ErrorCode::INVALID_KEY)
    } else {
        Ok(())
    }
}

/// What a write does to the object's soft pin (upstream `SoftPinAction`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SoftPinAction {
    /// Keep whatever soft pin the object has.
    #[default]
    Preserve,
    /// Pin the object against eviction for a TTL.
    Enable,
    /// Remove the soft pin.
    Disable,
}

/// Write options, with upstream's field names and defaults.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicateConfig {
    /// Number of memory replicas, placed on distinct segments (best effort).
    pub replica_num: u32,
    /// Soft-pin change applied when the write completes.
    pub soft_pin_action: SoftPinAction,
    /// Soft-pin TTL in milliseconds; `None` means the master's default.
    pub soft_pin_ttl_ms: Option<u64>,
    /// Never evict the object.
    pub with_hard_pin: bool,
    /// Deprecated single preferred segment; when non-empty, `preferred_segments` is ignored.
    pub preferred_segment: String,
    /// Segment names tried first, in order.
    pub preferred_segments: Vec<String>,
    /// Place the replica on the writer's own node when possible.
    pub prefer_alloc_in_same_node: bool,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        ReplicateConfig {
            replica_num: 1,
            soft_pin_action: SoftPinAction::Preserve,
            soft_pin_ttl_ms: None,
            with_hard_pin: false,
            preferred_segment: String::new(),
            preferred_segments: Vec::new(),
            prefer_alloc_in_same_node: false,
        }
    }
}

impl ReplicateConfig {
    /// Rejects option combinations the master cannot honour.
    pub fn validate(&self) -> Result<(), ErrorCode> {
        if self.replica_num == 0 {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        if self.soft_pin_ttl_ms.is_some() && self.soft_pin_action != SoftPinAction::Enable {
            return Err(ErrorCode::INVALID_PARAMS);
        }
        Ok(())
    }

    /// The preferred segment names in the order to try them.
    pub fn preferred(&self) -> Vec<&str> {
        if self.preferred_segment.is_empty() {
            self.preferred_segments.iter().map(String::as_str).collect()
        } else {
            vec![self.preferred_segment.as_str()]
        }
    }
}

/// Identifies a mounted segment (a region of some real client's memory).
pub type SegmentId = u64;

/// Where one replica of an object lives.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicaLocation {
    /// A range inside a mounted memory segment.
    Memory {
        /// The segment holding the bytes.
        segment: SegmentId,
        /// Name of that segment (its owner's host name and port).
        segment_name: String,
        /// Byte offset inside the segment.
        offset: u64,
        /// Where the owner's transfer engine listens (empty: in the master's process).
        endpoint: String,
    },
    /// An object on the SSD tier of a real client.
    Disk {
        /// Name of the owner's memory segment (its host name and port).
        segment_name: String,
        /// Where the owner's transfer engine listens (it serves disk reads too).
        endpoint: String,
    },
}

impl ReplicaLocation {
    /// Name of the segment holding the replica.
    pub fn segment_name(&self) -> &str {
        match self {
            ReplicaLocation::Memory { segment_name, .. }
            | ReplicaLocation::Disk { segment_name, .. } => segment_name,
        }
    }
}

/// Whether a replica can be read yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplicaStatus {
    /// Space is allocated and the writer is filling it.
    Processing,
    /// The bytes are complete and readable.
    Complete,
}

/// A replica as handed to readers and writers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaDescriptor {
    /// Where the bytes are.
    pub location: ReplicaLocation,
    /// Object size in bytes.
    pub size: u64,
    /// Readability.
    pub status: ReplicaStatus,
    /// The master's permission to transfer these bytes (with a cluster secret; see
    /// `protocol::grant`).
    pub grant: Option<crate::protocol::grant::Grant>,
}

/// Whether a write may replace an existing object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum WriteMode {
    /// Insert only: an existing key is kept (and the put reports success).
    Put,
    /// Insert or replace.
    Upsert,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_upstreams() {
        let config = ReplicateConfig::default();
        assert_eq!(config.replica_num, 1);
        assert_eq!(config.soft_pin_action, SoftPinAction::Preserve);
        assert!(config.preferred_segment.is_empty());
        assert!(!config.with_hard_pin);
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn keys() {
        assert_eq!(validate_key("", MAX_KEY_LEN), Err(ErrorCode::INVALID_KEY));
        assert_eq!(validate_key("a", MAX_KEY_LEN), Ok(()));
        let long = "k".repeat(MAX_KEY_LEN + 1);
        assert_eq!(
            validate_key(&long, MAX_KEY_LEN),
            Err(ErrorCode::INVALID_KEY)
        );
    }
}

/// The GPU programming interface a device buffer belongs to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DeviceApi {
    /// NVIDIA CUDA (the driver library `libcuda.so`).
    #[default]
    Cuda,
    /// AMD HIP (the runtime library `libamdhip64.so`, ROCm 6 or later).
    Hip,
}

impl std::fmt::Display for DeviceApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeviceApi::Cuda => "CUDA",
            DeviceApi::Hip => "HIP",
        })
    }
}
