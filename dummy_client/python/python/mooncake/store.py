"""The Mooncake Store client: ``MooncakeDistributedStore`` and ``ReplicateConfig``.

Dummy mode (``setup_dummy``) attaches to the node's ``mooncake_client``; embedded mode
(``setup``) runs the real client in this process. Both offer the same calls, with
upstream's return conventions: ``0``/positive on success, a negative error code
(``ERROR_CODES``) on failure, one entry per input for batch calls.
"""

import ctypes
import functools
import json
import logging
import os
import uuid

from . import _extras, _tensor_api
from ._extras import *  # noqa: F403 (helper classes: see its __all__)
from ._tensor_api import *  # noqa: F403 (the tensor module's public names: see its __all__)
from ._tensor_api import TensorMixin
from ._store import ERROR_CODES, ReplicateConfig, SoftPinAction, _RawBuffer, _StoreBase

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "BufferHandle",
    "ERROR_CODES",
    *_tensor_api.__all__,
    *_extras.__all__,
]

log = logging.getLogger("mooncake")


class BufferHandle:
    """An object's bytes in shared memory, valid while the handle lives.

    Handles returned by ``get_buffer`` are ctypes byte arrays: they support the buffer
    protocol (``memoryview(h)``, ``numpy.frombuffer(h, ...)``, ``bytes(h)``) and have
    ``ptr()``, ``size()`` and ``len()``. The memory stays valid (and unchanged) until the
    handle is garbage-collected, even if the key is removed meanwhile.
    """

    __slots__ = ()


@functools.lru_cache(maxsize=512)
def _handle_type(size):
    base = ctypes.c_ubyte * size

    def ptr(self):
        return ctypes.addressof(self)

    def size_(self):
        return size

    def tobytes(self):
        return bytes(self)

    def __repr__(self):
        return f"BufferHandle(ptr={ctypes.addressof(self):#x}, size={size})"

    return type(
        "BufferHandle",
        (base, BufferHandle),
        {"ptr": ptr, "size": size_, "len": size_, "tobytes": tobytes, "__repr__": __repr__},
    )


def _wrap(raw):
    if raw is None or raw.size() == 0:
        return None
    handle = _handle_type(raw.size()).from_address(raw.ptr())
    handle._raw = raw
    return handle


def _env_size(name, default):
    value = os.environ.get(name)
    return value if value else default


def _as_bytes(value):
    """bytes and bytearray pass through; any other buffer (memoryview, numpy array,
    array.array) is copied into bytes."""
    if isinstance(value, (bytes, bytearray)):
        return value
    return memoryview(value).tobytes()


class MooncakeDistributedStore(TensorMixin, _StoreBase):
    """A Mooncake Store client (drop-in for upstream's ``mooncake.store``)."""

    # ----- writes of bytes-like values (any buffer is accepted) -----

    def put(self, key, value, config=None):
        """Stores ``value`` (any bytes-like object); an existing key is kept."""
        return super().put(key, _as_bytes(value), config)

    def put_parts(self, key, *parts, config=None):
        """Stores the concatenation of ``parts``."""
        return super().put_parts(key, *[_as_bytes(p) for p in parts], config=config)

    def put_batch(self, keys, values, config=None):
        """Stores each value under its key; 0 or the first error."""
        return super().put_batch(keys, [_as_bytes(v) for v in values], config)

    def upsert(self, key, value, config=None):
        """Stores or replaces ``value``."""
        return super().upsert(key, _as_bytes(value), config)

    def upsert_parts(self, key, *parts, config=None):
        """Stores or replaces the concatenation of ``parts``."""
        return super().upsert_parts(key, *[_as_bytes(p) for p in parts], config=config)

    def upsert_batch(self, keys, values, config=None):
        """Stores or replaces each value; 0 or the first error."""
        return super().upsert_batch(keys, [_as_bytes(v) for v in values], config)

    # ----- lifecycle -----

    def setup_from_env(self):
        """Sets up from the environment: dummy mode when ``MOONCAKE_CLIENT`` is set
        (pool ``MOONCAKE_MEM_POOL_SIZE``, staging ``MOONCAKE_LOCAL_BUFFER_SIZE``),
        otherwise embedded mode from ``MOONCAKE_CONFIG_PATH`` (JSON with upstream's keys)
        or the ``MOONCAKE_*`` variables. Returns 0 or -1."""
        client = os.environ.get("MOONCAKE_CLIENT")
        if client:
            return self.setup_dummy(
                _env_size("MOONCAKE_MEM_POOL_SIZE", 0),
                _env_size("MOONCAKE_LOCAL_BUFFER_SIZE", 16 << 20),
                client,
            )
        path = os.environ.get("MOONCAKE_CONFIG_PATH")
        if path:
            try:
                with open(path) as f:
                    config = json.load(f)
            except (OSError, ValueError) as error:
                log.error("cannot read MOONCAKE_CONFIG_PATH=%s: %s", path, error)
                return -1
            if "master_server_address" in config and "master_server_addr" not in config:
                config["master_server_addr"] = config["master_server_address"]
            if "device_name" in config and "rdma_devices" not in config:
                config["rdma_devices"] = config["device_name"]
            return self.setup(config)
        return self.setup(
            {
                "local_hostname": os.environ.get("MOONCAKE_LOCAL_HOSTNAME", "localhost"),
                "metadata_server": os.environ.get("MOONCAKE_TE_META_DATA_SERVER", "P2PHANDSHAKE"),
                "global_segment_size": _env_size("MOONCAKE_GLOBAL_SEGMENT_SIZE", 3355443200),
                "local_buffer_size": _env_size("MOONCAKE_LOCAL_BUFFER_SIZE", 1073741824),
                "protocol": os.environ.get("MOONCAKE_PROTOCOL", "tcp"),
                "rdma_devices": os.environ.get("MOONCAKE_DEVICE", ""),
                "master_server_addr": os.environ.get("MOONCAKE_MASTER", "embedded"),
                "tenant_id": os.environ.get("MOONCAKE_TENANT_ID", "default"),
            }
        )

    def status(self):
        """The real client's status (dummies, mapped memory, objects, segments) as a
        dict, or None when unreachable."""
        text = self._status_json()
        return json.loads(text) if text else None

    # ----- buffers -----

    def get_buffer(self, key):
        """The object's bytes as a ``BufferHandle`` (None when missing)."""
        return _wrap(self._get_buffer(key))

    def batch_get_buffer(self, keys):
        """``get_buffer`` for each key."""
        return [_wrap(raw) for raw in self._batch_get_buffer(list(keys))]

    # ----- tasks -----

    def create_copy_task(self, key, targets):
        """Asks for replicas of ``key`` on ``targets``: ``(uuid.UUID or None, code)``."""
        task, code = self._create_copy_task(key, list(targets))
        return (uuid.UUID(int=task) if task is not None else None, code)

    def create_move_task(self, key, source, target):
        """Asks to move ``key`` from ``source`` to ``target``: ``(uuid.UUID or None, code)``."""
        task, code = self._create_move_task(key, source, target)
        return (uuid.UUID(int=task) if task is not None else None, code)

    def query_task(self, task_id):
        """The state of a task: ``(dict or None, code)``."""
        value = task_id.int if isinstance(task_id, uuid.UUID) else int(task_id)
        info, code = self._query_task(value)
        if info is not None:
            info["id"] = uuid.UUID(int=info["id"])
        return info, code
