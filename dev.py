#!/usr/bin/env python3
"""Set up warmroute in ./.venv (first run only) and run the demo or the tests.

    python3 dev.py demo     # a local emulated fleet, three routing strategies side by side
    python3 dev.py test     # the test suite

Needs only Python 3.11+: the virtual environment and every dependency are installed from PyPI.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".warmroute-installed"
BUILD_INPUTS = (ROOT / "pyproject.toml", *sorted((ROOT / "warmroute" / "core").glob("_*.c")))


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
    if subprocess.run([*pip, "-e", f"{ROOT}[test,llama]"]).returncode != 0:
        print("warning: llama-cpp-python could not be built; the llama.cpp tests will be skipped", flush=True)


def main(argv: list[str]) -> int:
    if sys.version_info < (3, 11):
        print("warmroute needs Python 3.11 or newer", file=sys.stderr)
        return 2
    if not argv or argv[0] not in ("demo", "test"):
        print(__doc__.strip())
        return 2
    try:
        _install()
    except subprocess.CalledProcessError as exc:
        print(f"setup failed: {' '.join(map(str, exc.cmd))} exited {exc.returncode}", file=sys.stderr)
        return 1
    if argv[0] == "test":
        _install_llama()
    if argv[0] == "demo":
        cmd = [str(BIN / "warmroute"), "demo", *argv[1:]]
    else:
        cmd = [str(BIN / "python"), "-m", "pytest", *argv[1:]]
    return subprocess.call(cmd, cwd=ROOT)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
