"""Tensor parallelism on CPU (gloo): 2 ranks give world 1's tokens and logprobs, each rank
reads only its slice, the ranks stay in lock-step, start-up failures are one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import save_file

from tests.lora_oracle import save_random_lora
from tests.shard.models import build_tiny_llama
from tests.shard.tp_utils import (
    RankReport,
    Request,
    assert_same_outputs,
    free_port,
    make_plans,
    run_plans,
    run_plans_on_each,
)
from tgis.shard.cli import main
from tgis.shard.native.runtime.lockstep import with_seeds
from tgis.shard_api.messages import (
    DetailOptions,
    PrefixInfo,
    SamplingParams,
    ScheduledSequence,
    StepPlan,
)

PROMPT = (9, 30, 31, 200, 17, 4, 99, 100, 101, 5, 6, 7, 8, 250, 3, 3, 40, 41, 42, 43)
DETAILS = DetailOptions(
    logprobs=True, ranks=True, top_n=3, input_tokens=True, generated_tokens=True
)
UNSEEDED = 4
INVALID_AT = 3


def scenario_plans() -> list[StepPlan]:
    """Chunked prefill, late arrivals, greedy and seeded sampling, penalties, details, one
    unseeded sampled request, and an invalid Step in the middle."""
    requests = [
        Request(1, PROMPT, 6, details=DETAILS, chunk=8),
        Request(2, PROMPT[:7], 5, SamplingParams(temperature=0.8, top_k=20, seed=42), DETAILS, 2),
        Request(3, PROMPT + PROMPT[:13], 4, SamplingParams(repetition_penalty=1.2), arrives=1),
        Request(UNSEEDED, PROMPT[3:12], 3, SamplingParams(temperature=1.0), arrives=1),
    ]
    plans = make_plans(requests)
    invalid = StepPlan(step_id=99, scheduled=(ScheduledSequence(999, 1),))
    return [*plans[:INVALID_AT], invalid, *plans[INVALID_AT:]]


def model_dir(tmp_path: Path, **overrides: object) -> Path:
    build_tiny_llama(tmp_path, seed=3, **overrides)
    return tmp_path


def full_sizes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def expected_reads(shape: tuple[int, ...], name: str, rank: int, kv_heads: int) -> int:
    """Elements rank `rank` of 2 should read of a tensor of full `shape`."""
    numel = 1
    for n in shape:
        numel *= n
    if len(shape) == 1 or (kv_heads == 1 and ("k_proj" in name or "v_proj" in name)):
        return numel  # norms; a single KV head is replicated on both ranks
    if "embed_tokens" in name or "lm_head" in name:
        part = -(-shape[0] // 2)  # padded vocabulary split: the last part may be short
        return (part if rank == 0 else shape[0] - part) * shape[1]
    return numel // 2


def check_reads(path: Path, reports: list[RankReport], kv_heads: int) -> None:
    sizes = full_sizes(path)
    for report in reports:
        assert set(report.reads) == set(sizes)
        for name, shape in sizes.items():
            want = expected_reads(shape, name, report.rank, kv_heads)
            assert report.reads[name] == want, f"rank {report.rank} read {name}"
        # Only the KV heads of this rank are cached.
        assert report.kv_shape == (64, 16, 1, 16)
        assert report.world_size == 2


# Model overrides and the KV heads each rank holds.
SPLITS: dict[str, tuple[dict[str, object], int]] = {
    "gqa-kv2-split": ({}, 2),
    "kv1-replicated": ({"num_key_value_heads": 1}, 1),
    "tied-odd-vocab": ({"tie_word_embeddings": True, "vocab_size": 255}, 2),
}


@pytest.fixture(scope="module")
def split_reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    """Each split's model directory and its reports on two ranks, all from one pair of rank
    processes (`run_plans_on_each`: their start is most of a two-rank run's time)."""
    paths = {
        name: model_dir(tmp_path_factory.mktemp(name), **overrides)
        for name, (overrides, _) in SPLITS.items()
    }
    each = run_plans_on_each([(path, scenario_plans()) for path in paths.values()], 2)
    return {
        name: (path, reports) for (name, path), reports in zip(paths.items(), each, strict=True)
    }


@pytest.mark.slow  # starts tensor-parallel rank processes
@pytest.mark.parametrize("split", list(SPLITS))
def test_two_ranks_match_one(split: str, split_reports: dict[str, tuple[Path, Any]]) -> None:
    path, reports = split_reports[split]
    (single,) = run_plans(path, scenario_plans(), 1)
    assert_same_outputs(single.outputs, reports[0].outputs, ignore_requests={UNSEEDED})
    kv_heads = SPLITS[split][1]
    outputs = reports[0].outputs
    assert outputs[INVALID_AT] == "InvalidStepError: unknown request id 999"  # also on 1 rank
    assert not any(isinstance(o, str) for i, o in enumerate(outputs) if i != INVALID_AT)
    assert sum(len(o.tokens) for o in outputs if not isinstance(o, str)) == 6 + 5 + 4 + 3
    assert reports[1].outputs == [] and reports[1].worker_error is None
    check_reads(path, reports, kv_heads)


@pytest.mark.slow  # starts tensor-parallel rank processes
def test_prompt_prefixes_on_two_ranks_match_one(tmp_path: Path) -> None:
    """Every rank loads the prefix from its own store (the lookup runs on all of them) and
    puts the same virtual tokens before the input; a missing prefix fails alike."""
    path = model_dir(tmp_path / "model")
    store = tmp_path / "store"
    (store / "p").mkdir(parents=True)
    torch.save(
        torch.randn(6, 64, generator=torch.Generator().manual_seed(1)), store / "p" / "decoder.pt"
    )
    requests = [
        Request(1, PROMPT[:9], 4, details=DETAILS, chunk=5, prefix_id="p", prefix_length=6),
        Request(2, PROMPT[:5], 3, arrives=1),
        Request(3, PROMPT[:4], 2, arrives=1, prefix_id="gone", prefix_length=3),
    ]
    config = {"prefix_store_path": str(store), "lookups": ["p", "gone"]}
    single = run_plans(path, make_plans(requests), 1, **config)[0]
    reports = run_plans(path, make_plans(requests), 2, **config)
    found, gone = single.lookups
    assert isinstance(found, PrefixInfo)
    assert found.length == 6 and len(found.version) == 16
    assert gone == 'StoreError: prefix id "gone" not found'
    assert reports[0].lookups == single.lookups  # every rank read the same contents
    assert_same_outputs(single.outputs, reports[0].outputs)
    assert sum(len(o.tokens) for o in reports[0].outputs if not isinstance(o, str)) == 4 + 3
    failed = [e for o in reports[0].outputs if not isinstance(o, str) for e in o.errors]
    assert [e.request_id for e in failed] == [3]
    assert reports[1].worker_error is None


@pytest.mark.slow  # starts tensor-parallel rank processes
def test_lora_adapters_on_two_ranks_match_one(tmp_path: Path) -> None:
    """Each rank keeps its slice of every adapter, split as the base weights are (q/k/v and
    gate/up by output rows, o and down by input columns, summed by the same all-reduce):
    a batch of two LoRA adapters, a prompt-tuning adapter and a plain prompt gives the
    same tokens and logprobs on two ranks as on one."""
    path = model_dir(tmp_path / "model")
    cache = tmp_path / "adapters"
    save_random_lora(path, cache / "all", seed=1, r=8, alpha=16)
    save_random_lora(path, cache / "qv", seed=2, r=4, alpha=8, targets=["q_proj", "v_proj"])
    (cache / "prompt").mkdir()
    (cache / "prompt" / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING"}')
    embeddings = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    save_file({"prompt_embeddings": embeddings}, cache / "prompt" / "adapter_model.safetensors")
    requests = [
        Request(1, PROMPT[:9], 4, details=DETAILS, chunk=5, adapter_id="all"),
        Request(2, PROMPT[:5], 3, arrives=1),
        Request(3, PROMPT[:6], 3, details=DETAILS, arrives=1, adapter_id="qv"),
        Request(4, PROMPT[:4], 2, adapter_id="prompt", prefix_length=3),
        Request(5, PROMPT[:4], 2, arrives=2, adapter_id="gone"),
    ]
    config = {"adapter_cache": str(cache), "adapter_lookups": ["all", "qv", "prompt", "gone"]}
    single = run_plans(path, make_plans(requests), 1, **config)[0]
    reports = run_plans(path, make_plans(requests), 2, **config)
    assert [str(a) for a in reports[0].adapter_lookups] == [str(a) for a in single.adapter_lookups]
    assert single.adapter_lookups[-1] == (
        "StoreError: can't retrieve adapter with id 'gone': directory does not exist"
    )
    assert_same_outputs(single.outputs, reports[0].outputs)
    assert sum(len(o.tokens) for o in reports[0].outputs if not isinstance(o, str)) == 4 + 3 + 3 + 2
    failed = [e for o in reports[0].outputs if not isinstance(o, str) for e in o.errors]
    assert [e.request_id for e in failed] == [5]
    assert reports[1].worker_error is None


@pytest.mark.slow  # starts tensor-parallel rank processes
def test_diverged_rank_stops_every_rank(tmp_path: Path) -> None:
    path = model_dir(tmp_path)
    plans = make_plans([Request(1, PROMPT, 6)])
    rank0, rank1 = run_plans(path, plans, world_size=2, diverge_at=2)
    assert not isinstance(rank0.outputs[1], str)
    assert str(rank0.outputs[2]).startswith("LockstepError: ranks diverged on step")
    assert "rank 1: RuntimeError: injected failure" in str(rank0.outputs[2])
    assert all(
        o == "LockstepError: the tensor-parallel ranks are stopped" for o in rank0.outputs[3:]
    )
    assert str(rank1.worker_error).startswith("LockstepError: ranks diverged on step")


def test_missing_seeds_are_drawn_once_by_rank_0() -> None:
    plan = scenario_plans()[1]
    seeded = with_seeds(plan)
    seeds = {ns.request_id: ns.sampling.seed for ns in seeded.new_sequences}
    assert seeds[UNSEEDED] is not None and seeds[3] is None  # greedy rows need none
    assert with_seeds(seeded) is seeded


def cli_failure(tmp_path: Path, args: list[str], **env: str) -> str:
    log = tmp_path / "termination-log"
    result = CliRunner().invoke(
        main, ["serve", *args], env={"TGIS_TERMINATION_LOG": str(log), **env}
    )
    assert result.exit_code == 1, result.output
    message = log.read_text().strip()
    assert "\n" not in message
    return message


def test_sharded_flag_and_world_size_must_agree(tmp_path: Path) -> None:
    path = str(model_dir(tmp_path))
    assert cli_failure(tmp_path, [path], WORLD_SIZE="2") == "WORLD_SIZE=2 needs --sharded"
    assert cli_failure(tmp_path, [path, "--sharded"]) == (
        "--sharded needs WORLD_SIZE > 1 (got WORLD_SIZE=1)"
    )


@pytest.mark.slow  # starts tensor-parallel rank processes
def test_rank_that_cannot_join_fails_in_one_line(tmp_path: Path) -> None:
    port = free_port()
    message = cli_failure(
        tmp_path,
        [str(model_dir(tmp_path)), "--sharded"],
        WORLD_SIZE="2",
        RANK="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TGIS_DISTRIBUTED_TIMEOUT_S="2",
    )
    assert message.startswith(
        f"rank 1 of 2 could not join the gloo group at 127.0.0.1:{port} within 2 s: "
    )
