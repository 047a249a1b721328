"""The launcher's start-up sequence: validate, prepare the tokenizer, run the supervisor.

With ``--nnodes`` above 1 it runs this node's ranks only (``nodes.py``): node 0 also runs the
router and listens for the other nodes' launchers, which run shards only and link to it
(``node_link.py``)."""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tgis import __version__
from tgis.launcher.children import ChildSpec
from tgis.launcher.commands import (
    ROUTER_PROGRAM,
    SHARD_PROGRAM,
    find_program,
    router_argv,
    router_env,
    shard_argv,
    shard_env,
    shard_socket_path,
)
from tgis.launcher.config import ConfigError, LauncherConfig, NodePlacement
from tgis.launcher.environment import log_ignored_env
from tgis.launcher.health import shard_is_ready
from tgis.launcher.logs import setup_logging
from tgis.launcher.node_link import LINK_PORT_OFFSET, LeaderLink, NodeLink, WorkerLink
from tgis.launcher.output import OutputForwarder
from tgis.launcher.resolution import resolve
from tgis.launcher.supervisor import NodeGroup, Supervisor
from tgis.launcher.tokenizer import TokenizerFile, prepare_tokenizer
from tgis.shard_api.channel import step_channel_path
from tgis.termination import fail_startup
from tgis.termination_log import termination_log_path, write_termination_log

ROUTER_STOP_MARGIN_S = 15.0
"""After its grace period, how long the router may take to stop before it is killed (it
needs a few seconds: shutdown.py, END_WAIT_S and SERVER_STOP_S, then the tracing flush)."""


def remove_sockets(paths: Sequence[str], log: logging.Logger, *, strict: bool) -> None:
    """Delete socket files left by an earlier run (strict: failing to is a start-up error)."""
    for path in paths:
        try:
            os.unlink(path)
            log.debug("Removed socket %s", path)
        except FileNotFoundError:
            pass
        except OSError as e:
            if strict:
                fail_startup(f"cannot remove stale shard socket {path}: {e}")
            log.warning("Could not remove socket %s: %s", path, e)


def report_failure(reason: str) -> None:
    """Put `reason` in the termination log, after whatever a shard already wrote there."""
    try:
        with open(termination_log_path(), encoding="utf-8") as f:
            earlier = f.read().strip()
    except (OSError, ValueError):
        earlier = ""
    write_termination_log(f"{earlier}\n{reason}" if earlier else reason)


def env_command(argv: Sequence[str], env: Mapping[str, str] | None, base: Mapping[str, str]) -> str:
    """A runnable shell line: `env [-u VAR] VAR=value ... argv` with only what differs from base."""
    if env is None:
        return shlex.join(argv)
    words = ["env"]
    words += [w for var in sorted(set(base) - set(env)) for w in ("-u", var)]
    words += [f"{var}={value}" for var, value in sorted(env.items()) if base.get(var) != value]
    return shlex.join([*words, *argv])


@dataclass(frozen=True)
class Plan:
    """What this node's launcher runs: its shards (ranks ``node.ranks``, their sockets by
    rank), and on node 0 the router with its tokenizer file (None on the other nodes)."""

    node: NodePlacement
    shards: list[ChildSpec]
    sockets: dict[int, str]
    router: ChildSpec | None
    tokenizer: TokenizerFile | None


def _prepare(flags: LauncherConfig, log: logging.Logger) -> Plan:
    """Validate everything and build the child specs; ConfigError on any bad setting."""
    cfg = resolve(flags, os.environ, log)
    node = cfg.node
    shard_program = find_program(SHARD_PROGRAM)
    sockets = {rank: shard_socket_path(flags.shard_uds_path, rank) for rank in node.ranks}
    argv = shard_argv(shard_program, cfg)
    shards = [
        ChildSpec(f"Shard {rank}", argv, shard_env(cfg, rank, os.environ)) for rank in node.ranks
    ]
    if not node.is_leader:
        return Plan(node, shards, sockets, None, None)
    router_program = find_program(ROUTER_PROGRAM)
    tokenizer = prepare_tokenizer(cfg.model_dir, log, trust_remote_code=flags.trust_remote_code)
    router = ChildSpec(
        "Router", router_argv(router_program, cfg, tokenizer.path), router_env(cfg, os.environ)
    )
    return Plan(node, shards, sockets, router, tokenizer)


def open_link(flags: LauncherConfig, node: NodePlacement, log: logging.Logger) -> NodeLink | None:
    """The link to the other nodes' launchers (None on a single node)."""
    if not node.multinode:
        return None
    port = flags.master_port + LINK_PORT_OFFSET
    if node.is_leader:
        try:
            link: NodeLink = LeaderLink(port, node.nnodes, log)
        except OSError as e:
            fail_startup(f"cannot listen for the other nodes' launchers on port {port}: {e}")
        log.info(
            "Node 0 of %d: waiting for the other nodes' launchers on port %d", node.nnodes, port
        )
        return link
    log.info(
        "Node %d of %d: ranks %d-%d, linking to node 0 at %s:%d",
        node.node_rank,
        node.nnodes,
        node.ranks.start,
        node.ranks.stop - 1,
        flags.master_addr,
        port,
    )
    return WorkerLink(flags.master_addr, port, node.node_rank, flags.shard_startup_timeout, log)


def launch(flags: LauncherConfig, *, dry_run: bool = False) -> int:
    """Run the launcher with parsed flags; returns the process exit code."""
    log = setup_logging(flags.json_output)
    log.info("TGIS launcher %s", __version__)
    if os.environ.get("GIT_COMMIT_HASH"):
        log.info("TGIS Commit hash: %s", os.environ["GIT_COMMIT_HASH"])
    log.info("Args: %s", flags)
    log_ignored_env(os.environ, log)
    try:
        plan = _prepare(flags, log)
    except ConfigError as e:
        fail_startup(str(e))
    sockets = plan.sockets

    if dry_run:
        for spec in [*plan.shards, *([plan.router] if plan.router else [])]:
            print(f"{spec.name}: {env_command(spec.argv, spec.env, os.environ)}", flush=True)
        if plan.tokenizer is not None:
            plan.tokenizer.cleanup()
        return 0

    owned = [*sockets.values(), *(step_channel_path(s) for s in sockets.values())]
    try:
        remove_sockets(owned, log, strict=True)
        supervisor = Supervisor(
            log,
            OutputForwarder(flags.json_output),
            # The router drains for the grace period, then needs a moment to stop.
            router_stop_timeout=flags.shutdown_grace_period + ROUTER_STOP_MARGIN_S,
        )
        link = open_link(flags, plan.node, log)
        outcome = supervisor.run(
            plan.shards,
            plan.router,
            probe=lambda rank: shard_is_ready(sockets[rank]),
            startup_timeout=flags.shard_startup_timeout,
            group=NodeGroup(plan.node.ranks.start, link) if link is not None else None,
        )
    finally:
        remove_sockets(owned, log, strict=False)
        if plan.tokenizer is not None:
            plan.tokenizer.cleanup()
    if outcome.reason:
        report_failure(outcome.reason)
    return outcome.exit_code
