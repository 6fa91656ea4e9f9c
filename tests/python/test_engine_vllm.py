"""vLLM's MooncakeStoreConnector, replayed (see ``engine_sequences.vllm_sequence``).

* embedded mode: ``setup`` with vLLM's seven positional arguments against a standalone
  master, each rank contributing a segment; ``ReplicateConfig()`` with and without
  ``preferred_segment``; FlashAttention (K and V buffer per layer) and MLA layouts;
* standalone-store mode: the rank contributes nothing (``global_segment_size=0``) and a
  real client joined to the same master owns the memory; ``preferred_segment`` names that
  client's segment, found through the master's ``/get_all_segments``.

The KV caches vLLM registers are its GPU tensors; here they are host arrays. Each case
checks ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` results (< 0 is
a failure; upstream returns 0 per put and the bytes read per get), the bytes read back,
``batch_get_replica_desc`` objects with ``is_memory_replica()``, a save thread running with
load threads, and the reset through ``remove_all(force=True)``.
"""

import pytest

from engine_sequences import sglang_check_server, vllm_sequence
from mooncake.store import MooncakeDistributedStore

MIB = 1 << 20


def vllm_setup(store, master, global_segment_size):
    # store.setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
    #             protocol, device_name, master_server_address)
    ret = store.setup("127.0.0.1", "P2PHANDSHAKE", global_segment_size, 16 * MIB, "tcp", "", master.address)
    if ret != 0:
        raise RuntimeError(f"Initialize MooncakeDistributedStore failed ({ret}).")


@pytest.mark.parametrize("layout", ["flash_attn", "mla"])
@pytest.mark.parametrize("preferred", ["none", "own_segment"])
def test_embedded(start_master, layout, preferred):
    master = start_master()
    store = MooncakeDistributedStore()
    vllm_setup(store, master, 64 * MIB)
    try:
        preferred_segment = store.get_hostname() if preferred == "own_segment" else None
        if preferred_segment is not None:
            assert preferred_segment, "get_hostname() returned nothing in embedded mode"
        vllm_sequence(store, preferred_segment=preferred_segment, mla=(layout == "mla"))
    finally:
        assert store.close() == 0


def test_embedded_two_ranks_share_the_master(start_master):
    """Two ranks (two embedded stores on one master): each saves and loads its own keys
    (tp_rank in the key), both run at the same time as vLLM's workers do."""
    master = start_master()
    stores = []
    try:
        for _ in range(2):
            store = MooncakeDistributedStore()
            vllm_setup(store, master, 64 * MIB)
            stores.append(store)
        status, body = master.http_get("/get_all_segments")
        assert status == 200 and len(body.split()) == 2, body
        for i, store in enumerate(stores):
            vllm_sequence(store, seed=i, reset=False)
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize("preferred", ["none", "owner_segment"])
def test_standalone_store(start_master, master_client, preferred):
    master = start_master()
    owner = master_client(master, segment="256MB")
    store = MooncakeDistributedStore()
    vllm_setup(store, master, 0)
    try:
        segments = sglang_check_server(master.host, master.metrics_port).split()
        # The rank contributed no memory: the owner's segment is the only one.
        assert len(segments) == 1, f"segments {segments}"
        preferred_segment = segments[0] if preferred == "owner_segment" else None
        vllm_sequence(store, preferred_segment=preferred_segment)
        vllm_sequence(store, preferred_segment=preferred_segment, mla=True, seed=1)
        assert owner.alive()
    finally:
        assert store.close() == 0
