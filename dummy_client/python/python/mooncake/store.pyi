"""Type stubs of ``mooncake.store``: the Mooncake Store client (mooncake-rs).

Dummy mode (``setup_dummy``) attaches to the node's ``mooncake_client``; embedded mode
(``setup``) runs the real client in this process. Both offer the same calls, with
upstream's names, parameters and return conventions: ``0``/positive on success, a
negative code (``ERROR_CODES``) on failure, one entry per input for batch calls. Every
method of ``MooncakeDistributedStore`` is listed here. See ``docs/python-api.md``, and
``docs/migration.md`` for what differs from upstream.
"""

import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Final, TypedDict

from typing_extensions import Buffer

from ._extras import BufferLease as BufferLease
from ._extras import BufferLeaseView as BufferLeaseView
from ._extras import BufferPool as BufferPool
from ._extras import EngramStore as EngramStore
from ._extras import EngramStoreConfig as EngramStoreConfig
from ._extras import MooncakeDistributedNoFRegister as MooncakeDistributedNoFRegister
from ._extras import RegisteredBufferLease as RegisteredBufferLease
from ._extras import RegisteredBufferLeaseView as RegisteredBufferLeaseView
from ._extras import RegisteredBufferPool as RegisteredBufferPool
from ._extras import bind_to_numa_node as bind_to_numa_node
from ._store import ERROR_CODES as ERROR_CODES
from ._store import SoftPinAction as SoftPinAction
from ._store import _StoreBase
from ._tensor_api import ACTIVATION as ACTIVATION
from ._tensor_api import GENERAL as GENERAL
from ._tensor_api import GRADIENT as GRADIENT
from ._tensor_api import KVCACHE as KVCACHE
from ._tensor_api import METADATA as METADATA
from ._tensor_api import OPTIMIZER_STATE as OPTIMIZER_STATE
from ._tensor_api import SAMPLE as SAMPLE
from ._tensor_api import TENSOR as TENSOR
from ._tensor_api import UNKNOWN as UNKNOWN
from ._tensor_api import WEIGHT as WEIGHT
from ._tensor_api import ObjectDataType as ObjectDataType
from ._tensor_api import ParallelAxis as ParallelAxis
from ._tensor_api import ReadTarget as ReadTarget
from ._tensor_api import TensorParallelism as TensorParallelism
from ._tensor_api import _deserialize_tensor as _deserialize_tensor
from ._tensor_api import _serialize_tensor as _serialize_tensor
from ._tensor_api import _tensor_metadata_size as _tensor_metadata_size
from ._types import COMPLETE as COMPLETE
from ._types import FAILED as FAILED
from ._types import INITIALIZED as INITIALIZED
from ._types import PENDING as PENDING
from ._types import PROCESSING as PROCESSING
from ._types import REMOVED as REMOVED
from ._types import REPLICA_COPY as REPLICA_COPY
from ._types import REPLICA_MOVE as REPLICA_MOVE
from ._types import SUCCESS as SUCCESS
from ._types import UNDEFINED as UNDEFINED
from ._types import Descriptor as Descriptor
from ._types import DiskDescriptor as DiskDescriptor
from ._types import MemoryDescriptor as MemoryDescriptor
from ._types import QueryTaskResponse as QueryTaskResponse
from ._types import ReplicaDescriptor as ReplicaDescriptor
from ._types import ReplicaStatus as ReplicaStatus
from ._types import TaskStatus as TaskStatus
from ._types import TaskType as TaskType

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "BufferHandle",
    "ERROR_CODES",
    "MooncakeHostMemAllocator",
    "get_alloc_func_addr",
    "get_free_func_addr",
    "ObjectDataType",
    "ParallelAxis",
    "TensorParallelism",
    "ReadTarget",
    "UNKNOWN",
    "KVCACHE",
    "TENSOR",
    "WEIGHT",
    "SAMPLE",
    "ACTIVATION",
    "GRADIENT",
    "OPTIMIZER_STATE",
    "METADATA",
    "GENERAL",
    "_serialize_tensor",
    "_deserialize_tensor",
    "_tensor_metadata_size",
    "BufferPool",
    "RegisteredBufferPool",
    "BufferLease",
    "BufferLeaseView",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "bind_to_numa_node",
    "EngramStore",
    "EngramStoreConfig",
    "MooncakeDistributedNoFRegister",
    "ReplicaStatus",
    "TaskStatus",
    "TaskType",
    "Descriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "ReplicaDescriptor",
    "QueryTaskResponse",
    "UNDEFINED",
    "INITIALIZED",
    "COMPLETE",
    "REMOVED",
    "PENDING",
    "PROCESSING",
    "SUCCESS",
    "FAILED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
]

_Tensor = Any
"""A ``numpy.ndarray`` or a ``torch.Tensor`` (stub-only alias)."""

_TaskId = tuple[int, int]
"""A task id: upstream's ``(high, low)`` pair of 64-bit ints (stub-only alias)."""

log: logging.Logger
"""The ``mooncake`` logger: setup failures, configuration problems and tensors that cannot be stored are logged here."""

INVALID_PARAMS: Final[int]
"""``ERROR_CODES["INVALID_PARAMS"]`` (-600)."""

NO_AVAILABLE_HANDLE: Final[int]
"""``ERROR_CODES["NO_AVAILABLE_HANDLE"]`` (-200)."""

OBJECT_NOT_FOUND: Final[int]
"""``ERROR_CODES["OBJECT_NOT_FOUND"]`` (-704)."""

OBJECT_ALREADY_EXISTS: Final[int]
"""``ERROR_CODES["OBJECT_ALREADY_EXISTS"]`` (-705)."""

NOT_SUPPORTED: Final[int]
"""``ERROR_CODES["NOT_SUPPORTED"]`` (-1012)."""

class _SegmentResult(TypedDict):
    """What ``mount_segment`` and ``allocate_and_mount_segment`` return (stub-only name)."""

    code: int
    segment_ids: list[str]

class ReplicateConfig:
    """Write options (upstream's fields; a value of the wrong type or sign raises ``TypeError``)."""

    replica_num: int
    """Memory replicas on distinct segments, best effort (default 1; 0 is ``INVALID_PARAMS``)."""
    soft_pin_action: SoftPinAction
    """What the write does to the soft pin (default ``PRESERVE``)."""
    soft_pin_ttl_ms: int | None
    """Soft-pin TTL in ms with ``soft_pin_action = ENABLE`` (``None``: the master's default)."""
    with_soft_pin: bool
    """Older spelling: ``True`` sets ``soft_pin_action = ENABLE``."""
    with_hard_pin: bool
    """Never evict the object."""
    preferred_segment: str
    """One preferred segment (``host:port``); when set, ``preferred_segments`` is ignored."""
    preferred_segments: list[str]
    """Segments tried first, in order (reading returns a copy)."""
    prefer_alloc_in_same_node: bool
    """Accepted; no effect."""
    group_ids: list[str] | None
    """Upstream's replica groups; kept, not used for placement (default ``None``)."""
    data_type: ObjectDataType
    """The object's ``ObjectDataType``; kept, no effect (default ``UNKNOWN``)."""
    nof_replica_num: int
    """Replicas on NVMe-oF targets; accepted, no effect (default 0)."""
    dfs_replica_num: int
    """Replicas on a distributed file system; accepted, no effect (default 0)."""
    preferred_nof_segments: list[str]
    """Preferred NVMe-oF segments; accepted, no effect (default ``[]``)."""

    def __init__(self) -> None:
        """Upstream's defaults; set the attributes."""

class MooncakeHostMemAllocator:
    """Host memory that the real client can map: zero-copy buffers in dummy mode."""

    def __init__(self) -> None: ...
    def alloc(self, size: int, /) -> int:
        """Address of ``size`` bytes, or 0 (the reason is logged)."""

    def free(self, ptr: int, /) -> int:
        """Frees an allocation: 0, or -1 when ``ptr`` is not one."""

def get_alloc_func_addr() -> int:
    """Address of a C function ``void *alloc(size_t)`` allocating like ``MooncakeHostMemAllocator.alloc``."""

def get_free_func_addr() -> int:
    """Address of a C function ``void free(void *)`` for that memory."""

class BufferHandle:
    """An object's bytes in shared memory (a ctypes byte array), valid until garbage-collected.

    Every handle returned by ``get_buffer`` is an instance of this class. Its block returns
    to the pool when the handle (and every view of it) is garbage-collected;
    ``free_to_mem_pool`` refuses it with ``INVALID_PARAMS``.
    """

    def ptr(self) -> int:
        """Address of the first byte in this process."""

    def size(self) -> int:
        """Number of bytes."""

    def len(self) -> int:
        """Number of bytes (same as ``size()``)."""

    def tobytes(self) -> bytes:
        """A copy of the bytes."""

    def __len__(self) -> int:
        """Number of bytes."""

    def __getitem__(self, index: int | slice) -> Any:
        """One byte as an int 0-255, or a range of bytes as a list of ints."""

    def __buffer__(self, flags: int, /) -> memoryview:
        """Buffer protocol: a 1-D writable view of unsigned bytes (format ``<B``)."""

class MooncakeDistributedStore(_StoreBase):
    """A Mooncake Store client, drop-in for upstream's ``mooncake.store.MooncakeDistributedStore``."""

    def __init__(self) -> None:
        """A client that is not set up yet: call ``setup_dummy``, ``setup`` or ``setup_from_env``."""

    # ----- lifecycle -----
    def setup_dummy(
        self,
        mem_pool_size: int | str | None = None,
        local_buffer_size: int | str | None = None,
        server_address: str | None = None,
    ) -> int:
        """Attaches to the node's ``mooncake_client``; 0, or -1 with the reason logged."""

    def setup(
        self,
        local_hostname: str | dict[str, Any],
        metadata_server: str | None = None,
        global_segment_size: int | str | None = None,
        local_buffer_size: int | str | None = None,
        protocol: str | None = None,
        rdma_devices: str | None = None,
        master_server_addr: str | None = None,
        engine: object = None,
        enable_ssd_offload: bool = False,
        ssd_offload_path: str | None = None,
        tenant_id: str | None = None,
        enable_client_http_server: bool = False,
        client_http_port: int = 9300,
    ) -> int:
        """Runs a real client in this process (positional or dict form) with its own master (``"embedded"``) or joined to the master at ``host:port``; 0, or -1 with the reason logged (also for an unusable argument)."""

    def setup_from_env(self) -> int:
        """Dummy mode when ``MOONCAKE_CLIENT`` is set, else embedded mode from the environment; 0 or -1 (ours)."""

    def init_all(self, protocol: str, device_name: str, mount_segment_size: int) -> int:
        """0 when the store is set up (``setup`` already did upstream's second step), else -1."""

    def close(self) -> int:
        """Disconnects; later calls return errors. Returns 0."""

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 real client or master unreachable."""

    def get_hostname(self) -> str:
        """The real client's segment name (``host:port``); ``""`` when disconnected."""

    def status(self) -> dict[str, Any] | None:
        """The real client's status (dummies, mapped memory, objects, segments), or None when unreachable (ours)."""

    # ----- writes of bytes-like values (bytes and bytearray as they are; any other buffer is copied into bytes first) -----
    def put(self, key: str, value: Buffer, config: ReplicateConfig | None = None) -> int:
        """Stores a copy of ``value``; an existing key keeps its value and this returns 0."""

    def put_parts(self, key: str, *parts: Buffer, config: ReplicateConfig | None = None) -> int:
        """Stores the concatenation of ``parts`` under ``key``."""

    def put_batch(
        self, keys: Sequence[str], values: Iterable[Buffer], config: ReplicateConfig | None = None
    ) -> int:
        """Stores each value under its key; one int: 0, or the first key's error."""

    def upsert(self, key: str, value: Buffer, config: ReplicateConfig | None = None) -> int:
        """Stores or replaces ``value``."""

    def upsert_parts(self, key: str, *parts: Buffer, config: ReplicateConfig | None = None) -> int:
        """``upsert`` of the concatenation of ``parts``."""

    def upsert_batch(
        self, keys: Sequence[str], values: Iterable[Buffer], config: ReplicateConfig | None = None
    ) -> int:
        """``upsert`` of many keys; one int: 0, or the first key's error."""

    # ----- writes from memory -----
    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Stores ``size`` bytes at ``buffer_ptr`` (zero-copy from shared memory)."""

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_from`` for each key; one code per key."""

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """``put_from`` that replaces an existing object."""

    def batch_upsert_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``upsert_from`` for each key."""

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """Stores the metadata bytes followed by the data bytes as one object."""

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Key ``i`` stores the concatenation of its buffers."""

    def batch_upsert_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``batch_put_from_multi_buffers`` that replaces existing objects (ours)."""

    # ----- reads -----
    def get(self, key: str) -> bytes:
        """The object's bytes; ``b""`` when missing or on error."""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """``get`` for each key."""

    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes in a pool block (one copy, by the real client), or None."""

    def batch_get_buffer(self, keys: Iterable[str]) -> list[BufferHandle | None]:
        """``get_buffer`` for each key."""

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Reads the object into ``buffer_ptr`` (capacity ``size``); its size, or a code."""

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``get_into`` for each key."""

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Scatters object ``i`` into its buffers in order; sizes or codes."""

    def get_into_ranges(
        self,
        buffer_ptrs: Sequence[int],
        keys: Sequence[Sequence[str]],
        dst_offsets: Sequence[Sequence[Sequence[int]]],
        src_offsets: Sequence[Sequence[Sequence[int]]],
        sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list[list[list[int]]]:
        """Copies byte ranges of objects into buffers; bytes copied or a code per fragment."""

    # ----- put and get sessions -----
    def batch_put_session_start(
        self, keys: Sequence[str], sizes: Sequence[int], config: ReplicateConfig | None = None
    ) -> list[int]:
        """Sets a pool block aside per key for ranged writes; one code per key."""

    def batch_put_from_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        all_dst_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Writes buffers at offsets of the objects of open put sessions; one code per key."""

    def batch_put_session_end(self, keys: Sequence[str]) -> list[int]:
        """Stores each session's object (one put) and closes the session; one code per key."""

    def batch_put_session_revoke(self, keys: Sequence[str]) -> list[int]:
        """Closes put sessions without storing; one code per key."""

    def batch_get_session_start(self, keys: Sequence[str]) -> list[int]:
        """Looks the objects up once; each one's size, or a code."""

    def batch_get_into_multi_buffer_ranges(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        all_src_offsets: Sequence[Sequence[int]],
    ) -> list[int]:
        """Reads ranges of each object into buffers; bytes read per key, or the first code."""

    def batch_get_session_end(self, keys: Sequence[str]) -> int:
        """Forgets what ``batch_get_session_start`` looked up; 0."""

    # ----- queries and removal -----
    def is_exist(self, key: str) -> int:
        """1 when readable, 0 when missing, or a code (grants a read lease when it exists)."""

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """``is_exist`` for each key (each entry its real error code)."""

    def get_size(self, key: str) -> int:
        """The object's size, or a code."""

    def get_replica_desc(self, key: str) -> list[ReplicaDescriptor]:
        """The object's replicas (``[]`` when missing)."""

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[ReplicaDescriptor]]:
        """``{key: [replica, ...]}`` for the keys that exist."""

    def remove(self, key: str, force: bool = False) -> int:
        """Removes an object (``OBJECT_HAS_LEASE`` under a read lease unless ``force``)."""

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """``remove`` for each key."""

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes the objects whose key matches (Rust ``regex`` syntax); how many, or a code."""

    def remove_all(self, force: bool = False) -> int:
        """Removes every readable object without a lease; how many, or a code."""

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Clears the objects among ``keys`` that nobody read or wrote for one lease TTL: their memory replicas on the segment ``segment_name`` (the other replicas keep serving them), or (empty) the whole objects; the keys cleared."""

    # ----- tasks -----
    def create_copy_task(self, key: str, targets: Iterable[str]) -> tuple[_TaskId | None, int]:
        """Asks for replicas of ``key`` on the ``targets`` segments: ``(task id or None, code)``."""

    def create_move_task(self, key: str, source: str, target: str) -> tuple[_TaskId | None, int]:
        """Asks to move ``key``'s replica from ``source`` to ``target``: ``(task id or None, code)``."""

    def query_task(self, task_id: _TaskId | uuid.UUID | int) -> tuple[QueryTaskResponse | None, int]:
        """The state of a task: ``(QueryTaskResponse or None, code)``."""

    # ----- memory -----
    def alloc_from_mem_pool(self, size: int) -> int:
        """Address of ``size`` bytes of shared memory (zero-copy buffers), or 0."""

    def free_to_mem_pool(self, ptr: int) -> int:
        """Returns a block from ``alloc_from_mem_pool``; 0 or ``INVALID_PARAMS`` (ours)."""

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Declares memory for the pointer calls (any range; ordinary memory is copy-through)."""

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forgets a registration."""

    # ----- segments and other upstream calls -----
    def mount_segment(
        self, path: str, size: int, offset: int = 0, protocol: str = "tcp", location: str = ""
    ) -> _SegmentResult:
        """``{"code": NOT_SUPPORTED, "segment_ids": []}``: a node contributes exactly its global segment."""

    def allocate_and_mount_segment(self, size: int, protocol: str = "tcp", location: str = "") -> _SegmentResult:
        """``{"code": NOT_SUPPORTED, "segment_ids": []}``."""

    def unmount_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        """``NOT_SUPPORTED``."""

    def unmount_and_free_segment(self, segment_ids: Sequence[str], grace_period_seconds: int = 0) -> int:
        """``NOT_SUPPORTED``."""

    def unmount_local_disk_segment(self, grace_period_seconds: int = 0) -> int:
        """``NOT_SUPPORTED``: the SSD tier stays until the real client restarts without it."""

    def get_offload_rpc_read_count(self) -> int:
        """Reads the node's real client served from other nodes' SSD tiers (shared by its dummies)."""

    # ----- tensors: [TensorMetadata][data] objects -----
    def put_tensor(self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None) -> int:
        """Stores a numpy array or torch tensor; an existing key keeps its value."""

    def batch_put_tensor(
        self, keys: Sequence[str], tensors_list: Sequence[_Tensor], config: ReplicateConfig | None = None
    ) -> list[int]:
        """``put_tensor`` for each key (a bad tensor fails only its own entry)."""

    def upsert_tensor(self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None) -> int:
        """Stores or replaces a tensor."""

    def batch_upsert_tensor(
        self, keys: Sequence[str], tensors_list: Sequence[_Tensor], config: ReplicateConfig | None = None
    ) -> list[int]:
        """``upsert_tensor`` for each key."""

    def pub_tensor(self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None) -> int:
        """A put with upstream's check: a non-empty ``preferred_segments`` must name ``replica_num`` segments."""

    def batch_pub_tensor(
        self, keys: Sequence[str], tensors_list: Sequence[_Tensor], config: ReplicateConfig | None = None
    ) -> list[int]:
        """``pub_tensor`` for each key."""

    def upsert_pub_tensor(self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None) -> int:
        """``pub_tensor`` that replaces an existing object."""

    def batch_upsert_pub_tensor(
        self, keys: Sequence[str], tensors_list: Sequence[_Tensor], config: ReplicateConfig | None = None
    ) -> list[int]:
        """``upsert_pub_tensor`` for each key."""

    def get_tensor(self, key: str) -> _Tensor | None:
        """The stored tensor (torch when torch is installed, else numpy), or None."""

    def batch_get_tensor(self, keys: Sequence[str]) -> list[_Tensor | None]:
        """``get_tensor`` for each key."""

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> _Tensor | None:
        """Reads a tensor into ``buffer_ptr`` and returns a view of that memory, or None."""

    def batch_get_tensor_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[Any]:
        """``get_tensor_into`` for each key; ``[INVALID_PARAMS] * len(keys)`` on mismatched lengths."""

    def put_tensor_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Stores a tensor already laid out at ``buffer_ptr``."""

    def batch_put_tensor_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_tensor_from`` for each key."""

    def upsert_tensor_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """``put_tensor_from`` that replaces an existing object."""

    def batch_upsert_tensor_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``upsert_tensor_from`` for each key."""

    # ----- tensor parallelism: shard r stored as <key>_tp_<r> (the plain key when tp_size is 1) -----
    def put_tensor_with_tp(
        self,
        key: str,
        tensor: _Tensor,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
        config: ReplicateConfig | None = None,
    ) -> int:
        """Splits ``tensor`` evenly into ``tp_size`` shards along ``split_dim``; shard r goes to ``<key>_tp_<r>``."""

    def batch_put_tensor_with_tp(
        self,
        base_keys: Sequence[str],
        tensors_list: Sequence[_Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_tensor_with_tp`` for each key."""

    def upsert_tensor_with_tp(
        self,
        key: str,
        tensor: _Tensor,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
        config: ReplicateConfig | None = None,
    ) -> int:
        """``put_tensor_with_tp`` that replaces existing shards (ours)."""

    def batch_upsert_tensor_with_tp(
        self,
        base_keys: Sequence[str],
        tensors_list: Sequence[_Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``upsert_tensor_with_tp`` for each key (ours)."""

    def put_tensor_with_tp_from(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> int:
        """``put_tensor_with_tp`` of the full tensor laid out at ``buffer_ptr``."""

    def batch_put_tensor_with_tp_from(
        self,
        base_keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """``put_tensor_with_tp_from`` for each key."""

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: _Tensor,
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """``put_tensor_with_tp`` with the ``pub_tensor`` check (upstream's argument order: ``config`` third)."""

    def batch_pub_tensor_with_tp(
        self,
        base_keys: Sequence[str],
        tensors_list: Sequence[_Tensor],
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """``pub_tensor_with_tp`` for each key."""

    def get_tensor_with_tp(self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0) -> _Tensor | None:
        """Shard ``tp_rank`` (``<key>_tp_<tp_rank>``, or ``key`` when ``tp_size`` is 1), or None."""

    def batch_get_tensor_with_tp(
        self, base_keys: Sequence[str], tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> list[_Tensor | None]:
        """``get_tensor_with_tp`` for each key."""

    def get_tensor_with_tp_into(
        self, key: str, buffer_ptr: int, size: int, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> _Tensor | None:
        """Reads shard ``tp_rank`` into ``buffer_ptr`` and returns a view of that memory, or None."""

    def batch_get_tensor_with_tp_into(
        self,
        base_keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[Any]:
        """``get_tensor_with_tp_into`` for each key."""

    # ----- parallel layouts (TensorParallelism, writer partitions, ReadTarget) -----
    def put_tensor_with_parallelism(
        self,
        key: str,
        tensor: _Tensor,
        parallelism: TensorParallelism | None = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        """Stores a tensor under a parallel layout (or a writer's partition); ``put_tensor`` without either."""

    def batch_put_tensor_with_parallelism(
        self,
        keys: Sequence[str],
        tensors_list: Sequence[_Tensor],
        parallelisms: Sequence[TensorParallelism | None] | None = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Sequence[Any] | None = None,
    ) -> list[int]:
        """``put_tensor_with_parallelism`` for each key."""

    def upsert_tensor_with_parallelism(
        self,
        key: str,
        tensor: _Tensor,
        parallelism: TensorParallelism | None = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        """``put_tensor_with_parallelism`` that replaces existing objects."""

    def batch_upsert_tensor_with_parallelism(
        self,
        keys: Sequence[str],
        tensors_list: Sequence[_Tensor],
        parallelisms: Sequence[TensorParallelism | None] | None = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Sequence[Any] | None = None,
    ) -> list[int]:
        """``upsert_tensor_with_parallelism`` for each key."""

    def put_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: TensorParallelism | None = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        """``put_tensor_with_parallelism`` of the full tensor laid out at ``buffer_ptr``."""

    def batch_put_tensor_with_parallelism_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        parallelisms: Sequence[TensorParallelism | None] | None = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Sequence[Any] | None = None,
    ) -> list[int]:
        """``put_tensor_with_parallelism_from`` for each key."""

    def upsert_tensor_with_parallelism_from(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        parallelism: TensorParallelism | None = None,
        config: ReplicateConfig | None = None,
        writer_partition: Any = None,
    ) -> int:
        """``put_tensor_with_parallelism_from`` that replaces existing objects."""

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        parallelisms: Sequence[TensorParallelism | None] | None = None,
        config: ReplicateConfig | None = None,
        writer_partitions: Sequence[Any] | None = None,
    ) -> list[int]:
        """``upsert_tensor_with_parallelism_from`` for each key."""

    def get_tensor_with_parallelism(self, key: str, target: ReadTarget | None = None) -> _Tensor | None:
        """Reads with a ``ReadTarget`` (as stored, one shard, or the full tensor reassembled), or None."""

    def batch_get_tensor_with_parallelism(
        self, keys: Sequence[str], targets: Sequence[ReadTarget | None] | None = None
    ) -> list[_Tensor | None]:
        """``get_tensor_with_parallelism`` for each key."""

    def get_tensor_with_parallelism_into(
        self, key: str, buffer_ptr: int, size: int, target: ReadTarget | None = None
    ) -> _Tensor | None:
        """``get_tensor_with_parallelism`` into ``buffer_ptr``."""

    def batch_get_tensor_with_parallelism_into(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        targets: Sequence[ReadTarget | None] | None = None,
    ) -> list[Any]:
        """``get_tensor_with_parallelism_into`` for each key."""

    def get_tensor_into_cuda(self, key: str, tensor: _Tensor) -> int:
        """No CUDA path yet: ``NOT_SUPPORTED`` for a CUDA tensor, ``INVALID_PARAMS`` otherwise."""

    def batch_get_tensor_into_cuda(self, keys: Sequence[str], tensors_list: Sequence[_Tensor]) -> list[int]:
        """``get_tensor_into_cuda`` for each key."""

    # ----- safetensors -----
    def save_tensor_to_safetensor(self, key: str, file_name: str | None = None) -> int:
        """Writes the tensor at ``key`` to a safetensors file (default name: ``key``); 0 or a code."""

    def load_tensor_from_safetensor(self, key: str | None = None, file_name: str | None = None) -> _Tensor | None:
        """Stores (upserts) a tensor from a safetensors file under ``key`` (default: ``file_name``) and returns it, or None."""
