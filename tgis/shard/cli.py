"""``text-generation-server``: the shard's command line (``serve``)."""

from __future__ import annotations

import asyncio
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from tgis.log import setup_logging
from tgis.shard.config import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    DEFAULT_SPECULATOR_MAX_BATCH_SIZE,
    DEFAULT_UDS_PATH,
    LOAD_FORMATS,
    ShardConfig,
    canonical_dtype,
    env_int,
    env_optional_int,
)
from tgis.termination import fail_startup


@click.group()
def main() -> None:
    """The tgis model shard."""


@main.command()
@click.argument("model_name", default="")
@click.argument("deployment_framework", required=False)
@click.option(
    "--dtype",
    envvar="DTYPE",
    default=None,
    help="auto (default), float32, float16 or bfloat16 (or fp32/float, fp16/half, bf16).",
)
@click.option("--max-sequence-length", type=int, default=2048, show_default=True)
@click.option("--max-new-tokens", type=int, default=1024, show_default=True)
@click.option(
    "--max-batch-size",
    type=int,
    default=None,
    help="Sizes the CPU KV cache (that many max-length sequences); default: by capacity.",
)
@click.option(
    "--batch-safety-margin",
    type=int,
    default=20,
    show_default=True,
    help="Percent of free GPU memory held back when sizing the KV cache.",
)
@click.option("--revision", default=None)
@click.option(
    "--quantize",
    default=None,
    help="gptq, awq, compressed-tensors, fp8 or int8 (bitsandbytes, eetq: int8); checked "
    "against the checkpoint's quantization_config",
)
@click.option("--sharded", is_flag=True, default=False)
@click.option(
    "--cuda-process-memory-fraction",
    "--cuda-memory-fraction",
    "cuda_process_memory_fraction",
    type=float,
    default=1.0,
    show_default=True,
)
@click.option(
    "--max-batch-prefill-tokens",
    type=int,
    default=4096,
    show_default=True,
    help="Prompt tokens of the largest step; the GPU warm-up prefills this many.",
)
@click.option(
    "--max-batch-total-tokens",
    type=int,
    default=None,
    help="KV tokens of the running batch: the CPU cache size, a cap on the GPU one "
    "(default: what fits).",
)
@click.option(
    "--load-format",
    type=click.Choice(LOAD_FORMATS),
    default="auto",
    show_default=True,
    help="auto: read the safetensors weights; dummy: random weights created on the device "
    "from config.json alone (benchmarks; native models only).",
)
@click.option(
    "--adapter-cache",
    envvar="ADAPTER_CACHE",
    default=None,
    help="Directory of PEFT adapters for adapter_id (LoRA and prompt tuning).",
)
@click.option(
    "--max-loras", envvar="MAX_LORAS", type=int, default=DEFAULT_MAX_LORAS, show_default=True
)
@click.option(
    "--max-lora-rank",
    envvar="MAX_LORA_RANK",
    type=int,
    default=DEFAULT_MAX_LORA_RANK,
    show_default=True,
)
@click.option(
    "--disable-prefix-caching",
    envvar="DISABLE_PREFIX_CACHING",
    is_flag=True,
    default=False,
    help="The router reuses no cached KV blocks: tell it so, and commit the CPU KV cache "
    "only as it fills.",
)
@click.option(
    "--speculator-name",
    envvar="SPECULATOR_NAME",
    default=None,
    help="A draft model (a directory or a cached model id sharing the tokenizer) for "
    "speculative decoding.",
)
@click.option(
    "--speculate",
    envvar="SPECULATE",
    type=click.IntRange(min=0),
    default=0,
    help="Tokens the router drafts per sequence and step (0: none): verify steps of that "
    "many drafts get CUDA graphs of their own.",
)
@click.option(
    "--speculator-max-batch-size",
    envvar="SPECULATOR_MAX_BATCH_SIZE",
    type=click.IntRange(min=1),
    default=DEFAULT_SPECULATOR_MAX_BATCH_SIZE,
    show_default=True,
    help="The router speculates while at most this many requests run or wait: the verify "
    "steps' CUDA graphs go up to that batch size.",
)
@click.option("--uds-path", default=DEFAULT_UDS_PATH, show_default=True)
def serve(**options: Any) -> None:
    """Load MODEL_NAME ("" = the embedded model) and serve it on ``{uds-path}-{rank}``."""
    _serve(ServeOptions(**options))


@dataclass(frozen=True)
class ServeOptions:
    """``serve``'s argument and options, as click parsed them."""

    model_name: str
    deployment_framework: str | None
    dtype: str | None
    max_sequence_length: int
    max_new_tokens: int
    max_batch_size: int | None
    batch_safety_margin: int
    revision: str | None
    quantize: str | None
    sharded: bool
    cuda_process_memory_fraction: float
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int | None
    load_format: str
    adapter_cache: str | None
    max_loras: int
    max_lora_rank: int
    disable_prefix_caching: bool
    speculator_name: str | None
    speculate: int
    speculator_max_batch_size: int
    uds_path: str


def _serve(options: ServeOptions) -> None:
    """Load the model, then serve this rank until SIGTERM (rank 0 of a tensor-parallel
    group also drives the others); a start-up failure exits with one line."""
    setup_logging(json_output=False, component="shard")
    # Imported here so `--help` does not pay for torch.
    from tgis.model_files import ModelNotFoundError
    from tgis.shard.errors import StartupError
    from tgis.shard.loader import load_runner
    from tgis.shard.parallel.distributed import init_distributed
    from tgis.shard.serving.server import ShardServer
    from tgis.shard.serving.tensor_parallel import native_runner, serve_rank

    try:
        config = _shard_config(options)
        config.validate()
        tp = init_distributed(config.rank, config.world_size)
        runner = load_runner(config, tp)
        ranked = native_runner(runner) if tp.is_parallel else None
    except (StartupError, ModelNotFoundError) as e:
        fail_startup(_one_line(str(e)))
    except Exception as e:
        fail_startup(
            _one_line(f"failed to load model '{options.model_name}': {type(e).__name__}: {e}")
        )
    if ranked is not None:  # tensor parallelism: rank 0 serves and drives the others
        sys.exit(asyncio.run(serve_rank(ranked, tp, config.socket_path)))
    asyncio.run(ShardServer(runner, config.socket_path, config.rank).serve_until_signal())


def _shard_config(options: ServeOptions) -> ShardConfig:
    """The shard's configuration: ``serve``'s options and the environment (rank, world
    size, KV blocks, prompt prefixes)."""
    from tgis.shard.adapters.prefix_store import max_prefix_length, prompt_cache_bytes

    return ShardConfig(
        model_name=options.model_name,
        revision=options.revision,
        deployment_framework=options.deployment_framework,
        quantize=options.quantize or None,
        dtype=canonical_dtype(options.dtype),
        max_sequence_length=options.max_sequence_length,
        max_new_tokens=options.max_new_tokens,
        max_batch_size=options.max_batch_size,
        batch_safety_margin=options.batch_safety_margin,
        sharded=options.sharded,
        cuda_process_memory_fraction=options.cuda_process_memory_fraction,
        uds_path=options.uds_path,
        rank=env_int("RANK", 0),
        world_size=env_int("WORLD_SIZE", 1),
        kv_cache_blocks=env_optional_int("TGIS_KV_CACHE_BLOCKS"),
        max_batch_prefill_tokens=options.max_batch_prefill_tokens,
        max_batch_total_tokens=options.max_batch_total_tokens,
        load_format=options.load_format,
        prefix_store_path=os.environ.get("PREFIX_STORE_PATH") or None,
        prompt_cache_bytes=prompt_cache_bytes(os.environ),
        max_prefix_length=max_prefix_length(os.environ, options.max_sequence_length),
        adapter_cache=options.adapter_cache or None,
        max_loras=options.max_loras,
        max_lora_rank=options.max_lora_rank,
        prefix_caching=not options.disable_prefix_caching,
        speculator_name=options.speculator_name or None,
        speculate=options.speculate,
        speculator_max_batch_size=options.speculator_max_batch_size,
    )


@main.command("download-weights")
@click.argument("model_name")
@click.option("--revision", default=None, help="Branch, tag or commit of a Hub model.")
@click.option("--token", default=None, help="Hugging Face token (default: HF_TOKEN / saved login).")
@click.option(
    "--extension",
    default=".safetensors",
    show_default=True,
    help="Comma-separated weight file extensions to fetch.",
)
@click.option(
    "--auto-convert/--no-auto-convert",
    default=True,
    show_default=True,
    help="Convert PyTorch .bin weights to safetensors when the model has no .safetensors.",
)
def download_weights(
    model_name: str, revision: str | None, token: str | None, extension: str, auto_convert: bool
) -> None:
    """Put MODEL_NAME's weights in the local HF cache (or prepare a local directory).

    Weights already in the cache are used as they are; otherwise they are downloaded from
    the Hugging Face Hub (never when HF_HUB_OFFLINE=1).
    """
    from tgis.shard.checkpoints.hub import download_weights as download
    from tgis.shard.checkpoints.weight_files import WeightsError

    try:
        fetched = download(
            model_name,
            revision=revision,
            extension=extension,
            auto_convert=auto_convert,
            token=token,
            report=click.echo,
        )
        if fetched.unconverted_in is not None:
            _convert_fetched(fetched.directory, fetched.unconverted_in)
        if fetched.downloaded is not None:
            click.echo(f"Weights of {fetched.downloaded} are in {fetched.directory}")
    except WeightsError as e:
        fail_startup(_one_line(str(e)))
    except Exception as e:
        fail_startup(_one_line(f"download-weights '{model_name}' failed: {type(e).__name__}: {e}"))


def _convert_fetched(directory: Path, found_in: str) -> None:
    """download-weights' second step: .safetensors were asked for and only .bin weights were
    found (in ``found_in``), so convert them next to themselves."""
    from tgis.shard.checkpoints.convert import convert_directory

    click.echo(f".safetensors weights not found in {found_in}, converting the .bin weights...")
    converted = convert_directory(directory, report=click.echo)
    click.echo(f"Converted {len(converted)} .bin file(s) to safetensors in {directory}")


@main.command("convert-to-safetensors")
@click.argument("model_name")
@click.option("--revision", default=None, help="Revision of a model in the local HF cache.")
def convert_to_safetensors(model_name: str, revision: str | None) -> None:
    """Convert MODEL_NAME's PyTorch .bin weights to .safetensors next to them.

    MODEL_NAME is a local directory or a model id in the local HF cache; nothing is
    downloaded. Tensors are verified to read back equal; tied duplicates are dropped.
    """
    from tgis.shard.checkpoints.hub import resolve_existing_model_dir
    from tgis.shard.checkpoints.weight_files import AlreadyConverted, WeightsError, bin_sources

    try:
        model_dir = resolve_existing_model_dir(model_name, revision)
        bin_sources(model_dir)  # the cheap checks, before importing torch
        from tgis.shard.checkpoints.convert import convert_directory

        converted = convert_directory(model_dir, report=click.echo)
    except AlreadyConverted as e:
        click.echo(_one_line(str(e)))  # as TGIS: nothing to do is not a failure
        return
    except WeightsError as e:
        fail_startup(_one_line(str(e)))
    except Exception as e:
        fail_startup(
            _one_line(f"convert-to-safetensors '{model_name}' failed: {type(e).__name__}: {e}")
        )
    click.echo(f"Converted {len(converted)} .bin file(s) to safetensors in {model_dir}")


def _one_line(message: str) -> str:
    return " ".join(message.split())
