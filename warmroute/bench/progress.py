"""A progress bar for a timed run (rich, on stderr); a no-op when disabled."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn


class Ticker:
    def __init__(self, label: str, total_s: float, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(), console=Console(stderr=True), transient=True,
        )
        self._task = self._progress.add_task(label, total=total_s, status="")

    def __enter__(self) -> Ticker:
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._progress.stop()

    def update(self, elapsed_s: float, done: int, errors: int) -> None:
        if self.enabled:
            status = f"{done} done" + (f", {errors} errors" if errors else "")
            self._progress.update(self._task, completed=elapsed_s, status=status)
