"""LoRA adapters (``adapter_id``) in the native engine, against PEFT's own generate.

Random adapters of the session's tiny Llama are saved by PEFT into an adapter cache; the
shard loads them through ``ADAPTER_CACHE``'s ShardConfig field. The oracle is
``PeftModel.generate`` of each request alone; the shard runs requests for different
adapters and for none in the same steps.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.lora_oracle import lora_greedy, save_random_lora
from tests.shard.driving import Router
from tests.shard.models import TinyModel
from tgis.shard.adapters.store_paths import StoreError
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import AdapterKind, DetailOptions

NEW_TOKENS = 6
PROMPT_A = [5, 17, 33, 9, 81, 40, 7]
PROMPT_B = [12, 99, 4, 150, 61]
PROMPT_C = [201, 3, 77, 18, 52, 11, 140, 6, 23]
LOGPROBS = DetailOptions(logprobs=True, generated_tokens=True)


@pytest.fixture(scope="module")
def cache(tiny_model: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three LoRA adapters (every target; q/v with rsLoRA, nested; the MLP only, saved as
    ``.bin``) and a prompt-tuning one."""
    root = tmp_path_factory.mktemp("adapters")
    save_random_lora(tiny_model.path, root / "all", seed=1, r=8, alpha=16)
    save_random_lora(
        tiny_model.path,
        root / "team" / "qv",
        seed=2,
        r=4,
        alpha=8,
        targets=["q_proj", "v_proj"],
        rslora=True,
    )
    save_random_lora(
        tiny_model.path,
        root / "mlp",
        seed=3,
        r=2,
        alpha=4,
        targets=["gate_proj", "up_proj", "down_proj"],
        safetensors=False,
    )
    (root / "prompt").mkdir()
    (root / "prompt" / "adapter_config.json").write_text(
        '{"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 4, "task_type": "CAUSAL_LM"}'
    )
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(4)
    embeddings = torch.randn(4, 64, generator=generator)
    save_file({"prompt_embeddings": embeddings}, root / "prompt" / "adapter_model.safetensors")
    return root


def make_runner(model: TinyModel, cache: Path | None, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("kv_cache_blocks", 64)
    return load_runner(
        ShardConfig(
            model_name=str(model.path),
            adapter_cache=None if cache is None else str(cache),
            **kwargs,
        )
    )  # type: ignore[return-value]


_ORACLE: dict[tuple[str, tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}


def oracle(model: TinyModel, cache: Path, adapter_id: str, prompt: list[int], new: int):
    key = (adapter_id, tuple(prompt), new)
    if key not in _ORACLE:
        adapter = cache / adapter_id if adapter_id else None
        _ORACLE[key] = lora_greedy(model.path, adapter, prompt, new)
    return _ORACLE[key]


def test_lookup_says_what_each_adapter_is(tiny_model: TinyModel, cache: Path) -> None:
    runner = make_runner(tiny_model, cache)
    assert runner.info.adapters_enabled
    assert runner.info.max_loras == 8
    assert runner.lookup_adapter("all").kind is AdapterKind.LORA
    assert runner.lookup_adapter("team/qv").prefix_length == 0
    prompt = runner.lookup_adapter("prompt")
    assert (prompt.kind, prompt.prefix_length) == (AdapterKind.PROMPT_TUNING, 4)


def test_without_a_cache_every_adapter_is_refused(tiny_model: TinyModel) -> None:
    runner = make_runner(tiny_model, None)
    assert not runner.info.adapters_enabled
    with pytest.raises(StoreError, match="no adapter store was configured"):
        runner.lookup_adapter("all")


def test_adapters_and_plain_requests_in_one_batch_match_peft(
    tiny_model: TinyModel, cache: Path
) -> None:
    """Three LoRA adapters and a plain prompt prefilled together (one in chunks), then
    decoded together: each equals PEFT's generate of that request alone, logprobs too."""
    runner = make_runner(tiny_model, cache)
    router = Router(runner, seed=5)
    cases = {
        1: ("all", PROMPT_A),
        2: ("team/qv", PROMPT_B),
        3: ("", PROMPT_C),
        4: ("mlp", PROMPT_A),
    }
    for rid, (adapter_id, prompt) in cases.items():
        if adapter_id:
            runner.lookup_adapter(adapter_id)
        router.add(rid, prompt, details=LOGPROBS, adapter_id=adapter_id)
    router.step({1: len(PROMPT_A), 2: len(PROMPT_B), 3: len(PROMPT_C), 4: 3})
    router.step({1: 1, 2: 1, 3: 1, 4: len(PROMPT_A) - 3})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1, 2, 3, 4])
    for rid, (adapter_id, prompt) in cases.items():
        new = NEW_TOKENS if rid == 4 else NEW_TOKENS + 1
        tokens, logits = oracle(tiny_model, cache, adapter_id, prompt, new)
        assert router.generated[rid] == tokens, f"request {rid} ({adapter_id or 'plain'})"
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            expected = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - expected) < 1e-4, f"request {rid}"


def test_the_adapters_change_the_output(tiny_model: TinyModel, cache: Path) -> None:
    """The oracle itself: with random A and B each adapter changes the greedy text."""
    plain, _ = oracle(tiny_model, cache, "", PROMPT_A, NEW_TOKENS)
    assert plain == tiny_model.greedy(PROMPT_A, NEW_TOKENS)[0]
    for adapter_id in ("all", "mlp"):
        assert oracle(tiny_model, cache, adapter_id, PROMPT_A, NEW_TOKENS)[0] != plain


def test_one_adapter_for_the_whole_step(tiny_model: TinyModel, cache: Path) -> None:
    """Every row of the step uses the same adapter (the path without row indices)."""
    runner = make_runner(tiny_model, cache)
    router = Router(runner)
    for rid, prompt in ((1, PROMPT_A), (2, PROMPT_C)):
        router.add(rid, prompt, adapter_id="team/qv")
    router.step({1: len(PROMPT_A), 2: len(PROMPT_C)})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1, 2])
    assert router.generated[1] == oracle(tiny_model, cache, "team/qv", PROMPT_A, NEW_TOKENS)[0]
    assert router.generated[2] == oracle(tiny_model, cache, "team/qv", PROMPT_C, NEW_TOKENS)[0]


def test_a_preempted_lora_sequence_resumes_exactly(tiny_model: TinyModel, cache: Path) -> None:
    runner = make_runner(tiny_model, cache)
    router = Router(runner)
    router.add(1, PROMPT_B, adapter_id="all")
    router.step({1: len(PROMPT_B)})
    router.decode([1])
    router.preempt(1)
    router.step({1: len(PROMPT_B) + 2})  # recompute the prompt and both tokens
    for _ in range(NEW_TOKENS - 3):
        router.decode([1])
    assert router.generated[1] == oracle(tiny_model, cache, "all", PROMPT_B, NEW_TOKENS)[0]


def test_more_adapters_than_the_cache_keeps_are_reloaded(
    tiny_model: TinyModel, cache: Path
) -> None:
    """With room for two, a third adapter evicts the least recently used one; a request for
    the evicted adapter reloads it and is still right."""
    runner = make_runner(tiny_model, cache, max_loras=2)
    assert runner.adapters.cache is not None
    for adapter_id in ("all", "team/qv", "mlp"):
        runner.lookup_adapter(adapter_id)
    assert runner.adapters.cache.cached_ids() == ["team/qv", "mlp"]
    router = Router(runner)
    router.add(1, PROMPT_C, adapter_id="all")
    router.step({1: len(PROMPT_C)})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1])
    assert router.generated[1] == oracle(tiny_model, cache, "all", PROMPT_C, NEW_TOKENS)[0]
    assert len(runner.adapters.cache.cached_ids()) <= 2


def test_a_prompt_tuning_adapter_is_a_prefix(tiny_model: TinyModel, cache: Path) -> None:
    from safetensors.torch import load_file

    from tests.prefix_oracle import prefixed_greedy

    runner = make_runner(tiny_model, cache)
    length = runner.lookup_adapter("prompt").prefix_length
    router = Router(runner)
    router.add(1, PROMPT_A, adapter_id="prompt", prefix_length=length)
    router.add(2, PROMPT_B, adapter_id="all")
    router.step({1: length + len(PROMPT_A), 2: len(PROMPT_B)})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1, 2])
    embeddings = load_file(cache / "prompt" / "adapter_model.safetensors")["prompt_embeddings"]
    assert (
        router.generated[1] == prefixed_greedy(tiny_model.hf, embeddings, PROMPT_A, NEW_TOKENS)[0]
    )
    assert router.generated[2] == oracle(tiny_model, cache, "all", PROMPT_B, NEW_TOKENS)[0]


def test_a_bad_adapter_fails_its_sequence_alone(tiny_model: TinyModel, cache: Path) -> None:
    runner = make_runner(tiny_model, cache)
    router = Router(runner)
    router.add(1, PROMPT_A, adapter_id="missing")
    router.add(2, PROMPT_B, adapter_id="prompt", prefix_length=3)  # the store says 4
    router.add(3, PROMPT_C, adapter_id="all")
    output = router.step({1: len(PROMPT_A), 2: 3 + len(PROMPT_B), 3: len(PROMPT_C)})
    errors = {e.request_id: e.message for e in output.errors}
    assert errors[1] == "can't retrieve adapter with id 'missing': directory does not exist"
    assert errors[2].startswith("prompt-tuning adapter 'prompt' has 4 virtual tokens")
    assert [t.request_id for t in output.tokens] == [3]
    assert router.generated[3] == oracle(tiny_model, cache, "all", PROMPT_C, 1)[0]
