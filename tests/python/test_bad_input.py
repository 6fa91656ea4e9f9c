"""Bad input never crashes the interpreter: it is a documented error code or a Python
exception, and the store keeps working afterwards."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mooncake.store import ReplicateConfig, SoftPinAction

OK = 0
INVALID_KEY = -400
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704


@pytest.fixture(autouse=True)
def still_healthy(request):
    owner = request.getfixturevalue("store") if "store" in request.fixturenames else None
    yield
    if owner is not None:
        assert owner.health_check() == 0
        key = "after-bad-input-check"
        assert owner.upsert(key, b"alive") == OK
        assert owner.get(key) == b"alive"
        assert owner.remove(key, True) == OK


def test_wrong_types(store, keys, pool):
    ptr = pool(64)
    calls = [
        lambda: store.put(1, b"x"),
        lambda: store.put(b"bytes-key", b"x"),
        lambda: store.put(None, b"x"),
        lambda: store.put(keys("k"), "a str value"),
        lambda: store.put(keys("k"), None),
        lambda: store.put(keys("k"), 12345),
        lambda: store.put(keys("k"), [1, 2, 3]),
        lambda: store.put(keys("k"), b"x", config=5),
        lambda: store.put(keys("k"), b"x", "config"),
        lambda: store.put_parts(keys("k"), b"x", "y"),
        lambda: store.put_batch(keys("k"), [b"x"]),
        lambda: store.put_batch([keys("k")], b"x"),
        lambda: store.put_batch([1], [b"x"]),
        lambda: store.upsert(keys("k"), "str"),
        lambda: store.get(None),
        lambda: store.get(42),
        lambda: store.get_batch("not a list"),
        lambda: store.get_batch([None]),
        lambda: store.batch_is_exist("abc"),
        lambda: store.batch_is_exist([1, 2]),
        lambda: store.is_exist(None),
        lambda: store.get_size(3.5),
        lambda: store.remove(keys("k"), "maybe"),
        lambda: store.batch_remove(None),
        lambda: store.remove_by_regex(None),
        lambda: store.get_into(keys("k"), "ptr", 10),
        lambda: store.get_into(keys("k"), ptr, 10.5),
        lambda: store.get_into(keys("k"), float(ptr), 10),
        lambda: store.put_from(keys("k"), ptr, None),
        lambda: store.batch_get_into([keys("k")], ptr, [10]),
        lambda: store.batch_put_from([keys("k")], [ptr], 10),
        lambda: store.batch_put_from_multi_buffers([keys("k")], [ptr], [[10]]),
        lambda: store.get_into_ranges([ptr], [keys("k")], [[[0]]], [[[0]]], [[[1]]]),
        lambda: store.get_into_ranges([ptr], [[keys("k")]], [[0]], [[[0]]], [[[1]]]),
        lambda: store.alloc_from_mem_pool("lots"),
        lambda: store.alloc_from_mem_pool(None),
        lambda: store.free_to_mem_pool(None),
        lambda: store.register_buffer(None, 10),
        lambda: store.create_copy_task(keys("k"), None),
        lambda: store.create_copy_task(None, ["a:1"]),
        lambda: store.query_task("not-a-uuid"),
        lambda: store.query_task(None),
        lambda: store.get_buffer(7),
        lambda: store.batch_get_buffer([None]),
    ]
    for index, call in enumerate(calls):
        with pytest.raises((TypeError, ValueError)):
            call()
            pytest.fail(f"call #{index} did not raise")


def test_negative_and_oversized_numbers(store, keys, pool):
    ptr = pool(64)
    assert store.put(keys("k"), b"value") == OK
    calls = [
        lambda: store.get_into(keys("k"), -1, 10),
        lambda: store.get_into(keys("k"), ptr, -1),
        lambda: store.put_from(keys("k"), -ptr, 10),
        lambda: store.put_from(keys("k"), ptr, -10),
        lambda: store.batch_get_into([keys("k")], [ptr], [-1]),
        lambda: store.batch_put_from([keys("k")], [-1], [10]),
        lambda: store.alloc_from_mem_pool(-1),
        lambda: store.alloc_from_mem_pool(1 << 64),
        lambda: store.free_to_mem_pool(-1),
        lambda: store.register_buffer(-1, 10),
        lambda: store.register_buffer(ptr, -10),
        lambda: store.unregister_buffer(-1),
        lambda: store.get_into(keys("k"), 1 << 64, 10),
        lambda: store.put_from(keys("k"), ptr, 1 << 70),
        lambda: store.get_into_ranges([ptr], [[keys("k")]], [[[-1]]], [[[0]]], [[[4]]]),
        lambda: store.get_into_ranges([ptr], [[keys("k")]], [[[0]]], [[[-1]]], [[[4]]]),
        lambda: store.get_into_ranges([ptr], [[keys("k")]], [[[0]]], [[[0]]], [[[-4]]]),
        lambda: store.batch_put_from_multi_buffers([keys("k")], [[ptr]], [[-1]]),
        lambda: store.query_task(-1),
        lambda: store.query_task(1 << 128),
    ]
    for index, call in enumerate(calls):
        with pytest.raises(OverflowError):
            call()
            pytest.fail(f"call #{index} did not raise")


def test_null_and_wild_pointers(store, keys):
    assert store.put(keys("k"), b"value") == OK
    for wild in (0, 8, 0x1000, 0xDEADBEEF000, (1 << 64) - 4096):
        assert store.get_into(keys("k"), wild, 64) == INVALID_PARAMS, wild
        assert store.put_from(keys("w"), wild, 64) == INVALID_PARAMS, wild
        assert store.upsert_from(keys("w"), wild, 64) == INVALID_PARAMS, wild
        assert store.batch_get_into([keys("k")], [wild], [64]) == [INVALID_PARAMS]
        assert store.batch_put_from([keys("w")], [wild], [64]) == [INVALID_PARAMS]
        assert store.batch_upsert_from([keys("w")], [wild], [64]) == [INVALID_PARAMS]
        assert store.batch_put_from_multi_buffers([keys("w")], [[wild]], [[64]]) == [INVALID_PARAMS]
        assert store.batch_get_into_multi_buffers([keys("k")], [[wild]], [[64]]) == [INVALID_PARAMS]
        assert store.put_from_with_metadata(keys("w"), wild, wild, 8, 8) == INVALID_PARAMS
        assert store.get_into_ranges([wild], [[keys("k")]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]
        assert store.free_to_mem_pool(wild) == INVALID_PARAMS
        assert store.get_tensor_into(keys("k"), wild, 64) is None
        assert store.batch_get_tensor_into([keys("k")], [wild], [64]) == [None]
    assert store.is_exist(keys("w")) == 0
    assert store.get(keys("k")) == b"value"


# Calls given a pointer that is neither the client's shared memory nor a registered
# buffer. NOACCESS is a PROT_NONE page: reading it at all kills the process, so a -600
# from these calls also shows that the memory was never read.
TENSOR_FROM_CALLS = {
    "store.put_tensor_from(K, 0, 64)": INVALID_PARAMS,
    "store.put_tensor_from(K, 0x1000, 64)": INVALID_PARAMS,
    "store.upsert_tensor_from(K, 0xDEADBEEF000, 64)": INVALID_PARAMS,
    "store.batch_put_tensor_from([K], [0], [64])": [INVALID_PARAMS],
    "store.put_tensor_from(K, NOACCESS, 64)": INVALID_PARAMS,
    "store.put_tensor_from(K, NOACCESS, 4096)": INVALID_PARAMS,
    "store.upsert_tensor_from(K, NOACCESS, 128)": INVALID_PARAMS,
    "store.batch_put_tensor_from([K, K + '2'], [NOACCESS, NOACCESS + 64], [64, 64])": [INVALID_PARAMS] * 2,
    "store.batch_upsert_tensor_from([K], [NOACCESS], [64])": [INVALID_PARAMS],
    "store.put_tensor_with_parallelism_from(K, NOACCESS, 64)": INVALID_PARAMS,
    "store.batch_upsert_tensor_with_parallelism_from([K], [NOACCESS], [64])": [INVALID_PARAMS],
}

TENSOR_FROM_CHILD = """
import ctypes, json, sys
from mooncake.store import MooncakeDistributedStore
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
NOACCESS = libc.mmap(None, 8192, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS
assert NOACCESS not in (None, ctypes.c_void_p(-1).value)
mode, address, K = sys.argv[1:4]
store = MooncakeDistributedStore()
if mode == "dummy":
    assert store.setup_dummy(8 << 20, 4 << 20, address) == 0
elif mode == "embedded":
    assert store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 4 << 20, "tcp", "", "embedded") == 0
for call in json.loads(sys.argv[4]):
    print("CALL " + call, flush=True)
    print("RESULT " + json.dumps(eval(call)), flush=True)
if mode != "unset":
    print("EXIST " + json.dumps(store.batch_is_exist([K, K + "2"])), flush=True)
    store.close()
"""


@pytest.mark.parametrize("mode", ["unset", "dummy", "embedded"])
def test_tensor_from_bad_pointer_does_not_crash(mode, real_client, keys):
    # Run in a child: a crash must not take the test session down.
    key = keys("k")
    result = subprocess.run(
        [sys.executable, "-c", TENSOR_FROM_CHILD, mode, real_client.address, key, json.dumps(list(TENSOR_FROM_CALLS))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = result.stdout.splitlines()
    calls = [line[5:] for line in lines if line.startswith("CALL ")]
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    crashed = calls[len(results)] if len(calls) > len(results) else None
    assert result.returncode == 0, f"rc {result.returncode} in {crashed}: {result.stderr[-2000:]}"
    assert calls == list(TENSOR_FROM_CALLS)
    assert dict(zip(calls, results)) == TENSOR_FROM_CALLS
    if mode != "unset":
        (exist,) = [json.loads(line[6:]) for line in lines if line.startswith("EXIST ")]
        assert exist == [0, 0]  # nothing was stored


def test_tensor_from_unregistered_ordinary_memory(store, keys):
    array = np.arange(6, dtype=np.int64)
    assert store.put_tensor(keys("src"), array) == OK
    layout = np.frombuffer(store.get(keys("src")), dtype=np.uint8).copy()  # a valid layout
    address, size = layout.ctypes.data, layout.nbytes
    assert store.put_tensor_from(keys("a"), address, size) == INVALID_PARAMS
    assert store.upsert_tensor_from(keys("a"), address, size) == INVALID_PARAMS
    assert store.batch_put_tensor_from([keys("a")], [address], [size]) == [INVALID_PARAMS]
    assert store.batch_upsert_tensor_from([keys("a")], [address], [size]) == [INVALID_PARAMS]
    assert store.is_exist(keys("a")) == 0
    # Registered, the same memory is accepted (copied through).
    assert store.register_buffer(address, size) == OK
    try:
        assert store.put_tensor_from(keys("a"), address, size) == OK
        assert np.array_equal(store.get_tensor(keys("a")), array)
        # Only the registered range counts: one byte past it is refused.
        assert store.upsert_tensor_from(keys("a"), address, size + 1) == INVALID_PARAMS
    finally:
        assert store.unregister_buffer(address) == OK
    assert store.put_tensor_from(keys("b"), address, size) == INVALID_PARAMS
    assert store.is_exist(keys("b")) == 0


def test_pool_pointer_with_range_past_the_pool(store, keys, pool):
    ptr = pool(4096)
    assert store.put(keys("k"), b"value") == OK
    assert store.get_into(keys("k"), ptr, 1 << 40) == INVALID_PARAMS
    assert store.put_from(keys("w"), ptr, 1 << 40) == INVALID_PARAMS
    assert store.put_from(keys("w"), ptr, 1 << 62) == INVALID_PARAMS
    assert store.put_from_with_metadata(keys("w"), ptr, ptr, 1 << 62, 1 << 62) == INVALID_PARAMS
    assert store.batch_put_from_multi_buffers([keys("w")], [[ptr, ptr]], [[(1 << 64) - 1, 2]]) == [INVALID_PARAMS]
    assert store.get_into_ranges([ptr], [[keys("k")]], [[[(1 << 64) - 2]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]
    assert store.get_into_ranges([ptr], [[keys("k")]], [[[0]]], [[[(1 << 64) - 2]]], [[[4]]]) == [[[INVALID_PARAMS]]]
    assert store.is_exist(keys("w")) == 0


def test_huge_sizes(store, keys):
    assert store.alloc_from_mem_pool(1 << 62) == 0
    assert store.alloc_from_mem_pool((1 << 64) - 1) == 0
    assert store.get_into(keys("missing"), 0x1000, (1 << 64) - 1) < 0


def test_mismatched_list_lengths(store, keys, pool):
    ptr = pool(4096)
    two = [keys("a"), keys("b")]
    assert store.put_batch(two, [b"x"]) == INVALID_PARAMS
    assert store.upsert_batch(two, [b"x", b"y", b"z"]) == INVALID_PARAMS
    assert store.batch_put_from(two, [ptr], [1, 1]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from(two, [ptr, ptr], [1]) == [INVALID_PARAMS] * 2
    assert store.batch_upsert_from(two, [ptr], [1]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into(two, [ptr], [1, 1]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into(two, [ptr, ptr], [1]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers(two, [[ptr]], [[1]]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers(two, [[ptr], [ptr, ptr]], [[1], [1]]) == [INVALID_PARAMS] * 2
    assert store.batch_upsert_from_multi_buffers(two, [[ptr], [ptr]], [[1]]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into_multi_buffers(two, [[ptr], [ptr]], [[1]]) == [INVALID_PARAMS] * 2
    assert store.batch_put_tensor(two, [np.zeros(2)]) == [INVALID_PARAMS] * 2
    assert store.batch_upsert_tensor(two, [np.zeros(2)] * 3) == [INVALID_PARAMS] * 2
    assert store.batch_get_tensor_into(two, [ptr], [64, 64]) == [INVALID_PARAMS] * 2
    assert store.batch_put_tensor_from(two, [ptr], [64]) == [INVALID_PARAMS] * 2
    assert store.get_into_ranges([ptr], [two], [[[0]]], [[[0]]], [[[1]]]) == [[[INVALID_PARAMS], []]]
    assert store.get_into_ranges([ptr], [[two[0]]], [[[0, 1]]], [[[0]]], [[[1, 1]]]) == [[[INVALID_PARAMS] * 2]]
    assert store.batch_is_exist(two) == [0, 0]


def test_over_long_keys(store, keys, pool):
    ptr = pool(64)
    long_key = "k" * 4097
    assert store.put(long_key, b"x") == INVALID_KEY
    assert store.put_parts(long_key, b"x") == INVALID_KEY
    assert store.upsert(long_key, b"x") == INVALID_KEY
    assert store.put_batch([long_key], [b"x"]) == INVALID_KEY
    assert store.put_from(long_key, ptr, 8) == INVALID_KEY
    assert store.batch_put_from([long_key], [ptr], [8]) == [INVALID_KEY]
    assert store.get(long_key) == b""
    assert store.get_buffer(long_key) is None
    assert store.get_into(long_key, ptr, 64) == INVALID_KEY
    assert store.batch_get_into([long_key], [ptr], [64]) == [INVALID_KEY]
    assert store.is_exist(long_key) == INVALID_KEY
    assert store.batch_is_exist([keys("ok"), long_key]) == [0, INVALID_KEY]
    assert store.get_size(long_key) == INVALID_KEY
    assert store.remove(long_key) == INVALID_KEY
    assert store.batch_remove([long_key], True) == [INVALID_KEY]
    assert store.put_tensor(long_key, np.zeros(3)) == INVALID_KEY
    assert store.get_tensor(long_key) is None
    result = store.get_into_ranges([ptr], [[long_key]], [[[0]]], [[[0]]], [[[4]]])
    assert result == [[[INVALID_KEY]]]
    assert store.create_copy_task(long_key, [store.get_hostname()])[0] is None

    # The limit is 4096 bytes of UTF-8, not 4096 characters.
    exact = keys("") + "x" * (4096 - len(keys("")))
    assert store.put(exact, b"fits") == OK
    assert store.get(exact) == b"fits"
    wide = "é" * 2048  # 4096 bytes
    assert store.put(wide, b"fits too") == OK
    assert store.get(wide) == b"fits too"
    assert store.remove(wide, True) == OK
    assert store.put("é" * 2049, b"x") == INVALID_KEY  # 4098 bytes
    assert store.put(keys("big") + "x" * 100_000, b"x") == INVALID_KEY


def test_empty_key(store):
    assert store.put("", b"x") == INVALID_KEY
    assert store.get("") == b""
    assert store.is_exist("") == INVALID_KEY
    assert store.get_size("") == INVALID_KEY
    assert store.remove("") == INVALID_KEY


def test_unusual_keys_round_trip(store, keys):
    for suffix in ("with space", "tab\tnew\nline", "nul\0byte", "emoji-🚀", "中文", "../../etc/passwd", "a" * 3000):
        key = keys(suffix)
        value = suffix.encode() + b"!"
        assert store.put(key, value) == OK, suffix
        assert store.get(key) == value, suffix
        assert store.is_exist(key) == 1
    # A key containing NUL is a key of its own, not a prefix match.
    assert store.get(keys("nul")) == b""


@pytest.mark.parametrize("bad_key", ["\ud800", "ok-then-\udfff", "\udc80\udc81"], ids=["high", "low", "pair-of-lows"])
def test_lone_surrogates_raise(store, keys, bad_key, pool):
    ptr = pool(64)
    calls = [
        lambda: store.put(bad_key, b"x"),
        lambda: store.put_parts(bad_key, b"x"),
        lambda: store.put_batch([keys("fine"), bad_key], [b"x", b"y"]),
        lambda: store.upsert(bad_key, b"x"),
        lambda: store.get(bad_key),
        lambda: store.get_batch([bad_key]),
        lambda: store.get_buffer(bad_key),
        lambda: store.batch_get_buffer([bad_key]),
        lambda: store.is_exist(bad_key),
        lambda: store.batch_is_exist([bad_key]),
        lambda: store.get_size(bad_key),
        lambda: store.remove(bad_key),
        lambda: store.batch_remove([bad_key]),
        lambda: store.remove_by_regex(bad_key),
        lambda: store.put_from(bad_key, ptr, 8),
        lambda: store.get_into(bad_key, ptr, 64),
        lambda: store.batch_get_into([bad_key], [ptr], [64]),
        lambda: store.get_into_ranges([ptr], [[bad_key]], [[[0]]], [[[0]]], [[[4]]]),
        lambda: store.put_tensor(bad_key, np.zeros(4)),
        lambda: store.get_tensor(bad_key),
        lambda: store.get_replica_desc(bad_key),
        lambda: store.create_copy_task(bad_key, ["a:1"]),
        lambda: store.create_copy_task(keys("fine"), [bad_key]),
        lambda: store.setup_dummy(1 << 20, 1 << 20, bad_key),
    ]
    for index, call in enumerate(calls):
        with pytest.raises(UnicodeError):
            call()
            pytest.fail(f"call #{index} did not raise")
    assert store.is_exist(keys("fine")) == 0


def test_replicate_config_bad_values():
    config = ReplicateConfig()
    # Upstream (pybind11) raises TypeError for a negative or mistyped number.
    with pytest.raises(TypeError):
        config.replica_num = -1
    with pytest.raises(TypeError):
        config.replica_num = None
    with pytest.raises(TypeError):
        config.replica_num = "two"
    with pytest.raises(TypeError):
        config.soft_pin_action = 1
    with pytest.raises(TypeError):
        config.preferred_segments = "not-a-list"
    with pytest.raises((TypeError, AttributeError)):
        config.no_such_field = 1
    config.soft_pin_action = SoftPinAction.DISABLE
    assert config.soft_pin_action == SoftPinAction.DISABLE


def test_bad_regexes(store):
    for pattern in ("(", "[a-", "a{99999999}", "(?P<x>", "\\"):
        assert store.remove_by_regex(pattern) == INVALID_PARAMS, pattern
    # A pattern that is valid but needs a huge automaton is refused, not run.
    assert store.remove_by_regex("(a|b|c|d|e){1000}{1000}") == INVALID_PARAMS


def test_setup_bad_arguments():
    from mooncake.store import MooncakeDistributedStore  # noqa: PLC0415

    store = MooncakeDistributedStore()
    with pytest.raises((TypeError, ValueError, OverflowError)):
        store.setup_dummy(-1, 1 << 20, "127.0.0.1:1")
    with pytest.raises(ValueError):
        store.setup_dummy("12 parsecs", 1 << 20, "127.0.0.1:1")
    with pytest.raises(TypeError):
        store.setup_dummy(1 << 20, 1 << 20, 12345)
    assert store.health_check() == 1
