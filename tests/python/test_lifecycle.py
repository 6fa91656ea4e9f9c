"""Setup (dummy, embedded, from the environment), close, health and real-client restarts."""

import ctypes
import gc
import json
import os
import time

import numpy as np
import pytest

from mooncake_testlib import buffer_address, dummy_entries, wait_until

from mooncake.store import MooncakeDistributedStore

OK = 0
RPC_FAIL = -900
MB = 1 << 20


def embedded_config(host="localhost", **extra):
    """A setup() dict for an embedded store with a 16 MB segment."""
    return {
        "local_hostname": host,
        "global_segment_size": 16 * MB,
        "local_buffer_size": 4 * MB,
        "protocol": "tcp",
        "master_server_addr": "embedded",
        **extra,
    }


def _every_call_fails_cleanly(store):
    """Every call on a store that is closed (or never set up) returns an error value."""
    assert store.health_check() == 1
    assert store.put("k", b"v") < 0
    assert store.put_parts("k", b"a", b"b") < 0
    assert store.put_batch(["k"], [b"v"]) < 0
    assert store.upsert("k", b"v") < 0
    assert store.upsert_parts("k", b"v") < 0
    assert store.upsert_batch(["k"], [b"v"]) < 0
    assert store.get("k") == b""
    assert store.get_batch(["k", "l"]) == [b"", b""]
    assert store.get_buffer("k") is None
    assert store.batch_get_buffer(["k"]) == [None]
    assert store.get_size("k") < 0
    assert store.is_exist("k") < 0
    assert all(code < 0 for code in store.batch_is_exist(["k", "l"]))
    assert store.remove("k") < 0
    assert store.remove("k", True) < 0
    assert all(code < 0 for code in store.batch_remove(["k"]))
    assert store.remove_by_regex(".*") < 0
    assert store.remove_all() < 0
    assert store.alloc_from_mem_pool(4096) == 0
    assert store.free_to_mem_pool(12345) < 0
    assert store.unregister_buffer(12345) < 0
    assert store.get_into("k", 12345, 10) < 0
    assert all(code < 0 for code in store.batch_get_into(["k"], [12345], [10]))
    assert store.put_from("k", 12345, 10) < 0
    assert all(code < 0 for code in store.batch_put_from(["k"], [12345], [10]))
    assert store.upsert_from("k", 12345, 10) < 0
    assert all(code < 0 for code in store.batch_upsert_from(["k"], [12345], [10]))
    assert store.put_from_with_metadata("k", 12345, 12345, 10, 10) < 0
    assert all(code < 0 for code in store.batch_put_from_multi_buffers(["k"], [[12345]], [[10]]))
    assert all(code < 0 for code in store.batch_get_into_multi_buffers(["k"], [[12345]], [[10]]))
    result = store.get_into_ranges([12345], [["k"]], [[[0]]], [[[0]]], [[[4]]])
    assert len(result) == 1 and len(result[0]) == 1 and result[0][0][0] < 0
    assert store.get_replica_desc("k") == []
    assert store.batch_get_replica_desc(["k"]) == {}
    task, code = store.create_copy_task("k", ["x:1"])
    assert task is None and code < 0
    task, code = store.create_move_task("k", "x:1", "y:2")
    assert task is None and code < 0
    info, code = store.query_task(1)
    assert info is None and code < 0
    assert store.status() is None
    assert store.get_hostname() == ""
    assert store.put_tensor("k", np.zeros(3)) < 0
    assert store.get_tensor("k") is None
    assert store.close() == OK


def test_close_then_every_call_returns_an_error(real_client, connect):
    store = connect(real_client.address, pool=4 * MB, staging=4 * MB)
    assert store.put("closing-key", b"v") == OK
    assert store.close() == OK
    _every_call_fails_cleanly(store)
    assert store.close() == OK


def test_buffer_handle_outlives_close(real_client, connect):
    store = connect(real_client.address, pool=4 * MB, staging=4 * MB)
    assert store.upsert("handle-after-close", b"still readable") == OK
    handle = store.get_buffer("handle-after-close")
    tensor_key = "tensor-after-close"
    assert store.upsert_tensor(tensor_key, np.arange(10)) == OK
    tensor = store.get_tensor(tensor_key)
    assert store.close() == OK
    assert bytes(handle) == b"still readable"
    assert tensor.tolist() == list(range(10))
    del handle, tensor
    gc.collect()


def test_close_embedded(embedded):
    store = embedded()
    assert store.put("k", b"v") == OK
    assert store.close() == OK
    _every_call_fails_cleanly(store)


def test_store_never_set_up():
    store = MooncakeDistributedStore()
    assert store.register_buffer(12345, 10) < 0
    _every_call_fails_cleanly(store)


def test_close_detaches_the_dummy(start_client, connect):
    client = start_client()
    watcher = connect(client.address, pool=2 * MB, staging=2 * MB)
    store = connect(client.address, pool=8 * MB, staging=4 * MB)
    # Listed as soon as setup_dummy returns.
    assert len(watcher.status()["dummies"]) == 2
    store.close()  # the object stays alive (the fixture holds it): close() alone detaches
    assert wait_until(lambda: len(watcher.status()["dummies"]) == 1, timeout=2)
    (left,) = watcher.status()["dummies"]
    assert left["mapped_bytes"] == 4 * MB
    assert store.health_check() == 1


def test_dropping_a_store_detaches_the_dummy(start_client, connect):
    client = start_client()
    watcher = connect(client.address, pool=2 * MB, staging=2 * MB)
    store = MooncakeDistributedStore()
    assert store.setup_dummy(8 * MB, 4 * MB, client.address) == OK
    assert wait_until(lambda: len(watcher.status()["dummies"]) == 2)
    del store
    gc.collect()
    assert wait_until(lambda: len(watcher.status()["dummies"]) == 1)
    (left,) = watcher.status()["dummies"]
    assert left["mapped_bytes"] == 4 * MB


def test_register_buffer_after_close_fails(real_client, connect):
    store = connect(real_client.address, pool=4 * MB, staging=4 * MB)
    data = bytearray(64)
    address = buffer_address(data)
    assert store.register_buffer(address, len(data)) == OK
    store.close()
    assert store.register_buffer(address, len(data)) == RPC_FAIL
    assert store.register_buffer(address + 8, 8) == RPC_FAIL
    assert store.unregister_buffer(address) == RPC_FAIL
    assert store.put_from("after-close", address, 8) < 0


def test_setup_again_after_close(start_client, connect):
    client = start_client()
    store = connect(client.address, pool=4 * MB, staging=4 * MB)
    assert store.put("a", b"v") == OK
    store.close()
    assert store.setup_dummy(4 * MB, 4 * MB, client.address) == OK
    assert store.health_check() == 0
    assert store.get("a") == b"v"


def test_setup_dummy_failures(log_dir):
    store = MooncakeDistributedStore()
    started = time.monotonic()
    assert store.setup_dummy(MB, MB, "127.0.0.1:1") == -1  # nothing listens there
    assert store.setup_dummy(MB, MB, "not an address:::") == -1
    assert store.setup_dummy(MB, MB, f"unix:{log_dir}/no-such.sock") == -1
    assert time.monotonic() - started < 5
    assert store.health_check() == 1


def test_setup_dummy_sizes_as_strings(start_client, connect):
    client = start_client()
    store = MooncakeDistributedStore()
    assert store.setup_dummy("32MB", "8MB", client.address) == OK
    try:
        (entry,) = store.status()["dummies"]
        assert entry["mapped_bytes"] == 40 * MB
        assert entry["pid"] == os.getpid()
        assert entry["uid"] == os.getuid()
    finally:
        store.close()
    with pytest.raises(ValueError):
        store.setup_dummy("lots", "8MB", client.address)


def test_setup_from_env_dummy(start_client, monkeypatch):
    client = start_client()
    monkeypatch.setenv("MOONCAKE_CLIENT", client.address)
    monkeypatch.setenv("MOONCAKE_MEM_POOL_SIZE", "32MB")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "8MB")
    store = MooncakeDistributedStore()
    assert store.setup_from_env() == OK
    try:
        assert store.get_hostname() == f"0.0.0.0:{client.port}"
        (entry,) = store.status()["dummies"]
        assert entry["mapped_bytes"] == 40 * MB
        assert store.put("env", b"works") == OK
        assert store.get("env") == b"works"
    finally:
        store.close()


def test_setup_dummy_without_address_reads_mooncake_client(start_client, monkeypatch):
    client = start_client()
    monkeypatch.setenv("MOONCAKE_CLIENT", client.address)
    store = MooncakeDistributedStore()
    assert store.setup_dummy(4 * MB, 4 * MB, "") == OK
    try:
        assert store.status()["pid"] == client.pid
    finally:
        store.close()


def test_setup_from_env_embedded(monkeypatch):
    monkeypatch.delenv("MOONCAKE_CLIENT", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "32MB")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "4MB")
    monkeypatch.setenv("MOONCAKE_MASTER", "embedded")
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "envhost")
    store = MooncakeDistributedStore()
    assert store.setup_from_env() == OK
    try:
        status = store.status()
        assert status["pid"] == os.getpid()
        assert [s["capacity"] for s in status["segments"]] == [32 * MB]
        assert store.get_hostname().startswith("envhost:")
        assert store.put("k", b"v") == OK and store.get("k") == b"v"
    finally:
        store.close()


def test_setup_from_env_config_path(monkeypatch, tmp_path):
    path = tmp_path / "mooncake.json"
    path.write_text(
        json.dumps(
            {
                "local_hostname": "cfghost",
                "metadata_server": "P2PHANDSHAKE",
                "global_segment_size": "16MB",
                "local_buffer_size": 4 * MB,
                "protocol": "tcp",
                "device_name": "",
                "master_server_address": "embedded",
            }
        )
    )
    monkeypatch.delenv("MOONCAKE_CLIENT", raising=False)
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    store = MooncakeDistributedStore()
    assert store.setup_from_env() == OK
    try:
        assert store.get_hostname().startswith("cfghost:")
        assert [s["capacity"] for s in store.status()["segments"]] == [16 * MB]
    finally:
        store.close()
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(tmp_path / "missing.json"))
    assert MooncakeDistributedStore().setup_from_env() == -1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(bad))
    assert MooncakeDistributedStore().setup_from_env() == -1


def test_setup_dict_form(embedded):
    store = MooncakeDistributedStore()
    config = {
        "local_hostname": "dicthost",
        "metadata_server": "P2PHANDSHAKE",
        "global_segment_size": 16 * MB,
        "local_buffer_size": 4 * MB,
        "protocol": "tcp",
        "master_server_addr": "embedded",
    }
    assert store.setup(config) == OK
    try:
        assert store.get_hostname().startswith("dicthost:")
        assert store.put("k", b"dict") == OK and store.get("k") == b"dict"
    finally:
        store.close()


@pytest.mark.parametrize("value", ["false", "False", "0", "no", "off", False, 0, None])
def test_setup_dict_ssd_offload_off(value):
    store = MooncakeDistributedStore()
    config = embedded_config("offhost", enable_ssd_offload=value)
    if value is None:
        del config["enable_ssd_offload"]
    assert store.setup(config) == OK
    try:
        assert store.health_check() == 0
        assert store.put("k", b"no offload") == OK and store.get("k") == b"no offload"
    finally:
        store.close()


def test_setup_dict_ssd_offload_on_or_invalid():
    config = {
        "local_hostname": "onhost",
        "global_segment_size": 16 * MB,
        "local_buffer_size": 4 * MB,
        "protocol": "tcp",
        "master_server_addr": "embedded",
    }
    # Offload asked for (as a string or a bool) with a storage path that does not
    # exist: a clear startup error, -1.
    for value in ("true", "True", "1", True):
        store = MooncakeDistributedStore()
        missing = {"ssd_offload_path": "/nonexistent/mooncake-ssd"}
        assert store.setup({**config, **missing, "enable_ssd_offload": value}) == -1, value
        assert store.health_check() == 1
    # A string that is not a boolean is an error code, as every unusable setup()
    # argument is upstream (before anything starts).
    store = MooncakeDistributedStore()
    assert store.setup({**config, "enable_ssd_offload": "maybe"}) == -1
    assert store.health_check() == 1


def test_setup_embedded_rejects_bad_settings():
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MB, 4 * MB, "rdma-nonexistent", "", "embedded") == -1
    assert store.setup("localhost", "P2PHANDSHAKE", 0, 4 * MB, "tcp", "", "embedded") == -1
    # No RDMA transport in this build: "rdma" is refused (SGLang's default), on any machine.
    assert store.setup("localhost", "P2PHANDSHAKE", 16 * MB, 4 * MB, "rdma", "", "embedded") == -1
    assert store.health_check() == 1


def test_setup_with_protocol_auto_runs_over_tcp(keys):
    store = MooncakeDistributedStore()
    try:
        assert store.setup("localhost", "P2PHANDSHAKE", 16 * MB, 4 * MB, "auto", "", "embedded") == 0
        assert store.put(keys("auto"), b"over tcp") == OK
        assert store.get(keys("auto")) == b"over tcp"
    finally:
        store.close()


def test_embedded_stores_are_independent(embedded):
    first, second = embedded(16 * MB), embedded(16 * MB)
    assert first.put("same-key", b"first") == OK
    assert second.get("same-key") == b""


def test_real_client_restart(start_client, connect):
    client = start_client()
    store = connect(client.address, pool=8 * MB, staging=4 * MB)
    assert store.put("before", b"old instance") == OK
    handle = store.get_buffer("before")
    old_instance = store.status()["instance_id"]

    client.kill()
    started = time.monotonic()
    assert store.health_check() == 2
    assert store.put("during", b"v") == RPC_FAIL
    assert store.get("before") == b""
    assert store.get_size("before") == RPC_FAIL
    assert time.monotonic() - started < 5, "calls while disconnected must fail fast"
    assert bytes(handle) == b"old instance"  # the handle's pool memory is the dummy's

    restarted = start_client(port=client.port)
    assert wait_until(lambda: store.health_check() == 0, timeout=10), "no reconnect"
    status = store.status()
    assert status["pid"] == restarted.pid
    assert status["instance_id"] != old_instance
    assert len(status["dummies"]) == 1  # re-registered with its shared memory
    assert status["dummies"][0]["mapped_bytes"] == 12 * MB
    assert store.get("before") == b""  # the old instance's objects are gone
    assert store.put("after", b"new instance") == OK
    assert store.get("after") == b"new instance"
    # Zero-copy calls still work after the memory was registered again.
    ptr = store.alloc_from_mem_pool(64)
    assert store.get_into("after", ptr, 64) == 12
    assert bytes(handle) == b"old instance"
    del handle
    store.free_to_mem_pool(ptr)


def test_status_lists_each_dummy(start_client, connect):
    client = start_client()
    first = connect(client.address, pool=4 * MB, staging=2 * MB)
    connect(client.address, pool=8 * MB, staging=2 * MB)
    assert wait_until(lambda: len(dummy_entries(first.status(), os.getpid())) == 2)
    entries = dummy_entries(first.status(), os.getpid())
    assert sorted(e["mapped_bytes"] for e in entries) == [6 * MB, 10 * MB]
    assert all(e["segments"] == 2 for e in entries)


def test_embedded_ssd_tier_keeps_evicted_objects(tmp_path, monkeypatch):
    monkeypatch.setenv("MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS", "1")
    store = MooncakeDistributedStore()
    config = embedded_config(enable_ssd_offload=True, ssd_offload_path=str(tmp_path))
    assert store.setup(config) == OK
    try:
        values = {}

        def on_disk(key):
            return any(r.is_local_disk_replica() for r in store.get_replica_desc(key))

        # Waves the disk keeps up with, three segments' worth in all.
        for wave in range(12):
            keys = [f"ssd-{wave}-{i}" for i in range(4)]
            for key in keys:
                values[key] = os.urandom(1 << 20)
                assert store.put(key, values[key]) == OK
            assert wait_until(lambda: all(on_disk(k) for k in keys), timeout=10), keys
        evicted = [k for k in values if all(r.is_local_disk_replica() for r in store.get_replica_desc(k)) and store.get_replica_desc(k)]
        assert evicted, "nothing left memory"
        for key, value in values.items():
            assert store.get(key) == value, key
        assert any(tmp_path.glob("*.bucket"))
        assert store.remove(evicted[0]) == OK
        assert store.is_exist(evicted[0]) == 0
    finally:
        store.close()


def test_client_spin_serves_calls_and_a_bad_value_fails_setup(start_client, monkeypatch, caplog):
    client = start_client()
    monkeypatch.setenv("MOONCAKE_CLIENT_SPIN_US", "200")
    store = MooncakeDistributedStore()
    assert store.setup_dummy(4 * MB, 4 * MB, client.address) == OK
    try:
        buf = store.alloc_from_mem_pool(32 * 4096)
        keys = [f"spin-{i}" for i in range(32)]
        ptrs = [buf + i * 4096 for i in range(32)]
        for i, p in enumerate(ptrs):
            ctypes.memset(p, i, 4096)
        assert store.batch_put_from(keys, ptrs, [4096] * 32) == [OK] * 32
        ctypes.memset(buf, 0xFF, 32 * 4096)
        assert store.batch_get_into(keys, ptrs, [4096] * 32) == [4096] * 32
        assert all(ctypes.string_at(p, 4096) == bytes([i]) * 4096 for i, p in enumerate(ptrs))
        assert store.is_exist(keys[0]) == 1
    finally:
        store.close()
    for bad in ("fast", "1001", "-1"):
        monkeypatch.setenv("MOONCAKE_CLIENT_SPIN_US", bad)
        caplog.clear()
        refused = MooncakeDistributedStore()
        assert refused.setup_dummy(4 * MB, 4 * MB, client.address) != OK
        assert f'MOONCAKE_CLIENT_SPIN_US="{bad}" is not valid' in caplog.text


def test_embedded_client_spin_on_master_calls_and_a_bad_value_fails_setup(start_master, monkeypatch, caplog):
    master = start_master()
    monkeypatch.setenv("MOONCAKE_CLIENT_SPIN_US", "200")
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MB, 4 * MB, "tcp", "", master.address) == OK
    try:
        values = {f"espin-{i}": bytes([i]) * 4096 for i in range(32)}
        assert store.put_batch(list(values), list(values.values())) == OK
        assert [store.get(k) for k in values] == list(values.values())
        assert store.batch_is_exist(list(values)) == [1] * 32
        assert store.remove_all(True) >= 32
    finally:
        store.close()
    for bad in ("fast", "1001"):
        monkeypatch.setenv("MOONCAKE_CLIENT_SPIN_US", bad)
        caplog.clear()
        refused = MooncakeDistributedStore()
        assert refused.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MB, 4 * MB, "tcp", "", master.address) != OK
        assert f'MOONCAKE_CLIENT_SPIN_US="{bad}" is not valid' in caplog.text
