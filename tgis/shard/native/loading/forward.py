"""The form of the forward a native runner runs, decided and prepared at start-up: the
compiled forward (``graphs/compiled.py``) or the eager one, the eager one with its weights
packed for oneDNN on the CPU (``linear/cpu_gemm.py``), the compiled step compiled before the
first request, and CUDA graphs of the decode and verify steps (``graphs/cuda_graphs.py``).
"""

from __future__ import annotations

import logging
import os
import time

import torch

from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.device import dtype_name
from tgis.shard.errors import StartupError
from tgis.shard.native.graphs.compiled import CompiledForward, should_compile
from tgis.shard.native.linear.cpu_gemm import PRIMITIVE_CACHE_VARIABLES, packing_available
from tgis.shard.native.models import CausalLM, ForwardFn
from tgis.shard.native.models.decoder import DecoderLM
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.parallel.group import TensorParallel
from tgis.shard_api.messages import DEFAULT_MAX_BATCH_SIZE

log = logging.getLogger(__name__)


def choose_forward(
    model: CausalLM, tp: TensorParallel, device: torch.device, engine: EngineSettings
) -> ForwardFn:
    """The compiled forward (``compiled.py``: on CUDA, or with ``TGIS_COMPILE=1``), else the
    eager one; tensor parallelism always runs eagerly (its collectives are outside graphs)."""
    try:
        mode = engine.compile_switch
    except ValueError as e:
        raise StartupError(str(e)) from None
    if should_compile(device, mode) and isinstance(model, DecoderLM) and not tp.is_parallel:
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


def compile_step(runner: ModelRunner, model: CausalLM, engine: EngineSettings) -> None:
    """Where the runner's forward is compiled, compile its step now (``ModelRunner.warm_up``);
    on failure run it eagerly, unless ``TGIS_COMPILE=1`` made compiling a requirement."""
    if not isinstance(runner.forward, CompiledForward):
        return
    started = time.monotonic()
    try:
        runner.warm_up()
    except Exception as e:
        if engine.compile_switch == "on":
            raise StartupError(f"compiling the step failed (TGIS_COMPILE=1): {e}") from e
        log.warning("Compiling the step failed, running it eagerly: %s", e)
        runner.forward = model.forward
    else:
        log.info("Compiled the step in %.1f s", time.monotonic() - started)


def capture_decode_graphs(runner: ModelRunner, config: ShardConfig, tp: TensorParallel) -> None:
    """CUDA graphs of the decode steps, and of the verify steps when the router drafts
    (``cuda_graphs.py``), where they apply: CUDA, ``triton_paged``, one rank,
    ``TGIS_CUDA_GRAPHS`` not 0."""
    from tgis.shard.native.graphs.cuda_graphs import DecodeGraphs, graph_buckets

    try:
        mode = config.engine.graphs_switch
    except ValueError as e:
        raise StartupError(str(e)) from None
    applies = (
        runner.device.type == "cuda"
        and runner.attention.name == "triton_paged"
        and not tp.is_parallel
    )
    if mode == "off" or not applies:
        if mode == "on" and not applies:
            log.warning("TGIS_CUDA_GRAPHS=1 ignored: graphs need CUDA, triton_paged, one rank")
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
        try:
            seconds = graphs.capture(pool)
            graphs.verify()
        except Exception as e:
            reason = " ".join(str(e).split())[:300]
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
