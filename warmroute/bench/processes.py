"""Child processes the demo and the benchmarks start (engines, routers, peers, helpers): start, wait until
ready, always stop.

Each child runs in its own session (so a Ctrl-C reaches only the parent, which then stops them in order), its
output going to a log file whose last line is shown if it fails to start. Readiness is one of: a line in the
log (`wait_for_log`, `wait_for_url`), GET /health answering 200 (`wait_for_http`), or a served completion
(`wait_for_model`).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from warmroute.errors import UsageError


_LISTENING = re.compile(r"listening on (https?://\S+)")


class Child:
    def __init__(self, name: str, args: list[str], log_dir: Path, module: str = "warmroute",
                 python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        """Run `PYTHON -m MODULE ARGS` in its own session, output to NAME.log in log_dir; `env` is added to
        this process's environment."""
        self._start(name, [python, "-m", module, *args], log_dir, env)

    @classmethod
    def command(cls, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None) -> Child:
        """Any command line (a peer router's binary, redis-server), not only `python -m MODULE`."""
        child = cls.__new__(cls)
        child._start(name, argv, log_dir, env)
        return child

    def _start(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None) -> None:
        self.name = name
        self.log = log_dir / f"{name}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, env={**os.environ, **(env or {})})

    @property
    def pid(self) -> int:
        return self.proc.pid

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM to the child's whole session (engines have worker processes of their own), SIGKILL to what is
        left after `grace_s`."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.signal_group(signal.SIGKILL)  # also any grandchild the child left behind
        self.proc.wait()

    async def exited(self, timeout_s: float) -> int:
        """The child's exit status once it has ended (subprocess.TimeoutExpired after `timeout_s`)."""
        return await asyncio.to_thread(self.proc.wait, timeout_s)

    def signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # its own session: the group id is its pid
        except (ProcessLookupError, PermissionError):
            pass

    def log_text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def failure(self, what: str) -> UsageError:
        lines = [ln for ln in self.log_text().splitlines() if ln.strip()]
        return UsageError(f"{self.name} {what}" + (f": {lines[-1].strip()}" if lines else ""))

    def check_alive(self, deadline: float, timeout_s: float, what: str = "ready") -> None:
        """UsageError naming the log's last line if the child has exited or `deadline` has passed."""
        if self.proc.poll() is not None:
            raise self.failure(f"exited with status {self.proc.returncode}")
        if time.monotonic() > deadline:
            raise self.failure(f"not {what} after {timeout_s:.0f} s")

    async def wait_for_log(self, needle: str, count: int, timeout_s: float) -> None:
        """Until `needle` appears `count` times in the output (e.g. one "listening" line per instance)."""
        deadline = time.monotonic() + timeout_s
        while self.log_text().count(needle) < count:
            self.check_alive(deadline, timeout_s)
            await asyncio.sleep(0.05)

    async def wait_for_url(self, timeout_s: float) -> str:
        """The URL of the first "listening on http://..." line in the output (a child started on port 0)."""
        deadline = time.monotonic() + timeout_s
        while (found := _LISTENING.search(self.log_text())) is None:
            self.check_alive(deadline, timeout_s)
            await asyncio.sleep(0.05)
        return found.group(1)

    async def wait_for_http(self, url: str, timeout_s: float) -> None:
        """Until GET url answers 200."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while not await _answers_200(session, url):
                self.check_alive(deadline, timeout_s, "healthy")
                await asyncio.sleep(0.05)

    async def wait_for_model(self, target: str, timeout_s: float = 60.0) -> str:
        """Until the server at `target` lists a model and serves a one-token completion with it (a router is
        ready only once its instances are); returns the model's name."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as session:
            while (model := await _serving_model(session, target)) is None:
                self.check_alive(deadline, timeout_s)
                await asyncio.sleep(0.2)
        return model


async def _answers_200(session: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def _serving_model(session: aiohttp.ClientSession, target: str) -> str | None:
    """The first model `target` lists, if a one-token completion with it succeeds."""
    timeout = aiohttp.ClientTimeout(total=5)
    try:
        async with session.get(target + "/v1/models", timeout=timeout) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else None
        models = data.get("data") if isinstance(data, dict) else None
        if not models:
            return None
        model = models[0].get("id")
        probe = {"model": model, "prompt": "ready?", "max_tokens": 1}
        async with session.post(target + "/v1/completions", json=probe, timeout=timeout) as resp:
            await resp.read()
            return model if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


# Ports handed out below the kernel's ephemeral range: a port picked there can be taken, between our check and
# the child's bind, by any outgoing connection on the machine (a CI run lost a router start to that).
_LOWEST_PORT = 10000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_ports(count: int, start: int | None = None) -> int:
    """The first port p >= start with p .. p+count-1 all free on 127.0.0.1 (racy, but fine for a demo).
    The default start depends on the process id, so demos running side by side rarely collide; ports are
    looked for below the ephemeral range first, where outgoing connections do not take them."""
    ceiling = _ephemeral_floor()
    if start is None:
        slots = max(1, (ceiling - _LOWEST_PORT) // 10 - 100)
        start = _LOWEST_PORT + (os.getpid() % slots) * 10
    for low, high in ((start, ceiling), (max(start, ceiling), 65536)):
        port = low
        while port + count <= high:
            if all(_free(p) for p in range(port, port + count)):
                return port
            port += count
    raise UsageError("no free local ports")


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (32768 where it cannot be read)."""
    try:
        return max(_LOWEST_PORT + 2000, int(_EPHEMERAL_RANGE.read_text().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
