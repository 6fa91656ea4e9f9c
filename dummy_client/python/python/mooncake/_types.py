"""Upstream's result types of ``mooncake.store``: replica descriptors, task responses
and their enums, with upstream's names, values and methods. Names listed in
``__all__`` are re-exported by ``mooncake.store``."""

import enum

__all__ = [
    "ReplicaStatus",
    "TaskStatus",
    "TaskType",
    "Descriptor",
    "MemoryDescriptor",
    "DiskDescriptor",
    "ReplicaDescriptor",
    "QueryTaskResponse",
    # Upstream's module-level enum constants (a name shared by two enums is the one
    # upstream exports: FAILED and PROCESSING are TaskStatus values).
    "UNDEFINED",
    "INITIALIZED",
    "COMPLETE",
    "REMOVED",
    "PENDING",
    "PROCESSING",
    "SUCCESS",
    "FAILED",
    "REPLICA_COPY",
    "REPLICA_MOVE",
]


class _UpstreamEnum(enum.IntEnum):
    """An int enum printed like upstream's (``TaskStatus.PENDING``)."""

    def __str__(self):
        return f"{type(self).__name__}.{self.name}"


class ReplicaStatus(_UpstreamEnum):
    """State of one replica of an object."""

    UNDEFINED = 0
    INITIALIZED = 1
    PROCESSING = 2
    COMPLETE = 3
    REMOVED = 4
    FAILED = 5


class TaskStatus(_UpstreamEnum):
    """State of a copy or move task."""

    PENDING = 0
    PROCESSING = 1
    FAILED = 2
    SUCCESS = 3


class TaskType(_UpstreamEnum):
    """Kind of a replica task."""

    REPLICA_COPY = 0
    REPLICA_MOVE = 1


UNDEFINED = ReplicaStatus.UNDEFINED
INITIALIZED = ReplicaStatus.INITIALIZED
COMPLETE = ReplicaStatus.COMPLETE
REMOVED = ReplicaStatus.REMOVED
PENDING = TaskStatus.PENDING
PROCESSING = TaskStatus.PROCESSING
SUCCESS = TaskStatus.SUCCESS
FAILED = TaskStatus.FAILED
REPLICA_COPY = TaskType.REPLICA_COPY
REPLICA_MOVE = TaskType.REPLICA_MOVE


class Descriptor:
    """Where a memory replica's bytes are: address in its segment, size, and the
    transfer endpoint of the node holding it."""

    def __init__(self, buffer_address=0, size=0, transport_endpoint=""):
        self.buffer_address = buffer_address
        self.size = size
        self.transport_endpoint = transport_endpoint

    def __repr__(self):
        return f"Descriptor(buffer_address={self.buffer_address:#x}, size={self.size}, transport_endpoint={self.transport_endpoint!r})"


class MemoryDescriptor:
    """A replica in a node's memory segment."""

    def __init__(self, buffer_descriptor, segment_name=""):
        self.buffer_descriptor = buffer_descriptor
        self.segment_name = segment_name

    def __repr__(self):
        return f"MemoryDescriptor(segment_name={self.segment_name!r}, buffer_descriptor={self.buffer_descriptor!r})"


class DiskDescriptor:
    """A replica in a node's SSD tier (``file_path`` names the owning node's record)."""

    def __init__(self, file_path="", object_size=0):
        self.file_path = file_path
        self.object_size = object_size

    def __repr__(self):
        return f"DiskDescriptor(file_path={self.file_path!r}, object_size={self.object_size})"


class ReplicaDescriptor:
    """One replica of an object, as returned by ``get_replica_desc`` and
    ``batch_get_replica_desc``."""

    def __init__(self, info):
        self._info = info
        self.status = ReplicaStatus.COMPLETE if info.get("status") == "complete" else ReplicaStatus.PROCESSING

    def is_memory_replica(self):
        """True for a replica in a node's memory."""
        return self._info.get("type") == "memory"

    def is_disk_replica(self):
        """True for a replica on a shared file system (this store has none)."""
        return False

    def is_local_disk_replica(self):
        """True for a replica in a node's SSD tier."""
        return self._info.get("type") == "local_disk"

    def get_memory_descriptor(self):
        """The memory location; ``RuntimeError`` for another kind of replica (as
        upstream)."""
        if not self.is_memory_replica():
            raise RuntimeError("not a memory replica")
        info = self._info
        return MemoryDescriptor(
            Descriptor(info.get("offset", 0), info.get("size", 0), info.get("endpoint", "")),
            info.get("segment_name", ""),
        )

    def get_disk_descriptor(self):
        """The SSD-tier location; ``RuntimeError`` for another kind of replica."""
        if not self.is_local_disk_replica():
            raise RuntimeError("not a disk replica")
        return DiskDescriptor(self._info.get("segment_name", ""), self._info.get("size", 0))

    def __repr__(self):
        kind = "memory" if self.is_memory_replica() else "local_disk"
        return f"ReplicaDescriptor({kind}, segment={self._info.get('segment_name', '')!r}, size={self._info.get('size', 0)}, status={self.status})"


_TASK_STATUS = {
    "pending": TaskStatus.PENDING,
    "running": TaskStatus.PROCESSING,
    "success": TaskStatus.SUCCESS,
    "failed": TaskStatus.FAILED,
}


class QueryTaskResponse:
    """State of a copy or move task (``query_task``)."""

    def __init__(self):
        self.id = (0, 0)
        self.type = TaskType.REPLICA_COPY
        self.status = TaskStatus.PENDING
        self.created_at_ms_epoch = 0
        self.last_updated_at_ms_epoch = 0
        self.assigned_client = ""
        self.message = ""

    @classmethod
    def _from_info(cls, info):
        response = cls()
        response.id = task_id_pair(info["id"])
        response.type = TaskType.REPLICA_MOVE if info.get("type") == "move" else TaskType.REPLICA_COPY
        response.status = _TASK_STATUS.get(info.get("status"), TaskStatus.PENDING)
        if response.status == TaskStatus.FAILED:
            response.message = f"error code {info.get('error_code', 0)}"
        return response

    def __repr__(self):
        return f"QueryTaskResponse(id={self.id}, type={self.type}, status={self.status}, message={self.message!r})"


def task_id_pair(value):
    """A 128-bit task id as upstream's ``(high, low)`` pair of 64-bit ints."""
    return (value >> 64, value & ((1 << 64) - 1))


def task_id_int(task_id):
    """A task id given as upstream's pair, a ``uuid.UUID`` or an int, as one int."""
    if isinstance(task_id, tuple) and len(task_id) == 2:
        high, low = task_id
        return (int(high) << 64) | int(low)
    if hasattr(task_id, "int"):
        return task_id.int
    return int(task_id)
