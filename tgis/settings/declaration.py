"""What one setting is: its name, flags, environment variables, type, default, help, and the
processes that read it.

A setting is declared once, in one of the tables of this package (``catalogue.py`` gathers
them). From that declaration come each process's command-line options (``options.py``),
the launcher's forwarding of its values to the shards and the router (``forwarding.py``)
and the defaults of the processes' configuration dataclasses (``default``).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["UNSET", "Kind", "Process", "Setting", "Via", "setting"]


class Process(enum.Enum):
    """A program with settings of its own."""

    LAUNCHER = "text-generation-launcher"
    ROUTER = "text-generation-router"
    SHARD = "text-generation-server serve"


class Kind(enum.Enum):
    """How a value is written on a command line and in an environment variable."""

    STR = "str"
    INT = "int"
    FLOAT = "float"
    FLAG = "flag"  # present or absent (`--json-output`); the variable takes true/false words
    BOOL = "bool"  # a value: `--default-include-stop-seqs false`
    LIST = "list"  # the flag repeated, or values comma-separated: a tuple of strings


class Via(enum.Enum):
    """How the launcher hands a value it holds to a child that reads the setting."""

    ARGV = "argv"  # `--flag value` on the child's command line (when set)
    ENV = "env"  # the setting's first variable in the child's environment (a secret)
    INHERITED = "inherited"  # not the launcher's: its own environment reaches the child


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()
"""A default that is not given (the setting has none, or none for that process)."""


@dataclass(frozen=True)
class Setting:
    """One setting. ``flags`` and ``env`` list the TGIS name first, then the aliases other
    servers' users bring (``aliases`` says whose each is); every process that reads the
    setting accepts all of them. ``defaults`` overrides ``default`` for a process (a child
    that the launcher always gives the resolved value, run alone)."""

    name: str
    flags: tuple[str, ...]
    env: tuple[str, ...]
    kind: Kind
    default: Any
    help: str
    readers: frozenset[Process]
    defaults: Mapping[Process, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)  # alias -> "TGI", "vLLM", ...
    choices: tuple[str, ...] = ()
    minimum: float | None = None  # the children check it on their command line
    via: Via = Via.ARGV
    positional: frozenset[Process] = frozenset()  # an argument there, not an option
    internal: bool = False  # only the launcher sets it (users have no reason to)

    def __post_init__(self) -> None:
        if not self.flags or not all(f.startswith("-") for f in self.flags):
            raise ValueError(f"setting {self.name}: flags must start with '-'")
        if not self.readers:
            raise ValueError(f"setting {self.name}: no process reads it")
        if self.via is Via.INHERITED and (not self.env or Process.LAUNCHER in self.readers):
            raise ValueError(f"setting {self.name}: inherited needs a variable, no launcher")
        if self.via is Via.ENV and not self.env:
            raise ValueError(f"setting {self.name}: passed by environment needs a variable")

    @property
    def flag(self) -> str:
        """The flag the launcher writes on a child's command line."""
        return next(f for f in self.flags if f.startswith("--"))

    def default_for(self, process: Process) -> Any:
        """The default ``process`` applies when the setting is given nowhere."""
        return self.defaults.get(process, self.default)

    def reads(self, process: Process) -> bool:
        return process in self.readers


def setting(  # noqa: PLR0913 (a declaration: every field has its say)
    name: str,
    flags: tuple[str, ...],
    env: tuple[str, ...],
    kind: Kind,
    default: Any,
    help: str,
    readers: Iterable[Process],
    *,
    defaults: Mapping[Process, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
    via: Via = Via.ARGV,
    positional: Iterable[Process] = (),
    internal: bool = False,
) -> Setting:
    """A ``Setting``, written compactly in the tables."""
    return Setting(
        name,
        flags,
        env,
        kind,
        default,
        help,
        frozenset(readers),
        defaults=dict(defaults or {}),
        aliases=dict(aliases or {}),
        choices=choices,
        minimum=minimum,
        via=via,
        positional=frozenset(positional),
        internal=internal,
    )
