"""Build a ready runner from a ShardConfig: find the model, choose its engine
(``engines.py``) and let that engine's loader load it (``native/loading/loader.py``,
``fallback/loader.py``)."""

from __future__ import annotations

from pathlib import Path

from tgis.model_files import resolve_model_dir
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.quantized.readers import layout_reader
from tgis.shard.checkpoints.quantized.scheme import checkpoint_scheme, resolve_quantization
from tgis.shard.config import ShardConfig
from tgis.shard.engines import dummy_needs_native, select_engine
from tgis.shard.errors import StartupError
from tgis.shard.native.linear.cpu_gemm import bound_primitive_caches
from tgis.shard.native.loading.loader import load_native_runner
from tgis.shard.parallel.group import SINGLE, TensorParallel
from tgis.shard.step.guided import Grammars
from tgis.shard.step.runner import Runner, SequenceRunner


def load_runner(config: ShardConfig, tp: TensorParallel = SINGLE) -> Runner:
    """Load the model named by ``config`` onto this rank's device and size its KV cache.

    With tensor parallelism (``tp`` from ``parallel.distributed.init_distributed``) this
    rank reads only its slice of each tensor and every rank gets the same number of KV
    blocks (the smallest that fits on all of them).

    oneDNN's primitive caches are capped first (``native/linear/cpu_gemm.py``): they fill with one
    entry per GEMM shape and row count and would otherwise grow for minutes under load.

    Raises StartupError (or ModelNotFoundError) with a one-line message on any problem.
    """
    config.validate()
    bound_primitive_caches()
    model_dir = resolve_model_dir(config.model_name, config.revision)
    model_config = ModelConfig.from_dir(model_dir)
    quantization = resolve_quantization(
        config.quantize,
        checkpoint_scheme(model_dir, model_config.raw),
        dummy=config.load_format == "dummy",
    )
    layout_reader(quantization)  # a variant tgis does not read fails here, in one line
    engine = select_engine(
        config.deployment_framework,
        model_config,
        config.world_size,
        requested=config.engine.engine,
        max_sequence_length=config.max_sequence_length,
    )
    if engine == "native":
        runner: SequenceRunner = load_native_runner(
            config, model_dir, model_config, tp, quantization
        )
        return with_grammars(runner, model_dir)
    if quantization is not None:
        raise StartupError(
            f"{quantization.describe()}: quantized weights are served by the native engine "
            f"only, and {model_config.model_type or model_config.architecture} runs on the "
            "transformers engine"
        )
    if config.load_format == "dummy":
        raise StartupError(dummy_needs_native(model_config, config.max_sequence_length))
    from tgis.shard.fallback.loader import load_hf_runner  # imports transformers

    return with_grammars(load_hf_runner(config, model_dir, model_config), model_dir)


def with_grammars(runner: SequenceRunner, model_dir: Path) -> SequenceRunner:
    """``runner`` with guided decoding's matchers for this model (``step/guided.py``)."""
    info = runner.info
    runner.grammars = Grammars.for_model(str(model_dir), info.vocab_size, info.eos_token_ids)
    return runner
