"""The form of the forward a native runner runs, decided and prepared at start-up: the
compiled forward (``graphs/compiled.py``) or the eager one, the eager one with its weights
packed for oneDNN on the CPU (``linear/cpu_gemm.py``), the compiled step compiled before the
first request, and CUDA graphs of the decode and verify steps (``graphs/cuda_graphs.py``).

With tensor parallelism every rank makes the same choices, and where a rank's start-up work
can fail alone (compiling, capturing) the ranks agree on the outcome before going on
(``distributed.first_failure``): all compiled or all eager, all with graphs or all without.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable

import torch

from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.cpu_threads import CpuThreads
from tgis.shard.device import dtype_name
from tgis.shard.errors import StartupError
from tgis.shard.native.graphs.compiled import CompiledForward, should_compile
from tgis.shard.native.linear.cpu_gemm import PRIMITIVE_CACHE_VARIABLES, packing_available
from tgis.shard.native.models import CausalLM, ForwardFn
from tgis.shard.native.models.decoder import DecoderLM
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.parallel.collective_op import rank_local
from tgis.shard.parallel.distributed import first_failure
from tgis.shard.parallel.group import SINGLE, TensorParallel
from tgis.shard_api.messages import DEFAULT_MAX_BATCH_SIZE

log = logging.getLogger(__name__)


def choose_forward(model: CausalLM, device: torch.device, engine: EngineSettings) -> ForwardFn:
    """The compiled forward (``compiled.py``: on CUDA, or with ``TGIS_COMPILE=1``), else the
    eager one; on every rank of a tensor-parallel group alike (its all-reduces are inside
    the compiled graph, ``parallel/collective_op.py``): every rank decides alike from the
    same settings, model and device type."""
    try:
        mode = engine.compile_switch
    except ValueError as e:
        raise StartupError(str(e)) from None
    if should_compile(device, mode) and isinstance(model, DecoderLM):
        return CompiledForward(model)
    log.info("The step runs eagerly (TGIS_COMPILE=%s)", mode)
    return model.forward


def pack_cpu_weights(
    model: CausalLM, forward: object, device: torch.device, dtype: torch.dtype
) -> None:
    """On the CPU, with the eager forward, put the linear layers' weights in oneDNN's
    layout (``cpu_gemm.py``)."""
    if device.type != "cpu" or isinstance(forward, CompiledForward):
        return
    if not isinstance(model, DecoderLM) or not packing_available(dtype):
        log.info("Linear layers: dense %s weights (no oneDNN packing for them)", dtype_name(dtype))
        return
    started = time.monotonic()
    count = model.pack_linear_weights()
    log.info(
        "Linear layers: %d weights packed for oneDNN (%s) in %.1f s; primitive caches of %s",
        count,
        dtype_name(dtype),
        time.monotonic() - started,
        " and ".join(f"{name}={os.environ.get(name)}" for name in PRIMITIVE_CACHE_VARIABLES),
    )


def compile_step(
    runner: ModelRunner, model: CausalLM, engine: EngineSettings, tp: TensorParallel = SINGLE
) -> None:
    """Where the runner's forward is compiled, compile its step now (``ModelRunner.warm_up``);
    on failure run it eagerly, unless ``TGIS_COMPILE=1`` made compiling a requirement.

    With tensor parallelism each rank warms up with its collectives rank-local
    (``collective_op.rank_local``: no rank waits in an all-reduce for a peer whose
    compilation failed), then the ranks agree: if any rank failed, every rank runs eagerly
    (or every rank fails under ``TGIS_COMPILE=1``)."""
    if not isinstance(runner.forward, CompiledForward):
        return
    started = time.monotonic()
    with rank_local() if tp.is_parallel else contextlib.nullcontext():
        failure = _agreed(tp, functools.partial(_warm_up_every_thread_count, runner))
    if failure and engine.compile_switch == "on":
        raise StartupError(f"compiling the step failed (TGIS_COMPILE=1): {failure}")
    if failure:
        log.warning("Compiling the step failed, running it eagerly: %s", failure)
        runner.reset()  # a warm-up that failed midway leaves its sequence behind
        runner.forward = model.forward
    else:
        log.info("Compiled the step in %.1f s", time.monotonic() - started)


def _warm_up_every_thread_count(runner: ModelRunner) -> None:
    """``runner.warm_up`` under each intra-op thread count its steps may use on the CPU
    (``cpu_threads.py``): a compiled graph is guarded on the count (inductor's CPU kernels
    are generated for it), so a count first met while serving would compile then, on
    that rank alone, while its peers wait in their first all-reduce."""
    threads = runner.threads
    counts = (None,) if threads is None else tuple(sorted({threads.small, threads.large}))
    try:
        for count in counts:
            if count is not None:
                runner.threads = CpuThreads(count, count)
            runner.warm_up()
    finally:
        runner.threads = threads


def capture_decode_graphs(runner: ModelRunner, config: ShardConfig, tp: TensorParallel) -> None:
    """CUDA graphs of the decode steps, and of the verify steps when the router drafts
    (``cuda_graphs.py``), where they apply: CUDA, ``triton_paged``, ``TGIS_CUDA_GRAPHS``
    not 0. Tensor-parallel ranks capture their NCCL all-reduces into the graphs (every rank
    the same buckets in the same order, so the collectives of the capture's warm-up runs
    and of the check pair up) and keep the graphs only if every rank captured and checked
    them."""
    from tgis.shard.native.graphs.cuda_graphs import DecodeGraphs, graph_buckets

    try:
        mode = config.engine.graphs_switch
    except ValueError as e:
        raise StartupError(str(e)) from None
    applies = runner.device.type == "cuda" and runner.attention.name == "triton_paged"
    if mode == "off" or not applies:
        if mode == "on" and not applies:
            log.warning("TGIS_CUDA_GRAPHS=1 ignored: graphs need CUDA and triton_paged")
        return
    max_batch = min(config.max_batch_size or DEFAULT_MAX_BATCH_SIZE, runner.info.num_blocks)
    sets = [(1, max_batch)]
    width = 1 + config.speculate
    if config.speculate and width <= getattr(runner.attention, "prefill_tile", 0):
        sets.append((width, min(max_batch, config.speculator_max_batch_size)))
    elif config.speculate:
        log.warning("No verify CUDA graphs: %d drafts exceed one query tile", config.speculate)
    pool = torch.cuda.graph_pool_handle()
    for rows, batch in sets:
        what = "decode" if rows == 1 else f"verify ({rows - 1} drafts)"
        graphs = DecodeGraphs(
            runner.forward,
            runner.kv_cache,
            runner.device,
            graph_buckets(batch),
            config.max_sequence_length,
            runner.info.vocab_size,
            rows,
        )
        started = time.monotonic()
        reason = _agreed(tp, functools.partial(graphs.capture, pool)) or _agreed(tp, graphs.verify)
        seconds = time.monotonic() - started
        if reason:
            if mode == "on":
                raise StartupError(f"capturing the {what} CUDA graphs failed: {reason}") from None
            log.warning("Capturing the %s CUDA graphs failed, running without: %s", what, reason)
            return
        runner.graph_sets += (graphs,)
        log.info(
            "Captured %s CUDA graphs for %d batch sizes (1 to %d) in %.1f s",
            what,
            len(graphs.buckets),
            graphs.max_batch,
            seconds,
        )


def _agreed(tp: TensorParallel, work: Callable[[], object]) -> str:
    """Run ``work`` on this rank; "" if it succeeded on every rank, else the first failing
    rank's reason (one line; on one rank, without the rank's number)."""
    error = ""
    try:
        work()
    except Exception as e:
        error = " ".join(str(e).split())[:300] or type(e).__name__
    return first_failure(tp, error)
