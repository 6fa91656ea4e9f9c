"""Child processes of the multi-process tests (run with the venv's python).

``python _workers.py pair ADDRESS ROLE KEY1 KEY2 LEASE_S``
    upstream's test_multi_dummy_clients: ROLE (1 or 2) puts its key, waits for the
    other's, reads and checks it, then removes it once the lease has expired.

``python _workers.py stress ADDRESS PREFIX NKEYS SECONDS WORKER_ID``
    the mixed workload of the concurrency test; prints a JSON report on the last line.
"""

import json
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


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {"pair": pair, "stress": stress}[command](*args)
