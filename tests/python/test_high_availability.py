"""High availability from Python: ``setup()`` in embedded mode with an ``etcd://`` master
address follows the leader of masters run with ``--enable_ha``. Killing the leader
(-9) loses no acknowledged object: after the failover each one reads back byte-exact,
and new puts succeed.

Needs the Debian ``etcd-server`` package (``.ci/run`` installs it); each test starts its
own etcd on free loopback ports.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_testlib import die_with_parent_prefix, free_loopback_port, wait_until  # noqa: E402

from mooncake.store import MooncakeDistributedStore  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (.ci/run installs etcd-server)")


@pytest.fixture
def etcd():
    """A one-member etcd on free loopback ports; answers its client endpoint."""
    data = tempfile.mkdtemp(prefix="mooncake-etcd-")
    client, peer = free_loopback_port(), free_loopback_port()
    proc = subprocess.Popen(
        [
            *die_with_parent_prefix(),
            "etcd",
            "--name=py",
            f"--data-dir={data}/data",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=py=http://127.0.0.1:{peer}",
            "--log-level=error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def healthy():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{client}/health", timeout=1) as answer:
                return b"true" in answer.read()
        except OSError:
            return False

    try:
        assert wait_until(healthy, timeout=20), "etcd did not start"
        yield f"127.0.0.1:{client}"
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def leader_of(masters):
    for master in masters:
        status, body = master.http_get("/health")
        if status == 200 and '"role":"leader"' in body:
            return master
    return None


def in_sync_standbys(master):
    status, body = master.http_get("/health")
    return body.count('"in_sync":true') if status == 200 else -1


def test_setup_with_an_etcd_address_follows_the_leader_across_a_failover(etcd, start_master, monkeypatch):
    cluster = f"py-ha-{os.getpid()}"
    flags = ("--enable_ha", f"--etcd_endpoints={etcd}", f"--cluster_id={cluster}", "--ha_lease_ttl_sec=1")
    masters = [start_master(*flags) for _ in range(3)]
    assert wait_until(lambda: leader_of(masters) is not None, timeout=15)
    monkeypatch.setenv("MC_STORE_CLUSTER_ID", cluster)
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", f"etcd://{etcd}") == 0
    try:
        values = {f"ha-{i}": os.urandom(4096 + i * 1000) for i in range(20)}
        for key, value in values.items():
            assert store.put(key, value) == 0
        leader = leader_of(masters)
        assert wait_until(lambda: in_sync_standbys(leader) == 2, timeout=20)
        leader.proc.kill()
        leader.proc.wait()
        started = time.monotonic()
        assert store.put("after-failover", b"x" * 4096) == 0
        elapsed = time.monotonic() - started
        assert elapsed < 15, f"the first put after the failover took {elapsed:.1f} s"
        for key, value in values.items():
            assert store.get(key) == value, key
        assert store.get("after-failover") == b"x" * 4096
    finally:
        store.close()
