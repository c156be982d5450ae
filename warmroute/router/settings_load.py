"""Loading `warmroute serve`'s settings: CLI flags > WARMROUTE_* env > YAML file > defaults, merged into the model
(settings.py) and validated; a bad value becomes one line naming the setting, its flag and variable, and what is
valid."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic_settings import EnvSettingsSource

from warmroute.core.strategies import (FLAT_ALIASES, OWN_SETTINGS, StrategyProfile, StrategySettings, check_profiles,
                                       flat_name, flat_names, merge_layers, own_setting)
from warmroute.errors import UsageError
from warmroute.router.settings import RouterSettings, env_of, flag_of
from warmroute.router.settings_cli import cli_values, is_setting, valid_range


def load_settings(cli_values: dict[str, Any] | None = None, config_file: str | Path | None = None,
                  env: dict[str, str] | None = None) -> RouterSettings:
    """Merge the layers (CLI > env > file > defaults) and validate; bad input raises a one-line UsageError."""
    file_values = read_config_file(config_file) if config_file else {}
    try:
        env_source = EnvSettingsSource(RouterSettings)
        if env is not None:  # tests pass their own environment
            env_source.env_vars = {k.lower(): v for k, v in env.items()}
        env_values = {k: v for k, v in env_source().items() if k not in OWN_SETTINGS}  # those: by plain names
        env_values.update(_own_settings_from_env(env_source.env_vars))
        merged = merge_layers(file_values, env_values, cli_values or {})
        # Everything is in `merged`, so the model's own env reading cannot change the outcome.
        return RouterSettings(**merged)
    except ValidationError as exc:
        raise UsageError(describe_errors(exc)) from None


def _own_settings_from_env(env_vars: Mapping[str, str | None]) -> dict[str, Any]:
    """Nested settings by their plain names (WARMROUTE_BALANCE_FACTOR, WARMROUTE_TIMEOUT_S, WARMROUTE_ADMISSION) or
    former names (WARMROUTE_QUEUE_TIMEOUT), which the model's env reading does not see (they are nested fields)."""
    names = [n for field in OWN_SETTINGS for n in flat_names(field)] + [n for n in FLAT_ALIASES if n not in OWN_SETTINGS]
    return {n: env_vars[env_of(n).lower()] for n in names if env_vars.get(env_of(n).lower()) is not None}


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UsageError(f"cannot read config file {path}: {str(exc).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"config file {path} must be a mapping of setting: value")
    values = {str(k).replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(k for k in values if k not in RouterSettings.model_fields and own_setting(k) is None)
    if unknown:
        raise UsageError(f"config file {path}: unknown setting {unknown[0]!r}; "
                         f"known: {', '.join(RouterSettings.model_fields)}")
    return values


def describe_errors(exc: ValidationError) -> str:
    """One line naming each bad setting, how to set it, and what is valid."""
    parts = []
    for err in exc.errors():
        loc = err.get("loc") or ()
        if loc and loc[0] == "strategies":  # a strategy defined in the config (YAML only: no flag)
            parts.append(_profile_error(loc, err))
            continue
        if len(loc) > 1 and loc[0] in OWN_SETTINGS:  # a strategy's own setting: named by its plain name
            if err["type"] == "extra_forbidden":
                parts.append(f"unknown setting {'.'.join(map(str, loc))}")
                continue
            loc = (flat_name(str(loc[0]), str(loc[1])), *loc[2:])
        name = str(loc[0]) if loc else ""
        if not is_setting(name):
            parts.append(_clean(err["msg"]))
            continue
        got = err.get("input")
        shown = "" if len(loc) > 1 or isinstance(got, (dict, list)) or got is None or name in _SECRET else f" = {got!r}"
        if err["type"] == "too_short" and name == "backends":
            detail = "at least one backend is required (--backend URL or NAME=URL)"
        elif len(loc) > 1:  # inside a backend entry
            detail = f"{'.'.join(map(str, loc[1:]))}: {_clean(err['msg'])}"
        elif err["type"] == "value_error":
            detail = _clean(err["msg"])
        else:
            detail = valid_range(name)
        parts.append(f"invalid setting {name}{shown} ({flag_of(name)}, {env_of(name)}): {detail}")
    return "; ".join(parts)


def _profile_error(loc: tuple, err: Any) -> str:
    """'invalid setting strategies.NAME: what is wrong' for a strategy defined under `strategies`."""
    if err["type"] == "extra_forbidden":
        where, detail = ".".join(map(str, loc[:-1])), f"unknown key {loc[-1]!r} (known: stages, base, settings)"
    else:
        where, detail = ".".join(map(str, loc)), _clean(err["msg"])
    return f"invalid setting {where}: {detail}"


_SECRET = frozenset({"api_keys", "api_key_salt", "admin_token", "observability_token", "redis_url"})  # never echoed


def _clean(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def strategy_settings_from(args: argparse.Namespace, file_values: Mapping[str, Any] | None = None
                           ) -> StrategySettings:
    """The strategy settings given as flags (add_setting_arguments(parser, StrategySettings)) over those of a config
    file's values (read_config_file; its other settings ignored), validated as `warmroute serve` validates them; a
    bad one raises a one-line UsageError."""
    from_file = {k: v for k, v in (file_values or {}).items()
                 if (k in StrategySettings.model_fields or own_setting(k) is not None)}
    try:
        return StrategySettings(**merge_layers(from_file, cli_values(args, StrategySettings)))
    except ValidationError as exc:
        raise UsageError(describe_errors(exc)) from None


def profiles_from(file_values: Mapping[str, Any]) -> dict[str, StrategyProfile]:
    """The strategies a config file's values define (`strategies:`), checked as `warmroute serve` checks them; a
    bad one raises a one-line UsageError."""
    try:
        return check_profiles(_PROFILES.validate_python(file_values.get("strategies") or {}))
    except ValidationError as exc:
        raise UsageError("; ".join(_profile_error(("strategies", *e["loc"]), e) for e in exc.errors())) from None
    except ValueError as exc:
        raise UsageError(f"invalid setting strategies: {exc}") from None


_PROFILES = TypeAdapter(dict[str, StrategyProfile])
