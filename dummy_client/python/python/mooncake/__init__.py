"""mooncake-rs: a drop-in implementation of the Mooncake Store Python client.

Use ``from mooncake.store import MooncakeDistributedStore, ReplicateConfig``. As
upstream's package does, ``mooncake`` itself re-exports the buffer-pool classes.
"""

import os as _os

# Upstream's wheels (another distribution name, the same package) put their compiled
# `store` module here as `store.so`; Python imports an extension module before
# `store.py`, so a leftover one would silently run upstream's client instead of ours.
_UPSTREAM_DISTRIBUTIONS = ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda")


def _refuse_a_foreign_store_module():
    here = _os.path.dirname(_os.path.abspath(__file__))
    foreign = sorted(
        name
        for name in _os.listdir(here)
        if name.startswith("store.") and name.endswith((".so", ".pyd"))
    )
    if not foreign:
        return
    installed = []
    try:
        from importlib import metadata

        for name in _UPSTREAM_DISTRIBUTIONS:
            try:
                installed.append(f"{name} {metadata.version(name)}")
            except metadata.PackageNotFoundError:
                pass
    except Exception:  # noqa: BLE001 - the refusal must not fail for another reason
        pass
    owner = ", ".join(installed) or "an upstream Mooncake wheel"
    raise ImportError(
        f"mooncake: {_os.path.join(here, foreign[0])} is the compiled store module of "
        f"another distribution ({owner}); Python would import it instead of this "
        "package's client. Remove it with `pip uninstall "
        + " ".join(_UPSTREAM_DISTRIBUTIONS)
        + "`, then reinstall this package (`pip install --force-reinstall` of its "
        "wheel), since both install files into the same `mooncake` directory."
    )


_refuse_a_foreign_store_module()

from mooncake.buffer_pool import BufferPool, RegisteredBufferPool  # noqa: E402

__all__ = ["store", "BufferPool", "RegisteredBufferPool"]
