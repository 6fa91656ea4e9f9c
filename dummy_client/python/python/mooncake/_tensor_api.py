"""The tensor calls of ``MooncakeDistributedStore`` (``put_tensor``, ``get_tensor``, the
``*_with_tp`` and ``*_with_parallelism`` families, ...), as a mixin over the byte and
pointer calls of the store. Tensors are stored as ``[TensorMetadata][data]`` (see
``_tensor``)."""

import ctypes
import logging

from . import _tensor
from ._store import ERROR_CODES

__all__ = []

log = logging.getLogger("mooncake")

INVALID_PARAMS = ERROR_CODES["INVALID_PARAMS"]
NO_AVAILABLE_HANDLE = ERROR_CODES["NO_AVAILABLE_HANDLE"]


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


class TensorMixin:
    """Tensor calls, built on ``alloc_from_mem_pool``, ``batch_put_from``, ``get_buffer`` ..."""

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
