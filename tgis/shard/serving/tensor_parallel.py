"""Serve one rank of a tensor-parallel model until SIGTERM; returns the exit code.

Rank 0 serves the router's `ShardService` on `{uds}-0` through a `LockstepRunner`, which
broadcasts every Step, Reset, Health and PrefixLookup to the other ranks. Ranks > 0 run
`run_worker` on a thread and serve only `Info` and `Health` on their own socket
`{uds}-{rank}` (the launcher's readiness check); `Step`, `Reset` and `PrefixLookup` there
are refused.

Shutdown: the launcher sends SIGTERM to every rank (a rank whose launcher is gone acts as if
it had). Rank 0 stops its gRPC server (in-flight
Steps finish), then broadcasts Stop; each worker leaves its loop on Stop, stops its server,
destroys the process group and exits 0. A worker whose Stop does not come within
`STOP_WAIT_S` of its own SIGTERM (rank 0 hung) exits anyway; a worker whose rank 0 vanished
(its collective fails) exits 1, as does rank 0 when the ranks leave lock-step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading

from tgis.shard.errors import InvalidStepError, StartupError
from tgis.shard.native.runtime.lockstep import LockstepRunner, run_worker
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.parallel.distributed import destroy, first_line
from tgis.shard.parallel.group import TensorParallel
from tgis.shard.serving.server import ShardServer
from tgis.shard.step.runner import Runner
from tgis.shard_api.messages import AdapterInfo, PrefixInfo, ShardInfo, StepOutput, StepPlan
from tgis.stop_requests import launcher_pid, wait_until_orphaned

log = logging.getLogger(__name__)

STOP_WAIT_S = 8.0
"""How long a worker waits, after its own SIGTERM, for rank 0's Stop."""


def native_runner(runner: Runner) -> ModelRunner:
    """The runner if it is the native engine's; StartupError otherwise (the transformers
    fallback has no tensor-parallel layers)."""
    if not isinstance(runner, ModelRunner):
        raise StartupError(
            "more than one shard needs the native engine; the transformers fallback "
            "(TGIS_ENGINE=hf) runs on a single shard"
        )
    return runner


async def serve_rank(runner: ModelRunner, tp: TensorParallel, socket_path: str) -> int:
    """Serve this rank until SIGTERM/SIGINT (or failure); the process exit code."""
    if tp.rank == 0:
        return await _serve_rank0(runner, tp, socket_path)
    return await _serve_worker(runner, tp, socket_path)


async def _serve_rank0(runner: ModelRunner, tp: TensorParallel, socket_path: str) -> int:
    lockstep = LockstepRunner(runner, tp, on_fatal=_stop_this_process)
    server = ShardServer(lockstep, socket_path, tp.rank)
    try:
        await server.serve_until_signal()
    finally:
        await asyncio.to_thread(lockstep.close)
        destroy()
    return 1 if lockstep.failed else 0


def _stop_this_process() -> None:
    """Ask the serving loop to stop (its SIGTERM handler), from any thread."""
    os.kill(os.getpid(), signal.SIGTERM)


class WorkerRunner:
    """What a rank > 0 serves on its own socket: Info, and Health while its loop runs."""

    def __init__(self, runner: ModelRunner, loop_thread: threading.Thread, rank: int) -> None:
        self.runner = runner
        self.loop_thread = loop_thread
        self.rank = rank

    @property
    def info(self) -> ShardInfo:
        """This rank's facts."""
        return self.runner.info

    def health(self) -> None:
        """Raise when the rank has left the group or its device does not answer."""
        if not self.loop_thread.is_alive():
            raise RuntimeError(f"rank {self.rank} is not running rank 0's commands")
        self.runner.health()

    def step(self, plan: StepPlan) -> StepOutput:
        """Refused: Steps reach this rank from rank 0."""
        raise InvalidStepError(f"rank {self.rank} does not serve Step; rank 0 does")

    def reset(self) -> None:
        """Refused, as Step."""
        raise InvalidStepError(f"rank {self.rank} does not serve Reset; rank 0 does")

    def lookup_prefix(self, prefix_id: str) -> PrefixInfo:
        """Refused, as Step: rank 0 loads prefixes on every rank."""
        raise InvalidStepError(f"rank {self.rank} does not serve PrefixLookup; rank 0 does")

    def lookup_adapter(self, adapter_id: str) -> AdapterInfo:
        """Refused, as Step: rank 0 loads adapters on every rank."""
        raise InvalidStepError(f"rank {self.rank} does not serve AdapterLookup; rank 0 does")


async def _serve_worker(runner: ModelRunner, tp: TensorParallel, socket_path: str) -> int:
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    stop = asyncio.Event()
    exit_code = [0]

    def work() -> None:
        try:
            run_worker(runner, tp)
        except Exception as e:
            log.error("Rank %d left the tensor-parallel group: %s", tp.rank, first_line(e))
            exit_code[0] = 1
        finally:
            loop.call_soon_threadsafe(ended.set)

    thread = threading.Thread(target=work, name=f"rank-{tp.rank}", daemon=True)
    server = ShardServer(
        WorkerRunner(runner, thread, tp.rank), socket_path, tp.rank, serves_steps=False
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    thread.start()
    await server.start()
    waiters = [
        asyncio.create_task(stop.wait()),
        asyncio.create_task(ended.wait()),
        # the launcher gone: as SIGTERM (rank 0 sees it too, and sends Stop)
        asyncio.create_task(wait_until_orphaned(launcher_pid(os.environ))),
    ]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in waiters:
        task.cancel()
    if not ended.is_set():
        log.info("Shard %d shutting down, waiting for rank 0's stop", tp.rank)
        try:
            await asyncio.wait_for(ended.wait(), STOP_WAIT_S)
        except TimeoutError:
            log.warning("Rank %d: no stop from rank 0 after %g s, exiting", tp.rank, STOP_WAIT_S)
    await server.stop(0)
    if thread.is_alive():  # blocked in a collective that will never end: leave without it
        logging.shutdown()
        os._exit(exit_code[0])
    destroy()
    return exit_code[0]
