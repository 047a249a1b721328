"""How the launcher hands its values to a child: the child's command-line words and the
variables added to its environment, from the settings the child reads.

The launcher gives, for each child, a mapping of setting name to value (its flags, with the
values it resolved in their place). A setting the child reads is written on its command
line (``Via.ARGV``: positionals first, then ``--flag value``, or the bare flag when true) or
put in its environment (``Via.ENV``, for secrets), in declaration order, when its value is
set (not None, False, "" or an empty list; a ``Kind.BOOL`` whenever it is not None; a
``Kind.LIST`` as one comma-separated value). A setting the child reads that is missing
from the mapping is left to the child (its own environment, inherited from the launcher,
else its default).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tgis.settings.catalogue import read_by
from tgis.settings.declaration import Kind, Process, Via

__all__ = ["child_argv", "child_env", "is_set"]


def is_set(value: Any, kind: Kind = Kind.STR) -> bool:
    """Whether a value is passed on at all (a ``Kind.BOOL`` false is: it is a value)."""
    if kind is Kind.BOOL:
        return value is not None
    return value is not None and value is not False and value != "" and value != ()


def _word(kind: Kind, value: Any) -> str:
    if kind is Kind.BOOL:
        return "true" if value else "false"
    if kind is Kind.LIST:
        return ",".join(value)
    return str(value)


def child_argv(process: Process, values: Mapping[str, Any]) -> list[str]:
    """The words after the program's name (and subcommand) for ``process``."""
    words = _positionals(process, values)
    settings = [s for s in read_by(process) if s.name in values and s.via is Via.ARGV]
    for s in settings:
        value = values[s.name]
        if process in s.positional or not is_set(value, s.kind):
            continue
        words += [s.flag] if s.kind is Kind.FLAG else [s.flag, _word(s.kind, value)]
    return words


def _positionals(process: Process, values: Mapping[str, Any]) -> list[str]:
    """The arguments, in order, up to the last one given (one not given before it takes
    the child's default)."""
    arguments = [s for s in read_by(process) if process in s.positional]
    given = [i for i, s in enumerate(arguments) if values.get(s.name) is not None]
    if not given:
        return []
    words = []
    for s in arguments[: given[-1] + 1]:
        value = values.get(s.name)
        words.append(_word(s.kind, s.default_for(process) if value is None else value))
    return words


def child_env(process: Process, values: Mapping[str, Any]) -> dict[str, str]:
    """The variables to add to ``process``'s environment (the ``Via.ENV`` settings)."""
    return {
        s.env[0]: _word(s.kind, values[s.name])
        for s in read_by(process)
        if s.via is Via.ENV and s.name in values and is_set(values[s.name], s.kind)
    }
