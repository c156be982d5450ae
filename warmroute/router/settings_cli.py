"""What the settings model (settings.py) looks like outside Python: a setting's plain name, flag, variable and YAML
key, the argparse flags of `warmroute serve` (and of `warmroute simulate`'s router settings), what values are valid,
and docs/configuration.md.

`python -m warmroute.router.settings_cli` regenerates docs/configuration.md (tests/router/test_router_settings.py
checks that it is current)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from warmroute.core.demand import DemandSettings
from warmroute.core.disaggregation import DisaggregationSettings
from warmroute.core.strategies import OWN_SETTINGS, STRATEGIES, StrategySettings, flat_names, former_names, own_setting
from warmroute.router.settings import GiB, KiB, MiB, RouterSettings, env_of, flag_of


# -- a setting's names ---------------------------------------------------------------------------------------
def is_setting(name: str) -> bool:
    return (name in RouterSettings.model_fields and name not in OWN_SETTINGS) or own_setting(name) is not None


def field_of(name: str) -> FieldInfo:
    """The field behind a setting's plain name: RouterSettings' own, or a nested one's (balance_factor, timeout_s,
    admission: its `enabled`, and former names: queue_timeout)."""
    nested = own_setting(name)
    return OWN_SETTINGS[nested[0]].model_fields[nested[1]] if nested else RouterSettings.model_fields[name]


def setting_names(model: type[BaseModel] | None = None) -> list[str]:
    """Every setting by its plain name, a strategy's own right after `strategy` (only the strategy settings
    for model=StrategySettings)."""
    strategy = [n for n in StrategySettings.model_fields if n not in OWN_SETTINGS]
    strategy += [n for field in OWN_SETTINGS for n in flat_names(field)]
    if model is StrategySettings:
        return strategy
    demand = list(DemandSettings.model_fields)  # next to the other settings for autoscaling
    pd = list(DisaggregationSettings.model_fields)  # right after the strategy's
    own = [n for n in RouterSettings.model_fields
           if n not in StrategySettings.model_fields and n not in demand and n not in pd]
    at = own.index("pod_deletion_cost_interval") + 1
    own = own[:at] + demand + own[at:]
    own.remove("strategies")  # right after `strategy`
    at = own.index("strategy") + 1
    return own[:at] + ["strategies"] + strategy + pd + own[at:]


def yaml_key(name: str) -> str:
    nested = own_setting(name)
    return f"{nested[0]}.{nested[1]}" if nested else name


# -- flags ---------------------------------------------------------------------------------------------------
NO_FLAG = frozenset({"strategies"})  # structured: the YAML file (or JSON in the variable) only


def _fields(model: type[BaseModel]) -> dict[str, FieldInfo]:
    """Each setting's field by its plain name: the router's and strategies' (nested ones flat), or any other
    model's own fields (the simulator's autoscaler)."""
    if model is RouterSettings or model is StrategySettings:
        return {name: field_of(name) for name in setting_names(model)}
    return dict(model.model_fields)


def add_setting_arguments(parser: argparse.ArgumentParser, model: type[BaseModel] = RouterSettings,
                          aliases: Mapping[str, str] | None = None) -> None:
    """One flag per setting (of `model`: RouterSettings, StrategySettings or another settings model for the
    simulator); values stay strings so the model validates them like env and file values. `aliases`: a shorter
    second flag for some settings (name -> flag)."""
    aliases = aliases or {}
    for name, field in _fields(model).items():
        if name in NO_FLAG:
            continue
        env = f"{env_of(name)}; " if model is RouterSettings else ""  # the simulator reads no environment
        help_text = f"{field.description} [{env}default {_default_text(name, field)}]"
        flags = [flag_of(name), *([aliases[name]] if name in aliases else []), *map(flag_of, former_names(name))]
        if field.annotation is bool:
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        elif name == "backends":
            parser.add_argument("--backend", dest=name, action="append", metavar="[NAME=]URL",
                                default=argparse.SUPPRESS, help=help_text)
        else:
            metavar = {int: "N", float: "X"}.get(field.annotation, "VALUE")
            parser.add_argument(*flags, dest=name, metavar=metavar,
                                default=argparse.SUPPRESS, help=help_text.replace("%", "%%"))


def cli_values(args: argparse.Namespace, model: type[BaseModel] = RouterSettings) -> dict[str, Any]:
    names = set(_fields(model))
    return {k: v for k, v in vars(args).items() if k in names}


def _default_text(name: str, field: FieldInfo | None = None) -> str:
    field = field or field_of(name)
    if name == "backends":
        return "none (required)"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict) and not value:
        return "none"
    if isinstance(value, dict):
        return ",".join(f"{k}={v:g}" for k, v in value.items())
    if name.endswith("_bytes") and isinstance(value, int) and value >= MiB:
        return _size(value)
    return str(value)


# -- what is valid -------------------------------------------------------------------------------------------
def valid_range(name: str) -> str:
    """'must be an integer from 1,024 to 65,536' and the like, from the field's own constraints."""
    field = field_of(name)
    ann = field.annotation
    if name == "scorers":
        return "NAME=WEIGHT pairs, comma-separated (weights from 0 to 1000)"
    if name == "strategy":
        return f"must be one of {', '.join(STRATEGIES)}, or a name defined under strategies"
    if name == "strategies":
        return "must be a mapping of NAME: {stages, base, settings}"
    if getattr(ann, "__origin__", None) is Literal:
        return "must be one of " + ", ".join(ann.__args__)
    if ann is bool:
        return "must be true or false"
    lo = hi = None
    for m in field.metadata:
        lo = getattr(m, "ge", lo) if getattr(m, "ge", None) is not None else lo
        hi = getattr(m, "le", hi) if getattr(m, "le", None) is not None else hi
    kind = "an integer" if ann is int else "a number" if ann is float else "a string"
    if lo is None and hi is None:
        return f"must be {kind}"
    if name.endswith("_bytes") and hi and hi >= MiB:
        return f"must be a size from {_size(lo)} to {_size(hi)} (bytes, or with a unit: 32MiB)"
    extra = " and a multiple of 8" if name == "block_bytes" else ""
    return f"must be {kind} from {_num(lo)} to {_num(hi)}{extra}"


def _num(x: float | None) -> str:
    if x is None:
        return "?"
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def _size(x: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if x >= scale and x % scale == 0:
            return f"{x // scale}{unit}"
    return f"{x:,} bytes"


# -- documentation -------------------------------------------------------------------------------------------
DOC_PATH = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def configuration_markdown() -> str:
    """docs/configuration.md, generated from the model (tests/router/test_router_settings.py keeps it current)."""
    lines = [
        "# Configuration of `warmroute serve`",
        "",
        "<!-- Generated by warmroute.router.settings_cli.configuration_markdown() (python -m warmroute.router.settings_cli); do not edit by hand. -->",
        "",
        "Every setting can be given as a command-line flag, as an environment variable, or as a key of the",
        "YAML file named by `--config FILE`. Precedence: flag > environment > file > default. An invalid",
        "value stops the router before it binds its port, with one line naming the setting and what is valid,",
        "and exit status 2. A strategy's own settings nest under its name in the file (`cache_aware:` then",
        "`balance_factor: 2`); they may also be written at the top level by their plain name, as flags and",
        "environment variables name them. The admission queue's settings nest under `admission:` the same way",
        "(`admission: {timeout_s: 30, fair_lend: 2}`, or `timeout_s: 30` at the top level, `--timeout-s 30`,",
        "`WARMROUTE_TIMEOUT_S=30`); `admission: false` (`--no-admission`) turns it off. Their former names still work",
        "as keys, flags and variables: `queue_timeout` (timeout_s), `queue_max_requests` (max_requests),",
        "`queue_max_bytes` (max_bytes), `queue_lifo_after` (lifo_after_s), `queue_aging` (aging_tokens_per_s).",
        "`warmroute simulate` takes the strategy and admission settings as the same flags.",
        "",
        "| Setting (YAML key) | Flag | Environment | Default | Valid | Meaning |",
        "|---|---|---|---|---|---|",
    ]
    for name in setting_names():
        valid = "" if name == "backends" else valid_range(name).removeprefix("must be ")
        flag = "—" if name in NO_FLAG else f"`{flag_of(name)}`"
        lines.append(f"| `{yaml_key(name)}` | {flag} | `{env_of(name)}` | `{_default_text(name)}` | "
                     f"{valid} | {field_of(name).description} |")
    lines += [
        "",
        "## Example file",
        "",
        "```yaml",
        "backends:",
        "  - http://10.0.0.1:8000            # named 10.0.0.1-8000",
        "  - name: big",
        "    url: http://10.0.0.2:8000",
        "    kv_capacity_tokens: 1500000     # this instance's own KV-cache capacity",
        "    models: [llama-3-70b]           # what it serves (default: read from its /v1/models)",
        "strategy: cache_aware",
        "prefix_length: 8192",
        "concurrency_threshold: 64",
        "cache_aware:",
        "  hot_balance_factor: 0.5",
        "admission:",
        "  timeout_s: 30                     # your time-to-first-token objective",
        "  fair_lend: 2",
        "index_memory_bytes: 512MiB",
        "```",
        "",
        "A strategy of your own (docs/architecture.md, Defining a strategy), selected by `strategy`:",
        "",
        "```yaml",
        "strategy: sticky",
        "strategies:",
        "  sticky:                           # cache_aware's stages, keeping conversations home longer",
        "    base: cache_aware",
        "    settings: {miss_weight: 32, balance_factor: 2.0}",
        "  ttft_only:                        # no slow start, no hot-prefix guard",
        "    stages: [prefix_match, load_guard, scorers, tie_slack, least_loaded_ties, rendezvous]",
        "```",
        "",
        "## Notes",
        "",
        "- `block_bytes` should match the engines' cache block: 64 bytes is about 16 tokens, vLLM's default.",
        "- `kv_capacity_tokens` sizes each instance's share of the prefix index, so the router forgets what",
        "  the engine has evicted; `index_memory_bytes` caps the whole index whatever the fleet's size. Unset,",
        "  it is read from each engine's `/metrics` (vLLM's `cache_config_info`, SGLang's `max_total_num_tokens`).",
        "  With `engine_feedback`, a wrong capacity is corrected from the cached tokens the engines report",
        "  (see docs/feedback.md); `warmroute_index_capacity_scale` in `/metrics` shows the factor learnt.",
        "- Several router replicas each keep their own index and metrics, and each sees only its share of a",
        "  prefix's requests: the fleet hit rate drops (docs/replicas.md). Set `redis_url` (the same Redis and",
        "  `redis_channel` for every replica) to share index updates between them. The `workers` of one router",
        "  share theirs through local sockets without Redis (with `redis_url`, through Redis like replicas);",
        "  `/metrics` sums the workers' counters and `/dashboard` shows every worker's traffic (each sends",
        "  the others its figures every second), whichever worker answers.",
        "- Mixed models: each instance's `/v1/models` is read every `models_interval` (and when a client asks the",
        "  router's `/v1/models`, with its credentials); a request naming a model goes only to the instances",
        "  that list it, a model no instance lists to any instance. A backend's `models` fixes its list.",
        "- Precise mode (`kv_events`, with `tokenizer`): each instance's KV-cache events (vLLM:",
        "  `--kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\":",
        "  \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}'`) are read from its URL's host at",
        "  `kv_events_port` and `kv_events_replay_port`, or from a backend entry's own `kv_events_endpoint` and",
        "  `kv_events_replay_endpoint` (`tcp://HOST:PORT`). See docs/precise.md.",
        "- Membership at run time (`backends_file`, `dns_refresh_interval`, `admin_token`): docs/deployment.md.",
        "- Health: a refused connection ejects an instance at once; `failures_before_ejection` consecutive",
        "  5xx answers or timeouts eject it, unless no other instance could take its requests; only a passing",
        "  `GET /health` brings it back.",
        "",
    ]
    return "\n".join(lines)


def write_configuration_doc(path: Path = DOC_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(configuration_markdown())


if __name__ == "__main__":  # python -m warmroute.router.settings_cli  regenerates the doc
    write_configuration_doc()
