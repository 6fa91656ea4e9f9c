"""Puts into space reserved ahead of their keys: a real client keeps writes started under
names of its own in its own segment, so a put of a small unpinned value copies at once
and completes with one master round trip. The values must read back byte-exact, an
existing key must stay as it was, and the reserved space must never show as objects nor
outlive the client at a shared master."""

import ctypes
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from mooncake.store import MooncakeDistributedStore, ReplicateConfig
from mooncake_testlib import die_with_parent_prefix, wait_until

OK = 0
SIZE = 4096
BATCH = 32


def own_segment(store):
    config = ReplicateConfig()
    config.preferred_segment = store.get_hostname()
    return config


def write_batches(store, keys, config, rounds=6):
    """Writes `rounds` batches of distinct values from registered memory; returns them."""
    buf = np.zeros(BATCH * SIZE, dtype=np.uint8)
    assert store.register_buffer(buf.ctypes.data, buf.nbytes) == OK
    values = {}
    try:
        for r in range(rounds):
            names = keys.many(BATCH, f"r{r}-")
            for i, name in enumerate(names):
                buf[i * SIZE:(i + 1) * SIZE] = (r * BATCH + i) % 251
                values[name] = bytes(buf[i * SIZE:(i + 1) * SIZE])
            ptrs = [buf.ctypes.data + i * SIZE for i in range(BATCH)]
            assert store.batch_put_from(names, ptrs, [SIZE] * BATCH, config) == [OK] * BATCH
            # Refills run in the background: give them a moment between batches.
            time.sleep(0.02)
    finally:
        assert store.unregister_buffer(buf.ctypes.data) == OK
    return values


def test_reserved_puts_read_back_exactly_and_leave_existing_keys_alone(embedded, keys):
    store = embedded(segment=32 << 20)
    config = own_segment(store)
    values = write_batches(store, keys, config)
    assert store.status()["reserved_puts"] > 0, "no put went through a reservation"
    for name, value in values.items():
        assert store.get(name) == value, name
    # A put of an existing key succeeds and changes nothing, reservation or not.
    first = next(iter(values))
    assert store.put(first, b"\xee" * SIZE, config) == OK
    assert store.get(first) == values[first]
    # Reservations are writes in progress, never objects.
    status = store.status()
    assert status["objects"] == len(values)
    assert store.remove_all(True) == len(values)


def test_reservations_serve_dummies_and_end_with_their_client(start_master, master_client, connect, keys):
    master = start_master()
    node = master_client(master)
    store = connect(node.address)
    config = ReplicateConfig()
    config.preferred_segment = f"127.0.0.1:{node.port}"
    pool = store.alloc_from_mem_pool(BATCH * SIZE)
    try:
        ptrs = [pool + i * SIZE for i in range(BATCH)]
        for r in range(4):
            names = keys.many(BATCH, f"d{r}-")
            for i in range(BATCH):
                ctypes.memset(ptrs[i], r * BATCH + i, SIZE)
            assert store.batch_put_from(names, ptrs, [SIZE] * BATCH, config) == [OK] * BATCH
            time.sleep(0.02)
            for i, name in enumerate(names):
                assert store.get(name) == bytes([r * BATCH + i]) * SIZE
        assert store.status()["reserved_puts"] > 0
        assert store.status()["reserved_writes"] > 0, "no reservation is held"
    finally:
        store.free_to_mem_pool(pool)
    store.close()
    node.stop()
    # The node's segment went away with it, and its reservations with the segment.
    checker = MooncakeDistributedStore()
    assert checker.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 4 << 20, "tcp", "", master.address) == OK
    try:
        assert wait_until(lambda: checker.status()["reserved_writes"] == 0, timeout=10)
    finally:
        checker.close()


def test_reserved_puts_are_never_read_before_their_bytes_are_whole(start_master, keys):
    """An embedded client of a remote master sends a reserved put's commit while it
    copies the value, so the key can turn readable first: a reader in another process,
    asking for each key as it appears, must still see every value whole."""
    # Short read leases: the space of values removed after a read comes back soon.
    master = start_master("--default_kv_lease_ttl=50ms")
    writer = MooncakeDistributedStore()
    assert writer.setup("127.0.0.1", "P2PHANDSHAKE", 128 << 20, 16 << 20, "tcp", "", master.address) == OK
    count, size = 300, 1 << 20
    reader = subprocess.Popen(
        [*die_with_parent_prefix(), sys.executable, str(Path(__file__).resolve().parent / "_workers.py"),
         "tail", master.address, keys("v"), str(count), str(size), "60"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        assert reader.stdout.readline().strip() == "ready"
        buf = np.zeros(size, dtype=np.uint8)
        assert writer.register_buffer(buf.ctypes.data, size) == OK
        config = own_segment(writer)
        for i in range(count):
            buf[:] = i % 251 + 1
            assert writer.put_from(f"{keys('v')}-{i}", buf.ctypes.data, size, config) == OK
            # Old keys go, so that reservations are used again (their bytes were
            # another value's), and the reader catches up.
            if i >= 32:
                assert writer.remove(f"{keys('v')}-{i - 32}", True) == OK, i
            time.sleep(0.002)
        out, _ = reader.communicate(timeout=90)
        report = json.loads(out.strip().splitlines()[-1])
        assert writer.status()["reserved_puts"] > count // 2, "puts did not go through reservations"
        assert writer.unregister_buffer(buf.ctypes.data) == OK
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
        writer.close()
    assert report["torn"] == [], report["torn"][:5]
    assert report["read"] > count // 2, report
