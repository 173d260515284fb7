"""Blocking calls to the workers from a notebook cell.

Runs on the controller. A Jupyter kernel runs a cell's synchronous code on the thread of its
asyncio event loop, with the loop marked as running, so the cell blocks the loop until it ends.
Monarch's ``Future.get()`` sees the running loop and logs a warning on every call (hundreds per
``fit``), although blocking is what a synchronous cell does anyway. ``blocks_the_cell`` hides the
loop from Monarch for the duration of one controller call, and puts it back after.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from lightning_monarch._compat import python as python_compat

F = TypeVar("F", bound=Callable[..., Any])


def blocks_the_cell(function: F) -> F:
    """Run ``function`` with this thread's running event loop, if any, hidden from Monarch."""

    @functools.wraps(function)
    def hidden_loop(*args: Any, **kwargs: Any) -> Any:
        with python_compat.running_loop_hidden():
            return function(*args, **kwargs)

    return hidden_loop  # type: ignore[return-value]
