"""GPU buffers against the stand-in CUDA driver (``device/fake_cuda/fake_cuda.c``) and
the stand-in HIP runtime built over it (``fake_hip.c`` appended); every scenario runs
once per interface.

Each scenario runs in a child process (``_gpu_worker.py``) with ``MOONCAKE_CUDA_LIBRARY``
(or ``MOONCAKE_HIP_LIBRARY``) naming the stand-in, because a process loads its driver
once. The stand-in's device
memory is reserved ``PROT_NONE``, so a CPU access to it kills the process: a worker that
exits cleanly proves the CPU never touched device memory. The real client of dummy mode
loads the same stand-in and opens the workers' allocations from their IPC handles.
"""

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mooncake_testlib import start_real_client  # noqa: E402

from mooncake.store import MooncakeDistributedStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "_gpu_worker.py"
SOURCES = ROOT / "device" / "fake_cuda"
INVALID_PARAMS = -600

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class FakeDriver:
    """A stand-in driver library and the environment that makes processes load it."""

    def __init__(self, api, path):
        self.api = api
        self.path = path
        variable = "MOONCAKE_HIP_LIBRARY" if api == "hip" else "MOONCAKE_CUDA_LIBRARY"
        self.env = {variable: str(path)}
        self.worker_env = {**self.env, "FAKE_GPU_LIBRARY": str(path), "FAKE_GPU_API": api}


@pytest.fixture(scope="module", params=["cuda", "hip"])
def fake_driver(request, tmp_path_factory):
    api = request.param
    soname = "libamdhip64.so" if api == "hip" else "libcuda.so"
    directory = tmp_path_factory.mktemp(f"fake_{api}")
    source = directory / f"{soname}.c"
    parts = ["fake_cuda.c", "fake_hip.c"] if api == "hip" else ["fake_cuda.c"]
    source.write_text("\n".join((SOURCES / part).read_text() for part in parts))
    out = directory / soname
    subprocess.run(
        ["cc", "-O2", "-shared", "-fPIC", "-Wl,-Bsymbolic", f"-Wl,-soname,{soname}", "-o", str(out), str(source)],
        check=True,
    )
    return FakeDriver(api, out)


def run_worker(fake_driver, *args, timeout=120, extra_env=None):
    env = {**os.environ, **fake_driver.worker_env, **(extra_env or {})}
    done = subprocess.run(
        [sys.executable, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"worker {args} exited with {done.returncode}:\n{output}"
    assert "OK" in done.stdout.splitlines(), output
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def status_of(client):
    store = MooncakeDistributedStore()
    assert store.setup_dummy(1 << 20, 1 << 20, client.address) == 0
    try:
        return json.loads(store._status_json())
    finally:
        store.close()


def test_embedded_mode_moves_pages_between_device_memory_and_the_store(fake_driver):
    run_worker(fake_driver, "embedded")


def test_a_pure_embedded_client_moves_device_memory_to_another_node(fake_driver, start_master, master_client):
    master = start_master()
    owner = master_client(master, segment="256MB")
    run_worker(fake_driver, "remote", master.address)
    assert owner.alive(), owner.log()


@pytest.mark.parametrize("call", ["cuInit", "cuDeviceGetCount"])
def test_a_driver_that_does_not_initialize_refuses_device_buffers(fake_driver, call):
    run_worker(fake_driver, "no_init", extra_env={"FAIL_AT_LOAD": call})


def test_dummy_mode_opens_device_memory_once_and_closes_it(fake_driver, log_dir):
    client = start_real_client(log_dir, segment="256MB", env=fake_driver.env)
    try:
        reports = run_worker(fake_driver, "dummy", client.address)
        # 8 device storages of the vLLM sequence: one IPC handle each, while registered.
        assert reports[0]["handles_registered"] == 8, reports
        assert reports[1]["handles_unregistered"] == 0, reports
        assert status_of(client)["device_handles"] == 0
    finally:
        client.stop()
    assert client.proc.returncode in (0, -15), client.log()


def test_a_dummy_killed_with_open_device_handles_releases_them(fake_driver, log_dir):
    client = start_real_client(log_dir, segment="128MB", env=fake_driver.env)
    env = {**os.environ, **fake_driver.worker_env}
    holder = subprocess.Popen(
        [sys.executable, str(WORKER), "hold", client.address], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "registered"
        assert status_of(client)["device_handles"] == 3
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        deadline = time.monotonic() + 10
        while status_of(client)["device_handles"] != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status_of(client)["device_handles"] == 0
        assert client.proc.poll() is None, "mooncake_client survives"
    finally:
        holder.kill()
        holder.wait()
        client.stop()


def test_a_real_client_without_a_driver_refuses_device_buffers(fake_driver, log_dir):
    client = start_real_client(log_dir, segment="128MB")
    try:
        run_worker(fake_driver, "refused", client.address)
        assert "cannot reach" in client.log() or "GPU" in client.log()
    finally:
        client.stop()


@pytest.mark.parametrize("mode", ["dummy", "embedded"])
def test_memory_that_is_not_host_memory_is_refused_without_a_crash(mode, request):
    """Without a driver, an address the CPU cannot read (a device pointer, or a
    PROT_NONE reservation standing in for one) is refused by register_buffer, and the
    pointer calls reject it: nothing dereferences it."""
    store = request.getfixturevalue(f"{mode}_store")
    size = 1 << 20
    addr = libc.mmap(None, size, 0, 0x22, -1, 0)  # PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS
    assert addr not in (None, ctypes.c_void_p(-1).value)
    try:
        assert store.register_buffer(addr, size) == INVALID_PARAMS
        assert store.put_from("not-host-memory", addr, 4096) < 0
        assert store.get_into("not-host-memory", addr, 4096) < 0
        assert store.batch_put_from_multi_buffers(["not-host-memory"], [[addr]], [[4096]])[0] < 0
        assert store.batch_get_into_multi_buffers(["not-host-memory"], [[addr]], [[4096]])[0] < 0
        assert store.is_exist("not-host-memory") == 0
    finally:
        libc.munmap(ctypes.c_void_p(addr), size)

