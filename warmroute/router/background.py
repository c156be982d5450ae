"""Background tasks of the router (health checks, scrapes, discovery, index sharing): stopping them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable


async def cancel_all(tasks: Iterable[asyncio.Task | None]) -> None:
    """Cancel the tasks, then wait until each has stopped; their cancellation is expected, not an error."""
    running = [t for t in tasks if t is not None]
    for task in running:
        task.cancel()
    for task in running:
        with contextlib.suppress(asyncio.CancelledError):
            await task
