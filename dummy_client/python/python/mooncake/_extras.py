"""Upstream's helper classes of ``mooncake.store`` that are not the store itself:
buffer pools and their leases, NUMA binding, and the other module-level helpers.
Names listed in ``__all__`` are re-exported by ``mooncake.store``."""

__all__ = []
