"""Zero copy where it is promised: the bytes copied through staging (the process-wide
``copied_through_staging_bytes`` of ``status()``, and the real client's
``staged_bytes`` / ``mooncake_client_staged_bytes_total`` in ``/metrics``) stay at zero
for memory the real client can use in place or reach across processes, and count exactly
the bytes of the copy-through path when it may not."""

import ctypes
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator
from mooncake_testlib import free_loopback_port

OK = 0
SIZE = 1 << 20
WORKERS = Path(__file__).resolve().parent / "_workers.py"


def copied(store):
    return store.status()["copied_through_staging_bytes"]


def staged(store):
    """Bytes the real client saw moved through a staging buffer or inside RPC messages."""
    return store.status()["staged_bytes"]


def metrics_staged(http_port):
    url = f"http://127.0.0.1:{http_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    line = next(l for l in text.splitlines() if l.startswith("mooncake_client_staged_bytes_total "))
    return int(line.split()[1])


def round_trip(store, key, src, dst, size=SIZE):
    assert store.put_from(key, src.ctypes.data, size) == OK
    assert store.batch_put_from([key + "-b"], [src.ctypes.data], [size]) == [OK]
    assert store.batch_put_from_multi_buffers([key + "-m"], [[src.ctypes.data, src.ctypes.data + size // 2]], [[size // 2, size // 2]]) == [OK]
    assert store.get_into(key, dst.ctypes.data, size) == size
    assert store.batch_get_into([key + "-b"], [dst.ctypes.data], [size]) == [size]
    assert store.batch_get_into_multi_buffers([key + "-m"], [[dst.ctypes.data]], [[size]]) == [size]
    assert np.array_equal(src[:size], dst[:size])


def test_registered_heap_memory_is_used_in_place_in_embedded_mode(embedded, keys):
    store = embedded(segment=32 << 20)
    src = np.random.default_rng(1).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, SIZE) == OK
    assert store.register_buffer(dst.ctypes.data, SIZE) == OK
    before, before_staged = copied(store), staged(store)
    round_trip(store, keys("emb"), src, dst)
    assert copied(store) == before
    assert staged(store) == before_staged == 0
    # Unregistered, the buffer is unknown again: refused, never read.
    assert store.unregister_buffer(src.ctypes.data) == OK
    assert store.put_from(keys("after"), src.ctypes.data, SIZE) < 0


def test_get_of_a_large_value_in_embedded_mode_is_byte_exact_and_lends_nothing_for_long(embedded, keys):
    """Past 1 MiB, get() reads straight into the new bytes object (lent to the real
    client for the one copy); the value must be exact and the loan must end with it."""
    store = embedded(segment=64 << 20)
    mine = lambda: [(e["segments"], e["mapped_bytes"]) for e in store.status()["dummies"] if e["pid"] == os.getpid()]
    lent_before = mine()
    rng = np.random.default_rng(7)
    for size in (1 << 20, (1 << 20) + 1, 3 << 20, (16 << 20) - 5):
        value = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert store.put(keys(f"v{size}"), value) == OK
        got = store.get(keys(f"v{size}"))
        assert got == value, size
        del got
        assert mine() == lent_before, size
    assert store.get(keys("missing")) == b""


def test_allocator_memory_is_zero_copy_in_dummy_mode(start_client, connect, keys):
    store = connect(start_client().address)
    allocator = MooncakeHostMemAllocator()
    ptrs = [allocator.alloc(SIZE), allocator.alloc(SIZE)]
    try:
        src, dst = (np.ctypeslib.as_array((ctypes.c_ubyte * SIZE).from_address(p)) for p in ptrs)
        src[:] = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
        for p in ptrs:
            assert store.register_buffer(p, SIZE) == OK
        before, before_staged = copied(store), staged(store)
        round_trip(store, keys("alloc"), src, dst)
        assert copied(store) == before
        assert staged(store) == before_staged
    finally:
        for p in ptrs:
            store.unregister_buffer(p)
            allocator.free(p)


def own_entry(store):
    return next(d for d in store.status()["dummies"] if d["pid"] == os.getpid())


def test_heap_memory_is_copied_once_by_the_real_client_in_dummy_mode(start_client, connect, keys):
    # A 1 MiB staging buffer and 4 MiB buffers: the copy-through path could not even
    # hold one value; the real client reads and writes the heap itself.
    size = 4 << 20
    store = connect(start_client().address, staging=1 << 20)
    src = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, size) == OK
    assert store.register_buffer(dst.ctypes.data, size) == OK
    entry = own_entry(store)
    assert entry["cross_memory"] and entry["declared_ranges"] == 2, entry
    before, before_staged = copied(store), staged(store)
    round_trip(store, keys("heap"), src, dst, size)
    fragments = store.get_into_ranges([dst.ctypes.data], [[keys("heap")]], [[[0]]], [[[7]]], [[[size - 7]]])
    assert fragments == [[[size - 7]]]
    assert np.array_equal(dst[: size - 7], src[7:])
    assert copied(store) == before
    assert staged(store) == before_staged
    # Unregistered, the buffer is forgotten by the real client too: refused, never read.
    assert store.unregister_buffer(src.ctypes.data) == OK
    assert own_entry(store)["declared_ranges"] == 1
    assert store.put_from(keys("after"), src.ctypes.data, size) < 0


def test_real_client_counts_bytes_moved_through_staging_in_status_and_metrics(start_client, connect, keys):
    http_port = free_loopback_port()
    store = connect(start_client("--enable_http_server", f"--http_port={http_port}").address)
    assert staged(store) == 0 and metrics_staged(http_port) == 0
    # Plain bytes objects have no memory the real client could use: staging both ways.
    value = np.random.default_rng(4).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    key = keys("bytes")
    assert store.put(key, value) == OK
    assert staged(store) == len(value)
    assert store.get(key) == value
    assert staged(store) == 2 * len(value)
    assert metrics_staged(http_port) == 2 * len(value)
    # A failed read copies nothing and counts nothing.
    assert store.get(keys("missing")) == b""
    assert staged(store) == 2 * len(value)
    # Pool memory is used in place: nothing more is counted.
    ptr = store.alloc_from_mem_pool(SIZE)
    assert ptr
    try:
        assert store.put_from(keys("pool"), ptr, SIZE) == OK
        assert store.get_into(keys("pool"), ptr, SIZE) == SIZE
    finally:
        store.free_to_mem_pool(ptr)
    assert staged(store) == 2 * len(value)
    assert metrics_staged(http_port) == 2 * len(value)


def test_heap_memory_goes_through_staging_when_the_real_client_may_not_read_it(start_client, keys):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv is missing: cannot run mooncake_client as another user")
    if os.geteuid() != 0:
        pytest.skip("running mooncake_client as another user needs root")
    # As nobody, without CAP_SYS_PTRACE, the real client may not read this (root) process.
    client = start_client("--allowed_uids=0", uid=65534)
    worker = subprocess.run(
        [sys.executable, str(WORKERS), "staging", client.address, keys("staging")],
        capture_output=True,
        text=True,
        timeout=120,
        # The dummy trusts a real client of another uid only when told to.
        env={**os.environ, "RUST_LOG": "warn", "MOONCAKE_CLIENT_UIDS": "65534"},
    )
    assert worker.returncode == 0, worker.stdout + worker.stderr
    report = json.loads(worker.stdout.strip().splitlines()[-1])
    for step in report["steps"]:
        assert step["ok"], step
        assert step["copied"] == step["expected"], step
        assert step["staged"] == step["expected_staged"], step
    assert report["cross_memory"] == [False], report
    notices = [line for line in worker.stderr.splitlines() if "copied through the staging buffer" in line]
    assert len(notices) == 1, worker.stderr
    assert "EPERM" in notices[0] and "CAP_SYS_PTRACE" in notices[0], notices[0]


# Mixed sizes, 14.5 MiB in all and about 0.6 MiB per value: the real client shares
# such a batch's copies out across its copy threads, item by item.
BATCH_SIZES = [(64 << 10) * (1 + i % 24) for i in range(24)]


@pytest.mark.parametrize("memory", ["embedded-heap", "dummy-allocator", "dummy-heap"])
def test_a_batch_of_many_medium_values_is_byte_exact_in_every_kind_of_memory(memory, embedded, start_client, connect, keys):
    if memory == "embedded-heap":
        store = embedded(segment=64 << 20)
    else:
        store = connect(start_client().address)
    total = sum(BATCH_SIZES)
    offsets = np.cumsum([0] + BATCH_SIZES[:-1]).tolist()
    allocator = MooncakeHostMemAllocator() if memory == "dummy-allocator" else None
    if allocator:
        ptrs = [allocator.alloc(total), allocator.alloc(total)]
        src, dst = (np.ctypeslib.as_array((ctypes.c_ubyte * total).from_address(p)) for p in ptrs)
    else:
        src, dst = np.empty(total, dtype=np.uint8), np.empty(total, dtype=np.uint8)
    try:
        src[:] = np.random.default_rng(7).integers(0, 256, total, dtype=np.uint8)
        dst[:] = 0
        for array in (src, dst):
            assert store.register_buffer(array.ctypes.data, total) == OK
        names = [keys(f"batch{i}") for i in range(len(BATCH_SIZES))]
        # One key exists already with other bytes: a put leaves it as it was.
        assert store.put(names[5], b"kept") == OK
        src_ptrs = [src.ctypes.data + o for o in offsets]
        dst_ptrs = [dst.ctypes.data + o for o in offsets]
        assert store.batch_put_from(names, src_ptrs, BATCH_SIZES) == [OK] * len(names)
        missing = keys("missing")
        got = store.batch_get_into(names + [missing], dst_ptrs + [dst.ctypes.data], BATCH_SIZES + [4096])
        assert got[5] == len(b"kept") and got[-1] < 0, got
        for i, (offset, size) in enumerate(zip(offsets, BATCH_SIZES)):
            if i == 5:
                assert bytes(dst[offset:offset + 4]) == b"kept"
                continue
            assert got[i] == size, (i, got[i])
            assert np.array_equal(dst[offset:offset + size], src[offset:offset + size]), f"value {i} differs"
        assert copied(store) == 0
    finally:
        for array in (src, dst):
            store.unregister_buffer(array.ctypes.data)
        if allocator:
            for p in ptrs:
                allocator.free(p)
