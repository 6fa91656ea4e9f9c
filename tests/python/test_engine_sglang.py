"""SGLang HiCache's Mooncake backend, replayed (see ``engine_sequences.sglang_sequence``).

* standalone storage (dummy mode): the host KV pool comes from
  ``MooncakeHostMemAllocator().alloc(size)`` before the store exists, wrapped as an array
  through ctypes; then ``setup_dummy(pool bytes, 16 MiB, MOONCAKE_CLIENT)``, the warmup, and
  ``register_buffer`` of the pool's K and V halves; against a real client running its
  embedded master and against one joined to a standalone master;
* ``check_server``: ``GET /get_all_segments`` on the master's metrics port until the body
  is non-empty;
* embedded mode: ``setup`` with SGLang's eight positional arguments and its kwargs against
  a standalone master, with ordinary host memory as the pools.

Each case checks what SGLang checks (every put result 0, every get result > 0, the count
of leading ``batch_is_exist`` results equal to 1) and the bytes read back.
"""

import gc

import numpy as np
import pytest

from engine_sequences import (
    SGLangMHAHostPool,
    SGLangMLAHostPool,
    array_at,
    sglang_check_server,
    sglang_sequence,
    sglang_setup,
)
from mooncake.store import MooncakeDistributedStore
from mooncake_testlib import free_loopback_port, wait_until

STAGING = 16 << 20
PAGES = 16


class AllocatorPool:
    """Host memory from ``MooncakeHostMemAllocator`` (SGLang's ``MooncakeHostTensorAllocator``),
    freed at the end."""

    def __init__(self):
        from mooncake.store import MooncakeHostMemAllocator  # noqa: PLC0415

        self.allocator = MooncakeHostMemAllocator()
        self.blocks = []

    def alloc(self, size):
        ptr = self.allocator.alloc(size)
        assert isinstance(ptr, int) and ptr != 0, f"MooncakeHostMemAllocator().alloc({size}) returned {ptr!r}"
        self.blocks.append(ptr)
        return array_at(ptr, size)

    def free_all(self):
        gc.collect()
        for ptr in self.blocks:
            assert self.allocator.free(ptr) == 0, f"MooncakeHostMemAllocator().free({ptr:#x}) failed"
        self.blocks = []


def mha_pool(memory_source):
    size = SGLangMHAHostPool.required_bytes(PAGES)
    return SGLangMHAHostPool(PAGES, memory=memory_source.alloc(size)), size


def mla_pool(memory_source, layout):
    probe = SGLangMLAHostPool(PAGES, layout=layout)
    size = probe.kv_buffer.nbytes
    return SGLangMLAHostPool(PAGES, layout=layout, memory=memory_source.alloc(size)), size


def standalone_store(pool_bytes, address):
    store = MooncakeDistributedStore()
    ret = store.setup_dummy(pool_bytes, STAGING, address)
    if ret:
        raise RuntimeError(f"Failed to setup Mooncake store, error code: {ret}")
    return store


def remove_keys(store, keys):
    if store.health_check() == 0:
        for key in keys:
            store.remove(key, True)


VARIANTS = {
    "plain": {},
    "group_ids": {"group_semantics": True},
    "prefix_group_ids": {"group_semantics": True, "config_prefix": "mooncake-rs_Qwen-Qwen3-8B"},
    "tp_rank_3": {"tp_rank": 3},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_standalone_mha_with_embedded_master(real_client, variant):
    memory = AllocatorPool()
    pool, size = mha_pool(memory)
    store = standalone_store(size, real_client.address)
    written = []
    try:
        written = sglang_sequence(store, pool, **VARIANTS[variant])
    finally:
        remove_keys(store, written)
        store.close()
        del pool
        memory.free_all()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_standalone_mla_with_embedded_master(real_client, layout):
    memory = AllocatorPool()
    pool, size = mla_pool(memory, layout)
    store = standalone_store(size, real_client.address)
    written = []
    try:
        written = sglang_sequence(store, pool, is_mla=True, group_semantics=(layout == "layer_first"))
    finally:
        remove_keys(store, written)
        store.close()
        del pool
        memory.free_all()


@pytest.mark.parametrize("register", ["kv_halves", "whole_pool"])
def test_standalone_with_standalone_master(start_master, master_client, register):
    """``kv_halves``: current SGLang registers the K and V halves of the allocator's block
    (upstream 0.3.13's dummy client refuses a registration that is not a whole allocator
    block); ``whole_pool``: older SGLang registered the whole ``kv_buffer``."""
    halves = register == "kv_halves"
    master = start_master()
    client = master_client(master)
    body = sglang_check_server(master.host, master.metrics_port)
    assert len(body.split()) == 1, f"one real client, segments {body!r}"

    memory = AllocatorPool()
    mha, mha_size = mha_pool(memory)
    mla, mla_size = mla_pool(memory, "layer_first")
    # One store for both pools, sized for both (SGLang's _standalone_required_bytes).
    store = standalone_store(mha_size + mla_size, client.address)
    try:
        sglang_sequence(store, mha, group_semantics=True, config_prefix="Qwen-Qwen3-8B", halves=halves)
        sglang_sequence(store, mla, is_mla=True)
        assert master.alive() and client.alive()
    finally:
        store.close()
        del mha, mla
        memory.free_all()


def test_check_server_waits_for_the_first_segment(start_master, master_client):
    master = start_master()
    # No real client yet: the master answers with an empty body, SGLang keeps waiting.
    status, body = master.http_get("/get_all_segments")
    assert (status, body) == (200, ""), f"/get_all_segments without segments: {status} {body!r}"
    with pytest.raises(AssertionError):
        sglang_check_server(master.host, master.metrics_port, timeout=0.5)
    master_client(master)
    body = sglang_check_server(master.host, master.metrics_port, timeout=10)
    segments = body.split()
    assert len(segments) == 1 and body.endswith("\n"), f"/get_all_segments: {body!r}"
    # A second node adds a line (once it has mounted: its socket accepts before that).
    master_client(master)
    listed = wait_until(lambda: len(master.http_get("/get_all_segments")[1].split()) == 2, timeout=5)
    assert listed, f"/get_all_segments with two clients: {master.http_get('/get_all_segments')}"


SETUP_KWARGS = {
    "no_kwargs": lambda: {},
    "client_http_server": lambda: {"enable_client_http_server": True, "client_http_port": free_loopback_port()},
}


@pytest.mark.parametrize("kwargs", list(SETUP_KWARGS))
def test_embedded(start_master, kwargs):
    master = start_master()
    store = MooncakeDistributedStore()
    ret, dropped = sglang_setup(store, master.address, tp_size=2, **SETUP_KWARGS[kwargs]())
    assert ret == 0, f"setup returned {ret}"
    assert dropped == [], f"setup() rejected SGLang's kwargs {dropped}"
    try:
        # Embedded mode: ordinary (pinned, here plain) host memory as the pools.
        sglang_sequence(store, SGLangMHAHostPool(PAGES))
        sglang_sequence(store, SGLangMHAHostPool(PAGES), group_semantics=True, config_prefix="Qwen-Qwen3-8B")
        sglang_sequence(store, SGLangMLAHostPool(PAGES), is_mla=True)
        sglang_sequence(store, SGLangMLAHostPool(PAGES, layout="layer_first"), is_mla=True, group_semantics=True)
        # The embedded store contributes its segment: the master lists it.
        status, body = master.http_get("/get_all_segments")
        assert status == 200 and len(body.split()) == 1, body
        # SGLang's clear(): remove_all() without force (objects under a read lease stay).
        assert store.remove_all() >= 0
    finally:
        store.close()


def test_embedded_mha_bf16_layout_sizes(start_master):
    """A larger page (page_size 64, 4 layers, 8 heads, head_dim 128, 2-byte dtype: 512 KiB
    per K or V object), the shape of a real model's page."""
    master = start_master()
    store = MooncakeDistributedStore()
    ret, _ = sglang_setup(store, master.address, global_segment_size=128 << 20)
    assert ret == 0
    try:
        pool = SGLangMHAHostPool(8, page_size=64, layer_num=4, head_num=8, head_dim=128, dtype=np.uint16)
        sglang_sequence(store, pool)
    finally:
        store.close()
