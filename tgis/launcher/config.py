"""Launcher configuration as types: the flag values (`LauncherConfig`) with their defaults and
the words they accept, the settings derived from them (`ResolvedConfig`), and `ConfigError`.

`validation.py` checks the flags, `environment.py` and `model_config.py` read the rest,
`resolution.py` ties them into a `ResolvedConfig`. A bad value raises `ConfigError` whose
message is the one line shown to the user and written to the termination log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tgis.router.config import DEFAULT_MAX_BATCH_PREFILL_TOKENS
from tgis.settings.catalogue import default
from tgis.settings.declaration import Process

DEPLOYMENT_FRAMEWORKS = (
    "hf_transformers",
    "tgis_native",
    "hf_accelerate",
    "hf_optimum_ort",
    "hf_optimum_bt",
    "ibm_fms",
)
LEGACY_DEPLOYMENT_FRAMEWORKS = {"hf_custom_tp": "tgis_native"}

DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}

# --quantize: the shard's formats (checkpoints/quantized/scheme.py), and TGIS's and TGI's names
# for weight-only int8.
QUANTIZE_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "int8", "bitsandbytes", "eetq")

# The name the router reports when no --model-name is given.
EMBEDDED_MODEL_NAME = "tgis-tiny-llama (embedded)"


class ConfigError(ValueError):
    """An unknown or inconsistent setting; the message is one line for the user."""


def _d(name: str) -> Any:
    return default(name, Process.LAUNCHER)


@dataclass(frozen=True)
class LauncherConfig:
    """The launcher's flags as given (command line, else env, else the defaults of
    ``tgis/settings``: one field per setting the launcher reads)."""

    model_name: str | None = _d("model_name")  # None: the embedded demo model
    require_model: bool = _d("require_model")  # the image: no model named is an error
    trust_remote_code: bool = _d("trust_remote_code")
    revision: str | None = _d("revision")
    deployment_framework: str = _d("deployment_framework")
    dtype: str | None = _d("dtype")
    dtype_str: str | None = _d("dtype_str")
    quantize: str | None = _d("quantize")
    load_format: str = _d("load_format")  # "dummy": random weights from config.json
    served_model_name: str | None = _d("served_model_name")  # default: model_name
    chat_template: str | None = _d("chat_template")  # a file or the text
    tool_call_parser: str | None = _d("tool_call_parser")  # None: from the chat template
    num_shard: int | None = _d("num_shard")
    shard_uds_path: str = _d("shard_uds_path")
    master_addr: str = _d("master_addr")
    master_port: int = _d("master_port")
    nnodes: int = _d("nnodes")  # nodes the num_shard ranks are spread over
    node_rank: int = _d("node_rank")  # this node's place (0: the router's)
    shard_startup_timeout: float = _d("shard_startup_timeout")
    shutdown_grace_period: float = _d("shutdown_grace_period")
    hostname: str | None = _d("hostname")  # None: every interface
    port: int = _d("port")
    grpc_port: int = _d("grpc_port")
    tls_cert_path: str | None = _d("tls_cert_path")
    tls_key_path: str | None = _d("tls_key_path")
    tls_client_ca_cert_path: str | None = _d("tls_client_ca_cert_path")
    http_tls: bool = _d("http_tls")
    cors_allow_origin: tuple[str, ...] = _d("cors_allow_origin")  # CORS on the HTTP port
    # A bearer token the /v1 routes require; passed to the router in its environment, and
    # kept out of the launcher's "Args:" log line.
    api_key: str | None = field(default=_d("api_key"), repr=False)
    json_output: bool = _d("json_output")
    otlp_endpoint: str | None = _d("otlp_endpoint")
    otlp_service_name: str = _d("otlp_service_name")
    max_concurrent_requests: int = _d("max_concurrent_requests")
    max_sequence_length: int | None = _d("max_sequence_length")  # default: config.json's
    max_new_tokens: int = _d("max_new_tokens")
    max_input_tokens: int | None = _d("max_input_tokens")  # default: max_sequence_length - 1
    max_client_batch_size: int | None = _d("max_client_batch_size")  # default: no limit
    max_stop_sequences: int = _d("max_stop_sequences")
    max_top_n_tokens: int | None = _d("max_top_n_tokens")  # default: no limit
    max_best_of: int = _d("max_best_of")
    max_batch_size: int | None = _d("max_batch_size")  # default: by capacity
    max_prefill_padding: float = _d("max_prefill_padding")
    max_waiting_tokens: int | None = _d("max_waiting_tokens")
    waiting_served_ratio: float | None = _d("waiting_served_ratio")
    max_batch_prefill_tokens: int | None = _d("max_batch_prefill_tokens")
    max_batch_total_tokens: int | None = _d("max_batch_total_tokens")
    batch_safety_margin: int = _d("batch_safety_margin")
    cuda_process_memory_fraction: float = _d("cuda_process_memory_fraction")
    output_special_tokens: bool = _d("output_special_tokens")
    default_include_stop_seqs: bool = _d("default_include_stop_seqs")
    disable_prefix_caching: bool = _d("disable_prefix_caching")
    speculate: int = _d("speculate")  # 0: off (4 with a draft model)
    speculator_name: str | None = _d("speculator_name")  # a draft model
    speculator_max_batch_size: int = _d("speculator_max_batch_size")
    speculate_always: bool = _d("speculate_always")
    prompt_lookup_min: int = _d("prompt_lookup_min")
    prompt_lookup_max: int = _d("prompt_lookup_max")
    adapter_cache: str | None = _d("adapter_cache")  # PEFT adapters (none: refused)
    lora_adapters: str | None = _d("lora_adapters")  # ids to load at start, comma-separated
    max_loras: int = _d("max_loras")
    max_lora_rank: int = _d("max_lora_rank")


@dataclass(frozen=True)
class NodePlacement:
    """This node's share of a group of ``world_size`` ranks spread over ``nnodes`` nodes."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0

    @property
    def per_node(self) -> int:
        """Ranks each node runs."""
        return self.world_size // self.nnodes

    @property
    def ranks(self) -> range:
        """The global ranks this node runs."""
        first = self.node_rank * self.per_node
        return range(first, first + self.per_node)

    @property
    def is_leader(self) -> bool:
        """Node 0: rank 0 and the router run here."""
        return self.node_rank == 0

    @property
    def multinode(self) -> bool:
        """Whether other nodes' launchers run part of the group."""
        return self.nnodes > 1

    def local_rank(self, rank: int) -> int:
        """``rank``'s index on this node (its GPU)."""
        return rank - self.ranks.start


@dataclass(frozen=True)
class ResolvedConfig:
    """Validated settings derived from the flags and the environment, ready to build commands."""

    flags: LauncherConfig
    model_dir: Path
    served_model_name: str
    deployment_framework: str
    dtype: str | None
    num_shard: int
    max_sequence_length: int
    hf_hub_cache: Path
    load_format: str = "auto"
    placement: NodePlacement | None = None  # None: every rank on this node

    @property
    def node(self) -> NodePlacement:
        """This node's ranks (all of them on a single node)."""
        return self.placement or NodePlacement(world_size=self.num_shard)


def blank(value: str | None) -> bool:
    """An unset setting: None, empty or only whitespace."""
    return value is None or not value.strip()


def effective_max_batch_prefill_tokens(flags: LauncherConfig) -> int | None:
    """What the router will use when either budget is set (None: both are defaults)."""
    if flags.max_batch_prefill_tokens is not None:
        return flags.max_batch_prefill_tokens
    if flags.max_batch_total_tokens is not None:
        return min(DEFAULT_MAX_BATCH_PREFILL_TOKENS, flags.max_batch_total_tokens)
    return None
