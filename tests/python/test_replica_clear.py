"""``batch_replica_clear`` (upstream's ``BatchReplicaClear``), in the setup of upstream's
own wheel tests: a standalone ``mooncake_master --default_kv_lease_ttl=500`` with two
nodes, used in embedded mode (``setup()`` stores) and in dummy mode (dummies of real
clients joined to the master).

What it promises (docs/eviction-and-leases.md): it clears only objects that nobody read
or wrote for one lease TTL; with a segment name, only the memory replicas on that
segment, and the other replicas keep serving the object.
"""

import time

import pytest

from mooncake.store import MooncakeDistributedStore, ReplicateConfig

OK = 0
TTL = 0.5  # seconds, as --default_kv_lease_ttl=500


@pytest.fixture
def lease_master(start_master):
    return start_master("--default_kv_lease_ttl=500")


@pytest.fixture(params=["embedded", "dummy"])
def two_nodes(request, lease_master, master_client, connect):
    """Two stores of the master above, each on a node (segment) of its own."""
    if request.param == "dummy":
        clients = [master_client(lease_master, segment="64MB") for _ in range(2)]
        yield [connect(client.address) for client in clients]
        return
    stores = []
    try:
        for _ in range(2):
            store = MooncakeDistributedStore()
            assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", lease_master.address) == OK
            stores.append(store)
        yield stores
    finally:
        for store in stores:
            store.close()


def idle():
    """Waits until whatever the test did to its keys so far is more than a TTL ago."""
    time.sleep(TTL + 0.15)


def test_objects_written_or_read_within_a_ttl_are_not_cleared(two_nodes, keys):
    store = two_nodes[0]
    fresh = keys.many(3, "fresh")
    for key in fresh:
        assert store.put(key, b"active lease") == OK
    assert store.batch_replica_clear(fresh) == []
    idle()
    read = keys("read")
    assert store.put(read, b"read") == OK
    idle()
    assert store.get(read) == b"read"
    assert store.batch_replica_clear([read]) == []
    for key in fresh:
        assert store.get(key) == b"active lease"
    idle()
    assert sorted(store.batch_replica_clear(fresh + [read])) == sorted(fresh + [read])
    assert store.batch_is_exist(fresh + [read]) == [0] * 4


def test_a_mixed_batch_clears_only_the_idle_objects(two_nodes, keys):
    store = two_nodes[0]
    expired, active = keys.many(2, "expired"), keys.many(2, "active")
    for key in expired:
        assert store.put(key, b"mixed") == OK
    idle()
    for key in active:
        assert store.put(key, b"mixed") == OK
    assert sorted(store.batch_replica_clear(expired + active + [keys("missing")])) == sorted(expired)
    for key in active:
        assert store.get(key) == b"mixed"
    assert store.batch_is_exist(expired) == [0, 0]


def test_clearing_one_segment_keeps_the_other_replica(two_nodes, keys):
    first, second = two_nodes
    key, value = keys("replicated"), b"specific segment clear test"
    config = ReplicateConfig()
    config.replica_num = 2
    assert first.put(key, value, config=config) == OK
    segments = {r.get_memory_descriptor().segment_name for r in first.get_replica_desc(key)}
    assert segments == {first.get_hostname(), second.get_hostname()}, segments
    idle()
    assert first.batch_replica_clear([key], "no-such-host:1") == []
    assert first.batch_replica_clear([key], first.get_hostname()) == [key]
    left = [r.get_memory_descriptor().segment_name for r in first.get_replica_desc(key)]
    assert left == [second.get_hostname()]
    assert second.get(key) == value
    assert first.get(key) == value
    idle()
    assert first.batch_replica_clear([key], second.get_hostname()) == [key]
    assert first.get(key) == b""
    assert first.batch_is_exist([key]) == [0]


def test_clearing_without_a_segment_removes_every_replica(two_nodes, keys):
    first, second = two_nodes
    key = keys("all")
    config = ReplicateConfig()
    config.replica_num = 2
    assert first.put(key, b"replicated clear all test", config=config) == OK
    idle()
    assert first.batch_replica_clear([key]) == [key]
    assert second.get(key) == b""
    assert first.batch_replica_clear([]) == []
