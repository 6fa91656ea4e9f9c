"""The bundle layout in the store: one manifest key naming a meta payload and named
buffer payloads, each payload split into chunks.

Keys (upstream's, so either implementation reads the other's bundles)::

    <prefix>/<partition>/<uuid hex>/manifest            JSON manifest
    <prefix>/<partition>/<uuid hex>/meta                meta payload (one chunk)
    <prefix>/<partition>/<uuid hex>/meta/chunk/<i>      ... or several
    <prefix>/<partition>/<uuid hex>/buffer/<name>       buffer payload (one chunk)
    <prefix>/<partition>/<uuid hex>/buffer/<name>/chunk/<i>

Manifest: ``{"version": 1, "layout": "bundle", "object_id": "<partition>/<hex>",
"meta": spec, "buffers": {name: spec}}`` (appended DataProto stages add
``buffer_object_ids`` and ``cleanup_keys``); a payload spec is ``{"key", "bytes",
"chunks": [{"key", "bytes"}]}``, and a tensor stored with ``put_tensor`` adds
``"kind": "tensor"`` (read back with ``get_tensor``). Manifests are validated before use:
every key must lie inside the bundle's namespace and chunk sizes must add up.
"""

from __future__ import annotations

import copy
import ctypes
import io
import json
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping, Optional, Sequence

MISSING_OBJECT_ERROR = -704  # remove() of an object that is already gone
_WRITE_CONFIG_FIELDS = (
    "data_type", "group_ids", "nof_replica_num", "prefer_alloc_in_same_node",
    "preferred_nof_segments", "preferred_segment", "preferred_segments", "replica_num",
    "with_hard_pin", "with_soft_pin",
)


@dataclass(frozen=True)
class TensorPayload:
    """A torch tensor to store with ``put_tensor`` (or the tensor codec helpers)."""

    tensor: Any


@dataclass(frozen=True)
class TensorObjectBuffer:
    """A caller-owned buffer that already holds a serialized Mooncake tensor object."""

    ptr: int
    size: int
    owner: Any
    batch_size: int | None = None

    def __len__(self) -> int:
        if self.batch_size is None:
            raise TypeError("tensor object buffer requires batch_size for DataProto use")
        return self.batch_size


@dataclass
class RawDestination:
    """Caller memory (address, size) to read a member into."""

    ptr: int
    size: int
    owner: Any = None
    pre_registered: bool = False


def store_module():
    try:
        from mooncake import store  # noqa: PLC0415
    except Exception:  # noqa: BLE001 (the extension may be missing in a docs build)
        return None
    return store


def torch_save_bytes(value: Any) -> bytes:
    import torch  # noqa: PLC0415

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def torch_load_bytes(payload: bytes) -> Any:
    import torch  # noqa: PLC0415

    return torch.load(io.BytesIO(payload), weights_only=True)


# ----- names -----


def normalize_key_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    if not prefix or any(ord(c) < 32 for c in prefix):
        raise ValueError("key_prefix must be a non-empty key prefix")
    return prefix


def validate_key_segment(value: Any, name: str) -> None:
    if not isinstance(value, str) or not value or "/" in value or any(ord(c) < 32 for c in value):
        raise ValueError(f"invalid bundle {name}: {value!r}")


def validate_chunk_bytes(chunk_bytes: int) -> int:
    if chunk_bytes <= 0:
        raise ValueError("chunk_bytes must be positive")
    return chunk_bytes


def bytes_view(value: Any, name: str) -> memoryview:
    try:
        view = memoryview(value)
    except TypeError as error:
        raise TypeError(f"bundle buffer {name} must support the buffer protocol") from error
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


# ----- write configs -----


def copy_write_config(config: Any) -> Any:
    try:
        return copy.copy(config)
    except TypeError:
        pass
    try:
        copied = type(config)()
    except Exception as error:
        raise TypeError("structured object store config must be copyable or default-constructible") from error
    for name in _WRITE_CONFIG_FIELDS:
        if hasattr(config, name):
            value = getattr(config, name)
            setattr(copied, name, list(value) if isinstance(value, list) else value)
    return copied


def config_for_keys(config: Any, key_count: int) -> Any:
    """``config`` with its one logical group id repeated once per physical key."""
    group_ids = None if config is None else getattr(config, "group_ids", None)
    if group_ids is None or key_count <= 0:
        return config
    as_str = isinstance(group_ids, str)
    group_ids = [group_ids] if as_str else list(group_ids)
    if not group_ids:
        ungrouped = copy_write_config(config)
        ungrouped.group_ids = None
        return ungrouped
    if len(group_ids) != 1:
        raise ValueError(
            "structured object store config.group_ids must contain exactly one "
            "logical group id; it is expanded across internal Mooncake keys"
        )
    if key_count == 1 and not as_str:
        return config
    grouped = copy_write_config(config)
    grouped.group_ids = [group_ids[0]] * key_count
    return grouped


def config_with_group_id(config: Any, group_id: str) -> Any:
    configured = getattr(config_for_keys(config, 1), "group_ids", None)
    if configured and configured[0] and configured[0] != group_id:
        raise ValueError("config.group_ids conflicts with the DataProto storage group")
    if config is None:
        module = store_module()
        grouped = getattr(module, "ReplicateConfig", SimpleNamespace)()
    else:
        grouped = copy_write_config(config)
    grouped.group_ids = [group_id]
    return grouped


def _call(fn: Any, *args: Any, config: Any = None) -> Any:
    return fn(*args) if config is None else fn(*args, config=config)


def check_status(status: Any, operation: str, key: str) -> None:
    if status not in (None, 0):
        raise RuntimeError(f"{operation} failed for {key}: {status}")


def cleanup_keys(store: Any, keys: Sequence[str], strict: bool) -> None:
    """Remove keys (already-missing ones are fine); errors raise only when ``strict``."""
    pending = list(dict.fromkeys(keys))
    batch_remove = getattr(store, "batch_remove", None)
    if callable(batch_remove) and pending:
        try:
            try:
                results = batch_remove(pending, True)
            except TypeError:
                results = batch_remove(pending)
            if len(results) != len(pending):
                raise RuntimeError(f"batch_remove returned {len(results)} results for {len(pending)} keys")
            pending = [k for k, s in zip(pending, results) if s not in (None, 0, MISSING_OBJECT_ERROR)]
        except Exception:
            if strict:
                raise
    errors = []
    for key in pending:
        try:
            status = store.remove(key, True)
        except KeyError:
            continue
        except Exception:
            if strict:
                raise
            continue
        if status not in (None, 0, MISSING_OBJECT_ERROR):
            errors.append((key, status))
    if errors and strict:
        raise RuntimeError(f"failed to remove {len(errors)} Mooncake keys: {errors[:3]}")


# ----- the bundle store -----


class BundleStore:
    """Writes and reads bundles of one key prefix through a store's put/get calls."""

    def __init__(self, store: Any, key_prefix: str, default_chunk_bytes: int) -> None:
        self.store = store
        self.key_prefix = key_prefix
        self.default_chunk_bytes = default_chunk_bytes

    # -- writing

    def new_object(self, partition: str) -> tuple[str, str]:
        validate_key_segment(partition, "partition")
        object_id = f"{partition}/{uuid.uuid4().hex}"
        return object_id, f"{self.key_prefix}/{object_id}"

    def put_payload(self, key: str, data: memoryview, chunk_bytes: int, config: Any, written: list) -> dict:
        if len(data) == 0:
            return {"key": key, "bytes": 0, "chunks": []}
        count = -(-len(data) // chunk_bytes)
        chunks = []
        for index in range(count):
            chunk_key = key if count == 1 else f"{key}/chunk/{index}"
            part = data[index * chunk_bytes : (index + 1) * chunk_bytes]
            check_status(_call(self.store.put, chunk_key, part, config=config_for_keys(config, 1)), "put", chunk_key)
            written.append(chunk_key)
            chunks.append({"key": chunk_key, "bytes": len(part)})
        return {"key": key, "bytes": len(data), "chunks": chunks}

    def put_tensor(self, key: str, value: TensorPayload, config: Any, copy_only: bool, written: list) -> dict:
        tensor = value.tensor
        put_tensor = getattr(self.store, "put_tensor" if config is None else "pub_tensor", None)
        module = store_module()
        if callable(put_tensor) and not copy_only:
            meta_bytes = int(module._tensor_metadata_size()) if module is not None else 0
            total = meta_bytes + int(getattr(tensor, "nbytes", 0))
            check_status(_call(put_tensor, key, tensor, config=config_for_keys(config, 1)), "put_tensor", key)
            written.append(key)
            return {
                "key": key, "kind": "tensor", "bytes": total, "dtype": str(tensor.dtype),
                "shape": list(tensor.shape), "chunks": [{"key": key, "bytes": total}],
                "metadata_bytes": meta_bytes,
            }
        if module is None or tensor.dim() == 0:
            data = torch_save_bytes(tensor)
            spec = self.put_payload(key, memoryview(data), len(data) or 1, config, written)
            spec["format"] = "torch_save"
            return spec
        meta, ptr, nbytes, _owner = module._serialize_tensor(tensor)
        data = bytes(meta) + (ctypes.string_at(ptr, nbytes) if nbytes else b"")
        spec = self.put_payload(key, memoryview(data), len(data) or 1, config, written)
        spec["metadata_bytes"] = len(meta)
        return spec

    def put_object_buffer(self, key: str, value: TensorObjectBuffer, config: Any, written: list) -> dict:
        config = config_for_keys(config, 1)
        put_tensor_from = getattr(self.store, "put_tensor_from", None)
        if config is None and callable(put_tensor_from):
            status = put_tensor_from(key, value.ptr, value.size)
        elif callable(getattr(self.store, "put_from", None)):
            status = _call(self.store.put_from, key, value.ptr, value.size, config=config)
        else:
            raise RuntimeError("put_from is unavailable")
        check_status(status, "put_from", key)
        written.append(key)
        return {"key": key, "bytes": value.size, "chunks": [{"key": key, "bytes": value.size}]}

    def put_bundle(
        self, meta: Any, buffers: Mapping[str, Any], partition: str, chunk_bytes: Optional[int],
        copy_only: bool = False, config: Any = None,
    ) -> tuple[str, dict]:
        """Store meta bytes plus named buffers; returns (manifest key, manifest)."""
        meta_view = bytes_view(meta, "meta")
        chunk = validate_chunk_bytes(self.default_chunk_bytes if chunk_bytes is None else chunk_bytes)
        object_id, base = self.new_object(partition)
        written: list[str] = []
        try:
            meta_spec = self.put_payload(f"{base}/meta", meta_view, chunk, config, written)
            specs = {}
            for name, value in buffers.items():
                validate_key_segment(name, "buffer name")
                key = f"{base}/buffer/{name}"
                if isinstance(value, TensorPayload):
                    specs[name] = self.put_tensor(key, value, config, copy_only, written)
                elif isinstance(value, TensorObjectBuffer):
                    specs[name] = self.put_object_buffer(key, value, config, written)
                else:
                    specs[name] = self.put_payload(key, bytes_view(value, name), chunk, config, written)
            manifest = {"version": 1, "layout": "bundle", "object_id": object_id, "meta": meta_spec, "buffers": specs}
            self._put_manifest(f"{base}/manifest", manifest, config, written)
        except Exception:
            cleanup_keys(self.store, written, strict=False)
            raise
        return f"{base}/manifest", manifest

    def put_bundle_manifest(
        self, meta: bytes, buffer_specs: Mapping[str, Any], partition: str, chunk_bytes: Optional[int],
        cleanup: Sequence[str], config: Any = None,
    ) -> tuple[str, dict]:
        """A new manifest over payloads that are already stored (DataProto appends)."""
        chunk = validate_chunk_bytes(self.default_chunk_bytes if chunk_bytes is None else chunk_bytes)
        object_id, base = self.new_object(partition)
        written: list[str] = []
        try:
            meta_spec = self.put_payload(f"{base}/meta", memoryview(meta), chunk, config, written)
            cleanup = list(dict.fromkeys(cleanup))
            owners = {self.object_id_of(str(spec["key"])) for spec in buffer_specs.values()}
            owners |= {self.object_id_of(key) for key in cleanup}
            manifest = {
                "version": 1, "layout": "bundle", "object_id": object_id, "meta": meta_spec,
                "buffers": dict(buffer_specs), "buffer_object_ids": sorted(o for o in owners if o),
            }
            if cleanup:
                manifest["cleanup_keys"] = cleanup
            self.validate_manifest(manifest)
            self._put_manifest(f"{base}/manifest", manifest, config, written)
        except Exception:
            cleanup_keys(self.store, written, strict=False)
            raise
        return f"{base}/manifest", manifest

    def _put_manifest(self, key: str, manifest: dict, config: Any, written: list) -> None:
        blob = json.dumps(manifest, separators=(",", ":")).encode("utf-8")
        check_status(_call(self.store.put, key, blob, config=config_for_keys(config, 1)), "put", key)
        written.append(key)

    # -- reading

    def resolve_manifest(self, manifest_key: Optional[str], manifest: Optional[dict]) -> dict:
        if not manifest:
            if not isinstance(manifest_key, str):
                raise ValueError("bundle ref must include manifest_key")
            raw = self.store.get(manifest_key)
            if not raw:
                raise KeyError(f"bundle manifest {manifest_key!r} not found")
            manifest = json.loads(bytes(raw).decode("utf-8"))
            if not isinstance(manifest, dict):
                raise ValueError("bundle manifest must decode to a dict")
        self.validate_manifest(manifest)
        return manifest

    def read_chunk(self, chunk: Mapping[str, Any]) -> bytes:
        data = self.store.get(chunk["key"])
        size = int(chunk["bytes"])
        if data is None or len(data) != size:
            got = 0 if data is None else len(data)
            raise RuntimeError(f"get failed for {chunk['key']}: expected {size} bytes, got {got}")
        return data

    def read_payload(self, spec: Mapping[str, Any]) -> bytearray:
        out = bytearray(int(spec["bytes"]))
        offset = 0
        for chunk in spec["chunks"]:
            data = self.read_chunk(chunk)
            out[offset : offset + len(data)] = data
            offset += len(data)
        return out

    def read_range(self, spec: Mapping[str, Any], start: int, length: int) -> bytearray:
        """Bytes [start, start+length) of a payload, reading only the chunks it covers."""
        out = bytearray(length)
        chunk_start = 0
        for chunk in spec["chunks"]:
            size = int(chunk["bytes"])
            lo, hi = max(start, chunk_start), min(start + length, chunk_start + size)
            if lo < hi:
                data = self.read_chunk(chunk)
                out[lo - start : hi - start] = data[lo - chunk_start : hi - chunk_start]
            chunk_start += size
        return out

    def read_tensor(self, spec: Mapping[str, Any]) -> Any:
        if spec.get("kind") == "tensor":
            get_tensor = getattr(self.store, "get_tensor", None)
            if not callable(get_tensor):
                raise RuntimeError("structured tensor payload does not support get_tensor")
            value = get_tensor(spec["key"])
            if value is None:
                raise RuntimeError(f"get_tensor failed for {spec['key']}")
            return value
        data = bytes(self.read_payload(spec))
        if spec.get("format") == "torch_save":
            return torch_load_bytes(data)
        module = store_module()
        if module is None:
            raise RuntimeError("mooncake.store tensor serialization helpers are required for structured tensor fields")
        return module._deserialize_tensor(data)

    # -- removing

    def remove_bundle(self, manifest_key: Optional[str], manifest: Optional[dict]) -> None:
        is_exist = getattr(self.store, "is_exist", None)
        if not manifest and isinstance(manifest_key, str) and callable(is_exist):
            status = is_exist(manifest_key)
            if status == 0:
                return
            if status != 1:
                raise RuntimeError(f"is_exist failed for {manifest_key}: {status}")
        try:
            manifest = self.resolve_manifest(manifest_key, manifest)
        except Exception:
            if isinstance(manifest_key, str) and callable(is_exist) and is_exist(manifest_key) == 0:
                return
            raise
        expected = f"{self.key_prefix}/{manifest['object_id']}/manifest"
        if manifest_key is not None and manifest_key != expected:
            raise ValueError("bundle manifest_key does not match manifest object_id")
        cleanup_keys(self.store, [*self.payload_keys(manifest), *manifest.get("cleanup_keys", [])], strict=True)
        cleanup_keys(self.store, [expected], strict=True)

    @staticmethod
    def payload_keys(manifest: Mapping[str, Any]) -> list[str]:
        specs = [manifest["meta"], *manifest["buffers"].values()]
        return [chunk["key"] for spec in specs for chunk in spec["chunks"]]

    def object_id_of(self, key: str) -> str | None:
        """The object id owning a bundle key (None outside this prefix)."""
        prefix = f"{self.key_prefix}/"
        if not key.startswith(prefix):
            return None
        suffix = key[len(prefix) :]
        for tail in ("/manifest", "/meta"):
            if suffix.endswith(tail):
                return suffix[: -len(tail)]
        for marker in ("/meta/", "/buffer/"):
            index = suffix.find(marker)
            if index > 0:
                return suffix[:index]
        return None

    # -- validation

    def validate_manifest(self, manifest: Mapping[str, Any]) -> None:
        if manifest.get("version") != 1 or manifest.get("layout") != "bundle":
            raise ValueError("invalid bundle manifest")
        object_id = manifest.get("object_id")
        if not isinstance(object_id, str):
            raise ValueError("bundle manifest object_id must be a string")
        owners = manifest.get("buffer_object_ids", [object_id])
        if not isinstance(owners, list) or not all(isinstance(o, str) for o in owners):
            raise ValueError("bundle manifest buffer_object_ids must be a list of strings")
        bases = [f"{self.key_prefix}/{o}" for o in owners]
        _validate_spec(manifest.get("meta"), [f"{self.key_prefix}/{object_id}"])
        cleanup = manifest.get("cleanup_keys", [])
        if not isinstance(cleanup, list) or not all(
            isinstance(k, str) and any(k == f"{b}/manifest" or k.startswith(f"{b}/") for b in bases)
            for k in cleanup
        ):
            raise ValueError("bundle manifest cleanup_keys are outside the bundle namespace")
        buffers = manifest.get("buffers")
        if not isinstance(buffers, dict):
            raise ValueError("bundle manifest buffers must be a dict")
        for name, spec in buffers.items():
            validate_key_segment(name, "buffer name")
            _validate_spec(spec, bases)


def _validate_spec(spec: Any, bases: Sequence[str]) -> None:
    if not isinstance(spec, dict):
        raise ValueError("bundle payload spec must be a dict")
    key = spec.get("key")
    if not isinstance(key, str) or not any(key.startswith(f"{b}/") for b in bases):
        raise ValueError("bundle payload key is outside the bundle namespace")
    expected = int(spec.get("bytes", -1))
    if expected < 0:
        raise ValueError("bundle payload bytes must be non-negative")
    chunks = spec.get("chunks")
    if not isinstance(chunks, list) or (expected and not chunks):
        raise ValueError("bundle payload chunks are invalid")
    seen: set[str] = set()
    total = 0
    for chunk in chunks:
        if not isinstance(chunk, dict):
            raise ValueError("bundle chunk must be a dict")
        chunk_key, size = chunk.get("key"), int(chunk.get("bytes", -1))
        if not isinstance(chunk_key, str) or (chunk_key != key and not chunk_key.startswith(f"{key}/")):
            raise ValueError("bundle chunk key is outside the payload namespace")
        if chunk_key in seen:
            raise ValueError("bundle chunk keys must be unique")
        if size < 0:
            raise ValueError("bundle chunk bytes must be non-negative")
        seen.add(chunk_key)
        total += size
    if total != expected:
        raise ValueError(f"bundle payload chunks total {total} bytes, expected {expected}")
