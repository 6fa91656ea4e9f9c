"""Type stubs of ``mooncake._store``, the compiled extension behind ``mooncake.store``.

Applications use ``mooncake.store``; this module holds the classes it re-exports
(``ReplicateConfig``, ``SoftPinAction``, ``ERROR_CODES``) and the base classes it wraps
(``_StoreBase``, ``_RawBuffer``). Return conventions follow upstream Mooncake: ``0`` or a
positive value on success, a negative ``ERROR_CODES`` value on failure, one entry per
input for batch calls. Every call that waits on the real client releases the GIL.
"""

from collections.abc import Sequence
from typing import Any, ClassVar, Final, Literal, TypedDict, final

__all__ = [
    "ReplicateConfig",
    "SoftPinAction",
    "_StoreBase",
    "_RawBuffer",
    "PROTOCOL_VERSION",
    "ERROR_CODES",
]

PROTOCOL_VERSION: Final[int]
"""Version of the dummy ↔ real client protocol this build speaks."""

ERROR_CODES: Final[dict[str, int]]
"""Every error code by upstream name, e.g. ``ERROR_CODES["OBJECT_NOT_FOUND"] == -704``."""

class _ReplicaDesc(TypedDict):
    """One replica as returned by ``get_replica_desc`` (stub-only name)."""

    type: Literal["memory"]
    segment_name: str
    segment_id: int
    offset: int
    endpoint: str
    size: int
    status: Literal["processing", "complete"]

class _TaskInfo(TypedDict):
    """A copy or move task as returned by ``_query_task`` (stub-only name); ``query_task`` turns ``id`` into a ``uuid.UUID``."""

    id: int
    type: Literal["copy", "move"]
    key: str
    targets: list[str]
    status: Literal["pending", "running", "success", "failed"]
    error_code: int

@final
class SoftPinAction:
    """What a write does to the object's soft pin (compares equal to its int value; hashable)."""

    PRESERVE: ClassVar[SoftPinAction]
    """Keep the object's soft pin as it is (0, the default)."""
    ENABLE: ClassVar[SoftPinAction]
    """Pin the object against eviction for a TTL (1)."""
    DISABLE: ClassVar[SoftPinAction]
    """Remove the soft pin (2)."""

    def __int__(self) -> int:
        """The upstream numeric value (0, 1 or 2)."""

    def __eq__(self, other: object, /) -> bool:
        """Equal to the same member or to its int value."""

    def __ne__(self, other: object, /) -> bool:
        """Negation of ``__eq__``."""

    def __hash__(self) -> int:
        """Members are hashable (usable in sets and as dict keys)."""

@final
class ReplicateConfig:
    """Write options: replica count, pins and placement preferences (upstream's fields)."""

    def __init__(self) -> None:
        """Defaults: one replica, ``PRESERVE``, no pins, no preferred segment."""

    @property
    def replica_num(self) -> int:
        """Number of memory replicas, on distinct segments, best effort (default 1; 0 is invalid)."""

    @replica_num.setter
    def replica_num(self, value: int) -> None: ...
    @property
    def soft_pin_action(self) -> SoftPinAction:
        """Soft-pin change applied when the write completes (default ``PRESERVE``)."""

    @soft_pin_action.setter
    def soft_pin_action(self, value: SoftPinAction) -> None: ...
    @property
    def soft_pin_ttl_ms(self) -> int | None:
        """Soft-pin TTL in milliseconds, from the write's completion; only valid with ``ENABLE``, at most the master's ``--max_kv_soft_pin_ttl`` (``None``: the master's default)."""

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None: ...
    @property
    def with_soft_pin(self) -> bool:
        """Older spelling of ``soft_pin_action == ENABLE`` (setting False selects ``PRESERVE``)."""

    @with_soft_pin.setter
    def with_soft_pin(self, value: bool) -> None: ...
    @property
    def with_hard_pin(self) -> bool:
        """Never evict the object (default False)."""

    @with_hard_pin.setter
    def with_hard_pin(self, value: bool) -> None: ...
    @property
    def preferred_segment(self) -> str:
        """Preferred segment name (``host:port``); when set, ``preferred_segments`` is ignored."""

    @preferred_segment.setter
    def preferred_segment(self, value: str) -> None: ...
    @property
    def preferred_segments(self) -> list[str]:
        """Preferred segment names, tried in order (a copy: assign a new list to change it)."""

    @preferred_segments.setter
    def preferred_segments(self, value: Sequence[str]) -> None: ...
    @property
    def prefer_alloc_in_same_node(self) -> bool:
        """Accepted for compatibility, no effect (default False); use ``preferred_segment = get_hostname()``."""

    @prefer_alloc_in_same_node.setter
    def prefer_alloc_in_same_node(self, value: bool) -> None: ...
    def __repr__(self) -> str:
        """``ReplicateConfig(replica_num=..., soft_pin_action=..., ...)``."""

@final
class _RawBuffer:
    """An object's bytes in the dummy's shared pool, valid while this object lives."""

    def ptr(self) -> int:
        """Address of the bytes in this process (0 after ``release()``)."""

    def size(self) -> int:
        """Number of bytes (0 after ``release()``)."""

    def __len__(self) -> int:
        """Number of bytes (0 after ``release()``)."""

    def tobytes(self) -> bytes:
        """A copy of the bytes."""

    def release(self) -> None:
        """Returns the memory to the pool now; the buffer becomes empty."""

class _StoreBase:
    """The store client behind ``MooncakeDistributedStore`` (dummy or embedded mode)."""

    def __init__(self) -> None:
        """A client that is not set up yet: calls return ``RPC_FAIL`` (-900) until ``setup*``."""

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
        """Runs a real client in this process (positional or dict form), with its own master (``"embedded"``) or joined to the master at ``master_server_addr`` (``host:port``); 0, or -1 with the reason logged."""

    def close(self) -> int:
        """Disconnects; later calls return errors. Returns 0."""

    def _owns_memory(self, ptr: int, size: int) -> bool:
        """True when ``ptr..ptr+size`` is this client's shared memory or inside a registered buffer."""

    def health_check(self) -> int:
        """0 healthy, 1 not set up or closed, 2 real client or master unreachable."""

    def get_hostname(self) -> str:
        """The real client's segment name (``host:port``); ``""`` when disconnected."""

    # ----- writes -----
    def put(self, key: str, value: bytes | bytearray, config: ReplicateConfig | None = None) -> int:
        """Stores a copy of ``value``; an existing key keeps its value and this returns 0 (``MooncakeDistributedStore.put`` accepts any bytes-like object)."""

    def put_parts(self, key: str, *parts: bytes | bytearray, config: ReplicateConfig | None = None) -> int:
        """Stores the concatenation of ``parts`` under ``key``."""

    def put_batch(
        self,
        keys: Sequence[str],
        values: Sequence[bytes | bytearray],
        config: ReplicateConfig | None = None,
    ) -> int:
        """Stores each value under its key; one int: 0, or the first key's error."""

    def upsert(self, key: str, value: bytes | bytearray, config: ReplicateConfig | None = None) -> int:
        """Stores or replaces ``value``; readers see the old value until the new one is complete."""

    def upsert_parts(self, key: str, *parts: bytes | bytearray, config: ReplicateConfig | None = None) -> int:
        """``upsert`` of the concatenation of ``parts``."""

    def upsert_batch(
        self,
        keys: Sequence[str],
        values: Sequence[bytes | bytearray],
        config: ReplicateConfig | None = None,
    ) -> int:
        """``upsert`` of many keys; one int: 0, or the first key's error."""

    def put_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """Stores ``size`` bytes at ``buffer_ptr``: zero-copy from shared memory, copied through from registered memory."""

    def batch_put_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_from`` for many keys in one request; one code per key."""

    def upsert_from(self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None) -> int:
        """``put_from`` that replaces an existing object."""

    def batch_upsert_from(
        self,
        keys: Sequence[str],
        buffer_ptrs: Sequence[int],
        sizes: Sequence[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``upsert_from`` for many keys in one request; one code per key."""

    def put_from_with_metadata(
        self,
        key: str,
        buffer_ptr: int,
        metadata_buffer_ptr: int,
        size: int,
        metadata_size: int,
        config: ReplicateConfig | None = None,
    ) -> int:
        """Stores ``metadata_size`` bytes at ``metadata_buffer_ptr`` followed by ``size`` bytes at ``buffer_ptr``."""

    def batch_put_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """Stores, for each key, the concatenation of its buffers; one code per key."""

    def batch_upsert_from_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``batch_put_from_multi_buffers`` that replaces existing objects."""

    # ----- reads -----
    def get(self, key: str) -> bytes:
        """The object's bytes, or ``b""`` when it is missing or on any error."""

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        """``get`` for each key (``b""`` for misses)."""

    def _get_buffer(self, key: str) -> _RawBuffer | None:
        """The object copied into a pool block, or None (wrapped by ``get_buffer``)."""

    def _batch_get_buffer(self, keys: Sequence[str]) -> list[_RawBuffer | None]:
        """``_get_buffer`` for each key (wrapped by ``batch_get_buffer``)."""

    def get_into(self, key: str, buffer_ptr: int, size: int) -> int:
        """Copies the object into ``buffer_ptr`` (capacity ``size``); the object's size or a negative code."""

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``get_into`` for many keys in one request; one size or code per key."""

    def batch_get_into_multi_buffers(
        self,
        keys: Sequence[str],
        all_buffer_ptrs: Sequence[Sequence[int]],
        all_sizes: Sequence[Sequence[int]],
        prefer_alloc_in_same_node: bool = False,
    ) -> list[int]:
        """Reads each object into its buffers, filled in order; one size or code per key."""

    def get_into_ranges(
        self,
        buffer_ptrs: Sequence[int],
        keys: Sequence[Sequence[str]],
        dst_offsets: Sequence[Sequence[Sequence[int]]],
        src_offsets: Sequence[Sequence[Sequence[int]]],
        sizes: Sequence[Sequence[Sequence[int]]],
    ) -> list[list[list[int]]]:
        """Copies byte ranges of objects into buffers; a result of the shape of ``dst_offsets``."""

    # ----- queries and removal -----
    def is_exist(self, key: str) -> int:
        """1 when the object is readable, 0 when not, or a negative code; grants a read lease."""

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """``is_exist`` for many keys in one request: 1, 0 or the real error code per key."""

    def get_size(self, key: str) -> int:
        """The object's size in bytes, or a negative code (no lease)."""

    def get_replica_desc(self, key: str) -> list[_ReplicaDesc]:
        """Where the object's replicas are, as dicts (``[]`` when missing or on error; no lease)."""

    def batch_get_replica_desc(self, keys: Sequence[str]) -> dict[str, list[_ReplicaDesc]]:
        """``{key: [replica, ...]}`` for the keys that exist."""

    def remove(self, key: str, force: bool = False) -> int:
        """Removes the object; ``OBJECT_HAS_LEASE`` (-706) under a read lease unless ``force``."""

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """``remove`` for many keys in one request; one code per key."""

    def batch_replica_clear(self, keys: Sequence[str], segment_name: str = "") -> list[str]:
        """Clears the objects among ``keys`` unused for one lease TTL (on ``segment_name`` only, when given); the keys cleared."""

    def remove_by_regex(self, regex_pattern: str, force: bool = False) -> int:
        """Removes every object whose key matches ``regex_pattern``; how many, or a negative code."""

    def remove_all(self, force: bool = False) -> int:
        """Removes every readable object (leased ones only with ``force``); how many, or a negative code."""

    # ----- tasks -----
    def _create_copy_task(self, key: str, targets: Sequence[str]) -> tuple[int | None, int]:
        """``(task id as int or None, code)`` (wrapped by ``create_copy_task``)."""

    def _create_move_task(self, key: str, source: str, target: str) -> tuple[int | None, int]:
        """``(task id as int or None, code)`` (wrapped by ``create_move_task``)."""

    def _query_task(self, id: int) -> tuple[_TaskInfo | None, int]:
        """``(task dict or None, code)`` (wrapped by ``query_task``)."""

    # ----- memory -----
    def alloc_from_mem_pool(self, size: int) -> int:
        """Address of ``size`` bytes of shared memory for zero-copy calls, or 0 on failure."""

    def free_to_mem_pool(self, ptr: int) -> int:
        """Returns a block from ``alloc_from_mem_pool``; 0, or ``INVALID_PARAMS`` for an unknown address or the block of a live buffer handle."""

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Registers memory for the pointer calls: shared memory is zero-copy, ordinary memory copied through; ``RPC_FAIL`` before setup and after ``close()``."""

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forgets a registered buffer; 0, ``INVALID_PARAMS`` when ``buffer_ptr`` starts none, ``RPC_FAIL`` before setup and after ``close()``."""

    def _status_json(self) -> str | None:
        """The real client's status as JSON text, or None when unreachable (wrapped by ``status``)."""
