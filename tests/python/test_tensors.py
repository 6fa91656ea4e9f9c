"""Tensor helpers with numpy arrays, in dummy and embedded mode (torch: test_tensors_torch.py)."""

import ctypes
import struct

import numpy as np
import pytest

from mooncake_testlib import read_at

from mooncake.store import ReplicateConfig

OK = 0
INVALID_PARAMS = -600

DTYPES = ["float32", "float64", "float16", "int8", "uint8", "int16", "int32", "int64", "uint64", "bool", "complex64", ">i4"]
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


def assert_same(got, expected):
    assert isinstance(got, np.ndarray)
    assert got.dtype == expected.dtype
    assert got.shape == expected.shape
    assert np.array_equal(got, expected)


def header_len(ndim):
    return (40 + 8 * ndim + 63) // 64 * 64


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
    assert got.flags["C_CONTIGUOUS"]


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
    assert store.get_size(keys("t")) == header_len(2) + array.nbytes
    raw = store.get(keys("t"))
    assert raw[:4] == b"MCTN"
    magic, version, framework, ndim, dtype, hlen, _, dlen = struct.unpack_from("<4sBBH16sIIQ", raw)
    assert (version, framework, ndim, hlen, dlen) == (1, 0, 2, 64, 48)
    assert dtype.rstrip(b"\0") == b"<f4"
    assert struct.unpack_from("<2q", raw, 40) == (3, 4)
    assert raw[hlen:] == array.tobytes()


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
    assert got.ctypes.data == ptr + header_len(2)  # a view of the caller's buffer
    assert read_at(ptr, 4) == b"MCTN"
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
    ptr = pool(256)
    ctypes.memset(ptr, 7, 256)
    assert store.put_tensor_from(keys("bad"), ptr, 256) == INVALID_PARAMS
    assert store.upsert_tensor_from(keys("bad"), ptr, 256) == INVALID_PARAMS
    assert store.batch_put_tensor_from([keys("bad")], [ptr], [256]) == [INVALID_PARAMS]
    assert store.is_exist(keys("bad")) == 0
    # A valid header whose size does not match the buffer is also refused.
    assert store.put_tensor(keys("t"), sample((4,), "int32")) == OK
    size = store.get_size(keys("t"))
    assert store.get_into(keys("t"), ptr, 256) == size
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
    """torch.chunk on a numpy array: pieces of ceil(n / parts) along ``dim`` (possibly
    fewer than ``parts`` of them)."""
    length = array.shape[dim]
    step = -(-length // parts)
    return [np.ascontiguousarray(np.take(array, range(i, min(i + step, length)), axis=dim)) for i in range(0, length, step)]


def shard_keys(key, count):
    return [f"{key}_tp_{r}" for r in range(count)]


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("split_dim", [0, 1])
def test_put_tensor_with_tp(store, keys, tp_size, split_dim):
    array = sample((5, 7), "float32")
    key = keys("tp")
    expected = chunk(array, tp_size, split_dim)
    code = store.put_tensor_with_tp(key, array, tp_size=tp_size, split_dim=split_dim)
    if len(expected) < tp_size:
        # e.g. 5 rows in 4 parts: chunks of 2 give 3 shards. Refused, nothing stored.
        assert code == INVALID_PARAMS
        assert store.batch_is_exist([key, *shard_keys(key, tp_size + 1)]) == [0] * (tp_size + 2)
        return
    assert code == OK
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
    assert expected[0].shape[split_dim] == -(-array.shape[split_dim] // tp_size)
    assert store.get_tensor_with_tp(key, tp_rank=tp_size, tp_size=tp_size) is None
    assert np.array_equal(
        np.concatenate([store.get_tensor_with_tp(key, r, tp_size, split_dim) for r in range(tp_size)], axis=split_dim),
        array,
    )


def test_tp_too_few_shards_stores_nothing(store, keys):
    four_cols = np.arange(12, dtype=np.float32).reshape(3, 4)
    # ceil(4 / 3) = 2 columns a shard: only 2 shards for tp_size 3.
    assert store.put_tensor_with_tp(keys("a"), four_cols, tp_size=3, split_dim=1) == INVALID_PARAMS
    assert store.upsert_tensor_with_tp(keys("a"), four_cols, tp_size=3, split_dim=1) == INVALID_PARAMS
    assert store.pub_tensor_with_tp(keys("a"), four_cols, tp_size=3, split_dim=1) == INVALID_PARAMS
    assert store.batch_is_exist([keys("a"), *shard_keys(keys("a"), 3)]) == [0] * 4
    # More parts than elements along the dimension.
    assert store.put_tensor_with_tp(keys("b"), four_cols, tp_size=4, split_dim=0) == INVALID_PARAMS
    assert store.put_tensor_with_tp(keys("b"), np.zeros((0, 4)), tp_size=2) == INVALID_PARAMS
    assert store.put_tensor_with_tp(keys("b"), np.array(1.0), tp_size=2) == INVALID_PARAMS
    assert store.batch_is_exist([keys("b"), *shard_keys(keys("b"), 4)]) == [0] * 5
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
    assert result == [INVALID_PARAMS, OK]  # 4 rows in 3 parts: 2 shards; 3 rows: 3 shards
    assert store.batch_is_exist(shard_keys(rows[0], 3)) == [0] * 3
    assert_same(store.get_tensor_with_tp(rows[1], tp_rank=2, tp_size=3), four_cols[2:])


@pytest.mark.parametrize("split_dim", [2, -3])
def test_tp_split_dim_out_of_range_is_invalid(store, keys, split_dim):
    array = sample((4, 4), "float32")
    assert store.put_tensor_with_tp(keys("a"), array, tp_size=2, split_dim=split_dim) == INVALID_PARAMS
    assert store.upsert_tensor_with_tp(keys("a"), array, tp_size=2, split_dim=split_dim) == INVALID_PARAMS
    assert store.pub_tensor_with_tp(keys("a"), array, tp_size=2, split_dim=split_dim) == INVALID_PARAMS
    names = [keys("b"), keys("c")]
    assert store.batch_put_tensor_with_tp(names, [array, array], tp_size=2, split_dim=split_dim) == [INVALID_PARAMS] * 2
    assert store.batch_is_exist([*shard_keys(keys("a"), 2), *shard_keys(names[0], 2)]) == [0] * 4


def test_tp_split_dim_negative_counts_from_the_end(store, keys):
    array = sample((3, 4), "float32")
    assert store.put_tensor_with_tp(keys("neg"), array, tp_size=2, split_dim=-1) == OK
    assert_same(store.get_tensor_with_tp(keys("neg"), tp_rank=1, tp_size=2), np.ascontiguousarray(array[:, 2:]))


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
    assert got.ctypes.data == ptr + header_len(2)  # a view of the caller's buffer
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
        assert got[0].ctypes.data == ptrs[0] + header_len(2)
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
