"""Only allowed local users and authenticated cluster members touch the store (issue:
hostile peers, findings 1, 2 and 12).

* A single node started with defaults listens on loopback only, and its embedded master
  and transfer engine admit only processes that know the secret it writes for its own
  user (mode 0600): another uid can neither join through the master nor read the segment
  through the transfer port. A busy embedded-master port is a startup error.
* With ``--cluster_secret_file`` (or ``MOONCAKE_CLUSTER_SECRET_FILE``) a master and its
  nodes prove membership to each other on every connection; a node without the secret,
  or with another one, is refused with a log line naming the peer.
* A node of a cluster whose master is on another machine must say which address it has
  (``--host``): the wildcard default names no address peers can reach.
"""

import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_testlib import (  # noqa: E402
    as_user_prefix,
    client_binary,
    die_with_parent_prefix,
    free_loopback_port,
    socket_accepts,
    wait_until,
)

from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402

NOBODY = 65534


def listening_addresses(pid):
    """(ip, port) of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        with open(table) as lines:
            next(lines)
            for line in lines:
                fields = line.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state != "0A" or inode not in inodes:
                    continue
                hex_ip, hex_port = local.split(":")
                raw = bytes.fromhex(hex_ip)
                if family == 4:
                    ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
                else:
                    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                    ip = socket.inet_ntop(socket.AF_INET6, words)
                found.append((ip, int(hex_port, 16)))
    return found


def run_client(*flags, prefix=(), env=None, timeout=30):
    """Runs ``mooncake_client`` expecting it to stop by itself; (exit code, output)."""
    port = 45000 + os.getpid() % 4000 + int(time.monotonic_ns() % 997)
    done = subprocess.run(
        [*prefix, str(client_binary()), f"--port={port}", "--global_segment_size=32MB", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )
    return done.returncode, done.stdout + done.stderr


def raw_transfer_read(port, segment=1, length=4096):
    """What an unauthenticated peer gets for a read of the first ``length`` bytes of
    ``segment`` from the transfer engine on ``port`` (b"" when it is refused)."""
    request = b"MCTE" + bytes([1, 0, 0, 0]) + struct.pack("<QQQ", segment, 0, length)
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
        # Padded to a full authentication hello, so an authenticating server answers at once.
        peer.sendall(request + bytes(16))
        try:
            while chunk := peer.recv(65536):
                received += chunk
                if len(received) >= 16 + length:
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    return received


def put_on(store, key, value, segment):
    config = ReplicateConfig()
    config.preferred_segment = segment
    assert store.put(key, value, config) == 0


def write_secret(directory, name, text):
    path = Path(directory) / name
    path.write_text(text)
    path.chmod(0o600)
    return path


def test_a_single_node_listens_on_loopback_only(start_client):
    master_port = free_loopback_port()
    http_port = free_loopback_port()
    client = start_client(f"--embedded_master_port={master_port}", "--enable_http_server", f"--http_port={http_port}")
    # The HTTP server starts with serving, just after the socket accepts.
    wait_until(lambda: {master_port, http_port} <= {port for _, port in listening_addresses(client.pid)})
    addresses = listening_addresses(client.pid)
    ports = {port for _, port in addresses}
    assert master_port in ports and http_port in ports and len(ports) >= 3, addresses
    wide = [(ip, port) for ip, port in addresses if not ip.startswith("127.")]
    assert not wide, f"listening beyond loopback: {wide}"


def test_the_local_users_processes_join_the_embedded_master_and_others_are_refused(start_client, connect, tmp_path):
    master_port = free_loopback_port()
    transfer_port = free_loopback_port()
    owner = start_client(f"--embedded_master_port={master_port}", f"--transfer_port={transfer_port}")
    owner_segment = f"0.0.0.0:{owner.port}"
    value = os.urandom(4096)
    writer = connect(owner.address)
    put_on(writer, "private", value, owner_segment)

    # A second node of the same user finds the secret and joins.
    peer = start_client(f"--master_server_address=127.0.0.1:{master_port}", "--host=127.0.0.1")
    reader = connect(peer.address)
    assert reader.get("private") == value

    # Without the secret, the transfer engine serves nothing.
    assert raw_transfer_read(transfer_port) == b""
    assert "did not prove cluster membership" in owner.log()

    # Another user cannot read the secret, so the master refuses its node.
    prefix = as_user_prefix(NOBODY)
    if prefix is None or os.geteuid() != 0:
        pytest.skip("needs root and setpriv to run a process as another user")
    code, output = run_client(
        f"--master_server_address=127.0.0.1:{master_port}",
        "--host=127.0.0.1",
        prefix=prefix,
        env={"XDG_RUNTIME_DIR": str(tmp_path)},
    )
    assert code != 0, output
    assert "master" in output and "refused" in output, output
    assert reader.get("private") == value
    assert owner.alive() and peer.alive()


def test_a_busy_embedded_master_port_is_a_startup_error():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        code, output = run_client(f"--embedded_master_port={port}")
    assert code != 0
    assert f"cannot serve the embedded master on 127.0.0.1:{port}" in output, output
    assert "--embedded_master_port" in output


def test_a_wildcard_host_is_refused_when_the_master_is_on_another_machine():
    code, output = run_client("--master_server_address=192.0.2.1:50051")
    assert code != 0
    assert "--host" in output and "wildcard" in output, output


def test_a_cluster_with_a_secret_admits_members_and_refuses_everyone_else(start_master, master_client, connect, tmp_path):
    secret = write_secret(tmp_path, "cluster.secret", "a secret shared by the cluster members\n")
    master = start_master(f"--cluster_secret_file={secret}")
    transfer_ports = [free_loopback_port() for _ in range(3)]
    nodes = [
        master_client(master, f"--cluster_secret_file={secret}", f"--transfer_port={port}")
        for port in transfer_ports
    ]
    stores = [connect(node.address) for node in nodes]
    values = {}
    for i, node in enumerate(nodes):
        key = f"member-{i}"
        values[key] = os.urandom(1 << 20)
        # Written through the next node onto this one's segment: node-to-node transfers.
        put_on(stores[(i + 1) % 3], key, values[key], f"127.0.0.1:{node.port}")
    for store in stores:
        for key, value in values.items():
            assert store.get(key) == value

    # Without a secret, or with another one, a node cannot join.
    code, output = run_client(f"--master_server_address={master.address}", "--host=127.0.0.1")
    assert code != 0 and "refused" in output, output
    other = write_secret(tmp_path, "other.secret", "not the secret of this cluster\n")
    code, output = run_client(
        f"--master_server_address={master.address}",
        "--host=127.0.0.1",
        env={"MOONCAKE_CLUSTER_SECRET_FILE": str(other)},
    )
    assert code != 0 and "check --cluster_secret_file" in output, output
    assert wait_until(lambda: "did not prove cluster membership" in master.log())

    # A raw peer gets nothing from any transfer port, and the store is unchanged.
    for port in transfer_ports:
        assert raw_transfer_read(port, segment=1) == b""
        assert raw_transfer_read(port, segment=2) == b""
    for store in stores:
        for key, value in values.items():
            assert store.get(key) == value
    assert master.alive() and all(node.alive() for node in nodes)


def test_a_secret_file_readable_by_others_is_refused(tmp_path):
    secret = write_secret(tmp_path, "loose.secret", "a secret shared by the cluster members\n")
    secret.chmod(0o644)
    code, output = run_client(f"--cluster_secret_file={secret}")
    assert code != 0
    assert "chmod 600" in output, output


def test_the_embedded_store_joins_a_local_embedded_master(start_client):
    """Python ``setup()`` pointed at a local real client's embedded master (the way
    upstream's benchmark runs its embedded modes) authenticates with that user's secret."""
    master_port = free_loopback_port()
    owner = start_client(f"--embedded_master_port={master_port}")
    assert socket_accepts(owner.port)
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", f"127.0.0.1:{master_port}") == 0
    try:
        value = os.urandom(8192)
        put_on(store, "embedded-joins", value, f"0.0.0.0:{owner.port}")
        assert store.get("embedded-joins") == value
    finally:
        store.close()


def test_a_node_whose_segment_name_is_mounted_again_stops_serving_it(start_master, master_client, connect, tmp_path):
    """Two instances with one segment name (a node restarted while its old instance
    still runs, or two nodes given the same --host and --port): the newest owns the
    name; the old one is told so at its next heartbeat and stops serving its segment,
    instead of serving objects that are no longer its own."""
    master = start_master()
    first = master_client(master)
    name = f"127.0.0.1:{first.port}"
    before = connect(first.address)
    put_on(before, "old-segment", b"x" * 4096, name)
    log_path = tmp_path / "second.log"
    with open(log_path, "wb") as log:
        second = subprocess.Popen(
            [
                *die_with_parent_prefix(),
                str(client_binary()),
                f"--port={first.port}",
                f"--socket_path={tmp_path / 'second.sock'}",
                f"--master_server_address={master.address}",
                "--host=127.0.0.1",
                "--embedded_master_port=0",
                "--global_segment_size=64MB",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        assert wait_until(lambda: "no longer contributes memory" in first.log(), timeout=10), first.log()
        assert first.alive() and second.poll() is None
        # The name now means the second instance's segment; objects written there are
        # read back through the first node, which reaches it as a peer.
        value = os.urandom(1 << 20)
        put_on(before, "new-segment", value, name)
        assert before.get("new-segment") == value
        assert before.get("old-segment") != b"x" * 4096  # went away with the old segment
    finally:
        second.terminate()
        second.wait(10)
