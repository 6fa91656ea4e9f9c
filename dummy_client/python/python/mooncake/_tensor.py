"""Upstream's ``TensorMetadata`` object layout, byte for byte.

A tensor is stored as one object: a 304-byte header followed by the tensor's bytes in C
(row-major) order. All integers are little-endian (upstream copies the C struct)::

    TensorObjectHeader (40 bytes)
    offset  size  field
    0       4     magic 0x4d4f4f4e (bytes b"NOOM")
    4       2     version (1)
    6       2     header_size (304)
    8       4     dtype code (i32, DTYPE_CODES: FLOAT32 0 ... FLOAT8_E5M2 14)
    12      4     ndim (i32, 0..8)
    16      4     layout_kind (0 FULL, 1 SHARD)
    20      4     reserved_flags (0)
    24      8     data_offset (u64, 304)
    32      8     data_bytes (u64)
    TensorLayoutMetadata (264 bytes)
    40      64    global_shape: 8 x i64, unused dimensions -1
    104     64    local_shape: 8 x i64 (the shape of the stored data), unused -1
    168     4     axis_count (u32, 0..4)
    172     4     reserved (0)
    176     4x32  axes, LayoutAxis each: kind i32 (DP 0, TP 1, EP 2, PP 3), axis_index i32,
                  shard_rank i32, shard_count i32, split_dim i32 (-1 when none),
                  reserved0 i32 (EP: expert_id, PP: stage_id), reserved1 i64 (local
                  extent of split_dim when there is one); unused axes all zero

Full tensors have layout FULL, equal shapes and no axes; shards written by the
``*_with_tp`` and ``*_with_parallelism`` calls have layout SHARD, the full tensor's
shape as ``global_shape`` and one axis per parallelism axis.

Sharded writes may also store a manifest (``<key>__parallelism_manifest`` or
``<key>__writer_manifest``), 96 bytes: magic 0x574d414e (b"NAMW"), version u16 (1),
header_size u16 (96), dtype i32, ndim i32, split_dim i32, shard_count i32, reserved i32, 4 bytes of
padding, global_shape 8 x i64.
"""

import struct
from collections import namedtuple

MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
FULL, SHARD = 0, 1
AXIS_KINDS = {"dp": 0, "tp": 1, "ep": 2, "pp": 3}
AXIS_NAMES = {v: k for k, v in AXIS_KINDS.items()}

HEADER = struct.Struct("<IHHiiIIQQ")
SHAPE = struct.Struct("<8q")
AXIS = struct.Struct("<iiiiiiq")
AXES_AT = HEADER.size + 2 * SHAPE.size + 8
METADATA_SIZE = AXES_AT + MAX_AXES * AXIS.size  # 304

MANIFEST_MAGIC = 0x574D414E
MANIFEST = struct.Struct("<IHHiiiii4x")  # padded to 32 bytes, as the C struct
MANIFEST_SIZE = MANIFEST.size + SHAPE.size  # 96

# Upstream's TensorDtype codes, with the numpy dtype that holds each one's bytes (the
# storage dtype: bfloat16 and float8 use unsigned integers of their size) and the
# safetensors name.
DTYPES = [
    # (name, code, numpy storage dtype, safetensors dtype)
    ("float32", 0, "<f4", "F32"),
    ("float64", 1, "<f8", "F64"),
    ("int8", 2, "|i1", "I8"),
    ("uint8", 3, "|u1", "U8"),
    ("int16", 4, "<i2", "I16"),
    ("uint16", 5, "<u2", "U16"),
    ("int32", 6, "<i4", "I32"),
    ("uint32", 7, "<u4", "U32"),
    ("int64", 8, "<i8", "I64"),
    ("uint64", 9, "<u8", "U64"),
    ("bool", 10, "|b1", "BOOL"),
    ("float16", 11, "<f2", "F16"),
    ("bfloat16", 12, "<u2", "BF16"),
    ("float8_e4m3fn", 13, "|u1", "F8_E4M3"),
    ("float8_e5m2", 14, "|u1", "F8_E5M2"),
]
DTYPE_CODES = {name: code for name, code, _, _ in DTYPES}
DTYPE_NAMES = {code: name for name, code, _, _ in DTYPES}
STORAGE = {code: storage for _, code, storage, _ in DTYPES}
SAFETENSORS_NAMES = {code: st for _, code, _, st in DTYPES}
SAFETENSORS_CODES = {st: code for _, code, _, st in DTYPES}

Axis = namedtuple("Axis", "kind rank size split_dim expert_id stage_id")
"""One parallelism axis: kind "dp"/"tp"/"ep"/"pp", rank, size, and split_dim, expert_id,
stage_id (each an int or None)."""

Metadata = namedtuple("Metadata", "dtype global_shape local_shape layout axes data_offset data_bytes")
"""A parsed header: dtype code, shapes (tuples), layout (FULL/SHARD), axes (list of
``Axis`` in stored order), data offset and length."""


def _shape(dims):
    dims = list(dims)
    return SHAPE.pack(*(dims + [-1] * (MAX_DIMS - len(dims))))


def pack_metadata(dtype, global_shape, local_shape, data_bytes, layout=FULL, axes=()):
    """The 304 header bytes. ``axes`` are ``Axis`` values (at most 4); ``local_shape``
    gives the extent recorded for each axis's split_dim."""
    global_shape, local_shape, axes = tuple(global_shape), tuple(local_shape), list(axes)
    if len(global_shape) > MAX_DIMS or len(local_shape) != len(global_shape) or len(axes) > MAX_AXES:
        raise ValueError("tensor has more than 8 dimensions or more than 4 parallelism axes")
    out = bytearray(METADATA_SIZE)
    HEADER.pack_into(out, 0, MAGIC, VERSION, METADATA_SIZE, dtype, len(global_shape), layout, 0, METADATA_SIZE, data_bytes)
    out[HEADER.size : HEADER.size + SHAPE.size] = _shape(global_shape)
    out[HEADER.size + SHAPE.size : AXES_AT - 8] = _shape(local_shape)
    struct.pack_into("<II", out, AXES_AT - 8, len(axes), 0)
    for index, axis in enumerate(axes):
        split = -1 if axis.split_dim is None else axis.split_dim
        reserved0 = axis.expert_id if axis.kind == "ep" else axis.stage_id if axis.kind == "pp" else None
        extent = local_shape[split] if split >= 0 else 0
        AXIS.pack_into(out, AXES_AT + index * AXIS.size, AXIS_KINDS[axis.kind], index, axis.rank, axis.size, split, reserved0 or 0, extent)
    return bytes(out)


def parse_metadata(buf, total_len=None):
    """A ``Metadata`` from the start of ``buf`` (an object of ``total_len`` bytes,
    default ``len(buf)``), or None when it is not a valid tensor object (upstream's
    checks, except that zero-sized dimensions are accepted as upstream's reads do)."""
    total = len(buf) if total_len is None else total_len
    if total < METADATA_SIZE or len(buf) < METADATA_SIZE:
        return None
    magic, version, header_size, dtype, ndim, layout, _, data_offset, data_bytes = HEADER.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or header_size != METADATA_SIZE:
        return None
    if dtype not in DTYPE_NAMES or not 0 <= ndim <= MAX_DIMS or layout not in (FULL, SHARD):
        return None
    if not METADATA_SIZE <= data_offset <= total or data_bytes != total - data_offset:
        return None
    global_dims = SHAPE.unpack_from(buf, HEADER.size)
    local_dims = SHAPE.unpack_from(buf, HEADER.size + SHAPE.size)
    if any(d < 0 for d in global_dims[:ndim] + local_dims[:ndim]):
        return None
    if any(d != -1 for d in global_dims[ndim:] + local_dims[ndim:]):
        return None
    (axis_count,) = struct.unpack_from("<I", buf, AXES_AT - 8)
    if axis_count > MAX_AXES:
        return None
    axes = []
    for index in range(axis_count):
        kind, _, rank, size, split, reserved0, _ = AXIS.unpack_from(buf, AXES_AT + index * AXIS.size)
        if kind not in AXIS_NAMES or size <= 0 or not 0 <= rank < size or not -1 <= split < ndim:
            return None
        name = AXIS_NAMES[kind]
        axes.append(
            Axis(name, rank, size, None if split < 0 else split, reserved0 if name == "ep" else None, reserved0 if name == "pp" else None)
        )
    return Metadata(dtype, global_dims[:ndim], local_dims[:ndim], layout, axes, data_offset, data_bytes)


def pack_manifest(dtype, global_shape, split_dim, shard_count):
    """The 96 bytes of a sharded tensor's manifest."""
    return MANIFEST.pack(MANIFEST_MAGIC, 1, MANIFEST_SIZE, dtype, len(global_shape), split_dim, shard_count, 0) + _shape(global_shape)


def parse_manifest(buf):
    """(dtype, global shape, split_dim, shard_count) of a manifest, or None."""
    if buf is None or len(buf) < MANIFEST_SIZE:
        return None
    magic, version, size, dtype, ndim, split_dim, count, _ = MANIFEST.unpack_from(buf, 0)
    if magic != MANIFEST_MAGIC or version != 1 or size != MANIFEST_SIZE or not 0 <= ndim <= MAX_DIMS:
        return None
    if count <= 0 or not 0 <= split_dim < ndim:
        return None
    shape = SHAPE.unpack_from(buf, MANIFEST.size)[:ndim]
    if any(d <= 0 for d in shape):
        return None
    return dtype, shape, split_dim, count


# ----- key names (upstream's) -----


def canonical_axes(axes):
    """Axes ordered dp, tp, ep, pp (upstream's canonical order)."""
    return sorted(axes, key=lambda a: AXIS_KINDS[a.kind])


def tp_key(key, rank):
    return f"{key}_tp_{rank}"


def parallelism_key(key, axes):
    """Upstream's storage key of a shard: ``<key>_tp_<rank>`` for a single TP axis,
    else ``<key>`` followed by ``__<kind>_<rank>of<size>[_sd<d>][_eid<e>][_sid<s>]`` per
    axis in canonical order."""
    if len(axes) == 1 and axes[0].kind == "tp":
        return tp_key(key, axes[0].rank)
    for axis in canonical_axes(axes):
        key += f"__{axis.kind}_{axis.rank}of{axis.size}"
        if axis.split_dim is not None:
            key += f"_sd{axis.split_dim}"
        if axis.expert_id is not None:
            key += f"_eid{axis.expert_id}"
        if axis.stage_id is not None:
            key += f"_sid{axis.stage_id}"
    return key


def parallelism_manifest_key(key):
    return f"{key}__parallelism_manifest"


def writer_manifest_key(key):
    return f"{key}__writer_manifest"


def writer_key(key, rank, size, split_dim):
    return f"{key}__writer_{rank}of{size}_sd{split_dim}"


def shard_range(length, rank, count):
    """(start, extent) of shard ``rank`` of ``count`` along a dimension of ``length``."""
    start = length * rank // count
    return start, length * (rank + 1) // count - start
