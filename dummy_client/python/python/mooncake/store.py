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

from . import _tensor
from ._store import ERROR_CODES, ReplicateConfig, SoftPinAction, _RawBuffer, _StoreBase

__all__ = [
    "MooncakeDistributedStore",
    "ReplicateConfig",
    "SoftPinAction",
    "BufferHandle",
    "ERROR_CODES",
]

log = logging.getLogger("mooncake")

INVALID_PARAMS = ERROR_CODES["INVALID_PARAMS"]
NO_AVAILABLE_HANDLE = ERROR_CODES["NO_AVAILABLE_HANDLE"]


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


def _torch():
    try:
        import torch  # noqa: PLC0415

        return torch
    except ImportError:
        return None


def _numpy():
    import numpy  # noqa: PLC0415

    return numpy


def _as_array(tensor):
    """(C-contiguous numpy array, dtype name, framework) of a numpy array or torch tensor."""
    np = _numpy()
    torch = _torch()
    if torch is not None and isinstance(tensor, torch.Tensor):
        t = tensor.detach().to("cpu").contiguous()
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy(), "bfloat16", _tensor.TORCH
        array = t.numpy()
        return array, array.dtype.str, _tensor.TORCH
    array = np.asarray(tensor)
    if array.dtype.hasobject:
        raise TypeError("arrays of Python objects cannot be stored; use a numeric dtype")
    if not array.flags.c_contiguous:
        array = array.copy(order="C")
    return array, array.dtype.str, _tensor.NUMPY


def _from_buffer(buf, info):
    """A tensor viewing ``buf`` (which keeps its memory alive)."""
    np = _numpy()
    dtype_name, shape, header_len, data_len, framework = info
    dtype = np.dtype("<i2") if dtype_name == "bfloat16" else np.dtype(dtype_name)
    count = data_len // dtype.itemsize if dtype.itemsize else 0
    array = np.frombuffer(buf, dtype=dtype, count=count, offset=header_len).reshape(shape)
    torch = _torch()
    if framework == _tensor.TORCH and torch is not None:
        result = torch.from_numpy(array)
        return result.view(torch.bfloat16) if dtype_name == "bfloat16" else result
    return array


def _split(tensor, parts, dim):
    """``parts`` shards along ``dim`` (torch.chunk semantics), or None when the tensor
    cannot be split into that many non-empty shards."""
    torch = _torch()
    if torch is not None and isinstance(tensor, torch.Tensor):
        shards = [c.contiguous() for c in torch.chunk(tensor, parts, dim=dim)]
    else:
        np = _numpy()
        array = np.asarray(tensor)
        if array.ndim == 0:
            return None
        length = array.shape[dim]
        step = -(-length // parts) if parts else 0
        shards = [np.ascontiguousarray(np.take(array, range(i, min(i + step, length)), axis=dim)) for i in range(0, length, step or 1)]
    return shards if len(shards) == parts else None


def _as_bytes(value):
    """bytes and bytearray pass through; any other buffer (memoryview, numpy array,
    array.array) is copied into bytes."""
    if isinstance(value, (bytes, bytearray)):
        return value
    return memoryview(value).tobytes()


class MooncakeDistributedStore(_StoreBase):
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

    # ----- tensors -----

    def _write_tensors(self, keys, tensors, config, upsert):
        keys = list(keys)
        tensors = list(tensors)
        if len(keys) != len(tensors):
            return [INVALID_PARAMS] * len(keys)
        results = [0] * len(keys)
        blocks, positions, ptrs, sizes = [], [], [], []
        try:
            for index, tensor in enumerate(tensors):
                try:
                    array, dtype_name, framework = _as_array(tensor)
                except (TypeError, ValueError) as error:
                    log.error("cannot store tensor under %r: %s", keys[index], error)
                    results[index] = INVALID_PARAMS
                    continue
                header = _tensor.pack_header(dtype_name, array.shape, array.nbytes, framework)
                total = len(header) + array.nbytes
                ptr = self.alloc_from_mem_pool(total)
                if not ptr:
                    results[index] = NO_AVAILABLE_HANDLE
                    continue
                blocks.append(ptr)
                ctypes.memmove(ptr, header, len(header))
                if array.nbytes:
                    ctypes.memmove(ptr + len(header), array.ctypes.data, array.nbytes)
                positions.append(index)
                ptrs.append(ptr)
                sizes.append(total)
            if positions:
                write = self.batch_upsert_from if upsert else self.batch_put_from
                chosen = [keys[i] for i in positions]
                codes = write(chosen, ptrs, sizes, config) if config is not None else write(chosen, ptrs, sizes)
                for index, code in zip(positions, codes):
                    results[index] = code
            return results
        finally:
            for ptr in blocks:
                self.free_to_mem_pool(ptr)

    @staticmethod
    def _valid_pub_config(config):
        """Upstream's check for publishing: explicit preferred segments must name one
        segment per replica."""
        if config is None:
            return True
        segments = list(config.preferred_segments)
        return not segments or len(segments) == config.replica_num

    def put_tensor(self, key, tensor, config=None):
        """Stores a numpy array or torch tensor (``[TensorMetadata][data]``)."""
        return self._write_tensors([key], [tensor], config, False)[0]

    def batch_put_tensor(self, keys, tensors_list, config=None):
        """``put_tensor`` for each key; one code per key."""
        return self._write_tensors(keys, tensors_list, config, False)

    def upsert_tensor(self, key, tensor, config=None):
        """Stores or replaces a tensor."""
        return self._write_tensors([key], [tensor], config, True)[0]

    def batch_upsert_tensor(self, keys, tensors_list, config=None):
        """``upsert_tensor`` for each key."""
        return self._write_tensors(keys, tensors_list, config, True)

    def pub_tensor(self, key, tensor, config=None):
        """Publishes a tensor (as upstream: a put with the given replica config, whose
        explicit preferred segments must number ``replica_num``)."""
        if not self._valid_pub_config(config):
            return INVALID_PARAMS
        return self.put_tensor(key, tensor, config)

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        """``pub_tensor`` for each key."""
        if not self._valid_pub_config(config):
            return [INVALID_PARAMS] * len(list(keys))
        return self.batch_put_tensor(keys, tensors_list, config)

    def get_tensor(self, key):
        """The stored tensor (torch if it was stored from torch and torch is installed,
        else numpy), or None."""
        handle = self.get_buffer(key)
        if handle is None:
            return None
        info = _tensor.unpack_header(memoryview(handle))
        return _from_buffer(handle, info) if info else None

    def batch_get_tensor(self, keys):
        """``get_tensor`` for each key."""
        return [self.get_tensor(key) for key in keys]

    def _tensor_at(self, ptr, size):
        if size <= 0 or not self._owns_memory(ptr, size):
            return None, None
        buf = (ctypes.c_ubyte * size).from_address(ptr)
        info = _tensor.unpack_header(memoryview(buf))
        return (_from_buffer(buf, info) if info else None), info

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads a tensor into ``buffer_ptr`` (zero-copy for shared memory) and returns a
        view of it, or None."""
        got = self.get_into(key, buffer_ptr, size)
        if got <= 0:
            return None
        return self._tensor_at(buffer_ptr, got)[0]

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        """``get_tensor_into`` for each key; mismatched lengths give ``INVALID_PARAMS``."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [self._tensor_at(p, n)[0] if n > 0 else None for p, n in zip(buffer_ptrs, got)]

    def _check_tensor_buffers(self, buffer_ptrs, sizes):
        return all(self._tensor_at(p, n)[1] is not None for p, n in zip(buffer_ptrs, sizes))

    def put_tensor_from(self, key, buffer_ptr, size, config=None):
        """Stores a tensor already laid out (``[TensorMetadata][data]``) at
        ``buffer_ptr``; ``INVALID_PARAMS`` when the buffer holds no valid tensor."""
        return self.batch_put_tensor_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_tensor_from(self, keys, buffer_ptrs, sizes, config=None):
        """``put_tensor_from`` for each key."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)) or not self._check_tensor_buffers(buffer_ptrs, sizes):
            return [INVALID_PARAMS] * len(keys)
        return self.batch_put_from(keys, buffer_ptrs, sizes, config) if config is not None else self.batch_put_from(keys, buffer_ptrs, sizes)

    def upsert_tensor_from(self, key, buffer_ptr, size, config=None):
        """``put_tensor_from`` that replaces an existing object."""
        return self.batch_upsert_tensor_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_tensor_from(self, keys, buffer_ptrs, sizes, config=None):
        """``upsert_tensor_from`` for each key."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)) or not self._check_tensor_buffers(buffer_ptrs, sizes):
            return [INVALID_PARAMS] * len(keys)
        return self.batch_upsert_from(keys, buffer_ptrs, sizes, config) if config is not None else self.batch_upsert_from(keys, buffer_ptrs, sizes)

    # ----- tensor parallelism: shard r stored as <key>_tp_<r> (plain key when tp_size is 1) -----

    @staticmethod
    def _tp_key(key, rank, tp_size):
        return key if tp_size == 1 else f"{key}_tp_{rank}"

    def _write_tp(self, keys, tensors, tp_size, split_dim, config, upsert):
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors) or tp_size < 1:
            return [INVALID_PARAMS] * len(keys)
        shard_keys, shards, owner = [], [], []
        result = [0] * len(keys)
        for index, (key, tensor) in enumerate(zip(keys, tensors)):
            try:
                split = _split(tensor, tp_size, split_dim) if tp_size > 1 else [tensor]
            except (IndexError, ValueError, TypeError, RuntimeError):
                split = None
            if split is None:
                result[index] = INVALID_PARAMS
                continue
            for rank, shard in enumerate(split):
                shard_keys.append(self._tp_key(key, rank, tp_size))
                shards.append(shard)
                owner.append(index)
        codes = self._write_tensors(shard_keys, shards, config, upsert) if shard_keys else []
        for index, code in zip(owner, codes):
            if code != 0 and result[index] == 0:
                result[index] = code
        return result

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """Splits ``tensor`` into ``tp_size`` shards along ``split_dim`` (torch.chunk
        semantics; -600 when that gives fewer shards) and stores shard ``r`` as
        ``<key>_tp_<r>``."""
        return self._write_tp([key], [tensor], tp_size, split_dim, config, False)[0]

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """``put_tensor_with_tp`` for each key."""
        return self._write_tp(base_keys, tensors_list, tp_size, split_dim, config, False)

    def upsert_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """``put_tensor_with_tp`` that replaces existing shards."""
        return self._write_tp([key], [tensor], tp_size, split_dim, config, True)[0]

    def batch_upsert_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """``upsert_tensor_with_tp`` for each key."""
        return self._write_tp(base_keys, tensors_list, tp_size, split_dim, config, True)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        """``put_tensor_with_tp`` with upstream's argument order for publishing."""
        if not self._valid_pub_config(config):
            return INVALID_PARAMS
        return self.put_tensor_with_tp(key, tensor, tp_rank, tp_size, split_dim, config)

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0, tp_size=1, split_dim=0):
        """``batch_put_tensor_with_tp`` with upstream's argument order for publishing."""
        if not self._valid_pub_config(config):
            return [INVALID_PARAMS] * len(list(base_keys))
        return self.batch_put_tensor_with_tp(base_keys, tensors_list, tp_rank, tp_size, split_dim, config)

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        """Shard ``tp_rank`` of a tensor stored with ``put_tensor_with_tp``."""
        return self.get_tensor(self._tp_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1, split_dim=0):
        """``get_tensor_with_tp`` for each key."""
        return [self.get_tensor(self._tp_key(key, tp_rank, tp_size)) for key in base_keys]

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        """Reads shard ``tp_rank`` into ``buffer_ptr`` and returns a view of it, or None."""
        return self.get_tensor_into(self._tp_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1, split_dim=0):
        """``get_tensor_with_tp_into`` for each key."""
        keys = [self._tp_key(key, tp_rank, tp_size) for key in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # Upstream's "parallelism" wrappers store whole tensors.
    def put_tensor_with_parallelism(self, key, tensor, config=None, **_):
        """Same as ``put_tensor``."""
        return self.put_tensor(key, tensor, config)

    def batch_put_tensor_with_parallelism(self, keys, tensors, config=None, **_):
        """Same as ``batch_put_tensor``."""
        return self.batch_put_tensor(keys, tensors, config)

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, config=None, **_):
        """Same as ``put_tensor_from``."""
        return self.put_tensor_from(key, buffer_ptr, size, config)

    def upsert_tensor_with_parallelism(self, key, tensor, config=None, **_):
        """Same as ``upsert_tensor``."""
        return self.upsert_tensor(key, tensor, config)

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, config=None, **_):
        """Same as ``batch_upsert_tensor_from``."""
        return self.batch_upsert_tensor_from(keys, buffer_ptrs, sizes, config)
