"""Child processes of the GPU tests, run against a stand-in GPU driver: the CUDA one,
or the HIP runtime built over it (``FAKE_GPU_API`` = ``cuda`` or ``hip``).

The stand-in is loaded by path (``FAKE_GPU_LIBRARY``; the test also names it in
``MOONCAKE_CUDA_LIBRARY`` or ``MOONCAKE_HIP_LIBRARY``) both by this script, which
allocates "device" memory with its CUDA calls, and by the store, which finds the same
library. Calls made to fail are named as CUDA calls and mapped to HIP's names. Device memory of the stand-in is reserved ``PROT_NONE``: if anything in
this process touched it with the CPU, the process would die with SIGSEGV.

``python _gpu_worker.py embedded``
    vLLM's sequence in embedded mode: register per-layer device storages, check, store
    pages with ``batch_put_from_multi_buffers``, load them into other device storages
    with ``batch_get_into_multi_buffers``, byte-exact; single ``put_from``/``get_into``
    of 4 KiB and 1 MiB; nothing copied through staging; the segment gets pinned; a driver
    call that fails gives an error code, not a crash.
``python _gpu_worker.py dummy ADDRESS``
    the same against a separate ``mooncake_client`` (IPC handles); prints the
    real client's open handle count after registering and after unregistering.
``python _gpu_worker.py remote MASTER``
    the same as a pure embedded client (no segment) of a standalone master whose
    objects live on another node: device memory goes through pinned bounce buffers.
``python _gpu_worker.py hold ADDRESS``
    registers a device buffer in dummy mode, prints ``registered``, then waits to be
    killed (the test kills it with SIGKILL).
``python _gpu_worker.py no_init`` (with ``FAIL_AT_LOAD`` naming a driver call of loading)
    the driver cannot be initialized: GPU buffers are refused, nothing crashes.
``python _gpu_worker.py refused ADDRESS``
    registers a device buffer with a real client that has no CUDA driver: refused.
"""

import ctypes
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402

from _workers import check  # noqa: E402

from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # noqa: E402

INVALID_PARAMS = -600
API = os.environ.get("FAKE_GPU_API", "cuda")
cuda = ctypes.CDLL(os.environ["FAKE_GPU_LIBRARY"], mode=ctypes.RTLD_GLOBAL)
cuda.fake_cuda_pinned_bytes.restype = ctypes.c_ulonglong

# The HIP name of each CUDA call the tests make fail.
HIP_NAMES = {
    "cuInit": "hipInit",
    "cuDeviceGetCount": "hipGetDeviceCount",
    "cuMemcpyDtoHAsync_v2": "hipMemcpyDtoHAsync",
    "cuMemcpyHtoDAsync_v2": "hipMemcpyHtoDAsync",
    "cuStreamSynchronize": "hipStreamSynchronize",
    "cuStreamCreate": "hipStreamCreateWithFlags",
    "cuCtxPushCurrent_v2": "hipSetDevice",
    "cuPointerGetAttribute": "hipPointerGetAttribute",
}


def fail(calls):
    """Makes the driver calls named in ``calls`` (CUDA names, comma separated) fail."""
    if API == "hip":
        calls = ",".join(HIP_NAMES[c] for c in calls.split(",") if c)
    cuda.fake_cuda_fail(calls.encode())


def cu(name, *args):
    result = getattr(cuda, name)(*args)
    check(result == 0, f"{name} -> {result}")


def init():
    cu("cuInit", 0)
    ctx = ctypes.c_void_p()
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    cu("cuCtxSetCurrent", ctx)


def device_alloc(size):
    ptr = ctypes.c_ulonglong()
    cu("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
    return ptr.value


def to_device(ptr, data):
    cu("cuMemcpyHtoD_v2", ctypes.c_ulonglong(ptr), data, ctypes.c_size_t(len(data)))


def from_device(ptr, size):
    out = ctypes.create_string_buffer(size)
    cu("cuMemcpyDtoH_v2", out, ctypes.c_ulonglong(ptr), ctypes.c_size_t(size))
    return out.raw


def pattern(seed, size):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def status(store):
    return json.loads(store._status_json())


def vllm_sequence(store, tag):
    """Per-layer K and V storages on the device; pages of 64 KiB; keys as vLLM names them."""
    layers, page, pages = 4, 64 << 10, 8
    storage = page * pages
    src = [device_alloc(storage) for _ in range(layers)]
    dst = [device_alloc(storage) for _ in range(layers)]
    for i, ptr in enumerate(src + dst):
        check(store.register_buffer(ptr, storage) == 0, f"register_buffer of device storage {i}")
    for layer, ptr in enumerate(src):
        to_device(ptr, pattern(layer, storage))
    keys = [f"model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{tag}{n}" for n in range(pages)]
    check(store.batch_is_exist(keys) == [0] * pages, "keys absent before the save")
    addrs = [[src[layer] + n * page for layer in range(layers)] for n in range(pages)]
    sizes = [[page] * layers for _ in range(pages)]
    results = store.batch_put_from_multi_buffers(keys, addrs, sizes, ReplicateConfig())
    check(all(r >= 0 for r in results), f"batch_put_from_multi_buffers {results}")
    check(store.batch_is_exist(keys) == [1] * pages, "keys present after the save")
    rotated = keys[1:] + keys[:1]
    order = list(range(1, pages)) + [0]
    into = [[dst[layer] + n * page for layer in range(layers)] for n in order]
    results = store.batch_get_into_multi_buffers(rotated, into, sizes)
    check(all(r == page * layers for r in results), f"batch_get_into_multi_buffers {results}")
    for layer in range(layers):
        check(from_device(dst[layer], storage) == pattern(layer, storage), f"layer {layer} byte-exact")
    return src, dst, keys


def singles(store, tag):
    for size in (4096, 1 << 20):
        src, dst = device_alloc(size), device_alloc(size)
        check(store.register_buffer(src, size) == 0, "register src")
        check(store.register_buffer(dst, size) == 0, "register dst")
        data = pattern(size % 97, size)
        to_device(src, data)
        key = f"{tag}-single-{size}"
        check(store.put_from(key, src, size) == 0, f"put_from {size}")
        check(store.get_into(key, dst, size) == size, f"get_into {size}")
        check(from_device(dst, size) == data, f"get_into {size} byte-exact")
        check(store.get(key) == data, f"get of a value put from the device, {size}")
        check(store.unregister_buffer(src) == 0 and store.unregister_buffer(dst) == 0, "unregister")
        check(store.put_from(key + "x", src, size) < 0, "an unregistered device buffer is refused")


class DeviceTensor:
    """What ``get_tensor_into_cuda`` asks of a CUDA tensor, over stand-in device memory."""

    def __init__(self, ptr, numel, element_size):
        self.ptr, self.count, self.size = ptr, numel, element_size

    def data_ptr(self):
        return self.ptr

    def numel(self):
        return self.count

    def element_size(self):
        return self.size

    def is_contiguous(self):
        return True


def tensor_into_device(store, tag):
    array = np.arange(1000, dtype=np.float32) * 3
    keys = [f"{tag}-tensor-{i}" for i in range(2)]
    for key in keys:
        check(store.put_tensor(key, array) == 0, "put_tensor")
    ptrs = [device_alloc(array.nbytes) for _ in keys]
    for ptr in ptrs:
        check(store.register_buffer(ptr, array.nbytes) == 0, "register the destination")
    got = store.get_tensor_into_cuda(keys[0], DeviceTensor(ptrs[0], 1000, 4))
    check(got == array.nbytes, f"get_tensor_into_cuda -> {got}")
    check(from_device(ptrs[0], array.nbytes) == array.tobytes(), "tensor payload byte-exact")
    got = store.batch_get_tensor_into_cuda([keys[1] + "-missing", keys[1]], [DeviceTensor(ptrs[0], 1000, 4), DeviceTensor(ptrs[1], 1000, 4)])
    check(got == [-704, array.nbytes], f"batch_get_tensor_into_cuda -> {got}")
    check(from_device(ptrs[1], array.nbytes) == array.tobytes(), "batch payload byte-exact")
    small = store.get_tensor_into_cuda(keys[0], DeviceTensor(ptrs[0], 10, 4))
    check(small == INVALID_PARAMS, f"a destination smaller than the payload -> {small}")
    for ptr in ptrs:
        check(store.unregister_buffer(ptr) == 0, "unregister the destination")


def every_pointer_call(store, ptr, size, tag):
    """Every call that takes a pointer, given device memory: results, never a crash (the
    stand-in's device memory kills the process if the CPU touches it)."""
    key, meta = f"{tag}-sweep", f"{tag}-sweep-meta"
    check(store.put(key, b"x" * size) == 0, "put a value to read")
    check(store.put_tensor(meta, np.zeros(size // 4, dtype=np.float32)) == 0, "put a tensor object")
    cfg = ReplicateConfig()
    calls = {
        "put_from": lambda: store.put_from(f"{key}-p", ptr, size),
        "batch_put_from": lambda: store.batch_put_from([f"{key}-bp"], [ptr], [size]),
        "upsert_from": lambda: store.upsert_from(f"{key}-u", ptr, size),
        "batch_upsert_from": lambda: store.batch_upsert_from([f"{key}-bu"], [ptr], [size]),
        "put_from_with_metadata": lambda: store.put_from_with_metadata(f"{key}-m", ptr, ptr, size // 2, size // 2),
        "batch_put_from_multi_buffers": lambda: store.batch_put_from_multi_buffers([f"{key}-mb"], [[ptr, ptr]], [[size // 2, size // 2]], cfg),
        "batch_upsert_from_multi_buffers": lambda: store.batch_upsert_from_multi_buffers([f"{key}-umb"], [[ptr]], [[size]], cfg),
        "get_into": lambda: store.get_into(key, ptr, size),
        "batch_get_into": lambda: store.batch_get_into([key], [ptr], [size]),
        "batch_get_into_multi_buffers": lambda: store.batch_get_into_multi_buffers([key], [[ptr, ptr]], [[size // 2, size // 2]]),
        "get_into_ranges": lambda: store.get_into_ranges([ptr], [[key]], [[[0]]], [[[0]]], [[[size]]]),
        "put_session": lambda: (
            store.batch_put_session_start([f"{key}-s"], [size]),
            store.batch_put_from_multi_buffer_ranges([f"{key}-s"], [[ptr]], [[size]], [[0]]),
            store.batch_put_session_end([f"{key}-s"]),
        ),
        "get_session": lambda: (
            store.batch_get_session_start([key]),
            store.batch_get_into_multi_buffer_ranges([key], [[ptr]], [[size]], [[0]]),
            store.batch_get_session_end([key]),
        ),
        "get_tensor_into": lambda: store.get_tensor_into(meta, ptr, size),
        "batch_get_tensor_into": lambda: store.batch_get_tensor_into([meta], [ptr], [size]),
        "put_tensor_from": lambda: store.put_tensor_from(f"{key}-t", ptr, size),
        "batch_put_tensor_from": lambda: store.batch_put_tensor_from([f"{key}-bt"], [ptr], [size]),
        "upsert_tensor_from": lambda: store.upsert_tensor_from(f"{key}-ut", ptr, size),
        "get_tensor_into_cuda": lambda: store.get_tensor_into_cuda(meta, DeviceTensor(ptr, size // 4, 4)),
    }
    results = {}
    for name, call in calls.items():
        try:
            results[name] = call()
        except (TypeError, ValueError) as error:  # a refusal Python raises is fine; a crash is not
            results[name] = repr(error)
    return results


def negative(result):
    """True when a call's result says it failed (negative codes, None, nested)."""
    if result is None or isinstance(result, str):
        return True
    if isinstance(result, (list, tuple)):
        return all(negative(r) for r in result) if result else True
    return result < 0


def sweep(store, tag):
    size = 8192
    registered = device_alloc(size)
    check(store.register_buffer(registered, size) == 0, "register")
    results = every_pointer_call(store, registered, size, f"{tag}-reg")
    check(results["put_from"] == 0 and results["get_into"] == size, f"registered device memory works: {results}")
    check(store.unregister_buffer(registered) == 0, "unregister")
    unregistered = device_alloc(size)
    results = every_pointer_call(store, unregistered, size, f"{tag}-unreg")
    # put_session's start and end and get_session's start do not name memory.
    named = {k: v for k, v in results.items() if k not in ("put_session", "get_session")}
    bad = {k: v for k, v in named.items() if not negative(v)}
    check(not bad, f"calls with unregistered device memory must fail: {bad}")
    check(negative(results["put_session"][1]) and negative(results["get_session"][1]), f"session transfers fail: {results}")


def driver_errors(store, tag):
    size = 4096
    src = device_alloc(size)
    check(store.register_buffer(src, size) == 0, "register")
    to_device(src, pattern(3, size))
    for call in ("cuMemcpyDtoHAsync_v2", "cuStreamSynchronize", "cuCtxPushCurrent_v2"):
        fail(call)
        code = store.put_from(f"{tag}-fail-{call}", src, size)
        fail("")
        check(code < 0, f"put_from with {call} failing -> {code}")
        check(store.is_exist(f"{tag}-fail-{call}") == 0, f"nothing stored when {call} fails")
    check(store.put_from(f"{tag}-after", src, size) == 0, "works again")
    for call in ("cuMemcpyHtoDAsync_v2", "cuStreamCreate,cuMemcpyHtoDAsync_v2"):
        fail(call)
        code = store.get_into(f"{tag}-after", src, size)
        fail("")
        check(code < 0, f"get_into with {call} failing -> {code}")
    check(store.get_into(f"{tag}-after", src, size) == size, "reads work again")
    fail("cuPointerGetAttribute")
    other = device_alloc(size)
    code = store.register_buffer(other, size)
    fail("")
    check(code == INVALID_PARAMS, f"register_buffer when the driver cannot classify -> {code}")


def embedded():
    init()
    store = MooncakeDistributedStore()
    check(store.setup("localhost", "P2PHANDSHAKE", 64 << 20, 16 << 20, "tcp", "", "embedded") == 0, "setup")
    vllm_sequence(store, "emb")
    singles(store, "emb")
    tensor_into_device(store, "emb")
    sweep(store, "emb")
    driver_errors(store, "emb")
    report = status(store)
    check(report["staged_bytes"] == 0, f"nothing staged: {report['staged_bytes']}")
    deadline = time.monotonic() + 10
    while cuda.fake_cuda_pinned_bytes() < (64 << 20) and time.monotonic() < deadline:
        time.sleep(0.05)
    check(cuda.fake_cuda_pinned_bytes() >= 64 << 20, f"segment pinned: {cuda.fake_cuda_pinned_bytes()}")
    deadline = time.monotonic() + 10
    while status(store)["segment_pinned_bytes"] < (64 << 20) and time.monotonic() < deadline:
        time.sleep(0.05)
    check(status(store)["segment_pinned_bytes"] == 64 << 20, f"status reports the pinned segment: {status(store)}")
    store.close()
    print("OK", flush=True)


def remote(master_address):
    """vLLM's standalone-store deployment: this process is a pure embedded client (no
    segment of its own) and every object lives on another node, so device memory
    travels through the transfer engine by way of pinned bounce buffers."""
    init()
    store = MooncakeDistributedStore()
    check(store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master_address) == 0, "setup")
    for _ in range(2):  # the second round reuses the bounce buffers of the first
        vllm_sequence(store, "rem")
        check(store.remove_all(True) >= 0, "remove_all")
    singles(store, "rem")
    tensor_into_device(store, "rem")
    report = status(store)
    check(report["staged_bytes"] == 0, f"nothing staged: {report['staged_bytes']}")
    # Pinned beyond the (placeholder) segment: at least the 1 MiB bounce buffer of the
    # largest single transfer.
    pinned = cuda.fake_cuda_pinned_bytes() - report["segment_pinned_bytes"]
    check(pinned >= 1 << 20, f"the bounce buffers are pinned: {pinned} bytes")
    store.close()
    print("OK", flush=True)


def dummy(address):
    init()
    store = MooncakeDistributedStore()
    check(store.setup_dummy(16 << 20, 8 << 20, address) == 0, "setup_dummy")
    src, dst, _ = vllm_sequence(store, f"dum{os.getpid()}-")
    report = status(store)
    print(json.dumps({"handles_registered": report["device_handles"]}), flush=True)
    check(report["staged_bytes"] == 0, f"nothing staged: {report['staged_bytes']}")
    singles(store, f"dum{os.getpid()}")
    tensor_into_device(store, f"dum{os.getpid()}")
    sweep(store, f"dum{os.getpid()}")
    for ptr in src + dst:
        check(store.unregister_buffer(ptr) == 0, "unregister")
    report = status(store)
    print(json.dumps({"handles_unregistered": report["device_handles"]}), flush=True)
    store.close()
    print("OK", flush=True)


def hold(address):
    init()
    store = MooncakeDistributedStore()
    check(store.setup_dummy(16 << 20, 8 << 20, address) == 0, "setup_dummy")
    for _ in range(3):
        ptr = device_alloc(1 << 20)
        check(store.register_buffer(ptr, 1 << 20) == 0, "register")
    print("registered", flush=True)
    time.sleep(60)


def no_init():
    """The driver is present but cuInit (then cuDeviceGetCount) fails: GPU buffers are
    refused, host memory still works."""
    init()
    ptr = device_alloc(1 << 20)
    store = MooncakeDistributedStore()
    check(store.setup("localhost", "P2PHANDSHAKE", 16 << 20, 8 << 20, "tcp", "", "embedded") == 0, "setup")
    fail(os.environ["FAIL_AT_LOAD"])
    check(store.register_buffer(ptr, 1 << 20) == INVALID_PARAMS, "refused when the driver does not initialize")
    fail("")
    check(store.register_buffer(ptr, 1 << 20) == INVALID_PARAMS, "the driver is loaded once per process")
    check(store.put("host-still-works", b"x" * 100) == 0, "host memory still works")
    store.close()
    print("OK", flush=True)


def refused(address):
    init()
    store = MooncakeDistributedStore()
    check(store.setup_dummy(16 << 20, 8 << 20, address) == 0, "setup_dummy")
    ptr = device_alloc(1 << 20)
    check(store.register_buffer(ptr, 1 << 20) == INVALID_PARAMS, "refused without a driver in mooncake_client")
    check(store.put_from("refused-key", ptr, 4096) < 0, "a refused buffer is not used")
    store.close()
    print("OK", flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    commands = {"embedded": embedded, "dummy": dummy, "hold": hold, "remote": remote, "refused": refused, "no_init": no_init}
    commands[command](*args)
