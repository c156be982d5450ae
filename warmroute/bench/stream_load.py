"""Many concurrent streaming clients through one router process, for its memory and its error count under
load: a trivial instance (warmroute.bench.trivial, tokens `itl_ms` apart) and `warmroute serve` in front of
it, each in a process of its own, and closed-loop streaming clients in this one. Also the router's liveness
with its admission queue full (`livez_with_queue`)."""

from __future__ import annotations

import asyncio
import os
import resource
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from warmroute.bench.processes import Child
from warmroute.prometheus_text import read_samples

QUEUE = "warmroute_queue_waiting"  # requests waiting in the router's queue, by priority class and tenant


def raise_fd_limit(want: int = 16384) -> int:
    """Child processes inherit it: 2,000 streams need 4,000 descriptors in the router."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def rss_kib(pid: int) -> int:
    """Resident memory of a process."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


@dataclass
class Stack:
    upstream: Child
    router: Child
    url: str
    logs: tempfile.TemporaryDirectory

    async def close(self) -> None:
        for child in (self.router, self.upstream):
            await asyncio.to_thread(child.stop, 10.0)
        self.logs.cleanup()


async def start_stack(itl_ms: float, *router_args: str, admission: bool = False) -> Stack:
    """The trivial instance and a `least_loaded` router in front of it (admission off unless asked), both on free
    ports."""
    logs = tempfile.TemporaryDirectory(prefix="warmroute-streams-")
    upstream = Child("upstream", ["--count", "1", "--port", "0", "--itl-ms", f"{itl_ms:g}"], Path(logs.name),
                     module="warmroute.bench.trivial")
    router: Child | None = None
    try:
        up_url = await upstream.wait_for_url(timeout_s=30)
        router = Child("router", [
            "serve", "--backend", f"up={up_url}", "--port", "0", "--strategy", "least_loaded",
            "--no-engine-metrics", *(() if admission else ("--no-admission",)),  # (off: the router's own capacity)
            "--shutdown-timeout", "5", *router_args], Path(logs.name))
        return Stack(upstream, router, await router.wait_for_url(timeout_s=30), logs)
    except BaseException:
        for child in (router, upstream):
            if child is not None:
                child.stop()
        logs.cleanup()
        raise


@dataclass
class Tally:
    ok: int = 0
    errors: int = 0
    kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1


async def stream_once(session: aiohttp.ClientSession, url: str, i: int, chunks: int, tally: Tally) -> None:
    """One streamed chat completion of `chunks` tokens, with client i's own prompt; counted ok only if every
    token and the end of the stream arrived."""
    body = {"model": "m", "stream": True, "max_tokens": chunks,
            "messages": [{"role": "system", "content": f"client {i} " * 40}, {"role": "user", "content": "go"}]}
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            data = await r.read()
            if r.status == 200 and data.endswith(b"data: [DONE]\n\n") and data.count(b'"content"') == chunks:
                tally.ok += 1
            else:
                tally.error(f"status_{r.status}" if r.status != 200 else "truncated")
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        tally.error(type(exc).__name__)


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False),
                                 timeout=aiohttp.ClientTimeout(total=300))


async def wave(url: str, clients: int, chunks: int) -> Tally:
    """`clients` concurrent streams, each held as long as its `chunks` tokens take."""
    tally = Tally()
    async with client_session() as s:
        await asyncio.gather(*(stream_once(s, url, i, chunks, tally) for i in range(clients)))
    return tally


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@dataclass
class Liveness:
    waiting: int  # requests waiting in the router's queue when /livez was probed
    livez_ms: list[float]  # each probe's time
    router_cores: float  # the router process's CPU over the probes, in cores


async def livez_with_queue(stack: Stack, waiting: int, probes: int = 40) -> Liveness:
    """With a router started `--engine-capacity 1` in front of an instance whose streams never end: one request
    takes the engine's slot, `waiting` more wait in the router's queue, nothing completes; then /livez is probed
    `probes` times, one after another, and the router's CPU read over that window."""
    body = {"model": "m", "max_tokens": 1000, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with client_session() as http:
        async def post(i: int) -> None:
            try:
                async with http.post(stack.url + "/v1/chat/completions", json={**body, "user": f"u{i}"}) as r:
                    await r.read()
            except aiohttp.ClientError:
                pass

        tasks = [asyncio.create_task(post(i)) for i in range(waiting + 1)]
        try:
            seen, deadline = 0, asyncio.get_running_loop().time() + 120
            while seen < waiting and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.5)
                async with http.get(stack.url + "/metrics") as r:
                    seen = int(sum(v for _, v in read_samples(await r.text(), (QUEUE,)).get(QUEUE, [])))
            cpu0, t0, took = _cpu_seconds(stack.router.pid), time.monotonic(), []
            for _ in range(probes):
                start = time.perf_counter()
                async with http.get(stack.url + "/livez") as r:
                    await r.read()
                took.append((time.perf_counter() - start) * 1000)
                await asyncio.sleep(0.05)
            cores = (_cpu_seconds(stack.router.pid) - cpu0) / (time.monotonic() - t0)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return Liveness(seen, took, cores)
