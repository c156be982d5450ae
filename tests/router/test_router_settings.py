"""Settings of `warmroute serve`: ranges, layering (CLI > env > file > defaults), one-line errors, the doc."""

from __future__ import annotations

import subprocess
import sys

import pytest

from warmroute.errors import UsageError
from warmroute.router.settings_cli import DOC_PATH, configuration_markdown
from warmroute.router.settings_load import load_settings

URL = "http://127.0.0.1:9"


def load(cli: dict | None = None, env: dict | None = None, config=None):
    return load_settings(cli, config, env=env or {})


def test_defaults_and_backend_names():
    s = load({"backends": [URL, "big=http://10.0.0.2:8000/", "http://[::1]:7"]})
    assert [(b.name, b.url) for b in s.backends] == [
        ("127.0.0.1-9", URL), ("big", "http://10.0.0.2:8000"), ("1-7", "http://[::1]:7")]
    assert (s.host, s.port, s.strategy) == ("127.0.0.1", 8080, "cache_aware")
    assert (s.max_body_bytes, s.index_memory_bytes, s.block_bytes) == (32 * 2**20, 256 * 2**20, 64)
    assert s.decision_headers and s.failures_before_ejection == 3 and s.health_interval == 2.0


@pytest.mark.parametrize("name,bad,needle", [
    ("prefix_length", "1023", "from 1,024 to 65,536"),
    ("prefix_length", "65537", "from 1,024 to 65,536"),
    ("concurrency_threshold", "0", "from 1 to 1,024"),
    ("concurrency_threshold", "1025", "from 1 to 1,024"),
    ("port", "70000", "from 0 to 65,535"),
    ("port", "http", "from 0 to 65,535"),
    ("strategy", "fastest", "one of cache_aware, prefix, session, least_loaded, round_robin, random"),
    ("balance_factor", "-1", "from 0 to 10"),
    ("miss_weight", "-1", "from 0 to 1000"),
    ("shared_miss_weight", "lots", "from 0 to 1000"),
    ("sticky_kv_limit", "-0.5", "from 0 to 1000"),
    ("hold_kv_limit", "1001", "from 0 to 1000"),
    ("hold_timeout", "-1", "from 0 to 3,600"),
    ("block_bytes", "60", "multiple of 8"),
    ("max_body_bytes", "2GiB", "from 1KiB to 1GiB"),
    ("index_memory_bytes", "lots", "from 1MiB to 64GiB"),
    ("health_interval", "0", "from 0.05 to 3,600"),
    ("first_byte_timeout", "-5", "from 0.1 to 3,600"),
    ("failures_before_ejection", "0", "from 1 to 100"),
    ("workers", "65", "from 1 to 64"),
    ("decision_headers", "perhaps", "true or false"),
    ("kv_capacity_tokens", "10", "from 256"),
])
def test_out_of_range_settings_name_the_setting_and_range(name, bad, needle):
    with pytest.raises(UsageError) as err:
        load({"backends": [URL], name: bad})
    msg = str(err.value)
    assert "\n" not in msg and needle in msg
    assert f"invalid setting {name}" in msg and "--" + name.replace("_", "-") in msg
    assert "WARMROUTE_" + name.upper() in msg


@pytest.mark.parametrize("backends,needle", [
    ([], "at least one backend"),
    (["ftp://x"], "must look like http://HOST:PORT"),
    (["http://x:notaport"], "invalid port"),
    (["a=http://x:1", "a=http://y:1"], "unique; repeated: a"),
    (["bad name=http://x:1"], "letters, digits"),
    ([{"url": URL, "weight": 3}], "weight"),
    ([{"url": URL, "kv_capacity_tokens": 0}], "kv_capacity_tokens"),
])
def test_bad_backends(backends, needle):
    with pytest.raises(UsageError, match="invalid setting backends") as err:
        load({"backends": backends})
    assert needle in str(err.value)


def test_sizes_accept_units():
    s = load({"backends": [URL], "max_body_bytes": "64KiB", "index_memory_bytes": "1 GiB"})
    assert (s.max_body_bytes, s.index_memory_bytes) == (64 * 1024, 2**30)


def test_precedence_cli_over_env_over_file_over_default(tmp_path):
    cfg = tmp_path / "router.yaml"
    cfg.write_text(
        "backends:\n"
        "  - http://10.0.0.1:8000\n"
        "  - name: big\n"
        "    url: http://10.0.0.2:8000\n"
        "    kv_capacity_tokens: 2000000\n"
        "prefix-length: 2048\n"  # dashes work as well as underscores
        "concurrency_threshold: 8\n"
        "strategy: prefix\n"
        "port: 7000\n")
    env = {"WARMROUTE_CONCURRENCY_THRESHOLD": "16", "WARMROUTE_STRATEGY": "session",
           "WARMROUTE_DECISION_HEADERS": "false", "UNRELATED": "x"}
    s = load({"strategy": "random"}, env, cfg)
    assert s.strategy == "random"  # CLI beats env and file
    assert s.concurrency_threshold == 16  # env beats file
    assert not s.decision_headers  # env beats default
    assert (s.prefix_length, s.port) == (2048, 7000)  # file beats default
    assert s.health_interval == 2.0  # default
    assert [(b.name, b.kv_capacity_tokens) for b in s.backends] == [("10.0.0.1-8000", None), ("big", 2_000_000)]


def test_a_strategys_settings_nest_under_its_name_and_keep_their_plain_names(tmp_path):
    """cache_aware's knobs: nested in the file (or at its top level, as older files have them), plain-named as
    flags and environment variables, with the same precedence setting by setting."""
    cfg = tmp_path / "router.yaml"
    cfg.write_text("backends: [http://10.0.0.1:8000]\n"
                   "cache_aware:\n  miss_weight: 8\n  hold_kv_limit: 2.0\n  balance_slack: 6\n"
                   "sticky_kv_limit: 3.0\n")
    env = {"WARMROUTE_HOLD_KV_LIMIT": "2.5", "WARMROUTE_BALANCE_SLACK": "7"}
    s = load({"balance_slack": "9"}, env, cfg)
    ca = s.cache_aware
    assert (ca.miss_weight, ca.sticky_kv_limit) == (8.0, 3.0)  # file, nested and flat
    assert ca.hold_kv_limit == 2.5  # env beats the file's nested value
    assert ca.balance_slack == 9  # CLI beats both
    assert ca.hold_keep == 1.5  # default
    assert s.strategy_settings().cache_aware == ca and type(s.strategy_settings()).__name__ == "StrategySettings"


def test_a_strategys_bad_setting_is_named_by_its_flag(tmp_path):
    with pytest.raises(UsageError, match=r"invalid setting hold_kv_limit = '-1' \(--hold-kv-limit, "
                                         r"WARMROUTE_HOLD_KV_LIMIT\): must be a number from 0 to 1000"):
        load(env={"WARMROUTE_HOLD_KV_LIMIT": "-1"})
    cfg = tmp_path / "router.yaml"
    cfg.write_text("backends: [http://10.0.0.1:8000]\ncache_aware:\n  bogus: 1\n")
    with pytest.raises(UsageError, match="unknown setting cache_aware.bogus"):
        load(config=cfg)


def test_env_backends_are_comma_separated():
    s = load(env={"WARMROUTE_BACKENDS": f"x={URL}, http://127.0.0.1:10"})
    assert [(b.name, b.url) for b in s.backends] == [("x", URL), ("127.0.0.1-10", "http://127.0.0.1:10")]


def test_config_file_errors_are_one_line(tmp_path):
    with pytest.raises(UsageError, match="cannot read config file"):
        load(config=tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [http://x:1]\nprefix_lenght: 2048\n")
    with pytest.raises(UsageError, match="unknown setting 'prefix_lenght'"):
        load(config=bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(UsageError, match="must be a mapping"):
        load(config=bad)


def _serve(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmroute", "serve", *args], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_cli_rejects_bad_settings_with_one_line_and_exit_2():
    out = _serve("--backend", URL, "--prefix-length", "100")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "prefix_length" in lines[0] and "1,024 to 65,536" in lines[0]
    assert "Traceback" not in out.stderr

    out = _serve("--backend", URL, env={"WARMROUTE_CONCURRENCY_THRESHOLD": "5000"})
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "concurrency_threshold" in out.stderr and "1 to 1,024" in out.stderr

    out = _serve("--backend", URL, "--strategy", "nope")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "one of" in out.stderr

    out = _serve()
    assert out.returncode == 2 and "at least one backend" in out.stderr


def test_configuration_doc_is_up_to_date():
    assert DOC_PATH.exists(), "run: python -m warmroute.router.settings_cli"
    assert DOC_PATH.read_text() == configuration_markdown(), "regenerate: python -m warmroute.router.settings_cli"


PROFILES = """\
backends: [http://127.0.0.1:9]
strategy: sticky
cache_aware: {miss_weight: 8}
strategies:
  ttft_only: {stages: [prefix_match, load_guard, scorers, tie_slack, least_loaded_ties, rendezvous]}
  sticky:
    base: cache_aware
    settings: {miss_weight: 32, balance_factor: 2.0, hold_timeout: 9}
"""


def test_a_config_file_defines_strategies_and_selects_one(tmp_path):
    from warmroute.core.strategies import CacheAwareStrategy
    from warmroute.router.metrics import Metrics
    from warmroute.router.routing import Router

    path = tmp_path / "profiles.yaml"
    path.write_text(PROFILES)
    s = load(config=path)
    assert s.strategy == "sticky" and set(s.strategies) == {"ttft_only", "sticky"}
    assert s.strategies["ttft_only"].pipeline()[-1] == "rendezvous"
    router = Router(s, Metrics(s.strategy, [b.name for b in s.backends]))
    assert isinstance(router.strategy, CacheAwareStrategy) and router.strategy.records_prefixes
    assert router.strategy.settings.cache_aware.miss_weight == 32  # the profile's own over the file's 8
    assert router.strategy.settings.cache_aware.balance_factor == 2.0
    assert router.admission.settings.hold_timeout == 9  # the admission queue reads the profile's hold_timeout too
    assert load({"strategy": "ttft_only"}, config=path).strategy == "ttft_only"
    assert load({"strategy": "cache_aware"}, config=path).cache_aware.miss_weight == 8


@pytest.mark.parametrize("strategies, needle", [
    ("{mine: {stages: [prefix_match, teleport, rendezvous]}}", "strategies.mine: unknown stage 'teleport'"),
    ("{mine: {stages: []}}", "strategies.mine: stages: at least one stage"),
    ("{mine: {stages: [prefix_match, scorers]}}", "strategies.mine: the last stage must be a picker"),
    ("{mine: {stages: [scorers, tie_slack, rendezvous]}}", "add 'prefix_match' to the stages"),
    ("{mine: {base: cache_aware, settings: {miss_wieght: 1}}}", "strategies.mine.settings: unknown setting"),
    ("{mine: {base: cache_aware, settings: {balance_factor: -1}}}", "balance_factor: Input should be greater"),
    ("{mine: {base: cache_aware, stage: [random]}}", "strategies.mine: unknown key 'stage'"),
    ("{cache_aware: {base: cache_aware}}", "'cache_aware' is a built-in strategy"),
    ("[random]", "strategies"),
])
def test_a_bad_strategy_in_the_config_is_one_line(tmp_path, strategies, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(f"backends: [http://127.0.0.1:9]\nstrategy: cache_aware\nstrategies: {strategies}\n")
    with pytest.raises(UsageError) as exc:
        load(config=path)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_strategy_naming_nothing_known_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("backends: [http://127.0.0.1:9]\nstrategy: stiky\nstrategies: {sticky: {base: cache_aware}}\n")
    with pytest.raises(UsageError, match=r"invalid setting strategy = 'stiky' .*one of cache_aware.*, sticky$"):
        load(config=path)


def test_serve_refuses_a_bad_strategy_with_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"backends: [{URL}]\nstrategy: mine\nstrategies:\n  mine: {{stages: [prefix_match, load_guard]}}\n")
    out = _serve("--config", str(bad))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "strategies.mine" in lines[0] and "last stage must be a picker" in lines[0]
