"""Type stubs of ``mooncake.store``: the Mooncake Store client (mooncake-rs).

Dummy mode (``setup_dummy``) attaches to the node's ``mooncake_client``; embedded mode
(``setup``) runs the real client in this process. Both offer the same calls, with
upstream's return conventions: ``0``/positive on success, a negative code
(``ERROR_CODES``) on failure, one entry per input for batch calls. See
``docs/python-api.md``.
"""

import logging
import uuid
from collections.abc import Iterable, Sequence
from typing import Any, Final, Literal, TypedDict, overload

from typing_extensions import Buffer

from ._store import ERROR_CODES as ERROR_CODES
from ._store import ReplicateConfig as ReplicateConfig
from ._store import SoftPinAction as SoftPinAction
from ._store import _StoreBase

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "BufferHandle",
    "ERROR_CODES",
]

_Tensor = Any
"""A ``numpy.ndarray`` or a ``torch.Tensor`` (stub-only alias)."""

log: logging.Logger
"""The ``mooncake`` logger: setup failures, configuration problems and tensors that cannot be stored are logged here."""

INVALID_PARAMS: Final[int]
"""``ERROR_CODES["INVALID_PARAMS"]`` (-600)."""

NO_AVAILABLE_HANDLE: Final[int]
"""``ERROR_CODES["NO_AVAILABLE_HANDLE"]`` (-200)."""

class _Task(TypedDict):
    """A copy or move task as returned by ``query_task`` (stub-only name)."""

    id: uuid.UUID
    type: Literal["copy", "move"]
    key: str
    targets: list[str]
    status: Literal["pending", "running", "success", "failed"]
    error_code: int

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

    @overload
    def __getitem__(self, index: int) -> int:
        """One byte, as an int 0-255."""

    @overload
    def __getitem__(self, index: slice) -> list[int]:
        """A range of bytes, as a list of ints."""

    def __buffer__(self, flags: int, /) -> memoryview:
        """Buffer protocol: a 1-D writable view of unsigned bytes (format ``<B``)."""

class MooncakeDistributedStore(_StoreBase):
    """A Mooncake Store client, drop-in for upstream's ``mooncake.store.MooncakeDistributedStore``."""

    def __init__(self) -> None:
        """A client that is not set up yet: call ``setup_dummy``, ``setup`` or ``setup_from_env``."""

    # ----- lifecycle -----
    def setup_from_env(self) -> int:
        """Dummy mode when ``MOONCAKE_CLIENT`` is set, else embedded mode from the environment; 0 or -1."""

    # ----- writes of bytes-like values (bytes and bytearray as they are; any other buffer is copied into bytes first) -----
    def put(self, key: str, value: Buffer, config: ReplicateConfig | None = None) -> int:
        """Stores a copy of ``value`` (any bytes-like object); an existing key keeps its value and this returns 0."""

    def put_parts(self, key: str, *parts: Buffer, config: ReplicateConfig | None = None) -> int:
        """Stores the concatenation of ``parts`` (each bytes-like) under ``key``."""

    def put_batch(
        self,
        keys: Sequence[str],
        values: Iterable[Buffer],
        config: ReplicateConfig | None = None,
    ) -> int:
        """Stores each value (bytes-like) under its key; one int: 0, or the first key's error."""

    def upsert(self, key: str, value: Buffer, config: ReplicateConfig | None = None) -> int:
        """Stores or replaces ``value`` (any bytes-like object)."""

    def upsert_parts(self, key: str, *parts: Buffer, config: ReplicateConfig | None = None) -> int:
        """``upsert`` of the concatenation of ``parts``."""

    def upsert_batch(
        self,
        keys: Sequence[str],
        values: Iterable[Buffer],
        config: ReplicateConfig | None = None,
    ) -> int:
        """``upsert`` of many keys; one int: 0, or the first key's error."""

    def status(self) -> dict[str, Any] | None:
        """The real client's status (dummies, mapped memory, objects, segments), or None when unreachable."""

    # ----- buffers -----
    def get_buffer(self, key: str) -> BufferHandle | None:
        """The object's bytes in a pool block (one copy, by the real client), or None."""

    def batch_get_buffer(self, keys: Iterable[str]) -> list[BufferHandle | None]:
        """``get_buffer`` for each key."""

    # ----- tasks -----
    def create_copy_task(self, key: str, targets: Iterable[str]) -> tuple[uuid.UUID | None, int]:
        """Asks for replicas of ``key`` on the ``targets`` segments: ``(task id or None, code)``."""

    def create_move_task(self, key: str, source: str, target: str) -> tuple[uuid.UUID | None, int]:
        """Asks to move ``key``'s replica from ``source`` to ``target``: ``(task id or None, code)``."""

    def query_task(self, task_id: uuid.UUID | int) -> tuple[_Task | None, int]:
        """The state of a task: ``(dict or None, code)``; the dict's ``id`` is the task's ``uuid.UUID``."""

    # ----- tensors -----
    def put_tensor(self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None) -> int:
        """Stores a numpy array or torch tensor as ``[TensorMetadata][data]``; an existing key keeps its value."""

    def batch_put_tensor(
        self, keys: Iterable[str], tensors_list: Iterable[_Tensor], config: ReplicateConfig | None = None
    ) -> list[int]:
        """``put_tensor`` for each key; one code per key (a bad tensor fails only its own entry)."""

    def upsert_tensor(self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None) -> int:
        """Stores or replaces a tensor."""

    def batch_upsert_tensor(
        self, keys: Iterable[str], tensors_list: Iterable[_Tensor], config: ReplicateConfig | None = None
    ) -> list[int]:
        """``upsert_tensor`` for each key; one code per key."""

    def pub_tensor(self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None) -> int:
        """Publishes a tensor as upstream: a put; ``INVALID_PARAMS`` when ``config.preferred_segments`` is set but does not name ``replica_num`` segments."""

    def batch_pub_tensor(
        self, keys: Iterable[str], tensors_list: Iterable[_Tensor], config: ReplicateConfig | None = None
    ) -> list[int]:
        """``pub_tensor`` for each key; one code per key (every key ``INVALID_PARAMS`` when ``config`` fails the check)."""

    def get_tensor(self, key: str) -> _Tensor | None:
        """The stored tensor (torch when stored from torch and torch is installed, else numpy), or None."""

    def batch_get_tensor(self, keys: Iterable[str]) -> list[_Tensor | None]:
        """``get_tensor`` for each key."""

    def get_tensor_into(self, key: str, buffer_ptr: int, size: int) -> _Tensor | None:
        """Reads a tensor into ``buffer_ptr`` and returns a view of that memory, or None."""

    def batch_get_tensor_into(
        self, keys: Iterable[str], buffer_ptrs: Iterable[int], sizes: Iterable[int]
    ) -> list[Any]:
        """``get_tensor_into`` for each key (tensor or None); ``[INVALID_PARAMS] * len(keys)`` on mismatched lengths."""

    def put_tensor_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        """Stores a tensor already laid out at ``buffer_ptr``; ``INVALID_PARAMS`` when it holds no valid tensor."""

    def batch_put_tensor_from(
        self,
        keys: Iterable[str],
        buffer_ptrs: Iterable[int],
        sizes: Iterable[int],
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_tensor_from`` for each key; every key ``INVALID_PARAMS`` if any buffer is not a valid tensor."""

    def upsert_tensor_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None
    ) -> int:
        """``put_tensor_from`` that replaces an existing object."""

    def batch_upsert_tensor_from(
        self,
        keys: Iterable[str],
        buffer_ptrs: Iterable[int],
        sizes: Iterable[int],
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
        """Splits ``tensor`` into ``tp_size`` shards along ``split_dim`` (torch.chunk; ``INVALID_PARAMS`` when that gives fewer); shard r goes to ``<key>_tp_<r>``."""

    def batch_put_tensor_with_tp(
        self,
        base_keys: Iterable[str],
        tensors_list: Iterable[_Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``put_tensor_with_tp`` for each key; one code per key (its first failing shard)."""

    def upsert_tensor_with_tp(
        self,
        key: str,
        tensor: _Tensor,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
        config: ReplicateConfig | None = None,
    ) -> int:
        """``put_tensor_with_tp`` that replaces existing shards."""

    def batch_upsert_tensor_with_tp(
        self,
        base_keys: Iterable[str],
        tensors_list: Iterable[_Tensor],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
        config: ReplicateConfig | None = None,
    ) -> list[int]:
        """``upsert_tensor_with_tp`` for each key."""

    def pub_tensor_with_tp(
        self,
        key: str,
        tensor: _Tensor,
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> int:
        """``put_tensor_with_tp`` with the ``pub_tensor`` check of ``config`` (upstream's argument order)."""

    def batch_pub_tensor_with_tp(
        self,
        base_keys: Iterable[str],
        tensors_list: Iterable[_Tensor],
        config: ReplicateConfig | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[int]:
        """``batch_put_tensor_with_tp`` with the ``pub_tensor`` check of ``config`` (upstream's argument order)."""

    def get_tensor_with_tp(
        self, key: str, tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> _Tensor | None:
        """Shard ``tp_rank`` (key ``<key>_tp_<tp_rank>``, or ``key`` when ``tp_size`` is 1) of a tensor stored with ``put_tensor_with_tp``."""

    def batch_get_tensor_with_tp(
        self, base_keys: Iterable[str], tp_rank: int = 0, tp_size: int = 1, split_dim: int = 0
    ) -> list[_Tensor | None]:
        """``get_tensor_with_tp`` for each key."""

    def get_tensor_with_tp_into(
        self,
        key: str,
        buffer_ptr: int,
        size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> _Tensor | None:
        """Reads shard ``tp_rank`` into ``buffer_ptr`` and returns a view of that memory, or None."""

    def batch_get_tensor_with_tp_into(
        self,
        base_keys: Iterable[str],
        buffer_ptrs: Iterable[int],
        sizes: Iterable[int],
        tp_rank: int = 0,
        tp_size: int = 1,
        split_dim: int = 0,
    ) -> list[Any]:
        """``get_tensor_with_tp_into`` for each key (tensor or None); ``[INVALID_PARAMS] * len(keys)`` on mismatched lengths."""

    # ----- upstream's "parallelism" wrappers: whole tensors, extra keywords ignored -----
    def put_tensor_with_parallelism(
        self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None, **_: Any
    ) -> int:
        """Same as ``put_tensor``."""

    def batch_put_tensor_with_parallelism(
        self,
        keys: Iterable[str],
        tensors: Iterable[_Tensor],
        config: ReplicateConfig | None = None,
        **_: Any,
    ) -> list[int]:
        """Same as ``batch_put_tensor``."""

    def put_tensor_with_parallelism_from(
        self, key: str, buffer_ptr: int, size: int, config: ReplicateConfig | None = None, **_: Any
    ) -> int:
        """Same as ``put_tensor_from``."""

    def upsert_tensor_with_parallelism(
        self, key: str, tensor: _Tensor, config: ReplicateConfig | None = None, **_: Any
    ) -> int:
        """Same as ``upsert_tensor``."""

    def batch_upsert_tensor_with_parallelism_from(
        self,
        keys: Iterable[str],
        buffer_ptrs: Iterable[int],
        sizes: Iterable[int],
        config: ReplicateConfig | None = None,
        **_: Any,
    ) -> list[int]:
        """Same as ``batch_upsert_tensor_from``."""
