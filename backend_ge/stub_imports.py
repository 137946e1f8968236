"""Keep what a python stub imports to what it uses: every served model is one stub process.

The python backend's stub (Triton 2.51) calls ``asyncio.iscoroutine()`` on every ``execute()`` result to
support ``async def execute``. That one call imports ``asyncio`` into every stub on its first request, and
with it ``ssl``, ``socket``, ``selectors`` and ``concurrent.futures``: measured +3.4 MiB PSS per stub, for a
backend whose ``execute`` is never a coroutine. :func:`defer_asyncio` registers a stand-in module that
answers ``iscoroutine`` exactly as asyncio does and turns into the real ``asyncio`` on any other use.
"""

from __future__ import annotations

import collections.abc
import importlib
import sys
import types

# asyncio.coroutines._COROUTINE_TYPES: 3.11 still counts generators (generator-based coroutines), 3.12 not.
if sys.version_info < (3, 12):
    _COROUTINE_TYPES: tuple[type, ...] = (types.CoroutineType, types.GeneratorType, collections.abc.Coroutine)
else:
    _COROUTINE_TYPES = (types.CoroutineType, collections.abc.Coroutine)


def iscoroutine(obj: object) -> bool:
    """``asyncio.iscoroutine`` without importing asyncio."""
    return isinstance(obj, _COROUTINE_TYPES)


class _DeferredAsyncio(types.ModuleType):
    """Stands in for ``asyncio`` until something needs more than ``iscoroutine``."""

    iscoroutine = staticmethod(iscoroutine)

    def __getattr__(self, name: str):
        real = _load_real_asyncio(self)
        return getattr(real, name)


def _load_real_asyncio(placeholder: types.ModuleType) -> types.ModuleType:
    if sys.modules.get("asyncio") is placeholder:
        del sys.modules["asyncio"]
    return importlib.import_module("asyncio")


def defer_asyncio() -> bool:
    """Register the stand-in unless asyncio is imported already; True when it was registered."""
    if "asyncio" in sys.modules:
        return False
    sys.modules["asyncio"] = _DeferredAsyncio("asyncio", __doc__)
    return True
