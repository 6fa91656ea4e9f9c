"""Upstream's ``MooncakeDistributedStoreAsync``: the store with an ``async_<name>``
coroutine for every method ``<name>``, run in the event loop's default executor.

    store = MooncakeDistributedStoreAsync()
    store.setup_dummy(...)
    await store.async_put("key", b"value")

The store's calls release the GIL while they wait, so several ``async_*`` calls in
flight run in parallel.
"""

import asyncio
import functools

from mooncake.store import MooncakeDistributedStore

__all__ = ["MooncakeDistributedStoreAsync"]


class MooncakeDistributedStoreAsync(MooncakeDistributedStore):
    """``MooncakeDistributedStore`` plus ``async_<name>`` for each method ``<name>``."""

    def __getattr__(self, name):
        # Only called for names not found the usual way: build the coroutine function
        # once and keep it on the instance.
        if not name.startswith("async_"):
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        method_name = name[len("async_") :]
        try:
            method = getattr(self, method_name)
        except AttributeError:
            raise AttributeError(
                f"'{type(self).__name__}' object has no attribute '{name}' (nor '{method_name}')"
            ) from None
        if not callable(method):
            raise AttributeError(f"'{method_name}' is not callable")
        coroutine_function = self._make_async_wrapper(method)
        setattr(self, name, coroutine_function)
        return coroutine_function

    def _make_async_wrapper(self, method):
        """A coroutine function that runs ``method`` in the running loop's executor."""

        @functools.wraps(method)
        async def run_in_executor(*args, **kwargs):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(None, functools.partial(method, *args, **kwargs))

        return run_in_executor
