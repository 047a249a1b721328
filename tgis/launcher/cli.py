"""`text-generation-launcher`: flags (each also read from its env vars) → LauncherConfig.

The options are those of the settings the launcher reads (``tgis/settings``). Command line
beats env beats default. Parse errors, like every other start-up error, are one
line on stderr and in the termination log, with a non-zero exit (`tgis.termination`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import click
from click.core import ParameterSource

from tgis.launcher.config import LauncherConfig
from tgis.log import one_line
from tgis.settings.declaration import Process
from tgis.settings.options import BOOL_HINT, setting_options, version_option
from tgis.termination import fail_startup


@click.command(
    name="text-generation-launcher",
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
        "terminal_width": 100,
    },
)
@setting_options(Process.LAUNCHER)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Validate, print the shard and router command lines, and exit.",
)
@version_option()
def command(dry_run: bool, **values: Any) -> tuple[LauncherConfig, bool]:
    """Start one shard per rank and the router, and supervise them (TGIS-compatible)."""
    return LauncherConfig(**values), dry_run


def error_message(error: click.ClickException) -> str:
    """One line naming the flag, or the env var when the bad value came from the environment."""
    if isinstance(error, click.BadParameter) and error.ctx and error.param and error.param.name:
        param, ctx = error.param, error.ctx
        envvar = _envvar_used(param.envvar)
        detail = error.message
        if envvar and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
            where = envvar
            if isinstance(param.type, click.types.BoolParamType):
                detail = f"{os.environ.get(envvar, '')!r}: {BOOL_HINT}"
        else:
            where = max(param.opts, key=len) if param.opts else param.name
        return one_line(f"invalid value for {where}: {detail}")
    return one_line(error.format_message())


def _envvar_used(envvar: str | Sequence[str] | None) -> str | None:
    """The env var a value came from: the option's only one, or the first set of several."""
    if envvar is None or isinstance(envvar, str):
        return envvar
    return next((name for name in envvar if os.environ.get(name)), None)


def parse_args(args: Sequence[str] | None = None) -> tuple[LauncherConfig, bool]:
    """Parse the command line (and env); raise click exceptions. Returns (config, dry_run)."""
    result = command.main(
        args=list(args) if args is not None else None,
        prog_name="text-generation-launcher",
        standalone_mode=False,
    )
    if not isinstance(result, tuple):  # --help: click printed it and returned the exit code
        raise click.exceptions.Exit(result if isinstance(result, int) else 0)
    return result


def main(args: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point."""
    try:
        config, dry_run = parse_args(args)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        fail_startup(error_message(e))

    from tgis.launcher.app import launch  # after parsing: --help stays fast

    sys.exit(launch(config, dry_run=dry_run))
