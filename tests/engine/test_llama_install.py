"""How `python3 dev.py test` builds llama-cpp-python (without llama.cpp: the build is faked, its inputs checked)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace
from typing import Any

import dev


def _build(monkeypatch, importable: bool) -> list[tuple[list[str], dict[str, str] | None]]:
    """Run dev._install_llama with subprocess.run recorded: the import probe answers `importable`."""
    calls: list[tuple[list[str], dict[str, str] | None]] = []

    def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess:
        calls.append((cmd, kw.get("env")))
        probe = "-c" in cmd
        return subprocess.CompletedProcess(cmd, 0 if (importable or not probe) else 1)

    monkeypatch.setattr(dev, "subprocess", SimpleNamespace(run=run))  # dev's own name only, not the module
    dev._install_llama()
    return calls


def test_the_build_leaves_out_the_multimodal_library(monkeypatch) -> None:
    monkeypatch.delenv("CMAKE_ARGS", raising=False)
    probe, (cmd, env) = _build(monkeypatch, importable=False)
    assert "-c" in probe[0] and cmd[-2:] == ["-e", f"{dev.ROOT}[test,llama]"]
    assert env is not None and env["CMAKE_ARGS"] == "-DLLAVA_BUILD=OFF"


def test_an_operators_own_cmake_args_are_kept(monkeypatch) -> None:
    monkeypatch.setenv("CMAKE_ARGS", "-DGGML_NATIVE=OFF")
    _, (_, env) = _build(monkeypatch, importable=False)
    assert env is not None and env["CMAKE_ARGS"] == "-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"


def test_nothing_is_built_where_llama_cpp_imports(monkeypatch) -> None:
    assert len(_build(monkeypatch, importable=True)) == 1  # the probe only
