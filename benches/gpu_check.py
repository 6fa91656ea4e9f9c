"""GPU check of the store on a machine with an NVIDIA GPU and PyTorch.

Moves GPU memory through the store in embedded mode (``setup()``, the real client in
this process), in dummy mode (a ``mooncake_client`` process, CUDA IPC handles) and in
remote mode (vLLM's standalone-store deployment: an embedded client that contributes no
memory, whose objects live in another node's segment, reached over TCP through the
transfer engine and a bounce buffer; a ``mooncake_master`` and a ``mooncake_client``
joined to it), checks every byte, and times ``put_from`` / ``get_into`` of 4 KiB, 1 MiB and 64 MiB objects
next to plain CUDA copies (``cudaMemcpy`` device to host and back, pinned and pageable
host memory) of the same sizes in the same run. Also runs vLLM's call sequence
(per-layer device storages, ``batch_put_from_multi_buffers``,
``batch_get_into_multi_buffers``) and ``get_tensor_into_cuda`` once per mode.

    python benches/gpu_check.py --client target/release/mooncake_client \
        --master target/release/mooncake_master [--json out.json]

Exits non-zero when a byte check or a call fails. Timings are medians over repeats.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from mooncake.store import MooncakeDistributedStore, ReplicateConfig

SIZES = [4 << 10, 1 << 20, 64 << 20]
SEGMENT = "4GB"
SEGMENT_BYTES = 4 << 30
STAGING = 64 << 20


def fail(message):
    print(f"FAIL: {message}", flush=True)
    sys.exit(1)


def check(ok, message):
    if not ok:
        fail(message)


def reps_for(size):
    return 200 if size <= (1 << 20) else 20


def median_seconds(step, reps, warmup=3):
    """Median wall time of ``step()`` (which must leave the GPU idle when it returns)."""
    for i in range(warmup):
        step(-1 - i)
    times = []
    for i in range(reps):
        start = time.perf_counter()
        step(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(size, seconds):
    return size / seconds / 1e9


def memcpy_baseline(size):
    """cudaMemcpy device-to-host and host-to-device (through ``Tensor.copy_``, which
    synchronizes) of ``size`` bytes, with pinned and with pageable host memory."""
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)
    reps = reps_for(size)
    out = {}
    for name, host in (("pinned", pinned), ("pageable", pageable)):
        d2h = median_seconds(lambda _i: (host.copy_(device), torch.cuda.synchronize()), reps)
        h2d = median_seconds(lambda _i: (device.copy_(host), torch.cuda.synchronize()), reps)
        out[name] = {"d2h_gbps": gbps(size, d2h), "h2d_gbps": gbps(size, h2d)}
    return out


def random_device_bytes(size, seed):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda", generator=generator)


def singles(store, mode):
    """Byte check and timing of put_from / get_into per size; returns the figures."""
    results = {}
    for size in SIZES:
        src = random_device_bytes(size, size % 1000)
        dst = torch.zeros(size, dtype=torch.uint8, device="cuda")
        check(store.register_buffer(src.data_ptr(), size) == 0, f"{mode}: register_buffer src {size}")
        check(store.register_buffer(dst.data_ptr(), size) == 0, f"{mode}: register_buffer dst {size}")
        key = f"{mode}-check-{size}"
        check(store.put_from(key, src.data_ptr(), size) == 0, f"{mode}: put_from {size}")
        check(store.get_into(key, dst.data_ptr(), size) == size, f"{mode}: get_into {size}")
        torch.cuda.synchronize()
        check(torch.equal(src, dst), f"{mode}: get_into {size} is byte-exact")
        if size <= (1 << 20):
            check(store.get(key) == src.cpu().numpy().tobytes(), f"{mode}: get of a device put {size}")
        reps = reps_for(size)

        def put(i):
            rc = store.put_from(f"{mode}-put-{size}-{i}", src.data_ptr(), size)
            check(rc == 0, f"{mode}: timed put_from {size} -> {rc}")

        def get(_i):
            rc = store.get_into(key, dst.data_ptr(), size)
            check(rc == size, f"{mode}: timed get_into {size} -> {rc}")

        put_s = median_seconds(put, reps)
        get_s = median_seconds(get, reps)
        torch.cuda.synchronize()
        check(torch.equal(src, dst), f"{mode}: timed get_into {size} is byte-exact")
        for i in range(-3, reps):
            store.remove(f"{mode}-put-{size}-{i}")
        store.remove(key)
        check(store.unregister_buffer(src.data_ptr()) == 0, f"{mode}: unregister src")
        check(store.unregister_buffer(dst.data_ptr()) == 0, f"{mode}: unregister dst")
        results[size] = {
            "put_from_gbps": gbps(size, put_s),
            "get_into_gbps": gbps(size, get_s),
            "put_from_us": put_s * 1e6,
            "get_into_us": get_s * 1e6,
        }
        print(f"{mode} {size:>9} B: put_from {gbps(size, put_s):7.2f} GB/s ({put_s * 1e6:8.1f} us), "
              f"get_into {gbps(size, get_s):7.2f} GB/s ({get_s * 1e6:8.1f} us)", flush=True)
    return results


def vllm_sequence(store, mode):
    """vLLM's store connector: register per-layer KV storages, save pages with
    batch_put_from_multi_buffers, load them into other storages with
    batch_get_into_multi_buffers; byte-exact. Returns the batch bandwidths."""
    layers, page, pages = 8, 256 << 10, 32
    storage = page * pages
    src = [random_device_bytes(storage, 100 + layer) for layer in range(layers)]
    dst = [torch.zeros(storage, dtype=torch.uint8, device="cuda") for _ in range(layers)]
    for tensor in src + dst:
        check(store.register_buffer(tensor.data_ptr(), storage) == 0, f"{mode}: register layer storage")
    keys = [f"model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{mode}{n}" for n in range(pages)]
    addrs = [[src[layer].data_ptr() + n * page for layer in range(layers)] for n in range(pages)]
    into = [[dst[layer].data_ptr() + n * page for layer in range(layers)] for n in range(pages)]
    sizes = [[page] * layers for _ in range(pages)]
    start = time.perf_counter()
    results = store.batch_put_from_multi_buffers(keys, addrs, sizes, ReplicateConfig())
    put_s = time.perf_counter() - start
    check(all(r >= 0 for r in results), f"{mode}: batch_put_from_multi_buffers {results}")
    start = time.perf_counter()
    results = store.batch_get_into_multi_buffers(keys, into, sizes)
    get_s = time.perf_counter() - start
    check(all(r == page * layers for r in results), f"{mode}: batch_get_into_multi_buffers {results}")
    torch.cuda.synchronize()
    for layer in range(layers):
        check(torch.equal(src[layer], dst[layer]), f"{mode}: layer {layer} byte-exact")
    total = layers * storage
    for tensor in src + dst:
        store.unregister_buffer(tensor.data_ptr())
    for key in keys:
        store.remove(key)
    print(f"{mode} vLLM sequence ({pages} pages x {layers} layers x {page >> 10} KiB): "
          f"save {gbps(total, put_s):.2f} GB/s, load {gbps(total, get_s):.2f} GB/s", flush=True)
    return {"save_gbps": gbps(total, put_s), "load_gbps": gbps(total, get_s)}


def tensor_into_cuda(store, mode):
    source = torch.arange(1 << 20, dtype=torch.float32)
    check(store.put_tensor(f"{mode}-tensor", source) == 0, f"{mode}: put_tensor")
    target = torch.zeros(1 << 20, dtype=torch.float32, device="cuda")
    check(store.register_buffer(target.data_ptr(), target.numel() * 4) == 0, f"{mode}: register tensor")
    read = store.get_tensor_into_cuda(f"{mode}-tensor", target)
    check(read == source.numel() * 4, f"{mode}: get_tensor_into_cuda -> {read}")
    torch.cuda.synchronize()
    check(torch.equal(target.cpu(), source), f"{mode}: get_tensor_into_cuda is exact")
    store.unregister_buffer(target.data_ptr())
    store.remove(f"{mode}-tensor")


def warm_pinning(store, mode):
    """Registers a device buffer and waits while the segment gets pinned (in the
    background, after the first GPU registration) so that timings see bus speed."""
    probe = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    check(store.register_buffer(probe.data_ptr(), 4096) == 0, f"{mode}: first GPU registration")
    started = time.monotonic()
    while time.monotonic() - started < 60:
        pinned = json.loads(store._status_json()).get("segment_pinned_bytes", 0)
        if pinned >= SEGMENT_BYTES:
            print(f"{mode}: segment pinned after {time.monotonic() - started:.1f} s", flush=True)
            return probe
        time.sleep(0.1)
    print(f"{mode}: the segment is not pinned after 60 s (timings are from pageable memory)", flush=True)
    return probe


def run_mode(store, mode):
    probe = warm_pinning(store, mode) if mode != "remote" else None
    figures = {"singles": singles(store, mode), "vllm": vllm_sequence(store, mode)}
    # Again, with every buffer the first round created (and pinned) warm.
    figures["vllm_again"] = vllm_sequence(store, mode)
    tensor_into_cuda(store, mode)
    if probe is not None:
        store.unregister_buffer(probe.data_ptr())
    return figures


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_client(binary, log_path, *flags):
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [binary, f"--port={port}", f"--global_segment_size={SEGMENT}", "--log_level=info",
         *(flags or ["--embedded_master_port=0"])],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        store = MooncakeDistributedStore()
        if store.setup_dummy(STAGING, STAGING, address) == 0:
            return proc, store
        check(proc.poll() is None, f"mooncake_client exited: {open(log_path).read()[-2000:]}")
        time.sleep(0.2)
    fail("mooncake_client did not accept a dummy in 30 s")


def loopback_tcp_gbps(size=64 << 20, count=16):
    """Raw loopback TCP of the same machine: one sender, one receiver thread, ``count``
    messages of ``size`` bytes (the ceiling of remote mode's transfers)."""
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    payload = bytes(size)

    def receive():
        conn, _ = listener.accept()
        buffer = bytearray(size)
        view = memoryview(buffer)
        left = size * count
        while left:
            got = conn.recv_into(view[: min(size, left)])
            check(got > 0, "raw TCP receiver: connection closed")
            left -= got
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=receive)
    thread.start()
    sender = socket.create_connection(listener.getsockname())
    start = time.perf_counter()
    for _ in range(count):
        sender.sendall(payload)
    check(sender.recv(1) == b"k", "raw TCP: no acknowledgement")
    elapsed = time.perf_counter() - start
    thread.join()
    sender.close()
    listener.close()
    return size * count / elapsed / 1e9


def remote_mode(args, report):
    """A standalone master, a node holding the memory, and this process as a pure
    embedded client (``global_segment_size`` 0) whose puts land on that node."""
    master_port = free_port()
    master = subprocess.Popen(
        [args.master, f"--rpc_port={master_port}", "--rpc_address=127.0.0.1", "--metrics_port=0",
         "--enable_metric_reporting=false", "--log_level=warn"],
        stdout=open(args.log + ".master", "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{master_port}"
    node = None
    try:
        node, probe = start_client(args.client, args.log + ".node", "--host=127.0.0.1",
                                   f"--master_server_address={address}")
        deadline = time.monotonic() + 30
        while not json.loads(probe._status_json()).get("segments"):
            check(time.monotonic() < deadline, "remote: the node's segment is not mounted at the master")
            time.sleep(0.1)
        probe.close()
        store = MooncakeDistributedStore()
        deadline = time.monotonic() + 30
        while store.setup("127.0.0.1", "P2PHANDSHAKE", 0, STAGING, "tcp", "", address) != 0:
            check(time.monotonic() < deadline, "remote: setup of the pure embedded client")
            time.sleep(0.2)
        report["remote"] = run_mode(store, "remote")
        store.close()
    finally:
        for proc in (node, master):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", required=True, help="path of the mooncake_client binary")
    parser.add_argument("--master", help="path of the mooncake_master binary (remote mode; skipped without it)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--log", default=os.path.join(tempfile.gettempdir(), "gpu_check_client.log"))
    args = parser.parse_args()
    check(torch.cuda.is_available(), "PyTorch sees no GPU")
    torch.cuda.init()
    print(f"GPU: {torch.cuda.get_device_name(0)}", flush=True)
    report = {"gpu": torch.cuda.get_device_name(0), "memcpy": {}}
    for size in SIZES:
        report["memcpy"][size] = memcpy_baseline(size)
        m = report["memcpy"][size]
        print(f"cudaMemcpy {size:>9} B: pinned D2H {m['pinned']['d2h_gbps']:7.2f} H2D {m['pinned']['h2d_gbps']:7.2f} GB/s; "
              f"pageable D2H {m['pageable']['d2h_gbps']:7.2f} H2D {m['pageable']['h2d_gbps']:7.2f} GB/s", flush=True)

    store = MooncakeDistributedStore()
    rc = store.setup("localhost", "P2PHANDSHAKE", SEGMENT_BYTES, STAGING, "tcp", "", "embedded")
    check(rc == 0, f"embedded setup -> {rc}")
    report["embedded"] = run_mode(store, "embedded")
    store.close()

    proc, store = start_client(args.client, args.log)
    try:
        report["dummy"] = run_mode(store, "dummy")
        status = json.loads(store._status_json())
        report["dummy_status_device_handles"] = status.get("device_handles")
        store.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with open(args.log) as log:
        pinned = [line.strip() for line in log if "pinned" in line]
    report["dummy_pinning_log"] = pinned
    print("dummy real client:", pinned, flush=True)

    if args.master:
        report["loopback_tcp_gbps"] = [loopback_tcp_gbps() for _ in range(3)]
        print(f"raw loopback TCP, 64 MiB messages: {report['loopback_tcp_gbps']} GB/s", flush=True)
        remote_mode(args, report)
        tcp = statistics.median(report["loopback_tcp_gbps"])
        ours = report["remote"]["singles"][SIZES[-1]]
        print(f"remote 64 MiB against raw loopback TCP ({tcp:.2f} GB/s): put_from {ours['put_from_gbps'] / tcp:.2f}, "
              f"get_into {ours['get_into_gbps'] / tcp:.2f}", flush=True)

    print("\nratio to cudaMemcpy (pinned) of the same size, same run:")
    for mode in [m for m in ("embedded", "dummy", "remote") if m in report]:
        for size in SIZES:
            ours = report[mode]["singles"][size]
            base = report["memcpy"][size]["pinned"]
            print(f"  {mode:8} {size:>9} B: put_from/D2H {ours['put_from_gbps'] / base['d2h_gbps']:.2f}, "
                  f"get_into/H2D {ours['get_into_gbps'] / base['h2d_gbps']:.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=1)
    print("OK", flush=True)


if __name__ == "__main__":
    main()
