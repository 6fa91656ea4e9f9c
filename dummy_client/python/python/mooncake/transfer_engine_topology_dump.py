"""Prints this machine's RDMA topology as upstream's ``transfer_engine_topology_dump`` does.

The output is one JSON object: for every CPU NUMA node (``cpu:<node>``) and every NVIDIA
GPU (``cuda:<index>``, in PCI order), a pair of lists: the RDMA devices nearest it (on
its NUMA node) and the others. The real client makes the same choice when
``--rdma_devices`` is empty. Read from sysfs only: nothing is loaded, and a machine
without RDMA devices prints ``{}``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

RDMA_DEVICE_DIR = Path("/sys/class/infiniband")
NODE_DIR = Path("/sys/devices/system/node")
PCI_DIR = Path("/sys/bus/pci/devices")
NVIDIA_VENDOR = "0x10de"
DISPLAY_CLASSES = ("0x0300", "0x0302")


def _numa_node(device: Path) -> int:
    try:
        return int((device / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return -1


def rdma_devices(root: Path = RDMA_DEVICE_DIR) -> dict[str, int]:
    """Each RDMA device's NUMA node (-1 when sysfs does not say)."""
    if not root.is_dir():
        return {}
    return {entry.name: _numa_node(entry / "device") for entry in sorted(root.iterdir())}


def _cpu_nodes(root: Path = NODE_DIR) -> list[int]:
    if not root.is_dir():
        return [0]
    nodes = sorted(int(e.name[4:]) for e in root.iterdir() if e.name.startswith("node") and e.name[4:].isdigit())
    return nodes or [0]


def _gpus(root: Path = PCI_DIR) -> list[int]:
    """The NUMA node of each NVIDIA GPU, in PCI address order."""
    if not root.is_dir():
        return []
    nodes = []
    for device in sorted(root.iterdir()):
        try:
            vendor = (device / "vendor").read_text().strip()
            klass = (device / "class").read_text().strip()
        except OSError:
            continue
        if vendor == NVIDIA_VENDOR and klass.startswith(DISPLAY_CLASSES):
            nodes.append(_numa_node(device))
    return nodes


def _split(devices: dict[str, int], node: int) -> list[list[str]]:
    near = [name for name, at in devices.items() if node >= 0 and at == node]
    if not near:
        return [list(devices), []]
    return [near, [name for name in devices if name not in near]]


def topology(devices: dict[str, int] | None = None) -> dict[str, list[list[str]]]:
    """The topology as upstream's JSON: location -> [nearest devices, other devices]."""
    devices = rdma_devices() if devices is None else devices
    if not devices:
        return {}
    result = {f"cpu:{node}": _split(devices, node) for node in _cpu_nodes()}
    for index, node in enumerate(_gpus()):
        result[f"cuda:{index}"] = _split(devices, node)
    return result


def main(argv: list[str] | None = None) -> int:
    """Prints the topology (one JSON object) and exits 0."""
    del argv
    sys.stdout.write(json.dumps(topology()) + os.linesep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
