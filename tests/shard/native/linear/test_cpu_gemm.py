"""Linear layers with oneDNN-packed weights on the CPU (tgis/shard/native/linear/cpu_gemm.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.shard.models import NUM_BLOCKS, TinyModel
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.linear.cpu_gemm import (
    LARGE_ROWS_STEP,
    PRIMITIVE_CACHE_ENTRIES,
    PRIMITIVE_CACHE_VARIABLES,
    ROW_STEPS,
    bound_primitive_caches,
    build_primitives,
    linear,
    pack,
    packing_available,
    padded_rows,
)
from tgis.shard.native.linear.sharded import ColumnLinear, LMHead, RowLinear

needs_packing = pytest.mark.skipif(
    not packing_available(torch.float32), reason="this PyTorch build has no oneDNN packing"
)


@needs_packing
@pytest.mark.parametrize("rows", [1, 7, 32, 300])
def test_packed_float32_is_float32_rounding_away_from_dense(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(384, 256, generator=gen)
    bias = torch.randn(384, generator=gen)
    x = torch.randn(rows, 256, generator=gen)
    exact = F.linear(x.double(), weight.double(), bias.double())
    got = linear(x, pack(weight), bias)
    assert got.dtype == torch.float32 and got.shape == (rows, 384)
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(
    not packing_available(torch.bfloat16), reason="this processor has no oneDNN bfloat16 GEMM"
)
def test_packed_bfloat16_matches_dense_bfloat16() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 128, generator=gen).bfloat16()
    x = torch.randn(16, 128, generator=gen).bfloat16()
    got = linear(x, pack(weight))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(x, weight).float(), atol=0.1, rtol=0.02)


@needs_packing
def test_the_cpu_loader_packs_every_linear_layer(tiny_model: TinyModel) -> None:
    runner = load_runner(ShardConfig(model_name=str(tiny_model.path), kv_cache_blocks=NUM_BLOCKS))
    layer = runner.model.layers[0]  # type: ignore[attr-defined]
    linears = [v for v in vars(layer.attn).values() if isinstance(v, ColumnLinear | RowLinear)]
    linears += [layer.mlp.gate_up, layer.mlp.down]
    assert len(linears) >= 3 and all(lin.weight.is_mkldnn for lin in linears)
    head = runner.model.lm_head  # type: ignore[attr-defined]
    assert isinstance(head, LMHead) and head.weight.is_mkldnn
    # float16 has no packed path: dense weights.
    half = load_runner(
        ShardConfig(model_name=str(tiny_model.path), dtype="float16", kv_cache_blocks=8)
    )
    assert not half.model.lm_head.weight.is_mkldnn  # type: ignore[attr-defined]


def test_bfloat16_stays_dense_where_onednn_has_no_bfloat16_gemm(
    tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a processor without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (an AVX2-only one, or
    ONEDNN_MAX_CPU_ISA=AVX2) packing a bfloat16 weight raises; the loader keeps those dense
    and still packs float32 ones."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    assert not packing_available(torch.bfloat16)
    assert packing_available(torch.float32) == torch.backends.mkldnn.is_available()
    runner = load_runner(
        ShardConfig(model_name=str(tiny_model.path), dtype="bfloat16", kv_cache_blocks=8)
    )
    head = runner.model.lm_head  # type: ignore[attr-defined]
    assert head.weight.dtype == torch.bfloat16 and not head.weight.is_mkldnn


def test_primitive_caches_are_capped_unless_the_environment_sets_them() -> None:
    environ = {"LRU_CACHE_CAPACITY": "200", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": " "}
    got = bound_primitive_caches(environ)
    assert got == {
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(PRIMITIVE_CACHE_ENTRIES),
        "LRU_CACHE_CAPACITY": "200",
    }
    assert environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(PRIMITIVE_CACHE_ENTRIES)


# GEMMs over 250 row counts and four weight shapes: 1,000 primitives, as a server met them
# before the row buckets ("raw": oneDNN's operator itself), or through ``linear``'s buckets.
_MANY_ROW_COUNTS = """
import sys
from tgis.shard.native.linear.cpu_gemm import bound_primitive_caches, linear, pack
import torch
if sys.argv[1] == "capped":
    bound_primitive_caches()
if sys.argv[2] == "raw":
    def linear(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
def rss_mib():
    status = open("/proc/self/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024
shapes = [(768, 256), (256, 256), (1408, 256), (256, 704)]
weights = [pack(torch.randn(out, inp)) for out, inp in shapes]
before = rss_mib()
for rows in range(1, 251):
    for weight, (_, inp) in zip(weights, shapes):
        linear(torch.randn(rows, inp), weight)
print(rss_mib() - before)
"""


@needs_packing
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_capped_primitive_caches_bound_the_memory_of_many_row_counts() -> None:
    def growth_mib(mode: str, gemm: str = "raw") -> float:
        environ = {k: v for k, v in os.environ.items() if k not in PRIMITIVE_CACHE_VARIABLES}
        result = subprocess.run(
            [sys.executable, "-c", _MANY_ROW_COUNTS, mode, gemm],
            capture_output=True, text=True, env=environ, timeout=120, check=True,
        )  # fmt: skip
        return float(result.stdout.split()[-1])

    default = growth_mib("default")  # oneDNN's and ideep's 1,024 entries each
    if default < 100:  # primitives are ~0.5 MB each on an AVX-512 host; smaller elsewhere?
        pytest.skip(f"1,000 primitives take {default:.0f} MiB on this CPU: nothing to bound")
    capped = growth_mib("capped")
    # Measured on an AVX-512 host: ~580 MiB against ~75 MiB.
    assert capped < default / 3, (capped, default)
    # The row buckets alone bound it too: ~23 row counts per shape reach oneDNN.
    bucketed = growth_mib("default", "bucketed")
    assert bucketed < default / 3, (bucketed, default)


def test_row_buckets_are_few_and_close_above_the_row_count() -> None:
    buckets = [padded_rows(rows) for rows in range(1, 2049)]
    assert all(b >= rows for rows, b in enumerate(buckets, start=1))
    assert buckets == sorted(buckets)
    assert buckets[:4] == [1, 2, 3, 4]  # one-to-four-row decodes run exactly
    assert len(set(buckets[:576])) <= 35  # a CPU budget's step with its decodes
    assert len(set(buckets)) <= 60  # up to 2,048 rows
    for rows in range(5, 2049):
        step = next((s for limit, s in ROW_STEPS if rows <= limit), LARGE_ROWS_STEP)
        assert buckets[rows - 1] - rows < step
        assert buckets[rows - 1] <= rows * 1.25 or rows <= 32
    ratios = {r: b / r for r, b in enumerate(buckets, start=1)}
    assert max(q for r, q in ratios.items() if 512 <= r <= 1024) <= 1.0625  # the CPU budget's
    assert max(q for r, q in ratios.items() if r > 1024) <= 1.125


@needs_packing
@pytest.mark.parametrize("rows", [5, 33, 513])
def test_padded_rows_give_the_rows_asked_for(rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen)
    bias = torch.randn(96, generator=gen)
    x = torch.randn(rows, 64, generator=gen)
    assert padded_rows(rows) > rows
    got = linear(x, pack(weight), bias)
    assert got.shape == (rows, 96) and got.is_contiguous()
    exact = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(got.double(), exact, atol=1e-4, rtol=1e-5)
    # A row's result does not depend on its neighbours or on the padding.
    alone = linear(x[rows - 1 :], pack(weight), bias)
    torch.testing.assert_close(got[rows - 1 :], alone, atol=1e-5, rtol=1e-6)


@needs_packing
def test_build_primitives_counts_each_distinct_gemm_once() -> None:
    a, b = pack(torch.randn(32, 16)), pack(torch.randn(32, 16))  # one shape
    c = pack(torch.randn(8, 16))
    bias = torch.randn(32)
    linears = [(a, None), (b, None), (a, bias), (c, None), (torch.randn(4, 16), None)]
    # Three distinct GEMMs (the dense weight has no primitive of its own) at the buckets of
    # 1..6 rows (1, 2, 3, 4, 8).
    assert build_primitives(linears, range(1, 7)) == 3 * 5
