"""Deployment files (deploy/, .dockerignore) checked against the code they deploy.

Nothing here needs a network, Docker or a cluster. What each test guards:
  - the Dockerfile: multi-stage slim build, non-root user, EXPOSE = the settings' default port, an entrypoint
    that is a real console script and subcommand, a HEALTHCHECK that really tells a healthy router (exit 0)
    from one with no healthy backend (exit 1), a build context (.dockerignore) that holds what COPY needs;
  - the Kubernetes manifests: they parse, the ConfigMap's file validates as RouterSettings (with the image's
    and the container's WARMROUTE_* variables on top, as the router will see them), probes hit real routes
    on the real port, ports/labels/volumes agree across objects, the grace period covers shutdown_timeout,
    the memory limit covers the index cap;
  - the systemd unit: restart policy, stop timeout above shutdown_timeout, the example config validates;
  - the Grafana dashboard: every metric, label and label value in its queries exists in the router's
    registry (built the way the app builds it), rate() only over counters and histograms.
"""

from __future__ import annotations

import asyncio
import configparser
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from fake_upstream import Upstream
from warmroute.cli import SUBCOMMANDS
from warmroute.core.feedback import VERDICTS
from warmroute.core.strategies import REASONS
from warmroute.errors import UsageError
from warmroute.router.app import METRICS, build_app
from warmroute.router.settings import MiB, RouterSettings
from warmroute.router.settings_load import load_settings, read_config_file

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
K8S = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
DASHBOARD = DEPLOY / "grafana" / "warmroute-dashboard.json"
DEFAULT_PORT = RouterSettings.model_fields["port"].default
SHUTDOWN_DEFAULT = RouterSettings.model_fields["shutdown_timeout"].default


# -- helpers ------------------------------------------------------------------------------------------------
def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments and parser directives dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def dockerfile_env() -> dict[str, str]:
    """The final stage's ENV (KEY=VALUE pairs, the form the Dockerfile uses)."""
    instructions = dockerfile_instructions()
    last_from = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    env: dict[str, str] = {}
    for word, args in instructions[last_from:]:
        if word == "ENV":
            for item in shlex.split(args):
                key, sep, value = item.partition("=")
                assert sep, f"ENV {args!r}: use KEY=VALUE"
                env[key] = value
    return env


def healthcheck_argv() -> list[str]:
    args = dict(dockerfile_instructions())["HEALTHCHECK"]
    _, sep, cmd = args.partition("CMD ")
    assert sep, "HEALTHCHECK needs a CMD"
    argv = json.loads(cmd)  # exec form: no shell needed in the image
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def k8s_docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]


def k8s_objects() -> dict[str, dict]:
    """kind -> the one object of that kind in deploy/kubernetes (the tests assume one each)."""
    objects: dict[str, dict] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in k8s_docs(path.name):
            assert doc["kind"] not in objects, f"two {doc['kind']} objects"
            objects[doc["kind"]] = doc
    return objects


def router_container(deployment: dict) -> dict:
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "warmroute"]
    return container


def configmap_file() -> tuple[str, str]:
    """(key, text) of the settings file in the ConfigMap."""
    data = k8s_objects()["ConfigMap"]["data"]
    (key,) = [k for k in data if k.endswith((".yaml", ".yml"))]
    return key, data[key]


def k8s_effective_settings(tmp_path: Path) -> RouterSettings:
    """What the router in the pod ends up with: the mounted file, under the image's and the pod's variables."""
    key, text = configmap_file()
    path = tmp_path / key
    path.write_text(text)
    container = router_container(k8s_objects()["Deployment"])
    env = {k: v for k, v in dockerfile_env().items() if k.startswith("WARMROUTE_")}
    env.update({e["name"]: str(e["value"]) for e in container.get("env", []) if e["name"].startswith("WARMROUTE_")})
    args = container.get("args", [])
    assert args[:1] == ["--config"], "the container should pass --config FILE to `warmroute serve`"
    return load_settings({}, path, env=env)


def get_routes() -> set[str]:
    """Paths the router answers GET on itself (the catch-all proxy route excluded)."""
    app = build_app(load_settings({"backends": ["http://127.0.0.1:9"]}, env={}))
    return {r.resource.canonical for r in app.router.routes()
            if r.method == "GET" and "{" not in r.resource.canonical}


def container_port(container: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    (number,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return number


def quantity_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(q))
    assert m, f"cannot read quantity {q!r}"
    return int(m.group(1)) * units.get(m.group(2) or "", 1)


# -- Dockerfile ---------------------------------------------------------------------------------------------
def test_dockerfile_is_multi_stage_slim_and_non_root():
    instructions = dockerfile_instructions()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for w, a in instructions if w == "ARG" and "=" in a}
    bases = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], a.split()[0]) for w, a in instructions if w == "FROM"]
    assert len(bases) >= 2, "build the wheels in one stage, run from another"
    assert bases[-1].startswith("python:3.11-slim")
    last_from = max(i for i, (w, _) in enumerate(instructions) if w == "FROM")
    users = [a for w, a in instructions[last_from:] if w == "USER"]
    assert users, "the runtime stage must set USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "a numeric non-root uid (runAsNonRoot can check it)"
    # The final stage installs nothing with a compiler and copies only the built environment.
    final = instructions[last_from + 1:]
    assert not [a for w, a in final if w == "COPY" and "--from=" not in a], "runtime stage copies only from build"


def test_dockerfile_port_entrypoint_and_env_match_the_code():
    instructions = dockerfile_instructions()
    exposed = [a for w, a in instructions if w == "EXPOSE"]
    assert exposed == [str(DEFAULT_PORT)], f"EXPOSE should be the default port {DEFAULT_PORT}"
    env = dockerfile_env()
    assert env.get("WARMROUTE_PORT", str(DEFAULT_PORT)) == str(DEFAULT_PORT)
    assert env.get("WARMROUTE_HOST") in ("0.0.0.0", "::"), "the default 127.0.0.1 is unreachable in a container"
    # The image's own environment must be valid settings (with a backend added, as every user must).
    settings = load_settings({"backends": ["http://10.0.0.5:8000"]}, env=env)
    assert settings.port == DEFAULT_PORT

    entry = json.loads(dict(instructions)["ENTRYPOINT"])
    assert entry == ["warmroute", "serve"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry[0] in scripts and entry[1] in SUBCOMMANDS
    assert dict(instructions).get("STOPSIGNAL", "SIGTERM") == "SIGTERM", "the router drains on SIGTERM"


def test_dockerfile_healthcheck_calls_health():
    argv = healthcheck_argv()
    assert argv[0] == "python" and argv[1] == "-c"
    assert "/health" in argv[2] and "/health" in get_routes()
    assert "WARMROUTE_PORT" in argv[2], "the check must follow the port setting"


def test_build_context_holds_what_the_dockerfile_copies():
    """.dockerignore is an allowlist: every COPY source (and the readme pyproject names) must be let in."""
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()]
    rules = [ln for ln in lines if ln and not ln.startswith("#")]
    assert rules[0] == "*", "expected an allowlist .dockerignore"
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    sources: list[str] = []
    for word, args in dockerfile_instructions():
        if word == "COPY" and "--from=" not in args:
            parts = [p for p in args.split() if not p.startswith("--")]
            sources += parts[:-1]
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    assert readme in sources, "setuptools needs the readme named in pyproject.toml to build the wheel"
    for src in sources:
        assert src.rstrip("/") in allowed, f"COPY {src}: excluded by .dockerignore"
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


async def _start_router(backend_url: str):
    from warmroute.router.server import start_router

    settings = load_settings({"backends": [f"a={backend_url}"], "port": 0, "engine_metrics": False,
                              "health_interval": 60}, env={})
    return await start_router(settings)


async def _healthcheck(port: int) -> int:
    argv = healthcheck_argv()
    proc = await asyncio.create_subprocess_exec(sys.executable, *argv[1:], env={"WARMROUTE_PORT": str(port)},
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(proc.wait(), 20)


async def test_healthcheck_command_tells_healthy_from_no_healthy_backend():
    upstream = await Upstream("ok").start()
    healthy = await _start_router(upstream.url)
    with socket.socket() as s:  # a port nobody listens on: the first health round ejects the backend
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    unhealthy = await _start_router(f"http://127.0.0.1:{dead_port}")
    try:
        assert await _healthcheck(healthy.port) == 0
        assert await _healthcheck(unhealthy.port) != 0
    finally:
        await healthy.stop()
        await unhealthy.stop()
        await upstream.stop()


# -- Kubernetes ---------------------------------------------------------------------------------------------
def test_every_manifest_parses_and_names_its_kind():
    paths = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert paths
    for path in paths:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        if path.parent == K8S:
            for doc in docs:
                assert doc.get("apiVersion") and doc.get("kind"), path
                if doc["kind"] != "Kustomization":
                    assert doc["metadata"]["name"], path


def test_rbac_allows_exactly_what_kubernetes_discovery_reads_and_the_deletion_costs_patch():
    objects = k8s_objects()
    assert objects["Role"]["rules"] == [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]  # router/kubernetes.py PodDeletionCost
    binding = objects["RoleBinding"]
    assert binding["roleRef"]["name"] == objects["Role"]["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": objects["ServiceAccount"]["metadata"]["name"]}]


def test_kustomization_lists_the_manifests():
    kust = k8s_docs("kustomization.yaml")[0]
    listed = set(kust["resources"])
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    optional = {"servicemonitor.yaml",  # needs the Prometheus Operator's CRDs: applied on its own
                "rbac.yaml"}  # only for Kubernetes discovery (kubernetes_service)
    assert listed == on_disk - optional
    container = router_container(k8s_objects()["Deployment"])
    assert container["image"].split(":")[0] in {i["name"] for i in kust.get("images", [])}


def test_kustomization_renders_the_four_objects():
    """What `kubectl kustomize` renders (that check needed kubectl, which CI does not have): the resources
    listed are exactly one ConfigMap, Deployment, PodDisruptionBudget and Service."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    kinds = sorted(d["kind"] for name in kust["resources"] for d in yaml.safe_load_all((K8S / name).read_text())
                   if d)
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]


def test_configmap_settings_are_valid_router_settings(tmp_path):
    key, text = configmap_file()
    path = tmp_path / key
    path.write_text(text)
    values = read_config_file(path)  # unknown keys raise UsageError
    # host and port in the file would be silently overridden by the container's WARMROUTE_* variables.
    assert "host" not in values and "port" not in values
    settings = k8s_effective_settings(tmp_path)
    assert len(settings.backends) >= 2
    assert settings.host in ("0.0.0.0", "::")
    # A key the router does not know must fail, not be ignored.
    (tmp_path / "bad.yaml").write_text(text + "\nprefix_lenght: 4096\n")
    with pytest.raises(UsageError):
        read_config_file(tmp_path / "bad.yaml")


def test_deployment_probes_hit_real_routes_on_the_listening_port(tmp_path):
    settings = k8s_effective_settings(tmp_path)
    deployment = k8s_objects()["Deployment"]
    container = router_container(deployment)
    routes = get_routes()
    assert [p["containerPort"] for p in container["ports"]] == [settings.port]
    probes = {name: container[name] for name in ("readinessProbe", "livenessProbe")}
    for name, probe in probes.items():
        get = probe["httpGet"]
        assert get["path"] in routes, f"{name} path {get['path']} is not a route of the router"
        assert container_port(container, get["port"]) == settings.port, name
    assert probes["readinessProbe"]["httpGet"]["path"] == "/health"
    # Liveness must not depend on the engines (/health and /ping answer 503 when none is healthy).
    assert probes["livenessProbe"]["httpGet"]["path"] == "/livez"


def test_deployment_replicas_security_and_shutdown(tmp_path):
    settings = k8s_effective_settings(tmp_path)
    deployment = k8s_objects()["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = router_container(deployment)
    assert deployment["spec"]["replicas"] >= 2
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()

    sc = container["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    image_uid = next(a for w, a in reversed(dockerfile_instructions()) if w == "USER").split(":")[0]
    assert str(pod["securityContext"]["runAsUser"]) == image_uid

    # SIGTERM comes after preStop; in-flight requests then get shutdown_timeout; the kubelet kills after grace.
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    sleep = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    assert pod["terminationGracePeriodSeconds"] > sleep + settings.shutdown_timeout

    memory = quantity_bytes(container["resources"]["limits"]["memory"])
    assert memory >= settings.workers * settings.index_memory_bytes + 256 * MiB, "room above the index cap"


def test_config_volume_is_where_args_point():
    objects = k8s_objects()
    container = router_container(objects["Deployment"])
    config_path = Path(container["args"][container["args"].index("--config") + 1])
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in objects["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    (name,) = [n for n, m in mounts.items() if Path(m["mountPath"]) == config_path.parent]
    assert volumes[name]["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    assert config_path.name == configmap_file()[0]
    assert mounts[name].get("readOnly") is True
    assert "/tmp" in {m["mountPath"] for m in mounts.values()}, "a writable /tmp beside the read-only root"


def test_service_pdb_and_servicemonitor_select_the_router():
    objects = k8s_objects()
    container = router_container(objects["Deployment"])
    pod_labels = objects["Deployment"]["spec"]["template"]["metadata"]["labels"]
    service = objects["Service"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port_names = {p["name"] for p in container["ports"]}
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in port_names or port["targetPort"] in {p["containerPort"] for p in container["ports"]}
    assert objects["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()

    monitor = objects["ServiceMonitor"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports
        assert endpoint["path"] == "/metrics" and "/metrics" in get_routes()
        # The engine is the router's `backend` label; `instance` stays the target's, so no honorLabels.
        assert not endpoint.get("honorLabels", False)


# -- systemd ------------------------------------------------------------------------------------------------
def systemd_unit() -> configparser.ConfigParser:
    unit = configparser.ConfigParser(interpolation=None, strict=True)
    unit.optionxform = str  # keys are case-sensitive
    unit.read_string((SYSTEMD / "warmroute.service").read_text())
    return unit


def seconds(value: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min|m)?", value.strip())
    assert m, f"cannot read duration {value!r}"
    return float(m.group(1)) * (60 if m.group(2) in ("min", "m") else 1)


def env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def test_systemd_unit_restarts_and_stops_gracefully():
    service = systemd_unit()["Service"]
    assert service["Restart"] == "on-failure"
    assert service.get("DynamicUser") == "yes" or service.get("User") not in (None, "root", "0")
    assert service.get("KillSignal", "SIGTERM") == "SIGTERM"
    assert service["RestartPreventExitStatus"] == "2"  # a UsageError: restarting would not fix it
    assert "EnvironmentFile" in service
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).is_absolute() and Path(argv[0]).name == "warmroute" and argv[1] == "serve"
    config = Path(argv[argv.index("--config") + 1])
    settings = load_settings({}, SYSTEMD / config.name, env=env_file(SYSTEMD / "warmroute.env"))
    assert seconds(service["TimeoutStopSec"]) > settings.shutdown_timeout
    assert seconds(service["TimeoutStopSec"]) > SHUTDOWN_DEFAULT


def test_an_invalid_setting_exits_2(monkeypatch):
    from warmroute.cli import main

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() rewrites sys.argv
    assert main(["serve", "--backend", "http://127.0.0.1:9", "--prefix-length", "1"]) == 2


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verifies_the_unit(tmp_path):
    text = (SYSTEMD / "warmroute.service").read_text()
    exe = shutil.which("warmroute") or str(Path(sys.executable).parent / "warmroute")
    if not Path(exe).exists():
        pytest.skip("no warmroute executable to point ExecStart at")
    unit = tmp_path / "warmroute.service"
    unit.write_text(text.replace("/opt/warmroute/bin/warmroute", exe))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [ln for ln in (out.stdout + out.stderr).splitlines() if str(unit) in ln or "warmroute" in ln]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


# -- Grafana ------------------------------------------------------------------------------------------------
TARGET_LABELS = {"job", "pod", "namespace"}  # added by Prometheus / the Prometheus Operator
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def router_series() -> dict[str, tuple[str, set[str]]]:
    """Series name -> (family type, label names), from the registry of a router built like `warmroute serve`."""
    from prometheus_client.metrics import MetricWrapperBase

    app = build_app(load_settings({"backends": ["a=http://127.0.0.1:9", "b=http://127.0.0.1:10"]}, env={}))
    metrics = app[METRICS]
    labels = {m._name: set(m._labelnames) for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)}
    series: dict[str, tuple[str, set[str]]] = {}
    for family in metrics.registry.collect():
        names = labels.get(family.name)
        if names is None:  # a family registered some other way: its samples tell its labels
            names = {k for s in family.samples for k in s.labels} - {"le"}
        for suffix in SUFFIXES[family.type]:
            series[family.name + suffix] = (family.type, names | ({"le"} if suffix == "_bucket" else set()))
    return series


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(board: dict) -> list[dict]:
    out = []
    for panel in board["panels"]:
        out.append(panel)
        out += panel.get("panels", [])
    return out


def expressions(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every query."""
    return [(p["title"], t["expr"], t.get("legendFormat", "")) for p in all_panels(board) for t in p.get("targets", [])]


def check_promql(expr: str, series: dict[str, tuple[str, set[str]]]) -> list[str]:
    """Problems in one expression: unknown series, labels, reason/verdict values; rate() over a gauge."""
    problems = []
    strings = re.compile(r'"(?:[^"\\]|\\.)*"')
    used: list[str] = []
    for name, body in re.findall(r"([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr):
        used.append(name)
        if name not in series:
            problems.append(f"unknown series {name}")
            continue
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"([^"]*)"', body):
            if label not in series[name][1] | TARGET_LABELS:
                problems.append(f"{name} has no label {label}")
            if label == "reason" and op == "=" and value not in REASONS:
                problems.append(f"reason {value!r} is not one of {REASONS}")
            if label == "verdict" and op == "=" and value not in VERDICTS:
                problems.append(f"verdict {value!r} is not one of {VERDICTS}")
    bare = strings.sub('""', expr)
    bare = re.sub(r"\{[^}]*\}", " ", bare)
    bare = re.sub(r"\[[^\]]*\]", " ", bare)
    groupings = re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    for ident in re.findall(r"\b([A-Za-z_:][\w:]*)\b(?!\s*\()", bare):
        if ident.lower() in PROMQL_WORDS:
            continue
        used.append(ident)
        if ident not in series:
            problems.append(f"unknown series {ident}")
    known_labels = set().union(*(series[n][1] for n in used if n in series)) | TARGET_LABELS
    for group in groupings:
        for label in filter(None, (g.strip() for g in group.split(","))):
            if label not in known_labels:
                problems.append(f"grouping by {label}, which none of {sorted(set(used))} has")
    for name in re.findall(r"\b(?:rate|irate|increase)\s*\(\s*([A-Za-z_:][\w:]*)", expr):
        if name in series and series[name][0] == "gauge":
            problems.append(f"rate() over the gauge {name}")
    if "histogram_quantile" in expr:
        if not re.search(r"by\s*\([^)]*\ble\b[^)]*\)", expr) or "_bucket" not in expr:
            problems.append("histogram_quantile needs _bucket series summed by le")
    return problems


def test_dashboard_queries_use_only_real_metrics_and_labels():
    series = router_series()
    board = dashboard()
    exprs = expressions(board)
    assert len(exprs) >= 20
    problems = []
    for title, expr, legend in exprs:
        problems += [f"{title}: {p}" for p in check_promql(expr, series)]
        names = set(re.findall(r"[A-Za-z_:][\w:]*(?=\s*\{)", expr)) | set(re.findall(r"\bwarmroute_\w+", expr))
        labels = set().union(*(series.get(n, ("", set()))[1] for n in names)) | TARGET_LABELS | {"instance"}
        for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", legend):
            if label not in labels:
                problems.append(f"{title}: legend uses {label}, which the series lack")
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+)(?:\{[^}]*\})?,\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            if m.group(1) not in series:
                problems.append(f"variable {var['name']}: unknown series {m.group(1)}")
            elif m.group(2) not in series[m.group(1)][1] | TARGET_LABELS:
                problems.append(f"variable {var['name']}: {m.group(1)} has no label {m.group(2)}")
    assert not problems, "\n".join(problems)


def test_the_promql_checker_catches_mistakes():
    series = router_series()
    assert check_promql('sum by (reason) (rate(warmroute_decisions_total{job=~"$job"}[5m]))', series) == []
    assert check_promql("rate(warmroute_decisions[5m])", series)  # counters are exposed with _total
    assert check_promql('warmroute_requests_total{reason="x"}', series)  # wrong label
    assert check_promql('warmroute_decisions_total{reason="spill"}', series)  # not a reason
    assert check_promql("sum by (status) (warmroute_inflight)", series)  # grouping by a missing label
    assert check_promql("rate(warmroute_inflight[5m])", series)  # rate over a gauge
    assert check_promql("histogram_quantile(0.5, rate(warmroute_decision_seconds_bucket[5m]))", series)


def test_dashboard_covers_the_operational_questions():
    used = " ".join(expr for _, expr, _ in expressions(dashboard()))
    for needle in ["warmroute_matched_prefix_ratio_sum", "warmroute_engine_cached_tokens_total",
                   "warmroute_time_to_first_byte_seconds_bucket", "warmroute_decisions_total",
                   'reason="overload_spill"', "warmroute_inflight", "warmroute_requests_total",
                   "warmroute_index_bytes", "warmroute_instance_healthy"]:
        assert needle in used, f"the dashboard has no panel on {needle}"


def test_dashboard_datasource_is_a_variable_and_layout_is_sane():
    board = dashboard()
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = all_panels(board)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in panels:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}", p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']} overlaps another panel"
        cells |= mine


def test_dashboard_queries_parse_as_promql():
    import promql_parser as promql  # in the test extra: this check runs wherever the suite does
    for title, expr, _ in expressions(dashboard()):
        promql.parse(expr.replace("$__rate_interval", "5m"))  # raises on a syntax error


# -- Autoscaling on the demand signal (deploy/kubernetes/autoscaling/, docs/autoscaling.md) --------------------------
AUTOSCALING = K8S / "autoscaling"


def autoscaling_object(name: str) -> dict:
    (doc,) = [d for d in yaml.safe_load_all((AUTOSCALING / name).read_text()) if d is not None]
    return doc


def quantity(value: str) -> float:
    """A Kubernetes quantity as the HPA reads a target value ("700m", "0.7", "2")."""
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def test_keda_scales_on_the_replicas_summed_dimensions_at_the_routers_target():
    from warmroute.core.demand import DemandSettings

    obj = autoscaling_object("keda-scaledobject.yaml")
    assert (obj["apiVersion"], obj["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    (trigger,) = obj["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"  # ceil(current x value / target)
    query = trigger["metadata"]["query"]
    assert check_promql(query, router_series()) == []
    # Each dimension summed over the router replicas (each reports its share of it), then the highest
    assert query.startswith("max(sum by (dimension) (warmroute_fleet_utilization{")
    assert quantity(trigger["metadata"]["threshold"]) == DemandSettings().scale_target
    spec = obj["spec"]
    assert spec["scaleTargetRef"]["kind"] == "Deployment" and 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]


def test_the_hpa_reads_the_demand_ratio_the_adapter_serves():
    from warmroute.core.demand import DemandSettings

    hpa = autoscaling_object("hpa.yaml")
    assert (hpa["apiVersion"], hpa["kind"]) == ("autoscaling/v2", "HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    external = metric["external"]
    assert metric["type"] == "External" and external["target"]["type"] == "Value"
    assert quantity(external["target"]["value"]) == DemandSettings().scale_target
    series = router_series()
    assert external["metric"]["name"] in series
    assert set(external["metric"]["selector"]["matchLabels"]) <= series[external["metric"]["name"]][1]
    adapter = autoscaling_object("prometheus-adapter-rules.yaml")
    (rule,) = yaml.safe_load(adapter["data"]["config.yaml"])["externalRules"]
    assert rule["name"]["as"] == external["metric"]["name"]
    assert check_promql(rule["seriesQuery"].strip("'"), series) == []
    concrete = rule["metricsQuery"].replace("<<.Series>>", external["metric"]["name"]).replace(
        "<<.LabelMatchers>>", 'model="m"')
    assert check_promql(concrete, series) == []
    assert hpa["spec"]["scaleTargetRef"] == autoscaling_object("keda-scaledobject.yaml")["spec"]["scaleTargetRef"]
