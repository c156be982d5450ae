"""`warmroute serve`: flags come from the settings model; everything is validated before the port is bound."""

from __future__ import annotations

import argparse
import logging

from warmroute.router.settings_cli import add_setting_arguments, cli_values
from warmroute.router.settings_load import load_settings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML file with the same keys as the settings "
                                                         "(flags and WARMROUTE_* variables override it)")
    add_setting_arguments(parser)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(cli_values(args), args.config)  # UsageError -> one line, exit 2
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from warmroute.router.discovery import check_backends_file
    from warmroute.router.server import serve  # imported after validation: bad flags fail fast

    check_backends_file(settings)

    return serve(settings)
