"""Two Python processes sharing objects through one real client (upstream's
test_multi_dummy_clients), and dummies dying without closing."""

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from mooncake_testlib import check_value, die_with_parent_prefix, dummy_entries, wait_until

WORKERS = Path(__file__).resolve().parent / "_workers.py"
LEASE = "300ms"


def spawn(*args):
    return subprocess.Popen(
        [*die_with_parent_prefix(), sys.executable, str(WORKERS), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_processes_share_objects(start_client, connect):
    client = start_client(f"--default_kv_lease_ttl={LEASE}")
    tag = uuid.uuid4().hex[:8]
    key1 = f"test_multi_dummy_client_interaction_client1_{tag}"
    key2 = f"test_multi_dummy_client_interaction_client2_{tag}"
    procs = [spawn("pair", client.address, role, key1, key2, "0.4") for role in ("1", "2")]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=60)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0 and out.strip().endswith("OK"), out
    observer = connect(client.address, pool=2 << 20, staging=2 << 20)
    assert observer.batch_is_exist([key1, key2, key1 + "_t", key2 + "_t"]) == [0, 0, 0, 0]
    # Both dummies exited: the real client released them.
    assert wait_until(lambda: len(observer.status()["dummies"]) == 1)
    assert observer.status()["objects"] == 0


def test_killed_dummy_is_released_at_once(start_client, connect):
    client = start_client()
    observer = connect(client.address, pool=2 << 20, staging=2 << 20)
    proc = spawn("stress", client.address, "killed", "4", "60", "99")
    try:
        assert proc.stdout.readline().strip() == "READY"
        assert wait_until(lambda: any(d["pid"] == proc.pid for d in observer.status()["dummies"]))
        (entry,) = dummy_entries(observer.status(), proc.pid)
        assert entry["mapped_bytes"] == (32 << 20) + (16 << 20)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert wait_until(lambda: not dummy_entries(observer.status(), proc.pid), timeout=3)
    assert observer.status()["mapped_bytes"] == 4 << 20
    assert wait_until(lambda: observer.status()["writes_in_progress"] == 0, timeout=3)
    assert observer.health_check() == 0 and client.alive()
    # Whatever it left is readable and intact.
    for i in range(4):
        value = observer.get(f"killed-{i}")
        if value:
            assert check_value(f"killed-{i}", value) is None
