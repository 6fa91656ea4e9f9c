"""Helpers shared by the Python tests and their child processes.

Kept free of pytest so that the worker scripts (run as separate interpreters) can import
it too. Nothing here starts processes; see ``conftest.py`` for the fixtures.
"""

import ctypes
import hashlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


def client_binary():
    """Path of the ``mooncake_client`` binary (``MOONCAKE_CLIENT_BIN`` overrides)."""
    override = os.environ.get("MOONCAKE_CLIENT_BIN")
    if override:
        return Path(override)
    return REPO_ROOT / "target" / "release" / "mooncake_client"


def die_with_parent_prefix():
    """``setpriv --pdeathsig TERM`` when available: a process started by the tests gets
    SIGTERM if the test process dies (even by SIGKILL or a segfault), so no real client
    is left behind. (A ``preexec_fn`` would not be safe: embedded stores run threads.)"""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "TERM"] if setpriv else []


def as_user_prefix(uid):
    """``setpriv`` running the command as ``uid`` (group ``uid``, no supplementary
    groups), dying with the test process; ``None`` without setpriv."""
    setpriv = shutil.which("setpriv")
    if not setpriv:
        return None
    return [setpriv, "--pdeathsig", "TERM", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def abstract_socket_name(port):
    return f"\0@mooncake_client_{port}.sock"


def socket_accepts(port):
    """True when something accepts connections on the real client's abstract socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(abstract_socket_name(port))
            return True
        except OSError:
            return False


class _Process:
    """A process the tests started (``proc``), with its log file (``log_path``)."""

    def alive(self):
        return self.proc.poll() is None

    def log(self):
        try:
            return Path(self.log_path).read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout=5.0):
        """SIGTERM, then SIGKILL if it does not exit in time. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        return self.proc.returncode


class RealClient(_Process):
    """A ``mooncake_client`` process started by the tests."""

    def __init__(self, proc, port, log_path, flags):
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.flags = flags

    @property
    def address(self):
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self):
        return self.proc.pid

    def kill(self):
        """SIGKILL (a crash of the real client)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def __repr__(self):
        return f"RealClient(port={self.port}, pid={self.proc.pid}, flags={self.flags})"


_starts = [0]


def _candidate_port(attempt):
    base = os.getpid() % 20000
    return 20000 + (base + 7919 * attempt) % 20000


def start_real_client(log_dir, *flags, segment="512MB", port=None, timeout=15.0, uid=None, env=None):
    """Starts ``mooncake_client`` on a port unique to this test session (retrying another
    port when the socket is already in use) and waits until a dummy can attach. With
    ``uid``, it runs as that user (through setpriv, which must exist); ``env`` adds
    environment variables."""
    prefix = die_with_parent_prefix() if uid is None else as_user_prefix(uid)
    binary = client_binary()
    if not binary.exists():
        raise RuntimeError(f"{binary} does not exist: build it with `cargo build --release`")
    last_log = ""
    for _ in range(30):
        if port is None:
            candidate = _candidate_port(_starts[0])
            _starts[0] += 1
            if socket_accepts(candidate):
                continue  # someone else (another session) serves this port
        else:
            candidate = port
        log_path = Path(log_dir) / f"mooncake_client_{candidate}_{time.monotonic_ns()}.log"
        # The embedded master is served over TCP only when a test asks for it (its
        # default port 50051 can be served by one real client per machine).
        quiet_master = [] if any(f.startswith("--embedded_master_port") for f in flags) else ["--embedded_master_port=0"]
        args = [
            *prefix,
            str(binary),
            f"--port={candidate}",
            f"--global_segment_size={segment}",
            "--log_level=warn",
            *quiet_master,
            *flags,
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env} if env else None,
            )
        client = RealClient(proc, candidate, log_path, list(flags))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if socket_accepts(candidate) and proc.poll() is None:
                if _owned_by(client):
                    return client
            time.sleep(0.01)
        client.stop()
        last_log = client.log()
        if "already in use" in last_log and port is None:
            continue
        raise RuntimeError(f"mooncake_client {args} did not start (rc={proc.returncode}):\n{last_log}")
    raise RuntimeError(f"no free port for mooncake_client; last log:\n{last_log}")


def _listening_inodes(port):
    """Inodes of the listening sockets named ``@mooncake_client_<port>.sock``."""
    name = "@" + abstract_socket_name(port)[1:]
    inodes = set()
    with open("/proc/net/unix") as table:
        next(table)
        for line in table:
            fields = line.split()
            if len(fields) >= 8 and fields[7] == name and fields[5] == "01":  # SS_UNCONNECTED
                inodes.add(fields[6])
    return inodes


def _owned_by(client):
    """True when the socket that accepts is the one our process listens on (not another
    session's real client on the same port). Checked through /proc, without attaching a
    dummy, so that no session lingers in the real client's status."""
    try:
        inodes = _listening_inodes(client.port)
        fds = Path(f"/proc/{client.pid}/fd")
        ours = {os.readlink(fd)[len("socket:["):-1] for fd in fds.iterdir() if os.readlink(fd).startswith("socket:[")}
    except OSError:
        return True  # no /proc: trust the process being alive
    return bool(inodes & ours)


# ----- a standalone master (mooncake_master) on loopback -----


def master_binary():
    """Path of the ``mooncake_master`` binary (``MOONCAKE_MASTER_BIN`` overrides)."""
    override = os.environ.get("MOONCAKE_MASTER_BIN")
    if override:
        return Path(override)
    return REPO_ROOT / "target" / "release" / "mooncake_master"


def free_loopback_port():
    """A TCP port free on 127.0.0.1 right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tcp_accepts(port, host="127.0.0.1"):
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class StandaloneMaster(_Process):
    """A ``mooncake_master`` process started by the tests, on loopback ports."""

    def __init__(self, proc, rpc_port, metrics_port, log_path, flags):
        self.proc = proc
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.flags = flags

    @property
    def address(self):
        """``host:port`` for ``--master_server_address`` and ``setup(..., master)``."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def host(self):
        return "127.0.0.1"

    def http_get(self, path, timeout=3.0):
        """(status, body text) of ``GET http://127.0.0.1:<metrics port><path>``."""
        import urllib.error  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415

        url = f"http://127.0.0.1:{self.metrics_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode(errors="replace")

    def __repr__(self):
        return f"StandaloneMaster(rpc={self.rpc_port}, metrics={self.metrics_port}, pid={self.proc.pid})"


def start_standalone_master(log_dir, *flags, timeout=15.0):
    """Starts ``mooncake_master`` with its RPC and metrics/HTTP servers on free loopback
    ports (retrying other ports when one is taken meanwhile) and waits until its RPC port
    accepts connections."""
    binary = master_binary()
    if not binary.exists():
        raise RuntimeError(f"{binary} does not exist: build it with `cargo build --release --bins`")
    last_log = ""
    for _ in range(10):
        rpc_port = free_loopback_port()
        metrics_port = free_loopback_port()
        if metrics_port == rpc_port:
            continue
        log_path = Path(log_dir) / f"mooncake_master_{rpc_port}_{time.monotonic_ns()}.log"
        args = [
            *die_with_parent_prefix(),
            str(binary),
            f"--rpc_port={rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={metrics_port}",
            "--metrics_host=127.0.0.1",
            "--enable_metric_reporting=false",
            *flags,
        ]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        master = StandaloneMaster(proc, rpc_port, metrics_port, log_path, list(flags))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if tcp_accepts(rpc_port) and proc.poll() is None:
                return master
            time.sleep(0.02)
        master.stop()
        last_log = master.log()
        if "in use" in last_log:
            continue
        raise RuntimeError(f"mooncake_master {args} did not start (rc={proc.returncode}):\n{last_log}")
    raise RuntimeError(f"no free ports for mooncake_master; last log:\n{last_log}")


def wait_until(predicate, timeout=5.0, interval=0.02):
    """Polls ``predicate`` until it returns a truthy value (returned) or time runs out
    (returns the last value)."""
    deadline = time.monotonic() + timeout
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval)
        value = predicate()
    return value


# ----- checksummed values (concurrency tests) -----

DIGEST = 8


def make_value(key, version, size, rng=None):
    """``[8-byte blake2b of the rest][key|version|filler]`` of at least ``size`` bytes."""
    head = f"{key}|{version}|".encode()
    filler_len = max(0, size - DIGEST - len(head))
    filler = rng.randbytes(filler_len) if rng is not None else os.urandom(filler_len)
    body = head + filler
    return hashlib.blake2b(body, digest_size=DIGEST).digest() + body


def check_value(key, value):
    """None when ``value`` is an intact value written for ``key``, else what is wrong."""
    value = bytes(value)
    if len(value) < DIGEST + len(key) + 1:
        return f"{key}: value of {len(value)} bytes is too short"
    body = value[DIGEST:]
    if hashlib.blake2b(body, digest_size=DIGEST).digest() != value[:DIGEST]:
        return f"{key}: checksum mismatch in a value of {len(value)} bytes (starts {value[:40]!r})"
    if not body.startswith(f"{key}|".encode()):
        return f"{key}: got the value of another key ({body[:60]!r})"
    return None


def write_at(ptr, data):
    ctypes.memmove(ptr, data, len(data))


def read_at(ptr, size):
    return ctypes.string_at(ptr, size)


def buffer_address(obj):
    """Address of a writable buffer-protocol object (bytearray, numpy array)."""
    try:
        import numpy  # noqa: PLC0415

        if isinstance(obj, numpy.ndarray):
            return obj.ctypes.data
    except ImportError:
        pass
    return ctypes.addressof((ctypes.c_char * len(obj)).from_buffer(obj))


def dummy_entries(status, pid):
    return [d for d in status["dummies"] if d["pid"] == pid]


# ----- the mixed workload of the concurrency test (threads and child processes) -----

VALUE_SIZES = [100, 2000, 30_000, 200_000, 1_100_000]
VALUE_WEIGHTS = [30, 30, 25, 12, 3]

# Codes a call may legitimately return while other clients write and remove the same keys.
ALLOWED = {
    "put": {0, -200},
    "upsert": {0, -200, -714},
    "put_from": {0, -200},
    "upsert_from": {0, -200, -714},
    "get_into": {-703, -704, -707},
    "batch_get_into": {-600, -703, -704, -707},
    "remove": {0, -703, -704, -706},
    "is_exist": {0, 1},
    "put_tensor": {0, -200},
    "upsert_tensor": {0, -200, -714},
}

OPS = [
    ("put", 14),
    ("upsert", 8),
    ("put_from", 8),
    ("upsert_from", 5),
    ("get", 14),
    ("get_into", 14),
    ("batch_get_into", 6),
    ("get_buffer", 8),
    ("remove", 6),
    ("is_exist", 5),
    ("tensor", 6),
]


def _key_tag(key):
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=3).digest(), "little")


class StressWorker:
    """Runs random mixed operations on shared keys and checks every byte it reads."""

    def __init__(self, store, names, rng, buffer_ptr, buffer_size, worker_id):
        self.store = store
        self.names = names
        self.rng = rng
        self.buf = buffer_ptr
        self.buf_size = buffer_size
        self.worker = worker_id
        self.version = 0
        self.counts = {}
        self.verified = 0
        self.wrong = []
        self.unexpected = []
        self.op_names = [name for name, _ in OPS]
        self.op_weights = [weight for _, weight in OPS]

    def _code(self, op, code):
        self.counts[f"{op}:{code}"] = self.counts.get(f"{op}:{code}", 0) + 1
        if code not in ALLOWED[op]:
            self.unexpected.append(f"{op} returned {code}")

    def _check(self, key, data, how):
        problem = check_value(key, data)
        if problem:
            self.wrong.append(f"{how}: {problem}")
        else:
            self.verified += 1

    def _value(self, key, limit=None):
        size = self.rng.choices(VALUE_SIZES, VALUE_WEIGHTS)[0]
        if limit is not None:
            size = min(size, limit)
        self.version += 1
        return make_value(key, f"{self.worker}:{self.version}", size, self.rng)

    def step(self):
        import numpy as np  # noqa: PLC0415

        store, rng = self.store, self.rng
        key = rng.choice(self.names)
        op = rng.choices(self.op_names, self.op_weights)[0]
        self.counts[op] = self.counts.get(op, 0) + 1
        if op in ("put", "upsert"):
            call = store.put if op == "put" else store.upsert
            self._code(op, call(key, self._value(key)))
        elif op in ("put_from", "upsert_from"):
            value = self._value(key, self.buf_size)
            write_at(self.buf, value)
            call = store.put_from if op == "put_from" else store.upsert_from
            self._code(op, call(key, self.buf, len(value)))
        elif op == "get":
            data = store.get(key)
            if data:
                self._check(key, data, "get")
        elif op == "get_into":
            got = store.get_into(key, self.buf, self.buf_size)
            if got > 0:
                self._check(key, read_at(self.buf, got), "get_into")
            else:
                self._code(op, got)
        elif op == "batch_get_into":
            other = rng.choice(self.names)
            half = self.buf_size // 2
            results = store.batch_get_into([key, other], [self.buf, self.buf + half], [half, half])
            for name, ptr, got in zip((key, other), (self.buf, self.buf + half), results):
                if got > 0:
                    self._check(name, read_at(ptr, got), "batch_get_into")
                else:
                    self._code(op, got)
        elif op == "get_buffer":
            handle = store.get_buffer(key)
            if handle is not None:
                self._check(key, bytes(handle), "get_buffer")
                del handle
        elif op == "remove":
            self._code(op, store.remove(key, rng.random() < 0.5))
        elif op == "is_exist":
            self._code(op, store.is_exist(key))
        elif op == "tensor":
            tkey = key + "-tensor"
            tag = _key_tag(tkey)
            if rng.random() < 0.5:
                self.version += 1
                n = rng.choice([1, 100, 5000])
                base = (tag << 32) + (self.worker << 24) + self.version
                array = np.arange(n, dtype=np.int64) + base
                write = store.put_tensor if rng.random() < 0.5 else store.upsert_tensor
                self._code("put_tensor" if write == store.put_tensor else "upsert_tensor", write(tkey, array))
            else:
                got = store.get_tensor(tkey)
                if got is not None:
                    expected = np.arange(got.shape[0], dtype=np.int64) + (got[0] if got.size else 0)
                    if got.dtype != np.int64 or got.ndim != 1 or got.size == 0:
                        self.wrong.append(f"get_tensor {tkey}: dtype {got.dtype} shape {got.shape}")
                    elif int(got[0]) >> 32 != tag or not np.array_equal(got, expected):
                        self.wrong.append(f"get_tensor {tkey}: wrong values (first {int(got[0]):#x})")
                    else:
                        self.verified += 1
                    del got

    def run(self, seconds):
        deadline = time.monotonic() + seconds
        steps = 0
        while time.monotonic() < deadline:
            self.step()
            steps += 1
        return steps

    def report(self):
        return {
            "worker": self.worker,
            "counts": self.counts,
            "verified": self.verified,
            "wrong": self.wrong[:20],
            "wrong_count": len(self.wrong),
            "unexpected": sorted(set(self.unexpected))[:20],
            "unexpected_count": len(self.unexpected),
        }
