"""The admission queue's settings have one name each (core/admission/settings.py AdmissionConfig): the same in the
router's YAML (`admission:`), its flags and variables, the simulator's flags and SimSettings, and the queue's
AdmissionSettings; the former flat names (queue_timeout, ...) still work."""

from __future__ import annotations

import argparse

import pytest

from warmroute.core.admission import AdmissionConfig, AdmissionSettings, admission_settings
from warmroute.core.strategies import StrategySettings, settings_for
from warmroute.router.settings_cli import add_setting_arguments, cli_values
from warmroute.router.settings_load import load_settings
from warmroute.sim import cli as sim_cli
from warmroute.sim.simulator import SimSettings
from warmroute.workloads.registry import make_workload

URL = "http://127.0.0.1:9"
# Each knob: the value as a flag, variable or YAML gives it, and what the queue then holds (none a default).
KNOBS = {
    "enabled": ("false", False),
    "max_requests": ("17", 17),
    "max_bytes": ("2MiB", 2 * 2**20),
    "timeout_s": ("12.5", 12.5),
    "spill_headroom": ("0.25", 0.25),
    "lifo_after_s": ("3", 3.0),
    "aging_tokens_per_s": ("100", 100.0),
    "engine_queue_share": ("0.5", 0.5),
    "fair_slack": ("7", 7.0),
    "fair_lend": ("2", 2.0),
    "tenant_weights": ("a=2,b=0.5", {"a": 2.0, "b": 0.5}),
    "tenant_queue_share": ("1.5", 1.5),
    "tenant_pending": ("3", 3),
    "prefill_budget": ("4096", 4096),
    "shared_prefill_wait_s": ("2.5", 2.5),
}
FORMER = {"queue_timeout": "timeout_s", "queue_max_requests": "max_requests", "queue_max_bytes": "max_bytes",
          "queue_lifo_after": "lifo_after_s", "queue_aging": "aging_tokens_per_s", "admission": "enabled"}


def test_every_knob_is_covered():
    assert set(KNOBS) == set(AdmissionConfig.model_fields)
    for name, (_, value) in KNOBS.items():
        assert getattr(AdmissionSettings(), name) != value, name  # not the default: a lost setting would show


def _flat(name: str) -> str:
    return "admission" if name == "enabled" else name


def _queue(settings) -> AdmissionSettings:
    """What the router's queue is built with (router/routing.py)."""
    return admission_settings(settings_for(settings.strategy, settings, settings.strategies))


def _serve_flags(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_setting_arguments(parser)
    return cli_values(parser.parse_args(list(argv)))


def _simulate(*argv: str) -> SimSettings:
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    return sim_cli.settings_from_args(parser.parse_args(["--workload", "mixed", *argv]), make_workload("mixed"))


@pytest.mark.parametrize("name", list(KNOBS))
def test_one_name_everywhere(name, tmp_path):
    text, value = KNOBS[name]
    flag = "--no-admission" if name == "enabled" else f"--{_flat(name).replace('_', '-')}"
    argv = [flag] if name == "enabled" else [flag, text]
    config = tmp_path / "warmroute.yaml"
    config.write_text(f"backends: [{URL}]\nadmission:\n  {name}: {text}\n")
    ways = {
        "yaml": load_settings(None, config, env={}),
        "yaml, flat": load_settings({"backends": [URL], _flat(name): text}, None, env={}),
        "flag": load_settings({"backends": [URL], **_serve_flags(*argv)}, None, env={}),
        "env": load_settings({"backends": [URL]}, None, env={f"WARMROUTE_{_flat(name).upper()}": text}),
    }
    for way, settings in ways.items():
        assert getattr(settings.admission, name) == value, way
        assert getattr(_queue(settings), name) == value, way
    sims = {"simulate flag": _simulate(*argv),
            "SimSettings": SimSettings(routing=StrategySettings(admission={name: text})),
            "SimSettings, flat": SimSettings(routing=StrategySettings(**{_flat(name): text})),
            "changed": SimSettings().changed(_flat(name), text)}
    for way, sim in sims.items():
        assert getattr(sim.admission, name) == value, way
        assert getattr(sim.admission_settings(), name) == value, way


@pytest.mark.parametrize("old", list(FORMER))
def test_former_names_still_work(old, tmp_path):
    name = FORMER[old]
    text, value = KNOBS[name]
    config = tmp_path / "warmroute.yaml"
    config.write_text(f"backends: [{URL}]\n{old}: {text}\n")
    argv = ["--no-admission"] if old == "admission" else [f"--{old.replace('_', '-')}", text]
    ways = {"yaml": load_settings(None, config, env={}),
            "flag": load_settings({"backends": [URL], **_serve_flags(*argv)}, None, env={}),
            "env": load_settings({"backends": [URL]}, None, env={f"WARMROUTE_{old.upper()}": text}),
            "simulate flag": _simulate(*argv).routing}
    for way, settings in ways.items():
        assert getattr(settings.admission, name) == value, way
        assert getattr(admission_settings(settings.strategy_settings()), name) == value, way


def test_layers_and_errors(tmp_path):
    config = tmp_path / "warmroute.yaml"
    config.write_text(f"backends: [{URL}]\nadmission: {{timeout_s: 30, fair_lend: 2}}\nqueue_max_requests: 9\n")
    s = load_settings({"fair_slack": "5"}, config, env={"WARMROUTE_QUEUE_TIMEOUT": "20"})
    assert (s.admission.timeout_s, s.admission.fair_lend, s.admission.max_requests, s.admission.fair_slack) == \
        (20.0, 2.0, 9, 5.0)  # env over the file, setting by setting inside `admission:`
    assert s.admission.enabled and s.cache_aware.hold_timeout == 5.0  # the hold's knobs stay cache_aware's
    from warmroute.errors import UsageError
    with pytest.raises(UsageError, match=r"invalid setting fair_lend = '-1' \(--fair-lend, WARMROUTE_FAIR_LEND\)"):
        load_settings({"backends": [URL], "fair_lend": "-1"}, None, env={})
    with pytest.raises(UsageError, match="unknown setting admission.nope"):
        load_settings({"backends": [URL], "admission": {"nope": 1}}, None, env={})
