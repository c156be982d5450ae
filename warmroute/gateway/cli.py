"""`warmroute epp`: serve's settings (flags, env, YAML file), the endpoint picker instead of the proxy."""

from __future__ import annotations

import argparse
import logging

from warmroute.router.cli import add_arguments as add_arguments  # the same flags as `warmroute serve`
from warmroute.router.settings_cli import cli_values
from warmroute.router.settings_load import load_settings


def run(args: argparse.Namespace) -> int:
    settings = load_settings(cli_values(args), args.config)  # UsageError -> one line, exit 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from warmroute.gateway.server import serve  # imported after validation: bad flags fail fast
    except ImportError as exc:
        from warmroute.errors import UsageError

        raise UsageError(f"{exc.name} is missing: pip install 'warmroute[gateway]'") from None
    return serve(settings)
