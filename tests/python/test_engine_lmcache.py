"""LMCache's MooncakestoreConnector, replayed (see ``engine_sequences.lmcache_sequence``).

``setup`` with LMCache's seven positional arguments against a standalone master;
``ReplicateConfig()`` with ``replica_num = 1`` and, with ``prefer_local_alloc``,
``preferred_segment = get_hostname()``; ``register_buffer`` of the pinned CPU pool;
``put_from`` through ``asyncio.to_thread`` under ``wait_for``; ``is_exist`` as a boolean;
``batch_get_into`` with whole-chunk buffers (a partial last chunk returns its own size, a
missing key <= 0); the metadata mode (``put_parts(meta_bytes, memoryview)`` and
``batch_get_buffer``, a missing key -> None); ``unregister_buffer`` then ``close()``.
"""

import pytest

from engine_sequences import lmcache_sequence
from mooncake.store import MooncakeDistributedStore

MIB = 1 << 20


def lmcache_setup(store, master):
    # store.setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
    #             protocol, device_name, master_server_address); LMCache ignores the result.
    return store.setup("127.0.0.1", "P2PHANDSHAKE", 64 * MIB, 16 * MIB, "tcp", "", master.address)


@pytest.mark.parametrize("prefer_local_alloc", [False, True])
def test_embedded(start_master, prefer_local_alloc):
    master = start_master()
    store = MooncakeDistributedStore()
    assert lmcache_setup(store, master) == 0
    closed = False
    try:
        written = lmcache_sequence(store, prefer_local_alloc=prefer_local_alloc, close=True)
        closed = True
        assert written
    finally:
        if not closed:
            store.close()


def test_embedded_two_workers(start_master):
    """Two LMCache workers (two embedded stores, one master): a chunk one of them put is
    read by the other through batch_get_into and batch_get_buffer."""
    import asyncio

    import numpy as np

    from engine_sequences import LMCacheConnector, LMCachePinnedPool, fill_random, lmcache_key

    master = start_master()
    stores = [MooncakeDistributedStore(), MooncakeDistributedStore()]
    try:
        for store in stores:
            assert lmcache_setup(store, master) == 0
        pools = [LMCachePinnedPool(), LMCachePinnedPool()]
        writer = LMCacheConnector(stores[0], pools[0], prefer_local_alloc=True)
        reader = LMCacheConnector(stores[1], pools[1], prefer_local_alloc=True)
        shape = (2, 4, 64, 128)
        chunk = pools[0].allocate(shape)
        fill_random(chunk, np.random.default_rng(7))
        key = lmcache_key("meta-llama/Llama-3.1-8B-two-workers", 0x1234_5678_9ABC)
        meta_key = key + "@meta"
        assert asyncio.run(writer.put_without_metadata(key, chunk)) == 0
        assert asyncio.run(writer.put_with_metadata(meta_key, chunk)) == 0
        assert reader.exists(key)
        objs, read = asyncio.run(reader.batch_get_into([key], shape))
        assert read == [chunk.nbytes]
        assert objs[0].tobytes() == chunk.tobytes()
        (buffer,) = asyncio.run(reader.batch_get_buffer([meta_key]))
        assert buffer is not None and len(memoryview(buffer)) == chunk.nbytes + 28
        assert bytes(memoryview(buffer)[28:]) == chunk.tobytes()
        del buffer
        for store in stores:
            store.remove(key, True)
            store.remove(meta_key, True)
        reader.close()
        writer.close()
    finally:
        for store in stores:
            store.close()
