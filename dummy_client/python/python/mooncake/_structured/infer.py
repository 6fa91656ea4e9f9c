"""Codec inference for a column of row values, and the expansion of dict/list rows.

A column is a list of Python values, one per row. ``choose_leaf_codec`` names the codec
that can store it (``ragged_tensor``, ``typed_ragged``, ``ndarray``, ``bytes_ragged``,
``utf8_ragged``, ``json_ragged``, ``msgpack_ragged``, ...), or refuses it.
``infer_structure`` splits dict/list rows into per-path leaf columns plus interior nodes,
the way upstream does, so the recursive layout stored for a field is the same.

Paths: ``root.key`` for a dict child (``.``, ``[`` and ``\\`` in keys are escaped with a
backslash), ``root[i]`` for a list child.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MAX_STRUCT_KEYS = 64
MAX_LIST_LEN = 8
MAX_SAMPLE_ROWS = 128
MAX_JSON_BYTES = 1 << 20
MAX_DEPTH = 32


def torch_module():
    """torch when importable, else None (torch is optional)."""
    try:
        import torch  # noqa: PLC0415
    except Exception:  # noqa: BLE001 (a broken torch install counts as absent)
        return None
    return torch


def msgpack_module(required_for: str | None = None):
    """msgpack when importable; None, or ImportError naming the codec when required."""
    try:
        import msgpack  # noqa: PLC0415
    except ImportError:
        if required_for is None:
            return None
        raise ImportError(
            f"the {required_for} codec needs the optional dependency msgpack; "
            "install it with `pip install msgpack`"
        ) from None
    return msgpack


@dataclass
class CodecDecision:
    """What ``choose_leaf_codec`` decided for a column (``codec`` is informative when
    ``accepted`` is False)."""

    accepted: bool
    codec: str
    reason: str
    normalized_type: str
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class InferredLeaf:
    """A leaf column found by ``infer_structure``."""

    path: str
    values: list[Any]
    decision: CodecDecision


@dataclass
class InferredNode:
    """An interior dict/list node found by ``infer_structure``."""

    path: str
    node_type: str
    children: list[Any]
    lengths: list[int] | None = None
    row_mask: list[bool] | None = None


class Missing:
    """Sentinel for a dict key (or list item) absent from a row, unlike a None value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<MISSING>"


MISSING = Missing()


def is_null(value: Any) -> bool:
    return value is None or isinstance(value, Missing)


def non_null(values: list[Any]) -> list[Any]:
    return [value for value in values if not is_null(value)]


def is_bytes_like(value: Any) -> bool:
    return isinstance(value, (bytes, bytearray, memoryview))


def is_pil_image(value: Any) -> bool:
    module = getattr(type(value), "__module__", "") or ""
    return module.startswith("PIL.") and hasattr(value, "save")


def is_media_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        is_pil_image(item) or is_bytes_like(item) for item in value
    )


def _json_exact(value: Any, depth: int = 0) -> bool:
    """True when JSON gives back exactly this value (str keys, lists, finite floats)."""
    if depth > MAX_DEPTH:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return type(value) in (bool, int, str) or value is None
    if type(value) is float:
        return math.isfinite(value)
    if type(value) is list:
        return all(_json_exact(item, depth + 1) for item in value)
    if type(value) is dict:
        return all(type(k) is str and _json_exact(v, depth + 1) for k, v in value.items())
    return False


def _structured_decision(rows: list[Any]) -> CodecDecision:
    """Dict/list/tuple rows: json_ragged when JSON round-trips every row exactly (readable
    without msgpack), else msgpack_ragged when msgpack can pack them (strict types)."""
    sampled = 0
    if all(_json_exact(row) for row in rows):
        for row in rows[:MAX_SAMPLE_ROWS]:
            sampled += len(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
        if sampled <= MAX_JSON_BYTES:
            return CodecDecision(True, "json_ragged", "all rows pass JSON serialization", "json")
    msgpack = msgpack_module()
    if msgpack is None:
        return CodecDecision(
            False, "msgpack_ragged", "rows need msgpack, which is not installed", "msgpack"
        )
    try:
        for row in rows:
            msgpack.packb(row, use_bin_type=True, strict_types=True)
    except (TypeError, ValueError, OverflowError):
        return CodecDecision(False, "msgpack_ragged", "msgpack serialization failed", "msgpack")
    return CodecDecision(True, "msgpack_ragged", "all rows are msgpack-like", "msgpack")


def choose_leaf_codec(values: list[Any]) -> CodecDecision:
    """The codec for a column of row values (None and MISSING rows are nulls)."""
    rows = non_null(values)
    if not rows:
        return CodecDecision(False, "msgpack_ragged", "all rows are null", "msgpack")
    torch = torch_module() if any(type(r).__module__.startswith("torch") for r in rows) else None
    if torch is not None and all(isinstance(row, torch.Tensor) for row in rows):
        dtypes = sorted({str(row.dtype) for row in rows})
        if len(dtypes) != 1:
            return CodecDecision(
                False, "ragged_tensor", f"mixed tensor dtype: {dtypes}", "torch.Tensor"
            )
        # Rows of different ndim are fine: the ragged layout keeps one shape per row.
        return CodecDecision(
            True, "ragged_tensor", "all non-null rows are Tensor", "torch.Tensor",
            {"dtype": dtypes[0]},
        )
    if all(is_media_list(row) for row in rows):
        return CodecDecision(True, "media_list_ragged", "all rows are media lists", "media list")
    if all(isinstance(row, np.ndarray) for row in rows):
        if all(np.issubdtype(row.dtype, np.number) for row in rows):
            return CodecDecision(
                True, "typed_ragged", "all rows are numeric ndarray", "numeric sequence",
                {"recursive_source": "ndarray"},
            )
        return CodecDecision(False, "msgpack_ragged", "object ndarray rows", "python object")
    if all(isinstance(row, (list, tuple)) for row in rows):
        try:
            dtype = np.result_type(*[np.asarray(row).dtype for row in rows])
        except (TypeError, ValueError, OverflowError):
            dtype = None
        if dtype is not None and np.issubdtype(dtype, np.number):
            return CodecDecision(
                True, "typed_ragged", "all rows are numeric sequences", "numeric sequence",
                {"dtype": str(dtype)},
            )
    if all(isinstance(row, (bool, int, float, np.number)) for row in rows):
        dtype = np.result_type(*rows)
        return CodecDecision(
            True, "ndarray", "all rows are numeric scalar", "numeric scalar",
            {"dtype": str(dtype)},
        )
    if all(is_bytes_like(row) for row in rows):
        return CodecDecision(True, "bytes_ragged", "all rows are bytes-like", "bytes-like")
    if all(is_pil_image(row) for row in rows):
        return CodecDecision(True, "media_bytes", "all rows are media", "media")
    if all(isinstance(row, str) for row in rows):
        return CodecDecision(True, "utf8_ragged", "all rows are str", "str")
    if all(isinstance(row, (dict, list, tuple)) for row in rows):
        return _structured_decision(rows)
    # Only pickle could store arbitrary objects; it is never used (unpickling what
    # another process wrote runs its code), so the column is refused.
    return CodecDecision(
        False, "pickle_ragged_fallback", "no safe codec matched (pickle is not used)",
        "python object",
    )


def escape_key(key: str) -> str:
    """A dict key as one path segment."""
    return key.replace("\\", "\\\\").replace(".", "\\.").replace("[", "\\[")


def path_tokens(path: str) -> list[Any]:
    """``a.b\\.c[2]`` -> ``["a", "b.c", 2]``."""
    tokens: list[Any] = []
    current: list[str] = []
    index = 0
    while index < len(path):
        char = path[index]
        if char == "\\" and index + 1 < len(path):
            current.append(path[index + 1])
            index += 2
        elif char in ".[":
            if current:
                tokens.append("".join(current))
                current = []
            if char == "[":
                end = path.index("]", index)
                tokens.append(int(path[index + 1 : end]))
                index = end + 1
            else:
                index += 1
        else:
            current.append(char)
            index += 1
    if current:
        tokens.append("".join(current))
    return tokens


def lookup_path(value: Any, root_path: str, target_path: str) -> Any:
    """The value at ``target_path`` inside a row stored under ``root_path`` (MISSING when
    a key or index on the way is absent)."""
    suffix = target_path[len(root_path) :]
    current = value
    for token in path_tokens(suffix):
        if isinstance(token, str):
            if not isinstance(current, dict) or token not in current:
                return MISSING
        elif not isinstance(current, (list, tuple)) or token >= len(current):
            return MISSING
        current = current[token]
    return current


def _dict_keys(values: list[Any]) -> list[str] | None:
    rows = non_null(values)
    if not rows or not all(isinstance(row, dict) for row in rows):
        return None
    keys = {key for row in rows for key in row}
    if len(keys) > MAX_STRUCT_KEYS or not all(isinstance(key, str) for key in keys):
        return None
    return sorted(keys)


def _list_shape(values: list[Any]) -> tuple[int, list[int]] | None:
    rows = non_null(values)
    if not rows or not all(isinstance(row, (list, tuple)) for row in rows):
        return None
    max_len = max(len(row) for row in rows)
    if max_len > MAX_LIST_LEN:
        return None
    if not all(item is None or isinstance(item, (dict, list, tuple)) for row in rows for item in row):
        return None
    return max_len, [len(v) if isinstance(v, (list, tuple)) else 0 for v in values]


def infer_structure(
    path: str,
    values: list[Any],
    leaves: list[InferredLeaf],
    nodes: list[InferredNode],
    *,
    _depth: int = 0,
) -> None:
    """Expand a column into interior nodes and leaf columns, appended to ``nodes`` and
    ``leaves``. A key absent from a row is MISSING in the child column (a None row stays
    None); each node's ``row_mask`` says which rows had a container there."""
    if _depth > MAX_DEPTH:
        raise ValueError(f"infer_structure exceeded max depth {MAX_DEPTH} at {path!r}")
    keys = _dict_keys(values)
    if keys is not None:
        nodes.append(InferredNode(path, "dict", keys, row_mask=[isinstance(v, dict) for v in values]))
        for key in keys:
            child = [v.get(key, MISSING) if isinstance(v, dict) else None for v in values]
            infer_structure(f"{path}.{escape_key(key)}", child, leaves, nodes, _depth=_depth + 1)
        return
    shape = _list_shape(values)
    if shape is not None:
        max_len, lengths = shape
        is_list = [isinstance(v, (list, tuple)) for v in values]
        nodes.append(InferredNode(path, "list", list(range(max_len)), lengths, row_mask=is_list))
        for index in range(max_len):
            child = [
                (v[index] if index < len(v) else MISSING) if listed else None
                for v, listed in zip(values, is_list)
            ]
            infer_structure(f"{path}[{index}]", child, leaves, nodes, _depth=_depth + 1)
        return
    leaves.append(InferredLeaf(path, values, choose_leaf_codec(values)))
