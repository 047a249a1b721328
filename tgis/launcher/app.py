"""The launcher's start-up sequence: validate, prepare the tokenizer, run the supervisor."""

from __future__ import annotations

import logging
import os
import shlex
from collections.abc import Mapping, Sequence

from tgis import __version__
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
from tgis.launcher.config import ConfigError, LauncherConfig
from tgis.launcher.environment import log_ignored_env
from tgis.launcher.health import shard_is_ready
from tgis.launcher.logs import setup_logging
from tgis.launcher.output import OutputForwarder
from tgis.launcher.resolution import resolve
from tgis.launcher.supervisor import ChildSpec, Supervisor
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


def _prepare(
    flags: LauncherConfig, log: logging.Logger
) -> tuple[list[ChildSpec], ChildSpec, list[str], TokenizerFile]:
    """Validate everything and build the child specs; ConfigError on any bad setting."""
    cfg = resolve(flags, os.environ, log)
    shard_program = find_program(SHARD_PROGRAM)
    router_program = find_program(ROUTER_PROGRAM)
    tokenizer = prepare_tokenizer(cfg.model_dir, log, trust_remote_code=flags.trust_remote_code)
    sockets = [shard_socket_path(flags.shard_uds_path, rank) for rank in range(cfg.num_shard)]
    argv = shard_argv(shard_program, cfg)
    shards = [
        ChildSpec(f"Shard {rank}", argv, shard_env(cfg, rank, os.environ))
        for rank in range(cfg.num_shard)
    ]
    router = ChildSpec(
        "Router", router_argv(router_program, cfg, tokenizer.path), router_env(cfg, os.environ)
    )
    return shards, router, sockets, tokenizer


def launch(flags: LauncherConfig, *, dry_run: bool = False) -> int:
    """Run the launcher with parsed flags; returns the process exit code."""
    log = setup_logging(flags.json_output)
    log.info("TGIS launcher %s", __version__)
    if os.environ.get("GIT_COMMIT_HASH"):
        log.info("TGIS Commit hash: %s", os.environ["GIT_COMMIT_HASH"])
    log.info("Args: %s", flags)
    log_ignored_env(os.environ, log)
    try:
        shards, router, sockets, tokenizer = _prepare(flags, log)
    except ConfigError as e:
        fail_startup(str(e))

    if dry_run:
        for spec in [*shards, router]:
            print(f"{spec.name}: {env_command(spec.argv, spec.env, os.environ)}", flush=True)
        tokenizer.cleanup()
        return 0

    owned = [*sockets, *(step_channel_path(s) for s in sockets)]
    try:
        remove_sockets(owned, log, strict=True)
        supervisor = Supervisor(
            log,
            OutputForwarder(flags.json_output),
            # The router drains for the grace period, then needs a moment to stop.
            router_stop_timeout=flags.shutdown_grace_period + ROUTER_STOP_MARGIN_S,
        )
        outcome = supervisor.run(
            shards,
            router,
            probe=lambda rank: shard_is_ready(sockets[rank]),
            startup_timeout=flags.shard_startup_timeout,
        )
    finally:
        remove_sockets(owned, log, strict=False)
        tokenizer.cleanup()
    if outcome.reason:
        report_failure(outcome.reason)
    return outcome.exit_code
