"""Where a read lease ends, in the setup of upstream's own wheel tests: a standalone
``mooncake_master --default_kv_lease_ttl=500``, used by an embedded ``setup()`` store and
by a dummy attached to a real client of that master; and with the master embedded in
``mooncake_client`` (``--default_kv_lease_ttl=500``).

Upstream's promise (docs/eviction-and-leases.md): a read at ``t`` leases the object
until ``t + TTL`` and no later, so a non-forced ``remove`` is refused before that and
succeeds after. Reads answered from the real client's read cache renew the lease as a
read asking the master would.
"""

import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake.store import MooncakeDistributedStore  # noqa: E402

OK = 0
OBJECT_HAS_LEASE = -706
TTL = 0.5  # seconds, as --default_kv_lease_ttl=500 and upstream's DEFAULT_KV_LEASE_TTL
VALUE = b"x" * 2100


@pytest.fixture
def lease_master(start_master):
    return start_master("--default_kv_lease_ttl=500")


@pytest.fixture(params=["embedded", "dummy", "dummy_of_embedded_master"])
def lease_store(request, lease_master, master_client, start_client, connect):
    """A store of the standalone master above: embedded (its own in-process real
    client), or a dummy of a real client joined to the master; or a dummy of a real
    client whose master runs in its own process (the single-node default)."""
    if request.param == "dummy_of_embedded_master":
        client = start_client("--default_kv_lease_ttl=500", segment="64MB")
        yield connect(client.address)
        return
    if request.param == "dummy":
        client = master_client(lease_master, segment="64MB")
        yield connect(client.address)
        return
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", lease_master.address) == OK
    try:
        yield store
    finally:
        store.close()


def sleep_until(deadline):
    left = deadline - time.monotonic()
    if left > 0:
        time.sleep(left)


def test_remove_one_ttl_after_a_get_succeeds(lease_store, keys):
    # Upstream's reproduction: put, get, sleep one TTL, remove.
    key = keys("read")
    assert lease_store.put(key, VALUE) == OK
    assert lease_store.get(key) == VALUE
    time.sleep(TTL)
    assert lease_store.remove(key) == OK
    # A put alone leases nothing.
    key = keys("written")
    assert lease_store.put(key, VALUE) == OK
    assert lease_store.remove(key) == OK


@pytest.mark.parametrize("read", ["get", "is_exist", "get_into"])
def test_a_read_blocks_remove_until_one_ttl_and_no_longer(lease_store, keys, read):
    key = keys(read)
    assert lease_store.put(key, VALUE) == OK
    time.sleep(TTL + 0.1)  # whatever the put did has ended
    if read == "get":
        assert lease_store.get(key) == VALUE
    elif read == "is_exist":
        assert lease_store.is_exist(key) == 1
    else:
        buffer = np.zeros(len(VALUE), dtype=np.uint8)
        assert lease_store.register_buffer(buffer.ctypes.data, buffer.nbytes) == OK
        assert lease_store.get_into(key, buffer.ctypes.data, buffer.nbytes) == len(VALUE)
        assert lease_store.unregister_buffer(buffer.ctypes.data) == OK
    answered = time.monotonic()
    sleep_until(answered + TTL - 0.05)
    assert lease_store.remove(key) == OBJECT_HAS_LEASE
    sleep_until(answered + TTL + 0.005)
    assert lease_store.remove(key) == OK


def test_a_read_from_the_read_cache_renews_the_lease(lease_store, keys):
    key = keys("cached")
    assert lease_store.put(key, VALUE) == OK
    assert lease_store.get(key) == VALUE  # asks the master: lease until first + TTL
    hits = lease_store.status()["read_cache_hits"]
    # Well inside the cache's window (half the lease), well past the first read's
    # boundary below.
    time.sleep(0.2)
    assert lease_store.get(key) == VALUE
    answered = time.monotonic()
    assert lease_store.status()["read_cache_hits"] > hits, "the second read did not hit the read cache"
    sleep_until(answered + TTL - 0.05)
    assert lease_store.remove(key) == OBJECT_HAS_LEASE, "a cache hit did not renew the lease"
    sleep_until(answered + TTL + 0.005)
    assert lease_store.remove(key) == OK, "a cache hit leased the object past one TTL"
