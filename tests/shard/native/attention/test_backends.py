"""Every attention backend equals the pure-torch reference on the same paged batches."""

from __future__ import annotations

import importlib.util
import os
import platform
import random
import shutil
import subprocess
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tests.shard.driving import Router
from tests.shard.models import TinyModel
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.loader import load_runner
from tgis.shard.native.attention.cpu_paged import CpuPagedAttention, load_kernel, openmp_runtimes
from tgis.shard.native.attention.interface import AttentionBackend, BatchLayout
from tgis.shard.native.attention.selection import select_attention_backend, start_attention_backend
from tgis.shard.native.attention.torch_paged import TorchPagedAttention
from tgis.shard.native.attention.varlen import (
    FlashVarlenAttention,
    SdpaVarlenAttention,
    prepare_packed,
)

BLOCK, HEADS, KV_HEADS, DIM, NUM_BLOCKS = 16, 4, 2, 8, 32
HAS_FLASH = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
# On a GPU machine these run on CUDA too (benchmarks/gpu_check.sh: pytest -m gpu).
pytestmark = pytest.mark.gpu
LENGTHS = (23, 40, 50, 2, 17)
# Step 1 computes the first `f` tokens of each sequence (prefill or chunk), step 2 the rest
# (a decode where one token is left, a chunk otherwise).
FIRSTS = (22, 17, 45, 1, 16)


def make_sequences(dtype: torch.dtype, device: torch.device) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(1)
    blocks = list(range(NUM_BLOCKS))
    random.Random(1).shuffle(blocks)  # out-of-order, non-contiguous block tables
    seqs = []
    for length in LENGTHS:
        shape = (length, HEADS, DIM), (length, KV_HEADS, DIM), (length, KV_HEADS, DIM)
        q, k, v = (torch.randn(s, generator=gen).to(device=device, dtype=dtype) for s in shape)
        table = [blocks.pop() for _ in range(-(-length // BLOCK))]
        seqs.append({"q": q, "k": k, "v": v, "table": table})
    return seqs


def step(
    backend: AttentionBackend,
    caches: tuple[torch.Tensor, torch.Tensor],
    seqs: list[dict[str, Any]],
    ranges: list[tuple[int, int]],
    scale: float | None,
    window: int | None = None,
    softcap: float | None = None,
) -> list[torch.Tensor]:
    qs, ks, vs, slots = [], [], [], []
    for seq, (start, end) in zip(seqs, ranges, strict=True):
        qs.append(seq["q"][start:end])
        ks.append(seq["k"][start:end])
        vs.append(seq["v"][start:end])
        slots += [seq["table"][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
    layout = BatchLayout.from_lists(
        query_lens=tuple(e - s for s, e in ranges),
        context_lens=tuple(e for _, e in ranges),
        block_tables=tuple(tuple(s["table"]) for s in seqs),
        slot_mapping=tuple(slots),
    )
    device = seqs[0]["q"].device
    metadata = backend.prepare(layout, device)
    capped = {} if softcap is None else {"softcap": softcap}
    out = backend.forward(
        torch.cat(qs),
        torch.cat(ks),
        torch.cat(vs),
        *caches,
        metadata,
        scale=scale,
        window=window,
        **capped,
    )
    return list(out.split(list(layout.query_lens)))


def two_steps(
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    scale: float | None,
    window: int | None = None,
    firsts: tuple[int, ...] = FIRSTS,
    softcap: float | None = None,
) -> list[torch.Tensor]:
    seqs = make_sequences(dtype, device)
    gen = torch.Generator().manual_seed(2)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    # Garbage in the cache: stale values must never be read.
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(device, dtype) for _ in "kv")
    caches = (k_cache, v_cache)
    first = step(backend, caches, seqs, [(0, f) for f in firsts], scale, window, softcap)
    rest = [(f, n) for f, n in zip(firsts, LENGTHS, strict=True)]
    return first + step(backend, caches, seqs, rest, scale, window, softcap)


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_varlen_equals_reference(dtype: torch.dtype, scale: float | None) -> None:
    cpu = torch.device("cpu")
    expected = two_steps(TorchPagedAttention(BLOCK), dtype, cpu, scale)
    got = two_steps(SdpaVarlenAttention(BLOCK), dtype, cpu, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=tol, rtol=tol)


def test_scale_changes_the_result() -> None:
    cpu = torch.device("cpu")
    default = two_steps(SdpaVarlenAttention(BLOCK), torch.float32, cpu, None)
    scaled = two_steps(SdpaVarlenAttention(BLOCK), torch.float32, cpu, 0.3)
    assert not torch.allclose(default[0], scaled[0])


# Sliding windows smaller than every context, equal to a block and to the first sequence's
# length, and larger than every context; the first steps' ends (FIRSTS) and CHUNKED's cut
# the windows of the second steps' first rows (chunks crossing the window's edge).
WINDOWS = (1, 5, 16, 23, 64)
CHUNKED = (9, 33, 20, 1, 3)


def naive_attention(
    seq: dict[str, Any], window: int | None, scale: float | None, softcap: float | None = None
) -> torch.Tensor:
    """One sequence's causal attention, query by query over its own keys (no cache): the
    query at position p sees the keys p - window < t <= p (transformers' sliding window);
    the scores soft-capped to softcap * tanh(score / softcap) when given (Gemma 2's)."""
    q, k, v = (seq[x].float() for x in "qkv")
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out = torch.empty_like(q)
    for p in range(q.shape[0]):
        lo = 0 if window is None else max(0, p - window + 1)
        scores = torch.einsum("hd,thd->ht", q[p], k[lo : p + 1])
        scores *= q.shape[-1] ** -0.5 if scale is None else scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[p] = torch.einsum("ht,thd->hd", scores.softmax(-1), v[lo : p + 1])
    return out


@pytest.mark.parametrize("firsts", [FIRSTS, CHUNKED], ids=["firsts", "chunked"])
@pytest.mark.parametrize("window", [None, *WINDOWS])
def test_reference_window_equals_naive_attention(
    window: int | None, firsts: tuple[int, ...]
) -> None:
    cpu = torch.device("cpu")
    got = two_steps(TorchPagedAttention(BLOCK), torch.float32, cpu, 0.3, window, firsts)
    for i, seq in enumerate(make_sequences(torch.float32, cpu)):
        expected = naive_attention(seq, window, 0.3)
        whole = torch.cat([got[i], got[len(LENGTHS) + i]])
        torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)


# Soft-capping (Gemma 2's attn_logit_softcapping): a cap below the scores' spread.
SOFTCAP = 0.5


@pytest.mark.parametrize("firsts", [FIRSTS, CHUNKED], ids=["firsts", "chunked"])
@pytest.mark.parametrize("window", [None, 5])
def test_reference_softcap_equals_naive_attention(
    window: int | None, firsts: tuple[int, ...]
) -> None:
    cpu = torch.device("cpu")
    got = two_steps(TorchPagedAttention(BLOCK), torch.float32, cpu, 0.3, window, firsts, SOFTCAP)
    uncapped = two_steps(TorchPagedAttention(BLOCK), torch.float32, cpu, 0.3, window, firsts)
    assert not torch.allclose(got[0], uncapped[0])
    for i, seq in enumerate(make_sequences(torch.float32, cpu)):
        expected = naive_attention(seq, window, 0.3, SOFTCAP)
        whole = torch.cat([got[i], got[len(LENGTHS) + i]])
        torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)


def test_backends_without_softcap_refuse_it() -> None:
    """A backend that cannot soft-cap (sdpa_varlen; flash_varlen and triton_paged alike)
    raises rather than attend uncapped (a soft-capped model is refused on them at start-up:
    tests/shard/native/models/test_gemma2.py)."""
    backend = SdpaVarlenAttention(BLOCK)
    assert not getattr(backend, "supports_softcap", False)
    with pytest.raises(ValueError, match="cannot soft-cap"):
        backend.forward(*(torch.zeros(1) for _ in range(5)), None, softcap=1.0)


def test_a_window_changes_the_result() -> None:
    cpu = torch.device("cpu")
    full = two_steps(TorchPagedAttention(BLOCK), torch.float32, cpu, None)
    slid = two_steps(TorchPagedAttention(BLOCK), torch.float32, cpu, None, 5)
    assert not torch.allclose(full[len(LENGTHS) + 2], slid[len(LENGTHS) + 2])  # a decode at 49


def _windowed_backends() -> list[Any]:
    backends: list[Any] = [SdpaVarlenAttention]
    if KERNEL is not None:
        backends.append(lambda block: CpuPagedAttention(block, KERNEL))
    return backends


@pytest.mark.parametrize("firsts", [FIRSTS, CHUNKED], ids=["firsts", "chunked"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_cpu_backend_windows_as_the_reference(
    dtype: torch.dtype, window: int, firsts: tuple[int, ...]
) -> None:
    """sdpa_varlen and cpu_paged (its decodes in the C kernel) against the reference."""
    cpu = torch.device("cpu")
    expected = two_steps(TorchPagedAttention(BLOCK), dtype, cpu, None, window, firsts)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for make in _windowed_backends():
        got = two_steps(make(BLOCK), dtype, cpu, None, window, firsts)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=tol, rtol=tol)


@pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and the flash-attn package")
@pytest.mark.parametrize("window", WINDOWS)
def test_flash_varlen_windows_as_the_reference_on_gpu(window: int) -> None:
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    expected = two_steps(TorchPagedAttention(BLOCK), dtype, cuda, None, window, CHUNKED)
    got = two_steps(FlashVarlenAttention(BLOCK), dtype, cuda, None, window, CHUNKED)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and the flash-attn package")
def test_flash_varlen_equals_reference_on_gpu() -> None:
    cuda, dtype = torch.device("cuda"), torch.bfloat16
    expected = two_steps(TorchPagedAttention(BLOCK), dtype, cuda, None)
    got = two_steps(FlashVarlenAttention(BLOCK), dtype, cuda, None)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not HAS_FLASH, reason="needs CUDA and the flash-attn package")
def test_flash_probe_passes_on_a_working_install() -> None:
    FlashVarlenAttention(BLOCK).probe(torch.device("cuda"))


def test_packed_context_slots_follow_every_block_table() -> None:
    """The vectorised packing equals a per-position walk of each (shuffled) block table."""
    rng = random.Random(3)
    block = 4
    free = list(range(64))
    rng.shuffle(free)
    contexts = [1, 4, 5, 13, 9, 16]
    tables = [[free.pop() for _ in range(-(-c // block))] for c in contexts]
    layout = BatchLayout.from_lists([1, 2, 5, 1, 9, 3], contexts, tables, list(range(21)))
    expected = [
        t[p // block] * block + p % block
        for c, t in zip(contexts, tables, strict=True)
        for p in range(c)
    ]
    packed = prepare_packed(layout, block, torch.device("cpu"))
    assert packed.context_slots.tolist() == expected
    assert packed.slot_mapping.tolist() == list(range(21))
    assert packed.cu_seqlens_q.tolist() == [0, 1, 3, 8, 9, 18, 21]
    assert packed.cu_seqlens_k.tolist() == [0, 1, 5, 10, 23, 32, 48]
    assert packed.cu_seqlens_q.dtype == packed.cu_seqlens_k.dtype == torch.int32
    assert (packed.max_seqlen_q, packed.max_seqlen_k) == (9, 16)


KERNEL = load_kernel()
needs_kernel = pytest.mark.skipif(
    KERNEL is None and os.environ.get("CI") != "true",
    reason="the CPU attention extension was not built (no C compiler at install)",
)


@needs_kernel
@pytest.mark.parametrize("scale", [None, 0.3])
def test_cpu_paged_equals_reference(scale: float | None) -> None:
    assert KERNEL is not None, "CI builds the CPU attention extension (make install)"
    cpu = torch.device("cpu")
    expected = two_steps(TorchPagedAttention(BLOCK), torch.float32, cpu, scale)
    got = two_steps(CpuPagedAttention(BLOCK, KERNEL), torch.float32, cpu, scale)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    # bfloat16 caches are read by the kernel too (in float32); the reference attends in
    # bfloat16, so they agree to bfloat16's precision.
    expected = two_steps(TorchPagedAttention(BLOCK), torch.bfloat16, cpu, scale)
    got = two_steps(CpuPagedAttention(BLOCK, KERNEL), torch.bfloat16, cpu, scale)
    for e, g in zip(expected, got, strict=True):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g, e, atol=2e-2, rtol=2e-2)


@pytest.fixture(params=[1, 3], ids=["1-thread", "3-threads"])
def torch_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's intra-op threads for the test (the C kernel shares its (sequence, KV head)
    items out between that many OpenMP threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block", [(8, 2, 64, 16), (4, 4, 128, 4), (6, 1, 32, 1)]
)
def test_cpu_paged_decodes_random_batches(
    heads: int, kv_heads: int, dim: int, block: int, cache_dtype: torch.dtype, torch_threads: int
) -> None:
    """Many decoding sequences of random lengths (block boundaries, one token, long) with
    shuffled tables over a cache full of garbage, against the reference, on one thread and
    on three."""
    assert KERNEL is not None
    check_random_batches(KERNEL, heads, kv_heads, dim, block, cache_dtype)


def check_random_batches(
    kernel_module: ModuleType,
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    cache_dtype: torch.dtype,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The kernel against the reference on random batches (with a sliding ``window`` and a
    ``softcap``, when given). A bfloat16 cache is checked against the float32 reference over
    the same (bfloat16-rounded) values: the kernel widens them exactly, so only float32
    rounding separates the two."""
    rng = random.Random(heads * 1000 + dim)
    gen = torch.Generator().manual_seed(dim)
    lengths = [1, block, block + 1, 2 * block, *(rng.randrange(1, 300) for _ in range(20))]
    num_blocks = sum(-(-n // block) for n in lengths) + 16
    shape = (num_blocks, block, kv_heads, dim)
    caches = [(torch.randn(shape, generator=gen) * 3).to(cache_dtype) for _ in "kv"]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, slots = [], []
    for n in lengths:
        table = [free.pop() for _ in range(-(-n // block))]
        tables.append(table)
        slots.append(table[(n - 1) // block] * block + (n - 1) % block)
    layout = BatchLayout.from_lists([1] * len(lengths), lengths, tables, slots)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    k = torch.randn(len(lengths), kv_heads, dim, generator=gen).to(cache_dtype).float()
    v = torch.randn(len(lengths), kv_heads, dim, generator=gen).to(cache_dtype).float()
    reference = TorchPagedAttention(block)
    cpu = torch.device("cpu")
    options: dict[str, Any] = {"window": window, "softcap": softcap}
    expected = reference.forward(
        q, k, v, *(c.float() for c in caches), reference.prepare(layout, cpu), **options
    )
    kernel = CpuPagedAttention(block, kernel_module)
    got = kernel.forward(
        q, k, v, *(c.clone() for c in caches), kernel.prepare(layout, cpu), **options
    )
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("window", [None, 17])
def test_cpu_paged_decodes_random_batches_softcapped(window: int | None) -> None:
    """The kernel's soft-capped scores (with and without a window) as the reference's."""
    assert KERNEL is not None
    for cache_dtype in (torch.float32, torch.bfloat16):
        check_random_batches(KERNEL, 8, 2, 64, 16, cache_dtype, window, softcap=2.0)


@needs_kernel
@pytest.mark.parametrize("window", [1, 7, 16, 17, 100, 400])
@pytest.mark.parametrize("block", [16, 4])
def test_cpu_paged_decodes_random_batches_in_a_window(window: int, block: int) -> None:
    """Windows from one key to more than every context, at and off block boundaries: the
    kernel starts inside a block and skips the blocks before it."""
    assert KERNEL is not None
    for cache_dtype in (torch.float32, torch.bfloat16):
        check_random_batches(KERNEL, 8, 2, 64, block, cache_dtype, window)


@needs_kernel
def test_cpu_kernel_never_reads_blocks_before_the_window() -> None:
    """Table entries wholly before the window may name blocks given back (here: out of
    range); the kernel reads and checks only the window's."""
    assert KERNEL is not None
    cache = torch.randn(4, 4, 1, 8)
    q, out = torch.randn(1, 2, 8), torch.empty(1, 2, 8)
    context = torch.tensor([10], dtype=torch.int64)
    tables = torch.tensor([[99, 1, 2]], dtype=torch.int64)  # block 99 does not exist
    args = (q, cache, cache, out, tables, context)
    KERNEL.paged_decode_attention(
        *(t.data_ptr() for t in args), 1, 2, 1, 8, 4, 3, 4, 10, 1.0, 0, 1, 6
    )
    layout = BatchLayout.from_lists([1], [10], [[3, 1, 2]], [2 * 4 + 1])
    reference = TorchPagedAttention(4)
    metadata = reference.prepare(layout, torch.device("cpu"))
    new = cache[2, 1:2].clone()  # token 9's key and value, already in the cache
    expected = reference.forward(
        q, new, new, cache.clone(), cache.clone(), metadata, scale=1.0, window=6
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="out of range"):  # the window reaches block 99
        KERNEL.paged_decode_attention(
            *(t.data_ptr() for t in args), 1, 2, 1, 8, 4, 3, 4, 10, 1.0, 0, 1, 7
        )


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((x for x in text.splitlines() if x.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


# The kernel's target_clones variants and the CPU flags each needs to run.
_VARIANTS = {
    "x86-64": set(),
    "x86-64-v3": {"avx2", "fma", "bmi2"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"},
}


@pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="x86-64 with gcc"
)
@pytest.mark.parametrize("march", list(_VARIANTS))
def test_every_compiled_variant_of_the_kernel_equals_the_reference(
    march: str, tmp_path: Path
) -> None:
    """The installed module runs the variant the CPU selects (target_clones); each one is
    built here on its own (TGIS_SINGLE_TARGET) so that all are checked on any host that can
    run them: the baseline's scalar and SSE code, AVX2 + FMA, AVX-512."""
    missing = _VARIANTS[march] - _cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {sorted(missing)} for {march}")
    source = Path(load_kernel.__code__.co_filename).parent / "csrc" / "cpu_attention.c"
    built = tmp_path / f"_cpu_attention{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        [
            "gcc", "-shared", "-fPIC", "-O3", "-fopenmp", "-std=c11", "-ffp-contract=fast",
            "-Wno-psabi", f"-march={march}", "-DTGIS_SINGLE_TARGET",
            f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(built),
        ],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    spec = importlib.util.spec_from_file_location("_cpu_attention", built)
    assert spec is not None and spec.loader is not None
    variant = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(variant)
    for cache_dtype in (torch.float32, torch.bfloat16):
        check_random_batches(variant, 8, 2, 64, 16, cache_dtype)
        check_random_batches(variant, 4, 2, 72, 4, cache_dtype)  # 64 lanes + a scalar tail
        check_random_batches(variant, 8, 2, 64, 16, cache_dtype, window=37)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_refuses_out_of_range_blocks_and_contexts(threads: int) -> None:
    assert KERNEL is not None
    cache = torch.zeros(4, 4, 1, 8)
    context = torch.tensor([5, 5, 5], dtype=torch.int64)
    q = torch.zeros(3, 2, 8)
    # The middle sequence is bad: block 4 of 4, or a context above max_context.
    for table, max_context in (([0, 4], 5), ([0, 1], 4)):
        out = torch.empty_like(q)
        tables = torch.tensor([[0, 1], table, [2, 3]], dtype=torch.int64)
        args = (q, cache, cache, out, tables, context)
        with pytest.raises(ValueError, match=r"out of range|too long"):
            KERNEL.paged_decode_attention(
                *(t.data_ptr() for t in args), 3, 2, 1, 8, 4, 2, 4, max_context, 1.0, 0, threads
            )


def test_selection_on_cpu_and_forced() -> None:
    cpu = torch.device("cpu")
    default = "cpu_paged" if KERNEL is not None else "torch_paged"
    assert select_attention_backend(cpu, BLOCK).name == default
    assert select_attention_backend(cpu, BLOCK, "torch_paged").name == "torch_paged"
    assert select_attention_backend(cpu, BLOCK, "sdpa_varlen").name == "sdpa_varlen"
    with pytest.raises(ValueError, match="TGIS_ATTENTION_BACKEND"):
        select_attention_backend(cpu, BLOCK, "nonsense")
    # TGIS's FLASH_ATTENTION switch: no flash on the CPU
    assert select_attention_backend(cpu, BLOCK, flash=True).name == default


@pytest.mark.parametrize("backend", ["sdpa_varlen", pytest.param("cpu_paged", marks=needs_kernel)])
def test_model_runner_on_other_backends_matches_hf(tiny_model: TinyModel, backend: str) -> None:
    engine = EngineSettings(attention_backend=backend)
    runner = load_runner(
        ShardConfig(model_name=str(tiny_model.path), kv_cache_blocks=32, engine=engine)
    )
    assert runner.info.attention_backend == backend
    prompts = {1: [5, 6, 7], 2: list(range(10, 39)), 3: [40, 41, 42, 43, 44, 45, 46, 47, 48]}
    router = Router(runner)
    for rid, prompt in prompts.items():
        router.add(rid, prompt)
    router.step({rid: len(p) for rid, p in prompts.items()})
    for _ in range(7):
        router.decode(list(prompts))
    for rid, prompt in prompts.items():
        assert router.generated[rid] == tiny_model.greedy(prompt, 8)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the probe must fail: no CUDA here")
def test_a_backend_failing_its_start_up_probe(caplog: pytest.LogCaptureFixture) -> None:
    """The probe makes a real call: on a host without CUDA the CUDA backends fail it. The
    default falls back to the reference with a warning; a forced one is a StartupError."""
    cuda = torch.device("cuda")
    with caplog.at_level("WARNING"):
        backend = start_attention_backend(cuda, BLOCK, torch.bfloat16)
    assert backend.name == "torch_paged"
    assert "failed its start-up probe" in caplog.text
    with pytest.raises(StartupError, match="triton_paged failed its start-up probe") as info:
        start_attention_backend(cuda, BLOCK, torch.bfloat16, "triton_paged")
    assert "\n" not in str(info.value)
    # Backends without kernels of their own, and the CPU, need no probe.
    assert start_attention_backend(cuda, BLOCK, torch.bfloat16, "sdpa_varlen").name == "sdpa_varlen"
    cpu_forced = start_attention_backend(torch.device("cpu"), BLOCK, torch.float32, "torch_paged")
    assert cpu_forced.name == "torch_paged"


@needs_kernel
def test_the_kernel_shares_the_openmp_runtime_torch_loaded(tmp_path: Path) -> None:
    """Built with -fopenmp, the extension binds to torch's libgomp (one thread pool)."""
    assert KERNEL is not None
    runtimes = openmp_runtimes()
    assert len(runtimes) <= 1, runtimes
    assert CpuPagedAttention(BLOCK, KERNEL).shares_torch_threads
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 0 fe:00 1 /opt/a/libgomp.so.1\n"
        "7f01-7f02 r--p 0 fe:00 1 /opt/a/libgomp.so.1\n"
        "7f02-7f03 r-xp 0 fe:00 2 /usr/lib64/libgomp-5a1b.so.1\n"
        "7f06-7f07 r-xp 0 fe:00 4 /usr/lib/libc.so.6\n"
        "7f08-7f09 rw-p 0 00:00 0\n"
    )
    assert openmp_runtimes(maps) == {"/opt/a/libgomp.so.1", "/usr/lib64/libgomp-5a1b.so.1"}
    assert openmp_runtimes(tmp_path / "missing") == set()
