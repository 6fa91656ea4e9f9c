"""Zero copy where it is promised: the bytes copied through staging (the process-wide
``copied_through_staging_bytes`` of ``status()``) stay at zero for memory the real
client can use in place, and count exactly the bytes of the copy-through path."""

import ctypes

import numpy as np

from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator

OK = 0
SIZE = 1 << 20


def copied(store):
    return store.status()["copied_through_staging_bytes"]


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
    before = copied(store)
    round_trip(store, keys("emb"), src, dst)
    assert copied(store) == before
    # Unregistered, the buffer is unknown again: refused, never read.
    assert store.unregister_buffer(src.ctypes.data) == OK
    assert store.put_from(keys("after"), src.ctypes.data, SIZE) < 0


def test_allocator_memory_is_zero_copy_in_dummy_mode(start_client, connect, keys):
    store = connect(start_client().address)
    allocator = MooncakeHostMemAllocator()
    ptrs = [allocator.alloc(SIZE), allocator.alloc(SIZE)]
    try:
        src, dst = (np.ctypeslib.as_array((ctypes.c_ubyte * SIZE).from_address(p)) for p in ptrs)
        src[:] = np.random.default_rng(2).integers(0, 256, SIZE, dtype=np.uint8)
        for p in ptrs:
            assert store.register_buffer(p, SIZE) == OK
        before = copied(store)
        round_trip(store, keys("alloc"), src, dst)
        assert copied(store) == before
    finally:
        for p in ptrs:
            store.unregister_buffer(p)
            allocator.free(p)


def test_heap_memory_in_dummy_mode_counts_every_copied_byte(start_client, connect, keys):
    store = connect(start_client().address)
    src = np.random.default_rng(3).integers(0, 256, SIZE, dtype=np.uint8)
    dst = np.zeros(SIZE, dtype=np.uint8)
    assert store.register_buffer(src.ctypes.data, SIZE) == OK
    assert store.register_buffer(dst.ctypes.data, SIZE) == OK
    before = copied(store)
    key = keys("heap")
    assert store.put_from(key, src.ctypes.data, SIZE) == OK
    assert copied(store) == before + SIZE
    assert store.get_into(key, dst.ctypes.data, SIZE) == SIZE
    assert copied(store) == before + 2 * SIZE
    assert np.array_equal(src, dst)
