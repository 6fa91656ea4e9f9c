"""Fixtures for the mooncake.store tests.

* ``real_client``: one ``mooncake_client`` process for the whole session (512 MB
  segment), started from ``target/release/mooncake_client`` of this repository, on a port
  derived from the pid (another one when it is in use), killed at teardown;
* ``start_client``: starts extra real clients with other flags (short lease, isolated
  status), stopped at the end of the test;
* ``start_master``: starts standalone ``mooncake_master`` processes on free loopback ports
  (RPC and metrics/HTTP), stopped at the end of the test; ``master_client`` starts a real
  client joined to one of them;
* ``dummy_store`` / ``embedded_store``: connected ``MooncakeDistributedStore`` objects
  (dummy mode attached to ``real_client``; embedded mode running its own real client
  in this process), shared by the session;
* ``store``: both of them, one after the other (tests using it run in both modes);
* ``keys``: unique key names for a test, removed afterwards;
* ``pool``: pool allocations of the test's store, freed afterwards.
"""

import re
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_testlib import start_real_client, start_standalone_master  # noqa: E402

from mooncake.store import MooncakeDistributedStore  # noqa: E402

POOL = 64 << 20
STAGING = 16 << 20
EMBEDDED_SEGMENT = 256 << 20


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running stress test (still runs by default)")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("mooncake_logs")


@pytest.fixture(scope="session")
def real_client(log_dir):
    client = start_real_client(log_dir)
    try:
        yield client
    finally:
        client.stop()
    # A crash of the real client during the session is a failure of its own.
    assert client.proc.returncode in (0, -15), f"mooncake_client exited with {client.proc.returncode}:\n{client.log()}"


@pytest.fixture
def start_client(log_dir):
    """``start_client(*flags, segment="128MB", uid=None)``: a dedicated real client for one
    test (run as user ``uid`` when given)."""
    started = []

    def start(*flags, segment="128MB", port=None, uid=None):
        client = start_real_client(log_dir, *flags, segment=segment, port=port, uid=uid)
        started.append(client)
        return client

    try:
        yield start
    finally:
        for client in started:
            client.stop()


@pytest.fixture
def start_master(log_dir):
    """``start_master(*flags)``: a standalone ``mooncake_master`` for one test (loopback
    RPC and metrics ports), stopped at the end of the test even when it fails."""
    started = []

    def start(*flags):
        master = start_standalone_master(log_dir, *flags)
        started.append(master)
        return master

    try:
        yield start
    finally:
        for master in started:
            master.stop()


@pytest.fixture
def master_client(start_client):
    """``master_client(master, *flags, segment=...)``: a real client joined to a standalone
    master (its segment named ``127.0.0.1:<port>``), stopped at the end of the test."""

    def start(master, *flags, segment="128MB"):
        return start_client(
            f"--master_server_address={master.address}", "--host=127.0.0.1", *flags, segment=segment
        )

    return start


@pytest.fixture
def connect():
    """``connect(address, pool=..., staging=...)``: a dummy-mode store closed after the test."""
    stores = []

    def make(address, pool=POOL, staging=STAGING):
        store = MooncakeDistributedStore()
        assert store.setup_dummy(pool, staging, address) == 0, f"setup_dummy({address}) failed"
        stores.append(store)
        return store

    try:
        yield make
    finally:
        for store in stores:
            store.close()


@pytest.fixture
def embedded():
    """``embedded(segment=...)``: an embedded-mode store (its own in-process real client)."""
    stores = []

    def make(segment=64 << 20, staging=STAGING):
        store = MooncakeDistributedStore()
        assert store.setup("localhost", "P2PHANDSHAKE", segment, staging, "tcp", "", "embedded") == 0
        stores.append(store)
        return store

    try:
        yield make
    finally:
        for store in stores:
            store.close()


@pytest.fixture(scope="session")
def dummy_store(real_client):
    store = MooncakeDistributedStore()
    assert store.setup_dummy(POOL, STAGING, real_client.address) == 0
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(scope="session")
def embedded_store():
    store = MooncakeDistributedStore()
    assert store.setup("localhost", "P2PHANDSHAKE", EMBEDDED_SEGMENT, STAGING, "tcp", "", "embedded") == 0
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(params=["dummy", "embedded"])
def mode(request):
    return request.param


@pytest.fixture
def store(mode, request):
    return request.getfixturevalue(f"{mode}_store")


class Keys:
    """Unique key names for one test: ``keys("a")`` -> ``"<prefix>-a"``."""

    def __init__(self):
        self.prefix = f"t{uuid.uuid4().hex[:16]}"

    def __call__(self, name=""):
        return f"{self.prefix}-{name}"

    def many(self, count, name="k"):
        return [self(f"{name}{i}") for i in range(count)]

    @property
    def pattern(self):
        return "^" + re.escape(self.prefix)


@pytest.fixture
def keys(request):
    # Resolve the stores now, so that they are torn down after this fixture.
    owners = [
        request.getfixturevalue(name)
        for name in ("store", "dummy_store", "embedded_store")
        if name in request.fixturenames
    ]
    names = Keys()
    yield names
    for owner in {id(o): o for o in owners}.values():
        if owner.health_check() == 0:
            owner.remove_by_regex(names.pattern, True)


@pytest.fixture
def pool(store):
    """``pool(size)``: a block of the store's shared pool (freed after the test)."""
    blocks = []

    def alloc(size):
        ptr = store.alloc_from_mem_pool(size)
        assert ptr != 0, f"alloc_from_mem_pool({size}) failed"
        blocks.append(ptr)
        return ptr

    yield alloc
    for ptr in blocks:
        store.free_to_mem_pool(ptr)
