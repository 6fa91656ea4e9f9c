"""The inference engines' call sequences on ``mooncake.store``, as plain functions.

Each sequence replays what one engine's Mooncake connector calls, in its order, with its
key formats and host-pool pointer maths, on a store that is already set up, and checks
the bytes that come back and the return values the engine itself checks. Sources (read
from the engines' public repositories; see ``/work/shared/reference/engines.md``):

* SGLang HiCache: ``python/sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py``
  (``MooncakeStore``: warmup, register_mem_pool_host, batch_exists, batch_set_v1,
  batch_get_v1, _put_batch_zero_copy_impl, _get_batch_zero_copy_impl) and the pointer
  maths of ``mem_cache/pool_host/mha.py`` / ``mla.py`` (``get_page_buffer_meta``).
* vLLM: ``vllm/distributed/kv_transfer/kv_connector/v1/mooncake/store/worker.py`` and
  ``data.py`` (``MooncakeStoreWorker.register_kv_caches``, the sending/receiving threads,
  ``lookup``, ``_get_replica_tiers_by_key``, the reset through ``remove_all(force=True)``).
* LMCache: ``lmcache/v1/storage_backend/connector/mooncakestore_connector.py``
  (``MooncakestoreConnector``).

The module only needs numpy and ``mooncake.store``, so that the same sequences run
against upstream's wheel (``mooncake-transfer-engine``) as well as ours. A sequence
raises ``AssertionError`` on the first difference and returns the keys it wrote.
"""

import asyncio
import ctypes
import hashlib
import os
import struct
import threading
import time
import uuid

import numpy as np

KIB = 1 << 10
MIB = 1 << 20


def _replicate_config():
    from mooncake.store import ReplicateConfig  # noqa: PLC0415

    return ReplicateConfig


def array_at(ptr, size, dtype=np.uint8, shape=None):
    """A numpy view of ``size`` bytes at ``ptr`` (how SGLang wraps the allocator's pointer:
    a ctypes byte array at the address, then a typed view)."""
    raw = (ctypes.c_byte * size).from_address(ptr)
    array = np.frombuffer(raw, dtype=np.uint8, count=size).view(dtype)
    return array.reshape(shape) if shape is not None else array


def address(array):
    return array.ctypes.data


def nbytes(array):
    return array.size * array.itemsize


def fill_random(array, rng):
    """Random bytes into ``array`` (any dtype), in place."""
    flat = array.reshape(-1).view(np.uint8)
    flat[:] = rng.integers(0, 256, size=flat.size, dtype=np.uint8)


def unique_tag():
    return uuid.uuid4().hex[:12]


# =====================================================================================
# SGLang HiCache
# =====================================================================================


class SGLangMHAHostPool:
    """``MHATokenToKVPoolHost`` with ``layout="page_first"``: one ``kv_buffer`` of shape
    ``(2, size, layer_num, head_num, head_dim)``; ``k_buffer``/``v_buffer`` are its halves.

    ``memory``: a flat uint8 array to build the pool in (e.g. memory from
    ``MooncakeHostMemAllocator().alloc``); by default an ordinary numpy allocation."""

    def __init__(self, num_pages, page_size=4, layer_num=2, head_num=2, head_dim=32, dtype=np.float16, memory=None):
        self.page_size = page_size
        self.size = num_pages * page_size
        self.layer_num = layer_num
        self.head_num = head_num
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        dims = (2, self.size, layer_num, head_num, head_dim)
        if memory is None:
            self.kv_buffer = np.zeros(dims, dtype=self.dtype)
        else:
            need = int(np.prod(dims)) * self.dtype.itemsize
            assert memory.size >= need, f"pool memory of {memory.size} bytes < {need}"
            self.kv_buffer = memory[:need].view(self.dtype).reshape(dims)

    @staticmethod
    def required_bytes(num_pages, page_size=4, layer_num=2, head_num=2, head_dim=32, dtype=np.float16):
        return 2 * num_pages * page_size * layer_num * head_num * head_dim * np.dtype(dtype).itemsize

    @property
    def k_buffer(self):
        return self.kv_buffer[0]

    @property
    def v_buffer(self):
        return self.kv_buffer[1]

    def get_hybrid_pool_buffer(self):
        # Newer SGLang registers the K and V halves separately.
        return [self.k_buffer, self.v_buffer]

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        itemsize = self.dtype.itemsize
        base = address(self.kv_buffer)
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * itemsize
        ptrs = []
        for index in range(0, len(indices), self.page_size):
            k_ptr = base + indices[index] * self.layer_num * self.head_num * self.head_dim * itemsize
            ptrs.append(k_ptr)
            ptrs.append(k_ptr + v_offset)
        element_size = self.layer_num * itemsize * self.page_size * self.head_num * self.head_dim
        return ptrs, [element_size] * len(ptrs)

    def page_bytes(self, first_token):
        """(K bytes, V bytes) of the page starting at token ``first_token``."""
        span = slice(first_token, first_token + self.page_size)
        return self.k_buffer[span].tobytes(), self.v_buffer[span].tobytes()


class SGLangMLAHostPool:
    """``MLATokenToKVPoolHost``: ``page_first`` is ``(size, layer_num, 1, kv_cache_dim)``
    (one pointer per page); ``layer_first`` is ``(layer_num, size, 1, kv_cache_dim)`` (one
    pointer per layer per page: a multi-buffer object)."""

    def __init__(
        self, num_pages, page_size=4, layer_num=3, kv_cache_dim=96, dtype=np.float16, layout="page_first", memory=None
    ):
        self.page_size = page_size
        self.size = num_pages * page_size
        self.layer_num = layer_num
        self.kv_cache_dim = kv_cache_dim
        self.dtype = np.dtype(dtype)
        self.layout = layout
        if layout == "page_first":
            dims = (self.size, layer_num, 1, kv_cache_dim)
        elif layout == "layer_first":
            dims = (layer_num, self.size, 1, kv_cache_dim)
        else:
            raise ValueError(layout)
        if memory is None:
            self.kv_buffer = np.zeros(dims, dtype=self.dtype)
        else:
            need = int(np.prod(dims)) * self.dtype.itemsize
            self.kv_buffer = memory[:need].view(self.dtype).reshape(dims)

    def get_hybrid_pool_buffer(self):
        return [self.kv_buffer]

    def get_page_buffer_meta(self, indices):
        assert len(indices) % self.page_size == 0
        itemsize = self.dtype.itemsize
        base = address(self.kv_buffer)
        ptrs = []
        if self.layout == "layer_first":
            for index in range(0, len(indices), self.page_size):
                for layer_id in range(self.layer_num):
                    ptrs.append(
                        base
                        + indices[index] * self.kv_cache_dim * itemsize
                        + layer_id * self.size * self.kv_cache_dim * itemsize
                    )
            element_size = itemsize * self.page_size * self.kv_cache_dim
        else:
            for index in range(0, len(indices), self.page_size):
                ptrs.append(base + indices[index] * self.layer_num * self.kv_cache_dim * itemsize)
            element_size = self.layer_num * itemsize * self.page_size * self.kv_cache_dim
        return ptrs, [element_size] * len(ptrs)

    def page_bytes(self, first_token):
        span = slice(first_token, first_token + self.page_size)
        if self.layout == "layer_first":
            return (self.kv_buffer[:, span].tobytes(),)
        return (self.kv_buffer[span].tobytes(),)


class SGLangMooncakeStore:
    """The calls of SGLang's ``MooncakeStore`` on ``mooncake.store``, in its order, with the
    raw results of the last put and get kept for the tests (SGLang turns them into bools)."""

    def __init__(self, store, pool, *, is_mla=False, tp_rank=0, config_prefix=None, group_semantics=False):
        self.store = store
        self.pool = pool
        self.is_mla = is_mla
        self.local_rank = tp_rank
        self.mha_suffix = f"{tp_rank}"
        self.mla_suffix = ""
        self.config_prefix = config_prefix
        ReplicateConfig = _replicate_config()
        self._replicate_config_cls = ReplicateConfig
        supports_group_ids = hasattr(ReplicateConfig, "group_ids")
        if not supports_group_ids:
            try:
                supports_group_ids = hasattr(ReplicateConfig(), "group_ids")
            except Exception:
                supports_group_ids = False
        self.supports_group_ids = supports_group_ids
        self.use_group_semantics = group_semantics and supports_group_ids
        self.registered = []
        self.put_calls = []  # (method, keys, results)
        self.get_calls = []

    # ----- lifecycle -----
    def warmup(self):
        warmup_key = "sglang_mooncake_store_warmup_key" + uuid.uuid4().hex
        warmup_value = bytes(4 * 1024)
        for _attempt in range(10):
            ret = self.store.put(warmup_key, warmup_value)
            if ret == 0:
                break
            time.sleep(1.0)
        else:
            raise AssertionError(f"warmup put failed 10 times (last {ret})")
        assert self.store.is_exist(warmup_key) == 1, "warmup: is_exist != 1"
        assert self.store.get(warmup_key) == warmup_value, "warmup: get != value"
        return warmup_key

    def register_mem_pool_host(self, halves=True):
        """``register_mem_pool_host``: each buffer of ``get_hybrid_pool_buffer()`` (the K
        and V halves of an MHA pool); ``halves=False`` registers the whole ``kv_buffer``
        once, as older SGLang did."""
        buffers = self.pool.get_hybrid_pool_buffer() if halves else [self.pool.kv_buffer]
        for buffer in buffers:
            size = nbytes(buffer)
            if size == 0:
                continue
            ret = self.store.register_buffer(address(buffer), size)
            assert ret == 0, f"register_buffer({address(buffer):#x}, {size}) returned {ret}"
            self.registered.append(address(buffer))

    def unregister_mem_pool_host(self):
        """Not an SGLang call (its pool lives as long as the process): the tests free the
        pool after a sequence, and upstream refuses to register a region that overlaps
        one still registered."""
        for ptr in self.registered:
            ret = self.store.unregister_buffer(ptr)
            assert ret == 0, f"unregister_buffer({ptr:#x}) returned {ret}"
        self.registered = []

    # ----- keys -----
    def _tag_keys(self, keys):
        if self.config_prefix is None:
            return keys
        return [f"{self.config_prefix}_{key}" for key in keys]

    def _make_group_id(self, logical_key):
        return f"sglang-hicache:{logical_key}"

    def _expand_group_ids(self, logical_keys, key_multiplier):
        group_ids = []
        for key in logical_keys:
            group_ids.extend([self._make_group_id(key)] * key_multiplier)
        return group_ids

    def component_keys(self, keys):
        keys = self._tag_keys(keys)
        if self.is_mla:
            return [f"{key}_{self.mla_suffix}_k" for key in keys]
        out = []
        for key in keys:
            out.append(f"{key}_{self.mha_suffix}_k")
            out.append(f"{key}_{self.mha_suffix}_v")
        return out

    @property
    def key_multiplier(self):
        return 1 if self.is_mla else 2

    # ----- zero-copy calls -----
    @staticmethod
    def _pack_multi_buffer_meta(key_strs, ptr_list, size_list):
        if len(ptr_list) == len(key_strs):
            return ptr_list, size_list
        assert len(ptr_list) % len(key_strs) == 0
        nbuf = len(ptr_list) // len(key_strs)
        return (
            [ptr_list[i : i + nbuf] for i in range(0, len(ptr_list), nbuf)],
            [size_list[i : i + nbuf] for i in range(0, len(size_list), nbuf)],
        )

    def _batch_preprocess(self, keys, host_indices):
        assert len(keys) == len(host_indices) // self.pool.page_size
        keys = self._tag_keys(keys)
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        if self.is_mla:
            key_list = [f"{key}_{self.mla_suffix}_k" for key in keys]
            ptrs, sizes = self._pack_multi_buffer_meta(key_list, ptrs, sizes)
        else:
            key_list = []
            for key in keys:
                key_list.append(f"{key}_{self.mha_suffix}_k")
                key_list.append(f"{key}_{self.mha_suffix}_v")
        assert len(key_list) == len(ptrs)
        return key_list, ptrs, sizes

    def _put_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes, group_ids=None):
        config = None
        if self.use_group_semantics and group_ids is not None:
            assert len(group_ids) == len(key_strs)
            config = self._replicate_config_cls()
            config.group_ids = group_ids
        if buffer_ptrs and isinstance(buffer_ptrs[0], list):
            config = config or self._replicate_config_cls()
            method = "batch_put_from_multi_buffers"
            results = self.store.batch_put_from_multi_buffers(key_strs, buffer_ptrs, buffer_sizes, config)
        elif config is not None:
            method = "batch_put_from"
            results = self.store.batch_put_from(key_strs, buffer_ptrs, buffer_sizes, config)
        else:
            method = "batch_put_from"
            results = self.store.batch_put_from(key_strs, buffer_ptrs, buffer_sizes)
        results = list(results)
        self.put_calls.append((method, list(key_strs), results))
        return results

    def _get_batch_zero_copy_impl(self, key_strs, buffer_ptrs, buffer_sizes):
        if buffer_ptrs and isinstance(buffer_ptrs[0], list):
            method = "batch_get_into_multi_buffers"
            results = self.store.batch_get_into_multi_buffers(key_strs, buffer_ptrs, buffer_sizes)
        else:
            method = "batch_get_into"
            results = self.store.batch_get_into(key_strs, buffer_ptrs, buffer_sizes)
        results = list(results)
        self.get_calls.append((method, list(key_strs), results))
        return results

    def _batch_postprocess(self, results, is_set_operate):
        m = self.key_multiplier
        groups = [results[i : i + m] for i in range(0, len(results), m)]
        if is_set_operate:
            return [all(r == 0 for r in g) for g in groups]
        return [all(r > 0 for r in g) for g in groups]

    # ----- the HiCacheStorage calls -----
    def batch_exists(self, keys):
        query_keys = self.component_keys(keys)
        exist_result = self.store.batch_is_exist(query_keys)
        assert len(exist_result) == len(query_keys)
        for i in range(len(query_keys)):
            if exist_result[i] != 1:
                return i // self.key_multiplier
        return len(query_keys) // self.key_multiplier

    def batch_set_v1(self, keys, host_indices):
        tagged = self._tag_keys(keys)
        key_strs, ptrs, sizes = self._batch_preprocess(keys, host_indices)
        key_multiplier = len(key_strs) // len(keys)
        group_ids = self._expand_group_ids(tagged, key_multiplier) if self.use_group_semantics else None
        exist_result = self.store.batch_is_exist(key_strs)
        set_keys, set_ptrs, set_sizes, set_indices = [], [], [], []
        set_results = [-1] * len(key_strs)
        for i in range(len(key_strs)):
            if exist_result[i] != 1:
                set_keys.append(key_strs[i])
                set_ptrs.append(ptrs[i])
                set_sizes.append(sizes[i])
                set_indices.append(i)
            else:
                set_results[i] = 0
        if set_keys:
            put_results = self._put_batch_zero_copy_impl(
                set_keys,
                set_ptrs,
                set_sizes,
                None if group_ids is None else [group_ids[i] for i in set_indices],
            )
            for i, index in enumerate(set_indices):
                set_results[index] = put_results[i]
        return self._batch_postprocess(set_results, is_set_operate=True)

    def batch_get_v1(self, keys, host_indices):
        key_strs, ptrs, sizes = self._batch_preprocess(keys, host_indices)
        results = self._get_batch_zero_copy_impl(key_strs, ptrs, sizes)
        return self._batch_postprocess(results, is_set_operate=False)


def sglang_setup(
    store,
    master_address,
    *,
    local_hostname="localhost",
    global_segment_size=64 * MIB,
    tp_size=1,
    pp_size=1,
    protocol="tcp",
    device_name="",
    metadata_server="P2PHANDSHAKE",
    transfer_engine=None,
    **setup_kwargs,
):
    """SGLang's embedded ``setup``: the per-rank share of the global segment, 16 MiB local
    buffer, the shared transfer engine or None, and kwargs (``enable_client_http_server``,
    ``client_http_port``, ``enable_ssd_offload``, ``ssd_offload_path``, ``tenant_id``); on
    a ``TypeError`` naming a kwarg SGLang retries without it (except ``tenant_id``).
    Returns (return code, the kwargs dropped)."""
    dropped = []
    while True:
        try:
            ret = store.setup(
                local_hostname,
                metadata_server,
                global_segment_size // (tp_size * pp_size),
                16 * MIB,
                protocol,
                device_name,
                master_address,
                transfer_engine,
                **setup_kwargs,
            )
            return ret, dropped
        except TypeError as error:
            unsupported = [key for key in list(setup_kwargs) if key in str(error)]
            if not unsupported:
                raise
            if "tenant_id" in unsupported:
                raise RuntimeError("setup() does not take tenant_id") from error
            for key in unsupported:
                setup_kwargs.pop(key, None)
                dropped.append(key)


def page_hashes(count):
    """SGLang page hashes: chained sha256 hex digests."""
    out = []
    prev = uuid.uuid4().bytes
    for i in range(count):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev.hex())
    return out


def token_indices(pool, pages):
    """Host token indices of the given page numbers (SGLang passes token indices)."""
    out = []
    for page in pages:
        out.extend(range(page * pool.page_size, (page + 1) * pool.page_size))
    return out


def sglang_sequence(
    store,
    pool,
    *,
    is_mla=False,
    group_semantics=False,
    config_prefix=None,
    tp_rank=0,
    register=True,
    halves=True,
    seed=0,
):
    """SGLang HiCache on one host pool: warmup, register the pool's buffers, back up half
    the pages, back up all of them (only the missing keys are put), query the prefix,
    prefetch into other host slots, compare bytes. The pool needs ``2 * n`` pages; pages
    ``0..n`` are the source, pages ``n..2n`` the destination. Returns the keys written."""
    rng = np.random.default_rng(seed)
    engine = SGLangMooncakeStore(
        store, pool, is_mla=is_mla, tp_rank=tp_rank, config_prefix=config_prefix, group_semantics=group_semantics
    )
    if group_semantics:
        assert engine.supports_group_ids, "ReplicateConfig has no group_ids field"
    written = [engine.warmup()]
    if register:
        engine.register_mem_pool_host(halves=halves)

    total_pages = pool.size // pool.page_size
    n = total_pages // 2
    assert n >= 4
    fill_random(pool.kv_buffer, rng)
    hashes = page_hashes(n)
    src = list(range(n))
    dst = list(range(n, 2 * n))
    written += engine.component_keys(hashes)

    # Backup of the first half: every key is new, every put result 0.
    half = n // 2
    ok = engine.batch_set_v1(hashes[:half], token_indices(pool, src[:half]))
    method, put_keys, results = engine.put_calls[-1]
    assert results == [0] * len(put_keys), f"{method} results {results}"
    assert ok == [True] * half
    if is_mla and pool.layout == "layer_first":
        assert method == "batch_put_from_multi_buffers"
    assert engine.batch_exists(hashes) == half

    # Backup of all pages: batch_is_exist first, only the missing keys are put.
    ok = engine.batch_set_v1(hashes, token_indices(pool, src))
    method, put_keys, results = engine.put_calls[-1]
    assert put_keys == engine.component_keys(hashes[half:]), "only missing keys should be put"
    assert results == [0] * len(put_keys), f"{method} results {results}"
    assert ok == [True] * n

    # Query: leading pages whose every component key exists.
    missing = page_hashes(1)[0]
    assert engine.batch_exists(hashes) == n
    assert engine.batch_exists(hashes + [missing]) == n
    assert engine.batch_exists([missing] + hashes) == 0
    if not is_mla:
        # A page with its K but not its V is not a hit: the prefix stops before it.
        v_key = engine.component_keys([hashes[2]])[1]
        assert store.remove(v_key, True) == 0
        assert engine.batch_exists(hashes) == 2
        ok = engine.batch_set_v1(hashes, token_indices(pool, src))
        method, put_keys, results = engine.put_calls[-1]
        assert put_keys == [v_key], f"re-backup put {put_keys}"
        assert results == [0]
        assert engine.batch_exists(hashes) == n

    # Prefetch into other host slots: every get result > 0 (the object's size), bytes equal.
    for page in dst:
        for part in _page_views(pool, page):
            part[...] = 0
    ok = engine.batch_get_v1(hashes, token_indices(pool, dst))
    method, get_keys, results = engine.get_calls[-1]
    _, sizes = pool.get_page_buffer_meta(token_indices(pool, dst))
    if is_mla and pool.layout == "layer_first":
        assert method == "batch_get_into_multi_buffers"
        per_key = [sum(sizes[i : i + pool.layer_num]) for i in range(0, len(sizes), pool.layer_num)]
    else:
        per_key = sizes
    assert results == per_key, f"{method} results {results}, expected sizes {per_key}"
    assert ok == [True] * n
    for s, d in zip(src, dst):
        assert pool.page_bytes(d * pool.page_size) == pool.page_bytes(s * pool.page_size), f"page {s} -> {d} differs"

    # A prefetch of a missing page fails (result <= 0) without touching the others.
    ok = engine.batch_get_v1([hashes[0], missing], token_indices(pool, dst[:2]))
    _, _, results = engine.get_calls[-1]
    assert ok == [True, False], f"prefetch with a missing page: {results}"
    if register:
        engine.unregister_mem_pool_host()
    return written


def _page_views(pool, page):
    span = slice(page * pool.page_size, (page + 1) * pool.page_size)
    if isinstance(pool, SGLangMHAHostPool):
        return [pool.k_buffer[span], pool.v_buffer[span]]
    if pool.layout == "layer_first":
        return [pool.kv_buffer[:, span]]
    return [pool.kv_buffer[span]]


def sglang_check_server(master_host, metrics_port, timeout=30.0, interval=0.2):
    """SGLang's ``check_server``: GET ``/get_all_segments`` until the body is non-empty
    (SGLang polls every 3 s for up to 10 minutes). Returns the body."""
    import urllib.request  # noqa: PLC0415

    url = f"http://{master_host}:{metrics_port}/get_all_segments"
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                body = response.read().decode()
            if body != "":
                return body
            last = "empty body"
        except Exception as error:  # noqa: BLE001 (SGLang retries on any error)
            last = repr(error)
        time.sleep(interval)
    raise AssertionError(f"{url} stayed empty or unreachable: {last}")


# =====================================================================================
# vLLM MooncakeStoreConnector
# =====================================================================================


class VLLMKVCaches:
    """The GPU KV-cache tensors vLLM registers, here in host memory. FlashAttention layout:
    one tensor per layer of shape ``(2, num_blocks, block_size, num_kv_heads, head_dim)``
    (K/V outermost: two segments per layer); ``mla=True`` gives the blocks-first layout
    ``(num_blocks, block_size, head_dim)`` (one segment per layer)."""

    def __init__(
        self, num_layers=3, num_blocks=24, block_size=16, num_kv_heads=2, head_dim=32, dtype=np.float16, mla=False
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.mla = mla
        if mla:
            shape = (num_blocks, block_size, head_dim)
        else:
            shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = {f"model.layers.{i}.self_attn": np.zeros(shape, dtype=dtype) for i in range(num_layers)}

    def block_bytes(self, block_id):
        out = []
        for cache in self.layers.values():
            if self.mla:
                out.append(cache[block_id].tobytes())
            else:
                out.append(cache[0, block_id].tobytes())
                out.append(cache[1, block_id].tobytes())
        return out

    def zero_block(self, block_id):
        for cache in self.layers.values():
            if self.mla:
                cache[block_id] = 0
            else:
                cache[:, block_id] = 0


class VLLMTokenDatabase:
    """``ChunkedTokenDatabase``: keys ``{model}@tp_rank:N@pcp0@dcp0@pp_rank:0@group:0@<hex>``
    and the per-segment addresses of a block."""

    def __init__(
        self, model_name, block_size, tp_rank=0, pcp_rank=0, dcp_rank=0, pp_rank=0, group_id=0, cache_prefix=""
    ):
        prefix = f"{cache_prefix}@" if cache_prefix else ""
        self.key_prefix = (
            f"{prefix}{model_name}@tp_rank:{tp_rank}@pcp{pcp_rank}@dcp{dcp_rank}@pp_rank:{pp_rank}@group:{group_id}"
        )
        self.block_size = block_size
        self.kv_caches_base_addr = []
        self.block_len = []

    def key_for(self, chunk_hash):
        return f"{self.key_prefix}@{chunk_hash.hex()}"

    def prepare_values(self, chunks, block_ids):
        addrs, sizes, bids = [], [], []
        length = len(self.block_len)
        for start, end in chunks:
            bid = block_ids[start // self.block_size]
            count = -(-(end - start) // self.block_size)
            addrs.append([base + bid * self.block_len[i % length] for i, base in enumerate(self.kv_caches_base_addr)])
            sizes.append([self.block_len[i % length] * count for i in range(len(self.kv_caches_base_addr))])
            bids.append(bid)
        return addrs, sizes, bids

    def process_tokens(self, token_len, block_hashes, mask_num=0):
        start_chunk = -(-mask_num // self.block_size)
        max_chunks = -(-token_len // self.block_size)
        for chunk_id in range(start_chunk, max_chunks):
            start = chunk_id * self.block_size
            end = min(start + self.block_size, token_len)
            yield start, end, block_hashes[end // self.block_size - 1]


def vllm_block_hashes(count):
    """vLLM block hashes: chained 32-byte digests."""
    out = []
    prev = uuid.uuid4().bytes
    for i in range(count):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


class VLLMStoreWorker:
    """The calls of ``MooncakeStoreWorker`` and its threads after ``setup``."""

    def __init__(self, store, caches, model_name, *, tp_rank=0, preferred_segment=None):
        ReplicateConfig = _replicate_config()
        self.store = store
        self.caches = caches
        self.tp_rank = tp_rank
        self.replicate_config = ReplicateConfig()
        if preferred_segment is not None:
            self.replicate_config.preferred_segment = preferred_segment
        self.db = VLLMTokenDatabase(model_name, caches.block_size, tp_rank=tp_rank)
        self.save_results = []
        self.lock = threading.Lock()

    def register_kv_caches(self):
        addrs, block_lens = [], []
        seen = set()
        for cache in self.caches.layers.values():
            base = address(cache)
            if base in seen:
                continue
            seen.add(base)
            region_len = nbytes(cache)
            ret = self.store.register_buffer(base, region_len)
            assert ret == 0, f"register_buffer({base:#x}, {region_len}) returned {ret}"
            page_size_bytes = region_len // self.caches.num_blocks
            outer = [d for d in range(cache.ndim) if cache.strides[d] > page_size_bytes]
            if not outer:
                addrs.append(base)
                block_lens.append(page_size_bytes)
            else:
                seg_stride = cache.strides[outer[0]]
                for idx in range(cache.shape[outer[0]]):
                    addrs.append(base + idx * seg_stride)
                    block_lens.append(seg_stride // self.caches.num_blocks)
        self.db.kv_caches_base_addr = addrs
        self.db.block_len = block_lens
        return len(addrs)

    def save(self, block_hashes, block_ids, token_len):
        """``KVCacheStoreSendingThread._handle_request``: dedup through ``batch_is_exist``,
        then ``batch_put_from_multi_buffers`` of the missing blocks. Returns (keys put,
        results)."""
        token_len = token_len // self.caches.block_size * self.caches.block_size
        starts, ends, keys = [], [], []
        for start, end, h in self.db.process_tokens(token_len, block_hashes):
            starts.append(start)
            ends.append(end)
            keys.append(self.db.key_for(h))
        if not keys:
            return [], []
        exists = self.store.batch_is_exist(keys)
        missing = [i for i, e in enumerate(exists) if e != 1]
        if not missing:
            return [], []
        keys = [keys[i] for i in missing]
        chunks = [(starts[i], ends[i]) for i in missing]
        addrs, sizes, _ = self.db.prepare_values(chunks, block_ids)
        res = list(self.store.batch_put_from_multi_buffers(keys, addrs, sizes, self.replicate_config))
        with self.lock:
            self.save_results.append((keys, res))
        return keys, res

    def lookup(self, num_tokens, block_hashes):
        """Tokens of the longest stored prefix (whole blocks)."""
        chunks = min(len(block_hashes), num_tokens // self.caches.block_size)
        keys = [self.db.key_for(block_hashes[i]) for i in range(chunks)]
        if not keys:
            return 0
        res = self.store.batch_is_exist(keys)
        hit = 0
        for value in res:
            if value != 1:
                break
            hit += 1
        return hit * self.caches.block_size

    def load(self, block_hashes, block_ids, token_len, tier_log=False):
        """``KVCacheStoreRecvingThread._handle_request``: keys rotated by tp rank,
        ``batch_get_into_multi_buffers``; a result < 0 is a failed block. Returns
        (keys, results, expected sizes, tiers)."""
        chunks, keys = [], []
        for start, end, h in self.db.process_tokens(token_len, block_hashes):
            keys.append(self.db.key_for(h))
            chunks.append((start, end))
        addrs, sizes, bids = self.db.prepare_values(chunks, block_ids)
        rotation = self.tp_rank % len(keys)
        keys = keys[rotation:] + keys[:rotation]
        addrs = addrs[rotation:] + addrs[:rotation]
        sizes = sizes[rotation:] + sizes[:rotation]
        tiers = None
        if tier_log:
            tiers = vllm_replica_tiers(self.store, keys)
        res = list(self.store.batch_get_into_multi_buffers(keys, addrs, sizes))
        return keys, res, [sum(s) for s in sizes], tiers


def vllm_replica_tiers(store, keys):
    """``_get_replica_tiers_by_key``: the first replica of each key, classified by its
    ``is_memory_replica()`` / ``is_disk_replica()`` / ``is_local_disk_replica()``."""
    descs = store.batch_get_replica_desc(keys)
    tiers = {}
    for key in keys:
        replicas = descs.get(key) if hasattr(descs, "get") else descs[key]
        tier = "unknown"
        if replicas:
            first = replicas[0]
            if getattr(first, "is_memory_replica", None) and first.is_memory_replica():
                tier = "memory"
            elif (getattr(first, "is_disk_replica", None) and first.is_disk_replica()) or (
                getattr(first, "is_local_disk_replica", None) and first.is_local_disk_replica()
            ):
                tier = "disk"
        tiers[key] = tier
    return tiers


def vllm_sequence(store, *, model_name=None, preferred_segment=None, mla=False, load_threads=2, seed=0, reset=True):
    """vLLM's MooncakeStoreConnector after ``setup``: register the KV caches, save a
    request's blocks (dedup by ``batch_is_exist``), look the prefix up, log the tiers
    through ``batch_get_replica_desc``, load into other blocks with the tp-rank rotation;
    then one save thread and load threads at the same time; then the reset
    (``remove_all(force=True)``). Returns the keys written (all removed when ``reset``)."""
    rng = np.random.default_rng(seed)
    model_name = model_name or f"Qwen3-8B-{unique_tag()}"
    caches = VLLMKVCaches(mla=mla)
    worker = VLLMStoreWorker(store, caches, model_name, tp_rank=1, preferred_segment=preferred_segment)
    segments = worker.register_kv_caches()
    assert segments == len(caches.layers) * (1 if mla else 2)
    for cache in caches.layers.values():
        fill_random(cache, rng)
    bs = caches.block_size

    # Request A: 4 full blocks and a partial tail (not saved: the save floors to blocks).
    hashes_a = vllm_block_hashes(5)
    blocks_a = [3, 5, 7, 9, 11]
    keys, res = worker.save(hashes_a, blocks_a, 4 * bs + 5)
    assert len(keys) == 4, f"saved {len(keys)} blocks"
    assert all(r >= 0 for r in res), f"batch_put_from_multi_buffers failed: {res}"
    assert res == [0] * 4, f"batch_put_from_multi_buffers results {res} (upstream: 0 each)"
    written = list(keys)
    # Saved again: everything exists, nothing is put.
    again, _ = worker.save(hashes_a, blocks_a, 4 * bs)
    assert again == [], f"dedup failed: {again} put again"

    # Lookup: 4 blocks present; a request sharing 2 blocks then diverging hits 2.
    assert worker.lookup(5 * bs, hashes_a) == 4 * bs
    assert worker.lookup(5 * bs, hashes_a[:2] + vllm_block_hashes(3)) == 2 * bs

    # Load into other blocks, with the tier log on.
    dst_a = [12, 13, 14, 15]
    for b in dst_a:
        caches.zero_block(b)
    keys_loaded, res, expected, tiers = worker.load(hashes_a, dst_a, 4 * bs, tier_log=True)
    assert keys_loaded[0] == worker.db.key_for(hashes_a[1]), "tp rank 1 rotates the key list by one"
    assert all(r >= 0 for r in res), f"batch_get_into_multi_buffers failed: {res}"
    assert res == expected, f"batch_get_into_multi_buffers results {res}, expected {expected}"
    assert set(tiers.values()) == {"memory"}, f"tiers {tiers}"
    for s, d in zip(blocks_a[:4], dst_a):
        assert caches.block_bytes(d) == caches.block_bytes(s), f"block {s} -> {d} differs"

    # A block that is not in the store fails the load (< 0).
    hashes_missing = hashes_a[:1] + vllm_block_hashes(1)
    _, res, _, _ = worker.load(hashes_missing, [16, 17], 2 * bs)
    assert sum(1 for r in res if r < 0) == 1, f"load with one missing block: {res}"

    # One save thread and load threads at once.
    hashes_b = vllm_block_hashes(4)
    blocks_b = [0, 1, 2, 4]
    errors = []
    stop = threading.Event()

    def saver():
        try:
            for i in range(1, 5):
                _keys, res = worker.save(hashes_b[:i], blocks_b, i * bs)
                if any(r < 0 for r in res):
                    errors.append(f"save {i}: {res}")
        except Exception as error:  # noqa: BLE001
            errors.append(f"save thread: {error!r}")

    def loader(targets):
        try:
            rounds = 0
            while not stop.is_set() or rounds < 3:
                _k, res, expected, _ = worker.load(hashes_a, targets, 4 * bs)
                if res != expected:
                    errors.append(f"load into {targets}: {res} != {expected}")
                    return
                for s, d in zip(blocks_a[:4], targets):
                    if caches.block_bytes(d) != caches.block_bytes(s):
                        errors.append(f"load into {targets}: block {s} -> {d} differs")
                        return
                rounds += 1
        except Exception as error:  # noqa: BLE001
            errors.append(f"load thread: {error!r}")

    targets = [[16, 17, 18, 19], [20, 21, 22, 23]][:load_threads]
    threads = [threading.Thread(target=loader, args=(t,)) for t in targets]
    save_thread = threading.Thread(target=saver)
    for t in threads:
        t.start()
    save_thread.start()
    save_thread.join(60)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert worker.lookup(4 * bs, hashes_b) == 4 * bs
    written += [worker.db.key_for(h) for h in hashes_b]
    for b in dst_a:
        caches.zero_block(b)
    _, res, expected, _ = worker.load(hashes_b, dst_a, 4 * bs)
    assert res == expected, f"load of request B: {res}"
    for s, d in zip(blocks_b, dst_a):
        assert caches.block_bytes(d) == caches.block_bytes(s), f"request B block {s} -> {d} differs"

    if reset:
        # LookupKeyServer's RESET: remove_all(force=True) after the save queue drained.
        removed = store.remove_all(force=True)
        assert removed >= len(written), f"remove_all(force=True) returned {removed} for {len(written)} keys"
        assert list(store.batch_is_exist(written)) == [0] * len(written)
        assert worker.lookup(4 * bs, hashes_a) == 0
    for cache in caches.layers.values():
        assert store.unregister_buffer(address(cache)) == 0
    return written


# =====================================================================================
# LMCache MooncakestoreConnector
# =====================================================================================

METADATA_BYTES_LEN = 28


class LMCachePinnedPool:
    """The pinned CPU buffer of LMCache's ``LocalCPUBackend`` (one uint8 tensor) and a
    bump allocator of chunk-shaped memory objects in it."""

    def __init__(self, size=16 * MIB):
        self.buffer = np.zeros(size, dtype=np.uint8)
        self.offset = 0

    def allocate(self, shape, dtype=np.float16):
        count = int(np.prod(shape)) * np.dtype(dtype).itemsize
        start = (self.offset + 255) // 256 * 256
        assert start + count <= self.buffer.size, "pinned pool exhausted"
        self.offset = start + count
        return self.buffer[start : start + count].view(dtype).reshape(shape)


def lmcache_key(model_name, chunk_hash, world_size=1, worker_id=0, dtype="bfloat16"):
    """``CacheEngineKey.to_string()``: ``model@world_size@worker_id@<hash hex>@dtype``."""
    return f"{model_name}@{world_size}@{worker_id}@{chunk_hash:016x}@{dtype}"


def lmcache_metadata(length, shape, dtype_code=1, fmt_code=1):
    """``RemoteMetadata.serialize()``: 28 bytes (length, shape padded to 4, dtype, fmt)."""
    dims = list(shape) + [0] * (4 - len(shape))
    return struct.pack("iiiiiii", length, *dims, dtype_code, fmt_code)


class LMCacheConnector:
    """The calls of ``MooncakestoreConnector`` after ``setup``."""

    def __init__(self, store, pool, *, prefer_local_alloc=False, transfer_timeout=5):
        ReplicateConfig = _replicate_config()
        self.store = store
        self.pool = pool
        self.transfer_timeout = transfer_timeout
        self.replica_config = ReplicateConfig()
        self.replica_config.replica_num = 1
        if prefer_local_alloc:
            self.replica_config.preferred_segment = self.store.get_hostname()
        buffer = pool.buffer
        self.registered_buffer_ptr = address(buffer)
        result = self.store.register_buffer(address(buffer), buffer.size)
        assert result == 0, f"register_buffer of the pinned pool returned {result}"

    def exists(self, key):
        return self.store.is_exist(key)

    async def put_without_metadata(self, key, obj):
        return await asyncio.wait_for(
            asyncio.to_thread(self.store.put_from, key, address(obj), nbytes(obj), self.replica_config),
            timeout=self.transfer_timeout,
        )

    async def put_with_metadata(self, key, obj):
        kv_bytes = memoryview(obj.reshape(-1).view(np.uint8))
        metadata = lmcache_metadata(len(kv_bytes), obj.shape)
        assert len(metadata) == METADATA_BYTES_LEN
        return await asyncio.wait_for(
            asyncio.to_thread(self.store.put_parts, key, metadata, kv_bytes),
            timeout=self.transfer_timeout,
        )

    async def batch_get_into(self, keys, full_shape, dtype=np.float16):
        objs = [self.pool.allocate(full_shape, dtype) for _ in keys]
        ptrs = [address(o) for o in objs]
        sizes = [nbytes(o) for o in objs]
        read = await asyncio.to_thread(self.store.batch_get_into, keys, ptrs, sizes)
        return objs, list(read)

    async def batch_get_buffer(self, keys):
        return await asyncio.to_thread(self.store.batch_get_buffer, keys)

    def close(self):
        if self.registered_buffer_ptr is not None:
            result = self.store.unregister_buffer(self.registered_buffer_ptr)
            assert result == 0, f"unregister_buffer returned {result}"
            self.registered_buffer_ptr = None
        self.store.close()


def lmcache_sequence(store, *, prefer_local_alloc=True, model_name=None, seed=0, close=True):
    """LMCache's connector: register the pinned pool, put whole chunks and a partial last
    chunk with ``put_from`` (``asyncio.to_thread`` under ``wait_for``), ``is_exist`` as a
    boolean, ``batch_get_into`` with whole-chunk buffers (the partial chunk returns its own
    size, a missing key <= 0), the metadata mode (``put_parts(meta, memoryview)`` and
    ``batch_get_buffer``, a missing key -> None), then ``unregister_buffer`` and ``close()``.
    Returns the keys written."""
    rng = np.random.default_rng(seed)
    model_name = model_name or f"meta-llama/Llama-3.1-8B-{unique_tag()}"
    pool = LMCachePinnedPool()
    conn = LMCacheConnector(store, pool, prefer_local_alloc=prefer_local_alloc)
    if prefer_local_alloc:
        assert conn.replica_config.preferred_segment, "get_hostname() returned nothing"

    # KV chunk, format KV_2LTD: (2, num_layers, chunk_tokens, hidden).
    layers, chunk, hidden = 4, 64, 128
    full_shape = (2, layers, chunk, hidden)
    tail_tokens = 23
    chunks = [pool.allocate(full_shape) for _ in range(3)] + [pool.allocate((2, layers, tail_tokens, hidden))]
    for c in chunks:
        fill_random(c, rng)
    base_hash = int.from_bytes(os.urandom(8), "little") >> 1
    keys = [lmcache_key(model_name, base_hash + i) for i in range(len(chunks))]

    async def put_all():
        return [await conn.put_without_metadata(k, c) for k, c in zip(keys, chunks)]

    results = asyncio.run(put_all())
    assert results == [0] * len(chunks), f"put_from results {results}"
    for k in keys:
        assert conn.exists(k), f"is_exist({k}) is false after put"
    missing = lmcache_key(model_name, base_hash + 1000)
    assert not conn.exists(missing), "is_exist of a missing key is truthy"
    assert conn.exists(missing) == 0

    objs, read = asyncio.run(conn.batch_get_into(keys + [missing], full_shape))
    sizes = [nbytes(c) for c in chunks]
    assert read[:-1] == sizes, f"batch_get_into read {read[:-1]}, expected {sizes}"
    assert read[-1] <= 0, f"batch_get_into of a missing key returned {read[-1]}"
    for obj, c, n in zip(objs, chunks, read):
        assert obj.reshape(-1).view(np.uint8)[:n].tobytes() == c.tobytes(), "chunk bytes differ"
    # LMCache's reshape_partial_chunk: the first n bytes are the (2, L, T', D) chunk.
    tail = objs[3].reshape(-1).view(np.uint8)[: read[3]].view(np.float16).reshape(2, layers, tail_tokens, hidden)
    assert np.array_equal(tail.view(np.uint16), chunks[3].view(np.uint16))

    # Metadata mode (save_chunk_meta): put_parts(meta, memoryview), batch_get_buffer.
    meta_keys = [lmcache_key(model_name, base_hash + 100 + i) for i in range(2)]

    async def put_meta():
        return [await conn.put_with_metadata(k, c) for k, c in zip(meta_keys, (chunks[0], chunks[3]))]

    results = asyncio.run(put_meta())
    assert results == [0, 0], f"put_parts results {results}"
    buffers = asyncio.run(conn.batch_get_buffer(meta_keys + [missing]))
    assert len(buffers) == 3
    assert buffers[2] is None, f"batch_get_buffer of a missing key returned {buffers[2]!r}"
    for buffer, c in zip(buffers[:2], (chunks[0], chunks[3])):
        assert buffer is not None
        view = memoryview(buffer)
        meta = view[:METADATA_BYTES_LEN]
        assert len(meta) == METADATA_BYTES_LEN
        length, d0, d1, d2, d3, _dtype, _fmt = struct.unpack("iiiiiii", meta)
        assert len(view) == length + METADATA_BYTES_LEN
        assert (d0, d1, d2, d3) == c.shape
        data = np.frombuffer(buffer, dtype=np.float16, offset=METADATA_BYTES_LEN, count=c.size).reshape(c.shape)
        assert data.tobytes() == c.tobytes(), "metadata-mode chunk differs"
        del view, meta, data
    del buffers

    written = keys + meta_keys
    if close:
        for k in written:
            store.remove(k, True)
        conn.close()
    return written
