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

from . import _extras, _tensor_api, _types
from ._extras import *  # noqa: F403 (helper classes: see its __all__)
from ._types import *  # noqa: F403 (result types and enums: see its __all__)
from ._types import QueryTaskResponse, ReplicaDescriptor, task_id_int, task_id_pair
from ._tensor_api import *  # noqa: F403 (the tensor module's public names: see its __all__)
from ._tensor_api import TensorMixin
from ._store import (
    ERROR_CODES,
    MooncakeHostMemAllocator,
    ReplicateConfig,
    SoftPinAction,
    _RawBuffer,
    _StoreBase,
    get_alloc_func_addr,
    get_free_func_addr,
)

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "BufferHandle",
    "ERROR_CODES",
    "MooncakeHostMemAllocator",
    "get_alloc_func_addr",
    "get_free_func_addr",
    *_tensor_api.__all__,
    *_extras.__all__,
    *_types.__all__,
]

log = logging.getLogger("mooncake")

INVALID_PARAMS = ERROR_CODES["INVALID_PARAMS"]
NO_AVAILABLE_HANDLE = ERROR_CODES["NO_AVAILABLE_HANDLE"]
OBJECT_NOT_FOUND = ERROR_CODES["OBJECT_NOT_FOUND"]
OBJECT_ALREADY_EXISTS = ERROR_CODES["OBJECT_ALREADY_EXISTS"]
NOT_SUPPORTED = ERROR_CODES["NOT_SUPPORTED"]


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

    # ----- replicas and tasks -----

    def get_replica_desc(self, key):
        """The replicas of ``key`` as ``ReplicaDescriptor`` objects (``[]`` when missing)."""
        return [ReplicaDescriptor(info) for info in super().get_replica_desc(key)]

    def batch_get_replica_desc(self, keys):
        """``{key: [ReplicaDescriptor, ...]}`` for the keys that exist."""
        found = super().batch_get_replica_desc(keys)
        return {key: [ReplicaDescriptor(info) for info in infos] for key, infos in found.items()}

    def create_copy_task(self, key, targets):
        """Asks for replicas of ``key`` on ``targets``: ``(task id, code)``; the id is
        upstream's ``(high, low)`` pair, None on failure."""
        task, code = self._create_copy_task(key, list(targets))
        return (task_id_pair(task) if task is not None else None, code)

    def create_move_task(self, key, source, target):
        """Asks to move ``key`` from ``source`` to ``target``: ``(task id, code)``."""
        task, code = self._create_move_task(key, source, target)
        return (task_id_pair(task) if task is not None else None, code)

    def query_task(self, task_id):
        """The state of a task (id as upstream's pair, a ``uuid.UUID`` or an int):
        ``(QueryTaskResponse or None, code)``."""
        info, code = self._query_task(task_id_int(task_id))
        return (QueryTaskResponse._from_info(info) if info is not None else None), code

    # ----- put and get sessions (ranged writes and reads of whole objects) -----

    def batch_put_session_start(self, keys, sizes, config=None):
        """Reserves each object (``sizes[i]`` bytes) for ranged writes with
        ``batch_put_from_multi_buffer_ranges``; nothing is readable until
        ``batch_put_session_end``. One code per key (``OBJECT_ALREADY_EXISTS`` when the
        key exists or a session for it is open)."""
        keys, sizes = list(keys), list(sizes)
        if len(keys) != len(sizes):
            return [INVALID_PARAMS] * len(keys)
        sessions = self._sessions()
        exist = self.batch_is_exist(keys) if keys else []
        results = []
        for key, size, present in zip(keys, sizes, exist):
            if present < 0:
                results.append(present)
            elif present == 1 or key in sessions:
                results.append(OBJECT_ALREADY_EXISTS)
            elif not isinstance(size, int) or size <= 0:
                results.append(INVALID_PARAMS)
            else:
                ptr = self.alloc_from_mem_pool(size)
                if not ptr:
                    results.append(NO_AVAILABLE_HANDLE)
                    continue
                sessions[key] = _PutSession(ptr, size, config)
                results.append(0)
        return results

    def batch_put_from_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes, all_dst_offsets):
        """Writes each buffer ``all_buffer_ptrs[i][j]`` (``all_sizes[i][j]`` bytes) at
        offset ``all_dst_offsets[i][j]`` of the object reserved for ``keys[i]``. One code
        per key: 0, ``OBJECT_NOT_FOUND`` without an open session, ``INVALID_PARAMS`` for a
        range outside the object or unknown memory."""
        keys = list(keys)
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets)):
            return [INVALID_PARAMS] * len(keys)
        sessions = self._sessions()
        results = []
        for key, ptrs, sizes, offsets in zip(keys, all_buffer_ptrs, all_sizes, all_dst_offsets):
            session = sessions.get(key)
            if session is None:
                results.append(OBJECT_NOT_FOUND)
                continue
            results.append(session.write(self, list(ptrs), list(sizes), list(offsets)))
        return results

    def batch_put_session_end(self, keys):
        """Completes the sessions of ``keys``: each object becomes readable. One code per
        key; the session is closed whatever the outcome."""
        keys = list(keys)
        sessions = self._sessions()
        open_keys = [k for k in keys if k in sessions]
        done = {}
        by_config = {}
        for key in open_keys:
            by_config.setdefault(id(sessions[key].config), []).append(key)
        for group in by_config.values():
            config = sessions[group[0]].config
            ptrs = [sessions[k].ptr for k in group]
            sizes = [sessions[k].size for k in group]
            codes = self.batch_put_from(group, ptrs, sizes, config) if config is not None else self.batch_put_from(group, ptrs, sizes)
            done.update(zip(group, codes))
        for key in open_keys:
            self.free_to_mem_pool(sessions.pop(key).ptr)
        return [done.get(key, OBJECT_NOT_FOUND) for key in keys]

    def batch_put_session_revoke(self, keys):
        """Abandons the sessions of ``keys`` (nothing is stored). One code per key."""
        sessions = self._sessions()
        results = []
        for key in keys:
            session = sessions.pop(key, None)
            if session is None:
                results.append(OBJECT_NOT_FOUND)
            else:
                self.free_to_mem_pool(session.ptr)
                results.append(0)
        return results

    def batch_get_session_start(self, keys):
        """Looks the objects up once (their sizes are remembered for ranged reads with
        ``batch_get_into_multi_buffer_ranges``). One entry per key: the object size or
        a negative code."""
        keys = list(keys)
        sizes = [self.get_size(key) for key in keys]
        cache = self._get_sessions()
        for key, size in zip(keys, sizes):
            if size >= 0:
                cache[key] = size
        return sizes

    def batch_get_into_multi_buffer_ranges(self, keys, all_buffer_ptrs, all_sizes, all_src_offsets):
        """Reads ``all_sizes[i][j]`` bytes at offset ``all_src_offsets[i][j]`` of object
        ``keys[i]`` into ``all_buffer_ptrs[i][j]``. One entry per key: the bytes read in
        all, or the first negative code."""
        keys = list(keys)
        if not (len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets)):
            return [INVALID_PARAMS] * len(keys)
        flat_ptrs, flat_keys, dst, src, sizes, owner = [], [], [], [], [], []
        results = [0] * len(keys)
        for index, (key, ptrs, lens, offsets) in enumerate(zip(keys, all_buffer_ptrs, all_sizes, all_src_offsets)):
            ptrs, lens, offsets = list(ptrs), list(lens), list(offsets)
            if not (len(ptrs) == len(lens) == len(offsets)):
                results[index] = INVALID_PARAMS
                continue
            for ptr, length, offset in zip(ptrs, lens, offsets):
                flat_ptrs.append(ptr)
                flat_keys.append([key])
                dst.append([[0]])
                src.append([[offset]])
                sizes.append([[length]])
                owner.append(index)
        if flat_ptrs:
            got = self.get_into_ranges(flat_ptrs, flat_keys, dst, src, sizes)
            for index, per_buffer in zip(owner, got):
                count = per_buffer[0][0]
                if results[index] < 0:
                    continue
                results[index] = count if count < 0 else results[index] + count
        return results

    def batch_get_session_end(self, keys):
        """Forgets what ``batch_get_session_start`` looked up. Returns 0."""
        cache = self._get_sessions()
        for key in keys:
            cache.pop(key, None)
        return 0

    def _sessions(self):
        if not hasattr(self, "_put_sessions"):
            self._put_sessions = {}
        return self._put_sessions

    def _get_sessions(self):
        if not hasattr(self, "_get_session_sizes"):
            self._get_session_sizes = {}
        return self._get_session_sizes

    # ----- segments and other upstream calls -----

    def _not_supported(self, call, why):
        _log_once(call, f"{call}: {why}")
        return NOT_SUPPORTED

    def mount_segment(self, path, size, offset=0, protocol="tcp", location=""):
        """Upstream mounts a shared-memory file as an extra segment; this store's nodes
        contribute exactly their global segment: ``NOT_SUPPORTED`` (logged once)."""
        code = self._not_supported("mount_segment", "extra segments are not supported; size the node with --global_segment_size")
        return {"code": code, "segment_ids": []}

    def allocate_and_mount_segment(self, size, protocol="tcp", location=""):
        """See ``mount_segment``: ``NOT_SUPPORTED`` (logged once)."""
        code = self._not_supported("allocate_and_mount_segment", "extra segments are not supported; size the node with --global_segment_size")
        return {"code": code, "segment_ids": []}

    def unmount_segment(self, segment_ids, grace_period_seconds=0):
        """See ``mount_segment``: ``NOT_SUPPORTED`` (logged once)."""
        return self._not_supported("unmount_segment", "extra segments are not supported; a node's segment leaves with the node")

    def unmount_and_free_segment(self, segment_ids, grace_period_seconds=0):
        """See ``mount_segment``: ``NOT_SUPPORTED`` (logged once)."""
        return self._not_supported("unmount_and_free_segment", "extra segments are not supported; a node's segment leaves with the node")

    def unmount_local_disk_segment(self, grace_period_seconds=0):
        """Upstream detaches a node's SSD tier at run time: ``NOT_SUPPORTED`` (logged
        once); restart the node without --enable_offload instead."""
        return self._not_supported("unmount_local_disk_segment", "the SSD tier stays until the node restarts without --enable_offload")

    def init_all(self, protocol, device_name, mount_segment_size):
        """Upstream's two-step initialisation after a bare ``setup``: ``setup()`` here
        already started the transfer engine and mounted the segment, so this returns 0
        when the store is set up, -1 otherwise."""
        return 0 if self.health_check() != 1 else -1

    def get_offload_rpc_read_count(self):
        """Reads this node served from another node's SSD tier since its real client
        started (0 when unreachable)."""
        status = self.status()
        return int(status.get("remote_disk_reads", 0)) if status else 0


class _PutSession:
    """An object reserved by ``batch_put_session_start``: its bytes are gathered in
    shared memory and stored in one zero-copy put at the end."""

    __slots__ = ("ptr", "size", "config")

    def __init__(self, ptr, size, config):
        self.ptr, self.size, self.config = ptr, size, config

    def write(self, store, ptrs, sizes, offsets):
        if not (len(ptrs) == len(sizes) == len(offsets)):
            return INVALID_PARAMS
        for ptr, size, offset in zip(ptrs, sizes, offsets):
            if not all(isinstance(v, int) for v in (ptr, size, offset)) or size < 0 or offset < 0 or offset + size > self.size:
                return INVALID_PARAMS
            if size and not store._owns_memory(ptr, size):
                return INVALID_PARAMS
        for ptr, size, offset in zip(ptrs, sizes, offsets):
            ctypes.memmove(self.ptr + offset, ptr, size)
        return 0


_LOGGED = set()


def _log_once(call, message):
    if call not in _LOGGED:
        _LOGGED.add(call)
        log.warning("%s", message)
