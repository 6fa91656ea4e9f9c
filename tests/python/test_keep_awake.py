"""Keeping cores awake after requests (`--keep_awake_us`): idle-priority threads of
``mooncake_client`` and ``mooncake_master`` that spin for a short window after each
request and sleep otherwise; off with 0; a bad value stops the process with a message
naming the flag."""

import os
import re
import subprocess
import urllib.request

from mooncake_testlib import client_binary, free_loopback_port, master_binary, wait_until

SCHED_IDLE = 5


def keep_awake_threads(pid):
    """{tid: (state, scheduling policy)} of the process's keep-awake threads."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except FileNotFoundError:
            continue
        if name.startswith("keep-awake-"):
            # Fields after the command name: state is the 3rd field, policy the 41st.
            fields = stat[stat.rindex(")") + 2 :].split()
            threads[int(tid)] = (fields[0], int(fields[38]))
    return threads


def metric(port, name):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def test_idle_priority_threads_spin_after_requests_and_then_sleep(start_client, connect, keys):
    http = free_loopback_port()
    node = start_client("--keep_awake_us=2000", "--enable_http_server", f"--http_port={http}")
    threads = keep_awake_threads(node.pid)
    assert 1 <= len(threads) <= min(8, os.cpu_count())
    assert all(policy == SCHED_IDLE for _, policy in threads.values()), threads
    store = connect(node.address)
    key = keys("k")
    assert store.put(key, b"x" * 4096) == 0
    for _ in range(20):
        assert store.get(key) == b"x" * 4096
    assert wait_until(lambda: metric(http, "mooncake_client_keep_awake_seconds_total") > 0, timeout=5)
    # Without requests they all sleep.
    assert wait_until(
        lambda: all(state == "S" for state, _ in keep_awake_threads(node.pid).values()), timeout=5
    ), keep_awake_threads(node.pid)


def test_zero_turns_it_off(start_client, connect, keys):
    node = start_client("--keep_awake_us=0")
    store = connect(node.address)
    assert store.put(keys("k"), b"y") == 0
    assert keep_awake_threads(node.pid) == {}


def test_the_master_keeps_its_cores_awake_too(start_master):
    master = start_master()
    threads = keep_awake_threads(master.proc.pid)
    assert threads and all(policy == SCHED_IDLE for _, policy in threads.values()), threads
    assert "\nmooncake_master_keep_awake_seconds_total " in master.http_get("/metrics")[1]


def test_bad_values_stop_the_process_with_the_flag_named():
    for binary in (client_binary(), master_binary()):
        for bad in ("10001", "-5", "2ms"):
            done = subprocess.run(
                [str(binary), f"--keep_awake_us={bad}"], capture_output=True, text=True, timeout=30
            )
            assert done.returncode == 2, (binary, bad, done.stderr)
            assert "--keep_awake_us" in done.stderr and "whole microseconds" in done.stderr, done.stderr
        done = subprocess.run(
            [str(binary)], capture_output=True, text=True, timeout=30, env={**os.environ, "MOONCAKE_KEEP_AWAKE_US": "x"}
        )
        assert done.returncode == 2 and "MOONCAKE_KEEP_AWAKE_US" in done.stderr, done.stderr
