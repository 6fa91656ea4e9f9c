"""mooncake-rs: a drop-in implementation of the Mooncake Store Python client.

Use ``from mooncake.store import MooncakeDistributedStore, ReplicateConfig``.
"""

__all__ = ["store"]
