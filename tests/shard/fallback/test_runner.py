"""The transformers fallback engine (``HfRunner``) against ``generate()`` of the same model.

Tiny random models of families the native engine does not implement (GPT-2, OPT, BLOOM,
T5) are built from configs at test time and driven by Step plans through the router
stand-in (``tests/shard/driving.py``): batches of different lengths, sequences joining
mid-decode, chunked prompts, finished and unscheduled sequences.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.shard.driving import Router
from tests.shard.fallback.hf_models import VOCAB, prompt_of, random_causal, random_seq2seq
from tests.shard.models import TinyModel
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.engines import select_engine
from tgis.shard.errors import InvalidStepError, StartupError
from tgis.shard.fallback.kv import KVBatch, concat, select
from tgis.shard.fallback.runner import HfRunner
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard_api.messages import (
    DetailOptions,
    ModelKind,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    StepPlan,
)

NEW_TOKENS = 10
LOGPROBS = DetailOptions(logprobs=True, ranks=True, generated_tokens=True)


PROMPTS = {1: prompt_of(3, 1), 2: prompt_of(11, 2), 3: prompt_of(29, 3), 4: prompt_of(6, 4)}


@dataclass
class HfModel:
    """A saved tiny transformers model and its in-process reference."""

    path: Path
    hf: Any
    seq2seq: bool = False
    _cache: dict[tuple[Any, ...], tuple[list[int], list[torch.Tensor]]] = field(
        default_factory=dict
    )

    def generate(
        self, prompt: list[int], max_new_tokens: int = NEW_TOKENS, **kwargs: Any
    ) -> tuple[list[int], list[torch.Tensor]]:
        """``generate()``'s greedy continuation of ``prompt`` alone and its step logits."""
        key = (*prompt, max_new_tokens, *sorted(kwargs.items()))
        if key not in self._cache:
            ids = torch.tensor([prompt])
            with torch.no_grad():
                out = self.hf.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                    **kwargs,
                )
            skip = 1 if self.seq2seq else len(prompt)  # the decoder start token / the prompt
            tokens = out.sequences[0, skip:].tolist()
            assert len(tokens) == max_new_tokens
            self._cache[key] = (tokens, [step[0].float() for step in out.logits])
        return self._cache[key]

    def runner(self, **kwargs: Any) -> HfRunner:
        """A fresh fallback runner on this model."""
        kwargs.setdefault("kv_cache_blocks", 64)
        runner = load_runner(ShardConfig(model_name=str(self.path), **kwargs))
        assert isinstance(runner, HfRunner)
        return runner


def _save(model: Any, path: Path, seq2seq: bool = False) -> HfModel:
    model.eval()
    model.save_pretrained(path)
    model.generation_config.eos_token_id = None  # the reference never stops early
    return HfModel(path, model, seq2seq)


@pytest.fixture(scope="module", params=["gpt2", "opt", "bloom"])
def causal(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HfModel:
    """One tiny random causal LM per family the native engine lacks."""
    return _save(random_causal(request.param), tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> HfModel:
    """The tiny GPT-2 alone, for the tests that need one causal family only."""
    return _save(random_causal("gpt2"), tmp_path_factory.mktemp("gpt2-only"))


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> HfModel:
    """A tiny random float32 T5 (pad 0 = decoder start, EOS 1)."""
    return _save(random_seq2seq("t5"), tmp_path_factory.mktemp("t5"), seq2seq=True)


@pytest.fixture(scope="module", params=["t5", "bart"])
def seq2seq(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> HfModel:
    """Each tiny random encoder-decoder family."""
    if request.param == "t5":
        return request.getfixturevalue("t5")
    return _save(random_seq2seq("bart"), tmp_path_factory.mktemp("bart"), seq2seq=True)


def run_batch_with_late_joiner(router: Router, prompts: dict[int, list[int]]) -> None:
    """Requests 1-3 start together (2 and 3 split their prompts differently); request 4
    joins after three decode steps and prefills while the others decode."""
    first = {1: prompts[1], 2: prompts[2], 3: prompts[3]}
    for rid, prompt in first.items():
        router.add(rid, prompt, details=LOGPROBS)
    router.step({1: len(prompts[1]), 2: len(prompts[2]), 3: 10})  # 3 is chunked
    router.step({1: 1, 2: 1, 3: len(prompts[3]) - 10})
    for _ in range(2):
        router.decode([1, 2, 3])
    router.add(4, prompts[4], details=LOGPROBS)
    out = router.step({1: 1, 2: 1, 3: 1, 4: len(prompts[4])})
    assert sorted(t.request_id for t in out.tokens) == [1, 2, 3, 4]
    while any(len(router.generated[r]) < NEW_TOKENS for r in prompts):
        router.decode([r for r in prompts if len(router.generated[r]) < NEW_TOKENS])


def assert_matches_generate(router: Router, model: HfModel, prompts: dict[int, list[int]]) -> None:
    """Tokens equal ``generate()``'s, logprobs within 1e-4 of its logits', ranks 1."""
    for rid, prompt in prompts.items():
        expected, logits = model.generate(prompt)
        assert router.generated[rid] == expected, f"request {rid}"
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            reference = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - reference) < 1e-4, f"request {rid}"
            assert detail.rank == 1


# ---- batched caches ------------------------------------------------------------------------


def test_select_packs_rows_and_concat_pads() -> None:
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])
    keys = (torch.arange(3)[:, None] * 10 + torch.arange(5)).float()[:, None, :, None]
    batch = KVBatch((7, 8, 9), (keys,), (-keys,), mask, packed=False)
    picked = select(batch, [9, 5, 7])  # reordered, 5 unknown, 8 dropped, 7's hole squeezed
    assert picked.rows == (9, 5, 7) and picked.packed
    assert picked.mask.tolist() == [[0, 1, 1], [0, 0, 0], [1, 1, 1]]
    assert picked.keys[0][:, 0, :, 0].tolist() == [[0, 23, 24], [0, 0, 0], [1, 2, 4]]
    assert picked.values[0][:, 0, :, 0].tolist() == [[0, -23, -24], [0, 0, 0], [-1, -2, -4]]
    assert select(picked, [9, 5, 7]) is picked  # unchanged rows: no copy
    both = concat([picked, select(batch, [8])])
    assert both.rows == (9, 5, 7, 8)
    assert both.mask.tolist() == [[0, 0, 0, 1, 1], [0] * 5, [0, 0, 1, 1, 1], [1] * 5]
    assert both.keys[0][0, 0, :, 0].tolist() == [0, 0, 0, 23, 24]
    assert both.keys[0][3, 0, :, 0].tolist() == [10, 11, 12, 13, 14]


# ---- decoder-only families ----------------------------------------------------------------


def test_causal_batch_matches_generate(causal: HfModel) -> None:
    runner = causal.runner()
    info = runner.info
    assert info.model_kind is ModelKind.CAUSAL_LM
    assert info.attention_backend == "hf_transformers"
    assert (info.eos_token_ids, info.vocab_size, info.block_size) == ((2,), VOCAB, 16)
    router = Router(runner)
    run_batch_with_late_joiner(router, PROMPTS)
    assert_matches_generate(router, causal, PROMPTS)
    assert all(o.forward_time_ns > 0 for o in router.outputs)


@pytest.mark.parametrize("ratio", [0, 1000], ids=["split-forwards", "one-padded-forward"])
def test_mixed_steps_in_one_or_two_forwards(
    gpt2: HfModel, ratio: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 0: decode rows and prompt chunks always run apart; 1000: always one padded forward
    # (decode rows then carry masked holes into the next step, which packs them).
    monkeypatch.setattr("tgis.shard.fallback.causal.MAX_PADDING_RATIO", ratio)
    router = Router(gpt2.runner())
    run_batch_with_late_joiner(router, PROMPTS)
    assert_matches_generate(router, gpt2, PROMPTS)


def test_unscheduled_finished_and_reused_ids(gpt2: HfModel) -> None:
    router = Router(gpt2.runner())
    router.add(1, PROMPTS[2])
    router.add(2, PROMPTS[3])
    router.step({1: len(PROMPTS[2]), 2: len(PROMPTS[3])})
    router.decode([1, 2])
    # Request 2 sits out two steps (its cache rows are carried), then resumes.
    router.decode([1])
    router.decode([1])
    router.finish(1)
    # Request id 1 comes back with another prompt while 2 resumes.
    router.add(1, PROMPTS[4])
    router.step({1: len(PROMPTS[4]), 2: 1})
    while any(len(router.generated[r]) < NEW_TOKENS for r in (1, 2)):
        router.decode([r for r in (1, 2) if len(router.generated[r]) < NEW_TOKENS])
    assert router.generated[2] == gpt2.generate(PROMPTS[3])[0]
    assert router.generated[1] == gpt2.generate(PROMPTS[4])[0]
    assert set(router.runner.sequences) == {1, 2}


def test_chunked_prompt_input_details_match_hf(gpt2: HfModel) -> None:
    prompt = PROMPTS[3]
    options = DetailOptions(logprobs=True, ranks=True, top_n=3, input_tokens=True)
    router = Router(gpt2.runner())
    router.add(5, prompt, details=options)
    for chunk in (7, 16):
        assert not router.step({5: chunk}).input_tokens
    (details,) = router.step({5: 6}).input_tokens
    tokens = details.tokens
    assert [d.token_id for d in tokens] == prompt
    assert math.isnan(tokens[0].logprob) and tokens[0].rank == 0 and not tokens[0].top_tokens
    with torch.no_grad():
        logits = gpt2.hf(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    for i in range(1, len(prompt)):
        assert abs(tokens[i].logprob - logprobs[i - 1, prompt[i]].item()) < 1e-4
        assert tokens[i].rank == 1 + int((logits[i - 1] > logits[i - 1, prompt[i]]).sum())
        top = [t.token_id for t in tokens[i].top_tokens]
        assert top == logprobs[i - 1].topk(3).indices.tolist()
    assert router.generated[5] == gpt2.generate(prompt)[0][:1]


def test_seeded_sampling_is_reproducible(gpt2: HfModel) -> None:
    def run(seed: int) -> list[int]:
        router = Router(gpt2.runner())
        router.add(1, PROMPTS[2], sampling=SamplingParams(temperature=1.0, top_k=50, seed=seed))
        router.add(2, PROMPTS[3])  # a greedy neighbour in the same batch
        router.step({1: len(PROMPTS[2]), 2: len(PROMPTS[3])})
        for _ in range(NEW_TOKENS - 1):
            router.decode([1, 2])
        assert router.generated[2] == gpt2.generate(PROMPTS[3])[0]
        return router.generated[1]

    first = run(1234)
    assert run(1234) == first
    assert run(4321) != first


def test_invalid_plan_changes_nothing(gpt2: HfModel) -> None:
    runner = gpt2.runner()
    router = Router(runner)
    router.add(1, PROMPTS[1])
    router.step({1: len(PROMPTS[1])})
    with pytest.raises(InvalidStepError, match="unknown request id 9"):
        runner.step(StepPlan(step_id=99, scheduled=(ScheduledSequence(9, 1),)))
    with pytest.raises(InvalidStepError, match="cannot hold"):
        runner.step(
            StepPlan(
                step_id=99,
                new_sequences=(NewSequence(7, tuple(PROMPTS[3])),),
                scheduled=(ScheduledSequence(7, len(PROMPTS[3])),),  # no blocks
            )
        )
    out = runner.step(
        StepPlan(step_id=100, new_sequences=(NewSequence(8, (VOCAB + 5,)),), scheduled=())
    )
    assert out.errors[0].request_id == 8 and "out of range" in out.errors[0].message
    for _ in range(NEW_TOKENS - 1):
        router.decode([1])
    assert router.generated[1] == gpt2.generate(PROMPTS[1])[0]
    assert set(runner.sequences) == {1}
    runner.reset()
    assert not runner.sequences


# ---- encoder-decoder ----------------------------------------------------------------------


def seq2seq_prompts(eos: int) -> dict[int, list[int]]:
    """Prompts ending with EOS, as a T5 tokenizer makes them."""
    return {rid: [*prompt, eos] for rid, prompt in PROMPTS.items()}


def test_seq2seq_batch_matches_generate(seq2seq: HfModel) -> None:
    runner = seq2seq.runner()
    assert runner.info.model_kind is ModelKind.SEQ2SEQ_LM
    (eos,) = runner.info.eos_token_ids
    assert eos == seq2seq.hf.config.eos_token_id
    prompts = seq2seq_prompts(eos)
    router = Router(runner)
    run_batch_with_late_joiner(router, prompts)
    assert_matches_generate(router, seq2seq, prompts)


def test_t5_input_details_are_text_only(t5: HfModel) -> None:
    prompt = seq2seq_prompts(1)[2]
    router = Router(t5.runner())
    asked = DetailOptions(logprobs=True, ranks=True, top_n=2, input_tokens=True)
    router.add(1, prompt, details=asked)
    router.add(2, prompt, details=DetailOptions(input_tokens=True))
    (plain,) = router.step({1: 4, 2: len(prompt)}).input_tokens  # 1 is mid-prompt
    assert plain.request_id == 2 and [d.token_id for d in plain.tokens] == prompt
    assert all(d.logprob == 0.0 and d.rank == 0 for d in plain.tokens)
    (details,) = router.step({1: len(prompt) - 4, 2: 1}).input_tokens
    assert details.request_id == 1 and [d.token_id for d in details.tokens] == prompt
    assert all(math.isnan(d.logprob) and d.rank == 0 and not d.top_tokens for d in details.tokens)
    assert router.generated[1] == router.generated[2][:1]


def test_t5_repetition_penalty_sees_decoder_ids_only(t5: HfModel) -> None:
    prompt = seq2seq_prompts(1)[3]
    router = Router(t5.runner())
    router.add(1, prompt, sampling=SamplingParams(repetition_penalty=3.0))
    router.step({1: len(prompt)})
    for _ in range(NEW_TOKENS - 1):
        router.decode([1])
    expected = t5.generate(prompt, repetition_penalty=3.0)[0]
    assert router.generated[1] == expected
    assert expected != t5.generate(prompt)[0]  # the penalty changes the output


# ---- both engines, engine selection ---------------------------------------------------------


def test_hf_engine_on_llama_equals_native(tiny_model: TinyModel) -> None:
    def run(engine: str) -> dict[int, list[int]]:
        config = ShardConfig(
            model_name=str(tiny_model.path), kv_cache_blocks=64, engine=EngineSettings(engine)
        )
        runner = load_runner(config)
        assert isinstance(runner, HfRunner if engine == "hf" else ModelRunner)
        router = Router(runner)
        run_batch_with_late_joiner(router, PROMPTS)
        return router.generated

    native = run("native")
    assert run("hf") == native
    assert native[3] == tiny_model.greedy(PROMPTS[3], NEW_TOKENS)[0]


def _model_config(path: Path, config: dict[str, Any]) -> ModelConfig:
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"vocab_size": 50, **config}))
    return ModelConfig.from_dir(path)


@pytest.mark.parametrize(
    ("env", "framework", "arch", "expected"),
    [
        ("", "hf_transformers", "LlamaForCausalLM", "native"),
        ("", "hf_transformers", "GPT2LMHeadModel", "hf"),
        ("auto", "ibm_fms", "T5ForConditionalGeneration", "hf"),
        ("", "hf_optimum_ort", "OPTForCausalLM", "hf"),
        ("", "tgis_native", "LlamaForCausalLM", "native"),
        ("hf", "tgis_native", "LlamaForCausalLM", "hf"),
        ("HF", None, "LlamaForCausalLM", "hf"),
        ("native", "hf_transformers", "LlamaForCausalLM", "native"),
    ],
)
def test_engine_selection(
    tmp_path: Path, env: str, framework: str | None, arch: str, expected: str
) -> None:
    config = _model_config(
        tmp_path / "m", {"architectures": [arch], "model_type": "x", **LLAMA_SHAPE}
    )
    assert select_engine(framework, config, requested=env) == expected


LLAMA_SHAPE = {
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


FALCON = {
    "architectures": ["FalconForCausalLM"],
    "model_type": "falcon",
    "hidden_size": 16,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "multi_query": True,
    "parallel_attn": True,
}


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({**FALCON, "alibi": False}, "native"),
        ({**FALCON, "alibi": True}, "hf"),  # a variant the native Falcon refuses
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", **LLAMA_SHAPE}, "native"),
        ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "hf"),  # incomplete
    ],
)
def test_auto_falls_back_for_variants_the_native_engine_cannot_run(
    tmp_path: Path, config: dict[str, Any], expected: str
) -> None:
    model_config = _model_config(tmp_path / "m", config)
    assert select_engine("hf_transformers", model_config) == expected


def test_engine_selection_errors(tmp_path: Path) -> None:
    gpt2 = _model_config(tmp_path / "g", {"architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(StartupError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        select_engine("hf_transformers", gpt2, requested="native")
    with pytest.raises(StartupError, match="TGIS_ENGINE=hf for the transformers fallback"):
        select_engine("tgis_native", gpt2)  # native asked for by the deployment framework
    with pytest.raises(StartupError, match="TGIS_ENGINE=fast is not one of auto, native, hf"):
        select_engine(None, gpt2, requested="fast")


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "no_such_model"}, "transformers cannot read"),
        ({"model_type": "vit"}, "unsupported model type 'vit'"),
        ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "cannot load model"),
    ],
    ids=["unknown-type", "not-a-language-model", "no-weights"],
)
def test_unloadable_models_fail_in_one_line(
    tmp_path: Path, config: dict[str, Any], message: str
) -> None:
    _model_config(tmp_path / "m", config)
    with pytest.raises(StartupError, match=message) as info:
        load_runner(ShardConfig(model_name=str(tmp_path / "m")))
    assert "\n" not in str(info.value).strip()


def test_recurrent_cache_is_refused(tmp_path: Path) -> None:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    model = MambaForCausalLM(
        MambaConfig(vocab_size=VOCAB, hidden_size=16, state_size=4, num_hidden_layers=1)
    )
    model.save_pretrained(tmp_path / "mamba")
    with pytest.raises(StartupError, match="cache the transformers fallback cannot batch"):
        load_runner(ShardConfig(model_name=str(tmp_path / "mamba")))
