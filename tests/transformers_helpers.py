"""An interpreter that has `transformers` (vLLM's virtual environment has it: vLLM depends on it), for tests that
check the router against what transformers itself writes and computes; the test is skipped, saying why, where
there is none."""

from __future__ import annotations

import subprocess

import pytest

from warmroute.realengine.vllm_fleet import candidate_pythons


def transformers_python() -> str:
    for python in candidate_pythons():
        if python.exists() and subprocess.run([str(python), "-c", "import transformers"],
                                              capture_output=True, timeout=120).returncode == 0:
            return str(python)
    pytest.skip("no interpreter with transformers (python3 dev.py vllm installs one in .venv-vllm)")
