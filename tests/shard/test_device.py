"""The dtype rule (`--dtype auto`) and bfloat16 on the CPU.

float32 stays the exact path (every test against transformers pins it, tests/conftest.py);
here bfloat16 is checked against transformers in float32 within a stated tolerance.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.shard.driving import Router
from tests.shard.models import TinyModel
from tgis.shard.config import ShardConfig, canonical_dtype
from tgis.shard.device import cpu_bf16_flags, select_dtype
from tgis.shard.loader import load_runner
from tgis.shard_api.messages import DetailOptions

CPU = torch.device("cpu")
PROMPT = [5, 17, 99, 3, 42, 8, 61, 23, 77, 14, 250, 9]


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: Test\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    return path


def test_native_bfloat16_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    assert cpu_bf16_flags(cpuinfo(tmp_path, "fpu sse avx2 avx512f avx512_bf16 avx512_vnni")) == (
        "avx512_bf16",
    )
    assert cpu_bf16_flags(cpuinfo(tmp_path, "avx512f amx_tile amx_bf16 avx512_bf16")) == (
        "avx512_bf16",
        "amx_bf16",
    )
    # AVX-512 alone emulates bfloat16 (slower than float32): not native.
    assert cpu_bf16_flags(cpuinfo(tmp_path, "fpu avx2 avx512f avx512bw avx512_vnni")) == ()
    assert cpu_bf16_flags(tmp_path / "missing") == ()


def test_auto_on_cpu_follows_the_processor_not_the_checkpoint(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="tgis.shard.device")
    monkeypatch.setattr("tgis.shard.device.cpu_bf16_flags", lambda *a: ("avx512_bf16",))
    for checkpoint in ("float32", "bfloat16", "float16", None):
        assert select_dtype(None, checkpoint, CPU) == torch.bfloat16
    assert "bfloat16 (native: avx512_bf16)" in caplog.text
    monkeypatch.setattr("tgis.shard.device.cpu_bf16_flags", lambda *a: ())
    for checkpoint in ("float32", "bfloat16", None):
        assert select_dtype(None, checkpoint, CPU) == torch.float32
    assert "float32 (the processor has no native bfloat16" in caplog.text
    # An explicit dtype always wins; `auto` is the rule.
    assert select_dtype("float32", "bfloat16", CPU) == torch.float32
    assert select_dtype("bfloat16", "float32", CPU) == torch.bfloat16
    assert canonical_dtype("auto") is None and canonical_dtype(" AUTO ") is None


def test_gpu_auto_keeps_the_checkpoint_dtype() -> None:
    meta = torch.device("meta")  # any non-CPU device takes the GPU rule
    assert select_dtype(None, "bfloat16", meta) == torch.bfloat16
    assert select_dtype(None, "float32", meta) == torch.float32
    assert select_dtype(None, None, meta) == torch.float16


def test_auto_serves_bfloat16_on_a_native_cpu(
    tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tgis.shard.device.cpu_bf16_flags", lambda *a: ("amx_bf16",))
    runner = load_runner(ShardConfig(model_name=str(tiny_model.path), kv_cache_blocks=8))
    assert runner.info.dtype == "bfloat16"
    assert runner.kv_cache.k[0].dtype == torch.bfloat16


# bfloat16 keeps 8 significant bits: on this model the prompt log-probabilities stay
# within these bounds of float32 transformers' (measured: max 0.020, mean 0.011; the
# bounds leave 5x for other BLAS builds).
BF16_MAX_LOGPROB_ERROR = 0.1
BF16_MEAN_LOGPROB_ERROR = 0.05


def test_bfloat16_within_tolerance_of_float32_transformers(tiny_model: TinyModel) -> None:
    runner = load_runner(
        ShardConfig(model_name=str(tiny_model.path), dtype="bfloat16", kv_cache_blocks=16)
    )
    assert runner.attention.name in ("cpu_paged", "torch_paged")
    router = Router(runner)
    router.add(1, PROMPT, details=DetailOptions(input_tokens=True, logprobs=True))
    output = router.step({1: len(PROMPT)})
    got = torch.tensor([d.logprob for d in output.input_tokens[0].tokens[1:]])
    expected_all = torch.log_softmax(tiny_model.prompt_logits(PROMPT), dim=-1)
    expected = expected_all[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    error = (got - expected).abs()
    assert error.max() <= BF16_MAX_LOGPROB_ERROR, error
    assert error.mean() <= BF16_MEAN_LOGPROB_ERROR, error
    # Greedy decoding through the C kernel's bfloat16 decode path agrees with float32
    # transformers on this model (its logits are far from ties).
    for _ in range(7):
        router.decode([1])
    assert router.generated[1] == tiny_model.greedy(PROMPT, 8)[0]
