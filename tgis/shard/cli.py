"""``text-generation-server``: the shard's command line (``serve``)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import click

from tgis.log import setup_logging
from tgis.settings.declaration import Process
from tgis.settings.options import setting_options, version_option
from tgis.shard.config import (
    EngineSettings,
    ShardConfig,
    canonical_dtype,
    env_int,
    max_prefix_length,
    prompt_cache_bytes,
)
from tgis.termination import fail_startup


@click.group()
@version_option()
def main() -> None:
    """The tgis model shard."""


@main.command()
@setting_options(Process.SHARD)
def serve(**options: Any) -> None:
    """Load MODEL_NAME ("" = the embedded model) and serve it on ``{shard-uds-path}-{rank}``."""
    _serve(options)


def _serve(options: Mapping[str, Any]) -> None:
    """Load the model, then serve this rank until SIGTERM (rank 0 of a tensor-parallel
    group also drives the others); a start-up failure exits with one line."""
    setup_logging(json_output=options["json_output"], component="shard")
    # Imported here so `--help` does not pay for torch.
    from tgis.model_files import ModelNotFoundError
    from tgis.shard.errors import StartupError
    from tgis.shard.loader import load_runner
    from tgis.shard.parallel.distributed import init_distributed
    from tgis.shard.serving.server import ShardServer
    from tgis.shard.serving.tensor_parallel import native_runner, serve_rank

    try:
        config = shard_config(options)
        config.validate()
        tp = init_distributed(config.rank, config.world_size, timeout_s=config.distributed_timeout)
        runner = load_runner(config, tp)
        ranked = native_runner(runner) if tp.is_parallel else None
    except (StartupError, ModelNotFoundError) as e:
        fail_startup(_one_line(str(e)))
    except Exception as e:
        fail_startup(
            _one_line(f"failed to load model '{options['model_name']}': {type(e).__name__}: {e}")
        )
    if ranked is not None:  # tensor parallelism: rank 0 serves and drives the others
        exit_after_serving(asyncio.run(serve_rank(ranked, tp, config.socket_path)))
    asyncio.run(ShardServer(runner, config.socket_path, config.rank).serve_until_signal())
    exit_after_serving(0)


def exit_after_serving(code: int) -> NoReturn:
    """Exit a shard that has stopped serving without finalizing the interpreter: the
    atexit handlers run (logging's flush among them) and stdout and stderr are flushed,
    but the teardown of torch's modules and objects, which takes about 0.8 s and
    leaves nothing behind that the next start needs, is skipped (``os._exit``)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


_BUILT: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "dtype": lambda o: {"dtype": canonical_dtype(o["dtype"])},
    "disable_prefix_caching": lambda o: {"prefix_caching": not o["disable_prefix_caching"]},
    "prompt_cache_size_mb": lambda o: {
        "prompt_cache_bytes": prompt_cache_bytes(o["prompt_cache_size_mb"])
    },
    "max_prompt_prefix_length": lambda o: {
        "max_prefix_length": max_prefix_length(
            o["max_prompt_prefix_length"], o["max_sequence_length"]
        )
    },
}
"""Settings ShardConfig takes in another form: each its fields from the options."""


def shard_config(options: Mapping[str, Any]) -> ShardConfig:
    """The shard's configuration: ``serve``'s options (each setting the shard reads, from
    the command line, else its environment variables, else its default), the engine's own
    in ``ShardConfig.engine``, and this rank's place in the group (RANK, WORLD_SIZE)."""
    engine_names = {f.name for f in fields(EngineSettings)}
    values: dict[str, Any] = {}
    for name, value in options.items():
        if name in _BUILT:
            values.update(_BUILT[name](options))
        elif name not in engine_names:
            values[name] = (value or None) if name in _BLANK_IS_NONE else value
    engine = EngineSettings(**{name: options[name] for name in engine_names})
    return ShardConfig(
        **values,
        engine=engine,
        rank=env_int("RANK", 0),
        world_size=env_int("WORLD_SIZE", 1),
    )


_BLANK_IS_NONE = frozenset(
    {"quantize", "adapter_cache", "lora_adapters", "speculator_name", "prefix_store_path"}
)
"""Options where an empty value means unset."""


def engine_from_environment() -> EngineSettings:
    """The engine's settings as ``serve`` reads them from this process's environment alone
    (TGIS_ATTENTION_BACKEND, TGIS_COMPILE, ...): for scripts that build a ShardConfig of
    their own, such as the benchmarks."""
    return shard_config(serve.make_context("serve", []).params).engine


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
