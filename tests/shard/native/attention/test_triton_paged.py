"""``triton_paged`` equals the pure-torch reference on the same paged batches.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``,
slow: the shapes here are tiny, but every sequence still spans several shuffled blocks and
the prefills several query tiles); with one they are compiled and run on CUDA, and the
last tests compare a Llama-8B-like head layout.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
from dataclasses import dataclass

import pytest
import torch

from tests.shard.driving import Router
from tests.shard.models import TinyModel
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.attention.interface import AttentionBackend, BatchLayout
from tgis.shard.native.attention.selection import select_attention_backend
from tgis.shard.native.attention.torch_paged import TorchPagedAttention

pytest.importorskip("triton")

ON_GPU = torch.cuda.is_available()
# On a GPU machine these run on CUDA too (benchmarks/gpu_check.sh: pytest -m gpu).
pytestmark = pytest.mark.gpu
DEVICE = torch.device("cuda" if ON_GPU else "cpu")


# Without a GPU, tests/conftest.py sets TRITON_INTERPRET=1 before anything imports triton.
from tgis.shard.native.attention.triton_paged import TritonPagedAttention  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(autouse=True)
def _runnable() -> None:
    if not ON_GPU and not INTERPRETED:
        pytest.fail("no GPU and TRITON_INTERPRET is not 1 (tests/conftest.py sets it)")


@dataclass
class Batch:
    """One step: the layout, the new q/k/v rows and caches full of earlier context."""

    layout: BatchLayout
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def make_batch(
    specs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    seed: int = 0,
    device: torch.device = DEVICE,
) -> Batch:
    """Sequences of ``(new tokens, context after the step)``, each over blocks taken from a
    shuffled free list (never contiguous). The cache is random: its values below each
    sequence's new tokens are the earlier context, the rest stale data never to be read."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-context // block) for _, context in specs) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for n, context in specs:
        table = [free.pop() for _ in range(-(-context // block))]
        tables.append(table)
        slots += [table[p // block] * block + p % block for p in range(context - n, context)]
    tokens = sum(n for n, _ in specs)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)

    return Batch(
        layout=BatchLayout.from_lists([n for n, _ in specs], [c for _, c in specs], tables, slots),
        q=randn(tokens, heads, dim),
        k=randn(tokens, kv_heads, dim),
        v=randn(tokens, kv_heads, dim),
        k_cache=randn(num_blocks, block, kv_heads, dim),
        v_cache=randn(num_blocks, block, kv_heads, dim),
    )


def assert_matches_reference(
    backend: AttentionBackend,
    batch: Batch,
    block: int,
    scale: float | None,
    tol: float,
    window: int | None = None,
) -> None:
    """Same output as ``TorchPagedAttention`` and the same cache afterwards."""
    results = []
    reference: AttentionBackend = TorchPagedAttention(block)
    for impl in (reference, backend):
        caches = batch.k_cache.clone(), batch.v_cache.clone()
        metadata = impl.prepare(batch.layout, batch.q.device)
        out = impl.forward(batch.q, batch.k, batch.v, *caches, metadata, scale=scale, window=window)
        results.append((out, caches))
    (expected, expected_caches), (got, got_caches) = results
    assert got.dtype == expected.dtype and got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
    for e, g in zip(expected_caches, got_caches, strict=True):
        assert torch.equal(g, e)


# Decodes (context 1, exactly one block, one past a block, long), chunks continuing earlier
# cached context (their first rows just before, at and after a 16-key tile boundary), a
# fresh prompt of three 16-token query tiles, a two-token chunk.
MIXED = [(1, 1), (1, 8), (1, 9), (20, 57), (35, 35), (1, 150), (2, 11), (18, 48), (3, 18)]


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block,dtype,splits,scale",
    [
        (4, 2, 8, 4, torch.float32, None, None),  # GQA, dim padded to 16
        (4, 2, 8, 4, torch.float32, 3, 0.3),  # split decodes (some splits empty)
        (4, 1, 24, 8, torch.float32, None, None),  # MQA, dim padded to 32
        (2, 2, 16, 16, torch.float32, 2, None),  # MHA, the real block size
        (4, 2, 8, 1, torch.float32, None, None),  # one token a block
        (4, 2, 8, 4, torch.bfloat16, None, None),
        (4, 1, 8, 4, torch.float16, 2, 0.3),
    ],
)
def test_mixed_batch_equals_reference(
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    splits: int | None,
    scale: float | None,
) -> None:
    batch = make_batch(MIXED, heads, kv_heads, dim, block, dtype, seed=heads + dim)
    backend = TritonPagedAttention(block, prefill_tile=16, kv_tile=16, decode_splits=splits)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert_matches_reference(backend, batch, block, scale, tol)


@pytest.mark.parametrize("seed", [1, 2])
def test_random_batches_equal_reference(seed: int) -> None:
    """Random mixes of decodes, chunks, fresh prompts and one long context, in random order."""
    rng = random.Random(seed)
    specs = [(1, rng.randrange(1, 70)) for _ in range(rng.randrange(1, 5))]
    for _ in range(rng.randrange(1, 3)):
        n = rng.randrange(2, 40)
        specs.append((n, n + rng.choice([0, rng.randrange(1, 50)])))
    specs.append((1, rng.randrange(100, 200)))
    rng.shuffle(specs)
    batch = make_batch(specs, 4, 2, 8, 4, torch.float32, seed=seed)
    backend = TritonPagedAttention(4, prefill_tile=16, kv_tile=16, decode_splits=seed)
    assert_matches_reference(backend, batch, 4, None, 1e-4)


@pytest.mark.parametrize("window", [1, 3, 16, 17, 40, 57, 200])
@pytest.mark.parametrize(
    "block,splits,dtype",
    [(4, None, torch.float32), (4, 3, torch.float32), (16, 2, torch.bfloat16)],
)
def test_sliding_windows_equal_reference(
    window: int, block: int, splits: int | None, dtype: torch.dtype
) -> None:
    """Windows of one key, inside a 16-key tile, exactly one and just past one tile, past
    a query tile, the longest chunk's context and every context: the prefill's lower-edge
    tiles (masked), its middle ones (unmasked) and skipped ones, and split decodes over the
    window's tiles alone."""
    batch = make_batch(MIXED, 4, 2, 8, block, dtype, seed=window)
    backend = TritonPagedAttention(block, prefill_tile=16, kv_tile=16, decode_splits=splits)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert_matches_reference(backend, batch, block, None, tol, window)


def test_only_decodes_and_only_prefills() -> None:
    for specs in ([(1, 30), (1, 5)], [(17, 17), (3, 40)]):
        batch = make_batch(specs, 4, 2, 8, 4, torch.float32)
        backend = TritonPagedAttention(4, prefill_tile=16, kv_tile=16)
        assert_matches_reference(backend, batch, 4, None, 1e-4)


def test_strided_inputs_and_default_tiles() -> None:
    """q/k/v as views into one fused projection (as the models pass them), default tiles."""
    batch = make_batch(MIXED[2:5], 4, 2, 16, 16, torch.float32, seed=3)
    fused = torch.cat(
        [t.flatten(1) for t in (batch.q, batch.k, batch.v)], dim=1
    )  # [tokens, q + k + v]
    tokens = fused.shape[0]
    q, k, v = fused.split([4 * 16, 2 * 16, 2 * 16], dim=1)
    views = Batch(
        batch.layout,
        q.view(tokens, 4, 16),
        k.view(tokens, 2, 16),
        v.view(tokens, 2, 16),
        batch.k_cache,
        batch.v_cache,
    )
    assert not views.q.is_contiguous()
    assert_matches_reference(TritonPagedAttention(16), views, 16, None, 1e-4)


def test_negative_slots_are_skipped() -> None:
    """A padding row (slot -1) writes nothing."""
    batch = make_batch([(1, 5)], 2, 1, 8, 4, torch.float32)
    backend = TritonPagedAttention(4)
    metadata = backend.prepare(batch.layout, DEVICE)
    padded = metadata.slot_mapping.clone().fill_(-1)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    backend._write_kv(batch.k, batch.v, k_cache, v_cache, padded)
    assert torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)


def test_probe_passes() -> None:
    TritonPagedAttention(16).probe(DEVICE)
    TritonPagedAttention(1).probe(DEVICE, torch.bfloat16)


def test_cuda_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA default when Triton imports, unless flash-attn is asked for and installed
    (nothing touches the device while choosing)."""
    cuda = torch.device("cuda")
    assert select_attention_backend(cuda, 16).name == "triton_paged"
    has_flash = ON_GPU and importlib.util.find_spec("flash_attn") is not None
    expected = "flash_varlen" if has_flash else "triton_paged"  # missing: a warning only
    assert select_attention_backend(cuda, 16, flash=True).name == expected
    monkeypatch.setattr("tgis.shard.native.attention.selection._has_triton", lambda: False)
    assert select_attention_backend(cuda, 16).name in ("flash_varlen", "torch_paged")


def test_cpu_only_when_asked_and_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert select_attention_backend(cpu, 16).name in ("cpu_paged", "torch_paged")
    with pytest.raises(ValueError, match="CUDA"):
        select_attention_backend(cpu, 16, "triton_paged")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attention_backend(cpu, 16, "triton_paged").name == "triton_paged"


def test_model_runner_matches_hf(tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny Llama greedy-decodes like Hugging Face: prompts, a prompt in two chunks
    (the second in a step with decodes), then decodes."""
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    engine = EngineSettings(attention_backend="triton_paged")
    runner = load_runner(
        ShardConfig(model_name=str(tiny_model.path), kv_cache_blocks=32, engine=engine)
    )
    assert runner.info.attention_backend == "triton_paged"
    prompts = {1: [5, 6, 7], 2: list(range(10, 39)), 3: [40, 41, 42, 43, 44, 45, 46, 47, 48]}
    router = Router(runner)
    for rid, prompt in prompts.items():
        router.add(rid, prompt)
    router.step({1: 3, 2: 20, 3: 9})
    router.step({1: 1, 2: 9, 3: 1})
    for _ in range(5):
        router.decode(list(prompts))
    for rid, prompt in prompts.items():
        generated = router.generated[rid]
        assert generated == tiny_model.greedy(prompt, 7)[0][: len(generated)]
    assert [len(router.generated[rid]) for rid in prompts] == [7, 6, 7]


# ---- GPU only: the compiled kernels at a real model's head layout ------------------------

needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


@needs_gpu
@pytest.mark.parametrize("decodes", [1, 7, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_8b_layout_on_gpu(decodes: int, dtype: torch.dtype) -> None:
    """32 query heads, 8 KV heads, dim 128, block 16: decodes of random (some long)
    contexts with prompt chunks and a fresh prompt, default tiles and splits."""
    rng = random.Random(decodes)
    specs = [(1, rng.randrange(1, 3000)) for _ in range(decodes)]
    specs += [(300, 1000), (513, 513), (5, 77)]
    rng.shuffle(specs)
    batch = make_batch(specs, 32, 8, 128, 16, dtype, seed=decodes)
    assert_matches_reference(TritonPagedAttention(16), batch, 16, None, 2e-2)


@needs_gpu
@pytest.mark.parametrize("dim", [64, 80, 96, 256])
def test_head_dims_on_gpu(dim: int) -> None:
    specs = [(1, 700), (1, 33), (40, 200), (130, 130)]
    batch = make_batch(specs, 8, 2, dim, 16, torch.bfloat16, seed=dim)
    assert_matches_reference(TritonPagedAttention(16), batch, 16, None, 2e-2)
    batch = make_batch(specs, 8, 1, dim, 16, torch.float32, seed=dim)  # MQA, float32
    assert_matches_reference(TritonPagedAttention(16), batch, 16, 0.1, 1e-4)
