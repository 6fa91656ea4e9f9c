"""Zero-copy calls (pool memory), registered ordinary memory, buffer handles, ranged
reads and the pool itself, in dummy and embedded mode."""

import ctypes
import gc
import os

import numpy as np
import pytest

from mooncake_testlib import buffer_address, dummy_entries, read_at, write_at

from mooncake.store import BufferHandle

OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
MB = 1 << 20


# ----- put_from / get_into -----


def test_put_from_get_into(store, keys, pool):
    data = bytes(range(256)) * 40
    src = pool(len(data))
    write_at(src, data)
    assert store.put_from(keys("a"), src, len(data)) == OK
    assert store.get(keys("a")) == data

    dst = pool(MB)
    ctypes.memset(dst, 0, MB)
    assert store.get_into(keys("a"), dst, MB) == len(data)
    assert read_at(dst, len(data)) == data
    assert read_at(dst + len(data), 16) == b"\0" * 16  # nothing past the object
    assert store.get_into(keys("a"), dst, len(data)) == len(data)  # exact fit
    assert store.get_into(keys("a"), dst, len(data) - 1) == INVALID_PARAMS  # too small
    assert store.get_into(keys("missing"), dst, MB) == OBJECT_NOT_FOUND


def test_put_from_does_not_overwrite_and_upsert_from_does(store, keys, pool):
    src = pool(64)
    write_at(src, b"first")
    assert store.put_from(keys("a"), src, 5) == OK
    write_at(src, b"SECOND!")
    assert store.put_from(keys("a"), src, 7) == OK
    assert store.get(keys("a")) == b"first"
    assert store.upsert_from(keys("a"), src, 7) == OK
    assert store.get(keys("a")) == b"SECOND!"
    write_at(src, b"third!!")
    assert store.upsert_from(keys("a"), src, 7) == OK  # same size
    assert store.get(keys("a")) == b"third!!"
    assert store.upsert_from(keys("new"), src, 3) == OK
    assert store.get(keys("new")) == b"thi"


def test_put_from_zero_size_is_invalid(store, keys, pool):
    src = pool(64)
    assert store.put_from(keys("z"), src, 0) == INVALID_PARAMS
    assert store.is_exist(keys("z")) == 0


def test_batch_put_from_and_batch_get_into(store, keys, pool):
    names = keys.many(3)
    values = [b"Hello, Batch World 0! " * 100, b"Hello, Batch World 1! " * 200, b"Hello, Batch World 2! " * 150]
    base = pool(3 * MB)
    assert store.register_buffer(base, 3 * MB) == OK  # as upstream (not needed for pool memory)
    ptrs = [base + i * MB for i in range(3)]
    for ptr, value in zip(ptrs, values):
        write_at(ptr, value)
    sizes = [len(v) for v in values]
    assert store.batch_put_from(names, ptrs, sizes) == [OK, OK, OK]
    assert store.get_batch(names) == values

    # Mismatched lengths: one -600 per key.
    assert store.batch_put_from(keys.many(2, "m"), ptrs, sizes) == [INVALID_PARAMS] * 2
    assert store.batch_put_from([], [], []) == []

    out = pool(3 * MB)
    out_ptrs = [out + i * MB for i in range(3)]
    assert store.batch_get_into(names, out_ptrs, [MB] * 3) == sizes
    for ptr, value in zip(out_ptrs, values):
        assert read_at(ptr, len(value)) == value
    assert store.batch_get_into(names[:2], out_ptrs, [MB] * 3) == [INVALID_PARAMS] * 2
    assert store.batch_get_into(names, out_ptrs[:2], [MB] * 2) == [INVALID_PARAMS] * 3
    assert store.batch_get_into([], [], []) == []
    assert store.batch_get_into(
        [names[0], keys("missing"), names[2]], out_ptrs, [MB, MB, 10]
    ) == [sizes[0], OBJECT_NOT_FOUND, INVALID_PARAMS]
    assert store.unregister_buffer(base) == OK


def test_batch_upsert_from(store, keys, pool):
    names = keys.many(2)
    src = pool(4096)
    write_at(src, b"AAAAbbbbbbbb")
    assert store.batch_put_from(names, [src, src + 4], [4, 8]) == [OK, OK]
    write_at(src, b"CCCCdddddd")
    assert store.batch_upsert_from(names, [src, src + 4], [4, 6]) == [OK, OK]
    assert store.get_batch(names) == [b"CCCC", b"dddddd"]
    assert store.batch_upsert_from(names, [src], [4, 6]) == [INVALID_PARAMS] * 2
    assert store.batch_upsert_from([], [], []) == []


def test_put_from_with_metadata_puts_metadata_first(store, keys, pool):
    buf = pool(4096)
    write_at(buf, b"PAYLOAD-BYTES")
    write_at(buf + 1024, b"META:")
    assert store.put_from_with_metadata(keys("m"), buf, buf + 1024, 13, 5) == OK
    assert store.get(keys("m")) == b"META:PAYLOAD-BYTES"
    assert store.get_size(keys("m")) == 18


def test_multi_buffers(store, keys, pool):
    buf = pool(8192)
    write_at(buf, b"head-")
    write_at(buf + 100, b"middle-")
    write_at(buf + 200, b"tail")
    write_at(buf + 300, b"solo")
    names = [keys("a"), keys("b")]
    result = store.batch_put_from_multi_buffers(names, [[buf, buf + 100, buf + 200], [buf + 300]], [[5, 7, 4], [4]])
    assert result == [OK, OK]
    assert store.get_batch(names) == [b"head-middle-tail", b"solo"]

    out = buf + 4096
    ctypes.memset(out, ord("."), 1024)
    got = store.batch_get_into_multi_buffers(names, [[out, out + 100], [out + 200]], [[6, 50], [4]])
    assert got == [16, 4]
    assert read_at(out, 6) == b"head-m"
    assert read_at(out + 100, 10) == b"iddle-tail"
    assert read_at(out + 200, 4) == b"solo"
    assert store.batch_get_into_multi_buffers(names, [[out, out + 100], [out + 200]], [[6, 5], [4]], True) == [
        INVALID_PARAMS,
        4,
    ]
    assert store.batch_get_into_multi_buffers(names, [[out]], [[64]]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into_multi_buffers(names, [[out], [out]], [[64, 1], [64]]) == [INVALID_PARAMS] * 2
    assert store.batch_get_into_multi_buffers([keys("missing")], [[out]], [[64]], False) == [OBJECT_NOT_FOUND]
    assert store.batch_get_into_multi_buffers([], [], []) == []

    assert store.batch_put_from_multi_buffers(names, [[buf]], [[4]]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers([keys("c")], [[buf, buf]], [[4]]) == [INVALID_PARAMS]
    write_at(buf, b"NEW!")
    assert store.batch_upsert_from_multi_buffers([names[1]], [[buf, buf + 300]], [[4, 4]]) == [OK]
    assert store.get(names[1]) == b"NEW!solo"


# ----- buffer handles -----


def test_get_buffer_contents(store, keys):
    data = bytes(range(256)) * 4
    assert store.put(keys("b"), data) == OK
    handle = store.get_buffer(keys("b"))
    assert handle is not None
    assert handle.size() == len(data) == handle.len() == len(handle)
    assert handle.ptr() != 0
    assert bytes(handle) == data
    assert handle.tobytes() == data
    assert memoryview(handle).tobytes() == data
    assert np.frombuffer(handle, dtype=np.uint8).tolist() == list(data)
    assert read_at(handle.ptr(), len(data)) == data
    assert "BufferHandle" in repr(handle)
    assert isinstance(handle, BufferHandle)
    assert not hasattr(handle, "release")  # the handle frees its block when collected
    assert store.get_buffer(keys("missing")) is None


def test_live_handle_block_cannot_be_freed(store, keys):
    data = b"owned by the handle" * 100
    assert store.put(keys("h"), data) == OK
    handle = store.get_buffer(keys("h"))
    view = np.frombuffer(handle, dtype=np.uint8)
    assert store.free_to_mem_pool(handle.ptr()) == INVALID_PARAMS
    assert bytes(handle) == data
    # Nothing else got the block: new allocations and objects leave it untouched.
    blocks = [store.alloc_from_mem_pool(len(data)) for _ in range(8)]
    assert handle.ptr() not in blocks
    for block in blocks:
        ctypes.memset(block, 0xAB, len(data))
    assert view.tobytes() == data
    for block in blocks:
        assert store.free_to_mem_pool(block) == OK
    handles = store.batch_get_buffer([keys("h")])
    assert isinstance(handles[0], BufferHandle)
    assert store.free_to_mem_pool(handles[0].ptr()) == INVALID_PARAMS
    del handle, view, handles
    gc.collect()


def test_get_buffer_stays_valid_after_remove_and_new_writes(store, keys, pool):
    data = b"A" * 100_000
    assert store.put(keys("b"), data) == OK
    handle = store.get_buffer(keys("b"))
    assert store.remove(keys("b"), True) == OK
    assert store.is_exist(keys("b")) == 0
    # New objects (likely in the space just freed) and new pool blocks, scribbled on.
    for i in range(4):
        assert store.put(keys(f"other{i}"), bytes([0x30 + i]) * 100_000) == OK
    assert store.put(keys("b"), b"C" * 100_000) == OK
    scratch = pool(4 * 100_000)
    ctypes.memset(scratch, 0xEE, 4 * 100_000)
    assert store.get_into(keys("other0"), scratch, 100_000) == 100_000
    second = store.get_buffer(keys("b"))
    assert bytes(second) == b"C" * 100_000
    assert bytes(handle) == data
    assert handle.ptr() != second.ptr()


def _handle_returns_block(store):
    """On a fresh store (64 MiB pool): a handle's block goes back to the pool when the last
    reference to the handle dies, not before."""
    pool_segments = lambda: dummy_entries(store.status(), os.getpid())[0]["segments"]  # noqa: E731
    assert store.put("b", b"x" * 5000) == OK
    handle = store.get_buffer("b")
    view = np.frombuffer(handle, dtype=np.uint8)
    del handle
    gc.collect()
    other = store.alloc_from_mem_pool(32 * MB)
    ctypes.memset(other, 0xEE, 32 * MB)
    assert view.tobytes() == b"x" * 5000  # the view keeps the handle's block alive
    assert store.free_to_mem_pool(other) == OK
    del view
    gc.collect()
    whole = store.alloc_from_mem_pool(64 * MB)  # the whole pool: only if nothing is left in it
    assert whole != 0
    assert pool_segments() == 2, "the pool grew: the handle's block was not returned"
    assert store.free_to_mem_pool(whole) == OK

    # The handle owns its block: the application cannot free it (-600), and it stays
    # allocated (and intact) until the handle is garbage-collected.
    handle = store.get_buffer("b")
    ptr = handle.ptr()
    assert store.free_to_mem_pool(ptr) == INVALID_PARAMS
    assert store.free_to_mem_pool(ptr) == INVALID_PARAMS
    filler = store.alloc_from_mem_pool(32 * MB)
    ctypes.memset(filler, 0xEE, 32 * MB)
    assert bytes(handle) == b"x" * 5000
    assert store.free_to_mem_pool(filler) == OK
    del handle
    gc.collect()
    whole = store.alloc_from_mem_pool(64 * MB)
    assert whole != 0 and pool_segments() == 2
    assert store.free_to_mem_pool(whole) == OK
    assert store.free_to_mem_pool(ptr) == INVALID_PARAMS  # freed by the handle, once


def test_get_buffer_block_returns_to_the_pool_dummy(start_client, connect):
    _handle_returns_block(connect(start_client().address))


def test_get_buffer_block_returns_to_the_pool_embedded(embedded):
    _handle_returns_block(embedded())


def test_batch_get_buffer(store, keys):
    names = keys.many(3)
    values = [b"one", b"two" * 1000, b"three" * 10]
    assert store.put_batch(names, values) == OK
    handles = store.batch_get_buffer([names[0], keys("missing"), names[1], names[2]])
    assert handles[1] is None
    assert [bytes(h) for h in (handles[0], handles[2], handles[3])] == values
    assert store.batch_get_buffer([]) == []


# ----- get_into_ranges (upstream test_get_into_ranges_operations) -----

DATA1 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DATA2 = b"abcdefghijklmnopqrstuvwxyz0123456789"


@pytest.fixture
def ranges_setup(store, keys, pool):
    k1, k2 = keys("r1"), keys("r2")
    assert store.put(k1, DATA1) == OK
    assert store.put(k2, DATA2) == OK
    b0, b1 = pool(32), pool(32)
    assert store.register_buffer(b0, 32) == OK
    assert store.register_buffer(b1, 32) == OK
    ctypes.memset(b0, ord("_"), 32)
    ctypes.memset(b1, ord("_"), 32)
    yield k1, k2, b0, b1
    assert store.unregister_buffer(b0) == OK
    assert store.unregister_buffer(b1) == OK


def test_get_into_ranges_upstream_example(store, ranges_setup):
    k1, k2, b0, b1 = ranges_setup
    result = store.get_into_ranges(
        [b0, b1],
        [[k1, k2], [k2, k1]],
        [[[0, 20], [8]], [[4], [16]]],
        [[[2, 30], [10]], [[0], [12]]],
        [[[4, 3], [6]], [[6], [4]]],
    )
    assert result == [[[4, 3], [6]], [[6], [4]]]
    assert read_at(b0, 4) == DATA1[2:6]
    assert read_at(b0 + 8, 6) == DATA2[10:16]
    assert read_at(b0 + 20, 3) == DATA1[30:33]
    assert read_at(b1 + 4, 6) == DATA2[0:6]
    assert read_at(b1 + 16, 4) == DATA1[12:16]
    assert read_at(b0, 32) == b"2345____klmnop______UVW_________"
    assert read_at(b1, 32) == b"____abcdef______CDEF____________"


def test_get_into_ranges_errors(store, ranges_setup):
    k1, k2, b0, _ = ranges_setup
    mismatch = store.get_into_ranges([b0], [[k1, k2]], [[[0], []]], [[[0, 1], []]], [[[4, 4], []]])
    assert len(mismatch) == 1 and len(mismatch[0]) == 2
    assert mismatch[0][0][0] < 0
    assert len(mismatch[0][1]) == 0
    assert store.get_into_ranges([b0], [[k1]], [[[0]]], [[[35]]], [[[4]]]) == [[[INVALID_PARAMS]]]  # past the object
    assert store.get_into_ranges([b0], [[k1]], [[[30]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]  # past the buffer
    missing = store.get_into_ranges([b0], [["missing-key", k1]], [[[0], [8]]], [[[0], [0]]], [[[4], [4]]])
    assert missing[0][0][0] == OBJECT_NOT_FOUND
    assert missing[0][1][0] == 4
    assert read_at(b0 + 8, 4) == DATA1[0:4]
    # Top-level length mismatch: every fragment fails, the shape follows the keys.
    assert store.get_into_ranges([b0, b0], [[k1]], [[[0]]], [[[0]]], [[[4]]]) == [[[INVALID_PARAMS]]]
    assert store.get_into_ranges([], [], [], [], []) == []
    # Zero-length fragment and an exact fit at the end of the buffer.
    assert store.get_into_ranges([b0], [[k1]], [[[0, 28]]], [[[0, 32]]], [[[0, 4]]]) == [[[INVALID_PARAMS, 4]]]
    assert read_at(b0 + 28, 4) == DATA1[32:36]


def test_get_into_ranges_into_unregistered_pool_block(store, keys, pool):
    assert store.put(keys("r"), DATA1) == OK
    block = pool(16)
    result = store.get_into_ranges([block], [[keys("r")]], [[[0, 8]]], [[[0, 10]]], [[[8, 8]]])
    assert result == [[[8, 8]]]
    assert read_at(block, 16) == DATA1[0:8] + DATA1[10:18]
    # The block's allocated size bounds the destination.
    assert store.get_into_ranges([block], [[keys("r")]], [[[12]]], [[[0]]], [[[8]]]) == [[[INVALID_PARAMS]]]


# ----- the pool -----


def test_alloc_and_free(store):
    ptr = store.alloc_from_mem_pool(1000)
    assert ptr != 0 and ptr % 64 == 0
    ctypes.memset(ptr, 1, 1000)
    assert store.free_to_mem_pool(ptr) == OK
    assert store.free_to_mem_pool(ptr) == INVALID_PARAMS
    assert store.free_to_mem_pool(0) == INVALID_PARAMS
    assert store.free_to_mem_pool(ptr + 64) == INVALID_PARAMS
    assert store.alloc_from_mem_pool(0) == 0
    blocks = [store.alloc_from_mem_pool(100) for _ in range(10)]
    assert len(set(blocks)) == 10 and all(blocks)
    assert all(store.free_to_mem_pool(b) == OK for b in blocks)


def _pool_growth(store, keys):
    ours = lambda: dummy_entries(store.status(), os.getpid())  # noqa: E731
    (before,) = ours()
    assert before["segments"] == 2 and before["mapped_bytes"] == 80 * MB
    first = store.alloc_from_mem_pool(48 * MB)
    second = store.alloc_from_mem_pool(48 * MB)  # does not fit in the 64 MiB pool: it grows
    third = store.alloc_from_mem_pool(100 * MB)  # larger than the growth step
    assert 0 not in (first, second, third)
    (after,) = ours()
    assert after["segments"] == 4
    assert after["mapped_bytes"] == 80 * MB + 64 * MB + 100 * MB
    for index, ptr in enumerate((first, second, third)):
        data = bytes([index + 1]) * (3 * MB)
        write_at(ptr, data)
        assert store.put_from(keys(f"g{index}"), ptr, len(data)) == OK
        ctypes.memset(ptr, 0, len(data))
        assert store.get_into(keys(f"g{index}"), ptr, 48 * MB) == len(data)
        assert read_at(ptr, len(data)) == data
    for ptr in (first, second, third):
        assert store.free_to_mem_pool(ptr) == OK
    # Freed blocks are reused: no further growth.
    again = store.alloc_from_mem_pool(48 * MB)
    assert again != 0
    (final,) = ours()
    assert final["segments"] == 4
    assert store.free_to_mem_pool(again) == OK


def test_pool_grows_beyond_initial_size_dummy(start_client, connect, keys):
    _pool_growth(connect(start_client().address), keys)


def test_pool_grows_beyond_initial_size_embedded(embedded, keys):
    _pool_growth(embedded(), keys)


def test_alloc_huge_returns_zero(store):
    assert store.alloc_from_mem_pool(1 << 62) == 0
    assert store.health_check() == 0


# ----- register_buffer -----


def test_register_sub_range_of_pool(store, keys, pool):
    assert store.put(keys("s"), b"sub-range!") == OK
    block = pool(4096)
    ctypes.memset(block, ord("."), 4096)
    assert store.register_buffer(block + 64, 128) == OK
    assert store.get_into(keys("s"), block + 64, 128) == 10
    assert read_at(block + 60, 16) == b"....sub-range!.."
    assert store.put_from(keys("t"), block + 64, 10) == OK
    assert store.get(keys("t")) == b"sub-range!"
    assert store.register_buffer(block + 64, 128) == OK  # again: no-op
    assert store.unregister_buffer(block + 64) == OK
    assert store.unregister_buffer(block + 64) == INVALID_PARAMS
    assert store.unregister_buffer(block + 65) == INVALID_PARAMS


def test_register_ordinary_memory_numpy(store, keys):
    array = np.zeros(4096, dtype=np.uint8)
    address = array.ctypes.data
    assert store.put(keys("n"), b"numpy bytes") == OK
    # Not registered: refused, untouched.
    assert store.get_into(keys("n"), address, 4096) == INVALID_PARAMS
    assert store.put_from(keys("x"), address, 16) == INVALID_PARAMS
    assert not array.any()

    assert store.register_buffer(address, array.nbytes) == OK
    try:
        assert store.get_into(keys("n"), address, 4096) == 11
        assert array[:11].tobytes() == b"numpy bytes"
        array[100:110] = np.arange(10, dtype=np.uint8)
        assert store.put_from(keys("p"), address + 100, 10) == OK
        assert store.get(keys("p")) == bytes(range(10))
        # Batch calls and ranged reads also copy through.
        assert store.batch_get_into([keys("n"), keys("p")], [address + 1000, address + 2000], [100, 100]) == [11, 10]
        assert array[1000:1011].tobytes() == b"numpy bytes"
        assert array[2000:2010].tobytes() == bytes(range(10))
        assert store.batch_put_from([keys("q")], [address + 1000], [11]) == [OK]
        assert store.get(keys("q")) == b"numpy bytes"
        assert store.get_into_ranges([address], [[keys("n")]], [[[3000]]], [[[6]]], [[[5]]]) == [[[5]]]
        assert array[3000:3005].tobytes() == b"bytes"
        # Past the end of the registered array: refused.
        assert store.get_into(keys("n"), address + 4090, 11) == INVALID_PARAMS
        assert store.put_from(keys("r"), address + 4090, 11) == INVALID_PARAMS
    finally:
        assert store.unregister_buffer(address) == OK
    assert store.put_from(keys("s"), address, 16) == INVALID_PARAMS
    assert store.unregister_buffer(address) == INVALID_PARAMS


def test_register_ordinary_memory_bytearray(store, keys):
    data = bytearray(b"bytearray payload" + b"\0" * 47)
    address = buffer_address(data)
    assert store.register_buffer(address, len(data)) == OK
    try:
        assert store.put_from(keys("b"), address, 17) == OK
        assert store.get(keys("b")) == b"bytearray payload"
        data[:] = b"\0" * len(data)
        assert store.get_into(keys("b"), address, len(data)) == 17
        assert bytes(data[:17]) == b"bytearray payload"
        assert store.upsert_from(keys("b"), address + 4, 5) == OK
        assert store.get(keys("b")) == b"array"
    finally:
        assert store.unregister_buffer(address) == OK


def test_register_ordinary_memory_larger_than_staging(store, keys):
    array = np.arange(20 * MB, dtype=np.uint8)  # > the 16 MiB staging buffer
    assert store.register_buffer(array.ctypes.data, array.nbytes) == OK
    try:
        assert store.put_from(keys("big"), array.ctypes.data, array.nbytes) == OK
        out = np.zeros_like(array)
        assert store.register_buffer(out.ctypes.data, out.nbytes) == OK
        # Larger than the staging buffer: read inline and copied in.
        assert store.get_into(keys("big"), out.ctypes.data, out.nbytes) == array.nbytes
        assert np.array_equal(out, array)
        assert store.unregister_buffer(out.ctypes.data) == OK
        assert store.get(keys("big")) == array.tobytes()
    finally:
        store.unregister_buffer(array.ctypes.data)


def test_nested_registrations_of_ordinary_memory(store, keys):
    array = np.zeros(1000, dtype=np.uint8)
    address = array.ctypes.data
    array[500:510] = 7
    assert store.register_buffer(address, 1000) == OK
    assert store.register_buffer(address + 10, 10) == OK
    try:
        assert store.put_from(keys("inner"), address + 12, 5) == OK
        assert store.put_from(keys("outer"), address + 500, 10) == OK
        assert store.get(keys("outer")) == bytes([7]) * 10
        assert store.get_into(keys("outer"), address + 900, 10) == 10
        assert array[900:910].tolist() == [7] * 10
        # Still refused past the end of the outer registration.
        assert store.put_from(keys("past"), address + 995, 10) == INVALID_PARAMS
        # Unregistering the inner one leaves the outer one working (and vice versa).
        assert store.unregister_buffer(address + 10) == OK
        assert store.put_from(keys("inner2"), address + 12, 5) == OK
        assert store.register_buffer(address + 10, 10) == OK
        assert store.unregister_buffer(address) == OK
        assert store.put_from(keys("inner3"), address + 12, 5) == OK
        assert store.put_from(keys("outer2"), address + 500, 10) == INVALID_PARAMS
    finally:
        store.unregister_buffer(address + 10)
        store.unregister_buffer(address)


def _get_into_larger_than_staging(store, keys):
    """A registered 16 MiB numpy buffer, a 4 MiB staging buffer and an 8 MiB object:
    get_into falls back to an inline transfer."""
    data = np.random.default_rng(7).integers(0, 256, 8 * MB, dtype=np.uint8)
    assert store.put(keys("obj"), data) == OK
    out = np.zeros(16 * MB, dtype=np.uint8)
    address = out.ctypes.data
    assert store.register_buffer(address, out.nbytes) == OK
    try:
        assert store.get_into(keys("obj"), address, out.nbytes) == data.nbytes
        assert np.array_equal(out[: data.nbytes], data)
        assert not out[data.nbytes :].any()  # nothing past the object
        # At an offset, and in a batch next to a small object.
        out[:] = 0
        assert store.put(keys("small"), b"small one") == OK
        result = store.batch_get_into([keys("small"), keys("obj")], [address, address + MB], [MB, 15 * MB])
        assert result == [9, data.nbytes]
        assert out[:9].tobytes() == b"small one"
        assert np.array_equal(out[MB : MB + data.nbytes], data)
        # Exact fit, too small, missing key.
        assert store.get_into(keys("obj"), address + 8 * MB, 8 * MB) == data.nbytes
        assert np.array_equal(out[8 * MB :], data)
        out[:] = 0
        assert store.get_into(keys("obj"), address, 8 * MB - 1) == INVALID_PARAMS
        assert store.get_into(keys("obj"), address, 6 * MB) == INVALID_PARAMS
        assert store.get_into(keys("missing"), address, out.nbytes) == OBJECT_NOT_FOUND
        assert not out.any()
        # Past the end of the registered buffer: refused.
        assert store.get_into(keys("obj"), address + 9 * MB, 8 * MB) == INVALID_PARAMS
        assert not out.any()
    finally:
        assert store.unregister_buffer(address) == OK
    # No longer registered: refused, untouched.
    assert store.get_into(keys("obj"), address, out.nbytes) == INVALID_PARAMS
    assert not out.any()
    assert store.health_check() == 0


def test_get_into_registered_buffer_larger_than_staging_dummy(real_client, connect, keys):
    store = connect(real_client.address, pool=16 * MB, staging=4 * MB)
    try:
        _get_into_larger_than_staging(store, keys)
    finally:
        store.remove_by_regex(keys.pattern, True)


def test_get_into_registered_buffer_larger_than_staging_embedded(embedded, keys):
    _get_into_larger_than_staging(embedded(segment=64 * MB, staging=4 * MB), keys)


def test_register_buffer_rejects_null_and_empty(store, pool):
    block = pool(64)
    assert store.register_buffer(0, 10) == INVALID_PARAMS
    assert store.register_buffer(block, 0) == INVALID_PARAMS
    assert store.unregister_buffer(0) == INVALID_PARAMS
    assert store.unregister_buffer(block) == INVALID_PARAMS  # never registered


def test_mixed_pool_and_ordinary_buffers_in_one_object(store, keys, pool):
    array = np.zeros(256, dtype=np.uint8)
    address = array.ctypes.data
    block = pool(256)
    assert store.register_buffer(address, 256) == OK
    try:
        array[:4] = np.frombuffer(b"META", dtype=np.uint8)
        write_at(block, b"DATA!")
        assert store.put_from_with_metadata(keys("m"), block, address, 5, 4) == OK
        assert store.get(keys("m")) == b"METADATA!"
        assert store.batch_put_from_multi_buffers([keys("n")], [[block, address]], [[5, 4]]) == [OK]
        assert store.get(keys("n")) == b"DATA!META"
        array[:] = 0
        ctypes.memset(block, 0, 256)
        assert store.batch_get_into_multi_buffers([keys("n")], [[address, block]], [[3, 100]]) == [9]
        assert array[:3].tobytes() == b"DAT"
        assert read_at(block, 7) == b"A!META\0"
        # One part in unregistered ordinary memory: the whole write is refused.
        stray = np.zeros(16, dtype=np.uint8)
        assert store.put_from_with_metadata(keys("x"), block, stray.ctypes.data, 5, 4) == INVALID_PARAMS
        assert store.is_exist(keys("x")) == 0
    finally:
        assert store.unregister_buffer(address) == OK
