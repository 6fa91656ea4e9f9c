//! The RPC service a real client offers its dummies.
//!
//! Addresses in requests are the dummy's own: the real client translates each
//! [`MemRange`] through the segments that dummy registered, or, for ordinary memory the
//! dummy declared with [`RealClientRpc::declare_memory`], reaches it across processes;
//! it rejects any range that is not wholly inside one segment or one declared range with
//! `INVALID_PARAMS`, before any byte moves.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::bounded::{self, Batch, Elements};
use crate::error::CodeResult;
use crate::master_api::{MasterStats, TaskInfo};
use crate::types::{ReplicaDescriptor, ReplicateConfig};

/// Deadline for calls that only touch metadata.
pub const CONTROL_DEADLINE: Duration = Duration::from_secs(30);
/// Deadline for calls that move payload bytes (large batches included).
pub const DATA_DEADLINE: Duration = Duration::from_secs(600);

/// Most payload bytes one request or reply carries inline (below the frame limit,
/// `codec::MAX_RPC_FRAME`, with room for keys and ranges). Larger values travel
/// through shared memory: the staging buffer, else a block of the dummy's pool.
pub const MAX_INLINE_BYTES: u64 = 48 << 20;

/// Most ranges of ordinary memory one dummy may declare at a time
/// ([`RealClientRpc::declare_memory`]); further ones are refused with
/// `NO_AVAILABLE_HANDLE` and stay on the staging path.
pub const MAX_DECLARED_RANGES: usize = 4096;

/// A byte range in the dummy's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemRange {
    /// Start address in the dummy.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Where a put's bytes come from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PutSource {
    /// Ranges of the dummy's shared memory, concatenated in order (zero-copy).
    Shared(#[serde(deserialize_with = "bounded::vec")] Vec<MemRange>),
    /// Bytes carried in the request (fallback when they fit no shared buffer).
    Inline(ByteBuf),
}

/// One object to write.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutItem {
    /// Object key.
    pub key: String,
    /// Its bytes.
    pub source: PutSource,
}

pub use crate::types::WriteMode;

/// One object to read into the dummy's shared memory.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GetItem {
    /// Object key.
    pub key: String,
    /// Destination ranges, filled in order; together at least the object's size.
    #[serde(deserialize_with = "bounded::vec")]
    pub dests: Vec<MemRange>,
}

/// One fragment of a ranged read: `dest.len` bytes from `src_offset` of the object.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fragment {
    /// Where the bytes go.
    pub dest: MemRange,
    /// Offset inside the object.
    pub src_offset: u64,
}

/// Ranged reads of one object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeRead {
    /// Object key.
    pub key: String,
    /// The fragments to copy.
    #[serde(deserialize_with = "bounded::vec")]
    pub fragments: Vec<Fragment>,
}

/// Whether the real client reads and writes a dummy's declared ordinary memory
/// directly (`process_vm_readv` / `process_vm_writev`), probed once per session.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CrossMemory {
    /// Declared ranges are copied once, straight to and from the dummy's memory.
    Available,
    /// The kernel or its policy forbids it; the text says which errno and what to do.
    /// Declared ranges must then be copied through the staging buffer.
    Unavailable(String),
}

/// Answer to [`RealClientRpc::declare_memory`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Declaration {
    /// One result per declared range: `INVALID_PARAMS` for an empty or wrapping range,
    /// `NO_AVAILABLE_HANDLE` past [`MAX_DECLARED_RANGES`].
    pub accepted: Vec<CodeResult<()>>,
    /// Whether declared ranges can be used in place.
    pub cross_memory: CrossMemory,
}

/// A GPU buffer a dummy registered, for [`RealClientRpc::declare_device`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceBufferDecl {
    /// Start of the buffer in the dummy.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Device ordinal.
    pub device: i32,
    /// Start of the device allocation holding the buffer, in the dummy.
    pub alloc_base: u64,
    /// Length of that allocation.
    pub alloc_len: u64,
    /// The allocation's IPC handle (64 bytes).
    pub handle: ByteBuf,
    /// The GPU interface the allocation belongs to (which driver opens the handle).
    pub api: crate::types::DeviceApi,
}

/// Answer to [`RealClientRpc::ping`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PingReply {
    /// Instance id of the real client (changes when it restarts).
    pub instance_id: u128,
    /// Whether the real client can reach its master.
    pub master_ok: bool,
    /// Name of the real client's segment (its `host:port`).
    pub segment_name: String,
}

/// A dummy attached to the real client, for status reports.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DummyInfo {
    /// The dummy's random id.
    pub client_id: u128,
    /// Its process id.
    pub pid: u32,
    /// Its uid (from the socket credentials).
    pub uid: u32,
    /// Its self-reported name.
    pub name: String,
    /// Segments it registered.
    pub segments: u32,
    /// Bytes of its shared memory the real client has mapped.
    pub mapped_bytes: u64,
    /// Ranges of ordinary memory it declared.
    pub declared_ranges: u32,
    /// Whether its declared memory is reached directly (false: not probed yet, or
    /// not permitted: the dummy copies through its staging buffer).
    pub cross_memory: bool,
    /// GPU buffers it registered.
    pub device_buffers: u32,
}

/// Answer to [`RealClientRpc::status`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Instance id of the real client.
    pub instance_id: u128,
    /// Process id of the real client.
    pub pid: u32,
    /// Name of its global segment.
    pub segment_name: String,
    /// Seconds since it started.
    pub uptime_secs: u64,
    /// Attached dummies.
    pub dummies: Vec<DummyInfo>,
    /// Bytes of dummy shared memory mapped in total.
    pub mapped_bytes: u64,
    /// The master's view: objects and segment usage (and, under high availability, the
    /// leader and its standbys).
    pub master: MasterStats,
    /// Where the real client's master is: `embedded`, `host:port` or `etcd://…`.
    pub master_at: String,
    /// Reads served from another node's SSD tier since start (upstream's
    /// `get_offload_rpc_read_count`).
    pub remote_disk_reads: u64,
    /// Bytes of this node's global segment.
    pub segment_bytes: u64,
    /// Bytes of it faulted in so far: the segment is faulted in by a background thread
    /// after start-up (and by first use), not before the real client serves.
    pub segment_resident_bytes: u64,
    /// Bytes dummies moved through their staging buffers or inside RPC messages since
    /// start (`mooncake_client_staged_bytes_total`): zero while every transfer is
    /// zero-copy.
    pub staged_bytes: u64,
    /// Reads that copied with the replica list of an earlier read of this real client,
    /// without asking the master (`mooncake_client_read_cache_hits_total`; see
    /// `--read_cache_ms`).
    pub read_cache_hits: u64,
    /// Puts completed into space reserved ahead of their keys, with one master round
    /// trip (`mooncake_client_reserved_puts_total`; see `real_client::reservations`).
    pub reserved_puts: u64,
    /// GPU allocations of dummies this process holds open (CUDA IPC handles).
    pub device_handles: u64,
    /// Bytes of the global segment pinned for GPU copies (`cuMemHostRegister` /
    /// `hipHostRegister`): 0 until the first GPU buffer is registered and while the
    /// background pinning runs, then the segment's size (0 again if pinning failed).
    pub segment_pinned_bytes: u64,
    /// When this process took its node over from another (`mooncake_client
    /// --takeover`): what it took over.
    pub taken_over: Option<TakenOver>,
}

/// What a real client took over from the process it replaced: by a planned handover
/// (`--takeover`), or from its segment file (`--segment_path`) after the process before
/// it ended without one (a crash; `from_pid` 0, and `objects` and `segment_bytes` count
/// the objects found whole).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakenOver {
    /// Process id of the process taken over (0: none, a restart on the segment file).
    pub from_pid: u32,
    /// Bytes of the segment taken over (the same memory, not copied).
    pub segment_bytes: u64,
    /// Objects of the embedded master taken over (0 with a remote master, which kept
    /// them).
    pub objects: u64,
    /// Milliseconds from this process's start to serving.
    pub took_ms: u64,
    /// When it took over (seconds since the Unix epoch).
    pub at_unix_secs: u64,
}

impl Elements for MemRange {
    fn elements(&self) -> usize {
        1
    }
}

impl Elements for PutItem {
    fn elements(&self) -> usize {
        match &self.source {
            PutSource::Shared(ranges) => 1 + ranges.len(),
            PutSource::Inline(_) => 1,
        }
    }
}

impl Elements for GetItem {
    fn elements(&self) -> usize {
        1 + self.dests.len()
    }
}

impl Elements for RangeRead {
    fn elements(&self) -> usize {
        1 + self.fragments.len()
    }
}

/// Calls a dummy makes to its real client. Every list of a request counts against
/// [`bounded::MAX_REQUEST_ELEMENTS`]; the dummy splits larger batches.
#[tarpc::service]
pub trait RealClientRpc {
    /// Health check; also reports master connectivity.
    async fn ping() -> PingReply;
    /// For each key: whether it exists (grants a read lease when it does).
    async fn exist(keys: Batch<String>) -> Vec<CodeResult<bool>>;
    /// Size of an object.
    async fn object_size(key: String) -> CodeResult<u64>;
    /// Writes objects. With [`WriteMode::Put`] an existing key is left unchanged and
    /// reported as success; with [`WriteMode::Upsert`] it is replaced.
    async fn put(
        items: Batch<PutItem>,
        config: ReplicateConfig,
        mode: WriteMode,
    ) -> Vec<CodeResult<()>>;
    /// Reads objects into shared memory; each result is the object size.
    /// Destinations smaller than the object are `BUFFER_OVERFLOW`.
    async fn get(items: Batch<GetItem>) -> Vec<CodeResult<u64>>;
    /// Copies fragments of objects; one result (bytes copied or error) per fragment.
    async fn get_ranges(reads: Batch<RangeRead>) -> Vec<Vec<CodeResult<u64>>>;
    /// Replica descriptors of objects (no lease is granted).
    async fn replica_desc(keys: Batch<String>) -> Vec<CodeResult<Vec<ReplicaDescriptor>>>;
    /// Removes every object whose key matches a regular expression; returns how many.
    async fn remove_by_regex(pattern: String, force: bool) -> CodeResult<u64>;
    /// Starts copying an object to other segments; returns the task id.
    async fn create_copy_task(key: String, targets: Batch<String>) -> CodeResult<u128>;
    /// Starts moving an object between segments; returns the task id.
    async fn create_move_task(key: String, source: String, target: String) -> CodeResult<u128>;
    /// The state of a task.
    async fn query_task(id: u128) -> CodeResult<TaskInfo>;
    /// Reads a whole object into the reply (fallback for values larger than staging).
    async fn get_inline(key: String) -> CodeResult<ByteBuf>;
    /// Removes objects (`OBJECT_HAS_LEASE` under a lease unless `force`).
    async fn remove(keys: Batch<String>, force: bool) -> Vec<CodeResult<()>>;
    /// Removes every object; returns how many.
    async fn remove_all(force: bool) -> CodeResult<u64>;
    /// Clears objects nobody read or wrote for one lease TTL (upstream's
    /// `batch_replica_clear`): their memory replicas on the segment named `segment`
    /// (at most [`MAX_KEY_LEN`](crate::types::MAX_KEY_LEN) bytes), or (`None`) the whole
    /// objects.
    async fn clear_replicas(keys: Batch<String>, segment: Option<String>) -> Vec<CodeResult<()>>;
    /// The real client's state: dummies, mappings, segment usage, object count.
    async fn status() -> StatusReport;
    /// Declares ranges of the dummy's ordinary memory (registered buffers outside its
    /// shared memory) that requests may then name; a range declared again at the same
    /// address replaces the earlier one. At most [`MAX_DECLARED_RANGES`] per call and
    /// per session. The first declaration of a session probes whether the real client
    /// may reach the dummy's memory.
    async fn declare_memory(ranges: Batch<MemRange>) -> Declaration;
    /// Forgets the declared range starting at `addr` (its buffer was unregistered);
    /// `INVALID_PARAMS` when none starts there.
    async fn forget_memory(addr: u64) -> CodeResult<()>;
    /// Registers a GPU buffer of the dummy: the real client opens its allocation from
    /// the IPC handle (once per allocation and session) and copies requests' ranges
    /// inside it straight between the device and its segment. The error says why the
    /// buffer cannot be reached (no driver here, a refused handle, too many buffers).
    async fn declare_device(buffer: DeviceBufferDecl) -> Result<(), String>;
}
