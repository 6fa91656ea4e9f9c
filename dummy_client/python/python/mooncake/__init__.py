"""mooncake-rs: a drop-in implementation of the Mooncake Store Python client.

Use ``from mooncake.store import MooncakeDistributedStore, ReplicateConfig``. As
upstream's package does, ``mooncake`` itself re-exports the buffer-pool classes.
"""

from mooncake.buffer_pool import BufferPool, RegisteredBufferPool

__all__ = ["store", "BufferPool", "RegisteredBufferPool"]
