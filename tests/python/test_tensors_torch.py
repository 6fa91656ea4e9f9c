"""Tensor helpers with torch tensors (skipped when torch is not installed). Mirrors
upstream's test_tensor_operations and test_00_mixed_put_and_put_tensor_concurrency."""

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
def test_torch_tp_shards_follow_torch_chunk(store, keys, tp_size, split_dim):
    t = torch.arange(35, dtype=torch.int32).reshape(5, 7)
    key = keys("tp")
    chunks = torch.chunk(t, tp_size, dim=split_dim)
    code = store.put_tensor_with_tp(key, t, tp_size=tp_size, split_dim=split_dim)
    shard_keys = [f"{key}_tp_{r}" for r in range(tp_size + 1)]
    if len(chunks) < tp_size:
        # torch.chunk gave fewer than tp_size chunks (5 rows in 4 parts: 3): refused.
        assert code == INVALID_PARAMS
        assert store.batch_is_exist([key, *shard_keys]) == [0] * (tp_size + 2)
        return
    assert code == OK
    if tp_size == 1:
        assert store.batch_is_exist([key, f"{key}_tp_0"]) == [1, 0]
        assert_same(store.get_tensor(key), t)
        assert_same(store.get_tensor_with_tp(key, tp_rank=0, tp_size=1), t)
        return
    for rank, chunk in enumerate(chunks):
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
