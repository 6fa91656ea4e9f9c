"""The tensor calls of ``MooncakeDistributedStore`` (``put_tensor``, ``get_tensor``, the
``*_with_tp`` and ``*_with_parallelism`` families, safetensors export and import, ...),
as a mixin over the byte and pointer calls of the store, and the tensor names of
upstream's module (``ParallelAxis``, ``TensorParallelism``, ``ReadTarget``,
``ObjectDataType``, ``_serialize_tensor`` ...). Objects use upstream's
``[TensorMetadata][data]`` layout (see ``_tensor``), so that tensors written by either
implementation read back in the other.

Tensors are numpy arrays or torch tensors. Reads return torch tensors when torch can be
imported (as upstream), numpy arrays otherwise (bfloat16 and float8 as their
``ml_dtypes`` types when that package is installed, else as uint16/uint8 holding the
bits).
"""

import ctypes
import enum
import logging

from . import _safetensors
from . import _tensor as T
from ._store import ERROR_CODES

__all__ = [
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
]

log = logging.getLogger("mooncake")

INVALID_PARAMS = ERROR_CODES["INVALID_PARAMS"]
NO_AVAILABLE_HANDLE = ERROR_CODES["NO_AVAILABLE_HANDLE"]
FILE_NOT_FOUND = ERROR_CODES.get("FILE_NOT_FOUND", -1100)
FILE_WRITE_FAIL = ERROR_CODES.get("FILE_WRITE_FAIL", -1103)


# ----- upstream's tensor names -----


class ObjectDataType(enum.IntEnum):
    """What an object holds (upstream's ``ObjectDataType``; ``ReplicateConfig.data_type``)."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9

    def __str__(self):
        return f"ObjectDataType.{self.name}"


UNKNOWN = ObjectDataType.UNKNOWN
KVCACHE = ObjectDataType.KVCACHE
TENSOR = ObjectDataType.TENSOR
WEIGHT = ObjectDataType.WEIGHT
SAMPLE = ObjectDataType.SAMPLE
ACTIVATION = ObjectDataType.ACTIVATION
GRADIENT = ObjectDataType.GRADIENT
OPTIMIZER_STATE = ObjectDataType.OPTIMIZER_STATE
METADATA = ObjectDataType.METADATA
GENERAL = ObjectDataType.GENERAL


class ParallelAxis:
    """One axis of a tensor's parallel layout: ``kind`` ("tp", "dp", "ep" or "pp"),
    ``rank`` of ``size``, and ``split_dim`` (TP: required), ``expert_id`` (EP: required)
    or ``stage_id`` (PP: required). Upstream's constructor takes no arguments; these
    keyword arguments are an addition."""

    def __init__(self, kind="", rank=0, size=1, split_dim=None, expert_id=None, stage_id=None):
        self.kind = kind
        self.rank = rank
        self.size = size
        self.split_dim = split_dim
        self.expert_id = expert_id
        self.stage_id = stage_id

    def __repr__(self):
        extra = "".join(f", {n}={getattr(self, n)}" for n in ("split_dim", "expert_id", "stage_id") if getattr(self, n) is not None)
        return f"ParallelAxis(kind={self.kind!r}, rank={self.rank}, size={self.size}{extra})"


class TensorParallelism:
    """A tensor's parallel layout: ``axes``, a list of ``ParallelAxis`` (at most 4, one
    per kind)."""

    def __init__(self, axes=None):
        self.axes = list(axes) if axes is not None else []

    def __repr__(self):
        return f"TensorParallelism(axes={self.axes!r})"


class ReadTarget:
    """What a ``*_with_parallelism`` read returns: ``mode`` "as_stored" (the object at
    the key), "shard" (the shard that ``parallelism`` names) or "full" (the full tensor,
    reassembled from its TP shards), case-insensitive."""

    def __init__(self, mode="as_stored", parallelism=None):
        self.mode = mode
        self.parallelism = parallelism

    def __repr__(self):
        return f"ReadTarget(mode={self.mode!r}, parallelism={self.parallelism!r})"


def _tensor_metadata_size():
    """The size of the tensor header (304)."""
    return T.METADATA_SIZE


def _serialize_tensor(tensor):
    """``(metadata bytes, data pointer, data size, owner)`` of a torch tensor (or numpy
    array): the header of the FULL object that ``put_tensor`` would store, and where its
    C-order bytes are (``owner`` keeps them alive). ValueError for unsupported input."""
    try:
        array, code = _to_storage(tensor)
    except (TypeError, ValueError):
        log.error("_serialize_tensor: unsupported tensor %r", type(tensor).__name__)
        raise ValueError("unsupported tensor for Mooncake tensor serialization") from None
    meta = T.pack_metadata(code, array.shape, array.shape, array.nbytes)
    return meta, array.ctypes.data, array.nbytes, _present(array, code)


def _deserialize_tensor(data):
    """The tensor held by ``[TensorMetadata][data]`` bytes. ValueError when invalid."""
    buf = bytearray(data)
    meta = T.parse_metadata(buf)
    if meta is None:
        raise ValueError("invalid serialized Mooncake tensor payload")
    return _present(_storage_view(buf, meta), meta.dtype)


# ----- numpy / torch conversion -----


def _torch():
    try:
        import torch  # noqa: PLC0415

        return torch
    except ImportError:
        return None


def _numpy():
    import numpy  # noqa: PLC0415

    return numpy


def _ml_dtypes():
    try:
        import ml_dtypes  # noqa: PLC0415

        return ml_dtypes
    except ImportError:
        return None


_NUMPY_CODES = {
    ("f", 4): 0, ("f", 8): 1, ("i", 1): 2, ("u", 1): 3, ("i", 2): 4, ("u", 2): 5,
    ("i", 4): 6, ("u", 4): 7, ("i", 8): 8, ("u", 8): 9, ("b", 1): 10, ("f", 2): 11,
}  # fmt: skip


def _contiguous(array):
    """``array`` in C order (``numpy.ascontiguousarray`` would turn 0-d into 1-d)."""
    return array if array.flags.c_contiguous else array.copy(order="C")


def _to_storage(tensor):
    """(C-contiguous little-endian numpy array of the storage dtype, dtype code) of a
    torch tensor or numpy array (or anything ``numpy.asarray`` takes)."""
    np = _numpy()
    torch = _torch()
    if torch is not None and isinstance(tensor, torch.Tensor):
        code = T.DTYPE_CODES.get(str(tensor.dtype).rsplit(".", 1)[-1])
        if code is None:
            raise TypeError(f"unsupported tensor dtype {tensor.dtype}")
        t = tensor.detach().to("cpu").contiguous()
        if code in (12, 13, 14):
            t = t.view(torch.uint16 if code == 12 else torch.uint8)
        return _contiguous(t.numpy()), code
    array = np.asarray(tensor)
    dtype = array.dtype
    code = T.DTYPE_CODES.get(dtype.name) if dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2") else None
    if code is None:
        if dtype.hasobject or dtype.fields is not None:
            raise TypeError(f"unsupported array dtype {dtype}")
        code = _NUMPY_CODES.get((dtype.kind, dtype.itemsize))
        if code is None:
            raise TypeError(f"unsupported array dtype {dtype}")
        if dtype.byteorder == ">":
            array = array.astype(dtype.newbyteorder("<"))
    return _contiguous(array).view(np.dtype(T.STORAGE[code])), code


def _storage_view(buf, meta, offset=None):
    """The stored data of a parsed object as a numpy array of the storage dtype over
    ``buf`` (which the array keeps alive)."""
    np = _numpy()
    dtype = np.dtype(T.STORAGE[meta.dtype])
    count = 1
    for d in meta.local_shape:
        count *= d
    start = meta.data_offset if offset is None else offset
    if count * dtype.itemsize > meta.data_bytes:
        raise ValueError("tensor data shorter than its shape")
    return np.frombuffer(buf, dtype=dtype, count=count, offset=start).reshape(meta.local_shape)


def _present(array, code):
    """The user-facing tensor for storage array ``array`` of dtype ``code``."""
    torch = _torch()
    name = T.DTYPE_NAMES[code]
    if torch is not None:
        if not array.flags.writeable:
            array = array.copy()
        result = torch.from_numpy(array)
        return result.view(getattr(torch, name)) if code in (12, 13, 14) else result
    if code in (12, 13, 14):
        ml = _ml_dtypes()
        if ml is not None:
            return array.view(getattr(ml, name))
    return array


# ----- parallelism specs -----


def _parse_axes(parallelism, context):
    """The validated axes of a ``TensorParallelism`` (upstream's rules), as ``T.Axis``;
    ValueError when invalid."""
    if not hasattr(parallelism, "axes"):
        raise ValueError(f"{context}: TensorParallelism must provide axes")
    axes = []
    for obj in list(parallelism.axes):
        if not all(hasattr(obj, n) for n in ("kind", "rank", "size")):
            raise ValueError(f"{context}: ParallelAxis must provide kind, rank, and size")
        kind = str(obj.kind).lower()
        if kind not in T.AXIS_KINDS:
            raise ValueError(f"{context}: unsupported axis kind {obj.kind!r}")
        opt = [getattr(obj, n, None) for n in ("split_dim", "expert_id", "stage_id")]
        axes.append(T.Axis(kind, int(obj.rank), int(obj.size), *[None if v is None else int(v) for v in opt]))
    if not axes:
        raise ValueError(f"{context}: parallelism axes cannot be empty")
    if len(axes) > T.MAX_AXES:
        raise ValueError(f"{context}: axis count exceeds max supported axes")
    if len({a.kind for a in axes}) != len(axes):
        raise ValueError(f"{context}: duplicate axis kinds are not supported")
    for a in axes:
        if a.size <= 0 or not 0 <= a.rank < a.size:
            raise ValueError(f"{context}: invalid rank/size for axis {a.kind}")
        required = {"tp": "split_dim", "ep": "expert_id", "pp": "stage_id"}.get(a.kind)
        if required and getattr(a, required) is None:
            raise ValueError(f"{context}: {a.kind.upper()} axis requires {required}")
        if a.kind != "tp" and a.split_dim is not None:
            raise ValueError(f"{context}: {a.kind.upper()} axis must not provide split_dim")
    return axes


def _tp_axis(axes):
    for index, a in enumerate(axes):
        if a.kind == "tp":
            return index
    return None


def _same_axes(requested, stored):
    return sorted(requested, key=lambda a: T.AXIS_KINDS[a.kind]) == T.canonical_axes(stored)


def _parse_writer(obj, context):
    if not all(hasattr(obj, n) for n in ("rank", "size", "split_dim")):
        raise ValueError(f"{context}: writer_partition must provide rank, size, and split_dim")
    rank, size, split_dim = int(obj.rank), int(obj.size), int(obj.split_dim)
    if size <= 0 or not 0 <= rank < size or split_dim < 0:
        raise ValueError(f"{context}: invalid writer partition")
    return rank, size, split_dim


def _parse_target(target):
    """(mode, axes or None) of a ``ReadTarget`` (None: as stored)."""
    if target is None:
        return "AS_STORED", None
    if not hasattr(target, "mode") or not hasattr(target, "parallelism"):
        raise ValueError("ReadTarget must provide mode and parallelism")
    mode = str(target.mode).upper()
    if mode not in ("AS_STORED", "SHARD", "FULL"):
        raise ValueError("Unsupported ReadTarget mode")
    axes = None if target.parallelism is None else _parse_axes(target.parallelism, "ReadTarget")
    return mode, axes


def _check_uniform(shape, split_dim, count, context):
    if not 0 <= split_dim < len(shape) or count <= 0:
        raise ValueError(f"{context}: invalid shard parameters")
    if shape[split_dim] % count:
        raise ValueError(f"{context}: only uniform sharding is supported")


def _slice(array, split_dim, rank, count):
    np = _numpy()
    start, extent = T.shard_range(array.shape[split_dim], rank, count)
    index = [slice(None)] * array.ndim
    index[split_dim] = slice(start, start + extent)
    return np.ascontiguousarray(array[tuple(index)])


_logged = set()


def _log_once(what, message):
    if what not in _logged:
        _logged.add(what)
        log.warning(message)


class TensorMixin:
    """Tensor calls, built on ``alloc_from_mem_pool``, ``batch_put_from``, ``get_buffer`` ..."""

    # ----- writing objects -----

    def _write_items(self, items, config, upsert):
        """Stores ``items`` (``(key, header bytes, storage array)``); one code each."""
        results = [0] * len(items)
        blocks, positions, keys, ptrs, sizes = [], [], [], [], []
        try:
            for index, (key, header, array) in enumerate(items):
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
                keys.append(key)
                ptrs.append(ptr)
                sizes.append(total)
            if positions:
                write = self.batch_upsert_from if upsert else self.batch_put_from
                codes = write(keys, ptrs, sizes, config) if config is not None else write(keys, ptrs, sizes)
                for index, code in zip(positions, codes):
                    results[index] = code
            return results
        finally:
            for ptr in blocks:
                self.free_to_mem_pool(ptr)

    def _write_groups(self, keys, plan, config, upsert):
        """Runs ``plan(index, key)`` for each key (a list of items, plus the manifests to
        upsert as ``(key, bytes)``), stores everything, and returns one code per key: 0,
        or the first failure among its objects (``INVALID_PARAMS`` when planning
        failed)."""
        keys = list(keys)
        results = [0] * len(keys)
        items, owners, manifests = [], [], []
        for index, key in enumerate(keys):
            try:
                group, extra = plan(index, key)
            except (TypeError, ValueError, IndexError) as error:
                log.error("cannot store tensor under %r: %s", key, error)
                results[index] = INVALID_PARAMS
                continue
            items.extend(group)
            owners.extend([index] * len(group))
            manifests.extend((index, k, v) for k, v in extra)
        for index, code in zip(owners, self._write_items(items, config, upsert) if items else []):
            if code != 0 and results[index] == 0:
                results[index] = code
        for index, key, value in manifests:
            if results[index] == 0:
                code = self.upsert(key, value, config) if config is not None else self.upsert(key, value)
                if code != 0:
                    results[index] = code
        return results

    @staticmethod
    def _full_item(key, array, code):
        return key, T.pack_metadata(code, array.shape, array.shape, array.nbytes), array

    @staticmethod
    def _shard_items(key_for, array, code, split_dim, count, axes, global_shape=None, context="tp"):
        """Items for all ``count`` TP shards of full ``array`` along ``split_dim`` (the
        TP axis of ``axes`` gets each rank), keyed by ``key_for(rank)``."""
        _check_uniform(array.shape, split_dim, count, context)
        tp = _tp_axis(axes)
        items = []
        for rank in range(count):
            shard = _slice(array, split_dim, rank, count)
            shard_axes = list(axes)
            shard_axes[tp] = shard_axes[tp]._replace(rank=rank)
            header = T.pack_metadata(code, global_shape or array.shape, shard.shape, shard.nbytes, T.SHARD, shard_axes)
            items.append((key_for(rank, shard_axes), header, shard))
        return items

    def _write_tensors(self, keys, tensors, config, upsert):
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            return [INVALID_PARAMS] * len(keys)

        def plan(index, key):
            array, code = _to_storage(tensors[index])
            return [self._full_item(key, array, code)], []

        return self._write_groups(keys, plan, config, upsert)

    # ----- whole tensors -----

    @staticmethod
    def _valid_pub_config(config):
        """Upstream's check for publishing: explicit preferred segments must name one
        segment per replica."""
        if config is None:
            return True
        segments = list(config.preferred_segments)
        return not segments or len(segments) == config.replica_num

    def put_tensor(self, key, tensor, config=None):
        """Stores a torch tensor or numpy array as a FULL ``[TensorMetadata][data]``
        object (``config`` is an addition to upstream's signature)."""
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
        """Publishes a tensor (a put with the given replica config, whose explicit
        preferred segments must number ``replica_num``)."""
        if not self._valid_pub_config(config):
            return INVALID_PARAMS
        return self.put_tensor(key, tensor, config)

    def batch_pub_tensor(self, keys, tensors_list, config=None):
        """``pub_tensor`` for each key."""
        if not self._valid_pub_config(config):
            return [INVALID_PARAMS] * len(list(keys))
        return self.batch_put_tensor(keys, tensors_list, config)

    def upsert_pub_tensor(self, key, tensor, config=None):
        """``pub_tensor`` that replaces an existing object."""
        if not self._valid_pub_config(config):
            return INVALID_PARAMS
        return self.upsert_tensor(key, tensor, config)

    def batch_upsert_pub_tensor(self, keys, tensors_list, config=None):
        """``upsert_pub_tensor`` for each key."""
        if not self._valid_pub_config(config):
            return [INVALID_PARAMS] * len(list(keys))
        return self.batch_upsert_tensor(keys, tensors_list, config)

    # ----- reading objects -----

    def _load(self, key):
        """(buffer handle, Metadata) of the tensor object at ``key``, or (None, None)."""
        handle = self.get_buffer(key)
        if handle is None:
            return None, None
        meta = T.parse_metadata(memoryview(handle))
        return (handle, meta) if meta is not None else (None, None)

    def _load_array(self, key):
        """(storage array, Metadata) of the tensor at ``key``, or (None, None)."""
        handle, meta = self._load(key)
        if meta is None:
            return None, None
        try:
            return _storage_view(handle, meta), meta
        except ValueError:
            return None, None

    def get_tensor(self, key):
        """The stored tensor (torch when torch is installed, else numpy), or None."""
        array, meta = self._load_array(key)
        return _present(array, meta.dtype) if meta is not None else None

    def batch_get_tensor(self, keys):
        """``get_tensor`` for each key."""
        return [self.get_tensor(key) for key in keys]

    def _tensor_at(self, ptr, size):
        if size <= 0 or not self._owns_memory(ptr, size):
            return None, None
        buf = (ctypes.c_ubyte * size).from_address(ptr)
        meta = T.parse_metadata(memoryview(buf))
        if meta is None:
            return None, None
        try:
            return _storage_view(buf, meta), meta
        except ValueError:
            return None, None

    def _present_at(self, ptr, size):
        array, meta = self._tensor_at(ptr, size)
        return _present(array, meta.dtype) if meta is not None else None

    def get_tensor_into(self, key, buffer_ptr, size):
        """Reads a tensor object into ``buffer_ptr`` (pool memory or a registered buffer)
        and returns a tensor viewing its data, or None."""
        got = self.get_into(key, buffer_ptr, size)
        if got <= 0:
            return None
        return self._present_at(buffer_ptr, got)

    def batch_get_tensor_into(self, keys, buffer_ptrs, sizes):
        """``get_tensor_into`` for each key; mismatched lengths give ``INVALID_PARAMS``."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        got = self.batch_get_into(keys, buffer_ptrs, sizes)
        return [self._present_at(p, n) if n > 0 else None for p, n in zip(buffer_ptrs, got)]

    # ----- writes from buffers laid out as [TensorMetadata][data] -----

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

    def _buffer_tensor(self, ptr, size):
        """(storage array, dtype code) of the full tensor laid out at ``ptr``; ValueError
        when the buffer holds none."""
        array, meta = self._tensor_at(ptr, size)
        if meta is None:
            raise ValueError("buffer holds no valid [TensorMetadata][data] tensor")
        return array, meta.dtype

    # ----- tensor parallelism: shard r of tp_size stored as <key>_tp_<r> -----

    def _write_tp(self, keys, sources, tp_size, split_dim, config, upsert):
        """Stores every TP shard of each full tensor (``sources[i]()`` gives its storage
        array and dtype code); a tp_size of 1 stores the whole tensor at the key."""
        keys, sources = list(keys), list(sources)
        if len(keys) != len(sources):
            return [INVALID_PARAMS] * len(keys)

        def plan(index, key):
            array, code = sources[index]()
            if tp_size == 1:
                return [self._full_item(key, array, code)], []
            axes = [T.Axis("tp", 0, tp_size, split_dim, None, None)]
            return self._shard_items(lambda r, _: T.tp_key(key, r), array, code, split_dim, tp_size, axes), []

        return self._write_groups(keys, plan, config, upsert)

    @staticmethod
    def _sources(tensors):
        return [lambda t=t: _to_storage(t) for t in tensors]

    def _buffer_sources(self, buffer_ptrs, sizes):
        return [lambda p=p, n=n: self._buffer_tensor(p, n) for p, n in zip(buffer_ptrs, sizes)]

    def put_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """Splits ``tensor`` into ``tp_size`` equal shards along ``split_dim`` and stores
        shard ``r`` as ``<key>_tp_<r>`` (SHARD objects with one TP axis), for every rank
        (``tp_rank`` is not used, as upstream). A dimension that does not divide evenly
        gives ``INVALID_PARAMS``; ``tp_size`` 1 stores the tensor at ``key``."""
        return self._write_tp([key], self._sources([tensor]), tp_size, split_dim, config, False)[0]

    def batch_put_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """``put_tensor_with_tp`` for each key."""
        return self._write_tp(base_keys, self._sources(tensors_list), tp_size, split_dim, config, False)

    def upsert_tensor_with_tp(self, key, tensor, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """``put_tensor_with_tp`` that replaces existing shards."""
        return self._write_tp([key], self._sources([tensor]), tp_size, split_dim, config, True)[0]

    def batch_upsert_tensor_with_tp(self, base_keys, tensors_list, tp_rank=0, tp_size=1, split_dim=0, config=None):
        """``upsert_tensor_with_tp`` for each key."""
        return self._write_tp(base_keys, self._sources(tensors_list), tp_size, split_dim, config, True)

    def put_tensor_with_tp_from(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        """``put_tensor_with_tp`` of the full tensor laid out at ``buffer_ptr``."""
        return self.batch_put_tensor_with_tp_from([key], [buffer_ptr], [size], tp_rank, tp_size, split_dim)[0]

    def batch_put_tensor_with_tp_from(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1, split_dim=0):
        """``put_tensor_with_tp_from`` for each key."""
        base_keys, buffer_ptrs, sizes = list(base_keys), list(buffer_ptrs), list(sizes)
        if not (len(base_keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(base_keys)
        return self._write_tp(base_keys, self._buffer_sources(buffer_ptrs, sizes), tp_size, split_dim, None, False)

    def pub_tensor_with_tp(self, key, tensor, config=None, tp_rank=0, tp_size=1, split_dim=0):
        """``put_tensor_with_tp`` with a replica config (upstream's argument order)."""
        if not self._valid_pub_config(config):
            return INVALID_PARAMS
        return self.put_tensor_with_tp(key, tensor, tp_rank, tp_size, split_dim, config)

    def batch_pub_tensor_with_tp(self, base_keys, tensors_list, config=None, tp_rank=0, tp_size=1, split_dim=0):
        """``batch_put_tensor_with_tp`` with a replica config (upstream's argument order)."""
        if not self._valid_pub_config(config):
            return [INVALID_PARAMS] * len(list(base_keys))
        return self.batch_put_tensor_with_tp(base_keys, tensors_list, tp_rank, tp_size, split_dim, config)

    @staticmethod
    def _tp_read_key(key, tp_rank, tp_size):
        return key if tp_size == 1 else T.tp_key(key, tp_rank)

    def get_tensor_with_tp(self, key, tp_rank=0, tp_size=1, split_dim=0):
        """Shard ``tp_rank`` stored by ``put_tensor_with_tp`` (``<key>_tp_<rank>``; the
        object at ``key`` when ``tp_size`` is 1), or None."""
        return self.get_tensor(self._tp_read_key(key, tp_rank, tp_size))

    def batch_get_tensor_with_tp(self, base_keys, tp_rank=0, tp_size=1, split_dim=0):
        """``get_tensor_with_tp`` for each key."""
        return [self.get_tensor(self._tp_read_key(key, tp_rank, tp_size)) for key in base_keys]

    def get_tensor_with_tp_into(self, key, buffer_ptr, size, tp_rank=0, tp_size=1, split_dim=0):
        """Reads shard ``tp_rank`` into ``buffer_ptr`` and returns a view of it, or None."""
        return self.get_tensor_into(self._tp_read_key(key, tp_rank, tp_size), buffer_ptr, size)

    def batch_get_tensor_with_tp_into(self, base_keys, buffer_ptrs, sizes, tp_rank=0, tp_size=1, split_dim=0):
        """``get_tensor_with_tp_into`` for each key."""
        keys = [self._tp_read_key(key, tp_rank, tp_size) for key in base_keys]
        return self.batch_get_tensor_into(keys, buffer_ptrs, sizes)

    # ----- general parallelism (TensorParallelism / writer partitions) -----

    def _plan_parallel(self, key, source, parallelism, writer, from_buffer):
        """Items and manifests for one ``*_with_parallelism`` write (upstream's routes).

        * ``writer_partition``: the full tensor's shard ``rank`` at
          ``<key>__writer_<rank>of<size>_sd<d>`` plus ``<key>__writer_manifest``;
        * no parallelism: the full tensor at ``key``;
        * a single TP axis: the tensor is this rank's shard (global shape inferred), at
          ``<key>_tp_<rank>``, plus ``<key>__parallelism_manifest``; from a buffer, the
          buffer holds the full tensor and every rank's shard is stored;
        * a TP axis among others: the tensor is full, this rank's shard is stored at the
          ``__<kind>_<r>of<n>...`` key, plus the manifest (from a buffer: every rank);
        * no TP axis: the tensor stored as it is, as a SHARD object at that key.
        """
        context = "put_tensor_with_parallelism"
        if writer is not None and parallelism is not None:
            raise ValueError(f"{context}: writer_partition cannot be combined with parallelism")
        array, code = source()
        if writer is not None:
            rank, size, split_dim = _parse_writer(writer, context)
            _check_uniform(array.shape, split_dim, size, context)
            shard = _slice(array, split_dim, rank, size)
            axes = [T.Axis("tp", rank, size, split_dim, None, None)]
            header = T.pack_metadata(code, array.shape, shard.shape, shard.nbytes, T.SHARD, axes)
            manifest = T.pack_manifest(code, array.shape, split_dim, size)
            return [(T.writer_key(key, rank, size, split_dim), header, shard)], [(T.writer_manifest_key(key), manifest)]
        if parallelism is None:
            return [self._full_item(key, array, code)], []
        axes = _parse_axes(parallelism, context)
        tp = _tp_axis(axes)
        if tp is None:
            header = T.pack_metadata(code, array.shape, array.shape, array.nbytes, T.SHARD, axes)
            return [(T.parallelism_key(key, axes), header, array)], []
        axis = axes[tp]
        if from_buffer:
            return self._shard_items(lambda r, a: T.parallelism_key(key, a), array, code, axis.split_dim, axis.size, axes, context=context), []
        if len(axes) == 1:
            if not 0 <= axis.split_dim < array.ndim:
                raise ValueError(f"{context}: invalid shard parameters")
            global_shape = list(array.shape)
            global_shape[axis.split_dim] *= axis.size
            header = T.pack_metadata(code, global_shape, array.shape, array.nbytes, T.SHARD, axes)
        else:
            global_shape = array.shape
            _check_uniform(global_shape, axis.split_dim, axis.size, context)
            array = _slice(array, axis.split_dim, axis.rank, axis.size)
            header = T.pack_metadata(code, global_shape, array.shape, array.nbytes, T.SHARD, axes)
        manifest = T.pack_manifest(code, global_shape, axis.split_dim, axis.size)
        return [(T.parallelism_key(key, axes), header, array)], [(T.parallelism_manifest_key(key), manifest)]

    def _write_parallel(self, keys, sources, parallelisms, writers, config, upsert, from_buffer, batch):
        keys = list(keys)
        context = "batch_put_tensor_with_parallelism"
        if batch:
            checked = []
            for name, value in (("parallelisms", parallelisms), ("writer_partitions", writers)):
                if value is None:
                    checked.append([None] * len(keys))
                elif not isinstance(value, list) or len(value) != len(keys):
                    log.error("%s: %s must be a list as long as keys, or None", context, name)
                    return [INVALID_PARAMS] * len(keys)
                else:
                    checked.append(value)
            parallelisms, writers = checked
        if len(sources) != len(keys):
            return [INVALID_PARAMS] * len(keys)

        def plan(index, key):
            return self._plan_parallel(key, sources[index], parallelisms[index], writers[index], from_buffer)

        return self._write_groups(keys, plan, config, upsert)

    def put_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None, writer_partition=None):
        """Stores a tensor under a ``TensorParallelism`` layout or as one writer's
        partition (any object with ``rank``, ``size``, ``split_dim``); see
        ``_plan_parallel`` for the keys. Without either, same as ``put_tensor``."""
        return self._write_parallel([key], self._sources([tensor]), [parallelism], [writer_partition], config, False, False, False)[0]

    def batch_put_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None, config=None, writer_partitions=None):
        """``put_tensor_with_parallelism`` for each key (``parallelisms`` and
        ``writer_partitions``: lists as long as ``keys``, or None)."""
        return self._write_parallel(keys, self._sources(list(tensors_list)), parallelisms, writer_partitions, config, False, False, True)

    def upsert_tensor_with_parallelism(self, key, tensor, parallelism=None, config=None, writer_partition=None):
        """``put_tensor_with_parallelism`` that replaces existing objects."""
        return self._write_parallel([key], self._sources([tensor]), [parallelism], [writer_partition], config, True, False, False)[0]

    def batch_upsert_tensor_with_parallelism(self, keys, tensors_list, parallelisms=None, config=None, writer_partitions=None):
        """``upsert_tensor_with_parallelism`` for each key."""
        return self._write_parallel(keys, self._sources(list(tensors_list)), parallelisms, writer_partitions, config, True, False, True)

    def _parallel_from(self, keys, buffer_ptrs, sizes, parallelisms, config, writers, upsert, batch):
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if not batch:
            parallelisms, writers = [parallelisms], [writers]
        elif all(v is None for v in (parallelisms, writers)):
            # Plain full objects: stored straight from the buffers.
            return (self.batch_upsert_tensor_from if upsert else self.batch_put_tensor_from)(keys, buffer_ptrs, sizes, config)
        if not batch and parallelisms[0] is None and writers[0] is None:
            return (self.batch_upsert_tensor_from if upsert else self.batch_put_tensor_from)(keys, buffer_ptrs, sizes, config)
        return self._write_parallel(keys, self._buffer_sources(buffer_ptrs, sizes), parallelisms, writers, config, upsert, True, batch)

    def put_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None, config=None, writer_partition=None):
        """``put_tensor_with_parallelism`` of the full tensor laid out at
        ``buffer_ptr`` (with a TP axis, every rank's shard is stored)."""
        return self._parallel_from([key], [buffer_ptr], [size], parallelism, config, writer_partition, False, False)[0]

    def batch_put_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms=None, config=None, writer_partitions=None):
        """``put_tensor_with_parallelism_from`` for each key."""
        return self._parallel_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, False, True)

    def upsert_tensor_with_parallelism_from(self, key, buffer_ptr, size, parallelism=None, config=None, writer_partition=None):
        """``put_tensor_with_parallelism_from`` that replaces existing objects."""
        return self._parallel_from([key], [buffer_ptr], [size], parallelism, config, writer_partition, True, False)[0]

    def batch_upsert_tensor_with_parallelism_from(self, keys, buffer_ptrs, sizes, parallelisms=None, config=None, writer_partitions=None):
        """``upsert_tensor_with_parallelism_from`` for each key."""
        return self._parallel_from(keys, buffer_ptrs, sizes, parallelisms, config, writer_partitions, True, True)

    # ----- reads with a ReadTarget -----

    def _read_shard(self, key, axes):
        """(storage array, Metadata, storage key) of the shard that ``axes`` name: at its
        parallelism key, or (single TP axis) at the matching writer-partition key."""
        names = [T.parallelism_key(key, axes)]
        if len(axes) == 1 and axes[0].kind == "tp":
            a = axes[0]
            names.append(T.writer_key(key, a.rank, a.size, a.split_dim or 0))
        for name in names:
            array, meta = self._load_array(name)
            if meta is not None and meta.layout == T.SHARD and _same_axes(axes, meta.axes):
                return array, meta, name
        return None, None, None

    def _assemble(self, shards, split_dim, global_shape):
        """The full storage array from shards (storage arrays, Metadata), or None."""
        np = _numpy()
        metas = [m for _, m in shards]
        if any(m.dtype != metas[0].dtype or tuple(m.global_shape) != tuple(global_shape) for m in metas):
            log.error("get_tensor_with_parallelism: shards disagree on dtype or global shape")
            return None
        full = np.concatenate([a for a, _ in shards], axis=split_dim)
        if tuple(full.shape) != tuple(global_shape):
            log.error("get_tensor_with_parallelism: shards do not cover the full tensor")
            return None
        return full

    def _resolve(self, key, target):
        """What a ReadTarget read of ``key`` gives: ("key", storage key) when it is one
        stored object, ("array", storage array, dtype code) when it is reassembled, or
        None. ValueError for an invalid target."""
        mode, axes = _parse_target(target)
        if mode == "AS_STORED":
            if axes is not None:
                log.error("get_tensor_with_parallelism: unsupported ReadTarget mode")
                return None
            return ("key", key)
        if mode == "SHARD":
            if axes is None:
                log.error("get_tensor_with_parallelism: a shard read needs a parallelism")
                return None
            _, meta, name = self._read_shard(key, axes)
            return ("key", name) if meta is not None else None
        if axes is None:
            _, meta = self._load(key)
            if meta is not None:
                return ("key", key)
            handle = self.get_buffer(T.writer_manifest_key(key))
            manifest = T.parse_manifest(memoryview(handle)) if handle is not None else None
            if manifest is None:
                return None
            dtype, global_shape, split_dim, count = manifest
            shards = []
            for rank in range(count):
                array, meta = self._load_array(T.writer_key(key, rank, count, split_dim))
                if meta is None:
                    return None
                shards.append((array, meta))
            full = self._assemble(shards, split_dim, global_shape)
            return ("array", full, dtype) if full is not None else None
        tp = _tp_axis(axes)
        if tp is None:
            log.error("get_tensor_with_parallelism: a full read needs a TP axis")
            return None
        shards = []
        for rank in range(axes[tp].size):
            shard_axes = list(axes)
            shard_axes[tp] = shard_axes[tp]._replace(rank=rank)
            array, meta, _ = self._read_shard(key, shard_axes)
            if meta is None:
                log.error("get_tensor_with_parallelism: missing shard %d of %r", rank, key)
                return None
            shards.append((array, meta))
        full = self._assemble(shards, axes[tp].split_dim, shards[0][1].global_shape)
        return ("array", full, shards[0][1].dtype) if full is not None else None

    def get_tensor_with_parallelism(self, key, target=None):
        """The tensor a ``ReadTarget`` names (None: as stored), or None. An invalid
        ``mode`` raises ValueError, as upstream raises."""
        found = self._resolve(key, target)
        if found is None:
            return None
        if found[0] == "key":
            return self.get_tensor(found[1])
        return _present(found[1], found[2])

    def batch_get_tensor_with_parallelism(self, keys, targets=None):
        """``get_tensor_with_parallelism`` for each key (``targets``: a list as long as
        ``keys``, or None)."""
        keys = list(keys)
        if targets is not None and (not isinstance(targets, list) or len(targets) != len(keys)):
            log.error("batch_get_tensor_with_parallelism: targets must be a list or None")
            return [None] * len(keys)
        targets = targets if targets is not None else [None] * len(keys)
        return [self.get_tensor_with_parallelism(k, t) for k, t in zip(keys, targets)]

    def get_tensor_with_parallelism_into(self, key, buffer_ptr, size, target=None):
        """``get_tensor_with_parallelism`` into ``buffer_ptr`` (laid out as
        ``[TensorMetadata][data]``; a reassembled tensor gets a FULL header); a tensor
        viewing the buffer, or None."""
        found = self._resolve(key, target)
        if found is None:
            return None
        if found[0] == "key":
            return self.get_tensor_into(found[1], buffer_ptr, size)
        array, code = found[1], found[2]
        header = T.pack_metadata(code, array.shape, array.shape, array.nbytes)
        total = len(header) + array.nbytes
        if total > size or not self._owns_memory(buffer_ptr, total):
            log.error("get_tensor_with_parallelism_into: buffer too small or not registered")
            return None
        ctypes.memmove(buffer_ptr, header, len(header))
        if array.nbytes:
            ctypes.memmove(buffer_ptr + len(header), _contiguous(array).ctypes.data, array.nbytes)
        return self._present_at(buffer_ptr, total)

    def batch_get_tensor_with_parallelism_into(self, keys, buffer_ptrs, sizes, targets=None):
        """``get_tensor_with_parallelism_into`` for each key."""
        keys, buffer_ptrs, sizes = list(keys), list(buffer_ptrs), list(sizes)
        if not (len(keys) == len(buffer_ptrs) == len(sizes)):
            return [INVALID_PARAMS] * len(keys)
        if targets is not None and (not isinstance(targets, list) or len(targets) != len(keys)):
            log.error("batch_get_tensor_with_parallelism_into: targets must be a list or None")
            return [None] * len(keys)
        targets = targets if targets is not None else [None] * len(keys)
        return [self.get_tensor_with_parallelism_into(*args) for args in zip(keys, buffer_ptrs, sizes, targets)]

    # ----- CUDA -----

    def _tensor_header(self, key):
        """(Metadata, object size) of the tensor object at ``key``, read without its
        payload, or an error code."""
        total = self.get_size(key)
        if total < 0:
            return total
        if total < T.METADATA_SIZE:
            return INVALID_PARAMS
        block = self.alloc_from_mem_pool(T.METADATA_SIZE)
        if not block:
            return NO_AVAILABLE_HANDLE
        try:
            got = self.get_into_ranges([block], [[key]], [[[0]]], [[[0]]], [[[T.METADATA_SIZE]]])[0][0][0]
            if got < 0:
                return got
            header = bytes((ctypes.c_ubyte * T.METADATA_SIZE).from_address(block))
        finally:
            self.free_to_mem_pool(block)
        meta = T.parse_metadata(header, total)
        return (meta, total) if meta is not None else INVALID_PARAMS

    def get_tensor_into_cuda(self, key, tensor):
        """Reads the payload of the tensor object at ``key`` into ``tensor`` (a contiguous
        CUDA or CPU tensor whose memory is registered with ``register_buffer``); returns
        the bytes read, or an error code (``INVALID_PARAMS`` for a destination that is not
        a contiguous tensor or is smaller than the payload, ``OBJECT_NOT_FOUND`` for a
        missing key). GPU memory is written by the real client's CUDA driver."""
        try:
            if not tensor.is_contiguous():
                log.error("get_tensor_into_cuda: the destination must be contiguous")
                return INVALID_PARAMS
            ptr = tensor.data_ptr()
            capacity = tensor.numel() * tensor.element_size()
        except AttributeError:
            log.error("get_tensor_into_cuda: the destination must be a tensor")
            return INVALID_PARAMS
        header = self._tensor_header(key)
        if isinstance(header, int):
            return header
        meta, _ = header
        if meta.data_bytes > capacity:
            log.error("get_tensor_into_cuda: %d payload bytes do not fit the %d-byte destination", meta.data_bytes, capacity)
            return INVALID_PARAMS
        if meta.data_bytes == 0:
            return 0
        got = self.get_into_ranges([ptr], [[key]], [[[0]]], [[[meta.data_offset]]], [[[meta.data_bytes]]])[0][0][0]
        return got if got < 0 else meta.data_bytes

    def batch_get_tensor_into_cuda(self, keys, tensors_list):
        """``get_tensor_into_cuda`` for each key."""
        keys, tensors_list = list(keys), list(tensors_list)
        if len(keys) != len(tensors_list):
            return [INVALID_PARAMS] * len(keys)
        return [self.get_tensor_into_cuda(k, t) for k, t in zip(keys, tensors_list)]

    # ----- safetensors -----

    def save_tensor_to_safetensor(self, key, file_name=None):
        """Writes the tensor at ``key`` to a safetensors file (``file_name``, default
        ``key``) holding one tensor named ``key``. 0, ``FILE_NOT_FOUND`` (-1100, as
        upstream) when there is no tensor at ``key``, ``FILE_WRITE_FAIL`` when the file
        cannot be written."""
        array, meta = self._load_array(key)
        if meta is None:
            log.error("save_tensor_to_safetensor: failed to fetch tensor for key %r", key)
            return FILE_NOT_FOUND
        path = key if file_name is None else file_name
        try:
            _safetensors.write(path, [(key, T.SAFETENSORS_NAMES[meta.dtype], array.shape, array)])
        except OSError as error:
            log.error("save_tensor_to_safetensor: cannot write %r: %s", path, error)
            return FILE_WRITE_FAIL
        return 0

    def load_tensor_from_safetensor(self, key=None, file_name=None):
        """Reads a tensor from a safetensors file and stores it (upsert) under ``key``
        (default: ``file_name``): the entry named ``key``, else the file's first entry
        (with a warning). Returns the tensor, or None (missing or invalid file,
        unsupported dtype, failed store)."""
        if file_name is None:
            file_name, key = key, None
        if file_name is None:
            log.error("load_tensor_from_safetensor: file_name is required")
            return None
        try:
            entries = _safetensors.read(file_name)
        except (OSError, ValueError) as error:
            log.error("load_tensor_from_safetensor: cannot load %r: %s", file_name, error)
            return None
        if not entries:
            log.error("load_tensor_from_safetensor: %r holds no tensor", file_name)
            return None
        store_key = file_name if key is None else key
        chosen = [e for e in entries if e[0] == store_key]
        if not chosen:
            log.warning("load_tensor_from_safetensor: key %r not found in %r; using its first entry", store_key, file_name)
            chosen = entries[:1]
        _, st_dtype, shape, data = chosen[0]
        code = T.SAFETENSORS_CODES.get(st_dtype)
        if code is None:
            log.error("load_tensor_from_safetensor: unsupported dtype %s", st_dtype)
            return None
        np = _numpy()
        dtype = np.dtype(T.STORAGE[code])
        count = 1
        for d in shape:
            count *= d
        if count * dtype.itemsize != len(data):
            log.error("load_tensor_from_safetensor: entry size does not match its shape")
            return None
        array = np.frombuffer(bytearray(data), dtype=dtype, count=count).reshape(shape)
        if self._write_items([self._full_item(store_key, array, code)], None, True)[0] != 0:
            return None
        return _present(array, code)
