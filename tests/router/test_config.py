"""Batching flags of the router: parsing (flags, env vars, aliases), start-up checks,
--max-input-tokens and --max-client-batch-size."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import replace
from typing import Any

import grpc
import pytest
from click.testing import CliRunner

from tgis.embedded_model import MODEL_DIR
from tgis.router import cli
from tgis.router.config import RouterConfig
from tgis.router.core.batching import kv_capacity_blocks, scheduler_limits
from tgis.router.edge.status import status_code
from tgis.router.errors import ValidationError
from tgis.router.intake.admission import Admission
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.limits import client_batch_size_error
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits, validate_input
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import GenerationParams, ResponseOptions, SamplingParams
from tgis.router.request_types import StoppingParams as Stopping
from tgis.shard_api.messages import ModelKind, ShardInfo

INFO = ShardInfo(
    model_kind=ModelKind.CAUSAL_LM,
    eos_token_ids=(2,),
    vocab_size=100,
    block_size=16,
    num_blocks=100,
    world_size=1,
    max_position_embeddings=0,
    model_type="llama",
    dtype="float32",
    device="cpu",
    attention_backend="x",
)


def parse(args: list[str], env: dict[str, str] | None = None) -> RouterConfig:
    """Run the router CLI up to the point where it would serve; return its config."""
    seen: list[RouterConfig] = []

    class FakeRouter:
        def __init__(self, config: RouterConfig) -> None:
            seen.append(config)

        async def run(self) -> None:
            await asyncio.sleep(0)

    import tgis.router.server as server

    original = server.Router
    server.Router = FakeRouter  # type: ignore[assignment,misc]
    try:
        result = CliRunner().invoke(
            cli.main, ["--tokenizer-path", "/t.json", *args], env=env or {}, catch_exceptions=False
        )
    finally:
        server.Router = original  # type: ignore[misc]
    assert result.exit_code == 0, result.output
    return seen[0]


def test_defaults_change_nothing_tgis_would_accept() -> None:
    config = parse([])
    assert config.max_batch_prefill_tokens is None
    assert config.effective_max_batch_prefill_tokens == 4096
    assert config.prefill_budget(on_cpu=True) == 512
    assert (config.max_batch_total_tokens, config.max_client_batch_size) == (None, None)
    assert config.max_input_tokens is None
    # By capacity and joining at the next step, unless the TGIS flags are set.
    assert (config.max_batch_size, config.max_waiting_tokens) == (None, None)
    assert config.waiting_served_ratio is None and config.joining_rule == (0, 0.0)
    limits = scheduler_limits(config, INFO)
    assert kv_capacity_blocks(limits, INFO) == INFO.num_blocks and limits.preemption
    assert limits.max_batch_size == 256


def test_either_joining_flag_brings_the_tgis_rule_with_its_defaults() -> None:
    assert parse(["--max-waiting-tokens", "10"]).joining_rule == (10, 1.2)
    assert parse(["--waiting-served-ratio", "0.5"]).joining_rule == (24, 0.5)
    assert parse([], {"MAX_BATCH_SIZE": "12"}).effective_max_batch_size == 12


def test_flags_env_vars_and_aliases() -> None:
    config = parse(
        ["--max-total-tokens", "512", "--max-batch-tokens", "256", "--waiting-served-ratio", "0.3"],
        {"MAX_BATCH_TOTAL_TOKENS": "800", "MAX_CLIENT_BATCH_SIZE": "4", "MAX_INPUT_TOKENS": "300"},
    )
    assert config.max_sequence_length == 512
    assert config.max_batch_prefill_tokens == 256
    assert (config.max_batch_total_tokens, config.max_client_batch_size) == (800, 4)
    assert (config.max_input_tokens, config.waiting_served_ratio) == (300, 0.3)
    env = {"MAX_BATCH_PREFILL_TOKENS": "64", "MAX_TOTAL_TOKENS": "100", "MAX_WAITING_TOKENS": "0"}
    config = parse([], env)
    assert (config.max_batch_prefill_tokens, config.max_sequence_length) == (64, 100)
    assert config.max_waiting_tokens == 0
    config = parse(["--max-sequence-length", "512", "--max-batch-total-tokens", "1000"])
    gpu = replace(INFO, device="cuda:0")
    limits = scheduler_limits(config, gpu)
    assert limits.max_batch_prefill_tokens == 1000  # the default is lowered to the total
    assert scheduler_limits(config, INFO).max_batch_prefill_tokens == 512  # the CPU default
    assert kv_capacity_blocks(limits, INFO) == 63  # 1000 tokens in whole blocks, < 100
    seq2seq = scheduler_limits(parse([]), replace(INFO, model_kind=ModelKind.SEQ2SEQ_LM))
    assert not seq2seq.preemption


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(max_batch_total_tokens=1000), "max_batch_total_tokens (1000) must be >= max_seq"),
        (dict(max_batch_prefill_tokens=0), "max_batch_prefill_tokens (0) must be > 0"),
        (
            dict(max_batch_prefill_tokens=5000, max_batch_total_tokens=4096),
            "max_batch_prefill_tokens (5000) must be <= max_batch_total_tokens (4096)",
        ),
        (dict(waiting_served_ratio=-1.0), "waiting_served_ratio (-1.0) must be >= 0"),
        (dict(max_waiting_tokens=-1), "max_waiting_tokens (-1) must be >= 0"),
        (dict(max_client_batch_size=0), "max_client_batch_size (0) must be > 0"),
        (dict(max_input_tokens=2048), "max_input_tokens (2048) must be < max_sequence_length"),
    ],
)
def test_inconsistent_values_fail_in_one_line(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        RouterConfig(tokenizer_path="t", **kwargs)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_max_input_tokens_rejects_longer_inputs_only_when_set() -> None:
    stopping = Stopping(max_new_tokens=10)
    params = GenerationParams(SamplingParams(), stopping, ResponseOptions())
    default = ServerLimits.from_args(200, 100)
    assert validate_input("x", list(range(150)), params, default).input_length == 150
    limited = ServerLimits.from_args(200, 100, max_input_tokens=100)
    assert validate_input("x", list(range(100)), params, limited).input_length == 100
    with pytest.raises(ValidationError) as info:
        validate_input("x", list(range(101)), params, limited)
    assert info.value.message == (
        "input tokens (101) plus prefix length (0) must be <= 100 (max_input_tokens)"
    )


class _Metrics(Metrics):
    """Metrics that also list the failures recorded, in order."""

    def __init__(self) -> None:
        super().__init__(max_sequence_length=200, max_new_tokens=100, max_batch_size=4)
        self.failures: list[str] = []

    def request_failure(self, err: str) -> None:
        super().request_failure(err)
        self.failures.append(err)


def test_max_client_batch_size() -> None:
    assert client_batch_size_error(1000, None) is None
    assert client_batch_size_error(4, 4) is None
    assert client_batch_size_error(5, 4) == (
        "batch size 5 exceeds the limit of 4 inputs per request (max_client_batch_size)"
    )

    def call(count: int, limit: int | None) -> tuple[grpc.StatusCode | None, _Metrics]:
        metrics = _Metrics()
        admission = Admission(
            tokenizer=RouterTokenizer(str(MODEL_DIR / "tokenizer.json")),
            limits=ServerLimits.from_args(200, 100, max_client_batch_size=limit),
            limiter=ConcurrencyLimiter(4),
            metrics=metrics,
        )
        try:
            admission.check_batch_size(count)
        except ValidationError as err:
            return status_code(err), metrics
        return None, metrics

    code, metrics = call(5, 4)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert metrics.failures == ["validation"]
    code, metrics = call(5, None)
    assert code is None and not metrics.failures


def test_every_router_flag_reaches_the_configuration() -> None:
    """A flag is a RouterConfig field of its own name, or one the CLI builds into another
    form: none is parsed and then dropped."""
    fields = {f.name for f in dataclasses.fields(RouterConfig)}
    for param in cli.main.params:
        name = param.name or ""
        if name == "version":  # -V / --version: prints and exits
            continue
        assert name in fields or name in cli._BUILT, name
