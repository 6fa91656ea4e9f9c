"""Upstream's helper names in mooncake.store: buffer pools and leases, NUMA binding,
Engram tables, the NVMe-oF registration stub."""

import gc
import logging
import os
import threading
import time

import numpy as np
import pytest

from mooncake import store as mstore
from mooncake.store import (
    ERROR_CODES,
    BufferLease,
    BufferLeaseView,
    BufferPool,
    EngramStore,
    EngramStoreConfig,
    MooncakeDistributedNoFRegister,
    RegisteredBufferLease,
    RegisteredBufferLeaseView,
    RegisteredBufferPool,
    bind_to_numa_node,
)

OK = 0
KB = 1 << 10
MB = 1 << 20


def test_names_are_upstreams_aliases():
    assert RegisteredBufferPool is BufferPool
    assert RegisteredBufferLease is BufferLease
    assert RegisteredBufferLeaseView is BufferLeaseView
    for name in ("BufferPool", "BufferLease", "bind_to_numa_node", "EngramStore", "MooncakeDistributedNoFRegister"):
        assert name in mstore.__all__
    with pytest.raises(TypeError):
        BufferLease()


# ----- buffer pool: leases -----


def test_acquire_write_release_and_reuse(store):
    pool = BufferPool(store, min_size_class=4 * KB, alignment=4 * KB)
    lease = pool.acquire(1234)
    assert lease.size == 1234
    assert lease.ptr != 0
    lease.buffer[:4] = b"abcd"
    assert bytes(lease.buffer[:4]) == b"abcd"
    lease.release()
    lease.release()  # a second release does nothing
    with pytest.raises(RuntimeError, match="closed"):
        lease.ptr
    with pool.buffer(2048) as second:
        assert len(second.buffer) == 2048
    pool.close()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire(1)


@pytest.mark.parametrize("size", [0, 1, 128 * KB + 1])
def test_any_size(store, size):
    pool = BufferPool(store, MB, max_size_class=128 * KB, alignment=4 * KB)
    lease = pool.acquire(size)
    assert lease.size == size
    view = lease.buffer
    assert len(view) == size
    assert view.format == "B" and not view.readonly
    del view
    lease.release()
    pool.close()


def test_memoryview_keeps_lease_alive(store):
    pool = BufferPool(store, 4096, min_size_class=4096, alignment=4096)
    lease = pool.acquire(4)
    view = lease.buffer
    view[:] = b"test"
    assert isinstance(view.obj, BufferLeaseView)
    assert bytes(view.obj.buffer) == b"test"
    with pytest.raises(RuntimeError, match="exported views"):
        lease.release()
    del view
    gc.collect()
    lease.release()
    view = pool.acquire(4).buffer  # the view keeps its otherwise unreferenced lease
    view[:] = b"live"
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    view.release()
    gc.collect()
    pool.close()


def test_lease_released_by_destructor_and_close_refused_while_leased(store):
    pool = BufferPool(store, MB, min_size_class=4096, alignment=4096)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="active leases"):
        pool.close()
    del lease
    gc.collect()
    pool.close()


def test_invalid_arguments(store):
    with pytest.raises(RuntimeError, match="alignment"):
        BufferPool(store, MB, alignment=12345)
    with pytest.raises(RuntimeError, match="positive"):
        BufferPool(store, MB, min_size_class=0)
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(None)
    pool = BufferPool(store, MB, min_size_class=4096, alignment=4096)
    with pytest.raises(RuntimeError, match="overflow|capacity"):
        pool.acquire((1 << 64) - 1)
    with pytest.raises(RuntimeError, match="capacity"):
        pool.acquire(MB + 1)
    with pytest.raises(RuntimeError, match="non-negative"):
        pool.acquire(1, timeout=-1)
    with pytest.raises(TypeError):
        pool.acquire(-1)
    pool.close()


def test_unset_store_is_refused():
    with pytest.raises(RuntimeError, match="not initialized"):
        BufferPool(mstore.MooncakeDistributedStore())


# ----- buffer pool: exhaustion -----


def test_nonblocking_exhaustion(store):
    pool = BufferPool(store, min_size_class=4096, max_size_class=4096, alignment=4096, max_regions=1, block_on_exhaustion=False)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1)
    lease.release()
    pool.acquire(1).release()
    pool.close()


def test_max_bytes_exhaustion_per_call(store):
    pool = BufferPool(store, 8 * KB, min_size_class=4096, alignment=4096)
    lease = pool.acquire(8 * KB)
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.acquire(1, block=False)
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(1, timeout=0.05)
    lease.release()
    pool.close()


def test_default_timeout(store):
    pool = BufferPool(store, min_size_class=4096, alignment=4096, max_regions=1, default_timeout=0.05)
    lease = pool.acquire(1)
    with pytest.raises(RuntimeError, match="timed out"):
        pool.acquire(1)
    lease.release()
    pool.close()


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_blocked_acquire_gets_released_buffer(store, timeout):
    pool = BufferPool(store, min_size_class=4096, max_size_class=4096, alignment=4096, max_regions=1)
    lease = pool.acquire(1)
    acquired = []
    thread = threading.Thread(target=lambda: acquired.append(pool.acquire(1, timeout=timeout)))
    thread.start()
    time.sleep(0.1)
    assert not acquired  # still waiting (and not holding the GIL: we got here)
    lease.release()
    thread.join(timeout=5)
    assert not thread.is_alive()
    acquired[0].release()
    pool.close()


def test_many_threads(store):
    pool = BufferPool(store, 64 * KB, min_size_class=4096, alignment=4096, max_regions=4)
    errors = []

    def work(i):
        try:
            for _ in range(50):
                with pool.acquire(4096) as lease:
                    lease.buffer[:] = bytes([i]) * 4096
                    assert bytes(lease.buffer) == bytes([i]) * 4096
        except Exception as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    stats = pool._stats()
    assert stats["in_use"] == 0 and stats["acquire"] == 400
    pool.close()


# ----- buffer pool: registered regions -----


class _NoSharedPool:
    """A store whose shared pool is full: every lease is a registered region."""

    def __init__(self, store):
        self._store = store
        self.registered = set()

    def health_check(self):
        return self._store.health_check()

    def alloc_from_mem_pool(self, size):
        return 0

    def free_to_mem_pool(self, ptr):
        return ERROR_CODES["INVALID_PARAMS"]

    def register_buffer(self, ptr, size):
        rc = self._store.register_buffer(ptr, size)
        if rc == 0:
            self.registered.add(ptr)
        return rc

    def unregister_buffer(self, ptr):
        self.registered.discard(ptr)
        return self._store.unregister_buffer(ptr)


def test_prewarm_registers_regions_that_leases_reuse(store):
    wrapped = _NoSharedPool(store)
    pool = RegisteredBufferPool(wrapped, MB, min_size_class=4096, alignment=4096, prewarm_size=1000, prewarm_count=2)
    assert len(wrapped.registered) == 2
    assert pool._stats()["size_classes"] == {4096: 2}
    first, second = pool.acquire(1000), pool.acquire(4000)
    assert {first.ptr, second.ptr} == wrapped.registered
    assert first.ptr % 4096 == 0 and second.ptr % 4096 == 0
    assert pool._stats()["reuse"] == 2
    first.release()
    second.release()
    pool.prewarm(5000, 1)  # size class 8192
    with pytest.raises(RuntimeError, match="oversize"):
        pool.prewarm(2 * MB, 1)
    assert len(wrapped.registered) == 3
    pool.close()
    assert not wrapped.registered


def test_registered_regions_put_from_get_into_byte_exact(store, keys):
    wrapped = _NoSharedPool(store)
    pool = BufferPool(wrapped, 16 * MB, min_size_class=64 * KB, alignment=MB)
    data = np.random.default_rng(7).integers(0, 256, 3 * MB + 17, dtype=np.uint8).tobytes()
    with pool.acquire(len(data)) as src, pool.acquire(len(data)) as dst:
        assert src.ptr % MB == 0
        src.buffer[:] = data
        assert store.put_from(keys("a"), src.ptr, src.size) == OK
        assert store.get(keys("a")) == data
        assert store.get_into(keys("a"), dst.ptr, dst.size) == len(data)
        assert bytes(dst.buffer) == data
    assert pool._stats()["kept_regions"] == 2
    pool.close()
    assert not wrapped.registered


def test_regions_from_mmap_without_the_host_allocator(store, keys, monkeypatch):
    from mooncake import _extras

    monkeypatch.setattr(_extras, "_HostMemAllocator", None)
    wrapped = _NoSharedPool(store)
    pool = BufferPool(wrapped, 4 * MB, min_size_class=4096, alignment=64 * KB)
    data = os.urandom(100 * KB)
    with pool.acquire(len(data)) as src, pool.acquire(len(data)) as dst:
        assert src.ptr % (64 * KB) == 0
        src.buffer[:] = data
        assert store.put_from(keys("m"), src.ptr, src.size) == OK
        assert store.get_into(keys("m"), dst.ptr, dst.size) == len(data)
        assert bytes(dst.buffer) == data
    pool.close()
    assert not wrapped.registered


def test_oversize_region_is_not_kept(store):
    wrapped = _NoSharedPool(store)
    pool = BufferPool(wrapped, MB, min_size_class=4096, max_size_class=8192, alignment=4096)
    lease = pool.acquire(100 * KB)
    assert len(wrapped.registered) == 1
    lease.release()
    assert not wrapped.registered
    assert pool._stats()["oversize_allocate"] == 1
    pool.close()


def test_kept_regions_are_evicted_for_another_size_class(store):
    wrapped = _NoSharedPool(store)
    pool = BufferPool(wrapped, 64 * KB, min_size_class=4096, alignment=4096, block_on_exhaustion=False)
    pool.prewarm(4096, 16)  # fills max_bytes with kept 4 KiB regions
    lease = pool.acquire(32 * KB)  # needs room: kept regions go
    assert pool._stats()["total_bytes"] <= 64 * KB
    lease.release()
    pool.close()
    assert not wrapped.registered


def test_shared_pool_leases_put_from_get_into_byte_exact(store, keys):
    pool = BufferPool(store)
    data = os.urandom(MB + 3)
    with pool.acquire(len(data)) as src, pool.acquire(len(data)) as dst:
        src.buffer[:] = data
        assert store.put_from(keys("b"), src.ptr, src.size) == OK
        assert store.get_into(keys("b"), dst.ptr, dst.size) == len(data)
        assert bytes(dst.buffer) == data
    assert pool._stats()["shared_pool"] == 2
    pool.close()


# ----- NUMA -----


def _node0_cpus():
    try:
        with open("/sys/devices/system/node/node0/cpulist") as f:
            text = f.read().strip()
    except OSError:
        return None
    cpus = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def test_bind_to_numa_node_0():
    cpus = _node0_cpus()
    if cpus is None:
        pytest.skip("no NUMA information in sysfs")
    result = []

    def run():  # in a thread of its own: the binding is per thread
        before = os.sched_getaffinity(0)
        assert bind_to_numa_node(0) is None
        result.append((before, os.sched_getaffinity(0)))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    before, after = result[0]
    assert after == cpus & before or after == cpus


def test_bind_to_unknown_numa_node_warns_and_returns(caplog):
    result = []

    def run():
        before = os.sched_getaffinity(0)
        with caplog.at_level(logging.WARNING, logger="mooncake"):
            result.append(bind_to_numa_node(4095))
        result.append(before == os.sched_getaffinity(0))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert result == [None, True]
    assert "Invalid NUMA node" in caplog.text or "NUMA is not available" in caplog.text


# ----- Engram -----


def _config(vocab, dim):
    config = EngramStoreConfig()
    config.table_vocab_sizes = vocab
    config.embedding_dim = dim
    return config


def test_engram_config_defaults_and_validation():
    config = EngramStoreConfig()
    assert config.table_vocab_sizes == [1024] and config.embedding_dim == 64
    engram = EngramStore(3, _config([5, 7], 4))
    assert engram.get_store_keys() == ["engram:l3:h0", "engram:l3:h1"]
    assert engram.get_num_heads() == 2 and engram.get_embedding_dim() == 4
    assert engram.get_table_vocab_sizes() == [5, 7]
    with pytest.raises(ValueError, match="must not be empty"):
        EngramStore(0, _config([], 4))
    with pytest.raises(ValueError, match="positive"):
        EngramStore(0, _config([3, 0], 4))
    with pytest.raises(ValueError, match="positive"):
        EngramStore(0, _config([3], 0))
    with pytest.raises(RuntimeError, match="rc=-600"):
        engram.remove_from_store()  # no store
    with pytest.raises(RuntimeError, match="lookup failed"):
        engram.lookup(np.zeros((1, 1, 2), dtype=np.int64))


def test_engram_populate_lookup_remove(store, keys):
    layer = abs(hash(keys.prefix)) % 1_000_000
    vocab, dim = [5, 9, 3], 8
    engram = EngramStore(layer, _config(vocab, dim), store)
    rng = np.random.default_rng(1)
    tables = [rng.standard_normal((v, dim)).astype(np.float32) for v in vocab]
    try:
        engram.populate(tables)
        with pytest.raises(RuntimeError, match="populate failed"):
            engram.populate(tables)  # the keys exist
        ids = np.array([[[0, 8, 2], [4, 1, 0]], [[3, 3, 1], [2, 7, 2]]], dtype=np.int64)
        out = engram.lookup(ids)
        assert out.shape == (2, 2, 3, dim) and out.dtype == np.float32
        for b in range(2):
            for token in range(2):
                for h in range(3):
                    assert np.array_equal(out[b, token, h], tables[h][ids[b, token, h]])
        assert np.array_equal(engram.lookup(ids.tolist()), out)  # nested lists
        with pytest.raises(RuntimeError, match="lookup failed"):
            engram.lookup(np.array([[[5, 0, 0]]]))  # row 5 of a 5-row table
        with pytest.raises(RuntimeError, match="num_heads"):
            engram.lookup(np.zeros((1, 1, 2), dtype=np.int64))
        with pytest.raises(RuntimeError, match="must not be empty"):
            engram.lookup([])
        with pytest.raises(RuntimeError, match="shape"):
            engram.populate([np.zeros((5, dim), np.float32)] * 3)
    finally:
        assert engram.remove_from_store(force=True) == 3
    assert engram.remove_from_store(force=True) == 0  # missing keys are ignored


# ----- NVMe-oF -----


def test_nof_register_is_not_supported(caplog):
    register = MooncakeDistributedNoFRegister()
    with caplog.at_level(logging.WARNING, logger="mooncake"):
        rc = register.real_register("nqn.2024-01.io.test", 1, "127.0.0.1", 4420, 0, MB, "127.0.0.1:50051")
        rc2 = register.real_unregister_by_endpoint("nqn.2024-01.io.test", 1, "127.0.0.1", 4420, "127.0.0.1:50051")
    assert rc == rc2 == ERROR_CODES["NOT_SUPPORTED"] == -1012
