"""Background tasks of the router (health checks, scrapes, discovery, index sharing): stopping them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

log = logging.getLogger("warmroute.router")

STOP_TIMEOUT_S = 5.0  # a task still running this long after its cancel is left behind, so that stopping never hangs


async def cancel_all(tasks: Iterable[asyncio.Task | None], timeout: float = STOP_TIMEOUT_S) -> None:
    """Cancel the tasks, then wait (at most `timeout` seconds) until each has stopped; their cancellation is
    expected, not an error, and a task that failed or would not stop is logged, never raised."""
    running = [t for t in list(tasks) if t is not None]
    for task in running:
        task.cancel()
    if not running:
        return
    done, stuck = await asyncio.wait(running, timeout=timeout)
    for task in stuck:
        log.error("task %s did not stop within %g s of its cancel; left behind", task.get_name(), timeout)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("task %s had failed: %r", task.get_name(), task.exception())
