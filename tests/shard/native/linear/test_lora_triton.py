"""The LoRA kernels (``lora_triton``) add the same deltas as the torch path of ``LoraRows``.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``,
set by tests/conftest.py), so the dims are tiny; with one they are compiled and run on CUDA.
Steps are built by ``lora_rows`` from stand-in work items, once with each implementation.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tgis.shard.adapters.lora_layout import LoraPair, LoraWeights
from tgis.shard.native.linear.lora_rows import LoraGroup, LoraRows, lora_kernel, lora_rows

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
# On a GPU machine these run on CUDA too (benchmarks/gpu_check.sh: pytest -m gpu).
pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda" if ON_GPU else "cpu")

# Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton.
from tgis.shard.native.linear.lora_triton import lora_add, prepare  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
IN, OUT = 40, 48  # not multiples of the kernels' tiles
SITES = (0, 1, 2)


@pytest.fixture(autouse=True)
def _runnable() -> None:
    if not ON_GPU and not INTERPRETED:
        pytest.fail("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")


def adapter(
    name: str,
    rank: int,
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    sites: tuple[int, ...] = SITES,
    in_features: int = IN,
    out_features: int = OUT,
) -> LoraWeights:
    """Random pairs of rank ``rank`` at ``sites``, scaled so deltas are of order one."""
    pairs = {}
    for site in sites:
        a = torch.randn(in_features, rank, generator=gen) / in_features**0.5
        b = torch.randn(rank, out_features, generator=gen) / rank**0.5
        pairs[site] = LoraPair(a.to(DEVICE, dtype), b.to(DEVICE, dtype))
    return LoraWeights(name, pairs, rank)


def step(spans: list[tuple[LoraWeights | None, int]]) -> tuple[list[Any], list[int]]:
    """Stand-in work items, one per ``(adapter or None, tokens)``, and their first rows."""
    work = [SimpleNamespace(seq=SimpleNamespace(lora=w), num_tokens=n) for w, n in spans]
    starts, row = [], 0
    for _, n in spans:
        starts.append(row)
        row += n
    return work, starts


def check(
    spans: list[tuple[LoraWeights | None, int]],
    gen: torch.Generator,
    dtype: torch.dtype = torch.float32,
    sites: tuple[int, ...] = SITES,
    in_features: int = IN,
    out_features: int = OUT,
) -> None:
    """Every site's output through the kernels equals the torch path's, rows without an
    adapter untouched."""
    work, starts = step(spans)
    rows = sum(n for _, n in spans)
    reference = lora_rows(work, starts, DEVICE, kernel="torch")
    kernels = lora_rows(work, starts, DEVICE, kernel="triton")
    assert reference is not None and kernels is not None and kernels.kernel is not None
    plain = torch.tensor(
        [r for (w, n), s in zip(spans, starts, strict=True) if w is None for r in range(s, s + n)],
        dtype=torch.long,
    )
    for site in sites:
        x = torch.randn(rows, in_features, generator=gen).to(DEVICE, dtype)
        y = torch.randn(rows, out_features, generator=gen).to(DEVICE, dtype)
        expected, got = y.clone(), y.clone()
        reference.add(site, x, expected)
        kernels.add(site, x, got)
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        else:
            torch.testing.assert_close(got.float(), expected.float(), rtol=2e-2, atol=6e-2)
        assert torch.equal(got.cpu()[plain], y.cpu()[plain])


@pytest.mark.parametrize("seed", range(4))
def test_random_groups_interleaved(seed: int) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    ranks = rng.sample([1, 3, 16, 64], k=1 + seed)
    adapters = [adapter(f"a{i}", r, gen) for i, r in enumerate(ranks)]
    choices: list[LoraWeights | None] = [*adapters, None]
    spans = [(rng.choice(choices), rng.randint(1, 9)) for _ in range(8)]
    spans.append((adapters[0], 2))  # at least one adapter row
    check(spans, gen)


def test_contiguous_groups_and_long_groups_over_several_tiles() -> None:
    gen = torch.Generator().manual_seed(1)
    small, large = adapter("small", 3, gen), adapter("large", 16, gen)
    check([(small, 70), (large, 5), (large, 1), (None, 4), (large, 1)], gen)


def test_one_adapter_for_every_row() -> None:
    gen = torch.Generator().manual_seed(2)
    only = adapter("only", 16, gen)
    check([(only, 6), (only, 1), (only, 1)], gen)


def test_a_group_without_the_site_is_skipped_there() -> None:
    gen = torch.Generator().manual_seed(3)
    full = adapter("full", 16, gen)
    partial = adapter("partial", 3, gen, sites=(1,))  # lacks sites 0 and 2
    check([(partial, 3), (full, 2), (None, 1), (partial, 4)], gen, sites=(0, 1, 2, 3))


def test_bfloat16_within_rounding() -> None:
    gen = torch.Generator().manual_seed(4)
    adapters = [adapter(f"b{r}", r, gen, dtype=torch.bfloat16) for r in (1, 3, 16, 64)]
    check([(adapters[i % 4], 1 + i) for i in range(6)] + [(None, 3)], gen, torch.bfloat16)


def test_fp16_within_rounding() -> None:
    gen = torch.Generator().manual_seed(5)
    adapters = [adapter(f"h{r}", r, gen, dtype=torch.float16) for r in (3, 16)]
    check([(adapters[0], 4), (None, 2), (adapters[1], 3)], gen, torch.float16)


def test_split_input_features_and_a_wide_rank() -> None:
    """Inputs summed from several partial products, and a rank over one rank block."""
    gen = torch.Generator().manual_seed(6)
    first = adapter("first", 100, gen, in_features=200, out_features=70, sites=(0,))
    second = adapter("second", 1, gen, in_features=200, out_features=70, sites=(0,))
    work, starts = step([(first, 3), (None, 2), (second, 2), (first, 1)])
    reference = lora_rows(work, starts, DEVICE, kernel="torch")
    metadata = prepare([(first, [0, 1, 2, 7]), (second, [5, 6])], DEVICE)
    assert reference is not None
    x = torch.randn(8, 200, generator=gen).to(DEVICE)
    y = torch.randn(8, 70, generator=gen).to(DEVICE)
    expected, got = y.clone(), y.clone()
    reference.add(0, x, expected)
    assert lora_add(metadata, 0, x, got, split_k=3)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_group_with_no_rows_adds_nothing() -> None:
    gen = torch.Generator().manual_seed(7)
    empty, used = adapter("empty", 3, gen), adapter("used", 16, gen)
    rows = torch.tensor([1, 3], device=DEVICE)
    metadata = prepare([(empty, []), (used, [1, 3])], DEVICE)
    kernels = LoraRows((LoraGroup(used, rows),), metadata)
    reference = LoraRows((LoraGroup(used, rows),))
    x = torch.randn(5, IN, generator=gen).to(DEVICE)
    y = torch.randn(5, OUT, generator=gen).to(DEVICE)
    expected, got = y.clone(), y.clone()
    reference.add(0, x, expected)
    kernels.add(0, x, got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_mixed_dtypes_take_the_torch_path() -> None:
    gen = torch.Generator().manual_seed(8)
    half = adapter("half", 3, gen, dtype=torch.bfloat16)
    full = adapter("full", 3, gen)
    metadata = prepare([(half, [0]), (full, [1])], DEVICE)
    x = torch.randn(2, IN, generator=gen).to(DEVICE)
    assert not lora_add(metadata, 0, x, torch.zeros(2, OUT, device=DEVICE))


def test_the_switch() -> None:
    cpu = torch.device("cpu")
    assert lora_kernel(cpu, "auto") == "torch"
    assert lora_kernel(torch.device("cuda"), "auto") == "triton"
    assert lora_kernel(torch.device("cuda"), "torch") == "torch"
    assert lora_kernel(cpu, "triton") == "triton"
    with pytest.raises(ValueError, match="TGIS_LORA_KERNEL"):
        lora_kernel(cpu, "cuda")
    work, starts = step([(adapter("a", 1, torch.Generator()), 2)])
    built = lora_rows(work, starts, cpu, "auto")
    assert built is not None and built.kernel is None
