"""`text-generation-launcher`: flags (each also read from its UPPER_SNAKE env var) → LauncherConfig.

Command line beats env beats default. Parse errors, like every other start-up error, are one
line on stderr and in the termination log, with a non-zero exit (`tgis.termination`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import click
from click.core import ParameterSource

from tgis.launcher.config import LauncherConfig, default_of
from tgis.log import one_line
from tgis.termination import fail_startup

TRUE_WORDS = ("true", "1", "yes")
FALSE_WORDS = ("false", "0", "no")
_BOOL_HINT = "expected one of true, false, 1, 0, yes, no"

F = TypeVar("F", bound=Callable[..., Any])


def parse_bool(value: str) -> bool:
    """true/false/1/0/yes/no, any case; ValueError otherwise."""
    word = value.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(value)


class StrictBool(click.ParamType):
    """A boolean option that takes a value (`--default-include-stop-seqs false`)."""

    name = "boolean"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> bool:
        if isinstance(value, bool):
            return value
        try:
            return parse_bool(str(value))
        except ValueError:
            self.fail(f"{value!r}: {_BOOL_HINT}", param, ctx)


def _strict_env_flag(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    """Flags set from the environment accept only the TGIS boolean words (click takes more)."""
    if param.name and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
        envvar = param.envvar if isinstance(param.envvar, str) else None
        raw = os.environ.get(envvar, "") if envvar else ""
        try:
            return parse_bool(raw)
        except ValueError:
            raise click.BadParameter(f"{raw!r}: {_BOOL_HINT}", ctx, param) from None
    return bool(value)


def _option(*decls: str, envvar: str | list[str] | None, **kwargs: Any) -> Callable[[F], F]:
    """A click option whose default comes from LauncherConfig and whose env var(s) are shown.

    The LauncherConfig field is the bare name among ``decls`` if there is one (aliases),
    else the last flag's name."""
    bare = [d for d in decls if not d.startswith("-")]
    name = bare[0] if bare else decls[-1].lstrip("-").replace("-", "_")
    kwargs.setdefault("default", default_of(name))
    if envvar is not None:
        kwargs["envvar"] = envvar
        kwargs["show_envvar"] = True
    return click.option(*decls, show_default=True, **kwargs)


def _flag(decl: str, envvar: str, help: str) -> Callable[[F], F]:
    return _option(decl, envvar=envvar, is_flag=True, callback=_strict_env_flag, help=help)


@click.command(
    name="text-generation-launcher",
    context_settings={
        "help_option_names": ["-h", "--help"],
        "max_content_width": 100,
        "terminal_width": 100,
    },
)
@_option(
    "--model-name",
    envvar="MODEL_NAME",
    help="Model id in the local HF cache, or a directory with config.json "
    "(default: the embedded tiny model).",
)
@_option("--revision", envvar="REVISION", help="Hub revision/branch of the model.")
@_option(
    "--deployment-framework",
    envvar="DEPLOYMENT_FRAMEWORK",
    help="Inference engine (hf_custom_tp is a deprecated name of tgis_native).",
)
@_option("--dtype", envvar="DTYPE", help="float32, float16 or bfloat16 (or fp32/fp16/bf16/...).")
@_option("--dtype-str", envvar="DTYPE_STR", help="Alias of --dtype.")
@_option(
    "--quantize",
    envvar="QUANTIZE",
    help="gptq, awq, compressed-tensors, fp8, int8 (bitsandbytes, eetq: int8).",
)
@_option(
    "--num-shard",
    envvar="NUM_SHARD",
    type=int,
    help="Number of shards (default: NUM_GPUS, else the visible CUDA devices, else 1).",
)
@_option("--max-concurrent-requests", envvar="MAX_CONCURRENT_REQUESTS", type=int)
@_option(
    "max_sequence_length",
    "--max-sequence-length",
    "--max-total-tokens",
    envvar=["MAX_SEQUENCE_LENGTH", "MAX_TOTAL_TOKENS"],
    type=int,
    help="Input + output tokens of one request (--max-total-tokens is TGI's name). "
    "Default: from the model's config.json, else 2048.",
)
@_option("--max-new-tokens", envvar="MAX_NEW_TOKENS", type=int)
@_option(
    "--max-batch-size",
    envvar="MAX_BATCH_SIZE",
    type=int,
    help="Most sequences in the running batch. Default: by capacity, as many as the KV "
    "cache holds (at most 256).",
)
@_option("--max-prefill-padding", envvar="MAX_PREFILL_PADDING", type=float)
@_option(
    "--batch-safety-margin",
    envvar="BATCH_SAFETY_MARGIN",
    type=int,
    help="Percentage of free GPU memory held back.",
)
@_option(
    "--max-waiting-tokens",
    envvar="MAX_WAITING_TOKENS",
    type=int,
    help="Steps after which queued requests join the running batch whatever their number "
    "(0: at the next step). Default: unset; with --waiting-served-ratio also unset, queued "
    "requests join at the next step (chunked prefill bounds their cost), else 24.",
)
@_option(
    "--waiting-served-ratio",
    envvar="WAITING_SERVED_RATIO",
    type=float,
    help="Queued requests join a running batch of n sequences at once when at least "
    "floor(n × ratio) of them can (default 1.2 when --max-waiting-tokens is set).",
)
@_option(
    "--max-batch-prefill-tokens",
    envvar="MAX_BATCH_PREFILL_TOKENS",
    type=int,
    help="Prompt tokens computed per step; longer prompts are prefilled in chunks alongside "
    "the decodes (default 4096, or --max-batch-total-tokens if smaller). The GPU warm-up "
    "runs a prefill this large.",
)
@_option(
    "--max-batch-total-tokens",
    envvar="MAX_BATCH_TOTAL_TOKENS",
    type=int,
    help="KV-cache tokens of the running batch (default: what fits in memory on GPU; "
    "TGIS_KV_CACHE_BLOCKS or batch size × sequence length on CPU).",
)
@_option(
    "--max-client-batch-size",
    envvar="MAX_CLIENT_BATCH_SIZE",
    type=int,
    help="Most inputs in one Generate call (default: no limit).",
)
@_option(
    "--max-input-tokens",
    envvar="MAX_INPUT_TOKENS",
    type=int,
    help="Longest input in tokens, after truncation (default: max-sequence-length - 1).",
)
@_option("-p", "--port", envvar="PORT", type=int, help="Router HTTP port.")
@_option("-g", "--grpc-port", envvar="GRPC_PORT", type=int, help="Router gRPC port.")
@_option(
    "--shard-uds-path",
    envvar="SHARD_UDS_PATH",
    help="Shard socket prefix; shard r listens on <path>-<r>.",
)
@_option("--master-addr", envvar="MASTER_ADDR")
@_option("--master-port", envvar="MASTER_PORT", type=int)
@_flag("--json-output", "JSON_OUTPUT", "JSON log lines (launcher and router).")
@_option("--tls-cert-path", envvar="TLS_CERT_PATH")
@_option("--tls-key-path", envvar="TLS_KEY_PATH")
@_option("--tls-client-ca-cert-path", envvar="TLS_CLIENT_CA_CERT_PATH")
@_flag("--output-special-tokens", "OUTPUT_SPECIAL_TOKENS", "Keep special tokens in output text.")
@_flag(
    "--disable-prefix-caching",
    "DISABLE_PREFIX_CACHING",
    "Compute every prompt in full: no reuse of cached KV blocks of earlier prompts.",
)
@_option(
    "--speculate",
    envvar="SPECULATE",
    type=int,
    help="Speculative decoding: tokens drafted per sequence and step by prompt lookup (n-grams "
    "of the prompt and the output); 0 turns it off.",
)
@_option(
    "--served-model-name",
    envvar="SERVED_MODEL_NAME",
    help="The model id of the OpenAI routes (/v1/models; default: --model-name).",
)
@_option(
    "--chat-template",
    envvar="CHAT_TEMPLATE",
    help="The chat template of /v1/chat/completions: a file, or the template itself "
    "(default: chat_template.jinja or tokenizer_config.json in the model directory).",
)
@_option(
    "--api-key",
    envvar="API_KEY",
    help="A bearer token the /v1 routes require (Authorization: Bearer <key>).",
)
@_flag(
    "--http-tls",
    "HTTP_TLS",
    "Serve the HTTP port (/health, /metrics, /v1) over TLS with the gRPC port's cert and key.",
)
@_option(
    "--speculator-name",
    envvar="SPECULATOR_NAME",
    help="A draft model sharing the model's tokenizer (a directory or a cached model id): it "
    "drafts the tokens instead of prompt lookup; --speculate then defaults to 4.",
)
@_option(
    "--speculator-max-batch-size",
    envvar="SPECULATOR_MAX_BATCH_SIZE",
    type=int,
    help="Speculate only while at most this many sequences run.",
)
@_option(
    "--prompt-lookup-min",
    envvar="PROMPT_LOOKUP_MIN",
    type=int,
    help="Shortest suffix, in tokens, prompt lookup searches for.",
)
@_option(
    "--prompt-lookup-max",
    envvar="PROMPT_LOOKUP_MAX",
    type=int,
    help="Longest suffix, in tokens, prompt lookup searches for.",
)
@_option(
    "cuda_process_memory_fraction",
    "-c",
    "--cuda-process-memory-fraction",
    "--cuda-memory-fraction",
    envvar=["CUDA_PROCESS_MEMORY_FRACTION", "CUDA_MEMORY_FRACTION"],
    type=float,
    help="Fraction of GPU memory a shard may use, 0 < x <= 1 (--cuda-memory-fraction is "
    "TGI's name).",
)
@_option(
    "--default-include-stop-seqs",
    envvar="DEFAULT_INCLUDE_STOP_SEQS",
    type=StrictBool(),
    help="Default of include_stop_sequence (takes a value: true/false).",
)
@_option(
    "--otlp-endpoint",
    envvar="OTLP_ENDPOINT",
    help="OpenTelemetry OTLP/gRPC collector (e.g. http://otel-collector:4317): the router "
    "exports a span per request with validation, queue and inference spans.",
)
@_option(
    "--otlp-service-name",
    envvar="OTLP_SERVICE_NAME",
    help="service.name of the router's spans (default: OTEL_SERVICE_NAME, else "
    "text-generation-inference.router).",
)
@_option(
    "--shard-startup-timeout",
    envvar="SHARD_STARTUP_TIMEOUT",
    type=float,
    help="Seconds to wait for every shard to become ready.",
)
@_option(
    "--load-format",
    envvar="LOAD_FORMAT",
    help="auto: read the model's safetensors weights; dummy: random weights created on the "
    "device from config.json alone, for benchmarks without the real weights (native models "
    "only; the tokenizer is still needed).",
)
@_option(
    "--shutdown-grace-period",
    envvar="SHUTDOWN_GRACE_PERIOD",
    type=float,
    help="Seconds in-flight requests may run after SIGTERM while new ones are refused and "
    "health reports NOT_SERVING (default 25: Kubernetes' terminationGracePeriodSeconds of 30 "
    "less a margin; raise both together).",
)
@_option(
    "--adapter-cache",
    envvar="ADAPTER_CACHE",
    help="Directory of PEFT adapters (LoRA or prompt tuning, each a directory with "
    "adapter_config.json) that requests name with adapter_id; loaded on first use. Unset: "
    "adapter_id is refused.",
)
@_option(
    "--max-loras",
    envvar="MAX_LORAS",
    type=int,
    help="Most different LoRA adapters in one step (requests for others wait); also how many "
    "stay loaded when unused. Default 8.",
)
@_option(
    "--max-lora-rank",
    envvar="MAX_LORA_RANK",
    type=int,
    help="The largest LoRA rank accepted (larger adapters are refused). Default 64.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Validate, print the shard and router command lines, and exit.",
)
def command(dry_run: bool, **values: Any) -> tuple[LauncherConfig, bool]:
    """Start one shard per rank and the router, and supervise them (TGIS-compatible)."""
    return LauncherConfig(**values), dry_run


def error_message(error: click.ClickException) -> str:
    """One line naming the flag, or the env var when the bad value came from the environment."""
    if isinstance(error, click.BadParameter) and error.ctx and error.param and error.param.name:
        param, ctx = error.param, error.ctx
        envvar = _envvar_used(param.envvar)
        detail = error.message
        if envvar and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
            where = envvar
            if isinstance(param.type, click.types.BoolParamType):
                detail = f"{os.environ.get(envvar, '')!r}: {_BOOL_HINT}"
        else:
            where = max(param.opts, key=len) if param.opts else param.name
        return one_line(f"invalid value for {where}: {detail}")
    return one_line(error.format_message())


def _envvar_used(envvar: str | Sequence[str] | None) -> str | None:
    """The env var a value came from: the option's only one, or the first set of several."""
    if envvar is None or isinstance(envvar, str):
        return envvar
    return next((name for name in envvar if os.environ.get(name)), None)


def parse_args(args: Sequence[str] | None = None) -> tuple[LauncherConfig, bool]:
    """Parse the command line (and env); raise click exceptions. Returns (config, dry_run)."""
    result = command.main(
        args=list(args) if args is not None else None,
        prog_name="text-generation-launcher",
        standalone_mode=False,
    )
    if not isinstance(result, tuple):  # --help: click printed it and returned the exit code
        raise click.exceptions.Exit(result if isinstance(result, int) else 0)
    return result


def main(args: Sequence[str] | None = None) -> NoReturn:
    """Console-script entry point."""
    try:
        config, dry_run = parse_args(args)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        fail_startup(error_message(e))

    from tgis.launcher.app import launch  # after parsing: --help stays fast

    sys.exit(launch(config, dry_run=dry_run))
