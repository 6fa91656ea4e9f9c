"""A minimal safetensors reader and writer (the file format, no dependency).

A safetensors file is: an 8-byte little-endian header length N, N bytes of JSON (padded
with spaces to a multiple of 8), then the tensors' bytes. The JSON maps each tensor
name to ``{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}`` (offsets into
the data part) and may hold a ``"__metadata__"`` map of strings.
"""

import json
import struct


def write(path, entries):
    """Writes ``entries``, a list of ``(name, dtype, shape, data)`` (data: a buffer in C
    order), to ``path``."""
    header, offset = {}, 0
    for name, dtype, shape, data in entries:
        size = memoryview(data).nbytes
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in entries:
            f.write(memoryview(data).cast("B"))


def read(path):
    """The tensors of a file as a list of ``(name, dtype, shape, bytes)`` in header
    order; ValueError when the file is not a valid safetensors file."""
    with open(path, "rb") as f:
        content = f.read()
    if len(content) < 8:
        raise ValueError("file too short for a safetensors header")
    (length,) = struct.unpack_from("<Q", content, 0)
    if 8 + length > len(content):
        raise ValueError("safetensors header longer than the file")
    try:
        header = json.loads(content[8 : 8 + length])
    except ValueError as error:
        raise ValueError(f"invalid safetensors header: {error}") from None
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not a JSON object")
    data = memoryview(content)[8 + length :]
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dtype, shape = info["dtype"], [int(d) for d in info["shape"]]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"invalid safetensors entry {name!r}") from None
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"safetensors entry {name!r} lies outside the file")
        entries.append((name, dtype, shape, bytes(data[begin:end])))
    return entries
