"""GPU check on a machine with an NVIDIA GPU and its driver (run by device_check.sh).

Allocates device memory with the CUDA driver (ctypes on libcuda.so.1), registers it with
the store, and moves 4 KiB, 1 MiB and 64 MiB objects between the device and the store
with put_from / get_into, byte-checked, in embedded mode (``setup()``) or dummy mode
(``setup_dummy`` against a running mooncake_client). Next to each size it times
cuMemcpyDtoH / cuMemcpyHtoD between the same device buffer and pinned host memory (what
``cudaMemcpy`` does), in the same run. Prints one JSON line per size.

    python device_check.py embedded
    python device_check.py dummy ADDRESS
"""

import ctypes
import json
import statistics
import sys
import time

from mooncake.store import MooncakeDistributedStore

SIZES = [4 << 10, 1 << 20, 64 << 20]
REPEATS = {4 << 10: 200, 1 << 20: 50, 64 << 20: 10}
cuda = ctypes.CDLL("libcuda.so.1")


def cu(name, *args):
    result = getattr(cuda, name)(*args)
    if result != 0:
        raise RuntimeError(f"{name} -> {result}")


def setup_cuda():
    cu("cuInit", 0)
    ctx = ctypes.c_void_p()
    cu("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), 0)
    cu("cuCtxSetCurrent", ctx)


def device_alloc(size):
    ptr = ctypes.c_ulonglong()
    cu("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
    return ptr.value


def pinned_alloc(size):
    ptr = ctypes.c_void_p()
    cu("cuMemAllocHost_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
    return ptr.value


def median_seconds(action, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def check_size(store, mode, size):
    src, dst = device_alloc(size), device_alloc(size)
    host = pinned_alloc(size)
    pattern = bytes((i * 7 + size) % 251 for i in range(4096)) * (size // 4096)
    ctypes.memmove(host, pattern, size)
    cu("cuMemcpyHtoD_v2", ctypes.c_ulonglong(src), ctypes.c_void_p(host), ctypes.c_size_t(size))
    assert store.register_buffer(src, size) == 0, "register src"
    assert store.register_buffer(dst, size) == 0, "register dst"
    time.sleep(2)  # the segment is pinned in the background after the first GPU buffer
    key = f"gpu-check-{mode}-{size}"
    counter = [0]

    def put():
        counter[0] += 1
        assert store.put_from(f"{key}-{counter[0]}", src, size) == 0

    put_s = median_seconds(put, REPEATS[size])
    assert store.get_into(f"{key}-1", dst, size) == size, "get_into"
    get_s = median_seconds(lambda: store.get_into(f"{key}-1", dst, size), REPEATS[size])
    ctypes.memset(host, 0, size)
    cu("cuMemcpyDtoH_v2", ctypes.c_void_p(host), ctypes.c_ulonglong(dst), ctypes.c_size_t(size))
    exact = ctypes.string_at(host, size) == pattern
    d2h_s = median_seconds(
        lambda: cu("cuMemcpyDtoH_v2", ctypes.c_void_p(host), ctypes.c_ulonglong(src), ctypes.c_size_t(size)),
        REPEATS[size],
    )
    h2d_s = median_seconds(
        lambda: cu("cuMemcpyHtoD_v2", ctypes.c_ulonglong(dst), ctypes.c_void_p(host), ctypes.c_size_t(size)),
        REPEATS[size],
    )
    for i in range(1, counter[0] + 1):
        store.remove(f"{key}-{i}")
    store.unregister_buffer(src)
    store.unregister_buffer(dst)
    gbps = lambda s: round(size / s / 1e9, 3)  # noqa: E731
    return {
        "mode": mode,
        "size": size,
        "byte_exact": exact,
        "put_from_GBps": gbps(put_s),
        "get_into_GBps": gbps(get_s),
        "memcpy_DtoH_GBps": gbps(d2h_s),
        "memcpy_HtoD_GBps": gbps(h2d_s),
        "put_vs_DtoH": round(d2h_s / put_s, 3),
        "get_vs_HtoD": round(h2d_s / get_s, 3),
    }


def main():
    mode = sys.argv[1]
    setup_cuda()
    store = MooncakeDistributedStore()
    if mode == "embedded":
        rc = store.setup("localhost", "P2PHANDSHAKE", 1 << 30, 64 << 20, "tcp", "", "embedded")
    else:
        rc = store.setup_dummy(64 << 20, 64 << 20, sys.argv[2])
    assert rc == 0, f"setup -> {rc}"
    ok = True
    for size in SIZES:
        result = check_size(store, mode, size)
        ok &= result["byte_exact"]
        print(json.dumps(result), flush=True)
    store.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
