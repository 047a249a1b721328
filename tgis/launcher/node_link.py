"""The link between the launchers of one tensor-parallel group spread over several nodes.

Node 0's launcher (the leader) listens on ``--master-port`` + 1; every other node's launcher
(a worker) connects to it at ``--master-addr`` and says which node it is. When a launcher's
supervision ends, it sends the others how: its exit code and reason, one JSON line. So a
shard that fails on any node ends every node's launcher, each naming the node and rank that
failed, as a local shard's failure does:

- a worker's end (a shard failed, a signal, ...) ends the leader with "node N: <reason>"
  (even a clean one: the group cannot serve without the worker's ranks);
- the leader's end ends every worker: exit 0 when the leader stopped cleanly (its shards
  told theirs to stop), else 1 with "node 0: <reason>";
- a worker's launcher asked to stop (SIGTERM: its pod deleted, the group rolled out) asks
  node 0's to stop the group, and keeps its ranks running meanwhile: node 0 drains its
  in-flight requests, which need every rank, then stops rank 0, which stops the others;
- a link that closes without that line (a launcher killed, its node gone) ends the other
  side with "lost contact with node N's launcher"; TCP keepalive probes notice a silent
  peer (a node that lost power or its network) within ``KEEPALIVE_S`` seconds.

The link carries nothing else: the shards' own group (torch.distributed) carries the model's
collectives, and rank 0's socket on the leader is the only one the router talks to.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO, Protocol

LINK_PORT_OFFSET = 1
"""The leader's link listens on ``--master-port`` + this."""

KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
KEEPALIVE_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES
"""At most this many seconds pass before a silent peer's link counts as lost."""

CONNECT_RETRY_S = 0.5


@dataclass(frozen=True)
class GroupEnd:
    """How another node ended the group: the exit code this launcher should end with, and
    the reason (None: a clean stop)."""

    exit_code: int
    reason: str | None = None
    drain: bool = False  # not an end yet: stop the group as on SIGTERM (node 0 only)


class NodeLink(Protocol):
    """Either side of the link, as the supervisor uses it."""

    def group_end(self) -> GroupEnd | None:
        """How another node ended the group, once it has."""

    def finish(self, exit_code: int, reason: str | None) -> None:
        """Tell the other side how this node ended."""

    def request_stop(self) -> None:
        """A worker: ask node 0 to stop the group (node 0: nothing)."""


def _keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _send(sock: socket.socket, message: dict[str, object]) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(json.dumps(message).encode() + b"\n")


def _read_end(
    lines: BinaryIO, on_stop_request: Callable[[], None] | None = None
) -> dict[str, object] | None:
    """The peer's end line, or None when the link closes (or breaks) without one; a stop
    request on the way calls ``on_stop_request``."""
    with contextlib.suppress(OSError):
        for line in lines:
            with contextlib.suppress(ValueError):
                message = json.loads(line)
                if isinstance(message, dict) and message.get("end"):
                    return message
                if isinstance(message, dict) and message.get("stop") and on_stop_request:
                    on_stop_request()
    return None


def end_message(node_rank: int, exit_code: int, reason: str | None) -> dict[str, object]:
    """The line a launcher sends when its supervision ends."""
    return {"end": True, "node": node_rank, "exit_code": exit_code, "reason": reason}


class LeaderLink:
    """Node 0's side: accept the workers, and end when any of them does."""

    def __init__(self, port: int, nnodes: int, log: logging.Logger) -> None:
        self.nnodes = nnodes
        self.log = log
        self._lock = threading.Lock()
        self._workers: dict[int, socket.socket] = {}
        self._end: GroupEnd | None = None
        self._closed = False
        if socket.has_dualstack_ipv6():
            self._server = socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False
            )
        else:
            self._server = socket.create_server(("", port))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, name="node-link", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, address = self._server.accept()
            except OSError:
                return  # closed
            _keepalive(sock)
            host = str(address[0]).removeprefix("::ffff:")  # an IPv4 peer on a dual-stack port
            threading.Thread(
                target=self._serve, args=(sock, host), name="node-link-peer", daemon=True
            ).start()

    def _serve(self, sock: socket.socket, address: str) -> None:
        with sock.makefile("rb") as lines:
            try:
                hello = json.loads(lines.readline() or b"{}")
            except (OSError, ValueError):
                hello = {}
            node = hello.get("node") if isinstance(hello, dict) else None
            if not isinstance(node, int) or not 0 < node < self.nnodes:
                self.log.warning("Node link: ignoring a connection from %s (%r)", address, hello)
                sock.close()
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._workers[node] = sock
            self.log.info("Node %d's launcher linked from %s", node, address)
            end = _read_end(lines, lambda: self._stop_requested_by(node))
        if end is None:
            reason = f"lost contact with node {node}'s launcher ({address})"
        else:
            detail = end.get("reason") or "its launcher stopped"
            reason = f"node {node}: {detail}"
        with self._lock:
            if self._closed:
                return
            if self._end is None or self._end.drain:
                self._end = GroupEnd(1, reason)

    def _stop_requested_by(self, node: int) -> None:
        self.log.info("Node %d's launcher was asked to stop: stopping the group", node)
        with self._lock:
            if self._end is None:
                self._end = GroupEnd(0, None, drain=True)

    def group_end(self) -> GroupEnd | None:
        """Set once a worker's launcher has ended (or its link was lost); a drain (once)
        when a worker's launcher was asked to stop."""
        with self._lock:
            end = self._end
            if end is not None and end.drain:
                self._end = None
            return end

    def request_stop(self) -> None:
        """Nothing: node 0 stops the group itself."""

    def finish(self, exit_code: int, reason: str | None) -> None:
        """Tell every linked worker how the leader ended, and close the link."""
        with self._lock:
            self._closed = True
            workers = list(self._workers.values())
        with contextlib.suppress(OSError):
            self._server.close()
        for sock in workers:
            _send(sock, end_message(0, exit_code, reason))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class WorkerLink:
    """A worker's side: connect to node 0's launcher (retrying until ``connect_timeout``),
    and end when it does."""

    def __init__(
        self,
        address: str,
        port: int,
        node_rank: int,
        connect_timeout: float,
        log: logging.Logger,
    ) -> None:
        self.address = address
        self.port = port
        self.node_rank = node_rank
        self.connect_timeout = connect_timeout
        self.log = log
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._end: GroupEnd | None = None
        self._closed = threading.Event()
        threading.Thread(target=self._run, name="node-link", daemon=True).start()

    def _connect(self) -> socket.socket | None:
        deadline = time.monotonic() + self.connect_timeout
        last = "no attempt"
        while not self._closed.is_set() and time.monotonic() < deadline:
            try:
                sock = socket.create_connection((self.address, self.port), timeout=5.0)
            except OSError as e:
                last = str(e)
                self._closed.wait(CONNECT_RETRY_S)
                continue
            sock.settimeout(None)
            _keepalive(sock)
            return sock
        if not self._closed.is_set():
            self._set_end(
                GroupEnd(
                    1,
                    f"could not reach node 0's launcher at {self.address}:{self.port} within "
                    f"{self.connect_timeout:g} s ({last})",
                )
            )
        return None

    def _run(self) -> None:
        sock = self._connect()
        if sock is None:
            return
        with self._lock:
            if self._closed.is_set():
                sock.close()
                return
            self._sock = sock
        _send(sock, {"node": self.node_rank})
        self.log.info("Linked to node 0's launcher at %s:%d", self.address, self.port)
        with sock.makefile("rb") as lines:
            end = _read_end(lines)
        if end is None:
            self._set_end(GroupEnd(1, f"lost contact with node 0's launcher ({self.address})"))
        elif end.get("exit_code") == 0:
            self._set_end(GroupEnd(0, None))
        else:
            self._set_end(GroupEnd(1, f"node 0: {end.get('reason') or 'the group failed'}"))

    def _set_end(self, end: GroupEnd) -> None:
        with self._lock:
            if self._end is None and not self._closed.is_set():
                self._end = end

    def group_end(self) -> GroupEnd | None:
        """Set once node 0's launcher has ended (or the link was lost, or never made)."""
        with self._lock:
            return self._end

    def request_stop(self) -> None:
        """Ask node 0's launcher to stop the group (drained, as on its own SIGTERM)."""
        with self._lock:
            sock = self._sock
        if sock is not None:
            _send(sock, {"stop": True})

    def finish(self, exit_code: int, reason: str | None) -> None:
        """Tell node 0's launcher how this node ended, and close the link."""
        with self._lock:
            self._closed.set()
            sock = self._sock
        if sock is not None:
            _send(sock, end_message(self.node_rank, exit_code, reason))
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
