"""Tensor helpers with torch tensors (skipped when torch is not installed). Mirrors
upstream's test_tensor_operations and test_00_mixed_put_and_put_tensor_concurrency."""

import ctypes
import threading

import pytest

torch = pytest.importorskip("torch")

OK = 0
INVALID_PARAMS = -600


def assert_same(got, expected):
    assert isinstance(got, torch.Tensor)
    assert got.dtype == expected.dtype
    assert tuple(got.shape) == tuple(expected.shape)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool],
    ids=str,
)
def test_torch_round_trip(store, keys, dtype):
    tensor = (torch.arange(24) % 7).to(dtype).reshape(2, 3, 4)
    assert store.put_tensor(keys("t"), tensor) == OK
    assert_same(store.get_tensor(keys("t")), tensor)


def test_torch_non_contiguous(store, keys):
    tensor = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert store.put_tensor(keys("t"), tensor) == OK
    assert_same(store.get_tensor(keys("t")), tensor.contiguous())


def test_upstream_tensor_operations(store, keys, pool):
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    key = keys("tensor")
    assert store.put_tensor(key, t) == OK
    assert_same(store.get_tensor(key), t)

    size = store.get_size(key)
    assert size > 0
    ptr = pool(size)
    assert store.register_buffer(ptr, size) == OK
    assert_same(store.get_tensor_into(key, ptr, size), t)
    assert store.batch_get_tensor_into([key, key + "_missing_arg"], [ptr], [size]) == [INVALID_PARAMS] * 2
    assert store.put_tensor_from(keys("from"), ptr, size) == OK
    assert_same(store.get_tensor(keys("from")), t)

    names = [keys("b0"), keys("b1")]
    assert store.batch_put_tensor(names, [t, t + 1]) == [OK, OK]
    got = store.batch_get_tensor(names)
    assert_same(got[0], t)
    assert_same(got[1], t + 1)

    assert store.upsert_tensor(keys("upsert"), t + 2) == OK
    assert_same(store.get_tensor(keys("upsert")), t + 2)
    assert store.pub_tensor(keys("pub"), t + 3) == OK
    assert_same(store.get_tensor(keys("pub")), t + 3)
    assert store.pub_tensor(keys("pub"), t + 7) == OK  # a put: the first value stays
    assert_same(store.get_tensor(keys("pub")), t + 3)
    assert store.batch_pub_tensor([keys("pub"), keys("pub2")], [t, t + 8]) == [OK, OK]
    assert_same(store.get_tensor(keys("pub2")), t + 8)

    assert store.put_tensor_with_tp(keys("tp"), t, tp_size=2, split_dim=1) == OK
    for rank in range(2):
        assert_same(store.get_tensor_with_tp(keys("tp"), tp_rank=rank, tp_size=2), torch.chunk(t, 2, dim=1)[rank].contiguous())
    assert store.batch_put_tensor_with_tp([keys("batch_tp")], [t], tp_size=2, split_dim=1) == [OK]

    assert store.put_tensor_with_parallelism(keys("par"), t) == OK
    assert_same(store.get_tensor(keys("par")), t)
    names = [keys("par1"), keys("par2")]
    assert store.batch_put_tensor_with_parallelism(names, [t + 4, t + 5]) == [OK, OK]
    got = store.batch_get_tensor(names)
    assert_same(got[0], t + 4)
    assert_same(got[1], t + 5)
    assert store.put_tensor_with_parallelism_from(keys("parfrom"), ptr, size) == OK
    assert_same(store.get_tensor(keys("parfrom")), t)
    assert store.upsert_tensor_with_parallelism(keys("parfrom"), t + 6) == OK
    assert_same(store.get_tensor(keys("parfrom")), t + 6)
    assert store.batch_upsert_tensor_with_parallelism_from([keys("parfrom")], [ptr], [size]) == [OK]
    assert_same(store.get_tensor(keys("parfrom")), t)
    assert store.unregister_buffer(ptr) == OK


@pytest.mark.parametrize("tp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("split_dim", [0, 1])
def test_torch_tp_shards_split_evenly(store, keys, tp_size, split_dim):
    t = torch.arange(72, dtype=torch.int32).reshape(6, 12)
    key = keys("tp")
    code = store.put_tensor_with_tp(key, t, tp_size=tp_size, split_dim=split_dim)
    shard_keys = [f"{key}_tp_{r}" for r in range(tp_size + 1)]
    if t.shape[split_dim] % tp_size:
        # Upstream only splits evenly (6 rows in 4 parts): refused, nothing stored.
        assert code == INVALID_PARAMS
        assert store.batch_is_exist([key, *shard_keys]) == [0] * (tp_size + 2)
        return
    assert code == OK
    if tp_size == 1:
        assert store.batch_is_exist([key, f"{key}_tp_0"]) == [1, 0]
        assert_same(store.get_tensor(key), t)
        assert_same(store.get_tensor_with_tp(key, tp_rank=0, tp_size=1), t)
        return
    for rank, chunk in enumerate(torch.chunk(t, tp_size, dim=split_dim)):
        assert_same(store.get_tensor_with_tp(key, tp_rank=rank, tp_size=tp_size, split_dim=split_dim), chunk.contiguous())
    assert store.is_exist(key) == 0
    assert store.get_tensor_with_tp(key, tp_rank=tp_size, tp_size=tp_size) is None


def test_torch_tp_pub_and_into(store, keys, pool):
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    key = keys("pub")
    assert store.pub_tensor_with_tp(key, t, tp_size=2, split_dim=1) == OK
    assert store.pub_tensor_with_tp(key, t + 1, tp_size=2, split_dim=1) == OK  # a put: kept
    chunks = torch.chunk(t, 2, dim=1)
    assert_same(store.get_tensor_with_tp(key, tp_rank=1, tp_size=2), chunks[1].contiguous())
    assert store.batch_pub_tensor_with_tp([keys("b")], [t], tp_size=2, split_dim=0) == [OK]
    assert store.pub_tensor_with_tp(keys("few"), torch.zeros(3, 4), tp_size=3, split_dim=1) == INVALID_PARAMS
    size = store.get_size(f"{key}_tp_0")
    ptr = pool(2 * size)
    assert_same(store.get_tensor_with_tp_into(key, ptr, size, tp_rank=0, tp_size=2), chunks[0].contiguous())
    got = store.batch_get_tensor_with_tp_into([key, keys("b")], [ptr, ptr + size], [size, size], tp_rank=1, tp_size=2)
    assert_same(got[0], chunks[1].contiguous())
    assert_same(got[1], torch.chunk(t, 2, dim=0)[1].contiguous())


def test_mixed_put_and_put_tensor_concurrency(store, keys):
    start = threading.Event()
    errors = []
    regular = {keys(f"regular_{i}"): f"regular-payload-{i}-".encode() * 4096 for i in range(16)}
    tensors = {keys(f"tensor_{i}"): (torch.arange(4096, dtype=torch.float32) + i).reshape(64, 64) for i in range(16)}

    def put_regular():
        start.wait()
        try:
            for key, value in regular.items():
                assert store.put(key, value) == OK
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    def put_tensors():
        start.wait()
        try:
            for key, tensor in tensors.items():
                assert store.put_tensor(key, tensor) == OK
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=put_regular), threading.Thread(target=put_tensors)]
    for thread in threads:
        thread.start()
    start.set()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    for key, value in regular.items():
        assert store.get(key) == value
    for key, tensor in tensors.items():
        assert_same(store.get_tensor(key), tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_torch_dtypes_without_numpy_twins(store, keys, dtype):
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
    assert store.put_tensor(keys("t"), t) == OK
    got = store.get_tensor(keys("t"))
    assert got.dtype == dtype and tuple(got.shape) == (2, 3)
    width = t.element_size()
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    assert torch.equal(got.view(bits), t.view(bits))


def test_torch_header_is_upstreams(store, keys):
    from mooncake.store import _deserialize_tensor, _serialize_tensor

    t = torch.ones(2, 3, 4, dtype=torch.bfloat16)
    meta, ptr, size, owner = _serialize_tensor(t)
    # Upstream's _serialize_tensor of this tensor (mooncake-transfer-engine 0.3.13).
    expected = bytearray(304)
    expected[:40] = bytes.fromhex("4e4f4f4d010030010c000000030000000000000000000000" "3001000000000000" "3000000000000000")
    shape = bytes.fromhex("0200000000000000" "0300000000000000" "0400000000000000") + b"\xff" * 40
    expected[40:104] = shape
    expected[104:168] = shape
    assert meta == bytes(expected)
    assert size == 48 and torch.equal(owner, t)
    assert torch.equal(_deserialize_tensor(meta + ctypes.string_at(ptr, size)), t)
    assert store.put_tensor(keys("t"), t) == OK
    assert store.get(keys("t"))[:304] == meta


def test_torch_cuda_reads_of_cpu_tensors_are_invalid(store, keys):
    t = torch.zeros(3, 4)
    assert store.put_tensor(keys("t"), t) == OK
    assert store.get_tensor_into_cuda(keys("t"), t) == INVALID_PARAMS  # a CPU tensor, as upstream
    assert store.batch_get_tensor_into_cuda([keys("t")], [t]) == [INVALID_PARAMS]


def test_torch_parallelism_round_trip(store, keys):
    from mooncake.store import ParallelAxis, ReadTarget, TensorParallelism

    t = torch.arange(48, dtype=torch.float16).reshape(4, 12)
    for rank, shard in enumerate(torch.chunk(t, 3, dim=1)):
        axis = ParallelAxis()
        axis.kind, axis.rank, axis.size, axis.split_dim = "tp", rank, 3, 1
        layout = TensorParallelism()
        layout.axes = [axis]
        assert store.put_tensor_with_parallelism(keys("p"), shard.contiguous(), parallelism=layout) == OK
    target = ReadTarget()
    target.mode, target.parallelism = "full", layout
    assert_same(store.get_tensor_with_parallelism(keys("p"), target), t)
