"""Child processes of the multi-process tests (run with the venv's python).

``python _workers.py pair ADDRESS ROLE KEY1 KEY2 LEASE_S``
    upstream's test_multi_dummy_clients: ROLE (1 or 2) puts its key, waits for the
    other's, reads and checks it, then removes it once the lease has expired.

``python _workers.py stress ADDRESS PREFIX NKEYS SECONDS WORKER_ID``
    the mixed workload of the concurrency test; prints a JSON report on the last line.

``python _workers.py tail MASTER PREFIX COUNT SIZE SECONDS``
    an embedded client of the master at MASTER that reads keys PREFIX-0 ..
    PREFIX-(COUNT-1) in order, asking for each until it exists (a second at most per
    key, SECONDS in all), and checks that each value is SIZE bytes of one byte, (i % 251) + 1; prints a
    JSON report (keys read, values that were not whole) on the last line.

``python _workers.py staging ADDRESS PREFIX``
    heap buffers in dummy mode with a 2 MiB staging buffer (batches larger than it,
    values larger than it); prints a JSON report of the bytes copied through staging
    per step, with the step's expected byte count and whether the data came back
    byte-exact. Its own process, so that the copy counter and the once-per-process log
    line are its own.
"""

import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from mooncake_testlib import StressWorker, read_at  # noqa: E402

from mooncake.store import MooncakeDistributedStore  # noqa: E402

DATA = b"Hello, World!"


def fail(message):
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def check(condition, message):
    if not condition:
        fail(message)


def pair(address, role, key1, key2, lease_s):
    role = int(role)
    own, other = (key1, key2) if role == 1 else (key2, key1)
    store = MooncakeDistributedStore()
    check(store.setup_dummy(16 << 20, 8 << 20, address) == 0, "setup_dummy")
    own_data = DATA + f" from client{role}".encode()
    other_data = DATA + f" from client{3 - role}".encode()
    check(store.put(own, own_data) == 0, "put own key")
    check(store.put_tensor(own + "_t", np.arange(100, dtype=np.int32) + role) == 0, "put_tensor own")

    deadline = time.monotonic() + 20
    while store.batch_is_exist([other, other + "_t"]) != [1, 1]:
        if time.monotonic() > deadline:
            fail(f"timed out waiting for {other}")
        time.sleep(0.05)

    check(store.get_size(other) == len(other_data), f"get_size {store.get_size(other)}")
    check(store.get(other) == other_data, f"get {store.get(other)!r}")
    ptr = store.alloc_from_mem_pool(4096)
    check(ptr != 0, "alloc_from_mem_pool")
    check(store.get_into(other, ptr, 4096) == len(other_data), "get_into")
    check(read_at(ptr, len(other_data)) == other_data, "get_into bytes")
    tensor = store.get_tensor(other + "_t")
    check(tensor is not None and np.array_equal(tensor, np.arange(100, dtype=np.int32) + (3 - role)), "get_tensor")
    del tensor
    check(store.put(other, b"overwrite attempt") == 0, "put of the other's key")
    check(store.get(other) == other_data, "put must not overwrite")
    check(store.remove(other) == -706, "remove under lease")

    time.sleep(float(lease_s))
    check(store.remove(other) == 0, f"remove after the lease: {store.remove(other)}")
    check(store.remove(other + "_t") == 0, "remove tensor after the lease")
    store.free_to_mem_pool(ptr)
    store.close()
    print("OK", flush=True)


def stress(address, prefix, nkeys, seconds, worker_id):
    store = MooncakeDistributedStore()
    check(store.setup_dummy(32 << 20, 16 << 20, address) == 0, "setup_dummy")
    names = [f"{prefix}-{i}" for i in range(int(nkeys))]
    buf_size = 3 << 20
    buf = store.alloc_from_mem_pool(buf_size)
    check(buf != 0, "alloc_from_mem_pool")
    worker = StressWorker(store, names, random.Random(int(worker_id) * 7919), buf, buf_size, int(worker_id))
    print("READY", flush=True)
    steps = worker.run(float(seconds))
    report = worker.report()
    report["steps"] = steps
    report["health"] = store.health_check()
    store.free_to_mem_pool(buf)
    print(json.dumps(report), flush=True)
    sys.exit(1 if report["wrong_count"] or report["unexpected_count"] else 0)


def staging(address, prefix):
    mb = 1 << 20
    store = MooncakeDistributedStore()
    check(store.setup_dummy(64 * mb, 2 * mb, address) == 0, "setup_dummy")
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 8 * mb, dtype=np.uint8)
    dst = np.zeros(8 * mb, dtype=np.uint8)
    extra = np.zeros(mb, dtype=np.uint8)
    for buffer in (src, dst, extra):
        check(store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0, "register_buffer")
    s, d = src.ctypes.data, dst.ctypes.data

    def copied():
        return store.status()["copied_through_staging_bytes"]

    steps = []

    def staged():
        return store.status()["staged_bytes"]

    def step(name, expected_bytes, run, through_pool=False):
        # `through_pool`: an object larger than the staging buffer is read into (or
        # written from) a block of the pool, copied there by the dummy: to the real
        # client, a zero-copy transfer of pool memory (only the dummy's own count sees
        # the copy).
        before, before_staged = copied(), staged()
        ok = bool(run())
        steps.append({
            "step": name, "ok": ok, "copied": copied() - before, "staged": staged() - before_staged,
            "expected": expected_bytes, "expected_staged": 0 if through_pool else expected_bytes,
        })

    keys = [f"{prefix}-{i}" for i in range(8)]
    # 8 MiB in one batch through a 2 MiB staging buffer: staging-sized rounds.
    step("batch_put_from", 8 * mb, lambda: store.batch_put_from(keys, [s + i * mb for i in range(8)], [mb] * 8) == [0] * 8)

    def multi_get():
        # Each key into two scattered halves of dst (key i: its halves at i and 15 - i).
        half = mb // 2
        ptrs = [[d + i * half, d + (15 - i) * half] for i in range(8)]
        got = store.batch_get_into_multi_buffers(keys, ptrs, [[half, half]] * 8)
        exact = all(
            np.array_equal(dst[i * half:(i + 1) * half], src[i * mb:i * mb + half])
            and np.array_equal(dst[(15 - i) * half:(16 - i) * half], src[i * mb + half:(i + 1) * mb])
            for i in range(8)
        )
        return got == [mb] * 8 and exact

    step("batch_get_into_multi_buffers", 8 * mb, multi_get)
    big = f"{prefix}-big"
    # 3 MiB: larger than the whole staging buffer.
    # Copied into a block of the pool (as reads of such objects are), not sent inline.
    step("put_from larger than staging", 3 * mb, lambda: store.put_from(big, s + mb, 3 * mb) == 0, through_pool=True)

    def get_big():
        dst[:] = 0
        return store.get_into(big, d, 3 * mb) == 3 * mb and np.array_equal(dst[:3 * mb], src[mb:4 * mb])

    step("get_into larger than staging", 3 * mb, get_big, through_pool=True)

    def multi_big():
        dst[:] = 0
        got = store.batch_get_into_multi_buffers([big], [[d + 4 * mb, d]], [[2 * mb, mb + 4096]])
        return got == [3 * mb] and np.array_equal(dst[4 * mb:6 * mb], src[mb:3 * mb]) and np.array_equal(dst[:mb], src[3 * mb:4 * mb])

    step("batch_get_into_multi_buffers larger than staging", 3 * mb, multi_big, through_pool=True)
    mine = [e for e in store.status()["dummies"] if e["pid"] == os.getpid()]
    report = {"steps": steps, "cross_memory": [e["cross_memory"] for e in mine]}
    store.close()
    print(json.dumps(report), flush=True)


def tail(master, prefix, count, size, seconds):
    count, size, seconds = int(count), int(size), float(seconds)
    store = MooncakeDistributedStore()
    check(store.setup("127.0.0.1", "P2PHANDSHAKE", 16 << 20, 16 << 20, "tcp", "", master) == 0, "setup")
    print("ready", flush=True)
    until = time.monotonic() + seconds
    read, torn = 0, []
    for i in range(count):
        expected = bytes([i % 251 + 1]) * size
        # A key the writer removed before this reader came to it is skipped.
        give_up = min(until, time.monotonic() + 1.0)
        while time.monotonic() < give_up:
            value = store.get(f"{prefix}-{i}")
            if value:
                break
        else:
            continue
        read += 1
        if value != expected:
            torn.append({"key": i, "len": len(value), "other_bytes": sum(1 for b in value if b != i % 251 + 1)})
    store.close()
    print(json.dumps({"read": read, "torn": torn}), flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"pair": pair, "stress": stress, "staging": staging, "tail": tail}[command](*args)
