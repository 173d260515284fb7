"""The door to the private names of Python's standard library that lightning_monarch uses.

Checked against CPython 3.10 to 3.13 (:data:`CHECKED_WITH`); ``tests/test_compat.py`` resolves
every name in :data:`PRIVATE_NAMES`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["CHECKED_WITH", "running_loop_hidden"]

#: The Python releases this door was last checked against.
CHECKED_WITH = "CPython 3.10-3.13"
#: Every private attribute this module uses, by the module that has it.
PRIVATE_NAMES: dict[str, tuple[str, ...]] = {"asyncio": ("_get_running_loop", "_set_running_loop")}


@contextlib.contextmanager
def running_loop_hidden() -> Iterator[None]:
    """Within the block, this thread's running event loop, if any, is not marked as running
    (``asyncio.get_running_loop()`` raises); it is put back after."""
    loop = asyncio._get_running_loop()
    if loop is None:
        yield
        return
    asyncio._set_running_loop(None)
    try:
        yield
    finally:
        asyncio._set_running_loop(loop)
