"""On a CUDA device (skipped elsewhere; `benchmarks/gpu_check.sh` runs every test marked
`gpu`): the tiny Llama served by each CUDA attention backend gives transformers' greedy
tokens and logprobs, the compiled step equals the eager one, decode and verify steps
replayed from CUDA graphs equal the eager ones, the KV warm-up measures real
memory, dummy weights are created on the device, and NCCL joins a group of one."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from tests.shard.cuda import cuda_runner, no_tf32  # noqa: F401 - the fixture
from tests.shard.driving import Router
from tests.shard.models import TinyModel, build_tiny_llama
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.attention.interface import BatchLayout
from tgis.shard.native.graphs.compiled import CompiledForward
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import DetailOptions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = {1: [5, 9, 33, 2, 41, 7, 8], 2: [60, 61, 62] * 7, 3: list(range(10, 47))}
NEW_TOKENS = 12
LOGPROBS = DetailOptions(logprobs=True, generated_tokens=True)


def cuda_backends() -> list[str]:
    names = ["torch_paged", "sdpa_varlen", "triton_paged"]
    if importlib.util.find_spec("flash_attn") is not None:
        names.append("flash_varlen")
    return names


def generate(runner: ModelRunner) -> Router:
    """The three prompts: two prefilled together, the third in chunks next to their
    decodes, then decodes to NEW_TOKENS each, on shuffled non-contiguous blocks."""
    router = Router(runner, seed=5)
    router.add(1, PROMPTS[1], details=LOGPROBS)
    router.add(2, PROMPTS[2], details=LOGPROBS)
    router.step({1: len(PROMPTS[1]), 2: len(PROMPTS[2])})
    router.add(3, PROMPTS[3], details=LOGPROBS)
    for chunk in (16, 16, 5):
        router.step({1: 1, 2: 1, 3: chunk})
    while any(len(router.generated[r]) < NEW_TOKENS for r in PROMPTS):
        router.step({r: 1 for r in PROMPTS if len(router.generated[r]) < NEW_TOKENS})
    return router


def logprobs(router: Router, rid: int) -> list[float]:
    return [t.token.logprob for o in router.outputs for t in o.tokens if t.request_id == rid]


@pytest.mark.parametrize("backend", cuda_backends())
def test_each_backend_serves_transformers_greedy_tokens(
    backend: str, tiny_model: TinyModel
) -> None:
    if backend == "flash_varlen":
        pytest.skip("flash-attn takes fp16/bf16 only; its kernel is compared in its own test")
    router = generate(cuda_runner(tiny_model.path, backend=backend))
    assert router.runner.attention.name == backend
    for rid, prompt in PROMPTS.items():
        expected, logits = tiny_model.greedy(prompt, NEW_TOKENS)
        assert router.generated[rid][:NEW_TOKENS] == expected, (backend, rid)
        for got, step_logits in zip(logprobs(router, rid), logits, strict=True):
            ref = torch.log_softmax(step_logits, dim=-1).max().item()
            assert abs(got - ref) < 1e-3, (backend, rid)


@pytest.mark.parametrize("backend", cuda_backends())
def test_each_backend_agrees_with_the_reference_in_bfloat16(
    backend: str, tiny_model: TinyModel
) -> None:
    """The served dtype on GPUs: first-token logprobs of every backend within bf16 noise of
    the reference backend's on the same bf16 model."""
    path = tiny_model.path
    bf16 = "bfloat16"
    expected = generate(cuda_runner(path, backend="torch_paged", dtype=bf16))
    got = generate(cuda_runner(path, backend=backend, dtype=bf16))
    for rid in PROMPTS:
        first_expected, first_got = logprobs(expected, rid)[0], logprobs(got, rid)[0]
        assert abs(first_got - first_expected) < 5e-2, (backend, rid)
        assert got.generated[rid][0] == expected.generated[rid][0], (backend, rid)


def test_compiled_step_equals_eager_on_cuda(tiny_model: TinyModel) -> None:
    eager = generate(cuda_runner(tiny_model.path))
    runner = cuda_runner(tiny_model.path, compiled=True)
    assert isinstance(runner.forward, CompiledForward)
    compiled = generate(runner)
    assert compiled.generated == eager.generated
    for rid in PROMPTS:
        for a, b in zip(logprobs(compiled, rid), logprobs(eager, rid), strict=True):
            assert abs(a - b) < 1e-4, rid


@pytest.mark.parametrize("compiled", [False, True])
def test_decode_graphs_equal_eager(
    compiled: bool, tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps replayed from CUDA graphs give the tokens and logprobs of the same
    forward run directly, over the eager and the compiled forward."""
    direct = cuda_runner(tiny_model.path, backend="triton_paged", compiled=compiled, graphs="0")
    assert direct.graph_sets == ()
    expected = generate(direct)
    runner = cuda_runner(tiny_model.path, backend="triton_paged", compiled=compiled, graphs="1")
    (graphs,) = runner.graph_sets
    graphs.verify(seed=3)  # graph == direct forward on random inputs
    replays: list[int] = []
    real_run = graphs.run

    def counting_run(layout: BatchLayout, bucket: int) -> torch.Tensor:
        replays.append(bucket)
        return real_run(layout, bucket)

    monkeypatch.setattr(graphs, "run", counting_run)
    got = generate(runner)
    # Prefill and the chunk steps run directly; then 8 decodes of all 3, 3 of the last one.
    assert replays == [4] * 8 + [1] * 3
    assert got.generated == expected.generated
    for rid in PROMPTS:
        for a, b in zip(logprobs(got, rid), logprobs(expected, rid), strict=True):
            assert abs(a - b) < 1e-4, rid


def test_verify_graphs_equal_eager(tiny_model: TinyModel, monkeypatch: pytest.MonkeyPatch) -> None:
    """With --speculate 4 the loader also captures verify graphs (1 + 4 rows a sequence):
    drafted steps replayed from them give the eager step's tokens and logprobs."""
    direct = cuda_runner(tiny_model.path, backend="triton_paged", speculate=4, graphs="0")
    expected = drafted_generate(direct)
    runner = cuda_runner(tiny_model.path, backend="triton_paged", speculate=4, graphs="1")
    assert [g.width for g in runner.graph_sets] == [1, 5]
    runner.graph_sets[1].verify(seed=3)
    widths: list[int] = []
    for graphs in runner.graph_sets:
        real_run = graphs.run

        def counting_run(layout: BatchLayout, bucket: int, g=graphs, run=real_run) -> torch.Tensor:  # type: ignore[no-untyped-def]
            widths.append(g.width)
            return run(layout, bucket)

        monkeypatch.setattr(graphs, "run", counting_run)
    got = drafted_generate(runner)
    assert 5 in widths
    assert got.generated == expected.generated
    for rid in PROMPTS:
        for a, b in zip(logprobs(got, rid), logprobs(expected, rid), strict=True):
            assert abs(a - b) < 1e-4, rid


def drafted_generate(runner: ModelRunner) -> Router:
    """The three prompts, then steps drafting 0 to 4 tokens per sequence (random ids: the
    drafts are verified whatever they are)."""
    rng = random.Random(4)
    router = Router(runner, seed=5)
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt, details=LOGPROBS)
    router.step({rid: len(p) for rid, p in PROMPTS.items()})
    while live := [r for r in PROMPTS if len(router.generated[r]) < NEW_TOKENS]:
        drafts = {r: [rng.randrange(3, 200) for _ in range(rng.randrange(5))] for r in live}
        router.speculate(drafts)
    return router


def test_kv_warm_up_measures_device_memory(tiny_model: TinyModel) -> None:
    """No TGIS_KV_CACHE_BLOCKS: the warm-up runs and sizes the cache from free memory,
    capped by --max-batch-total-tokens."""
    runner = load_runner(
        ShardConfig(
            model_name=str(tiny_model.path),
            max_sequence_length=256,
            max_batch_prefill_tokens=1024,
            max_batch_size=32,
            max_batch_total_tokens=1 << 20,
            engine=EngineSettings(compile="0"),
        )
    )
    assert isinstance(runner, ModelRunner)
    assert runner.info.num_blocks == (1 << 20) // runner.info.block_size
    router = Router(runner)
    router.add(1, PROMPTS[1])
    router.step({1: len(PROMPTS[1])})
    assert router.generated[1] == tiny_model.greedy(PROMPTS[1], 1)[0]


def test_dummy_weights_are_created_on_the_device(tmp_path: Path) -> None:
    build_tiny_llama(tmp_path, seed=1)
    (tmp_path / "model.safetensors").unlink()  # nothing to read but config.json
    runner = load_runner(
        ShardConfig(
            model_name=str(tmp_path),
            dtype="bfloat16",
            load_format="dummy",
            kv_cache_blocks=32,
            max_sequence_length=128,
            engine=EngineSettings(compile="0"),
        )
    )
    assert isinstance(runner, ModelRunner)
    router = Router(runner)
    router.add(1, PROMPTS[3], details=LOGPROBS)
    router.step({1: len(PROMPTS[3])})
    (lp,) = logprobs(router, 1)
    assert lp == lp and lp <= 0.0  # finite, a log-probability


def test_nccl_joins_a_group_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from tgis.procinfo import free_port
    from tgis.shard.parallel.distributed import backend_for, destroy, join_group

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    assert backend_for(True) == "nccl"
    tp = join_group(0, 1, local_rank=0, timeout_s=60, cuda=True)
    try:
        assert dist.get_backend() == "nccl"
        x = torch.arange(8, dtype=torch.float32, device="cuda")
        dist.all_reduce(x)
        assert x.tolist() == list(range(8))
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x)
        assert torch.equal(parts[0], x)
        assert tp.rank == 0 and tp.world_size == 1
    finally:
        destroy()
