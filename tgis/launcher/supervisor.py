"""Start, watch and stop the shard and router processes.

Every child runs in its own session (so its own process group): a Ctrl-C in a terminal reaches
only the launcher, and stopping a child signals its whole group, grandchildren included.

Lifecycle (`Supervisor.run`): start the shards; wait until every one is ready (probe), a shard
exits (failure), the start-up timeout passes (failure) or a signal arrives (clean stop); start
the router; then wait for a signal (clean stop, exit 0) or any child's exit (failure, exit 1).
Stopping is always the same: SIGTERM the router's group and wait (then SIGKILL), then SIGTERM
every shard's group and wait (then SIGKILL), then SIGKILL what is left of each group. A signal
that comes while the router drains is passed on to it (a second SIGTERM or SIGINT ends its
drain at once). A clean stop exits 0 unless a child had to be killed or ended badly (a shard
that aborted, a router that exited non-zero): then 1, with the reason.

With a group spread over several nodes (``NodeGroup``, ``node_link.py``), the supervisor
runs this node's ranks (the router only on node 0) and watches the link too: another node's
end ends this one (a worker's exit 0 when node 0 stopped cleanly), and a local shard's end
waits ``NodeGroup.settle`` seconds for another node's report, which names the cause when
the shard only followed a peer elsewhere. When supervision ends the link tells the other nodes.

Every child is told the launcher's pid (``tgis/stop_requests.py``), so that it stops by itself
when the launcher is gone, even after a SIGKILL that left no time to stop it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType

from tgis.launcher.children import (
    SIGBUS_MESSAGE,
    Child,
    ChildSpec,
    Outcome,
    StartError,
    describe_status,
    may_follow_a_peer,
)
from tgis.launcher.node_link import NodeLink
from tgis.launcher.output import OutputForwarder

HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

ReadyProbe = Callable[[int], bool]


@dataclass(frozen=True)
class NodeGroup:
    """This node's part of a group spread over several nodes: its first rank, the link to
    the other nodes' launchers, and how long a local shard's end waits for their report."""

    first_rank: int
    link: NodeLink
    settle: float = 2.0


class Supervisor:
    """Runs shards then router, and stops them all in order on a signal or a failure."""

    def __init__(
        self,
        log: logging.Logger,
        forwarder: OutputForwarder | None = None,
        *,
        poll_interval: float = 0.1,
        router_stop_timeout: float = 30.0,
        shard_stop_timeout: float = 10.0,
        waiting_log_interval: float = 10.0,
        peer_settle: float = 0.5,
    ) -> None:
        self.log = log
        self.forwarder = forwarder
        self.poll_interval = poll_interval
        self.router_stop_timeout = router_stop_timeout
        self.shard_stop_timeout = shard_stop_timeout
        self.waiting_log_interval = waiting_log_interval
        self.peer_settle = peer_settle
        self.first_rank = 0
        self.link: NodeLink | None = None
        self.link_settle = 0.0
        self._asked_group_stop = False
        self.shards: list[Child] = []
        self.router: Child | None = None
        self._stop = threading.Event()
        self._signal: int | None = None
        self._signals = 0

    # -- signals ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the supervision loop to stop everything and exit 0 (from any thread)."""
        self._stop.set()

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Only a plain assignment here: the handler runs in the main thread between two
        # bytecodes, possibly while that thread holds the lock inside `Event.wait`, so
        # `Event.set` from here could deadlock (it did: a supervisor hung on SIGTERM in CI).
        # The loops notice within one poll interval.
        if self._signal is None:
            self._signal = signum
        self._signals += 1

    def _stopping(self) -> bool:
        return self._signal is not None or self._stop.is_set()

    def _stop_now(self) -> bool:
        """Whether to stop now on a stop request. A worker node's launcher first asks node
        0's to stop the group and keeps its ranks running, which node 0's drain needs; it
        stops when node 0 ends the group, or on a second signal."""
        if not self._stopping():
            return False
        if self.link is None or self.first_rank == 0 or self._signals > 1:
            self._log_stop_request()
            return True
        if not self._asked_group_stop:
            self._asked_group_stop = True
            self.log.info("Stop requested: asking node 0 to stop the group (again: stop now)")
            self.link.request_stop()
        return False

    def install_signal_handlers(self) -> None:
        """SIGTERM, SIGINT and SIGHUP request a clean stop (main thread only)."""
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, self._on_signal)

    def _log_stop_request(self) -> None:
        if self._signal is not None:
            self.log.info("Received %s, shutting down", signal.Signals(self._signal).name)
        else:
            self.log.info("Stop requested, shutting down")

    # -- starting --------------------------------------------------------------------------

    def start(self, spec: ChildSpec) -> Child:
        """Start one child in its own process group."""
        self.log.info("Starting %s", spec.name)
        try:
            child = Child(spec, self.forwarder)
        except OSError as e:
            raise StartError(f"Could not start {spec.name}: {e}") from e
        self.log.info("%s started (pid %d)", spec.name, child.pid)
        return child

    def start_shards(self, specs: Sequence[ChildSpec]) -> None:
        """Start one child per rank of this node (spec i is rank first_rank + i)."""
        for spec in specs:
            self.shards.append(self.start(spec))

    def start_router(self, spec: ChildSpec) -> None:
        """Start the router (after the shards are ready)."""
        self.router = self.start(spec)

    # -- watching --------------------------------------------------------------------------

    def _shard_failure(self, rank: int, returncode: int) -> str:
        if returncode == -signal.SIGBUS and len(self.shards) > 1:
            return SIGBUS_MESSAGE
        return f"Shard {rank} failed: {describe_status(returncode)}"

    def _dead_shards(self) -> dict[int, int]:
        """Rank -> exit code of every shard that has exited."""
        codes = {self.first_rank + i: shard.poll() for i, shard in enumerate(self.shards)}
        return {rank: code for rank, code in codes.items() if code is not None}

    def _dead_shard(self) -> Outcome | None:
        """The failure to report when a shard has exited: the shard that caused it.

        With several shards, one that loses a peer mid-collective aborts or exits on its own
        within milliseconds (gloo and NCCL raise SIGABRT), and may be seen first. So when every
        dead shard looks like such a follower, the peers get `peer_settle` seconds to show a
        shard killed by another signal, and that one is named.
        """
        dead = self._dead_shards()
        if not dead:
            return None
        deadline = time.monotonic() + self.peer_settle
        while (
            len(dead) < len(self.shards)
            and all(may_follow_a_peer(code) for code in dead.values())
            and time.monotonic() < deadline
        ):
            time.sleep(self.poll_interval / 4)
            dead = self._dead_shards()
        rank, code = min(dead.items(), key=lambda item: (may_follow_a_peer(item[1]), item[0]))
        if self.link is not None:
            return self._settle_with_link(rank, code)
        return Outcome(1, self._shard_failure(rank, code))

    def _group_end(self) -> Outcome | None:
        """How another node ended the group, once it has."""
        end = self.link.group_end() if self.link is not None else None
        if end is None:
            return None
        if end.drain:  # a worker's launcher was asked to stop: as on SIGTERM here
            self.request_stop()
            return None
        if end.exit_code == 0:
            self.log.info("Node 0 stopped the group")
        return Outcome(end.exit_code, end.reason)

    def _settle_with_link(self, rank: int, returncode: int) -> Outcome:
        """A local shard ended in a group over several nodes. When its end may follow a
        peer's (an exit status, SIGABRT), another node's report within ``link_settle``
        seconds names the cause; else a worker's shard that exited 0 was stopped by rank 0
        (a clean end), and any other end is this shard's failure, reported at once."""
        settle = self.link_settle if may_follow_a_peer(returncode) else 0.0
        deadline = time.monotonic() + settle
        while True:
            ended = self._group_end()
            if ended is not None:
                return ended
            if time.monotonic() >= deadline:
                break
            time.sleep(self.poll_interval / 2)
        if returncode == 0 and self.first_rank > 0:
            self.log.info("Shard %d stopped: rank 0 ended the group", rank)
            return Outcome(0)
        return Outcome(1, self._shard_failure(rank, returncode))

    def wait_until_ready(self, probe: ReadyProbe, timeout: float) -> Outcome | None:
        """Poll until every shard is ready; an Outcome if start-up ends otherwise."""
        start = time.monotonic()
        next_log = start + self.waiting_log_interval
        pending = [self.first_rank + i for i in range(len(self.shards))]
        while pending:
            if self._stop_now():
                return Outcome(0)
            failure = self._group_end() or self._dead_shard()
            if failure is not None:
                return failure
            for rank in list(pending):
                if probe(rank):
                    pending.remove(rank)
                    self.log.info("Shard %d ready in %.1f s", rank, time.monotonic() - start)
            if not pending:
                break
            now = time.monotonic()
            if now - start >= timeout:
                return Outcome(
                    1,
                    f"Shard {pending[0]} was not ready after {timeout:g} s "
                    "(--shard-startup-timeout / SHARD_STARTUP_TIMEOUT)",
                )
            if now >= next_log:
                for rank in pending:
                    self.log.info("Waiting for shard %d to be ready...", rank)
                next_log += self.waiting_log_interval
            self._stop.wait(self.poll_interval)
        self.log.info("Shards ready")
        return None

    def watch(self) -> Outcome:
        """Block until a stop is requested (exit 0) or a child exits (exit 1)."""
        while True:
            if self._stop_now():
                return Outcome(0)
            failure = self._group_end() or self._dead_shard()
            if failure is not None:
                return failure
            if self.router is not None:
                returncode = self.router.poll()
                if returncode is not None:
                    return Outcome(1, f"Router exited unexpectedly: {describe_status(returncode)}")
            self._stop.wait(self.poll_interval)

    # -- stopping --------------------------------------------------------------------------

    def _stop_children(self, children: Sequence[Child], timeout: float, what: str) -> list[str]:
        """SIGTERM ``children``, wait up to ``timeout`` (passing on each new signal), then
        SIGKILL what is left of their groups; what went wrong, for the exit reason."""
        running = [child for child in children if child.poll() is None]
        for child in running:
            child.signal_group(signal.SIGTERM)
            child.signal_group(signal.SIGCONT)  # a stopped (SIGSTOP) child acts on it too
        if running:
            self.log.info("Waiting for %s to stop", what)
        problems: list[str] = []
        if not self._wait_passing_signals_on(running, timeout):
            for child in running:
                if child.poll() is None:
                    self.log.warning("%s did not stop after %g s, killing it", child.name, timeout)
                    problems.append(f"{child.name} did not stop within {timeout:g} s: killed")
        for child in children:
            child.kill()  # reaps, and kills whatever is left in the group
            returncode = child.poll()
            if returncode is None:
                self.log.error("%s (pid %d) survived SIGKILL", child.name, child.pid)
                problems.append(f"{child.name} (pid {child.pid}) survived SIGKILL")
            elif child in running:
                self.log.info("%s stopped: %s", child.name, describe_status(returncode))
                if returncode != 0 and returncode != -signal.SIGKILL:
                    problems.append(f"{child.name} stopped with {describe_status(returncode)}")
        return problems

    def _wait_passing_signals_on(self, children: Sequence[Child], timeout: float) -> bool:
        """Wait until every child has exited (True) or ``timeout`` passes; a signal the
        launcher gets meanwhile is passed on to the children's groups as SIGTERM."""
        deadline = time.monotonic() + timeout
        seen = self._signals
        while any(child.poll() is None for child in children):
            if time.monotonic() >= deadline:
                return False
            if self._signals != seen:
                seen = self._signals
                self.log.info("Signal received again: passing it on")
                for child in children:
                    child.signal_group(signal.SIGTERM)
            for child in children:
                child.wait(min(self.poll_interval, max(deadline - time.monotonic(), 0.0)))
        return True

    def shutdown(self) -> list[str]:
        """Stop the router (graceful, then forced), then the shards; wait for their output.
        What went wrong on the way (nothing: a clean stop)."""
        problems: list[str] = []
        if self.router is not None:
            problems += self._stop_children([self.router], self.router_stop_timeout, "the router")
        if self.shards:
            problems += self._stop_children(self.shards, self.shard_stop_timeout, "the shards")
        for child in [*self.shards, *([self.router] if self.router else [])]:
            child.join_output(timeout=1.0)
        self.log.info("Shutdown complete")
        return problems

    # -- the whole lifecycle ---------------------------------------------------------------

    def run(
        self,
        shards: Sequence[ChildSpec],
        router: ChildSpec | None,
        probe: ReadyProbe,
        startup_timeout: float,
        *,
        handle_signals: bool = True,
        group: NodeGroup | None = None,
    ) -> Outcome:
        """Start shards, wait for them, start the router (none: a worker node), watch; always
        stop everything, then tell the other nodes (if any) how it ended."""
        if group is not None:
            self.first_rank, self.link, self.link_settle = (
                group.first_rank,
                group.link,
                group.settle,
            )
        if handle_signals:
            self.install_signal_handlers()
        outcome = Outcome(1, "the launcher was interrupted")
        try:
            try:
                self.start_shards(shards)
                failed = self.wait_until_ready(probe, startup_timeout)
                if failed is None and router is not None:
                    self.start_router(router)
                outcome = failed or self.watch()
            except StartError as e:
                outcome = Outcome(1, str(e))
            if outcome.reason:
                self.log.error("%s", outcome.reason)
        finally:
            problems = self.shutdown()
        if outcome.exit_code == 0 and problems:
            outcome = Outcome(1, "; ".join(problems))
            self.log.error("Stopped uncleanly: %s", outcome.reason)
        if self.link is not None:
            self.link.finish(outcome.exit_code, outcome.reason)
        return outcome
