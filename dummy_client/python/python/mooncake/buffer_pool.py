"""Upstream's ``mooncake.buffer_pool``: the local-buffer pool classes of
``mooncake.store`` under their own module (``RegisteredBufferPool`` is the same
class as ``BufferPool``). A name is ``None`` when the installed ``mooncake.store``
does not provide it, as upstream's module does when its extension lacks it."""

try:
    from mooncake.store import BufferPool
except (ImportError, AttributeError):
    BufferPool = None

try:
    from mooncake.store import RegisteredBufferPool
except (ImportError, AttributeError):
    RegisteredBufferPool = BufferPool

__all__ = ["BufferPool", "RegisteredBufferPool"]
