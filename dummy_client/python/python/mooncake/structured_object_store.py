"""Structured objects in a Mooncake store: upstream's ``mooncake.structured_object_store``.

``MooncakeBundleTransfer`` stores three kinds of things over a store's plain put/get
calls (``put_tensor``/``get_tensor`` for torch tensors when the store has them):

* **bundles** (``put_bundle``): raw meta bytes plus named byte buffers, laid out as
  described in ``mooncake._structured.bundle`` (manifest key, chunked payloads);
* **structured objects** (``put_structured_object``, ``put_object``): a bundle whose
  meta is JSON metadata with one field spec per member (``ndarray``: dtype and shape,
  ``torch_tensor``, ``bytes``), read back whole or by member and row slice
  (``read_spec``, ``materialize``, ``materialize_into``);
* **DataProto-like batches and flat dicts** (``put``/``get``, ``put_dataproto``,
  ``append_dataproto_fields``): dense ``batch`` fields stored as members, object columns of
  ``non_tensor_batch`` encoded by a column codec (``mooncake._structured.codecs``; nested
  dicts/lists of tensors, arrays, numbers, strings and bytes are expanded recursively),
  ``meta_info`` kept in the returned ``MooncakeDataProtoRef``, which
  ``export_dataproto_ref`` turns into a JSON-safe handle another process can import.

Keys, manifests, field specs, codec payloads and handles have upstream's layout, so
either implementation reads what the other wrote. msgpack is optional: it is needed only
for rows JSON cannot hold exactly (bytes or non-str keys inside dicts, tuples) and is
imported when such a column is encoded or decoded. torch is optional too.

Not implemented (NotImplementedError): nested (jagged) torch tensors as members.
Reads copy through ``get``; upstream's buffer-pool and zero-copy paths are not used, so
``BundleTransferPolicy`` only selects whether tensors use ``put_tensor`` (``copy_mode``).
"""

from __future__ import annotations

import ctypes
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Protocol, Sequence

import numpy as np

from ._structured import bundle as _bundle
from ._structured import codecs as _codecs
from ._structured.bundle import (
    MISSING_OBJECT_ERROR,
    RawDestination as _RawDestinationBuffer,
    TensorObjectBuffer as _TensorObjectBufferPayload,
    TensorPayload as _TensorPayload,
)
from ._structured.codecs import EncodedColumn as _EncodedStructuredLeaf
from ._structured.infer import (
    MISSING,
    CodecDecision as _CodecDecision,
    InferredLeaf as _InferredLeaf,
    InferredNode as _InferredNode,
    Missing as _Missing,
    choose_leaf_codec as _choose_leaf_codec,
    escape_key as _escape_key,
    infer_structure,
    torch_module as _torch_module,
)

__all__ = [
    "AUTO_PARALLEL_MIN_BYTES",
    "AUTO_PARALLEL_MIN_CHUNKS",
    "BundleStore",
    "BundleTransferPolicy",
    "DATAPROTO_REF_HANDLE_TYPE",
    "DATAPROTO_REF_HANDLE_VERSION",
    "DEFAULT_BUNDLE_CHUNK_BYTES",
    "FieldSchema",
    "MISSING",
    "MISSING_OBJECT_ERROR",
    "MooncakeBundleTransfer",
    "MooncakeDataProtoRef",
    "RemoteBundleRef",
    "STORAGE_GROUP_ID",
    "STRUCTURED_FIELD_SPECS_KEY",
    "StructuredFieldLocation",
    "StructuredMemberSlice",
    "StructuredObjectPayload",
    "StructuredObjectReadSpec",
    "StructuredObjectResult",
    "export_dataproto_ref",
    "export_ref",
    "import_dataproto_ref",
    "import_ref",
    "infer_structure",
    "is_dataproto_ref_handle",
    "raw_destination",
    "tensor_object_buffer",
]

DEFAULT_BUNDLE_CHUNK_BYTES = 64 * 1024**2
AUTO_PARALLEL_MIN_BYTES = DEFAULT_BUNDLE_CHUNK_BYTES
AUTO_PARALLEL_MIN_CHUNKS = 8
STRUCTURED_FIELD_SPECS_KEY = "__mooncake_structured_fields__"
DATAPROTO_REF_HANDLE_TYPE = "mooncake_dataproto_ref"
DATAPROTO_REF_HANDLE_VERSION = 1
STORAGE_GROUP_ID = "storage_group_id"  # optional v1 handle field (v2 requires it)
_WRAPPED_OBJECT = "__mooncake_wrapped_object__"
_SECTIONS = ("batch", "non_tensor_batch", "meta_info")


class BundleStore(Protocol):
    """The store calls a bundle transfer needs (``MooncakeDistributedStore`` has them)."""

    def put(self, key: str, value: Any, config: Any = None) -> int: ...

    def get(self, key: str) -> bytes: ...

    def remove(self, key: str, force: bool = False) -> int: ...

    def is_exist(self, key: str) -> int: ...


@dataclass(frozen=True)
class BundleTransferPolicy:
    """Transfer knobs; here ``copy_mode="copy"`` stores tensors as bytes instead of with
    ``put_tensor`` and ``"zero_copy"`` is refused (no buffer pool path)."""

    max_inflight_put: int = 1
    put_mode: Literal["auto", "batch", "parallel"] = "auto"
    copy_mode: Literal["auto", "zero_copy", "copy"] = "auto"


@dataclass(frozen=True)
class FieldSchema:
    """Codec hint for a DataProto field; ``metadata["section"]`` pins its section,
    ``metadata["dtype"]`` / ``["keys"]`` feed the codec."""

    codec: str
    nullable: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class RemoteBundleRef:
    """A stored bundle: its manifest key (and the manifest when known)."""

    manifest_key: str
    manifest: dict[str, Any]


@dataclass(frozen=True, init=False)
class StructuredObjectPayload:
    """A structured object to store: JSON metadata plus named members."""

    metadata: Mapping[str, Any]
    buffers: Mapping[str, Any]

    def __init__(self, metadata: Optional[Mapping[str, Any]] = None, buffers: Optional[Mapping[str, Any]] = None) -> None:
        if buffers is None:
            raise TypeError("StructuredObjectPayload requires buffers")
        object.__setattr__(self, "metadata", {} if metadata is None else metadata)
        object.__setattr__(self, "buffers", buffers)


@dataclass
class StructuredObjectResult:
    """A materialized structured object: its metadata and members."""

    metadata: dict[str, Any]
    objects: dict[str, Any]


@dataclass(frozen=True)
class StructuredFieldLocation:
    """Where a DataProto field lives: stage, member, section."""

    stage: str
    member: str
    section: Literal["batch", "non_tensor_batch"]


@dataclass
class MooncakeDataProtoRef:
    """A stored DataProto: stage bundles, field index, meta_info and codec metadata."""

    batch_size: int
    stage_refs: dict[str, RemoteBundleRef]
    field_index: dict[str, StructuredFieldLocation]
    meta_info: dict[str, Any]
    namespace: str = "default"
    partition: str = "default"
    global_indexes: list[int] | None = None
    encoded_non_tensor: dict[str, Any] = field(default_factory=dict)
    _storage_group_id: str | None = field(default=None, repr=False)


@dataclass(frozen=True)
class StructuredMemberSlice:
    """Rows [start:end:step] of one member (axis 0 only)."""

    axis: int
    start: int
    end: int
    step: int = 1


@dataclass(frozen=True)
class StructuredObjectReadSpec:
    """What to read of a structured object: which members, which rows."""

    ref: RemoteBundleRef | Mapping[str, Any]
    member_names: tuple[str, ...] | None = None
    member_slices: tuple[tuple[str, StructuredMemberSlice], ...] = ()

    def select_members(self, names: Optional[Sequence[str]]) -> "StructuredObjectReadSpec":
        """This spec, reading only ``names`` (all members when None)."""
        return StructuredObjectReadSpec(self.ref, None if names is None else tuple(names), self.member_slices)

    def slice_member(self, name: str, axis: int, start: int, end: int, step: int = 1) -> "StructuredObjectReadSpec":
        """This spec, reading rows [start:end:step] of member ``name``."""
        slices = dict(self.member_slices)
        slices[name] = StructuredMemberSlice(axis, start, end, step)
        return StructuredObjectReadSpec(self.ref, self.member_names, tuple(slices.items()))

    def member_slice(self, name: str) -> StructuredMemberSlice | None:
        """The slice set for ``name``, if any."""
        return dict(self.member_slices).get(name)


DataProtoRefLike = MooncakeDataProtoRef | Mapping[str, Any]


def tensor_object_buffer(ptr: int, size: int, owner: Any = None, batch_size: int | None = None) -> _TensorObjectBufferPayload:
    """A member value: caller memory holding a serialized Mooncake tensor object."""
    return _TensorObjectBufferPayload(int(ptr), int(size), owner, batch_size)


def raw_destination(ptr: int, size: int, owner: Any = None, *, pre_registered: bool = False) -> _RawDestinationBuffer:
    """A ``materialize_into`` destination: caller memory (address, size)."""
    return _RawDestinationBuffer(int(ptr), int(size), owner, pre_registered)


# ----- DataProto handles -----


def is_dataproto_ref_handle(value: Any) -> bool:
    """True for a dict made by ``export_dataproto_ref``."""
    return isinstance(value, Mapping) and value.get("type") == DATAPROTO_REF_HANDLE_TYPE


def _json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return _json_safe(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    raise TypeError(f"DataProto ref handles support only JSON-safe values, got {type(value).__name__}")


def export_dataproto_ref(ref: MooncakeDataProtoRef) -> dict[str, Any]:
    """A JSON-safe handle of a DataProto ref, for another process."""
    if not isinstance(ref, MooncakeDataProtoRef):
        raise TypeError(f"expected MooncakeDataProtoRef, got {type(ref).__name__}")
    handle = {
        "type": DATAPROTO_REF_HANDLE_TYPE,
        "version": DATAPROTO_REF_HANDLE_VERSION,
        "kind": "bundle_stages",
        "batch_size": int(ref.batch_size),
        "namespace": ref.namespace,
        "partition": ref.partition,
        "global_indexes": _json_safe(ref.global_indexes),
        "stage_refs": {s: {"manifest_key": r.manifest_key} for s, r in ref.stage_refs.items()},
        "field_index": {
            n: {"stage": loc.stage, "member": loc.member, "section": loc.section} for n, loc in ref.field_index.items()
        },
        "meta_info": _json_safe(ref.meta_info),
        "encoded_non_tensor": _json_safe(ref.encoded_non_tensor),
    }
    if ref._storage_group_id is not None:
        handle[STORAGE_GROUP_ID] = ref._storage_group_id
    json.dumps(handle, ensure_ascii=False)
    return handle


def _mapping(value: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"DataProto ref handle {name} must be a mapping")
    return value


def _nonempty_str(*values: Any) -> bool:
    return all(isinstance(v, str) and v for v in values)


def import_dataproto_ref(handle: Mapping[str, Any]) -> MooncakeDataProtoRef:
    """The DataProto ref of a handle made by ``export_dataproto_ref``."""
    if not is_dataproto_ref_handle(handle):
        raise ValueError("not a Mooncake DataProto ref handle")
    version = int(handle.get("version", -1))
    if version not in (DATAPROTO_REF_HANDLE_VERSION, 2):
        raise ValueError(f"unsupported DataProto ref handle version: {handle.get('version')!r}")
    if handle.get("kind") != "bundle_stages":
        raise ValueError(f"unsupported DataProto ref handle kind: {handle.get('kind')!r}")
    stage_refs = {}
    for stage, raw in _mapping(handle.get("stage_refs"), "stage_refs").items():
        key = _mapping(raw, f"stage_refs[{stage!r}]").get("manifest_key")
        if not _nonempty_str(stage, key):
            raise ValueError("DataProto ref handle stage refs must contain non-empty string names and manifest_key values")
        stage_refs[stage] = RemoteBundleRef(manifest_key=key, manifest={})
    field_index = {}
    for name, raw in _mapping(handle.get("field_index"), "field_index").items():
        loc = _mapping(raw, f"field_index[{name!r}]")
        if loc.get("section") not in ("batch", "non_tensor_batch"):
            raise ValueError(f"invalid DataProto field section: {loc.get('section')!r}")
        if not _nonempty_str(name, loc.get("stage"), loc.get("member")):
            raise ValueError("DataProto ref handle field locations must be non-empty strings")
        if loc["stage"] not in stage_refs:
            raise ValueError(f"DataProto ref handle field {name!r} references unknown stage {loc['stage']!r}")
        field_index[name] = StructuredFieldLocation(loc["stage"], loc["member"], loc["section"])
    group = handle.get(STORAGE_GROUP_ID)
    if (version == 2 and group is None) or (group is not None and not _nonempty_str(group)):
        raise ValueError("DataProto ref handle has invalid storage_group_id")
    indexes = handle.get("global_indexes")
    if indexes is not None and (
        not isinstance(indexes, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in indexes)
    ):
        raise ValueError("DataProto ref handle global_indexes must be a list of integers or null")
    return MooncakeDataProtoRef(
        batch_size=int(handle["batch_size"]),
        stage_refs=stage_refs,
        field_index=field_index,
        meta_info=dict(_mapping(handle.get("meta_info", {}), "meta_info")),
        namespace=str(handle.get("namespace", "default")),
        partition=str(handle.get("partition", "default")),
        global_indexes=None if indexes is None else list(indexes),
        encoded_non_tensor=dict(_mapping(handle.get("encoded_non_tensor", {}), "encoded_non_tensor")),
        _storage_group_id=group,
    )


export_ref = export_dataproto_ref
import_ref = import_dataproto_ref


def _resolve_ref(ref: DataProtoRefLike) -> MooncakeDataProtoRef:
    if isinstance(ref, MooncakeDataProtoRef):
        return ref
    if is_dataproto_ref_handle(ref):
        return import_dataproto_ref(ref)
    raise TypeError(f"expected MooncakeDataProtoRef or DataProto handle, got {type(ref).__name__}")


# ----- member encoding -----


def _is_tensor(value: Any) -> bool:
    if not type(value).__module__.startswith("torch"):
        return False
    torch = _torch_module()
    return torch is not None and isinstance(value, torch.Tensor)


def _encode_member(value: Any) -> tuple[dict[str, Any], Any]:
    """(field spec, stored value) of one structured member."""
    if isinstance(value, _TensorObjectBufferPayload):
        return {"encoding": "torch_tensor"}, value
    if isinstance(value, _TensorPayload):
        value = value.tensor
    if _is_tensor(value):
        if value.is_nested:
            raise NotImplementedError(
                "structured_object_store: nested (jagged) torch tensors as members are not "
                "implemented in mooncake-rs (_encode_member)"
            )
        spec = {"encoding": "torch_tensor", "dtype": str(value.dtype), "shape": list(value.shape),
                "element_size": int(value.element_size())}
        return spec, _TensorPayload(value)
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return {"encoding": "ndarray", "dtype": array.dtype.str, "shape": list(value.shape)}, array.reshape(-1).view(np.uint8)
    return {"encoding": "bytes"}, value


def _field_specs(metadata: Mapping[str, Any]) -> dict[str, Any]:
    specs = metadata.get(STRUCTURED_FIELD_SPECS_KEY, {})
    if not isinstance(specs, dict):
        raise ValueError("structured field specs must be a dict")
    return specs


def _slice_bounds(member_slice: StructuredMemberSlice, rows: int) -> tuple[int, int, int]:
    if member_slice.axis != 0:
        raise ValueError("structured slicing currently supports axis=0 only")
    if member_slice.step <= 0:
        raise ValueError("structured ndarray slicing step must be positive")
    return slice(member_slice.start, member_slice.end, member_slice.step).indices(rows)


def _ndarray_destination(name: str, destination: Any, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if destination is None:
        return np.empty(shape, dtype=dtype)
    if isinstance(destination, _RawDestinationBuffer):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if destination.size < nbytes:
            raise ValueError(f"raw destination has {destination.size} bytes, expected at least {nbytes}")
        buf = (ctypes.c_uint8 * nbytes).from_address(destination.ptr)
        return np.ctypeslib.as_array(buf).view(dtype).reshape(shape)
    if not isinstance(destination, np.ndarray):
        raise TypeError(f"structured ndarray field {name} destination must be a numpy.ndarray or raw_destination")
    if destination.dtype != dtype:
        raise ValueError(f"structured ndarray field {name} destination dtype mismatch: expected {dtype.str}, got {destination.dtype.str}")
    if tuple(destination.shape) != shape:
        raise ValueError(f"structured ndarray field {name} destination shape mismatch: expected {shape}, got {tuple(destination.shape)}")
    if not destination.flags["C_CONTIGUOUS"] or not destination.flags["WRITEABLE"]:
        raise ValueError(f"structured ndarray field {name} destination must be C-contiguous and writeable")
    return destination


# ----- flat dicts and DataProto envelopes -----


def _is_seq(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def _to_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        return dict(value)
    items = getattr(value, "items", None)
    if callable(items):
        return dict(items())
    raise TypeError(f"expected mapping-like value, got {type(value).__name__}")


def _schema_section(name: str, schema: FieldSchema) -> str | None:
    section = schema.metadata.get("section")
    if section is not None and section not in _SECTIONS:
        raise ValueError(f"FieldSchema for {name!r} metadata['section'] must be one of {sorted(_SECTIONS)}")
    return section


def _schema_dtype(schema: FieldSchema) -> np.dtype | None:
    name = schema.metadata.get("dtype")
    if name is None:
        return None
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"invalid FieldSchema metadata['dtype']: {name!r}") from exc
    if dtype.kind not in "biufc":
        raise ValueError(f"FieldSchema metadata['dtype'] must be numeric or bool, got {dtype}")
    return dtype


def _object_column(name: str, value: Any, rows: int) -> np.ndarray:
    if len(value) != rows:
        raise ValueError(f"flat dict non_tensor_batch field {name!r} has batch size {len(value)}, expected {rows}")
    column = np.empty(rows, dtype=object)
    column[:] = list(value)
    return column


def _dense_len(value: Any) -> int | None:
    if _is_tensor(value) and value.ndim > 0:
        return len(value)
    if isinstance(value, np.ndarray) and value.dtype != object and value.ndim > 0:
        return len(value)
    return None


def _flat_dict_to_envelope(data: Mapping[str, Any], schemas: Mapping[str, FieldSchema]) -> dict[str, dict]:
    """Split a flat dict: row-aligned tensors/arrays -> batch, row-aligned sequences ->
    non_tensor_batch, the rest -> meta_info (``FieldSchema`` sections override)."""
    if not isinstance(data, Mapping):
        raise TypeError("flat dict payload must be a mapping")
    sections = {n: _schema_section(n, s) for n, s in schemas.items() if n in data}
    sized = {len(data[n]) for n, sec in sections.items() if sec in ("batch", "non_tensor_batch")}
    if len(sized) > 1:
        raise ValueError(f"flat dict fields have inconsistent batch sizes: {sorted(sized)}")
    schema_rows = sized.pop() if sized else 0
    rows = schema_rows
    if not rows:
        candidates = {k: v for k, v in data.items() if sections.get(k) != "meta_info"}
        dense = {n for n in map(_dense_len, candidates.values()) if n is not None}
        if len(dense) > 1:
            raise ValueError(f"flat dict dense fields have ambiguous batch sizes: {sorted(dense)}")
        if not dense:
            dense = {len(v) for v in candidates.values() if (isinstance(v, np.ndarray) and v.ndim > 0) or _is_seq(v)}
            if len(dense) > 1:
                raise ValueError(
                    f"flat dict fields have ambiguous batch sizes: {sorted(dense)}; "
                    "pass FieldSchema metadata['section'] for list-valued metadata fields"
                )
        rows = dense.pop() if dense else 0
    out: dict[str, dict] = {s: {} for s in _SECTIONS}
    for key, value in data.items():
        section = sections.get(key)
        if section is None:
            if rows and _dense_len(value) is not None and value.shape[:1] == (rows,):
                section = "batch"
            elif not schema_rows and _is_seq(value) and len(value) == rows:
                section = "non_tensor_batch"
            else:
                section = "meta_info"
        if section == "non_tensor_batch":
            schema = schemas.get(key)
            if isinstance(value, np.ndarray):
                if len(value) != rows:
                    raise ValueError(f"flat dict non_tensor_batch field {key!r} has batch size {len(value)}, expected {rows}")
                dtype = None if schema is None or schema.codec != "ndarray" else _schema_dtype(schema)
                if dtype is not None and (value.dtype != object or all(v is not None for v in value)):
                    value = np.asarray(value, dtype=dtype)
            elif _is_seq(value):
                value = _object_column(key, value, rows)
            else:
                raise TypeError(f"flat dict non_tensor_batch field {key!r} must be an ndarray or non-string sequence")
        out[section][key] = value
    return out


def _split_envelope(data: Any) -> tuple[dict, dict, dict]:
    if isinstance(data, Mapping):
        if data and set(data) <= set(_SECTIONS) and all(
            v is None or isinstance(v, Mapping) or callable(getattr(v, "items", None)) for v in data.values()
        ):
            return _to_dict(data.get("batch")), _to_dict(data.get("non_tensor_batch")), _to_dict(data.get("meta_info"))
        return dict(data), {}, {}
    return tuple(_to_dict(getattr(data, s, None)) for s in _SECTIONS)  # type: ignore[return-value]


def _envelope_to_flat_dict(data: Mapping[str, Any]) -> dict[str, Any]:
    parts = [_to_dict(data.get(s)) for s in ("meta_info", "batch", "non_tensor_batch")]
    overlap = (set(parts[0]) & set(parts[1])) | (set(parts[0]) & set(parts[2])) | (set(parts[1]) & set(parts[2]))
    if overlap:
        raise ValueError(f"Duplicate keys found across DataProto sections: {sorted(overlap)}")
    result = {**parts[0], **parts[1]}
    for name, value in parts[2].items():
        result[name] = value.tolist() if isinstance(value, np.ndarray) and value.dtype == object else value
    return result


def _build_result(batch: dict, non_tensor: dict, meta_info: dict, data_cls: Any) -> Any:
    if data_cls is None or data_cls is dict:
        return {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": meta_info}
    try:
        from_dict = getattr(data_cls, "from_dict", None)
        if callable(from_dict):
            return from_dict(batch, non_tensor, meta_info=meta_info)
        return data_cls(batch=batch, non_tensor_batch=non_tensor, meta_info=meta_info)
    except TypeError as error:
        raise TypeError(
            f"{getattr(data_cls, '__name__', data_cls)!r} cannot be constructed from batch, non_tensor_batch, and meta_info"
        ) from error


def _object_array(values: list[Any]) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = values
    return array


def _take_rows(value: Any, indices: Sequence[int] | None, bounds: tuple[int, int, int] | None) -> Any:
    """Rows of a decoded value (list, ndarray or tensor)."""
    if indices is not None:
        if isinstance(value, list):
            return [value[i] for i in indices]
        if _is_tensor(value):
            torch = _torch_module()
            return value[torch.as_tensor(list(indices), dtype=torch.long)]
        return value[list(indices)]
    if bounds is not None:
        return value[slice(*bounds)]
    return value


class MooncakeBundleTransfer:
    """Stores bundles, structured objects and DataProto batches in a Mooncake store."""

    def __init__(
        self,
        store: BundleStore,
        key_prefix: str = "bundle",
        default_chunk_bytes: int = DEFAULT_BUNDLE_CHUNK_BYTES,
        buffer_pool: Any = None,
    ) -> None:
        self.store = store
        self.key_prefix = _bundle.normalize_key_prefix(key_prefix)
        self.default_chunk_bytes = _bundle.validate_chunk_bytes(default_chunk_bytes)
        self.buffer_pool = buffer_pool  # accepted for upstream's signature; reads copy via get
        self._bundles = _bundle.BundleStore(store, self.key_prefix, self.default_chunk_bytes)

    # ----- bundles

    @staticmethod
    def _policy(policy: Optional[BundleTransferPolicy], max_inflight_put: Optional[int] = None) -> BundleTransferPolicy:
        result = policy or BundleTransferPolicy()
        if max_inflight_put is not None:
            result = BundleTransferPolicy(max_inflight_put, result.put_mode, result.copy_mode)
        if result.max_inflight_put < 1:
            raise ValueError("max_inflight_put must be positive")
        if result.put_mode not in ("auto", "batch", "parallel"):
            raise ValueError(f"unsupported put_mode: {result.put_mode}")
        if result.copy_mode not in ("auto", "zero_copy", "copy"):
            raise ValueError(f"unsupported copy_mode: {result.copy_mode}")
        if result.copy_mode == "zero_copy":
            raise ValueError("zero-copy structured fields require a BufferPool tensor-object buffer")
        return result

    @staticmethod
    def _ref_parts(ref: RemoteBundleRef | Mapping[str, Any]) -> tuple[Any, Any]:
        if isinstance(ref, RemoteBundleRef):
            return ref.manifest_key, ref.manifest
        return ref.get("manifest_key"), ref.get("manifest")

    def _manifest(self, ref: RemoteBundleRef | Mapping[str, Any]) -> dict[str, Any]:
        return self._bundles.resolve_manifest(*self._ref_parts(ref))

    def put_bundle(
        self, meta: bytes | bytearray | memoryview, buffers: Mapping[str, Any], partition: str = "default",
        chunk_bytes: Optional[int] = None, policy: Optional[BundleTransferPolicy] = None,
        max_inflight_put: Optional[int] = None, config: Any = None,
    ) -> RemoteBundleRef:
        """Store raw meta bytes plus named byte buffers as a bundle."""
        policy = self._policy(policy, max_inflight_put)
        key, manifest = self._bundles.put_bundle(meta, buffers, partition, chunk_bytes, policy.copy_mode == "copy", config)
        return RemoteBundleRef(manifest_key=key, manifest=manifest)

    def remove_bundle(self, ref: RemoteBundleRef | Mapping[str, Any]) -> None:
        """Remove every key of a bundle (nothing when it is already gone)."""
        self._bundles.remove_bundle(*self._ref_parts(ref))

    # ----- structured objects

    def put_structured_object(
        self, payload: StructuredObjectPayload, partition: str = "default", chunk_bytes: Optional[int] = None,
        policy: Optional[BundleTransferPolicy] = None, max_inflight_put: Optional[int] = None, config: Any = None,
    ) -> RemoteBundleRef:
        """Store JSON metadata plus named members (ndarrays, tensors, bytes)."""
        if not isinstance(payload.metadata, Mapping):
            raise TypeError("structured metadata must be a mapping")
        metadata = dict(payload.metadata)
        if STRUCTURED_FIELD_SPECS_KEY in metadata:
            raise ValueError(f"structured metadata key {STRUCTURED_FIELD_SPECS_KEY!r} is reserved")
        if not isinstance(metadata.setdefault("layout", "structured"), str):
            raise ValueError("structured metadata layout must be a string")
        specs, members = {}, {}
        for name, value in payload.buffers.items():
            _bundle.validate_key_segment(name, "buffer name")
            specs[name], members[name] = _encode_member(value)
        if specs:
            metadata[STRUCTURED_FIELD_SPECS_KEY] = specs
        try:
            meta = json.dumps(metadata, separators=(",", ":")).encode("utf-8")
        except TypeError as error:
            raise TypeError("structured metadata must be JSON-serializable") from error
        return self.put_bundle(meta, members, partition, chunk_bytes, policy, max_inflight_put, config)

    def put_object(
        self, obj: Any, partition: str = "default", chunk_bytes: Optional[int] = None,
        policy: Optional[BundleTransferPolicy] = None, max_inflight_put: Optional[int] = None, config: Any = None,
    ) -> RemoteBundleRef:
        """Store a mapping of members, or one tensor/array/bytes value."""
        if isinstance(obj, Mapping):
            payload = StructuredObjectPayload(metadata={}, buffers=obj)
        else:
            payload = StructuredObjectPayload(metadata={_WRAPPED_OBJECT: True}, buffers={"value": obj})
        return self.put_structured_object(payload, partition, chunk_bytes, policy, max_inflight_put, config)

    def get_object(self, ref: RemoteBundleRef | Mapping[str, Any]) -> Any:
        """What ``put_object`` stored."""
        result = self.materialize(self.read_spec(ref))
        return result.objects["value"] if result.metadata.get(_WRAPPED_OBJECT) else result.objects

    def read_spec(self, ref: RemoteBundleRef | Mapping[str, Any]) -> StructuredObjectReadSpec:
        """A read spec of all members of a structured object."""
        return StructuredObjectReadSpec(ref=ref)

    def materialize(self, spec: StructuredObjectReadSpec) -> StructuredObjectResult:
        """Read the members a spec selects."""
        return self.materialize_into(spec, None)

    def materialize_into(self, spec: StructuredObjectReadSpec, destinations: Optional[Mapping[str, Any]]) -> StructuredObjectResult:
        """Read the members a spec selects, into caller destinations where given (numpy
        arrays or ``raw_destination`` for ndarray members, ``tensor_object_buffer`` or
        ``raw_destination`` for tensor members)."""
        if spec.member_names is not None and not spec.member_names:
            raise ValueError("structured read spec selected no members")
        manifest = self._manifest(spec.ref)
        metadata = json.loads(bytes(self._bundles.read_payload(manifest["meta"])).decode("utf-8"))
        if not isinstance(metadata, dict):
            raise ValueError("structured metadata must decode to a dict")
        buffers = manifest["buffers"]
        selected = list(buffers) if spec.member_names is None else list(spec.member_names)
        missing = [name for name in selected if name not in buffers]
        if missing:
            raise KeyError(f"unknown bundle buffers: {missing}")
        specs = _field_specs(metadata)
        slices = dict(spec.member_slices)
        destinations = destinations or {}
        objects = {
            name: self._read_member(name, buffers[name], specs.get(name, {"encoding": "bytes"}),
                                    slices.get(name), destinations.get(name))
            for name in selected
        }
        return StructuredObjectResult(metadata=metadata, objects=objects)

    def _read_member(self, name: str, payload: Mapping, spec: Mapping, member_slice: Any, destination: Any) -> Any:
        encoding = spec.get("encoding", "bytes")
        if encoding == "bytes":
            if member_slice is not None:
                raise ValueError(f"structured bytes member {name} does not support slicing")
            if destination is not None:
                raise ValueError(f"structured bytes member {name} does not support materialize_into")
            return bytes(self._bundles.read_payload(payload))
        if encoding == "ndarray":
            return self._read_ndarray(name, payload, spec, member_slice, destination)
        if encoding == "torch_tensor":
            return self._read_tensor(name, payload, spec, member_slice, destination)
        raise ValueError(f"unsupported structured field encoding: {encoding}")

    def _read_ndarray(self, name: str, payload: Mapping, spec: Mapping, member_slice: Any, destination: Any) -> np.ndarray:
        dtype, shape = spec.get("dtype"), spec.get("shape")
        if not isinstance(dtype, str) or not isinstance(shape, list):
            raise ValueError(f"structured ndarray field {name} is missing dtype or shape")
        dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
        if member_slice is None:
            target = _ndarray_destination(name, destination, dtype, shape)
            if target.nbytes:
                target.reshape(-1).view(np.uint8)[:] = np.frombuffer(self._bundles.read_payload(payload), np.uint8)[: target.nbytes]
            return target
        if not shape:
            raise ValueError("structured ndarray slicing requires at least one dimension")
        start, end, step = _slice_bounds(member_slice, shape[0])
        count = len(range(start, end, step))
        target = _ndarray_destination(name, destination, dtype, (count, *shape[1:]))
        if count:
            row = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
            cover = (count - 1) * step + 1
            raw = self._bundles.read_range(payload, start * row, cover * row)
            target[...] = np.frombuffer(raw, dtype=dtype).reshape((cover, *shape[1:]))[::step]
        return target

    def _read_tensor(self, name: str, payload: Mapping, spec: Mapping, member_slice: Any, destination: Any) -> Any:
        if spec.get("nested"):
            raise NotImplementedError(
                "structured_object_store: nested (jagged) tensor members are not implemented "
                f"in mooncake-rs (member {name})"
            )
        if destination is not None and member_slice is None:
            if not isinstance(destination, (_TensorObjectBufferPayload, _RawDestinationBuffer)):
                raise ValueError(
                    f"structured tensor member {name} only supports tensor_object_buffer or raw_destination destinations"
                )
            get_into = getattr(self.store, "get_tensor_into", None)
            if payload.get("kind") == "tensor" and callable(get_into):
                return get_into(payload["key"], destination.ptr, destination.size)
            data = bytes(self._bundles.read_payload(payload))
            if destination.size < len(data):
                raise ValueError(f"tensor destination has {destination.size} bytes, expected at least {len(data)}")
            ctypes.memmove(destination.ptr, data, len(data))
            return destination
        value = self._bundles.read_tensor(payload)
        if member_slice is not None:
            if destination is not None:
                raise ValueError(f"sliced structured tensor member {name} does not support destinations")
            value = value[slice(*_slice_bounds(member_slice, len(value)))].contiguous()
        return value

    @staticmethod
    def release_result(result: Any) -> None:
        """Release buffer-pool leases held by a result (results here own their memory,
        so this only releases owners a caller attached)."""
        seen: set[int] = set()

        def visit(value: Any) -> None:
            owner = getattr(value, "_mooncake_pool_owner", None)
            if owner is not None:
                if id(owner) not in seen:
                    seen.add(id(owner))
                    owner.release()
                return
            if isinstance(value, Mapping):
                items = value.values()
            elif hasattr(value, "batch") and hasattr(value, "non_tensor_batch"):
                items = (value.batch, value.non_tensor_batch, getattr(value, "meta_info", None))
            elif isinstance(value, (list, tuple)) or (isinstance(value, np.ndarray) and value.dtype == object):
                items = list(value.flat) if isinstance(value, np.ndarray) else value
            else:
                return
            if id(value) not in seen:
                seen.add(id(value))
                for item in items:
                    visit(item)

        visit(result)

    # ----- DataProto

    def put(
        self, data: Any, *, type: Literal["dataproto", "dict"] = "dataproto", namespace: str = "default",
        partition: str = "default", stage: str = "default", chunk_bytes: Optional[int] = None,
        policy: Optional[BundleTransferPolicy] = None, config: Any = None,
        field_schemas: Optional[Mapping[str, FieldSchema]] = None,
    ) -> MooncakeDataProtoRef:
        """Store a DataProto-like object (``batch``/``non_tensor_batch``/``meta_info``) or a
        flat dict of row-aligned fields and metadata."""
        if type == "dict":
            data = _flat_dict_to_envelope(data, field_schemas or {})
        elif type != "dataproto":
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        return self._put_stage(None, data, namespace, partition, stage, chunk_bytes, policy, False, field_schemas, config)

    def get(
        self, ref: DataProtoRefLike, *, type: Literal["dataproto", "dict"] = "dataproto",
        fields: Optional[Sequence[str]] = None, batch_fields: Optional[Sequence[str]] = None,
        non_tensor_fields: Optional[Sequence[str]] = None, meta_info_keys: Optional[Sequence[str]] = None,
        data_cls: Optional[Any] = None, destinations: Optional[Mapping[str, Any]] = None,
        rows: slice | StructuredMemberSlice | Sequence[int] | None = None,
    ) -> Any:
        """Read what ``put`` stored (``type="dict"``: one flat dict, object columns as lists)."""
        if type not in ("dataproto", "dict"):
            raise ValueError(f"unsupported Mooncake payload type: {type!r}")
        flat = type == "dict"
        result = self._get(ref, fields, batch_fields, non_tensor_fields, meta_info_keys,
                           dict if flat else data_cls, destinations, rows, flat)
        return _envelope_to_flat_dict(result) if flat else result

    def put_dataproto(
        self, data: Any, *, namespace: str = "default", partition: str = "default", stage: str = "default",
        chunk_bytes: Optional[int] = None, policy: Optional[BundleTransferPolicy] = None,
        field_schemas: Optional[Mapping[str, FieldSchema]] = None, config: Any = None,
    ) -> MooncakeDataProtoRef:
        """``put(data, type="dataproto", ...)``."""
        return self.put(data, type="dataproto", namespace=namespace, partition=partition, stage=stage,
                        chunk_bytes=chunk_bytes, policy=policy, field_schemas=field_schemas, config=config)

    def get_dataproto(
        self, ref: DataProtoRefLike, *, fields: Optional[Sequence[str]] = None,
        batch_fields: Optional[Sequence[str]] = None, non_tensor_fields: Optional[Sequence[str]] = None,
        meta_info_keys: Optional[Sequence[str]] = None, data_cls: Optional[Any] = None,
        destinations: Optional[Mapping[str, Any]] = None,
        rows: slice | StructuredMemberSlice | Sequence[int] | None = None,
    ) -> Any:
        """Selected fields and rows of a stored DataProto."""
        return self._get(ref, fields, batch_fields, non_tensor_fields, meta_info_keys, data_cls, destinations, rows, False)

    def append_dataproto_fields(
        self, ref: DataProtoRefLike, data: Any, *, stage: str, overwrite: bool = False,
        chunk_bytes: Optional[int] = None, policy: Optional[BundleTransferPolicy] = None,
        field_schemas: Optional[Mapping[str, FieldSchema]] = None, config: Any = None,
    ) -> MooncakeDataProtoRef:
        """A new ref with more fields stored in ``stage`` (the old ref stays readable)."""
        ref = _resolve_ref(ref)
        return self._put_stage(ref, data, ref.namespace, ref.partition, stage, chunk_bytes, policy, overwrite, field_schemas, config)

    def cleanup_dataproto(self, ref: DataProtoRefLike) -> None:
        """Remove every stage bundle of a DataProto."""
        ref = _resolve_ref(ref)
        for key in dict.fromkeys(r.manifest_key for r in ref.stage_refs.values()):
            self.remove_bundle(next(r for r in ref.stage_refs.values() if r.manifest_key == key))

    def cleanup_dataproto_append(self, previous: DataProtoRefLike, appended: DataProtoRefLike) -> None:
        """Remove what an append added, leaving the previous ref intact."""
        previous, appended = _resolve_ref(previous), _resolve_ref(appended)
        for stage, stage_ref in appended.stage_refs.items():
            old = previous.stage_refs.get(stage)
            if old is None:
                self.remove_bundle(stage_ref)
                continue
            if stage_ref.manifest_key == old.manifest_key:
                continue
            is_exist = getattr(self.store, "is_exist", None)
            if callable(is_exist) and is_exist(stage_ref.manifest_key) == 0:
                continue
            manifest = self._manifest(stage_ref)
            old_members = {loc.member for loc in previous.field_index.values() if loc.stage == stage}
            for name, encoded in previous.encoded_non_tensor.items():
                if previous.field_index[name].stage == stage:
                    old_members.update(encoded["payload_members"].values())
            new_payloads = [p for n, p in manifest["buffers"].items() if n not in old_members]
            owners = {self._bundles.object_id_of(p["key"]) for p in new_payloads}
            keys = [c["key"] for c in manifest["meta"]["chunks"]]
            keys += [c["key"] for p in new_payloads for c in p["chunks"]]
            keys += [k for k in manifest.get("cleanup_keys", []) if self._bundles.object_id_of(k) in owners]
            _bundle.cleanup_keys(self.store, keys, strict=True)
            _bundle.cleanup_keys(self.store, [stage_ref.manifest_key], strict=True)

    def dataproto_manifest_view(self, ref: DataProtoRefLike) -> dict[str, Any]:
        """Where each field of a DataProto is stored and how it is encoded."""
        ref = _resolve_ref(ref)
        specs = {}
        for stage, stage_ref in ref.stage_refs.items():
            manifest = self._manifest(stage_ref)
            specs[stage] = _field_specs(json.loads(bytes(self._bundles.read_payload(manifest["meta"])).decode("utf-8")))
        fields = {}
        for name, loc in ref.field_index.items():
            stage_specs = specs[loc.stage]
            member_spec = dict(stage_specs.get(loc.member, {"encoding": "bytes"}))
            encoded = ref.encoded_non_tensor.get(name)
            if encoded is not None:
                member_spec = {
                    "encoding": "structured_non_tensor",
                    "codec": encoded["codec"],
                    "metadata": encoded.get("metadata"),
                    "payload_members": dict(encoded["payload_members"]),
                    "payload_specs": {
                        p: dict(stage_specs.get(m, {"encoding": "bytes"})) for p, m in encoded["payload_members"].items()
                    },
                }
            fields[name] = {"section": loc.section, "stage": loc.stage, "member": loc.member, "spec": member_spec}
        return {
            "namespace": ref.namespace,
            "partition": ref.partition,
            "batch_size": ref.batch_size,
            "batch_fields": {n: f for n, f in fields.items() if f["section"] == "batch"},
            "non_tensor_fields": {n: f for n, f in fields.items() if f["section"] == "non_tensor_batch"},
            "meta_info_keys": list(ref.meta_info),
        }

    def _new_group_id(self, config: Any) -> str | None:
        raw = getattr(config, "group_ids", None)
        if raw is None:
            group = None
        elif isinstance(raw, str):
            group = raw
        else:
            try:
                ids = list(raw)
            except TypeError as error:
                raise ValueError("structured object store config.group_ids must contain strings") from error
            if len(ids) > 1:
                raise ValueError(
                    "structured object store config.group_ids must contain exactly one "
                    "logical group id; it is expanded across internal Mooncake keys"
                )
            group = ids[0] if ids else None
        if group is None:
            return f"structured-{uuid.uuid4().hex}"
        if not isinstance(group, str):
            raise ValueError("structured object store config.group_ids must contain strings")
        return group or None

    def _encode_non_tensor(self, name: str, value: Any, schema: FieldSchema | None) -> _EncodedStructuredLeaf | None:
        path = f"non_tensor_batch.{name}"
        if schema is not None:
            if isinstance(value, np.ndarray):
                column = value
            elif _is_seq(value):
                column = _object_column(name, value, len(value))
            else:
                raise TypeError(f"non_tensor_batch field {name!r} with FieldSchema must be an ndarray or non-string sequence")
            try:
                if schema.codec == "auto":
                    if not schema.nullable and any(v is None for v in column):
                        raise ValueError(f"FieldSchema for {path!r} is not nullable")
                else:
                    hints = dict(schema.metadata)
                    if schema.codec in ("typed_ragged", "ndarray"):
                        dtype = _schema_dtype(schema)
                        hints["dtype"] = None if dtype is None else str(dtype)
                    return _codecs.encode_schema(path, list(column), schema.codec, hints, schema.nullable)
            except (TypeError, ValueError, RuntimeError, AttributeError) as exc:
                raise type(exc)(
                    f"failed to encode non_tensor_batch field {name!r} with FieldSchema codec {schema.codec!r}: {exc}"
                ) from exc
        if isinstance(value, np.ndarray) and value.dtype == object:
            return _codecs.encode_inferred(path, list(value))
        return None

    def _put_stage(
        self, ref: MooncakeDataProtoRef | None, data: Any, namespace: str, partition: str, stage: str,
        chunk_bytes: Optional[int], policy: Optional[BundleTransferPolicy], overwrite: bool,
        schemas: Optional[Mapping[str, FieldSchema]], config: Any,
    ) -> MooncakeDataProtoRef:
        batch, non_tensor, meta_info = _split_envelope(data)
        schemas = schemas or {}
        actual = {n: {s for s, part in zip(_SECTIONS, (batch, non_tensor, meta_info)) if n in part} for n in schemas}
        for name, schema in schemas.items():
            declared = _schema_section(name, schema)
            if declared is not None and actual[name] and declared not in actual[name]:
                found = ", ".join(repr(s) for s in sorted(actual[name]))
                raise ValueError(f"FieldSchema for {name!r} declares section {declared!r}, but data contains it in {found}")
        sizes = {len(v) for part in (batch, non_tensor) for v in part.values()}
        if len(sizes) > 1:
            raise ValueError(f"DataProto fields have inconsistent batch sizes: {sorted(sizes)}")
        batch_size = sizes.pop() if sizes else 0
        if ref is not None and batch_size != ref.batch_size:
            raise ValueError(f"DataProto append batch size {batch_size} does not match ref batch size {ref.batch_size}")
        both = sorted(set(batch) & set(non_tensor))
        if both:
            raise ValueError(f"DataProto batch and non_tensor_batch fields overlap: {both}")
        members: dict[str, Any] = {}
        updates: dict[str, StructuredFieldLocation] = {}
        for name, value in batch.items():
            members[f"batch.{name}"] = value
            updates[name] = StructuredFieldLocation(stage, f"batch.{name}", "batch")
        encoded_updates: dict[str, Any] = {}
        for name, value in non_tensor.items():
            schema = schemas.get(name)
            if schema is not None and _schema_section(name, schema) not in (None, "non_tensor_batch"):
                schema = None
            encoded = self._encode_non_tensor(name, value, schema)
            member = f"non_tensor_batch.{name}"
            updates[name] = StructuredFieldLocation(stage, member, "non_tensor_batch")
            if encoded is None:
                members[member] = value
                continue
            payload_members = {}
            for part, part_value in encoded.payload.items():
                members[f"{member}.{part}"] = part_value
                payload_members[part] = f"{member}.{part}"
            encoded_updates[name] = {
                "codec": encoded.codec, "rows": encoded.rows, "metadata": encoded.metadata,
                "payload_members": payload_members,
            }
        if not members:
            if ref is not None:
                return MooncakeDataProtoRef(
                    ref.batch_size, dict(ref.stage_refs), dict(ref.field_index), {**ref.meta_info, **meta_info},
                    ref.namespace, ref.partition, ref.global_indexes, dict(ref.encoded_non_tensor), ref._storage_group_id,
                )
            return MooncakeDataProtoRef(batch_size, {}, {}, dict(meta_info), namespace, partition,
                                        encoded_non_tensor={}, _storage_group_id=self._new_group_id(config))
        if ref is not None:
            duplicates = sorted(set(ref.field_index) & set(updates))
            if duplicates and not overwrite:
                raise ValueError(f"DataProto fields already exist: {duplicates}")
            if overwrite:
                dangling = sorted(n for n, loc in ref.field_index.items() if loc.stage == stage and n not in updates)
                if dangling:
                    raise ValueError(f"DataProto overwrite for stage {stage!r} must include existing fields: {dangling}")
        group = self._new_group_id(config) if ref is None else ref._storage_group_id
        effective = config if group is None else _bundle.config_with_group_id(config, group)
        payload = StructuredObjectPayload(
            metadata={"layout": "dataproto_stage", "dataproto": {
                "version": 1, "namespace": namespace, "partition": partition, "stage": stage, "batch_size": batch_size,
            }},
            buffers=members,
        )
        existing = None if ref is None else ref.stage_refs.get(stage)
        if existing is not None and not overwrite:
            stage_ref = self._append_stage(existing, payload, partition, chunk_bytes, policy, effective)
        else:
            stage_ref = self.put_structured_object(payload, partition, chunk_bytes, policy, config=effective)
            if existing is not None and existing.manifest_key != stage_ref.manifest_key:
                self.remove_bundle(existing)
        if ref is None:
            return MooncakeDataProtoRef(batch_size, {stage: stage_ref}, updates, dict(meta_info), namespace, partition,
                                        None, encoded_updates, group)
        encoded_all = {n: e for n, e in ref.encoded_non_tensor.items() if n not in updates}
        encoded_all.update(encoded_updates)
        return MooncakeDataProtoRef(
            batch_size, {**ref.stage_refs, stage: stage_ref}, {**ref.field_index, **updates},
            {**ref.meta_info, **meta_info}, namespace, partition, ref.global_indexes, encoded_all, group,
        )

    def _append_stage(
        self, old_ref: RemoteBundleRef, payload: StructuredObjectPayload, partition: str,
        chunk_bytes: Optional[int], policy: Optional[BundleTransferPolicy], config: Any,
    ) -> RemoteBundleRef:
        """Store the new members, then one manifest over old and new members."""
        new_ref = self.put_structured_object(payload, partition, chunk_bytes, policy, config=config)
        read_meta = lambda m: json.loads(bytes(self._bundles.read_payload(m["meta"])).decode("utf-8"))  # noqa: E731
        try:
            old_manifest, new_manifest = self._manifest(old_ref), self._manifest(new_ref)
            old_meta, new_meta = read_meta(old_manifest), read_meta(new_manifest)
            if old_meta.get("dataproto") != new_meta.get("dataproto"):
                raise ValueError("DataProto stage metadata mismatch during manifest merge")
            old_specs, new_specs = dict(_field_specs(old_meta)), _field_specs(new_meta)
            collisions = sorted((set(old_specs) & set(new_specs)) | (set(old_manifest["buffers"]) & set(new_manifest["buffers"])))
            if collisions:
                raise ValueError(f"structured members already exist: {collisions}")
            merged = dict(old_meta)
            old_specs.update(new_specs)
            if old_specs:
                merged[STRUCTURED_FIELD_SPECS_KEY] = old_specs
            base = lambda m: f"{self.key_prefix}/{m['object_id']}/manifest"  # noqa: E731
            cleanup = [
                *old_manifest.get("cleanup_keys", []), base(old_manifest),
                *[c["key"] for c in old_manifest["meta"]["chunks"]],
                base(new_manifest), *[c["key"] for c in new_manifest["meta"]["chunks"]],
            ]
            key, manifest = self._bundles.put_bundle_manifest(
                json.dumps(merged, separators=(",", ":")).encode("utf-8"),
                {**old_manifest["buffers"], **new_manifest["buffers"]}, partition, chunk_bytes, cleanup, config,
            )
        except Exception:
            self.remove_bundle(new_ref)
            raise
        _bundle.cleanup_keys(self.store, [base(new_manifest), *[c["key"] for c in new_manifest["meta"]["chunks"]]], strict=False)
        return RemoteBundleRef(manifest_key=key, manifest=manifest)

    def _get(
        self, ref: DataProtoRefLike, fields: Any, batch_fields: Any, non_tensor_fields: Any, meta_info_keys: Any,
        data_cls: Any, destinations: Optional[Mapping[str, Any]], rows: Any, flat: bool,
    ) -> Any:
        ref = _resolve_ref(ref)
        indices, bounds = self._row_selection(rows, ref.batch_size)
        if fields is not None and (batch_fields is not None or non_tensor_fields is not None):
            raise ValueError("fields cannot be combined with batch_fields or non_tensor_fields")
        if fields is not None:
            names = list(fields)
        elif batch_fields is None and non_tensor_fields is None:
            names = list(ref.field_index)
        else:
            names = [*(batch_fields or []), *(non_tensor_fields or [])]
        unknown = [n for n in names if n not in ref.field_index]
        if unknown:
            raise KeyError(f"unknown DataProto fields: {unknown}")
        if fields is None and (batch_fields is not None or non_tensor_fields is not None):
            order = [("batch", n) for n in batch_fields or []] + [("non_tensor_batch", n) for n in non_tensor_fields or []]
        else:
            order = [(ref.field_index[n].section, n) for n in names]
        destinations = destinations or {}
        by_stage: dict[str, list[str]] = {}
        for _section, name in order:
            by_stage.setdefault(ref.field_index[name].stage, []).append(name)
        out: dict[str, dict[str, Any]] = {"batch": {}, "non_tensor_batch": {}}
        for stage, stage_names in by_stage.items():
            members, member_dest = [], {}
            for name in stage_names:
                encoded = ref.encoded_non_tensor.get(name)
                if encoded is not None and ref.field_index[name].section == "non_tensor_batch":
                    members.extend(encoded["payload_members"].values())
                    continue
                member = ref.field_index[name].member
                members.append(member)
                if name in destinations and indices is None:
                    member_dest[member] = destinations[name]
            spec = self.read_spec(ref.stage_refs[stage]).select_members(list(dict.fromkeys(members)))
            if bounds is not None:
                for name in stage_names:
                    if name not in ref.encoded_non_tensor:
                        start, end, step = bounds
                        spec = spec.slice_member(ref.field_index[name].member, 0, start, end, step)
            objects = self.materialize_into(spec, member_dest).objects
            for name in stage_names:
                loc = ref.field_index[name]
                encoded = ref.encoded_non_tensor.get(name) if loc.section == "non_tensor_batch" else None
                if encoded is None:
                    value = objects[loc.member]
                    value = _take_rows(value, indices, None)
                else:
                    payload = {p: objects[m] for p, m in encoded["payload_members"].items()}
                    values = _codecs.decode_column(encoded, payload, ref.batch_size)
                    values = _take_rows(values, indices, bounds)
                    value = values if flat else _object_array(values)
                out[loc.section][name] = value
        meta_info = dict(ref.meta_info) if meta_info_keys is None else {
            k: ref.meta_info[k] for k in meta_info_keys if k in ref.meta_info
        }
        return _build_result(out["batch"], out["non_tensor_batch"], meta_info, data_cls)

    @staticmethod
    def _row_selection(rows: Any, total: int) -> tuple[list[int] | None, tuple[int, int, int] | None]:
        if rows is None:
            return None, None
        if isinstance(rows, StructuredMemberSlice):
            return None, _slice_bounds(rows, total)
        if isinstance(rows, slice):
            bounds = rows.indices(total)
            if bounds[2] <= 0:
                raise ValueError("DataProto row slicing step must be positive")
            return None, bounds
        if _is_seq(rows) or isinstance(rows, np.ndarray):
            indices = []
            for index in rows:
                if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
                    raise TypeError("DataProto row indices must be integers")
                normalized = int(index) + (total if int(index) < 0 else 0)
                if not 0 <= normalized < total:
                    raise IndexError(f"DataProto row index {index} out of range for {total} rows")
                indices.append(normalized)
            return indices, None
        raise TypeError("DataProto rows must be a slice, StructuredMemberSlice, or row index sequence")
