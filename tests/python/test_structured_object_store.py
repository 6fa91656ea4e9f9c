"""mooncake.structured_object_store: codec inference and codecs (no store), then bundles,
structured objects and DataProto/flat-dict batches in dummy and embedded mode.

numpy and plain Python values are always covered; torch cases skip without torch, and
the msgpack case checks the clear error when msgpack is missing.
"""

import importlib.util
import json

import numpy as np
import pytest

from mooncake.structured_object_store import (
    MISSING,
    FieldSchema,
    MooncakeBundleTransfer,
    StructuredObjectPayload,
    _choose_leaf_codec,
    _escape_key,
    export_dataproto_ref,
    import_dataproto_ref,
    infer_structure,
    is_dataproto_ref_handle,
)
from mooncake._structured import codecs

HAS_MSGPACK = importlib.util.find_spec("msgpack") is not None


# ----- inference and codecs, without a store -----


@pytest.mark.parametrize(
    ("values", "codec"),
    [
        ([[1, 2, 3], [4, 5]], "typed_ragged"),
        ([np.arange(3), np.arange(2.0)], "typed_ragged"),
        ([b"a", bytearray(b"bc"), None], "bytes_ragged"),
        (["x", None, "yz"], "utf8_ragged"),
        ([1, 2.5, True], "ndarray"),
        ([{"a": 1}, {"b": [1, "x", None]}], "json_ragged"),
        ([[b"png", b"jpg"], []], "media_list_ragged"),
    ],
)
def test_choose_leaf_codec_accepts(values, codec):
    decision = _choose_leaf_codec(values)
    assert decision.accepted, decision.reason
    assert decision.codec == codec


@pytest.mark.parametrize("values", [[], [None, MISSING], [object()], [np.array(["a"], dtype=object)]])
def test_choose_leaf_codec_refuses(values):
    assert not _choose_leaf_codec(values).accepted


def test_infer_structure_paths_and_masks():
    leaves, nodes = [], []
    infer_structure("r", [{"a.b": [{"k": 1}]}, None, {"c": "x"}], leaves, nodes)
    assert [n.node_type for n in nodes] == ["dict", "list", "dict"]
    assert nodes[0].row_mask == [True, False, True]
    assert sorted(leaf.path for leaf in leaves) == ["r.a\\.b[0].k", "r.c"]
    c_leaf = next(leaf for leaf in leaves if leaf.path == "r.c")
    assert c_leaf.values[0] is MISSING and c_leaf.values[1] is None and c_leaf.values[2] == "x"
    assert _escape_key("a[b.c\\") == "a\\[b\\.c\\\\"
    with pytest.raises(ValueError):
        deep = 1
        for _ in range(40):
            deep = {"a": deep}
        infer_structure("r", [deep], [], [])


ROUND_TRIPS = [
    ["a", None, "héllo", ""],
    [b"\x00\x01", None, b""],
    [1, None, 3],
    [[1, 2], None, [3]],
    [{"x": 1, "y": [True, None]}, None, {"z": "s"}],
    [np.arange(6, dtype=np.float32).reshape(2, 3), None, np.zeros((0, 3), np.float32)],
]


@pytest.mark.parametrize("values", ROUND_TRIPS, ids=[str(i) for i in range(len(ROUND_TRIPS))])
def test_codec_round_trip(values):
    encoded = codecs.encode_inferred("f", values)
    decoded = codecs.decode_column({"codec": encoded.codec, "metadata": encoded.metadata}, encoded.payload, len(values))
    json.dumps(encoded.metadata)  # metadata travels in JSON handles
    for got, want in zip(decoded, values):
        if isinstance(want, np.ndarray):
            np.testing.assert_array_equal(got, want)
        else:
            assert got == want


def test_recursive_round_trip_keeps_missing_and_none():
    values = [
        {"ids": np.arange(3), "blob": b"ab", "tags": ["t"]},
        None,
        {"ids": np.arange(1), "blob": None},
        {},
    ]
    encoded = codecs.encode_inferred("f", values)
    assert encoded.codec == "structured_recursive"
    decoded = codecs.decode_column({"codec": encoded.codec, "metadata": encoded.metadata}, encoded.payload, 4)
    assert decoded[1] is None and decoded[3] == {}
    assert decoded[2]["blob"] is None and "tags" not in decoded[2]
    np.testing.assert_array_equal(decoded[0]["ids"], np.arange(3))
    assert decoded[0]["blob"] == b"ab" and decoded[0]["tags"] == ["t"]


def test_msgpack_only_rows():
    values = [{1: "int key"}, {2: b"bytes"}]
    if HAS_MSGPACK:
        encoded = codecs.encode_inferred("f", values)
        assert encoded.codec == "msgpack_ragged"
        assert codecs.decode_column({"codec": "msgpack_ragged"}, encoded.payload, 2) == values
    else:
        assert "msgpack" in _choose_leaf_codec(values).reason
        with pytest.raises(ValueError, match="msgpack"):
            codecs.encode_inferred("f", values)


# ----- with a store -----


@pytest.fixture
def transfer(store, keys):
    return MooncakeBundleTransfer(store, key_prefix=keys("bundle"))


def test_bundle_layout_chunks_and_remove(store, transfer):
    ref = transfer.put_bundle(b"meta!", {"a": b"x" * 10, "b": np.arange(4, dtype=np.uint8), "e": b""}, chunk_bytes=4)
    manifest = ref.manifest
    base = f"{transfer.key_prefix}/{manifest['object_id']}"
    assert ref.manifest_key == f"{base}/manifest"
    assert manifest["object_id"].startswith("default/")
    assert [c["key"] for c in manifest["buffers"]["a"]["chunks"]] == [f"{base}/buffer/a/chunk/{i}" for i in range(3)]
    assert manifest["buffers"]["b"]["chunks"] == [{"key": f"{base}/buffer/b", "bytes": 4}]
    assert manifest["buffers"]["e"] == {"key": f"{base}/buffer/e", "bytes": 0, "chunks": []}
    assert json.loads(store.get(ref.manifest_key)) == manifest
    assert store.get(f"{base}/buffer/a/chunk/2") == b"xx"
    transfer.remove_bundle(ref)
    assert store.is_exist(ref.manifest_key) == 0
    assert store.is_exist(f"{base}/buffer/a/chunk/0") == 0
    transfer.remove_bundle({"manifest_key": ref.manifest_key})  # already gone: no error


def test_put_object_and_get_object(transfer):
    arrays = {"w": np.arange(12, dtype=np.float64).reshape(3, 4), "raw": b"bytes", "s": np.array(7, np.int16)}
    ref = transfer.put_object(arrays, chunk_bytes=16)
    got = transfer.get_object({"manifest_key": ref.manifest_key})
    np.testing.assert_array_equal(got["w"], arrays["w"])
    assert got["w"].flags.writeable
    assert got["raw"] == b"bytes"
    assert got["s"].shape == () and got["s"] == 7
    single = transfer.put_object(np.arange(5, dtype=np.int32))
    np.testing.assert_array_equal(transfer.get_object(single), np.arange(5, dtype=np.int32))
    with pytest.raises(ValueError):
        transfer.put_object({"bad/name": b"x"})


def test_read_spec_select_slice_and_destination(transfer):
    data = np.arange(40, dtype=np.int32).reshape(10, 4)
    ref = transfer.put_structured_object(StructuredObjectPayload({"tag": "t"}, {"x": data, "y": b"zz"}), chunk_bytes=24)
    spec = transfer.read_spec(ref).select_members(["x"]).slice_member("x", axis=0, start=1, end=9, step=3)
    result = transfer.materialize(spec)
    assert result.metadata["tag"] == "t" and list(result.objects) == ["x"]
    np.testing.assert_array_equal(result.objects["x"], data[1:9:3])
    out = np.empty_like(data)
    transfer.materialize_into(transfer.read_spec(ref).select_members(["x"]), {"x": out})
    np.testing.assert_array_equal(out, data)
    with pytest.raises(ValueError):
        transfer.materialize_into(transfer.read_spec(ref).select_members(["x"]), {"x": np.empty(3)})
    with pytest.raises(KeyError):
        transfer.materialize(transfer.read_spec(ref).select_members(["nope"]))


def test_flat_dict_round_trip_and_rows(store, transfer):
    data = {
        "ids": np.arange(4, dtype=np.int64),
        "text": ["a", None, "c", "d"],
        "score": [1.5, 2.0, None, 4.0],
        "tokens": [[1, 2], [3], [], [4, 5, 6]],
        "info": [{"k": 1}, None, {"k": [2]}, {}],
        "blobs": [b"x", b"", None, b"zz"],
        "arrays": [np.ones(2), np.zeros(3), None, np.arange(1.0)],
        "lr": 0.5,
        "name": "run",
    }
    ref = transfer.put(data, type="dict")
    assert ref.batch_size == 4 and ref.meta_info == {"lr": 0.5, "name": "run"}
    assert ref.encoded_non_tensor["text"]["codec"] == "utf8_ragged"
    assert ref.encoded_non_tensor["info"]["codec"] == "json_ragged"
    got = transfer.get(ref, type="dict")
    assert set(got) == set(data)
    np.testing.assert_array_equal(got["ids"], data["ids"])
    for name in ("text", "score", "tokens", "info", "blobs"):
        assert got[name] == data[name], name
    assert got["arrays"][2] is None
    np.testing.assert_array_equal(got["arrays"][1], np.zeros(3))
    sliced = transfer.get(ref, type="dict", rows=slice(1, 4, 2), fields=["ids", "text"])
    np.testing.assert_array_equal(sliced["ids"], [1, 3])
    assert sliced["text"] == [None, "d"]
    picked = transfer.get(ref, type="dict", rows=[3, 0], fields=["tokens", "ids"])
    assert picked["tokens"] == [[4, 5, 6], [1, 2]]
    np.testing.assert_array_equal(picked["ids"], [3, 0])
    transfer.cleanup_dataproto(ref)
    assert all(store.is_exist(r.manifest_key) == 0 for r in ref.stage_refs.values())


def test_dataproto_schema_append_and_handles(transfer):
    batch = {"obs": np.random.default_rng(0).random((3, 2)).astype(np.float32)}
    non_tensor = {"uid": np.array(["a", "b", "c"], dtype=object), "n": [1, 2, 3]}
    ref = transfer.put_dataproto(
        {"batch": batch, "non_tensor_batch": non_tensor, "meta_info": {"step": 1}},
        field_schemas={"n": FieldSchema("typed_ragged", metadata={"dtype": "int32"})},
    )
    handle = export_dataproto_ref(ref)
    assert is_dataproto_ref_handle(handle)
    json.dumps(handle)
    ref2 = transfer.append_dataproto_fields(
        import_dataproto_ref(handle), {"non_tensor_batch": {"extra": np.array([{"a": 1}, None, {"b": 2}], dtype=object)}},
        stage="default",
    )
    got = transfer.get_dataproto(ref2)
    np.testing.assert_array_equal(got["batch"]["obs"], batch["obs"])
    assert list(got["non_tensor_batch"]["uid"]) == ["a", "b", "c"]
    assert got["non_tensor_batch"]["n"].tolist() == [1, 2, 3]
    assert list(got["non_tensor_batch"]["extra"]) == [{"a": 1}, None, {"b": 2}]
    assert got["meta_info"] == {"step": 1}
    view = transfer.dataproto_manifest_view(ref2)
    assert view["batch_fields"]["obs"]["spec"]["encoding"] == "ndarray"
    assert view["non_tensor_fields"]["extra"]["spec"]["codec"] == "json_ragged"
    with pytest.raises(ValueError, match="already exist"):
        transfer.append_dataproto_fields(ref2, {"non_tensor_batch": {"uid": ["x", "y", "z"]}}, stage="default")
    transfer.cleanup_dataproto(ref2)


def test_torch_members_and_ragged_tensors(transfer):
    torch = pytest.importorskip("torch")
    t = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    ref = transfer.put_object({"t": t, "half": torch.ones(2, dtype=torch.float16)})
    got = transfer.get_object(ref)
    assert torch.equal(got["t"], t) and got["half"].dtype == torch.float16
    sliced = transfer.materialize(transfer.read_spec(ref).select_members(["t"]).slice_member("t", 0, 1, 3))
    assert torch.equal(sliced.objects["t"], t[1:3])
    rows = [torch.arange(3), None, torch.arange(2)]
    nested = [{"a": torch.ones(2)}, None, {"a": torch.zeros(1)}]
    dref = transfer.put({"x": t[:3], "ragged": rows, "nested": nested}, type="dict")
    assert dref.encoded_non_tensor["ragged"]["codec"] == "ragged_tensor"
    assert dref.encoded_non_tensor["nested"]["codec"] == "structured_recursive"
    back = transfer.get(dref, type="dict")
    assert torch.equal(back["x"], t[:3])
    assert torch.equal(back["ragged"][0], rows[0]) and back["ragged"][1] is None
    assert torch.equal(back["nested"][2]["a"], torch.zeros(1)) and back["nested"][1] is None
    transfer.cleanup_dataproto(dref)
