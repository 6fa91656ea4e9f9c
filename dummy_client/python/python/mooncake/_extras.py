"""Upstream's helper classes of ``mooncake.store`` that are not the store itself:
buffer pools and their leases, NUMA binding, the Engram embedding tables, and the
NVMe-oF registration stub. Names listed in ``__all__`` are re-exported by
``mooncake.store``.

Buffer pools (upstream's ``BufferPool``; ``RegisteredBufferPool`` is the same class):

* a lease is first served from the store's shared pool (``alloc_from_mem_pool``): memory
  that the store already knows, zero-copy in dummy mode, freed when the lease is
  released. This is upstream's "local buffer" part of the pool.
* when the shared pool has no room, the pool creates an *overflow region*: host memory
  (``MooncakeHostMemAllocator`` when the extension has it, so that dummy mode stays
  zero-copy; anonymous ``mmap`` otherwise), aligned to ``alignment``, rounded up to a size
  class and registered with ``store.register_buffer``. A released region is kept, still
  registered, for the next lease of its size class; ``prewarm`` creates such regions ahead
  of time, and a lease takes a kept region before asking the shared pool. ``close``
  unregisters and frees them.

Lifecycle: the pool owns its regions; a lease keeps the pool alive; a memoryview from
``lease.buffer`` keeps the lease alive, and ``release()`` refuses while one exists.
"""

import ctypes
import errno
import functools
import logging
import mmap
import operator
import os
import platform
import threading
import time
import weakref

from ._store import ERROR_CODES

try:  # added to the extension alongside this module; older builds lack it
    from ._store import MooncakeHostMemAllocator as _HostMemAllocator
except ImportError:  # pragma: no cover - depends on the built extension
    _HostMemAllocator = None

__all__ = [
    "BufferPool",
    "RegisteredBufferPool",
    "BufferLease",
    "BufferLeaseView",
    "RegisteredBufferLease",
    "RegisteredBufferLeaseView",
    "bind_to_numa_node",
    "EngramStore",
    "EngramStoreConfig",
    "MooncakeDistributedNoFRegister",
]

log = logging.getLogger("mooncake")

_SIZE_MAX = (1 << 64) - 1
_PAGE = mmap.PAGESIZE


def _size_t(value, name):
    """An ``int >= 0`` that fits a ``size_t``, else ``TypeError`` (as pybind11 does)."""
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be a non-negative int, got {type(value).__name__}") from None
    if number < 0 or number > _SIZE_MAX:
        raise TypeError(f"{name} must be a non-negative int that fits size_t, got {number}")
    return number


# ----------------------------------------------------------------------------------------
# memory for overflow regions
# ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.syscall.restype = ctypes.c_long
    return libc


_MAP_FAILED = ctypes.c_void_p(-1).value


class _HostMemory:
    """``size`` bytes whose start is aligned to ``alignment``; freed by ``free()``."""

    __slots__ = ("base", "ptr", "length", "_host")

    def __init__(self, size, alignment):
        # Over-allocate when the alignment is above a page, so an aligned start fits.
        extra = alignment if alignment > _PAGE else 0
        self.length = size + extra
        self._host = None
        base = 0
        if _HostMemAllocator is not None:
            host = _HostMemAllocator()
            base = host.alloc(self.length)
            if base:
                self._host = host
        if not base:
            libc = _libc()
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            addr = libc.mmap(None, self.length, prot, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
            if addr is None or addr == _MAP_FAILED:
                raise MemoryError(f"cannot map {self.length} bytes for a buffer pool region")
            base = addr
        self.base = base
        self.ptr = (base + alignment - 1) & ~(alignment - 1)

    def free(self):
        if not self.base:
            return
        base, self.base = self.base, 0
        if self._host is not None:
            self._host.free(base)
        else:
            _libc().munmap(base, self.length)


class _Block:
    """What a lease points at: a shared-pool block, or an overflow region."""

    __slots__ = ("ptr", "size", "size_class", "memory", "keep")

    def __init__(self, ptr, size, size_class=None, memory=None, keep=False):
        self.ptr = ptr
        self.size = size  # bytes counted against max_bytes
        self.size_class = size_class  # None: shared-pool block; else the region's class
        self.memory = memory  # _HostMemory of an overflow region
        self.keep = keep  # a region of a size class (not oversize): kept after release


# ----------------------------------------------------------------------------------------
# leases
# ----------------------------------------------------------------------------------------


class BufferLeaseView:
    """The object behind ``BufferLease.buffer``'s memoryview (``memoryview.obj``): the
    lease's bytes, kept alive (and the lease unreleasable) while a view exists."""

    __slots__ = ()

    @property
    def buffer(self):
        """A writable 1-D ``uint8`` memoryview of the leased bytes."""
        return memoryview(self).cast("B")


@functools.lru_cache(maxsize=256)
def _view_type(size):
    return type("BufferLeaseView", (ctypes.c_ubyte * size, BufferLeaseView), {"__module__": __name__})


class BufferLease:
    """A buffer taken from a ``BufferPool``: ``ptr``, ``size`` (the requested size),
    ``buffer`` (a writable memoryview). Return it with ``release()``, a ``with`` block,
    or by dropping the last reference."""

    def __init__(self, *args, **kwargs):
        raise TypeError("mooncake.store.BufferLease: No constructor defined! (use BufferPool.acquire)")

    @classmethod
    def _new(cls, pool, block, size):
        lease = object.__new__(cls)
        lease._pool = pool
        lease._block = block
        lease._size = size
        lease._closed = False
        lease._lock = threading.Lock()
        lease._views = weakref.WeakValueDictionary()  # id -> live view (arrays are unhashable)
        return lease

    @property
    def ptr(self):
        """Address of the leased bytes (registered with the pool's store)."""
        block = self._block
        if block is None:
            raise RuntimeError("buffer lease is closed")
        return block.ptr

    @property
    def size(self):
        """The size asked for in ``acquire``."""
        return self._size

    @property
    def buffer(self):
        """A writable 1-D ``uint8`` memoryview of ``size`` bytes at ``ptr``; while one
        exists, ``release()`` raises."""
        block = self._block
        if block is None:
            raise RuntimeError("buffer lease is closed")
        view = _view_type(self._size).from_address(block.ptr)
        view._lease = self
        self._views[id(view)] = view
        return memoryview(view).cast("B")

    def release(self):
        """Returns the buffer to the pool (a second call does nothing). ``RuntimeError``
        while a memoryview from ``buffer`` is alive."""
        self._release(check_views=True)

    def _release(self, check_views):
        with self._lock:
            if self._closed:
                return
            if check_views and len(self._views):
                raise RuntimeError("cannot release buffer while exported views exist")
            pool, block = self._pool, self._block
            if pool is not None and block is not None:
                pool._release_block(block)
            self._block = None
            self._pool = None
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.release()

    def __del__(self):
        try:
            self._release(check_views=False)
        except Exception:  # noqa: BLE001 - a destructor must not raise
            pass

    def __repr__(self):
        if self._block is None:
            return f"<BufferLease size={self._size} released>"
        return f"<BufferLease ptr={self._block.ptr:#x} size={self._size}>"


# ----------------------------------------------------------------------------------------
# the pool
# ----------------------------------------------------------------------------------------


class BufferPool:
    """Leases of registered host buffers for the pointer calls (``put_from``,
    ``get_into``, ``batch_*``): ``acquire(size)`` returns a ``BufferLease`` whose ``ptr``
    can be passed to the store directly.

    * ``max_bytes``: bytes leased and kept at once (``0``: no limit of its own);
    * ``min_size_class``, ``max_size_class``, ``alignment``: overflow regions are rounded
      up to ``min_size_class``, then to a power of two up to ``alignment``, then to a
      multiple of ``alignment``, start ``alignment``-aligned, and are kept for reuse
      when at most ``max_size_class`` bytes (default ``max_bytes``);
    * ``block_on_exhaustion``, ``default_timeout``: what ``acquire`` does when
      ``max_bytes`` or ``max_regions`` (leases at once) is reached: wait (at most
      ``default_timeout`` seconds), or raise ``RuntimeError``;
    * ``prewarm_size``, ``prewarm_count``: ``prewarm`` at construction.
    """

    def __init__(
        self,
        store,
        max_bytes=0,
        min_size_class=65536,
        max_size_class=None,
        alignment=8388608,
        block_on_exhaustion=True,
        default_timeout=None,
        max_regions=None,
        prewarm_size=None,
        prewarm_count=0,
    ):
        self._closed = True  # until validated: __del__ must not close a half-made pool
        if store is None:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        if not hasattr(store, "register_buffer") or not hasattr(store, "unregister_buffer"):
            raise RuntimeError(
                "BufferPool store parameter must be a MooncakeDistributedStore "
                "(an object with register_buffer and unregister_buffer)"
            )
        health_check = getattr(store, "health_check", None)
        if health_check is not None and health_check() == 1:
            raise RuntimeError("MooncakeDistributedStore is not initialized")
        max_bytes = _size_t(max_bytes, "max_bytes")
        min_size_class = _size_t(min_size_class, "min_size_class")
        alignment = _size_t(alignment, "alignment")
        if min_size_class == 0 or alignment == 0:
            raise RuntimeError("min_size_class and alignment must be positive")
        if alignment < ctypes.sizeof(ctypes.c_void_p) or alignment & (alignment - 1):
            raise RuntimeError("alignment must be a power of two and at least sizeof(void*)")
        self._store = store
        self._max_bytes = max_bytes or None
        if max_size_class is None:
            self._max_size_class = self._max_bytes
        else:
            self._max_size_class = _size_t(max_size_class, "max_size_class")
            if self._max_bytes is not None:
                self._max_size_class = min(self._max_size_class, self._max_bytes)
        self._min_size_class = min_size_class
        self._alignment = alignment
        self._block_on_exhaustion = bool(block_on_exhaustion)
        self._default_timeout = None if default_timeout is None else float(default_timeout)
        self._max_regions = None if max_regions is None else _size_t(max_regions, "max_regions")
        self._use_shared_pool = hasattr(store, "alloc_from_mem_pool") and hasattr(store, "free_to_mem_pool")

        # Re-entrant: a lease collected by the garbage collector releases itself from
        # whatever code of this thread is running, possibly code holding this lock.
        self._cond = threading.Condition(threading.RLock())
        self._free = {}  # size class -> [kept overflow regions]
        self._in_use = {}  # ptr -> _Block
        self._closing = False
        self._total_bytes = 0  # leased + kept
        self._reserved_bytes = 0  # being allocated
        self._reserved_regions = 0
        self._counters = dict.fromkeys(
            ("acquire", "reuse", "shared_pool", "allocate", "oversize_allocate", "wait", "release"), 0
        )
        self._closed = False
        if prewarm_size is not None and _size_t(prewarm_count, "prewarm_count") > 0:
            self.prewarm(prewarm_size, prewarm_count)

    # ----- public -----

    def acquire(self, size, block=None, timeout=None):
        """A lease of ``size`` bytes. When the pool is at ``max_bytes`` or
        ``max_regions``: waits for a release (``block``, default ``block_on_exhaustion``)
        for at most ``timeout`` seconds (default ``default_timeout``; ``None``: no limit),
        else raises ``RuntimeError``."""
        size = _size_t(size, "size")
        should_block = self._block_on_exhaustion if block is None else bool(block)
        timeout_s = self._default_timeout if timeout is None else float(timeout)
        if timeout_s is not None and timeout_s < 0:
            raise RuntimeError("timeout must be non-negative")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        wanted = max(size, 1)
        if self._max_bytes is not None and wanted > self._max_bytes:
            raise RuntimeError("requested buffer size exceeds pool capacity")
        self._size_class(wanted)  # raises on overflow
        with self._cond:
            while True:
                self._raise_if_not_open()
                block_ = self._try_acquire_locked(wanted)
                if block_ is not None:
                    self._in_use[block_.ptr] = block_
                    self._counters["acquire"] += 1
                    return BufferLease._new(self, block_, size)
                if not should_block:
                    raise RuntimeError("buffer pool is exhausted")
                self._counters["wait"] += 1
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise RuntimeError("timed out waiting for buffer")
                    self._cond.wait(remaining)

    def buffer(self, size, block=None, timeout=None):
        """``acquire`` under another name (for ``with pool.buffer(n) as lease:``)."""
        return self.acquire(size, block, timeout)

    def prewarm(self, size, count):
        """Creates ``count`` registered regions of ``size``'s size class, kept for the
        next leases of that class (upstream's pool, which serves everything from the
        store's local buffer, does nothing here)."""
        size = _size_t(size, "size")
        count = _size_t(count, "count")
        size_class, oversize = self._size_class(max(size, 1))
        if oversize:
            raise RuntimeError("cannot prewarm oversize buffers")
        for _ in range(count):
            with self._cond:
                self._raise_if_not_open()
                if not self._has_capacity_locked(size_class):
                    victims = self._evict_locked(size_class)
                    if not victims:
                        raise RuntimeError("buffer pool capacity exceeded")
                    self._cond.release()
                    try:
                        self._destroy(victims)
                    finally:
                        self._cond.acquire()
                    if not self._has_capacity_locked(size_class):
                        raise RuntimeError("buffer pool capacity exceeded")
                region = self._new_region_locked(size_class, keep=True)
                self._free.setdefault(size_class, []).append(region)
                self._cond.notify_all()

    def close(self):
        """Unregisters and frees the kept regions; later calls raise. ``RuntimeError``
        while leases are out. A second call does nothing."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            while self._reserved_regions:
                self._cond.wait()
            if self._in_use:
                self._closing = False
                self._cond.notify_all()
                raise RuntimeError("cannot close buffer pool with active leases")
            victims = [region for regions in self._free.values() for region in regions]
            self._free.clear()
            self._total_bytes -= sum(region.size for region in victims)
            self._closed = True
            self._closing = False
            self._cond.notify_all()
        self._destroy(victims)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a destructor must not raise
            pass

    def __repr__(self):
        state = "closed" if self._closed else f"{len(self._in_use)} leased"
        return f"<BufferPool max_bytes={self._max_bytes or 0} {state}>"

    def _stats(self):
        """Counters and sizes (ours, for tests and debugging)."""
        with self._cond:
            return {
                **self._counters,
                "in_use": len(self._in_use),
                "kept_regions": sum(len(r) for r in self._free.values()),
                "size_classes": {k: len(v) for k, v in self._free.items() if v},
                "total_bytes": self._total_bytes,
            }

    # ----- internals (called with self._cond held unless said otherwise) -----

    def _size_class(self, size):
        """``(bytes of an overflow region for size, whether it is oversize)``."""
        if self._max_size_class is not None and size > self._max_size_class:
            return self._align(size), True
        if size <= self._min_size_class:
            return self._min_size_class, False
        if size <= self._alignment:
            return 1 << (size - 1).bit_length(), False
        return self._align(size), False

    def _align(self, size):
        aligned = -(-size // self._alignment) * self._alignment
        if aligned > _SIZE_MAX:
            raise RuntimeError("buffer size overflow")
        return aligned

    def _raise_if_not_open(self):
        if self._closed:
            raise RuntimeError("buffer pool is closed")
        if self._closing:
            raise RuntimeError("buffer pool is closing")

    def _has_capacity_locked(self, size, new_lease=False):
        if new_lease and self._max_regions is not None:
            if len(self._in_use) + self._reserved_regions >= self._max_regions:
                return False
        if self._max_bytes is None:
            return True
        return self._total_bytes + self._reserved_bytes + size <= self._max_bytes

    def _evict_locked(self, size):
        """Takes kept regions out (largest first) until ``size`` more bytes fit; the
        caller destroys them without the lock. [] when evicting cannot help."""
        if self._max_bytes is None:
            return []
        kept = sorted((r for regions in self._free.values() for r in regions), key=lambda r: -r.size)
        room = self._max_bytes - self._total_bytes - self._reserved_bytes
        victims = []
        for region in kept:
            if room >= size:
                break
            victims.append(region)
            room += region.size
        if room < size:
            return []
        for region in victims:
            self._free[region.size_class].remove(region)
            self._total_bytes -= region.size
        return victims

    def _try_acquire_locked(self, size):
        if self._max_regions is not None and len(self._in_use) + self._reserved_regions >= self._max_regions:
            return None
        size_class, oversize = self._size_class(size)
        kept = None if oversize else self._free.get(size_class)
        if kept:
            self._counters["reuse"] += 1
            return kept.pop()
        if self._use_shared_pool and self._has_capacity_locked(size):
            block = self._shared_pool_block_locked(size)
            if block is not None:
                return block
        if not self._has_capacity_locked(size_class):
            victims = self._evict_locked(size_class)
            if not victims:
                return None
            self._cond.release()
            try:
                self._destroy(victims)
            finally:
                self._cond.acquire()
            self._raise_if_not_open()
            if not self._has_capacity_locked(size_class, new_lease=True):
                return None
        region = self._new_region_locked(size_class, keep=not oversize)
        self._counters["oversize_allocate" if oversize else "allocate"] += 1
        return region

    def _shared_pool_block_locked(self, size):
        self._reserved_bytes += size
        self._reserved_regions += 1
        self._cond.release()
        try:
            ptr = self._store.alloc_from_mem_pool(size)
        finally:
            self._cond.acquire()
            self._reserved_bytes -= size
            self._reserved_regions -= 1
            self._cond.notify_all()
        if not ptr:
            return None
        if self._closing or self._closed:
            self._store.free_to_mem_pool(ptr)
            raise RuntimeError("buffer pool is closing")
        self._total_bytes += size
        self._counters["shared_pool"] += 1
        return _Block(ptr, size)

    def _new_region_locked(self, size_class, keep):
        """Allocates and registers an overflow region (without the lock meanwhile) and
        counts it in ``_total_bytes``."""
        self._reserved_bytes += size_class
        self._reserved_regions += 1
        self._cond.release()
        memory = None
        try:
            memory = _HostMemory(size_class, self._alignment)
            rc = self._store.register_buffer(memory.ptr, size_class)
            if rc != 0:
                raise RuntimeError(f"overflow buffer registration failed (register_buffer returned {rc})")
        except BaseException:
            if memory is not None:
                memory.free()
            self._cond.acquire()
            self._reserved_bytes -= size_class
            self._reserved_regions -= 1
            self._cond.notify_all()
            raise
        self._cond.acquire()
        self._reserved_bytes -= size_class
        self._reserved_regions -= 1
        self._cond.notify_all()
        region = _Block(memory.ptr, size_class, size_class, memory, keep)
        if self._closing or self._closed:
            self._cond.release()
            try:
                self._destroy([region])
            finally:
                self._cond.acquire()
            raise RuntimeError("buffer pool is closing")
        self._total_bytes += size_class
        return region

    def _release_block(self, block):
        """A lease's ``release`` (called without the lock)."""
        destroy = None
        with self._cond:
            if self._in_use.get(block.ptr) is not block:
                raise RuntimeError("buffer lease is not active")
            del self._in_use[block.ptr]
            self._counters["release"] += 1
            if block.keep and not (self._closed or self._closing):
                self._free.setdefault(block.size_class, []).append(block)
            else:
                self._total_bytes -= block.size
                destroy = block
            self._cond.notify_all()
        if destroy is not None:
            self._destroy([destroy])

    def _destroy(self, blocks):
        """Frees shared-pool blocks; unregisters and frees overflow regions (no lock)."""
        for block in blocks:
            if block.memory is None:
                rc = self._store.free_to_mem_pool(block.ptr)
                if rc != 0:
                    log.debug("BufferPool: free_to_mem_pool(%#x) returned %s", block.ptr, rc)
                continue
            rc = self._store.unregister_buffer(block.ptr)
            if rc != 0:
                log.warning("BufferPool: unregister_buffer(%#x) returned %s; freeing the region anyway", block.ptr, rc)
            block.memory.free()


RegisteredBufferPool = BufferPool
RegisteredBufferLease = BufferLease
RegisteredBufferLeaseView = BufferLeaseView


# ----------------------------------------------------------------------------------------
# NUMA
# ----------------------------------------------------------------------------------------

_NODE_DIR = "/sys/devices/system/node"
_MPOL_PREFERRED = 1
_SYS_SET_MEMPOLICY = {"x86_64": 238, "amd64": 238, "aarch64": 237, "arm64": 237, "riscv64": 237}


def _parse_cpulist(text):
    cpus = set()
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            low, high = part.split("-", 1)
            cpus.update(range(int(low), int(high) + 1))
        else:
            cpus.add(int(part))
    return cpus


def _numa_nodes():
    try:
        names = os.listdir(_NODE_DIR)
    except OSError:
        return None
    nodes = [int(name[4:]) for name in names if name.startswith("node") and name[4:].isdigit()]
    return sorted(nodes) or None


def _set_preferred_node(node):
    """``set_mempolicy(MPOL_PREFERRED, {node})`` for the calling thread (``node < 0``:
    local allocation); True on success."""
    number = _SYS_SET_MEMPOLICY.get(platform.machine().lower())
    if number is None:
        log.warning("bind_to_numa_node: set_mempolicy is not known on %s; memory policy unchanged", platform.machine())
        return False
    libc = _libc()
    if node < 0:
        rc = libc.syscall(ctypes.c_long(number), ctypes.c_int(_MPOL_PREFERRED), None, ctypes.c_ulong(0))
    else:
        bits = 8 * ctypes.sizeof(ctypes.c_ulong)
        words = node // bits + 1
        mask = (ctypes.c_ulong * words)()
        mask[node // bits] = 1 << (node % bits)
        rc = libc.syscall(
            ctypes.c_long(number), ctypes.c_int(_MPOL_PREFERRED), mask, ctypes.c_ulong(words * bits + 1)
        )
    if rc != 0:
        err = ctypes.get_errno()
        log.warning("bind_to_numa_node: set_mempolicy(node %d) failed: %s", node, os.strerror(err or errno.EINVAL))
        return False
    return True


def bind_to_numa_node(node):
    """Bind the current thread and memory allocation preference to the specified NUMA node

    The calling thread runs on the node's CPUs from then on, and its new memory comes
    from that node when it has room (preferred, not strict). Problems (no NUMA, an
    unknown node) are logged as warnings, never raised, as upstream does."""
    node = operator.index(node)
    nodes = _numa_nodes()
    if nodes is None:
        log.warning("NUMA is not available on this system; binding skipped")
        return None
    max_node = nodes[-1]
    if node < 0 or node > max_node:
        log.warning("Invalid NUMA node: %d. Valid range: 0-%d", node, max_node)
    try:
        if node == -1:  # libnuma: -1 means every node
            cpus = set(range(os.cpu_count() or 1))
        else:
            with open(f"{_NODE_DIR}/node{node}/cpulist") as f:
                cpus = _parse_cpulist(f.read())
        if not cpus:
            raise OSError(errno.EINVAL, "the node has no CPUs")
        os.sched_setaffinity(0, cpus)
    except (OSError, ValueError) as error:
        log.warning("numa_run_on_node failed for node %d (%s)", node, error)
    _set_preferred_node(node)
    return None


# ----------------------------------------------------------------------------------------
# Engram embedding tables
# ----------------------------------------------------------------------------------------


class EngramStoreConfig:
    """Shape of one Engram layer: ``table_vocab_sizes`` (rows of each head's table) and
    ``embedding_dim`` (float32 values per row)."""

    def __init__(self):
        self._table_vocab_sizes = [1024]
        self._embedding_dim = 64

    @property
    def table_vocab_sizes(self):
        return list(self._table_vocab_sizes)

    @table_vocab_sizes.setter
    def table_vocab_sizes(self, value):
        self._table_vocab_sizes = [operator.index(v) for v in value]

    @property
    def embedding_dim(self):
        return self._embedding_dim

    @embedding_dim.setter
    def embedding_dim(self, value):
        self._embedding_dim = operator.index(value)

    def __repr__(self):
        return f"EngramStoreConfig(table_vocab_sizes={self._table_vocab_sizes}, embedding_dim={self._embedding_dim})"


def _numpy():
    import numpy  # a dependency of the Engram helpers only (extra "tensors")

    return numpy


class EngramStore:
    """One layer of Engram embedding tables in the store: head ``h``'s table
    (``table_vocab_sizes[h]`` rows of ``embedding_dim`` float32) is the object
    ``engram:l<layer_id>:h<h>``. ``populate`` writes the tables, ``lookup`` gathers
    rows, ``remove_from_store`` removes them."""

    def __init__(self, layer_id, config, store=None):
        if not isinstance(config, EngramStoreConfig):
            raise TypeError("config must be an EngramStoreConfig")
        if store is not None and not all(
            hasattr(store, name)
            for name in ("batch_is_exist", "batch_put_from", "get_into_ranges", "register_buffer", "remove")
        ):
            raise RuntimeError("EngramStore store parameter must be a MooncakeDistributedStore")
        self._layer_id = operator.index(layer_id)
        self._store = store
        self._vocab = list(config.table_vocab_sizes)
        self._dim = config.embedding_dim
        if not self._vocab:
            raise ValueError("EngramStoreConfig.table_vocab_sizes must not be empty")
        if self._dim <= 0:
            raise ValueError("EngramStoreConfig.embedding_dim must be positive")
        if any(v <= 0 for v in self._vocab):
            raise ValueError("EngramStoreConfig.table_vocab_sizes must contain only positive values")
        self._keys = [f"engram:l{self._layer_id}:h{h}" for h in range(len(self._vocab))]

    def get_table_vocab_sizes(self):
        return list(self._vocab)

    def get_store_keys(self):
        return list(self._keys)

    def get_num_heads(self):
        return len(self._vocab)

    def get_embedding_dim(self):
        return self._dim

    def remove_from_store(self, force=False):
        """Remove all Mooncake Store tables owned by this EngramStore layer. Returns the
        number of removed head tables; missing keys are ignored."""
        if self._store is None:
            rc = ERROR_CODES["INVALID_PARAMS"]
        else:
            removed, rc = 0, 0
            for key in self._keys:
                result = self._store.remove(key, bool(force))
                if result == 0:
                    removed += 1
                elif result != ERROR_CODES["OBJECT_NOT_FOUND"] and rc == 0:
                    rc = result
            rc = rc or removed
        if rc < 0:
            raise RuntimeError(f"remove_from_store failed, rc={rc}")
        return rc

    def populate(self, embedding_buffers):
        """Writes each head's table from a ``[vocab_size, embedding_dim]`` float32 array
        (other dtypes are converted). The keys must not exist yet; on failure nothing
        is left behind. ``RuntimeError`` on failure."""
        np = _numpy()
        buffers = list(embedding_buffers)
        if len(buffers) != len(self._vocab):
            raise RuntimeError("embedding_buffers size must match num_heads")
        arrays = []
        for buf, rows in zip(buffers, self._vocab):
            if not isinstance(buf, np.ndarray):
                raise RuntimeError("embedding_buffers must be NumPy arrays")
            arr = np.ascontiguousarray(buf, dtype=np.float32)
            if arr.ndim != 2:
                raise RuntimeError("each embedding buffer must be 2D [N_h, D]")
            if arr.shape != (rows, self._dim):
                raise RuntimeError("embedding buffer shape does not match get_table_vocab_sizes()/get_embedding_dim()")
            arrays.append(arr)
        if self._populate(arrays) != 0:
            raise RuntimeError("populate failed")

    def _populate(self, arrays):
        store = self._store
        if store is None:
            return -1
        exists = store.batch_is_exist(self._keys)
        if len(exists) != len(self._keys):
            log.error("Failed to preflight EngramStore populate key existence")
            return -1
        for key, found in zip(self._keys, exists):
            if found < 0:
                log.error("Failed to query EngramStore key '%s' before populate, rc=%d", key, found)
                return -1
            if found:
                log.error("EngramStore populate requires empty destination key '%s'. Remove the existing layer first.", key)
                return -1
        ptrs = [arr.ctypes.data for arr in arrays]
        sizes = [arr.nbytes for arr in arrays]
        registered = []
        try:
            for ptr, size in zip(ptrs, sizes):
                if store.register_buffer(ptr, size) != 0:
                    return -1
                registered.append(ptr)
            results = list(store.batch_put_from(self._keys, ptrs, sizes))
        finally:
            unregister_failed = any(store.unregister_buffer(ptr) != 0 for ptr in registered)
        if len(registered) != len(ptrs):
            return -1
        if len(results) == len(self._keys) and all(r == 0 for r in results) and not unregister_failed:
            return 0
        complete = len(results) == len(self._keys)
        for i, key in enumerate(self._keys):
            if complete and results[i] != 0:
                continue
            rc = store.remove(key, True)
            if rc not in (0, ERROR_CODES["OBJECT_NOT_FOUND"]):
                log.error("Failed to roll back partially populated EngramStore key '%s', rc=%d", key, rc)
        return -1

    def lookup(self, row_ids):
        """Lookup embeddings by precomputed row IDs. Returns [B, L, H, D].

        ``row_ids``: ``[B, L, H]`` integers (a NumPy array or nested lists), each in
        ``0..table_vocab_sizes[h]``. ``RuntimeError`` on a bad shape, an ID out of range
        or a failed read."""
        np = _numpy()
        heads = len(self._vocab)
        if isinstance(row_ids, np.ndarray):
            try:
                ids = np.ascontiguousarray(row_ids, dtype=np.int64)
            except (TypeError, ValueError):
                raise RuntimeError("row_ids array must be convertible to int64") from None
            if ids.ndim != 3:
                raise RuntimeError("row_ids array must have shape [B, L, H]")
            if ids.shape[2] != heads:
                raise RuntimeError("row_ids last dimension must match num_heads")
        else:
            nested = [[[operator.index(h) for h in token] for token in batch] for batch in row_ids]
            if not nested or not nested[0]:
                raise RuntimeError("row_ids must not be empty")
            length = len(nested[0])
            if any(len(batch) != length or any(len(token) != heads for token in batch) for batch in nested):
                raise RuntimeError("EngramStore lookup failed")
            ids = np.asarray(nested, dtype=np.int64).reshape(len(nested), length, heads)
        out = np.empty(ids.shape + (self._dim,), dtype=np.float32)
        if self._lookup_into(ids, out) != 0:
            out.fill(0)
            raise RuntimeError("EngramStore lookup failed")
        return out

    def _lookup_into(self, ids, out):
        store = self._store
        batch, length, heads = ids.shape
        if store is None or batch <= 0 or length <= 0:
            return -1
        np = _numpy()
        vocab = np.asarray(self._vocab, dtype=np.int64)
        if (ids < 0).any() or (ids >= vocab).any():
            return -1
        row_bytes = self._dim * 4
        flat = ids.reshape(-1, heads)
        slots = np.arange(flat.shape[0] * heads, dtype=np.int64).reshape(-1, heads) * row_bytes
        dst = [slots[:, h].tolist() for h in range(heads)]
        src = [(flat[:, h] * row_bytes).tolist() for h in range(heads)]
        sizes = [[row_bytes] * flat.shape[0] for _ in range(heads)]
        ptr, nbytes = out.ctypes.data, out.nbytes
        if store.register_buffer(ptr, nbytes) != 0:
            return -1
        try:
            results = store.get_into_ranges([ptr], [self._keys], [dst], [src], [sizes])
        finally:
            unregistered = store.unregister_buffer(ptr)
        if unregistered != 0 or len(results) != 1 or len(results[0]) != heads:
            return -1
        for head_results in results[0]:
            if len(head_results) != flat.shape[0] or any(r != row_bytes for r in head_results):
                return -1
        return 0

    def __repr__(self):
        return f"<EngramStore layer={self._layer_id} heads={len(self._vocab)} dim={self._dim}>"


# ----------------------------------------------------------------------------------------
# NVMe-oF registration
# ----------------------------------------------------------------------------------------

_nof_warned = threading.Event()


def _nof_unsupported(call):
    if not _nof_warned.is_set():
        _nof_warned.set()
        log.warning(
            "MooncakeDistributedNoFRegister.%s: NVMe-oF SSD registration is not supported here "
            "(returns NOT_SUPPORTED, %d); the SSD tier is a local directory: "
            "mooncake_client --offload_path, or setup(..., enable_ssd_offload=True, ssd_offload_path=...)",
            call,
            ERROR_CODES["NOT_SUPPORTED"],
        )
    return ERROR_CODES["NOT_SUPPORTED"]


class MooncakeDistributedNoFRegister:
    """Upstream's registration of NVMe-oF SSDs with the master. Not supported: both
    calls return ``ERROR_CODES["NOT_SUPPORTED"]`` (-1012) and log why, once."""

    def real_register(self, arg0, arg1, arg2, arg3, arg4, arg5, arg6):
        """``(nqn, nsid, traddr, trsvcid, base, size, master_server_address)`` -> code."""
        return _nof_unsupported("real_register")

    def real_unregister_by_endpoint(self, arg0, arg1, arg2, arg3, arg4):
        """``(nqn, nsid, traddr, trsvcid, master_server_address)`` -> code."""
        return _nof_unsupported("real_unregister_by_endpoint")
