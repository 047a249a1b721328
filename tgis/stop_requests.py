"""What tells a router or shard process to stop: SIGTERM or SIGINT, and the launcher's end.

Signals: ``on_stop_signals`` installs the event loop's handlers; ``ignore_stop_signals``
replaces them once the process is on its way out, so that a late signal (the launcher passes
each one on) cannot kill it half-way through its clean exit.

The launcher's end: a child of the launcher notices when the launcher is gone, however it
went. The launcher names itself in ``TGIS_LAUNCHER_PID`` in the environment of every router and
shard it starts. A child whose parent is no longer that process (the launcher died, even by
SIGKILL, and the child was handed to init or a subreaper) has lost it, and stops by itself
instead of holding the ports and the model's memory with no one to stop it. A process
started without the variable (by hand, by a test) watches nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Mapping

__all__ = [
    "LAUNCHER_PID_ENV",
    "POLL_S",
    "STOP_SIGNALS",
    "ignore_stop_signals",
    "launcher_env",
    "launcher_pid",
    "on_stop_signals",
    "wait_until_orphaned",
]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

LAUNCHER_PID_ENV = "TGIS_LAUNCHER_PID"
POLL_S = 0.25
"""How often a child looks at its parent."""


def launcher_env() -> dict[str, str]:
    """What the launcher adds to its children's environment."""
    return {LAUNCHER_PID_ENV: str(os.getpid())}


def launcher_pid(environ: Mapping[str, str]) -> int | None:
    """The launcher's pid from ``environ``; None when not started by one (or unreadable)."""
    try:
        pid = int(environ.get(LAUNCHER_PID_ENV, ""))
    except ValueError:
        return None
    return pid if pid > 1 else None


def orphaned(pid: int) -> bool:
    """Whether this process's parent is no longer ``pid``."""
    return os.getppid() != pid


async def wait_until_orphaned(pid: int | None, poll: float = POLL_S) -> None:
    """Return once the launcher ``pid`` is no longer this process's parent; never when
    ``pid`` is None."""
    if pid is None:
        await asyncio.Event().wait()  # forever
        return
    while not orphaned(pid):
        await asyncio.sleep(poll)


def on_stop_signals(callback: Callable[[], None]) -> None:
    """Call ``callback`` on the running event loop at each SIGTERM and SIGINT."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, callback)


def ignore_stop_signals() -> None:
    """From now on SIGTERM and SIGINT do nothing (the running loop's handlers removed)."""
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
