"""The drop-in surface: every public name of upstream's ``mooncake.store`` (0.3.13)
exists, and the calls added for it behave as upstream's do."""

import ctypes
import importlib
import logging

import numpy as np
import pytest

import mooncake.store as store_module
from mooncake.store import (
    ERROR_CODES,
    MooncakeDistributedStore,
    MooncakeHostMemAllocator,
    ReplicateConfig,
    get_alloc_func_addr,
    get_free_func_addr,
)
from upstream_names import UPSTREAM_CONFIG, UPSTREAM_MODULE, UPSTREAM_STORE, UPSTREAM_STORE_MODULES

OK = 0
INVALID_PARAMS = ERROR_CODES["INVALID_PARAMS"]
OBJECT_NOT_FOUND = ERROR_CODES["OBJECT_NOT_FOUND"]
OBJECT_ALREADY_EXISTS = ERROR_CODES["OBJECT_ALREADY_EXISTS"]
NOT_SUPPORTED = ERROR_CODES["NOT_SUPPORTED"]


def _missing(expected, obj):
    return sorted(set(expected) - set(dir(obj)))


def test_every_upstream_module_name_exists():
    assert _missing(UPSTREAM_MODULE, store_module) == []


def test_every_upstream_store_method_exists():
    assert _missing(UPSTREAM_STORE, MooncakeDistributedStore) == []
    for name in UPSTREAM_STORE:
        assert callable(getattr(MooncakeDistributedStore, name)), name


def test_every_upstream_replicate_config_field_exists():
    assert _missing(UPSTREAM_CONFIG, ReplicateConfig) == []


@pytest.mark.parametrize("name", UPSTREAM_STORE_MODULES)
def test_upstream_store_modules_import(name):
    importlib.import_module(f"mooncake.{name}")


# ----- ReplicateConfig -----


def test_replicate_config_defaults_match_upstream():
    config = ReplicateConfig()
    assert config.replica_num == 1
    assert config.group_ids is None
    assert int(config.data_type) == 0
    assert config.nof_replica_num == 0 and config.dfs_replica_num == 0
    assert config.preferred_nof_segments == []
    assert config.soft_pin_ttl_ms is None
    assert str(config).startswith("ReplicateConfig: { replica_num: 1, nof_replica_num: 0")


def test_replicate_config_new_fields_round_trip():
    config = ReplicateConfig()
    config.group_ids = ["g0", "g1"]
    config.data_type = store_module.ObjectDataType.KVCACHE
    config.nof_replica_num = 2
    config.preferred_nof_segments = ["a"]
    assert config.group_ids == ["g0", "g1"]
    assert config.data_type == store_module.ObjectDataType.KVCACHE
    assert config.nof_replica_num == 2 and config.preferred_nof_segments == ["a"]
    assert "group_ids: [g0, g1]" in str(config) and "data_type: KVCACHE" in str(config)


def test_replicate_config_wrong_types_raise_type_error_like_upstream():
    config = ReplicateConfig()
    with pytest.raises(TypeError):
        config.soft_pin_ttl_ms = -1
    with pytest.raises(TypeError):
        config.replica_num = -1
    with pytest.raises(TypeError):
        config.group_ids = [1]
    config.soft_pin_ttl_ms = None
    assert config.soft_pin_ttl_ms is None


# ----- host memory allocator -----


def test_host_allocator_memory_is_zero_copy_in_dummy_mode(start_client, keys):
    client = start_client()
    allocator = MooncakeHostMemAllocator()
    size = 4 << 20
    ptr = allocator.alloc(size)
    assert ptr != 0
    pool = np.ctypeslib.as_array((ctypes.c_ubyte * size).from_address(ptr))
    pool[:] = np.arange(size, dtype=np.uint64).astype(np.uint8)
    store = MooncakeDistributedStore()
    try:
        # Allocated before the store exists, as SGLang's standalone mode does: the
        # real client maps it at setup, next to the pool and the staging buffer.
        assert store.setup_dummy(16 << 20, 16 << 20, client.address) == 0
        mapped = store.status()["mapped_bytes"]
        assert mapped >= (16 << 20) * 2 + size
        assert store.register_buffer(ptr, size) == OK
        half = size // 2
        key = keys("host")
        assert store.batch_put_from_multi_buffers([key], [[ptr, ptr + half]], [[half, half]]) == [OK]
        # Allocated after setup: mapped when registered.
        out = allocator.alloc(size)
        assert store.register_buffer(out, size) == OK
        assert store.status()["mapped_bytes"] == mapped + size
        assert store.get_into(key, out, size) == size
        assert bytes((ctypes.c_ubyte * size).from_address(out)) == bytes(pool)
        assert store.remove(key, True) == OK
        assert allocator.free(out) == 0
    finally:
        store.close()
        assert allocator.free(ptr) == 0
    assert allocator.free(ptr) == -1


def test_alloc_func_addr_allocates_through_c_entry_points():
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(get_alloc_func_addr())
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(get_free_func_addr())
    ptr = alloc(1 << 20)
    assert ptr
    ctypes.memset(ptr, 7, 1 << 20)
    assert bytes((ctypes.c_ubyte * 4).from_address(ptr)) == b"\x07" * 4
    free(ptr)
    assert MooncakeHostMemAllocator().free(ptr) == -1


# ----- embedded setup -----


def test_two_embedded_stores_have_their_own_segments():
    first, second = MooncakeDistributedStore(), MooncakeDistributedStore()
    try:
        assert first.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", "embedded") == 0
        assert second.setup("localhost", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", "embedded") == 0
        names = {first.get_hostname(), second.get_hostname()}
        assert len(names) == 2
        for name in names:
            host, _, port = name.rpartition(":")
            assert host == "localhost" and 12300 <= int(port) < 14300, name
    finally:
        first.close()
        second.close()


def test_local_hostname_with_a_port_keeps_it():
    store = MooncakeDistributedStore()
    try:
        assert store.setup("localhost:13999", "P2PHANDSHAKE", 32 << 20, 16 << 20, "tcp", "", "embedded") == 0
        assert store.get_hostname() == "localhost:13999"
        assert store.put("k", b"v") == OK and store.get("k") == b"v"
    finally:
        store.close()


def test_unusable_size_is_an_error_code_not_an_exception(caplog):
    store = MooncakeDistributedStore()
    with caplog.at_level(logging.ERROR, logger="mooncake"):
        assert store.setup("localhost", "P2PHANDSHAKE", "50%", 16 << 20, "tcp", "", "embedded") == -1
    assert "50%" in caplog.text


# ----- sessions -----


def test_put_session_writes_ranges_and_publishes_at_end(store, keys, pool):
    key, other = keys("s"), keys("other")
    buf = pool(1 << 20)
    ctypes.memmove(buf, bytes(range(256)) * 4096, 1 << 20)
    assert store.batch_put_session_start([key, other], [1 << 20, 10]) == [OK, OK]
    assert store.batch_put_session_start([key], [5]) == [OBJECT_ALREADY_EXISTS]
    half = 1 << 19
    assert store.batch_put_from_multi_buffer_ranges([key], [[buf + half, buf]], [[half, half]], [[half, 0]]) == [OK]
    # A range past the reserved size is refused and writes nothing.
    assert store.batch_put_from_multi_buffer_ranges([key], [[buf]], [[16]], [[(1 << 20) - 8]]) == [INVALID_PARAMS]
    assert store.batch_put_from_multi_buffer_ranges([keys("none")], [[buf]], [[1]], [[0]]) == [OBJECT_NOT_FOUND]
    assert store.is_exist(key) == 0
    assert store.batch_put_session_revoke([other]) == [OK]
    assert store.batch_put_session_end([key, other]) == [OK, OBJECT_NOT_FOUND]
    assert store.get(key) == bytes(range(256)) * 4096
    assert store.is_exist(other) == 0
    assert store.batch_put_session_start([key], [4]) == [OBJECT_ALREADY_EXISTS]


def test_get_session_reads_ranges(store, keys, pool):
    key = keys("g")
    value = bytes(range(200))
    assert store.put(key, value) == OK
    assert store.batch_get_session_start([key, keys("missing")]) == [200, OBJECT_NOT_FOUND]
    a, b = pool(64), pool(64)
    got = store.batch_get_into_multi_buffer_ranges([key], [[a, b]], [[10, 20]], [[5, 150]])
    assert got == [30]
    assert bytes((ctypes.c_ubyte * 10).from_address(a)) == value[5:15]
    assert bytes((ctypes.c_ubyte * 20).from_address(b)) == value[150:170]
    assert store.batch_get_into_multi_buffer_ranges([key], [[a]], [[10]], [[195]])[0] < 0
    assert store.batch_get_session_end([key]) == 0


# ----- other upstream calls -----


def test_segment_calls_answer_not_supported(store, caplog):
    with caplog.at_level(logging.WARNING, logger="mooncake"):
        assert store.mount_segment("/dev/shm/x", 1 << 20)["code"] == NOT_SUPPORTED
        assert store.allocate_and_mount_segment(1 << 20)["code"] == NOT_SUPPORTED
        assert store.unmount_segment(["1"]) == NOT_SUPPORTED
        assert store.unmount_and_free_segment(["1"]) == NOT_SUPPORTED
        assert store.unmount_local_disk_segment() == NOT_SUPPORTED


def test_init_all_after_setup(store):
    assert store.init_all("tcp", "", 1 << 20) == 0
    assert MooncakeDistributedStore().init_all("tcp", "", 1 << 20) == -1


def test_batch_replica_clear_keeps_objects_used_within_a_lease(store, keys):
    # Clearing idle objects (and one segment's replicas): test_replica_clear.py.
    a, b = keys("a"), keys("b")
    assert store.put(a, b"1") == OK and store.put(b, b"2") == OK
    assert store.batch_replica_clear([a, keys("missing")], "no-such-segment:1") == []
    assert store.batch_replica_clear([a, keys("missing")], store.get_hostname()) == []
    assert store.batch_replica_clear([b]) == []
    assert store.batch_is_exist([a, b]) == [1, 1]


def test_offload_rpc_read_count_starts_at_zero(store):
    assert store.get_offload_rpc_read_count() >= 0


def test_put_of_bytes_needs_the_local_buffer_like_upstream(embedded, keys):
    # Upstream: setup succeeds, bytes puts fail with INVALID_PARAMS and store nothing.
    store = embedded(staging=0)
    key = keys("zero")
    assert store.put(key, b"value") == INVALID_PARAMS
    assert store.put_parts(key, b"a", b"b") == INVALID_PARAMS
    assert store.put_batch([key], [b"v"]) == INVALID_PARAMS
    assert store.upsert(key, b"v") == INVALID_PARAMS
    assert store.is_exist(key) == 0
    # Registered memory does not need the local buffer.
    buf = store.alloc_from_mem_pool(16)
    ctypes.memmove(buf, b"x" * 16, 16)
    assert store.put_from(key, buf, 16) == OK
    assert store.get_size(key) == 16
    store.free_to_mem_pool(buf)
