"""The read cache (``--read_cache_ms``): a real client reads an object of its own segment
again with the replica list of an earlier read, without asking the master, for at most
that long and half the read lease. Its own removals and writes forget the keys first;
another client's forced removal or upsert may be missed for that long, but the bytes read
are always a whole version of the object (the master keeps a leased version's space)."""

import time
import urllib.request

from mooncake.store import ReplicateConfig

from mooncake_testlib import free_loopback_port

OK = 0
SIZE = 64 << 10


def hits(store):
    return store.status()["read_cache_hits"]


def value(tag, size=SIZE):
    return bytes([tag]) * size


def placed_on(client):
    config = ReplicateConfig()
    config.preferred_segment = f"127.0.0.1:{client.port}"
    return config


def test_a_second_read_of_an_own_segment_object_skips_the_master(embedded, keys):
    store = embedded(segment=32 << 20)
    key = keys("k")
    assert store.put(key, value(1)) == OK
    assert store.get(key) == value(1)
    before = hits(store)
    for _ in range(3):
        assert store.get(key) == value(1)
    assert store.batch_get_buffer([key, key])[0] is not None
    assert hits(store) >= before + 3
    # A missing key is never answered from the cache.
    assert store.get(keys("missing")) == b""
    assert store.is_exist(keys("missing")) == 0


def test_own_removals_and_upserts_are_seen_at_once(embedded, keys):
    store = embedded(segment=32 << 20)
    key, other = keys("k"), keys("o")
    assert store.put(key, value(1)) == OK
    assert store.put(other, value(5)) == OK
    assert store.get(key) == value(1) and store.get(key) == value(1)
    assert store.upsert(key, value(2)) == OK
    assert store.get(key) == value(2)
    assert store.remove(key, True) == OK
    assert store.get(key) == b""
    assert store.put(key, value(3)) == OK
    assert store.get(key) == value(3) and store.get(key) == value(3)
    assert store.get(other) == value(5) and store.get(other) == value(5)
    assert store.remove_all(True) >= 2
    assert store.get(key) == b"" and store.get(other) == b""


def test_another_clients_forced_replacement_is_read_whole_and_seen_within_the_window(
    start_master, master_client, connect, keys
):
    master = start_master()
    reader_node = master_client(master, "--read_cache_ms=300")
    writer_node = master_client(master)
    reader, writer = connect(reader_node.address), connect(writer_node.address)
    key = keys("k")
    on_reader = placed_on(reader_node)
    assert writer.put(key, value(1), on_reader) == OK
    assert reader.get(key) == value(1)
    assert reader.get(key) == value(1)
    assert hits(reader) >= 1
    # Another node removes it by force and writes a new version into the reader's own
    # segment: the old version's space stays held while the reader's lease runs.
    assert writer.remove(key, True) == OK
    assert writer.put(key, value(2), on_reader) == OK
    seen = reader.get(key)
    assert seen in (value(1), value(2)), "a read returned bytes of no version"
    time.sleep(0.35)
    assert reader.get(key) == value(2)


def test_the_cache_can_be_turned_off(start_client, connect, keys):
    http = free_loopback_port()
    node = start_client("--read_cache_ms=0", "--enable_http_server", f"--http_port={http}")
    store = connect(node.address)
    key = keys("k")
    assert store.put(key, value(7)) == OK
    for _ in range(3):
        assert store.get(key) == value(7)
    assert hits(store) == 0
    url = f"http://127.0.0.1:{http}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    assert "\nmooncake_client_read_cache_hits_total 0\n" in text
