"""What a benchmark run writes beside its numbers: the command that produced them, the code and machine they
were measured on, and its outputs (JSON with everything measured, a Markdown fragment to paste into docs)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository a benchmark runs from
OUT = ROOT / "out"  # git-ignored


def log(msg: str) -> None:
    """Progress on stderr, so stdout holds only the results."""
    print(msg, file=sys.stderr, flush=True)


def command_line(script: str, argv: list[str]) -> str:
    """How to run `script` (a path under the repository) again with `argv`, as the docs show it."""
    path = Path(script).resolve()
    shown = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    return shlex.join([".venv/bin/python", shown, *argv])


def tree_state() -> str:
    """The commit measured, and the source files that differed from it (uncommitted work is measured too)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "warmroute"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=10).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    files = sorted(line[3:] for line in changed if line.strip())
    return f"commit {head or 'unknown'}" + (f" plus uncommitted changes to {', '.join(files)}" if files else "")


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def machine() -> str:
    return f"{os.cpu_count()} CPU cores ({platform.machine()}), shared with other work"


def write_outputs(json_path: Path, data: Any, markdown: str | None = None) -> list[Path]:
    """`data` as JSON at `json_path` and `markdown` beside it (same name, .md); the paths written. The docs
    are edited by hand from the fragment: a benchmark never rewrites them."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    written = [json_path]
    if markdown is not None:
        md = json_path.with_suffix(".md")
        md.write_text(markdown if markdown.endswith("\n") else markdown + "\n")
        written.append(md)
    log("wrote " + " and ".join(str(p) for p in written))
    return written
