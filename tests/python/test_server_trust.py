"""A dummy shares memory only with a real client it trusts (issue: hostile peers, finding 3).

While ``mooncake_client`` is down, any process of the network namespace can bind its
abstract socket name. The dummy checks the credentials of whoever answers
(``SO_PEERCRED``): its own uid, root, or a uid listed in ``MOONCAKE_CLIENT_UIDS``;
anything else is refused before a single byte (let alone a memfd) is sent.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_testlib import abstract_socket_name, as_user_prefix  # noqa: E402

from mooncake.store import MooncakeDistributedStore  # noqa: E402

# A listener on an abstract socket that reports how many bytes and descriptors its first
# peer sent, then exits. Run as another user.
IMPOSTOR = r"""
import array, socket, sys
name = "\0" + sys.argv[1]
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(name)
server.listen(8)
print("listening", flush=True)
peer, _ = server.accept()
peer.settimeout(5)
received, fds = 0, 0
try:
    while True:
        data, ancdata, _, _ = peer.recvmsg(65536, socket.CMSG_SPACE(64 * 4))
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += len(payload) // 4
        if not data:
            break
        received += len(data)
except OSError:
    pass
print(f"received {received} fds {fds}", flush=True)
"""


def _free_port():
    for port in range(41000, 42000):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(abstract_socket_name(port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free abstract socket name")


def _impostor(port, uid):
    python = "/usr/bin/python3"
    if not os.access(python, os.X_OK):
        pytest.skip("no system python3 that another user can run")
    proc = subprocess.Popen(
        [*as_user_prefix(uid), python, "-c", IMPOSTOR, abstract_socket_name(port)[1:]],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "listening"
    return proc


needs_root = pytest.mark.skipif(
    shutil.which("setpriv") is None or os.geteuid() != 0,
    reason="running a process as another user needs setpriv and root",
)


@needs_root
def test_a_dummy_sends_nothing_to_a_server_of_another_uid():
    port = _free_port()
    impostor = _impostor(port, 65534)
    try:
        store = MooncakeDistributedStore()
        started = time.monotonic()
        assert store.setup_dummy(16 << 20, 8 << 20, str(port)) != 0
        assert time.monotonic() - started < 10
        report = impostor.communicate(timeout=10)[0]
        assert "received 0 fds 0" in report, report
    finally:
        impostor.kill()
        impostor.wait()


@needs_root
def test_a_server_uid_listed_in_the_environment_is_trusted():
    """With MOONCAKE_CLIENT_UIDS naming the server's uid, the dummy talks to it (here an
    impostor that never answers: the dummy sends its hello, so bytes arrive)."""
    port = _free_port()
    impostor = _impostor(port, 65534)
    code = (
        "import sys; from mooncake.store import MooncakeDistributedStore as S; "
        f"sys.exit(0 if S().setup_dummy(1 << 20, 1 << 20, '{port}') != 0 else 1)"
    )
    try:
        worker = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "MOONCAKE_CLIENT_UIDS": "65534"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert worker.returncode == 0, worker.stderr
        report = impostor.communicate(timeout=10)[0]
        assert "received 0 fds 0" not in report, report
        assert "fds 0" in report, "no memory before the server's welcome"
    finally:
        impostor.kill()
        impostor.wait()
