"""One child process of the launcher (a shard or the router): what to run (``ChildSpec``),
the running process, leader of its own process group (``Child``), and how its end reads
(``describe_status``, ``may_follow_a_peer``); ``supervisor.py`` starts, watches and stops them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tgis.launcher.output import OutputForwarder
from tgis.stop_requests import launcher_env

SIGBUS_MESSAGE = (
    "Encountered SIGBUS error. This is usually caused by NCCL having insufficient shared memory. "
    "Ensure at least 1GB of shared memory is available. In case of OpenShift/K8s, mount a memory "
    "medium emptyDir volume to /dev/shm"
)


@dataclass(frozen=True)
class ChildSpec:
    """What to run: a name for logs (`Shard 0`, `Router`), the command line, its environment."""

    name: str
    argv: Sequence[str]
    env: Mapping[str, str] | None = None


@dataclass(frozen=True)
class Outcome:
    """How supervision ended: the launcher's exit code and, for a failure, the reason."""

    exit_code: int
    reason: str | None = None


def describe_status(returncode: int) -> str:
    """An exit status the way TGIS prints it: `exit status: 1` or `signal: 9 (SIGKILL)`."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            return f"signal: {-returncode}"
        return f"signal: {-returncode} ({name})"
    return f"exit status: {returncode}"


def may_follow_a_peer(returncode: int) -> bool:
    """Whether a shard's end may be the consequence of another shard's: an exit status or
    SIGABRT (a failed collective), as opposed to a kill by any other signal."""
    return returncode >= 0 or returncode == -signal.SIGABRT


class StartError(RuntimeError):
    """A child could not be started (e.g. its program is missing)."""


class Child:
    """One running child process, leader of its own process group."""

    def __init__(self, spec: ChildSpec, forwarder: OutputForwarder | None) -> None:
        piped = subprocess.PIPE if forwarder is not None else None
        self.name = spec.name
        env = dict(spec.env) if spec.env is not None else dict(os.environ)
        self.popen = subprocess.Popen(
            list(spec.argv),
            env={**env, **launcher_env()},
            stdin=subprocess.DEVNULL,
            stdout=piped,
            stderr=piped,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.threads: list[threading.Thread] = []
        if forwarder is not None:
            assert self.popen.stdout is not None and self.popen.stderr is not None
            self.threads = [
                forwarder.start(self.popen.stdout, self.name, sys.stdout),
                forwarder.start(self.popen.stderr, self.name, sys.stderr),
            ]

    def poll(self) -> int | None:
        """The exit code (negative: killed by that signal), or None while running."""
        return self.popen.poll()

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the child's process group; nothing if the group is gone."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the child to exit; True if it has."""
        try:
            self.popen.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self, timeout: float = 5.0) -> None:
        """SIGKILL the whole group, reap the child, and kill any straggler left in the group."""
        self.signal_group(signal.SIGKILL)
        self.wait(timeout)  # a process stuck in the kernel (D state) may outlast SIGKILL
        self.signal_group(signal.SIGKILL)

    def join_output(self, timeout: float) -> None:
        """Let the output threads print the child's last lines."""
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(deadline - time.monotonic(), 0.0))
