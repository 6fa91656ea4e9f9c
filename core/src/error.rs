//! Error codes shared by every process, with upstream Mooncake's names and numeric values.
//!
//! The numbers are part of the public contract: Python callers compare return values
//! against them, so a value never changes once published.

use serde::{Deserialize, Serialize};

macro_rules! error_codes {
    ($( $(#[$doc:meta])* $name:ident = $value:literal => $what:literal, )*) => {
        /// A stable, negative status code as returned to callers (`0` is success).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
        #[repr(i32)]
        #[allow(non_camel_case_types, reason = "upstream spells the codes in SCREAMING_CASE")]
        pub enum ErrorCode {
            $( $(#[$doc])* #[doc = $what] $name = $value, )*
        }

        impl ErrorCode {
            /// Every code, in declaration order.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$name,)*];

            /// The upstream name, e.g. `"OBJECT_NOT_FOUND"`.
            pub fn name(self) -> &'static str {
                match self { $(ErrorCode::$name => stringify!($name),)* }
            }

            /// A short human explanation of what the code means.
            pub fn describe(self) -> &'static str {
                match self { $(ErrorCode::$name => $what,)* }
            }

            /// The code for a numeric value, if the value is a known code.
            pub fn from_i32(value: i32) -> Option<ErrorCode> {
                match value { $($value => Some(ErrorCode::$name),)* _ => None }
            }
        }
    };
}

error_codes! {
    OK = 0 => "success",
    INTERNAL_ERROR = -1 => "internal error",
    BUFFER_OVERFLOW = -10 => "buffer overflow",
    SHARD_INDEX_OUT_OF_RANGE = -100 => "shard index out of range",
    SEGMENT_NOT_FOUND = -101 => "segment not found",
    SEGMENT_ALREADY_EXISTS = -102 => "segment already exists",
    CLIENT_NOT_FOUND = -103 => "client not found",
    NO_AVAILABLE_HANDLE = -200 => "no space left in the mounted segments",
    INVALID_VERSION = -300 => "invalid version",
    INVALID_KEY = -400 => "invalid key",
    WRITE_FAIL = -500 => "write failed",
    INVALID_PARAMS = -600 => "invalid parameters",
    ILLEGAL_CLIENT = -601 => "illegal client",
    INVALID_WRITE = -700 => "invalid write",
    INVALID_READ = -701 => "invalid read",
    INVALID_REPLICA = -702 => "invalid replica",
    REPLICA_IS_NOT_READY = -703 => "replica is not ready (write in progress)",
    OBJECT_NOT_FOUND = -704 => "object not found",
    OBJECT_ALREADY_EXISTS = -705 => "object already exists",
    OBJECT_HAS_LEASE = -706 => "object has an active read lease",
    LEASE_EXPIRED = -707 => "lease expired",
    OBJECT_HAS_REPLICATION_TASK = -708 => "object has a replication task",
    OBJECT_NO_REPLICATION_TASK = -709 => "object has no replication task",
    REPLICA_NOT_FOUND = -710 => "replica not found",
    REPLICA_ALREADY_EXISTS = -711 => "replica already exists",
    REPLICA_IS_GONE = -712 => "replica is gone",
    REPLICA_NOT_IN_LOCAL_MEMORY = -713 => "replica is not in local memory",
    OBJECT_REPLICA_BUSY = -714 => "object replica is busy",
    TRANSFER_FAIL = -800 => "transfer failed",
    CHECKSUM_MISMATCH = -801 => "checksum mismatch",
    RPC_FAIL = -900 => "RPC failed (peer unreachable or disconnected)",
    RPC_TIMEOUT = -901 => "RPC timed out",
    ETCD_OPERATION_ERROR = -1000 => "etcd operation error",
    ETCD_KEY_NOT_EXIST = -1001 => "etcd key does not exist",
    ETCD_TRANSACTION_FAIL = -1002 => "etcd transaction failed",
    ETCD_CTX_CANCELLED = -1003 => "etcd context cancelled",
    OPLOG_ENTRY_NOT_FOUND = -1004 => "oplog entry not found",
    K8S_LEASE_OPERATION_ERROR = -1005 => "k8s lease operation error",
    K8S_LEASE_NOT_FOUND = -1006 => "k8s lease not found",
    INCOMPLETE_OPLOG_CATCH_UP = -1007 => "incomplete oplog catch-up",
    UNAVAILABLE_IN_CURRENT_STATUS = -1010 => "unavailable in the current status",
    UNAVAILABLE_IN_CURRENT_MODE = -1011 => "unavailable in the current mode",
    NOT_SUPPORTED = -1012 => "not supported",
    FILE_NOT_FOUND = -1100 => "file not found",
    FILE_OPEN_FAIL = -1101 => "file open failed",
    FILE_READ_FAIL = -1102 => "file read failed",
    FILE_WRITE_FAIL = -1103 => "file write failed",
    FILE_INVALID_BUFFER = -1104 => "invalid file buffer",
    FILE_LOCK_FAIL = -1105 => "file lock failed",
    FILE_INVALID_HANDLE = -1106 => "invalid file handle",
    BUCKET_NOT_FOUND = -1200 => "bucket not found",
    BUCKET_ALREADY_EXISTS = -1201 => "bucket already exists",
    KEYS_EXCEED_BUCKET_LIMIT = -1202 => "keys exceed bucket limit",
    KEYS_ULTRA_LIMIT = -1203 => "keys exceed the limit",
    UNABLE_OFFLOAD = -1300 => "unable to offload",
    UNABLE_OFFLOADING = -1301 => "offloading unavailable",
    TASK_NOT_FOUND = -1400 => "task not found",
    TASK_PENDING_LIMIT_EXCEEDED = -1401 => "task pending limit exceeded",
    JOB_NOT_FOUND = -1402 => "job not found",
    SERIALIZE_UNSUPPORTED = -1500 => "serialization unsupported",
    SERIALIZE_FAIL = -1501 => "serialization failed",
    DESERIALIZE_FAIL = -1502 => "deserialization failed",
    PERSISTENT_FAIL = -1503 => "persistence failed",
    DFS_NETWORK_TIMEOUT = -1600 => "DFS network timeout",
    DFS_SERVICE_UNAVAILABLE = -1601 => "DFS service unavailable",
    DFS_QUOTA_EXCEEDED = -1602 => "DFS quota exceeded",
    DFS_PERMISSION_DENIED = -1603 => "DFS permission denied",
    DFS_STALE_HANDLE = -1604 => "DFS stale handle",
    DFS_PARTIAL_WRITE = -1605 => "DFS partial write",
    TENANT_QUOTA_EXCEEDED = -1700 => "tenant quota exceeded",
    TENANT_NOT_REGISTERED = -1701 => "tenant not registered",
    TENANT_NOT_EMPTY = -1702 => "tenant not empty",
}

impl ErrorCode {
    /// The numeric value callers see (`0` or negative).
    pub fn as_i32(self) -> i32 {
        self as i32
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.name(),
            self.as_i32(),
            self.describe()
        )
    }
}

impl std::error::Error for ErrorCode {}

/// Result of an operation that fails with a stable [`ErrorCode`].
pub type CodeResult<T> = Result<T, ErrorCode>;

/// Converts results to upstream's integer return convention: the value on success, the
/// negative code on failure.
pub trait ToRet {
    /// The upstream-style integer.
    fn to_ret(&self) -> i64;
}

impl ToRet for CodeResult<()> {
    fn to_ret(&self) -> i64 {
        match self {
            Ok(()) => 0,
            Err(code) => i64::from(code.as_i32()),
        }
    }
}

impl ToRet for CodeResult<u64> {
    fn to_ret(&self) -> i64 {
        match self {
            Ok(value) => i64::try_from(*value).unwrap_or(i64::MAX),
            Err(code) => i64::from(code.as_i32()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_match_upstream() {
        assert_eq!(ErrorCode::OBJECT_NOT_FOUND.as_i32(), -704);
        assert_eq!(ErrorCode::OBJECT_HAS_LEASE.as_i32(), -706);
        assert_eq!(ErrorCode::INVALID_PARAMS.as_i32(), -600);
        assert_eq!(ErrorCode::RPC_FAIL.as_i32(), -900);
        assert_eq!(ErrorCode::NO_AVAILABLE_HANDLE.as_i32(), -200);
        assert_eq!(ErrorCode::TENANT_NOT_EMPTY.as_i32(), -1702);
        assert_eq!(ErrorCode::ALL.len(), 72);
    }

    #[test]
    fn round_trips_through_i32() {
        for code in ErrorCode::ALL {
            assert_eq!(ErrorCode::from_i32(code.as_i32()), Some(*code));
        }
        assert_eq!(ErrorCode::from_i32(-2), None);
    }
}
