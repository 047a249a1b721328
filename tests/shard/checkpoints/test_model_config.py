"""Models with several EOS ids (Llama 3 style): all are reported and all are masked."""

from __future__ import annotations

import json
from pathlib import Path

from tests.shard.driving import Router
from tests.shard.models import TinyModel, build_tiny_llama
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard_api.messages import SamplingParams

PROMPT = [9, 30, 31, 200, 17, 4]


def first_token(model_dir: Path, min_new_tokens: int) -> int:
    router = Router(load_runner(ShardConfig(model_name=str(model_dir), kv_cache_blocks=8)))
    router.add(1, PROMPT, SamplingParams(min_new_tokens=min_new_tokens))
    router.step({1: len(PROMPT)})
    return router.generated[1][0]


def test_config_and_generation_config_eos_ids_are_merged(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "vocab_size": 10, "eos_token_id": [2, 7]})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (2, 7, 9)


def test_every_eos_id_is_masked_during_min_new_tokens(tmp_path: Path) -> None:
    reference = TinyModel(tmp_path / "ref", build_tiny_llama(tmp_path / "ref"))
    greedy_first = reference.greedy(PROMPT, 1)[0][0]
    # The greedy first token becomes the *second* of two EOS ids.
    multi = tmp_path / "multi"
    build_tiny_llama(multi, eos_token_id=[3, greedy_first])
    runner = load_runner(ShardConfig(model_name=str(multi), kv_cache_blocks=8))
    assert set(runner.info.eos_token_ids) == {3, greedy_first}
    assert first_token(multi, min_new_tokens=0) == greedy_first
    masked = first_token(multi, min_new_tokens=1)
    assert masked not in (3, greedy_first)
