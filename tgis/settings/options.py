"""A program's command-line options, built from the settings it reads.

Every setting becomes one option with all its flags and environment variables (command line
beats environment beats default), its help (naming the aliases and whose they are) and the
program's default. Flags are present or absent, and their variables take only the words
true/false/1/0/yes/no; a ``Kind.BOOL`` takes one of those words as its value. The children
check ranges and choices here; the launcher checks them in ``launcher/validation.py``, with
its own messages, before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from tgis import __version__
from tgis.settings.catalogue import read_by
from tgis.settings.declaration import UNSET, Kind, Process, Setting

__all__ = ["BOOL_HINT", "StrictBool", "parse_bool", "setting_options", "version_option"]

F = TypeVar("F", bound=Callable[..., Any])

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")
BOOL_HINT = "expected one of true, false, 1, 0, yes, no"


def parse_bool(value: str) -> bool:
    """true/false/1/0/yes/no, any case; ValueError otherwise."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(value)


class StrictBool(click.ParamType):
    """A boolean option that takes a value (`--default-include-stop-seqs false`)."""

    name = "boolean"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool:
        if isinstance(value, bool):
            return value
        try:
            return parse_bool(str(value))
        except ValueError:
            self.fail(f"{value!r}: {BOOL_HINT}", param, ctx)


def _strict_env_flag(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """Flags set from the environment accept only the boolean words (click takes more)."""
    if param.name and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        raw = next((os.environ[n] for n in names if os.environ.get(n)), "")
        try:
            return parse_bool(raw)
        except ValueError:
            raise click.BadParameter(f"{raw!r}: {BOOL_HINT}", ctx, param) from None
    return bool(value)


def _split_list(_: click.Context, __: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """A ``Kind.LIST``: every value given (the flag repeated) split at commas, blanks around
    the items and empty ones dropped, each once, in order."""
    items = (item.strip() for value in values for item in value.split(","))
    return tuple(dict.fromkeys(item for item in items if item))


def _type(setting: Setting, checked: bool) -> click.ParamType:
    if setting.kind is Kind.BOOL:
        return StrictBool()
    if checked and setting.choices:
        return click.Choice(setting.choices, case_sensitive=False)
    if setting.kind is Kind.INT:
        minimum = int(setting.minimum) if checked and setting.minimum is not None else None
        return click.IntRange(min=minimum) if minimum is not None else click.INT
    if setting.kind is Kind.FLOAT:
        minimum_f = setting.minimum if checked else None
        return click.FloatRange(min=minimum_f) if minimum_f is not None else click.FLOAT
    return click.STRING


def _help(setting: Setting) -> str:
    names = [a for a in (*setting.flags, *setting.env) if a in setting.aliases]
    if not names:
        return setting.help
    whose = "; ".join(f"{name} is {setting.aliases[name]}'s name" for name in names)
    return f"{setting.help} ({whose})"


def _parameter(setting: Setting, process: Process) -> Callable[[F], F]:
    default = setting.default_for(process)
    checked = process is not Process.LAUNCHER
    if process in setting.positional:
        return click.argument(setting.name, default=default, required=False)
    common: dict[str, Any] = {
        "envvar": list(setting.env),
        "show_envvar": True,
        "help": _help(setting),
    }
    if setting.kind is Kind.FLAG:
        return click.option(
            *setting.flags, setting.name, is_flag=True, default=bool(default),
            callback=_strict_env_flag, **common,
        )  # fmt: skip
    if setting.kind is Kind.LIST:
        return click.option(
            *setting.flags, setting.name, multiple=True, callback=_split_list, **common
        )
    if default is UNSET:
        return click.option(
            *setting.flags, setting.name, type=_type(setting, checked), required=True, **common
        )
    return click.option(
        *setting.flags, setting.name, type=_type(setting, checked), default=default,
        show_default=default is not None, **common,
    )  # fmt: skip


def setting_options(process: Process) -> Callable[[F], F]:
    """A decorator adding an option (or argument) for every setting ``process`` reads, in
    declaration order; the command receives each value under the setting's name."""
    parameters = [_parameter(s, process) for s in read_by(process)]

    def decorate(command: F) -> F:
        for parameter in reversed(parameters):
            command = parameter(command)
        return command

    return decorate


def version_option() -> Callable[[F], F]:
    """``-V`` / ``--version``: print the program's name and the package's version, exit 0
    (every program has it, as TGI's do)."""
    return click.version_option(
        __version__, "-V", "--version", message="%(prog)s %(version)s", help="Print the version."
    )
