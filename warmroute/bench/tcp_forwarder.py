"""A plain TCP forwarder, the reference for what any proxy costs: bytes in, bytes out, nothing parsed.

    python -m warmroute.bench.tcp_forwarder LISTEN_PORT=UPSTREAM_PORT [...]

Every connection accepted on 127.0.0.1:LISTEN_PORT is joined to a new connection to 127.0.0.1:UPSTREAM_PORT;
runs on uvloop where installed (as warmroute does) until SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def serve(pairs: list[tuple[int, int]]) -> None:
    async def accept(port: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, up_w), pipe(up_r, client_w))

    servers = [await asyncio.start_server(lambda r, w, p=up: accept(p, r, w), "127.0.0.1", listen)
               for listen, up in pairs]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("forwarding " + ", ".join(f"{a}->{b}" for a, b in pairs), flush=True)
    await stop.wait()
    for server in servers:
        server.close()


def main(argv: list[str]) -> int:
    pairs = [tuple(int(x) for x in arg.split("=")) for arg in argv]
    try:
        import uvloop
        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:
        runner = asyncio.Runner()
    with runner:
        runner.run(serve(pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
