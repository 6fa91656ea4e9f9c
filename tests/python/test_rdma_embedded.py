"""Embedded stores (``setup()``, as SGLang's HiCache, vLLM's and LMCache's connectors run
them) moving their bytes with RDMA on the stand-in verbs provider: two stores of one
cluster in a child process, registered host buffers, multi-buffer batches, a value
written by one and read by the other. In a child process because a process loads its
verbs library once: the other tests of this run must see a machine without RDMA."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from mooncake_testlib import free_loopback_port, start_standalone_master

REPO_ROOT = Path(__file__).resolve().parents[2]
SOURCE = REPO_ROOT / "rdma" / "fake_verbs" / "fake_verbs.c"

WORKER = textwrap.dedent(
    """
    import ctypes, sys
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig

    master, port_a, port_b = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    MB = 1 << 20
    stores = []
    for port in (port_a, port_b):
        store = MooncakeDistributedStore()
        code = store.setup(f"127.0.0.1:{port}", "P2PHANDSHAKE", 64 * MB, 16 * MB, "rdma", "fake_rdma0", master)
        assert code == 0, f"setup over rdma: {code}"
        stores.append(store)
    a, b = stores
    # The first RDMA work request of this process fails (FAKE_VERBS_FAULT): proof that
    # the bytes go over verbs; the put reports it and the next one succeeds.
    on_b = ReplicateConfig()
    on_b.preferred_segment = f"127.0.0.1:{port_b}"
    size, count = 256 * 1024, 8
    source = (ctypes.c_ubyte * (size * count))()
    for i in range(size * count):
        source[i] = (i * 7 + i // size) % 251
    base = ctypes.addressof(source)
    assert a.register_buffer(base, size * count) == 0
    keys = [f"rdma-embedded-{i}" for i in range(count)]
    first = a.put_from(keys[0], base, size, on_b)
    assert first < 0, f"the injected failure did not reach the caller: {first}"
    codes = a.batch_put_from_multi_buffers(keys, [[base + i * size] for i in range(count)], [[size] for _ in range(count)], on_b)
    assert all(c == 0 for c in codes), codes
    dest = (ctypes.c_ubyte * (size * count))()
    dbase = ctypes.addressof(dest)
    assert a.register_buffer(dbase, size * count) == 0
    got = a.batch_get_into(keys, [dbase + i * size for i in range(count)], [size] * count)
    assert all(g == size for g in got), got
    assert bytes(dest) == bytes(source), "bytes read back over RDMA differ"
    print("RDMA-EMBEDDED-OK")
    """
)


def test_embedded_stores_move_registered_buffers_over_rdma(tmp_path):
    library = tmp_path / "libibverbs.so.1"
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", "-Wl,-Bsymbolic", "-Wl,-soname,libibverbs.so.1", "-o", str(library), str(SOURCE), "-lpthread"],
        check=True,
    )
    master = start_standalone_master(tmp_path)
    try:
        env = {
            **os.environ,
            "MOONCAKE_IBVERBS_LIBRARY": str(library),
            "FAKE_VERBS_FAULT": "remote_access@0",
        }
        ports = [free_loopback_port(), free_loopback_port()]
        run = subprocess.run(
            [sys.executable, "-c", WORKER, master.address, str(ports[0]), str(ports[1])],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0 and "RDMA-EMBEDDED-OK" in run.stdout, run.stdout + run.stderr
    finally:
        master.stop()
