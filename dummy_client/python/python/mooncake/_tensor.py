"""The ``[TensorMetadata][data]`` layout of stored tensors.

A tensor is stored as one object: a header, padded to a multiple of 64 bytes, followed
by the tensor's bytes in C (row-major) order, little-endian::

    offset  size  field
    0       4     magic b"MCTN"
    4       1     layout version (1)
    5       1     framework the tensor came from: 0 numpy, 1 torch
    6       2     ndim (u16)
    8       16    dtype: numpy dtype string (e.g. "<f4", "|u1") or "bfloat16", NUL padded
    24      4     header length in bytes (u32, multiple of 64; data starts here)
    28      4     reserved (0)
    32      8     data length in bytes (u64)
    40      8*n   shape, one i64 per dimension
    ...           zero padding up to the header length

All integers are little-endian.
"""

import struct

MAGIC = b"MCTN"
VERSION = 1
FIXED = struct.Struct("<4sBBH16sIIQ")
NUMPY, TORCH = 0, 1


def _round64(n):
    return (n + 63) // 64 * 64


def pack_header(dtype_name, shape, data_len, framework):
    """Header bytes for a tensor."""
    dtype = dtype_name.encode("ascii")
    if len(dtype) > 16:
        raise ValueError(f"dtype name {dtype_name!r} is longer than 16 bytes")
    header_len = _round64(FIXED.size + 8 * len(shape))
    head = FIXED.pack(MAGIC, VERSION, framework, len(shape), dtype, header_len, 0, data_len)
    head += struct.pack(f"<{len(shape)}q", *shape)
    return head + b"\0" * (header_len - len(head))


def unpack_header(buf):
    """(dtype name, shape, header length, data length, framework) from a buffer, or
    None when it does not hold a valid tensor."""
    if len(buf) < FIXED.size:
        return None
    magic, version, framework, ndim, dtype, header_len, _, data_len = FIXED.unpack_from(buf, 0)
    if magic != MAGIC or version != VERSION or header_len < FIXED.size + 8 * ndim:
        return None
    if header_len + data_len != len(buf):
        return None
    shape = struct.unpack_from(f"<{ndim}q", buf, FIXED.size)
    if any(d < 0 for d in shape):
        return None
    return dtype.rstrip(b"\0").decode("ascii"), tuple(shape), header_len, data_len, framework
