"""What installing the Python package gives besides ``mooncake.store``: the console
scripts (``mooncake_master``, ``mooncake_client``, ``mooncake_http_metadata_server``,
``mc_store_rest_server``) and upstream's other store modules (``mooncake.async_store``,
``mooncake.buffer_pool``, ``mooncake.mooncake_config``, ``mooncake.mooncake_store_service``).

The command tests run the scripts of a fresh virtual environment into which the wheel
was installed with pip: ``MOONCAKE_WHEEL_VENV`` names it (``.ci/run`` creates it).
Without that variable they are skipped; the module tests run in any case.

Every process runs on loopback, on ports picked free, and is killed at teardown.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_testlib import die_with_parent_prefix, socket_accepts, wait_until  # noqa: E402

from mooncake.store import MooncakeDistributedStore  # noqa: E402

POOL = 32 << 20
STAGING = 16 << 20


# ----- helpers -----


def free_port():
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tcp_accepts(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def free_client_port():
    """A port whose real-client socket name (``@mooncake_client_<port>.sock``) nobody uses."""
    while True:
        port = free_port()
        if not socket_accepts(port):
            return port


class Started:
    """A command started by a test; ``stop()`` sends SIGTERM and returns the exit status,
    the ``processes`` fixture kills whatever is left."""

    def __init__(self, argv, log_path, env=None):
        self.argv = argv
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*die_with_parent_prefix(), *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )

    def log(self):
        return Path(self.log_path).read_text(errors="replace")

    def wait_port(self, port, timeout=30.0):
        ready = wait_until(lambda: self.proc.poll() is not None or tcp_accepts(port), timeout)
        assert ready and self.proc.poll() is None, f"{self.argv} did not start:\n{self.log()}"

    def stop(self, timeout=15.0):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                pytest.fail(f"{self.argv} ignored SIGTERM:\n{self.log()}")
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture
def processes(tmp_path):
    """``processes(argv, env=None)``: starts a command, killed at teardown."""
    started = []

    def start(argv, env=None):
        proc = Started([str(a) for a in argv], tmp_path / f"cmd{len(started)}.log", env)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            proc.kill()


@pytest.fixture(scope="module")
def wheel_bin():
    """The ``bin`` folder of the fresh virtual environment holding the installed wheel."""
    venv = os.environ.get("MOONCAKE_WHEEL_VENV")
    if not venv:
        pytest.skip(
            "MOONCAKE_WHEEL_VENV is not set: it names a fresh venv into which the mooncake-rs "
            "wheel was pip-installed (.ci/run sets it up)"
        )
    bin_dir = Path(venv) / "bin"
    for name in ("mooncake_master", "mooncake_client", "mooncake_http_metadata_server", "mc_store_rest_server"):
        assert (bin_dir / name).is_file(), f"{bin_dir / name} is missing: the wheel does not install {name}"
    return bin_dir


def http(method, url, body=None, timeout=10):
    """``(status, body_bytes)`` of one request (error statuses included)."""
    request = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def start_master(processes, bin_dir):
    port = free_port()
    master = processes(
        [
            bin_dir / "mooncake_master",
            f"--rpc_port={port}",
            "--rpc_address=127.0.0.1",
            "--metrics_port=0",
            "--enable_metric_reporting=false",
            "--log_level=warn",
        ]
    )
    master.wait_port(port)
    return master, f"127.0.0.1:{port}"


# ----- the commands of the installed wheel -----


@pytest.mark.parametrize("command", ["mooncake_master", "mooncake_client"])
def test_help_lists_the_flags(wheel_bin, command):
    done = subprocess.run([wheel_bin / command, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--log_level" in done.stdout, done.stdout
    assert ("--rpc_port" if command == "mooncake_master" else "--master_server_address") in done.stdout


@pytest.mark.parametrize("command", ["mooncake_master", "mooncake_client"])
def test_bad_flag_exits_with_2_and_one_line(wheel_bin, command):
    done = subprocess.run(
        [wheel_bin / command, "--no_such_flag_at_all=1"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.startswith(f"{command}: "), done.stderr
    assert "Traceback" not in done.stderr


def test_master_and_client_serve_a_dummy_store(wheel_bin, processes):
    master, master_address = start_master(processes, wheel_bin)
    client_port = free_client_port()
    client = processes(
        [
            wheel_bin / "mooncake_client",
            f"--port={client_port}",
            f"--master_server_address={master_address}",
            "--host=127.0.0.1",
            "--global_segment_size=64MB",
            "--log_level=warn",
        ]
    )
    assert wait_until(lambda: client.proc.poll() is not None or socket_accepts(client_port), 30)
    assert client.proc.poll() is None, client.log()

    store = MooncakeDistributedStore()
    assert store.setup_dummy(POOL, STAGING, f"127.0.0.1:{client_port}") == 0
    try:
        key = f"wheel-{uuid.uuid4().hex}"
        value = os.urandom(300_000)
        assert store.put(key, value) == 0
        assert store.is_exist(key) == 1
        assert store.get(key) == value
        assert store.remove(key, True) == 0  # forced: the get holds a read lease
    finally:
        store.close()

    # The pid the command got is the server's: SIGTERM stops it cleanly (status 0).
    assert client.stop() == 0, client.log()
    assert not socket_accepts(client_port)
    assert master.stop() == 0, master.log()
    assert not tcp_accepts(int(master_address.rsplit(":", 1)[1]))


def test_sigint_stops_the_master_cleanly(wheel_bin, processes):
    master, _ = start_master(processes, wheel_bin)
    master.proc.send_signal(signal.SIGINT)
    assert master.proc.wait(15) == 0, master.log()
    assert "Traceback" not in master.log() and "KeyboardInterrupt" not in master.log()


def test_http_metadata_server_round_trip(wheel_bin, processes):
    port = free_port()
    server = processes([wheel_bin / "mooncake_http_metadata_server", "--host=127.0.0.1", f"--port={port}"])
    server.wait_port(port)
    url = f"http://127.0.0.1:{port}/metadata?key=node%2F1"
    assert http("GET", url) == (404, b"metadata not found")
    assert http("PUT", url, b'{"segment": 1}') == (200, b"metadata updated")
    assert http("GET", url) == (200, b'{"segment": 1}')
    assert http("PUT", url, b'{"segment": 2}') == (200, b"metadata updated")
    assert http("GET", url) == (200, b'{"segment": 2}')
    assert http("DELETE", url) == (200, b"metadata deleted")
    assert http("DELETE", url) == (404, b"metadata not found")
    rpc = f"http://127.0.0.1:{port}/metadata?key=a_rpc_meta"
    assert http("PUT", rpc, b"1")[0] == 200
    assert http("PUT", rpc, b"2") == (400, b"Duplicate rpc_meta key not allowed")
    assert http("GET", f"http://127.0.0.1:{port}/metadata") == (400, b"metadata key is required")
    assert http("POST", url, b"x") == (405, b"Method not allowed")
    assert http("GET", f"http://127.0.0.1:{port}/elsewhere")[0] == 404
    assert server.stop() == 0, server.log()


def test_store_rest_server_serves_the_store(wheel_bin, processes, tmp_path):
    _, master_address = start_master(processes, wheel_bin)
    port = free_port()
    env = {
        **os.environ,
        "MOONCAKE_MASTER": master_address,
        "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "64MB",
        "MOONCAKE_LOCAL_BUFFER_SIZE": "16MB",
    }
    env.pop("MOONCAKE_CONFIG_PATH", None)
    service = processes(
        [wheel_bin / "mc_store_rest_server", "--host=127.0.0.1", f"--port={port}", "--max-wait-time=20"], env=env
    )
    service.wait_port(port, timeout=40)
    base = f"http://127.0.0.1:{port}/api"
    body = json.dumps({"key": "rest key", "value": "héllo"}).encode()
    assert http("PUT", f"{base}/put", body) == (200, b'{"status": "success"}')
    assert http("GET", f"{base}/get/rest%20key") == (200, "héllo".encode())
    assert json.loads(http("GET", f"{base}/exist/rest%20key")[1]) == {"exists": True}
    assert http("GET", f"{base}/get/missing")[0] == 404
    assert http("PUT", f"{base}/put", b'{"key": "k"}')[0] == 400
    # A key just read is under a read lease: removing it is refused, as upstream.
    assert http("DELETE", f"{base}/remove/rest%20key")[0] == 500
    assert http("PUT", f"{base}/put", json.dumps({"key": "unread", "value": "x"}).encode())[0] == 200
    assert http("DELETE", f"{base}/remove/unread")[0] == 200
    assert json.loads(http("GET", f"{base}/exist/unread")[1]) == {"exists": False}
    assert http("DELETE", f"{base}/remove_all")[0] == 200
    prefill = json.dumps({"mode": "prefill"}).encode()
    assert json.loads(http("POST", f"{base}/reconfigure", prefill)[1]) == {"status": "success", "mode": "prefill"}
    status, answer = http("POST", f"{base}/mount", json.dumps({"size": 1 << 20}).encode())
    assert status == 501 and "not supported" in json.loads(answer)["error"]
    assert http("GET", f"{base}/put")[0] == 405
    assert service.stop() == 0, service.log()


# ----- the modules, in this interpreter -----


def test_store_modules_import():
    import mooncake.async_store
    import mooncake.buffer_pool
    import mooncake.cli
    import mooncake.cli_client
    import mooncake.http_metadata_server
    import mooncake.mooncake_config
    import mooncake.mooncake_store_service

    assert callable(mooncake.cli.main) and callable(mooncake.cli_client.main)
    assert callable(mooncake.mooncake_store_service.sync_main)
    assert issubclass(mooncake.async_store.MooncakeDistributedStoreAsync, MooncakeDistributedStore)
    pools = mooncake.buffer_pool
    assert pools.RegisteredBufferPool is pools.BufferPool or pools.BufferPool is None
    assert set(pools.__all__) == {"BufferPool", "RegisteredBufferPool"}


def test_commands_run_in_this_interpreter():
    """``python -m mooncake.cli`` works without the console scripts (and the extension's
    ``_run_master`` prints the master's help)."""
    for module, flag in (("mooncake.cli", "--rpc_port"), ("mooncake.cli_client", "--master_server_address")):
        done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and flag in done.stdout, done.stderr


def test_async_store(real_client):
    from mooncake.async_store import MooncakeDistributedStoreAsync

    store = MooncakeDistributedStoreAsync()
    assert store.setup_dummy(POOL, STAGING, real_client.address) == 0
    key = f"async-{uuid.uuid4().hex}"

    async def scenario():
        assert await store.async_put(key, b"v" * 1000) == 0
        values = await asyncio.gather(*(store.async_get(key) for _ in range(4)))
        assert values == [b"v" * 1000] * 4
        assert await store.async_remove(key, True) == 0  # forced: the gets hold a read lease

    try:
        asyncio.run(scenario())
        assert store.async_put is store.async_put  # made once, kept on the instance
        with pytest.raises(AttributeError):
            store.async_no_such_method
        with pytest.raises(AttributeError):
            store.no_such_attribute
    finally:
        store.close()


def test_mooncake_config_from_env(monkeypatch):
    from mooncake.mooncake_config import DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LOCAL_BUFFER_SIZE, MooncakeConfig

    for name in list(os.environ):
        if name.startswith("MOONCAKE_"):
            monkeypatch.delenv(name)
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        MooncakeConfig.load_from_env()
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.1:50051")
    config = MooncakeConfig.load_from_env()
    assert config == MooncakeConfig(
        local_hostname="localhost",
        metadata_server="P2PHANDSHAKE",
        global_segment_size=DEFAULT_GLOBAL_SEGMENT_SIZE,
        local_buffer_size=DEFAULT_LOCAL_BUFFER_SIZE,
        protocol="tcp",
        device_name="",
        master_server_address="10.0.0.1:50051",
    )
    assert (config.tenant_id, config.enable_ssd_offload, config.client_http_port) == ("default", False, 9300)
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "1.5gb")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "RDMA")
    monkeypatch.setenv("MOONCAKE_OFFLOAD_ENABLED", "yes")
    monkeypatch.setenv("MOONCAKE_CLIENT_HTTP_PORT", "9400")
    config = MooncakeConfig.load_from_env()
    assert config.global_segment_size == 3 << 29
    assert config.protocol == "rdma"
    assert config.enable_ssd_offload is True
    assert config.client_http_port == 9400
    monkeypatch.setenv("MOONCAKE_OFFLOAD_ENABLED", "maybe")
    with pytest.raises(ValueError, match="boolean"):
        MooncakeConfig.load_from_env()


def test_mooncake_config_from_file(tmp_path, monkeypatch):
    from mooncake.mooncake_config import MooncakeConfig

    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "n1", "metadata_server": "P2PHANDSHAKE"}))
    with pytest.raises(ValueError, match="master_server_address"):
        MooncakeConfig.from_file(str(path))
    path.write_text(
        json.dumps(
            {
                "local_hostname": "n1",
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": "m:50051",
                "global_segment_size": "512MB",
                "local_buffer_size": 1024,
                "enable_ssd_offload": "false",
                "tenant_id": 7,
            }
        )
    )
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    config = MooncakeConfig.load_from_env()
    assert (config.global_segment_size, config.local_buffer_size) == (512 << 20, 1024)
    assert (config.enable_ssd_offload, config.tenant_id, config.device_name) == (False, "7", "")
    with pytest.raises(ValueError, match="non-empty"):
        MooncakeConfig("", "P2PHANDSHAKE", 1, 1, "tcp", "", "m:1")
    with pytest.raises(ValueError, match="non-negative"):
        MooncakeConfig("h", "P2PHANDSHAKE", -1, 1, "tcp", "", "m:1")


def test_store_service_routes(dummy_store, monkeypatch):
    """The REST routes against a connected store, without the command around them."""
    from mooncake.mooncake_store_service import MooncakeStoreService

    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:1")
    service = MooncakeStoreService(cli_config={"local_hostname": "127.0.0.1"})
    service.store = dummy_store
    port = service.start_http_service(0, "127.0.0.1")
    try:
        base = f"http://127.0.0.1:{port}/api"
        key = f"svc-{uuid.uuid4().hex}"
        assert http("PUT", f"{base}/put", json.dumps({"key": key, "value": "v1"}).encode())[0] == 200
        assert http("GET", f"{base}/get/{key}") == (200, b"v1")
        assert http("PUT", f"{base}/put", b"not json")[0] == 500
        assert http("POST", f"{base}/unmount_local_disk", b"not json")[0] == 400
        assert http("POST", f"{base}/unmount_local_disk", b'{"grace_period_seconds": -1}')[0] == 400
        assert http("POST", f"{base}/unmount_local_disk", b"{}")[0] == 501
        assert http("POST", f"{base}/reconfigure", b'{"mode": "other"}')[0] == 400
        assert http("POST", f"{base}/reconfigure", b'{"mode": "decode"}')[0] == 400
        assert http("POST", f"{base}/reconfigure", b'{"mode": "decode", "path": "p", "size": 1}')[0] == 501
        assert http("POST", f"{base}/mount_shm", b'{"name": "../x", "size": 1}')[0] == 400
        assert http("POST", f"{base}/mount", b'{"size": 0}')[0] == 400
        assert http("POST", f"{base}/unmount", b"{}")[0] == 400
        assert http("POST", f"{base}/unmount_shm", b'{"segment_ids": "a"}')[0] == 501
        assert http("GET", f"{base}/get/a/b")[0] == 404
        assert http("DELETE", f"{base}/remove/{key}")[0] == 500  # under the read lease of the get
        dummy_store.remove(key, True)
    finally:
        service.store = None  # the session's store stays open
        service.stop()


# ----- runtime dependencies, as upstream's wheel declares them -----

# Requires-Dist of upstream's wheel (mooncake-transfer-engine 0.3.13.post1), without its
# marker for Pythons older than 3.10.
UPSTREAM_REQUIRES = ("aiohttp", "requests", "msgpack")

CODEC_CHECK = """
import importlib.metadata as md, json
from mooncake.structured_object_store import _choose_leaf_codec
requires = [r.split(";")[0].strip() for r in md.requires("mooncake-rs") or [] if "extra ==" not in r]
imported = {}
for name in %r:
    try:
        __import__(name)
        imported[name] = True
    except ImportError:
        imported[name] = False
# Rows JSON cannot round-trip exactly (bytes): msgpack when it is there.
decision = _choose_leaf_codec([{"a": b"x"}, {"b": [1, 2]}])
print(json.dumps({"requires": requires, "imported": imported,
                  "codec": decision.codec, "accepted": decision.accepted}))
""" % (UPSTREAM_REQUIRES,)


@pytest.fixture(scope="module")
def wheel_file():
    wheel = os.environ.get("MOONCAKE_WHEEL")
    if not wheel:
        pytest.skip("MOONCAKE_WHEEL is not set: it names the mooncake-rs wheel (.ci/run builds it)")
    return wheel


def test_a_fresh_venv_gets_upstreams_runtime_dependencies_and_the_msgpack_codec(wheel_file, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        # numpy: the structured-object store needs it, as upstream's does (engines have it).
        [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", wheel_file, "numpy"],
        capture_output=True, text=True, timeout=600,
    )
    assert install.returncode == 0, install.stderr
    # Outside the repository, so that only the installed package is importable.
    checked = subprocess.run(
        [str(venv / "bin" / "python"), "-c", CODEC_CHECK],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert checked.returncode == 0, checked.stderr
    report = json.loads(checked.stdout.strip().splitlines()[-1])
    assert sorted(report["requires"]) == sorted(UPSTREAM_REQUIRES), report
    assert all(report["imported"].values()), report
    assert (report["codec"], report["accepted"]) == ("msgpack_ragged", True), report
