#!/usr/bin/env python3
"""Offload throughput: how fast a node's SSD tier takes the objects its master queues.

Starts a ``mooncake_master --enable_offload`` and one ``mooncake_client
--enable_offload`` (offload directory in ``--dir``), puts ``--objects`` values of
``--size`` bytes through a dummy, and measures the time from the first put until the
master counts every object on disk. With several ``--build DIR`` (directories holding
``mooncake_master`` and ``mooncake_client``), the builds take turns in every repeat, so
their ratio comes from one run; medians are printed.

    python3 benches/offload_throughput.py --build target/release --build /path/to/other
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

import mooncake_testlib as lib  # noqa: E402
from mooncake.store import MooncakeDistributedStore  # noqa: E402


def on_disk(master):
    _, body = master.http_get("/metrics")
    for line in body.splitlines():
        if line.startswith("mooncake_master_objects_on_disk "):
            return int(float(line.split()[1]))
    return 0


def one_run(build, objects, size, workdir):
    os.environ["MOONCAKE_MASTER_BIN"] = str(Path(build) / "mooncake_master")
    os.environ["MOONCAKE_CLIENT_BIN"] = str(Path(build) / "mooncake_client")
    disk = Path(tempfile.mkdtemp(dir=workdir, prefix="disk-"))
    logs = Path(tempfile.mkdtemp(dir=workdir, prefix="logs-"))
    master = lib.start_standalone_master(logs, "--enable_offload=true")
    client = lib.start_real_client(
        logs,
        f"--master_server_address={master.address}",
        "--enable_offload=true",
        segment=f"{objects * size + (256 << 20)}",
        env={
            "MOONCAKE_OFFLOAD_FILE_STORAGE_PATH": str(disk),
            "MOONCAKE_OFFLOAD_HEARTBEAT_INTERVAL_SECONDS": "1",
        },
    )
    try:
        store = MooncakeDistributedStore()
        assert store.setup_dummy(64 << 20, 64 << 20, client.address) == 0
        value = os.urandom(size)
        started = time.monotonic()
        for i in range(objects):
            assert store.put(f"k{i}", value) == 0
        lib.wait_until(lambda: on_disk(master) >= objects, timeout=300, interval=0.01)
        elapsed = time.monotonic() - started
        assert on_disk(master) >= objects, "not everything reached the disk"
        store.close()
        return objects * size / elapsed
    finally:
        client.stop()
        master.stop()
        shutil.rmtree(disk, ignore_errors=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="append", required=True)
    parser.add_argument("--objects", type=int, default=512)
    parser.add_argument("--size", type=int, default=4 << 20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    rates = {build: [] for build in args.build}
    for _ in range(args.repeats):
        for build in args.build:
            rates[build].append(one_run(build, args.objects, args.size, args.dir))
    base = statistics.median(rates[args.build[0]])
    for build, values in rates.items():
        median = statistics.median(values)
        spread = ", ".join(f"{v / 1e9:.2f}" for v in values)
        print(f"{build}: {median / 1e9:.2f} GB/s median ({spread}); {median / base:.2f}x the first build")


if __name__ == "__main__":
    main()
