"""Tensor helpers with numpy arrays, in dummy and embedded mode (torch: test_tensors_torch.py)."""

import ctypes
import struct

import numpy as np
import pytest

from mooncake_testlib import read_at

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


@pytest.mark.xfail(strict=True, reason="0-d arrays come back with shape (1,): _as_array uses np.ascontiguousarray")
def test_round_trip_zero_dim(store, keys):
    array = np.array(3.5)
    assert store.put_tensor(keys("t"), array) == OK
    assert_same(store.get_tensor(keys("t")), array)


@pytest.mark.xfail(
    strict=True,
    reason="put_tensor of an object array succeeds and stores raw PyObject pointers; "
    "get_tensor then raises ValueError. It should be refused at put time",
)
def test_object_arrays_are_refused(store, keys):
    array = np.array([object(), "x"], dtype=object)
    try:
        result = store.put_tensor(keys("obj"), array)
    except (TypeError, ValueError):
        return
    assert result < 0


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
    assert store.pub_tensor(key, sample((3, 4), "float32", 4)) == OK
    assert_same(store.get_tensor(key), sample((3, 4), "float32", 4))


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("split_dim", [0, 1])
def test_put_tensor_with_tp(store, keys, tp_size, split_dim):
    array = sample((5, 7), "float32")
    key = keys("tp")
    assert store.put_tensor_with_tp(key, array, tp_size=tp_size, split_dim=split_dim) == OK
    expected = np.array_split(array, tp_size, axis=split_dim)
    assert store.batch_is_exist([f"{key}_tp_{r}" for r in range(tp_size)]) == [1] * tp_size
    assert store.is_exist(f"{key}_tp_{tp_size}") == 0
    for rank in range(tp_size):
        shard = store.get_tensor_with_tp(key, tp_rank=rank, tp_size=tp_size, split_dim=split_dim)
        assert_same(shard, np.ascontiguousarray(expected[rank]))
        assert_same(store.get_tensor(f"{key}_tp_{rank}"), np.ascontiguousarray(expected[rank]))
    assert store.get_tensor_with_tp(key, tp_rank=tp_size, tp_size=tp_size) is None
    assert np.array_equal(
        np.concatenate([store.get_tensor_with_tp(key, r, tp_size, split_dim) for r in range(tp_size)], axis=split_dim),
        array,
    )


def test_upstream_tp_example(store, keys):
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert store.put_tensor_with_tp(keys("tp"), array, tp_size=2, split_dim=1) == OK
    for rank in range(2):
        got = store.get_tensor_with_tp(keys("tp"), tp_rank=rank, tp_size=2)
        assert_same(got, np.ascontiguousarray(np.array_split(array, 2, axis=1)[rank]))
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
