"""Bytes API, queries, removal, tasks and configuration, in dummy and embedded mode."""

import array
import ctypes
import os
import threading
import time
import uuid

import numpy as np
import pytest

from mooncake.store import (
    ERROR_CODES,
    MooncakeDistributedStore,
    QueryTaskResponse,
    ReplicaDescriptor,
    ReplicaStatus,
    ReplicateConfig,
    SoftPinAction,
    TaskStatus,
    TaskType,
)

OK = 0
INVALID_KEY = -400
INVALID_PARAMS = -600
OBJECT_NOT_FOUND = -704
OBJECT_HAS_LEASE = -706
SEGMENT_NOT_FOUND = -101
TASK_NOT_FOUND = -1400


def test_error_codes_keep_upstream_values():
    expected = {
        "OK": 0,
        "INTERNAL_ERROR": -1,
        "BUFFER_OVERFLOW": -10,
        "SEGMENT_NOT_FOUND": -101,
        "NO_AVAILABLE_HANDLE": -200,
        "INVALID_KEY": -400,
        "INVALID_PARAMS": -600,
        "OBJECT_NOT_FOUND": -704,
        "OBJECT_ALREADY_EXISTS": -705,
        "OBJECT_HAS_LEASE": -706,
        "LEASE_EXPIRED": -707,
        "OBJECT_REPLICA_BUSY": -714,
        "TRANSFER_FAIL": -800,
        "CHECKSUM_MISMATCH": -801,
        "RPC_FAIL": -900,
        "RPC_TIMEOUT": -901,
        "NOT_SUPPORTED": -1012,
        "TASK_NOT_FOUND": -1400,
        "TENANT_NOT_EMPTY": -1702,
    }
    for name, value in expected.items():
        assert ERROR_CODES[name] == value, name
    assert len(set(ERROR_CODES.values())) == len(ERROR_CODES)


# ----- put / get / size / exist -----


def test_put_get_size_exist(store, keys):
    key, data = keys("basic"), b"Hello, World!"
    assert store.put(key, data) == OK
    assert store.get_size(key) == 13
    assert store.get(key) == data
    assert store.is_exist(key) == 1
    assert store.is_exist(keys("missing")) == 0
    assert store.get(keys("missing")) == b""
    assert store.get_size(keys("missing")) == OBJECT_NOT_FOUND


def test_put_accepts_bytearray_and_binary_data(store, keys):
    data = bytes(range(256)) * 33
    assert store.put(keys("ba"), bytearray(data)) == OK
    assert store.get(keys("ba")) == data


def test_bytes_like_values(store, keys):
    data = bytes(range(256)) * 17
    floats = np.arange(300, dtype=np.float32)
    ints = array.array("i", range(100))
    strided = np.arange(64, dtype=np.uint16)[::3]  # not contiguous: stored in C order
    values = {
        "mv": (memoryview(data), data),
        "mv-slice": (memoryview(data)[10:20], data[10:20]),
        "np-u8": (np.frombuffer(data, dtype=np.uint8), data),
        "np-f32": (floats, floats.tobytes()),
        "np-2d": (floats.reshape(30, 10), floats.tobytes()),
        "np-strided": (strided, strided.tobytes()),
        "array": (ints, ints.tobytes()),
        "bytearray": (bytearray(b"ba"), b"ba"),
    }
    for name, (value, expected) in values.items():
        assert store.put(keys(name), value) == OK, name
        assert store.get(keys(name)) == expected, name
    # The value is copied: changing the source afterwards changes nothing.
    source = np.full(16, 7, dtype=np.uint8)
    assert store.put(keys("copied"), source) == OK
    source[:] = 0
    assert store.get(keys("copied")) == bytes([7]) * 16

    assert store.put_parts(keys("parts"), memoryview(b"ab"), np.frombuffer(b"cd", dtype=np.uint8), array.array("b", b"ef"), b"gh") == OK
    assert store.get(keys("parts")) == b"abcdefgh"
    names = keys.many(3, "batch")
    assert store.put_batch(names, [memoryview(b"one"), np.frombuffer(b"two", dtype=np.uint8), array.array("B", b"three")]) == OK
    assert store.get_batch(names) == [b"one", b"two", b"three"]

    assert store.upsert(keys("mv"), np.frombuffer(b"replaced", dtype=np.uint8)) == OK
    assert store.get(keys("mv")) == b"replaced"
    assert store.upsert_parts(keys("parts"), memoryview(b"x"), array.array("b", b"y")) == OK
    assert store.get(keys("parts")) == b"xy"
    assert store.upsert_batch(names, [memoryview(b"1"), np.array([50], dtype=np.uint8), array.array("B", b"3")]) == OK
    assert store.get_batch(names) == [b"1", b"2", b"3"]

    # An empty buffer is an empty value (-600), like b"".
    assert store.put(keys("empty"), memoryview(b"")) == INVALID_PARAMS
    assert store.put(keys("empty"), np.zeros(0, dtype=np.uint8)) == INVALID_PARAMS
    assert store.is_exist(keys("empty")) == 0


def test_str_values_are_refused(store, keys):
    calls = [
        lambda: store.put(keys("s"), "text"),
        lambda: store.put_parts(keys("s"), b"a", "b"),
        lambda: store.put_batch([keys("s")], ["text"]),
        lambda: store.upsert(keys("s"), "text"),
        lambda: store.upsert_parts(keys("s"), "text"),
        lambda: store.upsert_batch([keys("s"), keys("t")], [b"ok", "text"]),
    ]
    for index, call in enumerate(calls):
        with pytest.raises(TypeError):
            call()
            pytest.fail(f"call #{index} did not raise")
    assert store.batch_is_exist([keys("s"), keys("t")]) == [0, 0]


def test_put_of_existing_key_succeeds_without_overwriting(store, keys):
    key = keys("twice")
    assert store.put(key, b"first") == OK
    assert store.put(key, b"second value") == OK
    assert store.get(key) == b"first"
    assert store.get_size(key) == 5


def test_put_empty_value_is_invalid(store, keys):
    assert store.put(keys("empty"), b"") == INVALID_PARAMS
    assert store.is_exist(keys("empty")) == 0


@pytest.mark.parametrize("size", [1, 63, 64, 65, 4096, (1 << 20) + 3, 3 << 20])
def test_put_get_sizes(store, keys, size):
    data = bytes((i * 31 + 7) & 0xFF for i in range(min(size, 4096))) * (size // 4096 + 1)
    data = data[:size]
    assert store.put(keys("s"), data) == OK
    assert store.get_size(keys("s")) == size
    assert store.get(keys("s")) == data


def test_put_larger_than_staging_buffer(store, keys):
    data = bytes(range(251)) * ((24 << 20) // 251)  # > the 16 MiB staging buffer
    assert store.put(keys("big"), data) == OK
    assert store.get(keys("big")) == data


def test_get_of_a_value_larger_than_the_pool_and_the_staging_buffer(real_client, connect, keys):
    """A value larger than the staging buffer and the pool still arrives whole."""
    store = connect(real_client.address, pool=1 << 20, staging=1 << 20)
    data = bytes(range(241)) * ((6 << 20) // 241)
    assert store.put(keys("big"), data) == OK
    assert store.get(keys("big")) == data
    assert store.get_batch([keys("big"), keys("missing")]) == [data, b""]


def test_batch_is_exist(store, keys):
    names = keys.many(20)
    for name in names[:10]:
        assert store.put(name, b"Hello, Batch World!") == OK
    assert store.batch_is_exist(names) == [1] * 10 + [0] * 10
    assert store.batch_is_exist([]) == []
    assert store.batch_is_exist([names[0]]) == [1]
    assert store.batch_is_exist([keys("non_existent_key")]) == [0]


def test_put_parts(store, keys):
    assert store.put_parts(keys("p"), b"ab", b"cd", b"ef") == OK
    assert store.get(keys("p")) == b"abcdef"
    assert store.put_parts(keys("q"), b"x" * 100, bytearray(b"y"), config=ReplicateConfig()) == OK
    assert store.get(keys("q")) == b"x" * 100 + b"y"
    assert store.put_parts(keys("none")) == INVALID_PARAMS


def test_put_batch_returns_one_int(store, keys):
    names = keys.many(3)
    values = [b"one", b"two" * 1000, bytes(range(256))]
    result = store.put_batch(names, values)
    assert result == OK and isinstance(result, int)
    assert store.get_batch(names) == values
    assert store.get_batch(names + [keys("missing")]) == values + [b""]
    assert store.get_batch([]) == []
    assert store.put_batch([], []) == OK


def test_batch_writes_with_duplicate_keys(store, keys):
    key = keys("dup")
    assert store.put_batch([key, key], [b"first", b"second"]) == OK
    assert store.get(key) == b"first"  # put never overwrites, even within a batch
    other = keys("dup-upsert")
    assert store.upsert_batch([other, other], [b"first", b"second!"]) == OK
    assert store.get(other) == b"second!"  # upserts apply in order


def test_put_batch_mismatch_and_bad_entry(store, keys):
    assert store.put_batch(keys.many(2), [b"only one"]) == INVALID_PARAMS
    result = store.put_batch([keys("good"), "x" * 4097], [b"v", b"v"])
    assert isinstance(result, int) and result == INVALID_KEY


def test_upsert_same_size(store, keys):
    key = keys("u")
    assert store.put(key, b"AAAA") == OK
    assert store.get(key) == b"AAAA"  # takes a lease: upsert must still work
    assert store.upsert(key, b"BBBB") == OK
    assert store.get(key) == b"BBBB"
    assert store.get_size(key) == 4


def test_upsert_changed_size(store, keys):
    key = keys("u")
    assert store.put(key, b"short") == OK
    assert store.upsert(key, b"a much longer value" * 100) == OK
    assert store.get(key) == b"a much longer value" * 100
    assert store.get_size(key) == 1900
    assert store.upsert(key, b"x") == OK
    assert store.get(key) == b"x"


def test_upsert_inserts_missing_key(store, keys):
    assert store.upsert(keys("new"), b"fresh") == OK
    assert store.get(keys("new")) == b"fresh"


def test_upsert_parts_and_batch(store, keys):
    key = keys("up")
    assert store.put(key, b"old") == OK
    assert store.upsert_parts(key, b"12", b"34", b"5") == OK
    assert store.get(key) == b"12345"
    names = [key, keys("other")]
    result = store.upsert_batch(names, [b"zz", b"yy" * 10])
    assert result == OK and isinstance(result, int)
    assert store.get_batch(names) == [b"zz", b"yy" * 10]
    assert store.upsert_batch(names, [b"only one"]) == INVALID_PARAMS


# ----- removal and leases -----


def test_remove_under_lease(store, keys):
    key = keys("leased")
    assert store.put(key, b"data") == OK
    assert store.remove(key) == OK  # no read yet: no lease
    assert store.put(key, b"data") == OK
    assert store.get(key) == b"data"
    assert store.remove(key) == OBJECT_HAS_LEASE
    assert store.is_exist(key) == 1
    assert store.remove(key, True) == OK
    assert store.is_exist(key) == 0
    assert store.get(key) == b""
    assert store.remove(key, True) == OBJECT_NOT_FOUND
    assert store.remove(keys("never")) == OBJECT_NOT_FOUND


def test_is_exist_grants_a_lease(store, keys):
    key = keys("e")
    assert store.put(key, b"data") == OK
    assert store.is_exist(key) == 1
    assert store.remove(key) == OBJECT_HAS_LEASE
    assert store.remove(key, force=True) == OK


def test_batch_remove(store, keys):
    names = keys.many(3)
    for name in names:
        assert store.put(name, b"v") == OK
    assert store.get(names[2]) == b"v"
    assert store.batch_remove(names + [keys("missing")]) == [OK, OK, OBJECT_HAS_LEASE, OBJECT_NOT_FOUND]
    assert store.batch_remove([names[2]], True) == [OK]
    assert store.batch_is_exist(names) == [0, 0, 0]
    assert store.batch_remove([]) == []


def test_remove_by_regex(store, keys):
    for name in ("a-1", "a-2", "a-3", "b-1"):
        assert store.put(keys(name), b"v") == OK
    assert store.get(keys("a-3")) == b"v"  # leased: skipped unless forced
    assert store.remove_by_regex(keys.pattern + r"-a-\d$") == 2
    assert store.batch_is_exist([keys("a-1"), keys("a-2"), keys("a-3"), keys("b-1")]) == [0, 0, 1, 1]
    assert store.remove_by_regex(keys.pattern + "-a-", True) == 1
    assert store.remove_by_regex(keys.pattern + "-nothing") == 0
    assert store.is_exist(keys("b-1")) == 1
    assert store.remove_by_regex("(unclosed") == INVALID_PARAMS
    assert store.remove_by_regex("x" * 5000) == INVALID_PARAMS


def _check_remove_all(store):
    for i in range(3):
        assert store.put(f"all-{i}", b"v") == OK
    assert store.get("all-0") == b"v"
    assert store.remove_all() == 2  # the leased one stays
    assert store.batch_is_exist(["all-0", "all-1", "all-2"]) == [1, 0, 0]
    assert store.remove_all(True) == 1
    assert store.remove_all(True) == 0
    assert store.status()["objects"] == 0


def test_remove_all_dummy(start_client, connect):
    # A real client of its own: remove_all must not wipe the other tests' objects.
    _check_remove_all(connect(start_client().address))


def test_remove_all_embedded(embedded):
    _check_remove_all(embedded())


def test_remove_after_lease_expiry(start_client, connect):
    client = start_client("--default_kv_lease_ttl=300ms")
    store = connect(client.address)
    assert store.put("leased", b"data") == OK
    assert store.get("leased") == b"data"
    assert store.remove("leased") == OBJECT_HAS_LEASE
    time.sleep(0.4)
    assert store.remove("leased") == OK
    assert store.is_exist("leased") == 0


# ----- replica descriptors, hostname, health, status -----


def test_get_hostname(store):
    name = store.get_hostname()
    assert isinstance(name, str) and name
    host, _, port = name.rpartition(":")
    assert host and port.isdigit()


def test_get_replica_desc(store, keys):
    key = keys("r")
    assert store.put(key, b"x" * 1000) == OK
    replicas = store.get_replica_desc(key)
    assert len(replicas) == 1
    replica = replicas[0]
    assert isinstance(replica, ReplicaDescriptor)
    assert replica.is_memory_replica() and not replica.is_local_disk_replica() and not replica.is_disk_replica()
    assert replica.status == ReplicaStatus.COMPLETE
    memory = replica.get_memory_descriptor()
    assert memory.segment_name == store.get_hostname()
    assert memory.buffer_descriptor.size == 1000
    assert isinstance(memory.buffer_descriptor.buffer_address, int)
    # The owner's transfer endpoint ("host:port").
    host, _, port = memory.buffer_descriptor.transport_endpoint.rpartition(":")
    assert host and port.isdigit(), memory
    with pytest.raises(RuntimeError):
        replica.get_disk_descriptor()
    assert store.get_replica_desc(keys("missing")) == []
    batch = store.batch_get_replica_desc([key, keys("missing")])
    assert list(batch) == [key]
    assert [r.get_memory_descriptor().buffer_descriptor.size for r in batch[key]] == [1000]
    assert store.batch_get_replica_desc([]) == {}
    # Inspecting replicas grants no lease.
    assert store.remove(key) == OK


def test_health_check(store):
    assert store.health_check() == 0


def test_status_dummy(dummy_store, real_client):
    status = dummy_store.status()
    assert status["pid"] == real_client.pid
    assert status["segment_name"] == dummy_store.get_hostname()
    assert len(status["instance_id"]) == 32
    assert status["uptime_secs"] >= 0
    assert [s["capacity"] for s in status["segments"]] == [512 << 20]
    ours = [d for d in status["dummies"] if d["pid"] == os.getpid()]
    # The session's store (other stores of this process may be attached too).
    assert any(d["mapped_bytes"] >= (64 << 20) + (16 << 20) and d["segments"] >= 2 for d in ours), status
    assert all(d["uid"] == os.getuid() and d["name"].endswith(f"[{os.getpid()}]") for d in ours)
    assert status["mapped_bytes"] == sum(d["mapped_bytes"] for d in status["dummies"])
    assert isinstance(status["objects"], int)
    assert status["writes_in_progress"] == 0


def test_status_embedded(embedded_store):
    status = embedded_store.status()
    assert status["pid"] == os.getpid()
    assert [s["capacity"] for s in status["segments"]] == [256 << 20]
    assert status["segment_name"] == embedded_store.get_hostname()


def test_status_reports_the_segment_faulted_in_after_start(dummy_store):
    # The segment is faulted in by a background thread after the real client starts
    # serving; status says how much of it is resident.
    deadline = time.monotonic() + 30
    while True:
        status = dummy_store.status()
        assert status["segment_bytes"] == 512 << 20
        assert 0 <= status["segment_resident_bytes"] <= status["segment_bytes"]
        if status["segment_resident_bytes"] == status["segment_bytes"] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert status["segment_resident_bytes"] == status["segment_bytes"], status


def test_status_counts_objects(start_client, connect):
    store = connect(start_client().address)
    before = store.status()
    assert before["objects"] == 0 and before["segments"][0]["used"] == 0
    assert store.put("a", b"x" * 1000) == OK
    assert store.put("b", b"y" * 10) == OK
    after = store.status()
    assert after["objects"] == 2
    assert after["segments"][0]["used"] >= 1010
    (mine,) = after["dummies"]
    assert mine["mapped_bytes"] == (64 << 20) + (16 << 20)
    assert mine["segments"] == 2


# ----- tasks -----


def test_copy_task_to_own_segment(store, keys):
    key = keys("c")
    assert store.put(key, b"copy me") == OK
    task, code = store.create_copy_task(key, [store.get_hostname()])
    assert code == OK
    # Upstream's task id: a pair of 64-bit ints.
    assert isinstance(task, tuple) and len(task) == 2 and task != (0, 0)
    info, code = store.query_task(task)
    assert code == OK
    assert isinstance(info, QueryTaskResponse)
    assert info.status == TaskStatus.SUCCESS and info.message == ""
    assert info.type == TaskType.REPLICA_COPY
    assert info.id == task
    again, code = store.query_task(uuid.UUID(int=(task[0] << 64) | task[1]))
    assert code == OK and again.id == task
    assert store.get(key) == b"copy me"


def test_move_task_within_own_segment(store, keys):
    key = keys("m")
    assert store.put(key, b"move me") == OK
    me = store.get_hostname()
    task, code = store.create_move_task(key, me, me)
    assert code == OK and task is not None
    info, code = store.query_task(task)
    assert code == OK and info.type == TaskType.REPLICA_MOVE and info.status == TaskStatus.SUCCESS
    assert info.id == task
    assert store.create_move_task(key, "elsewhere:1", me) == (None, ERROR_CODES["REPLICA_NOT_FOUND"])


def test_copy_task_to_missing_segment(store, keys):
    key = keys("c")
    assert store.put(key, b"v") == OK
    started = time.monotonic()
    task, code = store.create_copy_task(key, ["no-such-host:12345"])
    assert time.monotonic() - started < 5
    assert (task, code) == (None, SEGMENT_NOT_FOUND)
    assert store.create_copy_task(keys("missing"), [store.get_hostname()]) == (None, OBJECT_NOT_FOUND)
    assert store.create_copy_task(key, []) == (None, INVALID_PARAMS)


def test_query_unknown_task(store):
    assert store.query_task(uuid.uuid4()) == (None, TASK_NOT_FOUND)
    assert store.query_task(12345) == (None, TASK_NOT_FOUND)


# ----- ReplicateConfig / SoftPinAction -----


def test_replicate_config_defaults_and_properties():
    config = ReplicateConfig()
    assert config.replica_num == 1
    assert config.soft_pin_action == SoftPinAction.PRESERVE
    assert config.soft_pin_ttl_ms is None
    assert config.with_soft_pin is False
    assert config.with_hard_pin is False
    assert config.preferred_segment == ""
    assert config.preferred_segments == []
    assert config.prefer_alloc_in_same_node is False

    config.replica_num = 3
    config.soft_pin_action = SoftPinAction.ENABLE
    config.preferred_segment = "node1:12345"
    config.soft_pin_ttl_ms = 1000
    config.with_hard_pin = True
    config.preferred_segments = ["a:1", "b:2"]
    config.prefer_alloc_in_same_node = True
    assert config.replica_num == 3
    assert config.soft_pin_action == SoftPinAction.ENABLE
    assert config.with_soft_pin is True
    assert config.preferred_segment == "node1:12345"
    assert config.soft_pin_ttl_ms == 1000
    assert config.with_hard_pin is True
    assert config.preferred_segments == ["a:1", "b:2"]
    assert config.prefer_alloc_in_same_node is True

    text = str(config)
    assert isinstance(text, str) and "3" in text
    assert repr(config) == text
    # Upstream's text form.
    for fragment in ("ReplicateConfig: {", "replica_num: 3", "soft_pin_action: ENABLE", "preferred_segment: node1:12345", "soft_pin_ttl_ms: 1000"):
        assert fragment in text, text

    config.with_soft_pin = False
    assert config.soft_pin_action == SoftPinAction.PRESERVE
    config.soft_pin_ttl_ms = None
    assert config.soft_pin_ttl_ms is None


def test_soft_pin_action_values():
    assert int(SoftPinAction.PRESERVE) == 0
    assert int(SoftPinAction.ENABLE) == 1
    assert int(SoftPinAction.DISABLE) == 2
    assert SoftPinAction.ENABLE != SoftPinAction.DISABLE
    assert SoftPinAction.ENABLE == SoftPinAction.ENABLE


def test_writes_with_config(store, keys):
    config = ReplicateConfig()
    config.preferred_segment = store.get_hostname()
    config.with_hard_pin = True
    config.soft_pin_action = SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = 60_000
    assert store.put(keys("a"), b"pinned", config) == OK
    assert store.put(keys("b"), b"pinned", config=config) == OK
    assert store.upsert(keys("a"), b"PINNED", config) == OK
    assert store.put_batch([keys("c")], [b"v"], config) == OK
    assert store.get_batch([keys("a"), keys("b"), keys("c")]) == [b"PINNED", b"pinned", b"v"]
    # Best effort: more replicas than segments still stores one.
    two = ReplicateConfig()
    two.replica_num = 2
    assert store.put(keys("two"), b"v", two) == OK
    assert store.get(keys("two")) == b"v"


def test_invalid_configs_are_rejected(store, keys):
    zero = ReplicateConfig()
    zero.replica_num = 0
    assert store.put(keys("z"), b"v", zero) == INVALID_PARAMS
    ttl_without_pin = ReplicateConfig()
    ttl_without_pin.soft_pin_ttl_ms = 100
    assert store.put(keys("t"), b"v", ttl_without_pin) == INVALID_PARAMS
    assert store.batch_is_exist([keys("z"), keys("t")]) == [0, 0]


def test_two_dummies_in_one_process_share_objects(real_client, dummy_store, connect, keys):
    other = connect(real_client.address, pool=4 << 20, staging=4 << 20)
    assert dummy_store.put(keys("x"), b"from the first") == OK
    assert other.get(keys("x")) == b"from the first"
    assert other.put(keys("y"), b"from the second") == OK
    assert dummy_store.get(keys("y")) == b"from the second"
    assert isinstance(other, MooncakeDistributedStore)


def test_full_segment_refuses_writes_cleanly(start_client, connect):
    client = start_client(segment="32MB")
    store = connect(client.address, pool=8 << 20, staging=4 << 20)
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True  # never evicted: the segment really fills up
    codes = [store.put(f"fill-{i}", bytes([i]) * (1 << 20), pinned) for i in range(40)]
    full = codes.index(ERROR_CODES["NO_AVAILABLE_HANDLE"])
    assert 0 < full <= 32 and codes[:full] == [OK] * full
    assert set(codes[full:]) == {ERROR_CODES["NO_AVAILABLE_HANDLE"]}
    assert store.upsert("fill-0", b"z" * (2 << 20), pinned) == ERROR_CODES["NO_AVAILABLE_HANDLE"]
    assert store.get("fill-0") == bytes([0]) * (1 << 20)  # the failed upsert kept the old value
    assert store.get(f"fill-{full - 1}") == bytes([full - 1]) * (1 << 20)
    assert store.status()["writes_in_progress"] == 0
    assert store.remove("fill-1") == OK  # never read: no lease, freed at once
    assert store.put("after-remove", b"y" * (1 << 20), pinned) == OK
    assert store.get("after-remove") == b"y" * (1 << 20)


def test_each_dummy_has_a_hard_pin_quota(start_client, connect):
    client = start_client("--max_hard_pinned_bytes_per_dummy=3MB", segment="64MB")
    first = connect(client.address, pool=8 << 20, staging=4 << 20)
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    mib = 1 << 20
    assert [first.put(f"pin-{i}", bytes([i]) * mib, pinned) for i in range(3)] == [OK] * 3
    refused = ERROR_CODES["NO_AVAILABLE_HANDLE"]
    assert first.put("pin-3", b"x" * mib, pinned) == refused
    assert first.put("plain", b"x" * mib) == OK  # unpinned writes are not counted
    assert first.put_batch(["pin-4", "pin-5"], [b"a", b"b"], pinned) == refused
    # Another dummy has a quota of its own.
    second = connect(client.address, pool=8 << 20, staging=4 << 20)
    assert second.put("theirs", b"y" * mib, pinned) == OK
    # A removed object stops counting.
    assert first.remove("pin-0") == OK
    assert first.put("pin-3", b"z" * mib, pinned) == OK
    assert first.get("pin-3") == b"z" * mib


def test_each_dummy_has_a_read_lease_quota(start_client, connect):
    # A dummy that keeps reading everything would keep every object leased (unevictable)
    # for good; with a quota, the objects past it stay evictable and other dummies' puts
    # find room.
    client = start_client(
        "--max_read_leased_bytes_per_dummy=6MB", "--default_kv_lease_ttl=2s", segment="32MB"
    )
    reader = connect(client.address, pool=8 << 20, staging=4 << 20)
    writer = connect(client.address, pool=8 << 20, staging=4 << 20)
    mib = 1 << 20
    # The reader fills the whole segment, then keeps reading all of it.
    keys = [f"read-{i}" for i in range(32)]
    assert [reader.put(key, bytes([i]) * mib) for i, key in enumerate(keys)] == [OK] * 32
    stop = threading.Event()
    reads = []

    def reread():
        while not stop.is_set():
            reader.batch_is_exist(keys)
            for i, key in enumerate(keys):
                value = reader.get(key)
                reads.append(len(value) if value in (b"", bytes([i]) * mib) else -1)

    thread = threading.Thread(target=reread)
    thread.start()
    try:
        time.sleep(0.5)
        codes = [writer.put(f"new-{i}", bytes([i]) * mib) for i in range(32)]
    finally:
        stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()
    assert codes == [OK] * 32, "the reader's leases kept the writer from evicting"
    assert -1 not in reads, "a read returned wrong bytes"
    assert any(n == mib for n in reads), "the reader read nothing"
    assert writer.get("new-31") == bytes([31]) * mib
    assert writer.get("new-0") in (b"", bytes([0]) * mib)


# ----- upstream's keyword names -----


def test_upstream_keyword_names(store, keys, pool):
    a, b = np.arange(6, dtype=np.int32).reshape(2, 3), np.arange(4, dtype=np.float64)
    names = [keys("t0"), keys("t1")]
    assert store.batch_put_tensor(keys=names, tensors_list=[a, b]) == [OK, OK]
    assert store.batch_upsert_tensor(keys=names, tensors_list=[b, a]) == [OK, OK]
    assert np.array_equal(store.get_tensor(names[0]), b)
    tp_names = [keys("tp0"), keys("tp1")]
    assert store.batch_put_tensor_with_tp(base_keys=tp_names, tensors_list=[a, a + 1], tp_size=2, split_dim=0) == [OK, OK]
    shards = store.batch_get_tensor_with_tp(base_keys=tp_names, tp_rank=1, tp_size=2)
    assert np.array_equal(shards[0], a[1:]) and np.array_equal(shards[1], a[1:] + 1)

    assert store.put(keys("mb"), b"multi-buffer") == OK
    out = pool(64)
    got = store.batch_get_into_multi_buffers(
        keys=[keys("mb")], all_buffer_ptrs=[[out, out + 32]], all_sizes=[[5, 32]], prefer_alloc_in_same_node=False
    )
    assert got == [12]
    assert ctypes.string_at(out, 5) + ctypes.string_at(out + 32, 7) == b"multi-buffer"

    assert store.get(keys("mb")) == b"multi-buffer"  # leased: needs force
    assert store.remove_by_regex(regex_pattern=keys.pattern + "-mb$", force=False) == 0
    assert store.remove_by_regex(regex_pattern=keys.pattern + "-mb$", force=True) == 1
    assert store.is_exist(keys("mb")) == 0

    # The former names are gone.
    with pytest.raises(TypeError):
        store.remove_by_regex(regex=keys.pattern)
    with pytest.raises(TypeError):
        store.batch_put_tensor(names, tensors=[a, b])
    with pytest.raises(TypeError):
        store.batch_get_into_multi_buffers([keys("mb")], [[out]], [[64]], prefer_same_node=True)
