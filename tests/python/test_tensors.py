"""Tensor helpers with numpy arrays, in dummy and embedded mode (torch: test_tensors_torch.py).

Reads return torch tensors when torch is installed (as upstream), numpy arrays otherwise;
``assert_same`` compares either with a numpy array.
"""

import ctypes
import json
import struct

import numpy as np
import pytest

from mooncake_testlib import read_at

import mooncake.store as mstore
from mooncake.store import ParallelAxis, ReadTarget, ReplicateConfig, TensorParallelism

OK = 0
INVALID_PARAMS = -600
NOT_SUPPORTED = -1012
FILE_NOT_FOUND = -1100
HEADER = 304  # upstream's sizeof(TensorMetadata)

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "bool", ">i4"]
SHAPES = [(1,), (7,), (3, 4), (2, 3, 5), (4, 1, 2, 1), (0, 3)]


def sample(shape, dtype, offset=0):
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    values = np.arange(offset, offset + count)
    if dtype.kind == "b":
        values = values % 3 == 0
    elif dtype.kind == "c":
        values = values + 1j * (values * 2)
    return values.astype(dtype).reshape(shape)


def as_numpy(got):
    """A read result as a numpy array (torch tensors are converted)."""
    if not isinstance(got, np.ndarray) and hasattr(got, "numpy"):
        return got.numpy()
    return got


def data_ptr(got):
    return got.data_ptr() if hasattr(got, "data_ptr") else got.ctypes.data


def assert_same(got, expected):
    got = as_numpy(got)
    assert isinstance(got, np.ndarray)
    # Stored little-endian: a big-endian array reads back as its little-endian twin.
    expected = np.asarray(expected)
    expected = expected.astype(expected.dtype.newbyteorder("<")) if expected.dtype.byteorder == ">" else expected
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert np.array_equal(got, expected)


def header_len(ndim):
    return HEADER


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_dtypes(store, keys, dtype):
    array = sample((3, 5), dtype)
    assert store.put_tensor(keys("t"), array) == OK
    assert_same(store.get_tensor(keys("t")), array)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_round_trip_shapes(store, keys, shape):
    array = sample(shape, "float32", offset=1)
    assert store.put_tensor(keys("t"), array) == OK
    assert_same(store.get_tensor(keys("t")), array)


def test_round_trip_larger_than_staging(store, keys):
    array = np.random.default_rng(1).standard_normal((5 << 20) // 2).astype(np.float64)  # 20 MiB
    assert store.put_tensor(keys("big"), array) == OK
    assert_same(store.get_tensor(keys("big")), array)


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(12).reshape(3, 4).T,
        lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)),
        lambda: np.arange(40, dtype=np.int16)[::3],
        lambda: np.arange(24, dtype=np.float32).reshape(2, 3, 4)[:, 1:, ::2],
    ],
    ids=["transposed", "fortran", "strided", "sliced"],
)
def test_non_contiguous_input(store, keys, make):
    array = make()
    assert store.put_tensor(keys("t"), array) == OK
    got = store.get_tensor(keys("t"))
    assert_same(got, np.ascontiguousarray(array))
    assert as_numpy(got).flags["C_CONTIGUOUS"]


@pytest.mark.parametrize("dtype", ["float64", "int8", "bool", ">i4"])
def test_round_trip_zero_dim(store, keys, dtype):
    array = np.array(3, dtype=dtype)
    assert store.put_tensor(keys("t"), array) == OK
    got = store.get_tensor(keys("t"))
    assert got.shape == () and got.ndim == 0
    assert_same(got, array)
    assert store.get_size(keys("t")) == header_len(0) + array.nbytes
    # Numpy scalars are 0-d too.
    assert store.upsert_tensor(keys("t"), np.float32(2.5)) == OK
    assert_same(store.get_tensor(keys("t")), np.array(2.5, dtype=np.float32))


def test_object_arrays_are_refused(store, keys):
    array = np.array([object(), "x"], dtype=object)
    assert store.put_tensor(keys("obj"), array) == INVALID_PARAMS
    assert store.upsert_tensor(keys("obj"), array) == INVALID_PARAMS
    assert store.pub_tensor(keys("obj"), array) == INVALID_PARAMS
    assert store.put_tensor(keys("obj"), np.array(None)) == INVALID_PARAMS
    assert store.put_tensor(keys("obj"), np.array([[1, 2], [3, 4]], dtype=object)) == INVALID_PARAMS
    assert store.put_tensor_with_tp(keys("obj"), np.array([1, "a", None, 2.0], dtype=object), tp_size=2) == INVALID_PARAMS
    # Structured dtypes holding objects too.
    assert store.put_tensor(keys("obj"), np.zeros(2, dtype=[("a", "i4"), ("b", "O")])) == INVALID_PARAMS
    # Dtypes upstream's layout has no code for.
    assert store.put_tensor(keys("obj"), np.zeros(2, dtype=np.complex64)) == INVALID_PARAMS
    assert store.put_tensor(keys("obj"), np.zeros(2, dtype=[("a", "i4")])) == INVALID_PARAMS
    assert store.is_exist(keys("obj")) == 0
    assert store.batch_is_exist([keys("obj_tp_0"), keys("obj_tp_1")]) == [0, 0]
    assert store.batch_put_tensor([keys("obj")], [array]) == [INVALID_PARAMS]
    assert store.batch_upsert_tensor([keys("obj")], [array]) == [INVALID_PARAMS]
    assert store.batch_pub_tensor([keys("obj")], [array]) == [INVALID_PARAMS]
    assert store.is_exist(keys("obj")) == 0


def test_batch_with_an_object_array_fails_only_that_entry(store, keys):
    bad = np.array([object(), "x"], dtype=object)
    good = sample((4, 2), "int32")
    names = [keys("fine"), keys("obj")]
    assert store.batch_put_tensor(names, [good, bad]) == [OK, INVALID_PARAMS]
    assert store.batch_is_exist(names) == [1, 0]
    assert_same(store.get_tensor(names[0]), good)
    others = [keys("up"), keys("obj")]
    assert store.batch_upsert_tensor(others, [good, bad]) == [OK, INVALID_PARAMS]
    assert store.batch_pub_tensor([keys("pub"), keys("obj")], [good, bad]) == [OK, INVALID_PARAMS]
    tp = [keys("tp"), keys("obj")]
    assert store.batch_put_tensor_with_tp(tp, [good, np.array([1, None], dtype=object)], tp_size=2) == [OK, INVALID_PARAMS]
    assert store.batch_is_exist([keys("up"), keys("pub"), *shard_keys(keys("tp"), 2), keys("obj")]) == [1, 1, 1, 1, 0]


def test_stored_layout(store, keys):
    array = sample((3, 4), "<f4")
    assert store.put_tensor(keys("t"), array) == OK
    assert store.get_size(keys("t")) == HEADER + array.nbytes
    raw = store.get(keys("t"))
    assert raw[:4] == b"NOOM"
    magic, version, hsize, dtype, ndim, layout, flags, offset, dlen = struct.unpack_from("<IHHiiIIQQ", raw)
    assert (magic, version, hsize, dtype, ndim, layout, flags, offset, dlen) == (0x4D4F4F4E, 1, 304, 0, 2, 0, 0, 304, 48)
    assert struct.unpack_from("<8q", raw, 40) == (3, 4, -1, -1, -1, -1, -1, -1)
    assert struct.unpack_from("<8q", raw, 104) == (3, 4, -1, -1, -1, -1, -1, -1)
    assert raw[168:304] == bytes(136)  # no axes
    assert raw[HEADER:] == array.tobytes()


def test_get_tensor_of_missing_or_non_tensor(store, keys):
    assert store.get_tensor(keys("missing")) is None
    assert store.put(keys("plain"), b"not a tensor at all, just bytes") == OK
    assert store.get_tensor(keys("plain")) is None


def test_get_tensor_result_survives_remove(store, keys):
    array = sample((64, 64), "float32")
    assert store.put_tensor(keys("t"), array) == OK
    got = store.get_tensor(keys("t"))
    assert store.remove(keys("t"), True) == OK
    assert store.put_tensor(keys("t"), array + 1) == OK
    assert_same(got, array)


def test_batch_put_and_get(store, keys):
    names = keys.many(3)
    arrays = [sample((3, 4), "float32"), sample((5,), "int64", 7), sample((2, 2, 2), "uint8", 3)]
    assert store.batch_put_tensor(names, arrays) == [OK, OK, OK]
    got = store.batch_get_tensor(names + [keys("missing")])
    for tensor, array in zip(got, arrays):
        assert_same(tensor, array)
    assert got[3] is None
    assert store.batch_put_tensor(names, arrays[:2]) == [INVALID_PARAMS] * 3
    assert store.batch_put_tensor([], []) == []
    assert store.batch_get_tensor([]) == []


def test_get_tensor_into(store, keys, pool):
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert store.put_tensor(keys("t"), array) == OK
    size = store.get_size(keys("t"))
    ptr = pool(size)
    assert store.register_buffer(ptr, size) == OK
    ctypes.memset(ptr, 0, size)
    got = store.get_tensor_into(keys("t"), ptr, size)
    assert_same(got, array)
    assert data_ptr(got) == ptr + HEADER  # a view of the caller's buffer
    assert read_at(ptr, 4) == b"NOOM"
    assert store.get_tensor_into(keys("t"), ptr, size - 1) is None  # too small
    assert store.get_tensor_into(keys("missing"), ptr, size) is None

    # Mismatched list lengths: -600 for every key (upstream's wrapper check).
    result = store.batch_get_tensor_into([keys("t"), keys("t_missing_arg")], [ptr], [size])
    assert result == [INVALID_PARAMS, INVALID_PARAMS]

    other = pool(2 * size)
    got = store.batch_get_tensor_into([keys("t"), keys("missing")], [other, other + size], [size, size])
    assert_same(got[0], array)
    assert got[1] is None

    # put_tensor_from the buffer get_tensor_into filled (a valid [metadata][data] layout).
    assert store.put_tensor_from(keys("from"), ptr, size) == OK
    assert_same(store.get_tensor(keys("from")), array)
    assert store.batch_put_tensor_from([keys("f1"), keys("f2")], [ptr, other], [size, size]) == [OK, OK]
    assert_same(store.get_tensor(keys("f2")), array)
    assert store.unregister_buffer(ptr) == OK


def test_put_tensor_from_rejects_invalid_layout(store, keys, pool):
    ptr = pool(512)
    ctypes.memset(ptr, 7, 512)
    assert store.put_tensor_from(keys("bad"), ptr, 512) == INVALID_PARAMS
    assert store.upsert_tensor_from(keys("bad"), ptr, 512) == INVALID_PARAMS
    assert store.batch_put_tensor_from([keys("bad")], [ptr], [512]) == [INVALID_PARAMS]
    assert store.is_exist(keys("bad")) == 0
    # A valid header whose size does not match the buffer is also refused.
    assert store.put_tensor(keys("t"), sample((4,), "int32")) == OK
    size = store.get_size(keys("t"))
    assert store.get_into(keys("t"), ptr, 512) == size
    assert store.put_tensor_from(keys("short"), ptr, size - 1) == INVALID_PARAMS
    assert store.put_tensor_from(keys("long"), ptr, size + 1) == INVALID_PARAMS
    assert store.put_tensor_from(keys("ok"), ptr, size) == OK
    assert store.batch_put_tensor_from([keys("a"), keys("b")], [ptr], [size]) == [INVALID_PARAMS] * 2


def test_upsert_tensor(store, keys):
    key = keys("u")
    assert store.put_tensor(key, sample((3, 4), "float32")) == OK
    assert store.put_tensor(key, sample((3, 4), "float32", 100)) == OK  # put keeps the old one
    assert_same(store.get_tensor(key), sample((3, 4), "float32"))
    assert store.upsert_tensor(key, sample((3, 4), "float32", 2)) == OK
    assert_same(store.get_tensor(key), sample((3, 4), "float32", 2))
    assert store.upsert_tensor(key, sample((2, 9), "int64", 5)) == OK  # new shape, dtype and size
    assert_same(store.get_tensor(key), sample((2, 9), "int64", 5))
    names = [key, keys("v")]
    assert store.batch_upsert_tensor(names, [sample((1,), "int8"), sample((2,), "int8")]) == [OK, OK]
    assert_same(store.batch_get_tensor(names)[1], sample((2,), "int8"))


def test_upsert_tensor_from(store, keys, pool):
    assert store.put_tensor(keys("src"), sample((6,), "float64", 9)) == OK
    size = store.get_size(keys("src"))
    ptr = pool(size)
    assert store.get_into(keys("src"), ptr, size) == size
    assert store.put_tensor(keys("dst"), sample((2,), "int8")) == OK
    assert store.upsert_tensor_from(keys("dst"), ptr, size) == OK
    assert_same(store.get_tensor(keys("dst")), sample((6,), "float64", 9))
    assert store.batch_upsert_tensor_from([keys("dst"), keys("new")], [ptr, ptr], [size, size]) == [OK, OK]
    assert_same(store.get_tensor(keys("new")), sample((6,), "float64", 9))


def test_pub_tensor(store, keys):
    key = keys("pub")
    assert store.pub_tensor(key, sample((3, 4), "float32", 3)) == OK
    assert_same(store.get_tensor(key), sample((3, 4), "float32", 3))
    # A put, as upstream: publishing to an existing key keeps the first value.
    assert store.pub_tensor(key, sample((3, 4), "float32", 4)) == OK
    assert_same(store.get_tensor(key), sample((3, 4), "float32", 3))
    assert store.pub_tensor(key, sample((7,), "int64")) == OK
    assert_same(store.get_tensor(key), sample((3, 4), "float32", 3))
    config = ReplicateConfig()
    config.preferred_segment = store.get_hostname()
    assert store.pub_tensor(keys("cfg"), sample((2,), "int8"), config) == OK
    assert_same(store.get_tensor(keys("cfg")), sample((2,), "int8"))


def test_pub_tensor_validates_preferred_segments(store, keys):
    config = ReplicateConfig()
    config.replica_num = 1
    config.preferred_segments = [store.get_hostname(), "other:1"]
    array = sample((4,), "float32")
    assert store.pub_tensor(keys("a"), array, config) == INVALID_PARAMS
    assert store.batch_pub_tensor([keys("b")], [array], config) == [INVALID_PARAMS]
    assert store.pub_tensor_with_tp(keys("c"), array, tp_size=2, config=config) == INVALID_PARAMS
    assert store.batch_pub_tensor_with_tp([keys("d")], [array], tp_size=2, config=config) == [INVALID_PARAMS]
    assert store.batch_is_exist([keys("a"), keys("b"), keys("c_tp_0"), keys("d_tp_0")]) == [0] * 4


def test_batch_pub_tensor(store, keys):
    names = keys.many(3)
    assert store.put_tensor(names[1], sample((2,), "int16", 50)) == OK
    arrays = [sample((3, 4), "float32"), sample((5,), "int64", 7), sample((2, 2), "uint8", 3)]
    assert store.batch_pub_tensor(names, arrays) == [OK, OK, OK]
    got = store.batch_get_tensor(names)
    assert_same(got[0], arrays[0])
    assert_same(got[1], sample((2,), "int16", 50))  # kept
    assert_same(got[2], arrays[2])
    assert store.batch_pub_tensor(names, arrays[:2]) == [INVALID_PARAMS] * 3
    assert store.batch_pub_tensor(keys=[keys("kw")], tensors_list=[arrays[0]], config=ReplicateConfig()) == [OK]
    assert_same(store.get_tensor(keys("kw")), arrays[0])
    assert store.batch_pub_tensor([], []) == []


def chunk(array, parts, dim):
    """Equal shards of ``array`` along ``dim`` (upstream only splits evenly)."""
    return [np.ascontiguousarray(a) for a in np.split(array, parts, axis=dim)]


def shard_keys(key, count):
    return [f"{key}_tp_{r}" for r in range(count)]


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("split_dim", [0, 1])
def test_put_tensor_with_tp(store, keys, tp_size, split_dim):
    array = sample((6, 12), "float32")
    key = keys("tp")
    code = store.put_tensor_with_tp(key, array, tp_size=tp_size, split_dim=split_dim)
    if array.shape[split_dim] % tp_size:
        # e.g. 6 rows in 4 parts: upstream only splits evenly. Refused, nothing stored.
        assert code == INVALID_PARAMS
        assert store.batch_is_exist([key, *shard_keys(key, tp_size + 1)]) == [0] * (tp_size + 2)
        return
    assert code == OK
    expected = chunk(array, tp_size, split_dim)
    if tp_size == 1:
        # The plain key, no suffix.
        assert store.batch_is_exist([key, f"{key}_tp_0"]) == [1, 0]
        assert_same(store.get_tensor(key), array)
        assert_same(store.get_tensor_with_tp(key), array)
        assert_same(store.get_tensor_with_tp(key, tp_rank=0, tp_size=1, split_dim=split_dim), array)
        return
    assert store.batch_is_exist(shard_keys(key, tp_size)) == [1] * tp_size
    assert store.batch_is_exist([key, f"{key}_tp_{tp_size}"]) == [0, 0]
    for rank in range(tp_size):
        shard = store.get_tensor_with_tp(key, tp_rank=rank, tp_size=tp_size, split_dim=split_dim)
        assert_same(shard, expected[rank])
        assert_same(store.get_tensor(f"{key}_tp_{rank}"), expected[rank])
    assert expected[0].shape[split_dim] == array.shape[split_dim] // tp_size
    assert store.get_tensor_with_tp(key, tp_rank=tp_size, tp_size=tp_size) is None
    assert np.array_equal(
        np.concatenate([store.get_tensor_with_tp(key, r, tp_size, split_dim) for r in range(tp_size)], axis=split_dim),
        array,
    )


def test_tp_uneven_split_stores_nothing(store, keys):
    four_cols = np.arange(12, dtype=np.float32).reshape(3, 4)
    # 4 columns do not split evenly in 3 (upstream: "only uniform sharding is supported").
    assert store.put_tensor_with_tp(keys("a"), four_cols, tp_size=3, split_dim=1) == INVALID_PARAMS
    assert store.upsert_tensor_with_tp(keys("a"), four_cols, tp_size=3, split_dim=1) == INVALID_PARAMS
    assert store.pub_tensor_with_tp(keys("a"), four_cols, tp_size=3, split_dim=1) == INVALID_PARAMS
    assert store.batch_is_exist([keys("a"), *shard_keys(keys("a"), 3)]) == [0] * 4
    # More parts than elements along the dimension.
    assert store.put_tensor_with_tp(keys("b"), four_cols, tp_size=4, split_dim=0) == INVALID_PARAMS
    assert store.put_tensor_with_tp(keys("b"), np.array(1.0), tp_size=2) == INVALID_PARAMS
    assert store.batch_is_exist([keys("b"), *shard_keys(keys("b"), 4)]) == [0] * 5
    # An empty dimension splits evenly: empty shards.
    assert store.put_tensor_with_tp(keys("e"), np.zeros((0, 4)), tp_size=2) == OK
    assert_same(store.get_tensor_with_tp(keys("e"), 1, 2), np.zeros((0, 4)))
    # 0-d and empty tensors are fine with tp_size 1 (stored whole, under the plain key).
    assert store.put_tensor_with_tp(keys("c"), np.array(1.5), tp_size=1) == OK
    assert_same(store.get_tensor_with_tp(keys("c")), np.array(1.5))
    # In a batch only the tensor that cannot be split fails.
    names = [keys("ok"), keys("bad"), keys("ok2")]
    result = store.batch_put_tensor_with_tp(names, [four_cols.T.copy(), four_cols, sample((6, 3), "int8")], tp_size=3, split_dim=1)
    assert result == [OK, INVALID_PARAMS, OK]  # 3 columns split into 3; 4 columns do not
    assert store.batch_is_exist(shard_keys(names[1], 3)) == [0] * 3
    assert store.batch_is_exist(shard_keys(names[0], 3) + shard_keys(names[2], 3)) == [1] * 6
    assert_same(store.get_tensor_with_tp(names[0], tp_rank=2, tp_size=3), np.ascontiguousarray(four_cols.T[:, 2:]))
    rows = [keys("rows4"), keys("rows3")]
    result = store.batch_put_tensor_with_tp(rows, [four_cols.T.copy(), four_cols], tp_size=3, split_dim=0)
    assert result == [INVALID_PARAMS, OK]  # 4 rows do not split in 3; 3 rows do
    assert store.batch_is_exist(shard_keys(rows[0], 3)) == [0] * 3
    assert_same(store.get_tensor_with_tp(rows[1], tp_rank=2, tp_size=3), four_cols[2:])


@pytest.mark.parametrize("split_dim", [2, -1, -3])
def test_tp_split_dim_out_of_range_is_invalid(store, keys, split_dim):
    array = sample((4, 4), "float32")
    assert store.put_tensor_with_tp(keys("a"), array, tp_size=2, split_dim=split_dim) == INVALID_PARAMS
    assert store.upsert_tensor_with_tp(keys("a"), array, tp_size=2, split_dim=split_dim) == INVALID_PARAMS
    assert store.pub_tensor_with_tp(keys("a"), array, tp_size=2, split_dim=split_dim) == INVALID_PARAMS
    names = [keys("b"), keys("c")]
    assert store.batch_put_tensor_with_tp(names, [array, array], tp_size=2, split_dim=split_dim) == [INVALID_PARAMS] * 2
    assert store.batch_is_exist([*shard_keys(keys("a"), 2), *shard_keys(names[0], 2)]) == [0] * 4


def test_tp_size_one_uses_the_plain_key(store, keys):
    array = sample((4, 6), "int32")
    assert store.put_tensor_with_tp(keys("one"), array, tp_size=1, split_dim=1) == OK
    assert store.batch_is_exist([keys("one"), keys("one_tp_0")]) == [1, 0]
    assert_same(store.get_tensor(keys("one")), array)
    # And the other way round: a tensor stored with put_tensor reads as tp_size 1.
    assert store.put_tensor(keys("plain"), array + 1) == OK
    assert_same(store.get_tensor_with_tp(keys("plain"), tp_rank=0, tp_size=1), array + 1)
    assert_same(store.batch_get_tensor_with_tp([keys("plain"), keys("one")], tp_size=1)[0], array + 1)
    assert store.upsert_tensor_with_tp(keys("one"), array - 1, tp_size=1) == OK
    assert_same(store.get_tensor(keys("one")), array - 1)
    assert store.batch_put_tensor_with_tp([keys("b1")], [array], tp_size=1) == [OK]
    assert store.batch_is_exist([keys("b1"), keys("b1_tp_0")]) == [1, 0]


def test_upstream_tp_example(store, keys):
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert store.put_tensor_with_tp(keys("tp"), array, tp_size=2, split_dim=1) == OK
    for rank in range(2):
        got = store.get_tensor_with_tp(keys("tp"), tp_rank=rank, tp_size=2)
        assert_same(got, np.ascontiguousarray(array[:, 2 * rank : 2 * rank + 2]))
    assert store.batch_put_tensor_with_tp([keys("batch_tp")], [array], tp_size=2, split_dim=1) == [OK]
    assert_same(
        store.get_tensor_with_tp(keys("batch_tp"), tp_rank=1, tp_size=2),
        np.ascontiguousarray(array[:, 2:]),
    )


def test_batch_tp_and_upsert_tp(store, keys):
    names = [keys("a"), keys("b")]
    arrays = [sample((4, 6), "int32"), sample((6, 2), "float64", 1)]
    assert store.batch_put_tensor_with_tp(names, arrays, tp_size=2, split_dim=0) == [OK, OK]
    rank1 = store.batch_get_tensor_with_tp(names + [keys("missing")], tp_rank=1, tp_size=2)
    assert_same(rank1[0], arrays[0][2:])
    assert_same(rank1[1], arrays[1][3:])
    assert rank1[2] is None
    assert store.batch_put_tensor_with_tp(names, arrays[:1], tp_size=2) == [INVALID_PARAMS] * 2
    assert store.put_tensor_with_tp(keys("zero"), arrays[0], tp_size=0) == INVALID_PARAMS

    assert store.upsert_tensor_with_tp(names[0], arrays[0] + 100, tp_size=2, split_dim=1) == OK
    assert_same(store.get_tensor_with_tp(names[0], tp_rank=0, tp_size=2), np.ascontiguousarray((arrays[0] + 100)[:, :3]))
    assert store.batch_upsert_tensor_with_tp(names, [arrays[0] - 1, arrays[1] - 1], tp_size=2, split_dim=0) == [OK, OK]
    assert_same(store.get_tensor_with_tp(names[1], tp_rank=0, tp_size=2), arrays[1][:3] - 1)


def test_pub_tensor_with_tp(store, keys):
    array = sample((6, 4), "float32")
    key = keys("pub")
    assert store.pub_tensor_with_tp(key, array, tp_size=2, split_dim=1) == OK
    for rank in range(2):
        assert_same(store.get_tensor_with_tp(key, tp_rank=rank, tp_size=2), chunk(array, 2, 1)[rank])
    # A put: publishing again keeps the existing shards.
    assert store.pub_tensor_with_tp(key, array + 1, tp_size=2, split_dim=1) == OK
    assert_same(store.get_tensor_with_tp(key, tp_rank=1, tp_size=2), chunk(array, 2, 1)[1])
    assert store.pub_tensor_with_tp(keys("one"), array, tp_size=1) == OK
    assert store.batch_is_exist([keys("one"), keys("one_tp_0")]) == [1, 0]
    assert store.pub_tensor_with_tp(keys("bad"), array, tp_size=0) == INVALID_PARAMS

    names = [keys("b0"), keys("b1")]
    arrays = [sample((6, 2), "int16"), sample((3, 3), "uint8", 5)]
    assert store.batch_pub_tensor_with_tp(names, arrays, tp_size=3, split_dim=0) == [OK, OK]
    for name, source in zip(names, arrays):
        for rank, expected in enumerate(chunk(source, 3, 0)):
            assert_same(store.get_tensor_with_tp(name, tp_rank=rank, tp_size=3), expected)
    again = store.batch_pub_tensor_with_tp(base_keys=names, tensors_list=[a + 1 for a in arrays], tp_size=3, split_dim=0)
    assert again == [OK, OK]
    assert_same(store.get_tensor_with_tp(names[0], tp_rank=2, tp_size=3), arrays[0][4:])
    assert store.batch_pub_tensor_with_tp(names, arrays[:1], tp_size=3) == [INVALID_PARAMS] * 2
    assert store.batch_pub_tensor_with_tp([keys("few")], [sample((2, 2), "int8")], tp_size=3) == [INVALID_PARAMS]
    assert store.batch_is_exist(shard_keys(keys("few"), 3)) == [0] * 3


def test_pub_tensor_with_tp_upstream_positional_order(store, keys):
    array = sample((4, 6), "float32")
    config = ReplicateConfig()
    assert store.pub_tensor_with_tp(keys("a"), array, config, 0, 2, 1) == OK
    assert_same(store.get_tensor_with_tp(keys("a"), 1, 2, 1), chunk(array, 2, 1)[1])
    assert store.batch_pub_tensor_with_tp([keys("b")], [array], config, 0, 2, 0) == [OK]
    assert_same(store.get_tensor_with_tp(keys("b"), 1, 2), chunk(array, 2, 0)[1])


def test_get_tensor_with_tp_into(store, keys, pool):
    array = sample((4, 6), "float64", 2)
    key = keys("tp")
    assert store.put_tensor_with_tp(key, array, tp_size=2, split_dim=1) == OK
    shards = chunk(array, 2, 1)
    size = store.get_size(f"{key}_tp_1")
    assert size == header_len(2) + shards[1].nbytes
    ptr = pool(2 * size)
    ctypes.memset(ptr, 0, 2 * size)
    got = store.get_tensor_with_tp_into(key, ptr, size, tp_rank=1, tp_size=2, split_dim=1)
    assert_same(got, shards[1])
    assert data_ptr(got) == ptr + HEADER  # a view of the caller's buffer
    got0 = store.get_tensor_with_tp_into(key, ptr + size, size, tp_rank=0, tp_size=2)
    assert_same(got0, shards[0])
    assert_same(got, shards[1])  # the other shard did not overwrite it
    assert store.get_tensor_with_tp_into(key, ptr, size - 1, tp_rank=1, tp_size=2) is None  # too small
    assert store.get_tensor_with_tp_into(key, ptr, size, tp_rank=2, tp_size=2) is None  # no such shard
    assert store.get_tensor_with_tp_into(keys("missing"), ptr, size, tp_rank=0, tp_size=2) is None
    assert store.get_tensor_with_tp_into(key, 0xDEADBEEF000, size, tp_rank=0, tp_size=2) is None  # not our memory

    # tp_size 1 reads the plain key.
    assert store.put_tensor_with_tp(keys("whole"), shards[0], tp_size=1) == OK
    assert_same(store.get_tensor_with_tp_into(keys("whole"), ptr, 2 * size), shards[0])

    # Registered ordinary memory.
    out = np.zeros(4096, dtype=np.uint8)
    assert store.register_buffer(out.ctypes.data, out.nbytes) == OK
    try:
        assert_same(store.get_tensor_with_tp_into(key, out.ctypes.data, out.nbytes, tp_rank=1, tp_size=2), shards[1])
    finally:
        assert store.unregister_buffer(out.ctypes.data) == OK


def test_batch_get_tensor_with_tp_into(store, keys, pool):
    names = [keys("a"), keys("b")]
    arrays = [sample((6, 4), "int32"), sample((3, 5), "float32", 9)]
    assert store.batch_put_tensor_with_tp(names, arrays, tp_size=3, split_dim=0) == [OK, OK]
    slot = 4096
    base = pool(3 * slot)
    ptrs = [base, base + slot, base + 2 * slot]
    for rank in range(3):
        got = store.batch_get_tensor_with_tp_into(names + [keys("missing")], ptrs, [slot] * 3, tp_rank=rank, tp_size=3)
        assert len(got) == 3
        assert_same(got[0], chunk(arrays[0], 3, 0)[rank])
        assert_same(got[1], chunk(arrays[1], 3, 0)[rank])
        assert got[2] is None
        assert data_ptr(got[0]) == ptrs[0] + HEADER
    assert store.batch_get_tensor_with_tp_into(
        base_keys=names, buffer_ptrs=ptrs[:2], sizes=[slot, 8], tp_rank=0, tp_size=3, split_dim=0
    )[1] is None  # too small
    # Mismatched list lengths: -600 for every key.
    assert store.batch_get_tensor_with_tp_into(names, ptrs[:1], [slot], tp_rank=0, tp_size=3) == [INVALID_PARAMS] * 2
    assert store.batch_get_tensor_with_tp_into([], [], [], tp_size=3) == []
    # tp_size 1: the plain keys.
    assert store.batch_put_tensor(names, arrays) == [OK, OK]
    whole = store.batch_get_tensor_with_tp_into(names, ptrs[:2], [slot, slot])
    assert_same(whole[0], arrays[0])
    assert_same(whole[1], arrays[1])


def test_parallelism_wrappers(store, keys, pool):
    t = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert store.put_tensor_with_parallelism(keys("p"), t) == OK
    assert_same(store.get_tensor(keys("p")), t)
    names = [keys("p1"), keys("p2")]
    assert store.batch_put_tensor_with_parallelism(names, [t + 4, t + 5]) == [OK, OK]
    got = store.batch_get_tensor(names)
    assert_same(got[0], t + 4)
    assert_same(got[1], t + 5)

    assert store.put_tensor(keys("src"), t) == OK
    size = store.get_size(keys("src"))
    ptr = pool(size)
    assert store.register_buffer(ptr, size) == OK
    assert store.get_into(keys("src"), ptr, size) == size
    assert store.put_tensor_with_parallelism_from(keys("from"), ptr, size) == OK
    assert_same(store.get_tensor(keys("from")), t)
    assert store.upsert_tensor_with_parallelism(keys("from"), t + 6) == OK
    assert_same(store.get_tensor(keys("from")), t + 6)
    assert store.batch_upsert_tensor_with_parallelism_from([keys("from")], [ptr], [size]) == [OK]
    assert_same(store.get_tensor(keys("from")), t)
    assert store.unregister_buffer(ptr) == OK


# Objects written by upstream's wheel (mooncake-transfer-engine 0.3.13: put_tensor,
# put_tensor_with_tp, put_tensor_with_parallelism), read back with get(), as hex.
UPSTREAM_OBJECTS = {
    "full_f32_4x12": (
        "4e4f4f4d01003001000000000200000000000000000000003001000000000000c0000000000000000400000000000000"
        "0c00000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff04000000000000000c00000000000000ffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000000000000000000000803f0000004000004040000080400000a0400000c0400000e040"
        "000000410000104100002041000030410000404100005041000060410000704100008041000088410000904100009841"
        "0000a0410000a8410000b0410000b8410000c0410000c8410000d0410000d8410000e0410000e8410000f0410000f841"
        "00000042000004420000084200000c4200001042000014420000184200001c4200002042000024420000284200002c42"
        "00003042000034420000384200003c42"
    ),
    "full_i64_1x2x3": (
        "4e4f4f4d0100300108000000030000000000000000000000300100000000000030000000000000000100000000000000"
        "02000000000000000300000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff010000000000000002000000000000000300000000000000ffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000010000000000000002000000000000000300000000000000"
        "04000000000000000500000000000000"
    ),
    "full_bf16_2": (
        "4e4f4f4d010030010c000000010000000000000000000000300100000000000004000000000000000200000000000000"
        "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff0200000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000000000803f00c0"
    ),
    "full_scalar_i32": (
        "4e4f4f4d010030010600000000000000000000000000000030010000000000000400000000000000ffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "0000000000000000000000000000000007000000"
    ),
    "full_empty_u8_0x3": (
        "4e4f4f4d0100300103000000020000000000000000000000300100000000000000000000000000000000000000000000"
        "0300000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff00000000000000000300000000000000ffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000000000"
    ),
    "tp_1of2_sd1": (
        "4e4f4f4d0100300100000000020000000100000000000000300100000000000060000000000000000400000000000000"
        "0c00000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff04000000000000000600000000000000ffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff010000000000000001000000000000000100000002000000"
        "010000000000000006000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000c0400000e040000000410000104100002041000030410000904100009841"
        "0000a0410000a8410000b0410000b8410000f0410000f84100000042000004420000084200000c420000284200002c42"
        "00003042000034420000384200003c42"
    ),
    "dp_tp_shard": (
        "4e4f4f4d0100300100000000020000000100000000000000300100000000000060000000000000000400000000000000"
        "0c00000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff04000000000000000600000000000000ffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff020000000000000001000000000000000100000002000000"
        "0100000000000000060000000000000000000000010000000100000002000000ffffffff000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000c0400000e040000000410000104100002041000030410000904100009841"
        "0000a0410000a8410000b0410000b8410000f0410000f84100000042000004420000084200000c420000284200002c42"
        "00003042000034420000384200003c42"
    ),
    "dp_tp_manifest": (
        "4e414d570100600000000000020000000100000002000000000000000000000004000000000000000c00000000000000"
        "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
    ),
    "ep_pp_shard": (
        "4e4f4f4d010030010b000000010000000100000000000000300100000000000004000000000000000200000000000000"
        "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff0200000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff020000000000000002000000000000000000000002000000"
        "ffffffff03000000000000000000000003000000010000000100000004000000ffffffff020000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "00000000000000000000000000000000003c003c"
    ),
    "writer_shard": (
        "4e4f4f4d0100300100000000020000000100000000000000300100000000000060000000000000000400000000000000"
        "0c00000000000000ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffff02000000000000000c00000000000000ffffffffffffffffffffffffffffffffffffffffffffffff"
        "ffffffffffffffffffffffffffffffffffffffffffffffff010000000000000001000000000000000100000002000000"
        "000000000000000002000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
        "000000000000000000000000000000000000c0410000c8410000d0410000d8410000e0410000e8410000f0410000f841"
        "00000042000004420000084200000c4200001042000014420000184200001c4200002042000024420000284200002c42"
        "00003042000034420000384200003c42"
    ),
    "writer_manifest": (
        "4e414d570100600000000000020000000000000002000000000000000000000004000000000000000c00000000000000"
        "ffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff"
    ),
}


def upstream(name):
    return bytes.fromhex(UPSTREAM_OBJECTS[name])


def ax(kind, rank, size, split_dim=None, expert_id=None, stage_id=None):
    """A ParallelAxis set up attribute by attribute (upstream's constructor takes none)."""
    axis = ParallelAxis()
    axis.kind, axis.rank, axis.size = kind, rank, size
    axis.split_dim, axis.expert_id, axis.stage_id = split_dim, expert_id, stage_id
    return axis


def par(*axes):
    parallelism = TensorParallelism()
    parallelism.axes = list(axes)
    return parallelism


def target(mode, parallelism=None):
    read = ReadTarget()
    read.mode, read.parallelism = mode, parallelism
    return read


class Writer:
    def __init__(self, rank, size, split_dim):
        self.rank, self.size, self.split_dim = rank, size, split_dim


FULL = np.arange(48, dtype=np.float32).reshape(4, 12)


def test_module_names_match_upstream():
    assert mstore._tensor_metadata_size() == HEADER
    values = {"UNKNOWN": 0, "KVCACHE": 1, "TENSOR": 2, "WEIGHT": 3, "SAMPLE": 4, "ACTIVATION": 5,
              "GRADIENT": 6, "OPTIMIZER_STATE": 7, "METADATA": 8, "GENERAL": 9}  # fmt: skip
    for name, value in values.items():
        member = getattr(mstore.ObjectDataType, name)
        assert int(member) == value and member.name == name
        assert getattr(mstore, name) is member
        assert str(member) == f"ObjectDataType.{name}"
    assert mstore.ObjectDataType(3) is mstore.WEIGHT
    axis = ParallelAxis()
    assert (axis.kind, axis.rank, axis.size, axis.split_dim, axis.expert_id, axis.stage_id) == ("", 0, 1, None, None, None)
    assert TensorParallelism().axes == []
    assert (ReadTarget().mode, ReadTarget().parallelism) == ("as_stored", None)


def test_our_objects_equal_upstreams_byte_for_byte(store, keys):
    """The same calls write exactly the objects upstream's wheel wrote."""
    k = keys("x")
    assert store.put_tensor(k + "f", FULL) == OK
    assert store.get(k + "f") == upstream("full_f32_4x12")
    assert store.put_tensor(k + "i", np.arange(6, dtype=np.int64).reshape(1, 2, 3)) == OK
    assert store.get(k + "i") == upstream("full_i64_1x2x3")
    assert store.put_tensor(k + "s", np.array(7, dtype=np.int32)) == OK
    assert store.get(k + "s") == upstream("full_scalar_i32")
    assert store.put_tensor(k + "e", np.zeros((0, 3), dtype=np.uint8)) == OK
    assert store.get(k + "e") == upstream("full_empty_u8_0x3")
    assert store.put_tensor_with_tp(k + "tp", FULL, tp_size=2, split_dim=1) == OK
    assert store.get(k + "tp_tp_1") == upstream("tp_1of2_sd1")
    assert store.put_tensor_with_parallelism(k + "mx", FULL, parallelism=par(ax("tp", 1, 2, 1), ax("dp", 1, 2))) == OK
    assert store.get(k + "mx__dp_1of2__tp_1of2_sd1") == upstream("dp_tp_shard")
    assert store.get(k + "mx__parallelism_manifest") == upstream("dp_tp_manifest")
    ep_pp = par(ax("ep", 0, 2, expert_id=3), ax("pp", 1, 4, stage_id=2))
    assert store.put_tensor_with_parallelism(k + "ep", np.ones(2, dtype=np.float16), parallelism=ep_pp) == OK
    assert store.get(k + "ep__ep_0of2_eid3__pp_1of4_sid2") == upstream("ep_pp_shard")
    assert store.put_tensor_with_parallelism(k + "w", FULL, writer_partition=Writer(1, 2, 0)) == OK
    assert store.get(k + "w__writer_1of2_sd0") == upstream("writer_shard")
    assert store.get(k + "w__writer_manifest") == upstream("writer_manifest")


def test_upstream_objects_read_back(store, keys):
    k = keys("u")
    for name in UPSTREAM_OBJECTS:
        assert store.put(k + name, upstream(name)) == OK
    assert_same(store.get_tensor(k + "full_f32_4x12"), FULL)
    assert_same(store.get_tensor(k + "full_i64_1x2x3"), np.arange(6, dtype=np.int64).reshape(1, 2, 3))
    assert_same(store.get_tensor(k + "full_scalar_i32"), np.array(7, dtype=np.int32))
    assert_same(store.get_tensor(k + "full_empty_u8_0x3"), np.zeros((0, 3), dtype=np.uint8))
    assert_same(store.get_tensor(k + "tp_1of2_sd1"), FULL[:, 6:])
    assert_same(store.get_tensor(k + "writer_shard"), FULL[2:])
    bf16 = store.get_tensor(k + "full_bf16_2")  # torch.bfloat16, ml_dtypes.bfloat16 or the raw uint16 bits
    bits = as_numpy(bf16.view(__import__("torch").int16)) if hasattr(bf16, "data_ptr") else as_numpy(bf16).view(np.uint16)
    assert bits.astype(np.uint16).tolist() == [0x3F80, 0xC000]  # 1.0, -2.0
    assert store.get_tensor(k + "dp_tp_manifest") is None  # a manifest is no tensor


def test_serialize_and_deserialize():
    meta, ptr, size, owner = mstore._serialize_tensor(FULL)
    assert meta == upstream("full_f32_4x12")[:HEADER]
    assert size == FULL.nbytes and ptr != 0
    assert ctypes.string_at(ptr, size) == FULL.tobytes()
    assert_same(owner, FULL)
    assert_same(mstore._deserialize_tensor(upstream("full_f32_4x12")), FULL)
    assert_same(mstore._deserialize_tensor(upstream("tp_1of2_sd1")), FULL[:, 6:])
    with pytest.raises(ValueError):
        mstore._deserialize_tensor(b"abc")
    with pytest.raises(ValueError):
        mstore._deserialize_tensor(upstream("full_f32_4x12")[:-1])
    with pytest.raises(ValueError):
        mstore._serialize_tensor(np.zeros(2, dtype=np.complex64))


def test_parallelism_shards_and_full_reads(store, keys):
    key = keys("p")
    halves = chunk(FULL, 2, 1)
    for rank in range(2):  # each rank writes its own shard
        assert store.put_tensor_with_parallelism(key, halves[rank], parallelism=par(ax("tp", rank, 2, 1))) == OK
    assert store.batch_is_exist([key, f"{key}_tp_0", f"{key}_tp_1", f"{key}__parallelism_manifest"]) == [0, 1, 1, 1]
    assert_same(store.get_tensor_with_parallelism(key, target("full", par(ax("tp", 0, 2, 1)))), FULL)
    assert_same(store.get_tensor_with_parallelism(key, target("FULL", par(ax("TP", 1, 2, 1)))), FULL)
    assert_same(store.get_tensor_with_parallelism(key, target("shard", par(ax("tp", 1, 2, 1)))), halves[1])
    assert_same(store.get_tensor_with_tp(key, 1, 2, 1), halves[1])
    assert store.get_tensor_with_parallelism(key, target("shard", par(ax("tp", 1, 2, 0)))) is None  # other split_dim
    assert store.get_tensor_with_parallelism(key) is None  # as stored: nothing at the key itself
    assert store.get_tensor_with_parallelism(key, target("as_stored", par(ax("tp", 0, 2, 1)))) is None
    assert store.get_tensor_with_parallelism(key, target("full")) is None  # no writer manifest
    with pytest.raises(ValueError):
        store.get_tensor_with_parallelism(key, target("bogus"))
    # Invalid layouts are refused.
    for bad in (par(), par(ax("tp", 0, 2)), par(ax("tp", 2, 2, 0)), par(ax("dp", 0, 2, split_dim=0)),
                par(ax("ep", 0, 2)), par(ax("pp", 0, 2)), par(ax("xx", 0, 2)), par(ax("tp", 0, 2, 0), ax("tp", 1, 2, 0))):  # fmt: skip
        assert store.put_tensor_with_parallelism(keys("bad"), FULL, parallelism=bad) == INVALID_PARAMS
    assert store.put_tensor_with_parallelism(keys("bad"), FULL, par(ax("tp", 0, 2, 0)), None, Writer(0, 2, 0)) == INVALID_PARAMS
    assert store.put_tensor_with_parallelism(keys("bad"), FULL, writer_partition=Writer(0, 5, 0)) == INVALID_PARAMS  # 4 rows
    # Plain objects read as stored and as full tensors.
    assert store.put_tensor_with_parallelism(keys("plain"), FULL) == OK
    assert_same(store.get_tensor_with_parallelism(keys("plain")), FULL)
    assert_same(store.get_tensor_with_parallelism(keys("plain"), target("full")), FULL)
    # Multi-axis: the full tensor is given, this rank's TP shard is stored.
    layout = par(ax("dp", 1, 2), ax("tp", 0, 2, 1))
    assert store.upsert_tensor_with_parallelism(keys("mx"), FULL, parallelism=layout) == OK
    assert_same(store.get_tensor_with_parallelism(keys("mx"), target("shard", layout)), halves[0])
    assert store.get_tensor_with_parallelism(keys("mx"), target("full", layout)) is None  # rank 1 missing
    # Batches.
    got = store.batch_get_tensor_with_parallelism([keys("plain"), key, keys("missing")],
                                                  [None, target("full", par(ax("tp", 0, 2, 1))), None])  # fmt: skip
    assert_same(got[0], FULL)
    assert_same(got[1], FULL)
    assert got[2] is None
    assert store.batch_get_tensor_with_parallelism([keys("plain")], target("as_stored")) == [None]  # not a list
    assert_same(store.batch_get_tensor_with_parallelism([keys("plain")])[0], FULL)
    names = [keys("b0"), keys("b1")]
    layouts = [par(ax("tp", 0, 2, 0)), par(ax("tp", 1, 2, 0))]
    assert store.batch_put_tensor_with_parallelism(names, [FULL[:2], FULL[2:]], layouts) == [OK, OK]
    assert store.batch_upsert_tensor_with_parallelism(names, [FULL, FULL], writer_partitions=[Writer(0, 2, 0), Writer(1, 2, 0)]) == [OK, OK]
    assert_same(store.get_tensor_with_parallelism(names[0], target("shard", layouts[0])), FULL[:2])
    assert store.batch_put_tensor_with_parallelism(names, [FULL, FULL], layouts[:1]) == [INVALID_PARAMS] * 2


def test_writer_partitions(store, keys):
    key = keys("w")
    for rank in range(3):  # each writer stores its partition of the full tensor
        assert store.put_tensor_with_parallelism(key, FULL, writer_partition=Writer(rank, 3, 1)) == OK
    assert store.batch_is_exist([key, f"{key}__writer_manifest", *[f"{key}__writer_{r}of3_sd1" for r in range(3)]]) == [0, 1, 1, 1, 1]
    assert_same(store.get_tensor_with_parallelism(key, target("full")), FULL)
    assert_same(store.get_tensor_with_parallelism(key, target("shard", par(ax("tp", 2, 3, 1)))), FULL[:, 8:])
    assert_same(store.get_tensor_with_parallelism(key, target("full", par(ax("tp", 0, 3, 1)))), FULL)
    assert store.get_tensor_with_parallelism(key) is None
    assert store.get_tensor_with_tp(key, 0, 3, 1) is None  # writer shards are not <key>_tp_<r>


def test_parallelism_reads_into_buffers(store, keys, pool):
    key = keys("p")
    assert store.put_tensor_with_tp(key, FULL, tp_size=2, split_dim=0) == OK
    assert store.put_tensor(keys("plain"), FULL) == OK
    size = HEADER + FULL.nbytes
    ptr = pool(3 * size)
    got = store.get_tensor_with_parallelism_into(key, ptr, size, target("full", par(ax("tp", 0, 2, 0))))
    assert_same(got, FULL)
    assert data_ptr(got) == ptr + HEADER
    assert ctypes.string_at(ptr, HEADER) == upstream("full_f32_4x12")[:HEADER]  # a FULL header
    assert store.get_tensor_with_parallelism_into(key, ptr, size - 1, target("full", par(ax("tp", 0, 2, 0)))) is None
    shard = store.get_tensor_with_parallelism_into(key, ptr, size, target("shard", par(ax("tp", 1, 2, 0))))
    assert_same(shard, FULL[2:])
    assert_same(store.get_tensor_with_parallelism_into(keys("plain"), ptr, size), FULL)
    got = store.batch_get_tensor_with_parallelism_into([keys("plain"), key, keys("missing")], [ptr, ptr + size, ptr + 2 * size], [size] * 3,
                                                       [None, target("shard", par(ax("tp", 0, 2, 0))), None])  # fmt: skip
    assert_same(got[0], FULL)
    assert_same(got[1], FULL[:2])
    assert got[2] is None
    assert store.batch_get_tensor_with_parallelism_into([key], [ptr, ptr], [size]) == [INVALID_PARAMS]


def test_writes_from_buffers(store, keys, pool):
    assert store.put_tensor(keys("src"), FULL) == OK
    size = store.get_size(keys("src"))
    ptr = pool(size)
    assert store.get_into(keys("src"), ptr, size) == size
    key = keys("tp")
    assert store.put_tensor_with_tp_from(key, ptr, size, tp_rank=0, tp_size=2, split_dim=1) == OK
    assert store.get(f"{key}_tp_1") == upstream("tp_1of2_sd1")
    assert_same(store.get_tensor_with_tp(key, 0, 2, 1), FULL[:, :6])
    assert store.batch_put_tensor_with_tp_from([keys("b")], [ptr], [size], tp_size=4, split_dim=0) == [OK]
    assert_same(store.get_tensor_with_tp(keys("b"), 3, 4), FULL[3:])
    assert store.batch_put_tensor_with_tp_from([keys("c")], [ptr], [size], tp_size=5) == [INVALID_PARAMS]  # 4 rows
    assert store.put_tensor_with_tp_from(keys("one"), ptr, size) == OK  # tp_size 1: the plain key
    assert store.get(keys("one")) == upstream("full_f32_4x12")
    # With a TP layout, the buffer is the full tensor and every rank's shard is stored.
    assert store.upsert_tensor_with_parallelism_from(keys("s"), ptr, size, parallelism=par(ax("tp", 0, 2, 1))) == OK
    assert store.batch_is_exist([keys("s_tp_0"), keys("s_tp_1")]) == [1, 1]
    assert_same(store.get_tensor_with_parallelism(keys("s"), target("full", par(ax("tp", 0, 2, 1)))), FULL)
    assert store.put_tensor_with_parallelism_from(keys("w"), ptr, size, writer_partition=Writer(1, 2, 0)) == OK
    assert store.get(keys("w") + "__writer_1of2_sd0") == upstream("writer_shard")
    names = [keys("f1"), keys("f2")]
    assert store.batch_put_tensor_with_parallelism_from(names, [ptr, ptr], [size, size]) == [OK, OK]
    assert store.get(names[1]) == upstream("full_f32_4x12")
    assert store.batch_upsert_tensor_with_parallelism_from(names, [ptr, ptr], [size, size], [None, par(ax("tp", 0, 2, 0))]) == [OK, OK]
    assert_same(store.get_tensor(names[1] + "_tp_1"), FULL[2:])
    ctypes.memset(ptr, 7, 64)  # no valid header any more
    assert store.put_tensor_with_tp_from(keys("bad"), ptr, size, tp_size=2) == INVALID_PARAMS
    assert store.put_tensor_with_parallelism_from(keys("bad"), ptr, size, par(ax("tp", 0, 2, 0))) == INVALID_PARAMS


def test_upsert_pub_tensor(store, keys):
    assert store.upsert_pub_tensor(keys("a"), FULL) == OK
    assert store.upsert_pub_tensor(keys("a"), FULL + 1, ReplicateConfig()) == OK
    assert_same(store.get_tensor(keys("a")), FULL + 1)
    assert store.batch_upsert_pub_tensor([keys("a"), keys("b")], [FULL, FULL + 2]) == [OK, OK]
    assert_same(store.get_tensor(keys("b")), FULL + 2)
    config = ReplicateConfig()
    config.preferred_segments = ["one:1", "two:2"]  # two segments for one replica
    assert store.upsert_pub_tensor(keys("c"), FULL, config) == INVALID_PARAMS
    assert store.batch_upsert_pub_tensor([keys("c")], [FULL], config) == [INVALID_PARAMS]


def read_safetensors(path):
    """A hand parser of the safetensors format."""
    with open(path, "rb") as f:
        content = f.read()
    (length,) = struct.unpack_from("<Q", content)
    assert length % 8 == 0
    return json.loads(content[8 : 8 + length]), content[8 + length :]


def test_safetensors_export_and_import(store, keys, tmp_path, monkeypatch):
    key = keys("st")
    assert store.put_tensor(key, FULL) == OK
    path = tmp_path / "t.safetensors"
    assert store.save_tensor_to_safetensor(key, str(path)) == OK
    header, data = read_safetensors(path)
    assert header == {key: {"dtype": "F32", "shape": [4, 12], "data_offsets": [0, 192]}}
    assert data == FULL.tobytes()
    assert store.remove(key, True) == OK
    assert_same(store.load_tensor_from_safetensor(key, str(path)), FULL)
    assert_same(store.get_tensor(key), FULL)
    # Another key: the file's first entry, stored under the new key.
    assert_same(store.load_tensor_from_safetensor(key=keys("other"), file_name=str(path)), FULL)
    assert_same(store.get_tensor(keys("other")), FULL)
    # The default file name is the key.
    monkeypatch.chdir(tmp_path)
    assert store.put_tensor(keys("i8"), np.arange(5, dtype=np.int8)) == OK
    assert store.save_tensor_to_safetensor(keys("i8")) == OK
    header, data = read_safetensors(tmp_path / keys("i8"))
    assert header[keys("i8")]["dtype"] == "I8" and data == bytes(range(5))
    assert store.save_tensor_to_safetensor(keys("missing"), str(tmp_path / "m")) == FILE_NOT_FOUND
    assert not (tmp_path / "m").exists()
    assert store.load_tensor_from_safetensor(keys("x"), str(tmp_path / "none.safetensors")) is None
    (tmp_path / "junk").write_bytes(b"\xff" * 20)
    assert store.load_tensor_from_safetensor(keys("x"), str(tmp_path / "junk")) is None
    assert store.is_exist(keys("x")) == 0


def test_cuda_reads_are_refused(store, keys):
    assert store.put_tensor(keys("t"), FULL) == OK
    assert store.get_tensor_into_cuda(keys("t"), np.zeros_like(FULL)) == INVALID_PARAMS  # not a CUDA tensor
    assert store.batch_get_tensor_into_cuda([keys("t"), keys("t")], [FULL, FULL]) == [INVALID_PARAMS] * 2
    assert store.batch_get_tensor_into_cuda([keys("t"), keys("t")], [FULL]) == [INVALID_PARAMS] * 2
    assert store.batch_get_tensor_into_cuda([], []) == []


def test_tensor_writes_leave_the_pool_empty(start_client, connect):
    store = connect(start_client(segment="256MB").address)
    array = sample((1024, 1024), "float32")  # 4 MiB each
    for i in range(40):  # 160 MiB in all: would overflow a 64 MiB pool that leaked
        assert store.put_tensor(f"t{i}", array) == OK
    assert store.batch_put_tensor([f"b{i}" for i in range(10)], [array] * 10) == [OK] * 10
    for i in range(40):
        got = store.get_tensor(f"t{i}")
        assert got is not None and got[1023, 1023] == array[1023, 1023]
        del got
    whole = store.alloc_from_mem_pool(64 << 20)
    assert whole != 0
    (entry,) = store.status()["dummies"]
    assert entry["segments"] == 2, "the pool grew: tensor staging or get_tensor leaked blocks"
    assert store.free_to_mem_pool(whole) == OK
