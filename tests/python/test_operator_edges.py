"""The edges of the swap an operator's scripts meet: SGLang's `MOONCAKE_CHECK_SERVER`
against a single `mooncake_client` (its embedded master's HTTP endpoints), the TCP
readiness port start scripts and Kubernetes probes wait for, and its limits."""

import socket
import subprocess
import time
import urllib.error
import urllib.request


from mooncake_testlib import client_binary, free_loopback_port, tcp_accepts, wait_until


def http_get(port, path, timeout=3.0):
    """(status, body) of ``GET http://127.0.0.1:<port><path>``; (None, "") when nothing
    answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except OSError:
        return None, ""


def sglang_check_server(metrics_port, limit_s=10.0, every_s=0.2):
    """SGLang HiCache's `check_server`: poll the master's `/get_all_segments` until the
    body is non-empty (SGLang polls every 3 s for up to 10 minutes)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        status, body = http_get(metrics_port, "/get_all_segments")
        if status == 200 and body.strip():
            return body
        time.sleep(every_s)
    return None


def test_sglangs_server_check_passes_against_one_mooncake_client(start_client):
    port = free_loopback_port()
    client = start_client(f"--metrics_port={port}")
    body = sglang_check_server(port)
    assert body is not None, f"no segment listed on 127.0.0.1:{port}:\n{client.log()}"
    assert f":{client.port}" in body, body
    status, health = http_get(port, "/health")
    assert status == 200, health
    status, metrics = http_get(port, "/metrics")
    assert status == 200 and "master_" in metrics, metrics[:300]
    status, _ = http_get(port, "/get_all_keys")
    assert status == 200


def test_the_embedded_master_answers_in_the_standalone_masters_formats(start_client, start_master, master_client):
    port = free_loopback_port()
    single = start_client(f"--metrics_port={port}")
    master = start_master()
    joined = master_client(master)
    assert sglang_check_server(master.metrics_port) is not None
    for path in ("/get_all_segments", "/get_all_keys", "/health"):
        ours_status, ours = http_get(port, path)
        theirs_status, theirs = master.http_get(path)
        assert ours_status == theirs_status == 200, (path, ours, theirs)
        # One segment each, named after its own node: the same shape of answer.
        assert ours.count("\n") == theirs.count("\n"), (path, ours, theirs)
    assert single.alive() and joined.alive()


def test_master_http_flags_are_refused_with_a_remote_master(tmp_path):
    for flag in ("--metrics_port=19003", "--enable_http_metadata_server"):
        run = subprocess.run(
            [
                str(client_binary()),
                f"--port={free_loopback_port()}",
                "--master_server_address=127.0.0.1:1",
                "--global_segment_size=64MB",
                flag,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert run.returncode == 2, run
        name = flag.split("=")[0].lstrip("-")
        assert name in run.stderr and "give the flag to that mooncake_master" in run.stderr, run.stderr


def test_the_readiness_port_answers_probes_and_nothing_else(start_client):
    client = start_client()
    assert tcp_accepts(client.port), "no TCP listener on 127.0.0.1:<port>"
    status, body = http_get(client.port, "/health")
    assert (status, body) == (200, "OK\n")
    assert http_get(client.port, "/status")[0] == 404
    # A bare probe (connect, close) and a peer that sends garbage get nothing.
    with socket.create_connection(("127.0.0.1", client.port), timeout=1):
        pass
    with socket.create_connection(("127.0.0.1", client.port), timeout=2) as peer:
        peer.sendall(b"\x00\x01hello\r\n\r\n")
        peer.settimeout(2)
        answer = peer.recv(4096)
        assert not answer.startswith(b"HTTP/1.1 200"), answer
    assert client.alive()
    assert http_get(client.port, "/health")[0] == 200


def test_the_readiness_port_moves_or_turns_off(start_client):
    moved = free_loopback_port()
    client = start_client(f"--readiness_port={moved}")
    assert http_get(moved, "/health")[0] == 200
    assert not tcp_accepts(client.port)
    off = start_client("--readiness_port=0")
    assert not tcp_accepts(off.port)


def test_a_busy_readiness_port_that_was_asked_for_stops_startup(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = holder.getsockname()[1]
        run = subprocess.run(
            [
                str(client_binary()),
                f"--port={free_loopback_port()}",
                "--global_segment_size=64MB",
                "--embedded_master_port=0",
                f"--readiness_port={busy}",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
    assert run.returncode != 0, run
    assert f"127.0.0.1:{busy}" in run.stderr and "--readiness_port" in run.stderr, run.stderr


def test_a_busy_default_readiness_port_is_only_warned_about(start_client):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = holder.getsockname()[1]
        client = start_client(port=busy)
        assert client.alive()
        assert wait_until(lambda: "readiness port" in client.log(), timeout=5), client.log()
