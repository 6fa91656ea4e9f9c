"""Concurrency: threads in this process and child processes on overlapping keys.

Every value carries a blake2b checksum of its bytes and the key it was written for
(``mooncake_testlib.make_value``); every read is checked. ``MOONCAKE_STRESS_SECONDS``
sets the duration (30 s by default).
"""

import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from mooncake_testlib import StressWorker, check_value, die_with_parent_prefix, dummy_entries, wait_until

from mooncake.store import MooncakeDistributedStore

WORKERS = Path(__file__).resolve().parent / "_workers.py"
SECONDS = float(os.environ.get("MOONCAKE_STRESS_SECONDS", "30"))
THREADS = 8
CHILDREN = 4
NKEYS = 16
MB = 1 << 20


@pytest.mark.slow
def test_threads_and_processes_mixed_workload(start_client):
    client = start_client(segment="1GB")
    store = MooncakeDistributedStore()
    assert store.setup_dummy(64 * MB, 16 * MB, client.address) == 0
    prefix = f"stress-{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}-{i}" for i in range(NKEYS)]
    procs = []
    try:
        # Four children run the same workload for the whole time; a fifth is killed with
        # SIGKILL half-way through (a rank crashing mid-call).
        for worker_id in range(1, CHILDREN + 2):
            procs.append(
                subprocess.Popen(
                    [*die_with_parent_prefix(), sys.executable, str(WORKERS), "stress", client.address, prefix, str(NKEYS), str(SECONDS), str(worker_id)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        for proc in procs:
            line = proc.stdout.readline().strip()
            assert line == "READY", line + proc.stdout.read()
        victim = procs[-1]

        buffer_size = 3 * MB
        buffers = [store.alloc_from_mem_pool(buffer_size) for _ in range(THREADS)]
        assert all(buffers)
        workers = [
            StressWorker(store, names, random.Random(1000 + i), buffers[i], buffer_size, 100 + i) for i in range(THREADS)
        ]
        crashes = []

        def run(worker):
            try:
                worker.run(SECONDS)
            except BaseException as error:  # noqa: BLE001
                crashes.append(f"worker {worker.worker}: {error!r}")

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in workers]
        for thread in threads:
            thread.start()
        time.sleep(SECONDS / 2)
        os.kill(victim.pid, signal.SIGKILL)
        for thread in threads:
            thread.join(SECONDS + 60)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"

        reports = []
        for proc in procs[:-1]:
            out, _ = proc.communicate(timeout=60)
            lines = out.strip().splitlines()
            assert proc.returncode in (0, 1) and lines, f"child crashed (rc {proc.returncode}):\n{out}"
            reports.append(json.loads(lines[-1]))
        victim.communicate(timeout=10)
        assert victim.returncode == -signal.SIGKILL
        reports += [w.report() for w in workers]

        assert not crashes, crashes
        wrong = [r["wrong"] for r in reports if r["wrong_count"]]
        assert not wrong, f"wrong bytes read: {wrong}"
        unexpected = [r["unexpected"] for r in reports if r["unexpected_count"]]
        assert not unexpected, f"unexpected return codes: {unexpected}"
        verified = sum(r["verified"] for r in reports)
        totals = {}
        for report in reports:
            for name, count in report["counts"].items():
                totals[name] = totals.get(name, 0) + count
        print(f"verified reads: {verified}; operations and codes: {json.dumps(totals, sort_keys=True)}")
        assert verified > 500, f"too little verified work: {reports}"
        assert all(r.get("health", 0) == 0 for r in reports)
        assert client.alive(), client.log()
        assert store.health_check() == 0

        # Every child is gone from the real client (the killed one included); only this
        # process's dummy is left, with exactly the memory it registered.
        child_pids = {p.pid for p in procs}
        assert wait_until(lambda: not child_pids & {d["pid"] for d in store.status()["dummies"]}, timeout=5)
        status = store.status()
        (mine,) = dummy_entries(status, os.getpid())
        assert len(status["dummies"]) == 1
        assert mine["segments"] == 2, "the pool grew: blocks leaked during the workload"
        assert mine["mapped_bytes"] == 80 * MB
        assert status["mapped_bytes"] == 80 * MB
        assert wait_until(lambda: store.status()["writes_in_progress"] == 0, timeout=5)

        # No pool block leaked: once the thread buffers are back, the whole initial pool
        # can be allocated in one piece without growing.
        for ptr in buffers:
            assert store.free_to_mem_pool(ptr) == 0
        whole = store.alloc_from_mem_pool(64 * MB)
        assert whole != 0
        assert dummy_entries(store.status(), os.getpid())[0]["segments"] == 2
        assert store.free_to_mem_pool(whole) == 0

        # What is left in the store is intact.
        for name in names:
            value = store.get(name)
            if value:
                assert check_value(name, value) is None
            tensor = store.get_tensor(name + "-tensor")
            if tensor is not None:
                assert np.array_equal(tensor, np.arange(tensor.shape[0], dtype=np.int64) + tensor[0])
        assert store.remove_all(True) >= 0
        assert store.status()["objects"] == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            if proc.stdout:
                proc.stdout.close()
        store.close()


def test_mixed_put_and_put_tensor_concurrency_numpy(store, keys):
    """Upstream's test_00 with numpy: inline puts and tensor staging at the same time."""
    start = threading.Event()
    errors = []
    regular = {keys(f"regular_{i}"): f"regular-payload-{i}-".encode() * 4096 for i in range(16)}
    tensors = {keys(f"tensor_{i}"): (np.arange(4096, dtype=np.float32) + i).reshape(64, 64) for i in range(16)}

    def put_all(items, call):
        start.wait()
        try:
            for key, value in items.items():
                assert call(key, value) == 0
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [
        threading.Thread(target=put_all, args=(regular, store.put)),
        threading.Thread(target=put_all, args=(tensors, store.put_tensor)),
    ]
    for thread in threads:
        thread.start()
    start.set()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    for key, value in regular.items():
        assert store.get(key) == value
    for key, tensor in tensors.items():
        got = store.get_tensor(key)
        assert got.dtype == tensor.dtype and np.array_equal(got, tensor)


def test_many_threads_share_one_store(store, keys):
    """16 threads each doing put/get_into/remove on their own keys through one store."""
    errors = []

    def run(index):
        try:
            rng = random.Random(index)
            ptr = store.alloc_from_mem_pool(256 * 1024)
            assert ptr
            try:
                for round_ in range(30):
                    key = keys(f"{index}-{round_ % 5}")
                    size = rng.choice([10, 1000, 100_000])
                    value = bytes([index]) * size
                    assert store.upsert(key, value) == 0
                    assert store.get_into(key, ptr, 256 * 1024) == size
                    assert ctypes.string_at(ptr, size) == value
                    assert store.remove(key, True) == 0
            finally:
                store.free_to_mem_pool(ptr)
        except BaseException as error:  # noqa: BLE001
            errors.append(f"thread {index}: {error!r}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors


def test_close_while_other_threads_are_in_calls(real_client, connect):
    store = connect(real_client.address, pool=32 * MB, staging=16 * MB)
    value = bytes(range(256)) * (2 * MB // 256)
    assert store.upsert("close-race", value) == 0
    seen = []
    stop = threading.Event()

    def run():
        ptr = store.alloc_from_mem_pool(4 * MB)
        while not stop.is_set():
            data = store.get("close-race")
            seen.append(data in (b"", value))
            if ptr:
                got = store.get_into("close-race", ptr, 4 * MB)
                seen.append(got < 0 or (got == len(value) and ctypes.string_at(ptr, got) == value))
            handle = store.get_buffer("close-race")
            seen.append(handle is None or bytes(handle) == value)
            del handle

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    assert store.close() == 0
    time.sleep(0.3)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads)
    assert seen and all(seen)
    assert store.health_check() == 1
