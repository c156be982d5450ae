"""A round-robin front for several router replicas: each request goes to the next upstream in turn, the
answer is streamed back chunk by chunk (what a plain load balancer in front of replicas does).

    python -m warmroute.bench.front --port 9100 http://127.0.0.1:9001 http://127.0.0.1:9002
"""

from __future__ import annotations

import argparse
import itertools

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}


def front_app(upstreams: list[str]) -> web.Application:
    """Each request to the next upstream in turn; the answer streamed back chunk by chunk."""
    turn = itertools.cycle(upstreams)

    async def on_start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                               timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False)

    async def on_stop(app: web.Application) -> None:
        await app["session"].close()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        async with request.app["session"].request(request.method, next(turn) + request.path_qs, data=body or None,
                                                  headers=headers) as up:
            resp = web.StreamResponse(status=up.status, headers={k: v for k, v in up.headers.items()
                                                                 if k.lower() not in HOP_BY_HOP})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(on_start)
    app.on_cleanup.append(on_stop)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def run_front(port: int, upstreams: list[str]) -> None:
    print(f"front listening on 127.0.0.1:{port}", flush=True)
    web.run_app(front_app(upstreams), host="127.0.0.1", port=port, access_log=None, print=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("upstreams", nargs="+", help="base URLs, taken in turn")
    args = p.parse_args(argv)
    run_front(args.port, args.upstreams)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
