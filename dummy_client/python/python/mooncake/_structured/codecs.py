"""Column codecs of structured non-tensor fields.

Each codec turns a column (one Python value per row, None for a null row) into named
payloads (numpy arrays or bytes, each stored as one bundle member) plus JSON metadata,
and back. The payload names and layouts are upstream's:

* ``typed_ragged`` / ``ragged_tensor``: ``data`` (all rows' elements, flat), ``offsets``
  (int64, rows+1), ``shapes`` (int64, rows x max(ndim,1)), ``ndims`` (int16), ``nulls``;
* ``ndarray``: ``data`` (one scalar per row), ``nulls``;
* ``bytes_ragged`` / ``utf8_ragged`` / ``json_ragged`` / ``msgpack_ragged`` /
  ``media_bytes``: ``data`` (concatenated bytes), ``offsets`` (int64), ``nulls``;
* ``media_list_ragged``: ``data``, ``row_offsets``, ``byte_offsets``, ``nulls``;
* ``ragged_tensor_dict``: ``null_mask`` plus ``<key>.<payload>`` of one ``ragged_tensor``
  column per dict key;
* ``structured_recursive``: ``node.<i>.{missing,row_mask,lengths}`` and
  ``leaf.<i>.<payload>`` / ``leaf.<i>.missing`` for the nodes and leaves found by
  ``infer_structure``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from .infer import (
    MISSING,
    CodecDecision,
    InferredLeaf,
    InferredNode,
    Missing,
    choose_leaf_codec,
    escape_key,
    infer_structure,
    is_bytes_like,
    is_null,
    is_pil_image,
    lookup_path,
    msgpack_module,
    torch_module,
)

TYPED_RAGGED_DEFAULT_DTYPE = "int64"
RAGGED_TENSOR_DEFAULT_DTYPE = "torch.float32"
FALLBACK_ERRORS = (TypeError, ValueError, OverflowError, RuntimeError, RecursionError)
_RECURSIVE_LEAF_CODECS = {"ragged_tensor", "bytes_ragged", "media_bytes", "media_list_ragged"}


@dataclass
class EncodedColumn:
    """A column encoded by one codec: ``payload`` members plus JSON ``metadata``."""

    codec: str
    rows: int
    payload: dict[str, Any]
    metadata: dict[str, Any]


def _nulls(values: Sequence[Any]) -> np.ndarray:
    return np.asarray([value is None for value in values], dtype=np.bool_)


def _require_torch(what: str):
    torch = torch_module()
    if torch is None:
        raise RuntimeError(f"torch is required to {what}")
    return torch


def parse_torch_dtype(name: str):
    torch = _require_torch("use ragged tensor fields")
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype: {name}")
    return dtype


def torch_dtype_to_numpy(name: str) -> np.dtype:
    torch = _require_torch("use ragged tensor fields")
    dtype = parse_torch_dtype(name)
    if dtype == torch.bfloat16:
        raise ValueError("torch.bfloat16 has no value-preserving numpy dtype")
    return torch.empty(0, dtype=dtype).numpy().dtype


# ----- typed_ragged -----


def encode_typed_ragged(values: list[Any], dtype_hint: Any = None) -> tuple[dict, dict]:
    if dtype_hint is None:
        arrays = [np.asarray(v) for v in values if v is not None]
        dtype = np.result_type(*arrays) if arrays else np.dtype(TYPED_RAGGED_DEFAULT_DTYPE)
    else:
        dtype = np.dtype(dtype_hint)
    if dtype.hasobject:
        raise ValueError("typed_ragged codec requires non-object dtype")
    rows = [None if v is None else np.asarray(v, dtype=dtype, order="C") for v in values]
    present = [r for r in rows if r is not None]
    is_ndarray = [isinstance(v, np.ndarray) for v in values]
    all_ndarray = all(v is None or nd for v, nd in zip(values, is_ndarray))
    ndims = np.asarray([0 if r is None else r.ndim for r in rows], dtype=np.int16)
    sizes = np.asarray([0 if r is None else r.size for r in rows], dtype=np.int64)
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    max_ndim = max((r.ndim for r in present), default=0)
    shapes = np.zeros((len(rows), max(max_ndim, 1)), dtype=np.int64)
    for index, r in enumerate(rows):
        if r is not None and r.ndim:
            shapes[index, : r.ndim] = r.shape
    data = (
        np.concatenate([r.reshape(-1) for r in present]) if present else np.empty(0, dtype=dtype)
    ).astype(dtype, copy=False)
    metadata: dict[str, Any] = {
        "dtype": str(dtype),
        "max_ndim": int(max_ndim),
        "shape_policy": "ragged",
    }
    if all_ndarray and values:
        # Upstream's ndarray-row layout: rows come back as ndarrays (views of ``data``).
        metadata.update(row_format="ndarray", ndarray_rows=None, physical_layout="contiguous_flat")
    elif any(is_ndarray):
        metadata.update(row_format="mixed", ndarray_rows=[bool(v is not None and nd) for v, nd in zip(values, is_ndarray)])
    else:
        metadata.update(row_format="list", ndarray_rows=None)
    payload = {"data": data, "offsets": offsets, "shapes": shapes, "ndims": ndims, "nulls": _nulls(values)}
    return payload, metadata


def _as_typed(raw: Any, dtype: np.dtype) -> np.ndarray:
    torch = torch_module() if type(raw).__module__.startswith("torch") else None
    if torch is not None and isinstance(raw, torch.Tensor):
        return raw.numpy()
    if isinstance(raw, np.ndarray) and raw.dtype == dtype:
        return raw
    if isinstance(raw, np.ndarray):
        return raw.view(np.uint8).reshape(-1).view(dtype)
    return np.frombuffer(raw, dtype=dtype)


def decode_typed_ragged(payload: Mapping[str, Any], rows: int, metadata: Optional[Mapping] = None) -> list[Any]:
    metadata = metadata or {}
    data = _as_typed(payload["data"], np.dtype(metadata.get("dtype", TYPED_RAGGED_DEFAULT_DTYPE)))
    offsets, shapes, ndims, nulls = (payload[k] for k in ("offsets", "shapes", "ndims", "nulls"))
    row_format = metadata.get("row_format")
    ndarray_rows = metadata.get("ndarray_rows") or []
    values: list[Any] = []
    for row in range(rows):
        if bool(nulls[row]):
            values.append(None)
            continue
        ndim = int(ndims[row])
        array = data[int(offsets[row]) : int(offsets[row + 1])].reshape(
            tuple(int(d) for d in shapes[row, :ndim])
        )
        as_array = row_format == "ndarray" or (row_format == "mixed" and bool(ndarray_rows[row]))
        values.append(array if as_array else array.tolist())
    return values


# ----- ragged_tensor -----


def encode_ragged_tensor(values: list[Any]) -> tuple[dict, dict]:
    torch = _require_torch("encode ragged tensor fields")
    dtype = None
    arrays: list[Any] = []
    for value in values:
        if value is None:
            arrays.append(None)
            continue
        if isinstance(value, np.ndarray):
            if value.dtype == object:
                raise ValueError("ragged tensor codec requires numeric ndarray values")
            tensor = torch.as_tensor(value.copy() if not value.flags.writeable else value)
        else:
            tensor = value.detach()
        tensor = tensor.cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            raise ValueError("ragged tensor codec does not support torch.bfloat16")
        dtype = tensor.dtype if dtype is None else dtype
        if tensor.dtype != dtype:
            raise ValueError(f"mixed tensor dtype: {dtype} vs {tensor.dtype}")
        arrays.append(tensor.numpy())
    dtype = dtype or parse_torch_dtype(RAGGED_TENSOR_DEFAULT_DTYPE)
    payload, metadata = encode_typed_ragged(arrays, torch_dtype_to_numpy(str(dtype)))
    metadata["dtype"] = str(dtype)
    return payload, metadata


def decode_ragged_tensor(payload: Mapping[str, Any], rows: int, metadata: Optional[Mapping] = None) -> list[Any]:
    torch = _require_torch("decode ragged tensor fields")
    name = (metadata or {}).get("dtype", RAGGED_TENSOR_DEFAULT_DTYPE)
    patched = {**(metadata or {}), "dtype": str(torch_dtype_to_numpy(name)), "row_format": "ndarray"}
    dtype = parse_torch_dtype(name)
    return [
        None if v is None else torch.from_numpy(np.array(v)).to(dtype)
        for v in decode_typed_ragged(payload, rows, patched)
    ]


# ----- ragged_tensor_dict -----


def encode_ragged_tensor_dict(values: list[Any], declared_keys: Any = None) -> EncodedColumn:
    keys = None if declared_keys is None else _tensor_dict_keys(declared_keys)
    seen: set[str] = set()
    for row, item in enumerate(values):
        if item is None:
            continue
        if not isinstance(item, Mapping):
            raise TypeError(
                f"ragged_tensor_dict rows must be mappings or None; row {row} is {type(item).__name__}"
            )
        nulls = sorted(k for k, v in item.items() if v is None)
        if nulls:
            raise TypeError(
                "ragged_tensor_dict rows cannot contain explicit None tensor values; "
                f"row {row} has explicit None for {nulls}"
            )
        row_keys = set(_tensor_dict_keys(item.keys()))
        if keys is not None and row_keys - set(keys):
            raise ValueError(
                "ragged_tensor_dict rows contain keys not declared in FieldSchema "
                f"metadata['keys']; row {row} has keys not declared: {sorted(row_keys - set(keys))}"
            )
        seen |= row_keys
    keys = keys if keys is not None else sorted(seen)
    payload: dict[str, Any] = {"null_mask": _nulls(values)}
    key_codecs: dict[str, Any] = {}
    for key in keys:
        try:
            sub, meta = encode_ragged_tensor([None if v is None else v.get(key) for v in values])
        except FALLBACK_ERRORS as exc:
            raise ValueError(f"failed to encode ragged_tensor_dict key {key!r}") from exc
        payload.update({f"{key}.{name}": part for name, part in sub.items()})
        key_codecs[key] = meta
    return EncodedColumn("ragged_tensor_dict", len(values), payload, {"keys": keys, "key_codecs": key_codecs})


def _tensor_dict_keys(keys: Any) -> list[str]:
    names = list(keys.keys() if isinstance(keys, Mapping) else keys)
    for name in names:
        if not isinstance(name, str) or not name or "/" in name or "." in name:
            raise ValueError(f"ragged_tensor_dict keys must be non-empty strings without '/' or '.': {name!r}")
    if len(set(names)) != len(names):
        raise ValueError("ragged_tensor_dict keys must be unique")
    return names


def decode_ragged_tensor_dict(payload: Mapping[str, Any], rows: int, metadata: Mapping) -> list[Any]:
    null_mask = payload["null_mask"]
    if is_bytes_like(null_mask):
        null_mask = np.frombuffer(null_mask, dtype=np.bool_)
    columns = {}
    for key in metadata.get("keys", []):
        sub = {n[len(key) + 1 :]: v for n, v in payload.items() if n.startswith(f"{key}.")}
        columns[key] = decode_ragged_tensor(sub, rows, metadata.get("key_codecs", {}).get(key))
    return [
        None if bool(null_mask[row]) else {k: c[row] for k, c in columns.items() if c[row] is not None}
        for row in range(rows)
    ]


# ----- scalars -----


def encode_numeric_scalar(values: list[Any], dtype: Any) -> tuple[dict, dict]:
    dtype = np.dtype(dtype)
    fill = False if dtype == np.bool_ else 0
    data = np.asarray([fill if v is None else v for v in values], dtype=dtype)
    return {"data": data, "nulls": _nulls(values)}, {"dtype": str(data.dtype), "shape": list(data.shape)}


def decode_numeric_scalar(payload: Mapping[str, Any]) -> list[Any]:
    data, nulls = np.asarray(payload["data"]), np.asarray(payload["nulls"])
    if not bool(nulls.any()):
        return data.tolist()
    values = data.astype(object)
    values[nulls] = None
    return values.tolist()


# ----- byte columns -----


def _media_bytes(value: Any) -> tuple[bytes, Optional[str], dict]:
    if value is None:
        return b"", None, {"kind": "null"}
    if is_pil_image(value):
        image = value.convert(value.mode) if getattr(value, "readonly", False) else value
        return image.tobytes(), "image/raw", {
            "kind": "pil_raw", "mode": image.mode, "size": list(image.size),
            "format": getattr(value, "format", None),
        }
    return bytes(value), None, {"kind": "bytes"}


def encode_bytes_like(values: list[Any]) -> tuple[dict, dict]:
    parts = [_media_bytes(v) for v in values]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    np.cumsum([len(p[0]) for p in parts], out=offsets[1:])
    metadata: dict[str, Any] = {}
    if any(p[2]["kind"] == "pil_raw" for p in parts):
        metadata["media_encodings"] = [p[2] for p in parts]
    media_types = sorted({p[1] for p in parts if p[1]})
    if media_types:
        metadata.update(media_types=media_types, encode_source="raw_pixels_from_object")
    return {"data": b"".join(p[0] for p in parts), "offsets": offsets, "nulls": _nulls(values)}, metadata


def _decode_media(data: memoryview, encoding: Optional[Mapping]) -> Any:
    if not encoding or encoding.get("kind") != "pil_raw":
        return bytes(data)
    try:
        from PIL import Image  # noqa: PLC0415
    except ImportError:
        return bytes(data)
    image = Image.frombuffer(encoding["mode"], tuple(encoding["size"]), bytes(data), "raw", encoding["mode"], 0, 1)
    image.format = encoding.get("format")
    return image


def decode_bytes_like(payload: Mapping[str, Any], rows: int, metadata: Optional[Mapping] = None) -> list[Any]:
    data = memoryview(payload["data"]).cast("B")
    offsets, nulls = payload["offsets"], payload["nulls"]
    encodings = (metadata or {}).get("media_encodings", [])
    return [
        None if bool(nulls[row]) else _decode_media(
            data[int(offsets[row]) : int(offsets[row + 1])],
            encodings[row] if row < len(encodings) else None,
        )
        for row in range(rows)
    ]


def encode_media_list(values: list[Any]) -> tuple[dict, dict]:
    row_offsets, byte_offsets, parts = [0], [0], []
    for value in values:
        items = [] if value is None else [_media_bytes(item) for item in value]
        for item in items:
            parts.append(item)
            byte_offsets.append(byte_offsets[-1] + len(item[0]))
        row_offsets.append(row_offsets[-1] + len(items))
    metadata: dict[str, Any] = {"encode_source": "raw_pixels_from_object", "media_encodings": [p[2] for p in parts]}
    media_types = sorted({p[1] for p in parts if p[1]})
    if media_types:
        metadata["media_types"] = media_types
    return {
        "data": b"".join(p[0] for p in parts),
        "row_offsets": np.asarray(row_offsets, dtype=np.int64),
        "byte_offsets": np.asarray(byte_offsets, dtype=np.int64),
        "nulls": _nulls(values),
    }, metadata


def decode_media_list(payload: Mapping[str, Any], rows: int, metadata: Optional[Mapping] = None) -> list[Any]:
    data = memoryview(payload["data"]).cast("B")
    row_offsets, byte_offsets, nulls = payload["row_offsets"], payload["byte_offsets"], payload["nulls"]
    encodings = (metadata or {}).get("media_encodings", [])
    values: list[Any] = []
    for row in range(rows):
        if bool(nulls[row]):
            values.append(None)
            continue
        values.append([
            _decode_media(
                data[int(byte_offsets[i]) : int(byte_offsets[i + 1])],
                encodings[i] if i < len(encodings) else None,
            )
            for i in range(int(row_offsets[row]), int(row_offsets[row + 1]))
        ])
    return values


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def encode_msgpack(values: list[Any], path: str = "") -> tuple[dict, dict]:
    msgpack = msgpack_module(required_for="msgpack_ragged")
    try:
        parts = [None if v is None else msgpack.packb(v, use_bin_type=True, strict_types=True) for v in values]
    except TypeError as exc:
        raise ValueError(f"unsupported structured non-tensor field {path}: msgpack codec cannot encode value") from exc
    payload, _ = encode_bytes_like(parts)
    return payload, {}


def decode_msgpack(payload: Mapping[str, Any], rows: int) -> list[Any]:
    msgpack = msgpack_module(required_for="msgpack_ragged")
    return [
        None if part is None else msgpack.unpackb(part, raw=False, strict_map_key=False)
        for part in decode_bytes_like(payload, rows)
    ]


# ----- one column, one codec -----


def encode_leaf(codec: str, values: list[Any], metadata: Optional[Mapping] = None, path: str = "") -> tuple[dict, dict]:
    """Payload and metadata of ``values`` under ``codec`` (``metadata``: the decision's or
    schema's hints, e.g. ``dtype``)."""
    hints = dict(metadata or {})
    if codec == "ragged_tensor":
        return encode_ragged_tensor(values)
    if codec == "typed_ragged":
        return encode_typed_ragged(values, hints.get("dtype") if hints.get("recursive_source") != "ndarray" else None)
    if codec == "ndarray":
        if "dtype" not in hints:
            raise ValueError("ndarray codec needs a dtype")
        return encode_numeric_scalar(values, hints["dtype"])
    if codec in ("bytes_ragged", "media_bytes"):
        return encode_bytes_like(values)
    if codec == "media_list_ragged":
        return encode_media_list(values)
    if codec == "utf8_ragged":
        return encode_bytes_like([None if v is None else v.encode("utf-8") for v in values])
    if codec == "msgpack_ragged":
        return encode_msgpack(values, path)
    if codec == "json_ragged":
        return encode_bytes_like([None if v is None else _json_bytes(v) for v in values])
    raise ValueError(f"unsupported structured non-tensor codec: {codec!r}")


def decode_leaf(codec: str, payload: Mapping[str, Any], rows: int, metadata: Optional[Mapping] = None) -> list[Any]:
    if codec == "ragged_tensor":
        return decode_ragged_tensor(payload, rows, metadata)
    if codec == "typed_ragged":
        return decode_typed_ragged(payload, rows, metadata)
    if codec == "media_list_ragged":
        return decode_media_list(payload, rows, metadata)
    if codec == "ndarray":
        return decode_numeric_scalar(payload)
    if codec in ("bytes_ragged", "media_bytes"):
        return decode_bytes_like(payload, rows, metadata if codec == "media_bytes" else None)
    if codec == "utf8_ragged":
        return [None if v is None else v.decode("utf-8") for v in decode_bytes_like(payload, rows)]
    if codec == "msgpack_ragged":
        return decode_msgpack(payload, rows)
    if codec == "json_ragged":
        return [None if v is None else json.loads(v) for v in decode_bytes_like(payload, rows)]
    raise ValueError(f"unknown structured non-tensor codec: {codec}")


def encode_decided(values: list[Any], decision: CodecDecision, path: str = "") -> EncodedColumn:
    if not decision.accepted:
        raise ValueError(f"unsupported structured non-tensor field {path}: {decision.reason}")
    payload, metadata = encode_leaf(decision.codec, values, decision.metadata, path)
    metadata.update(
        schema_source="inferred_from_runtime_values",
        decision_reason=decision.reason,
        normalized_type=decision.normalized_type,
        **decision.metadata,
    )
    if decision.codec == "ragged_tensor":
        metadata["dtype"] = decision.metadata.get("dtype", metadata["dtype"])
    return EncodedColumn(decision.codec, len(values), payload, metadata)


# ----- recursive structures -----


def _wants_recursive(leaves: Sequence[InferredLeaf]) -> bool:
    for leaf in leaves:
        codec = leaf.decision.codec
        if codec in _RECURSIVE_LEAF_CODECS:
            return True
        if codec == "typed_ragged" and any(isinstance(v, np.ndarray) for v in leaf.values if not is_null(v)):
            return True
    return False


def encode_recursive(path: str, values: list[Any], leaves: Sequence[InferredLeaf], nodes: Sequence[InferredNode]) -> EncodedColumn:
    payload: dict[str, Any] = {}
    node_specs = []
    for node_id, node in enumerate(nodes):
        spec: dict[str, Any] = {"id": node_id, "path": node.path, "node_type": node.node_type, "children": list(node.children)}
        payload[f"node.{node_id}.missing"] = np.asarray(
            [lookup_path(v, path, node.path) is MISSING for v in values], dtype=np.bool_
        )
        spec["missing_payload"] = f"node.{node_id}.missing"
        if node.row_mask is not None:
            payload[f"node.{node_id}.row_mask"] = np.asarray(node.row_mask, dtype=np.bool_)
            spec["row_mask_payload"] = f"node.{node_id}.row_mask"
        if node.lengths is not None:
            payload[f"node.{node_id}.lengths"] = np.asarray(node.lengths, dtype=np.int64)
            spec["lengths_payload"] = f"node.{node_id}.lengths"
        node_specs.append(spec)
    leaf_specs = []
    for leaf_id, leaf in enumerate(leaves):
        missing = [isinstance(v, Missing) for v in leaf.values]
        column = [None if m else v for m, v in zip(missing, leaf.values)]
        decision = leaf.decision
        if not decision.accepted and all(is_null(v) for v in leaf.values):
            decision = CodecDecision(True, "json_ragged", "all rows are null or missing", "json")
        encoded = encode_decided(column, decision, leaf.path)
        members = {}
        for name, part in encoded.payload.items():
            payload[f"leaf.{leaf_id}.{name}"] = part
            members[name] = f"leaf.{leaf_id}.{name}"
        payload[f"leaf.{leaf_id}.missing"] = np.asarray(missing, dtype=np.bool_)
        members["missing"] = f"leaf.{leaf_id}.missing"
        leaf_specs.append({
            "id": leaf_id, "path": leaf.path, "codec": encoded.codec, "rows": encoded.rows,
            "metadata": encoded.metadata, "payload_members": members,
        })
    return EncodedColumn("structured_recursive", len(values), payload, {
        "schema_source": "inferred_from_runtime_values",
        "structure_version": 1,
        "root_path": path,
        "nodes": node_specs,
        "leaves": leaf_specs,
    })


def _child_path(node: Mapping[str, Any], child: Any) -> str:
    if node["node_type"] == "dict":
        return f"{node['path']}.{escape_key(str(child))}"
    return f"{node['path']}[{int(child)}]"


def decode_recursive(metadata: Mapping[str, Any], payload: Mapping[str, Any], rows: int) -> list[Any]:
    columns: dict[str, list[Any]] = {}
    for leaf in metadata.get("leaves", []):
        members = leaf["payload_members"]
        values = decode_leaf(
            leaf["codec"], {n: payload[m] for n, m in members.items() if n != "missing"}, rows, leaf.get("metadata")
        )
        missing = payload[members["missing"]]
        columns[leaf["path"]] = [MISSING if bool(missing[r]) else values[r] for r in range(rows)]
    depth = lambda node: node["path"].count(".") + node["path"].count("[")  # noqa: E731
    for node in sorted(metadata.get("nodes", []), key=depth, reverse=True):
        missing = payload[node["missing_payload"]] if node.get("missing_payload") else None
        row_mask = payload[node["row_mask_payload"]] if node.get("row_mask_payload") else None
        lengths = payload[node["lengths_payload"]] if node.get("lengths_payload") else None
        children = [(child, columns[_child_path(node, child)]) for child in node["children"]]
        out: list[Any] = []
        for row in range(rows):
            if missing is not None and bool(missing[row]):
                out.append(MISSING)
            elif row_mask is not None and not bool(row_mask[row]):
                out.append(None)
            elif node["node_type"] == "dict":
                out.append({c: col[row] for c, col in children if not isinstance(col[row], Missing)})
            else:
                length = int(lengths[row]) if lengths is not None else len(children)
                item = [None] * length
                for c, col in children:
                    if int(c) < length and not isinstance(col[row], Missing):
                        item[int(c)] = col[row]
                out.append(item)
        columns[node["path"]] = out
    return columns[metadata["root_path"]]


# ----- a whole non-tensor field -----


def normalize_scalar(value: Any) -> Any:
    """numpy values as plain Python ones (for the generic msgpack/json fallbacks)."""
    if isinstance(value, np.ndarray):
        return normalize_scalar(value.tolist())
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: normalize_scalar(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [normalize_scalar(v) for v in value]
    return value


def encode_inferred(path: str, values: list[Any]) -> EncodedColumn:
    """Encode an object column the way upstream does without a schema: recursive layout
    when the rows hold tensors/arrays/bytes inside dicts or lists, else one leaf codec."""
    leaves: list[InferredLeaf] = []
    nodes: list[InferredNode] = []
    infer_structure(path, values, leaves, nodes)
    if nodes and _wants_recursive(leaves):
        return encode_recursive(path, values, leaves, nodes)
    return encode_decided(values, choose_leaf_codec(values), path)


def encode_with_fallback(path: str, values: list[Any]) -> EncodedColumn:
    """Schema codec ``auto``: inference, then msgpack, then JSON of normalized values."""
    errors = []
    try:
        leaves: list[InferredLeaf] = []
        nodes: list[InferredNode] = []
        infer_structure(path, values, leaves, nodes)
        if nodes and _wants_recursive(leaves):
            return encode_recursive(path, values, leaves, nodes)
    except FALLBACK_ERRORS as error:
        errors.append(f"structured_recursive: {error}")
    decision = choose_leaf_codec(values)
    for codec in dict.fromkeys([decision.codec, "msgpack_ragged", "json_ragged"]):
        hints = decision.metadata if codec == decision.codec else {}
        column = [normalize_scalar(v) for v in values] if codec in ("msgpack_ragged", "json_ragged") else values
        try:
            return encode_schema(path, column, codec, hints)
        except (*FALLBACK_ERRORS, ImportError) as error:
            errors.append(f"{codec}: {error}")
    raise ValueError(f"unable to infer a safe codec for structured non-tensor field {path!r}; tried {errors}")


def encode_schema(path: str, values: list[Any], codec: str, hints: Mapping[str, Any], nullable: bool = True) -> EncodedColumn:
    """Encode with a codec named by a FieldSchema (no inference; ``auto`` falls back)."""
    if not nullable and any(v is None for v in values):
        raise ValueError(f"FieldSchema for {path!r} is not nullable")
    if codec == "auto":
        return encode_with_fallback(path, values)
    if codec == "ragged_tensor_dict":
        return encode_ragged_tensor_dict(values, hints.get("keys"))
    if codec == "ndarray" and hints.get("dtype") is None:
        return encode_with_fallback(path, values)
    payload, metadata = encode_leaf(codec, values, hints, path)
    return EncodedColumn(codec, len(values), payload, metadata)


def decode_column(encoded: Mapping[str, Any], payload: Mapping[str, Any], rows: int) -> list[Any]:
    """The rows of an encoded field (``encoded``: codec, metadata)."""
    codec = encoded.get("codec")
    metadata = encoded.get("metadata") or {}
    if codec == "ragged_tensor_dict":
        return decode_ragged_tensor_dict(payload, rows, metadata)
    if codec == "structured_recursive":
        return decode_recursive(metadata, payload, rows)
    return decode_leaf(codec, payload, rows, metadata)
