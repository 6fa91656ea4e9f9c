"""One embedded master runs one maintenance loop (eviction, lease and client expiry, task
timeouts), whether it is served over TCP to other nodes or not: two loops would run two
eviction passes at once, which can evict more than they should.

The real client's ``/metrics`` counts the passes (``mooncake_client_maintenance_rounds_total``);
one loop runs at most one pass per 50 ms interval."""

import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_testlib import free_loopback_port, start_real_client, wait_until  # noqa: E402

INTERVAL_S = 0.05
METRIC = "mooncake_client_maintenance_rounds_total "


def rounds(http_port):
    """The pass count from the real client's /metrics, or None while it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=3) as reply:
            text = reply.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(METRIC):
            return int(line[len(METRIC):])
    raise AssertionError(f"/metrics has no {METRIC.strip()}:\n{text}")


@pytest.mark.parametrize("served", [True, False], ids=["served-over-tcp", "in-process-only"])
def test_an_embedded_master_runs_one_maintenance_loop(tmp_path, served):
    http_port = free_loopback_port()
    flags = ["--enable_http_server=true", f"--http_port={http_port}"]
    if served:
        flags.append(f"--embedded_master_port={free_loopback_port()}")
    client = start_real_client(tmp_path, *flags)
    try:
        assert wait_until(lambda: rounds(http_port) is not None), client.log()
        first, started = rounds(http_port), time.monotonic()
        time.sleep(2.0)
        second, elapsed = rounds(http_port), time.monotonic() - started
        done = second - first
        # A busy machine runs fewer passes, never more: two loops would run about twice
        # as many as one interval allows.
        allowed = elapsed / INTERVAL_S + 2
        assert 0 < done <= allowed, f"{done} maintenance passes in {elapsed:.2f} s (one loop: at most {allowed:.0f})"
    finally:
        client.stop()
