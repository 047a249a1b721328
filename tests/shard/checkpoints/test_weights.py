"""One checkpoint, two layouts: a single model.safetensors and 3 files with an index."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from tests.shard.driving import Router
from tests.shard.models import TinyModel
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard_api.messages import DetailOptions

PROMPTS = {1: [5, 6, 7, 8], 2: list(range(20, 45))}


def split_into_three(single: Path, out: Path) -> list[str]:
    """Rewrite `single`'s model.safetensors as 3 files plus model.safetensors.index.json."""
    out.mkdir()
    for f in single.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, out / f.name)
    with safe_open(str(single / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    names = sorted(tensors)
    files = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    weight_map = {}
    for i, file in enumerate(files):
        part = names[i::3]
        save_file({n: tensors[n].contiguous() for n in part}, str(out / file))
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return files


def generate(model_dir: Path) -> dict[int, list[tuple[int, float]]]:
    runner = load_runner(ShardConfig(model_name=str(model_dir), kv_cache_blocks=16))
    router = Router(runner)
    details = DetailOptions(logprobs=True, generated_tokens=True)
    out: dict[int, list[tuple[int, float]]] = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt, details=details)
    results = [router.step({rid: len(p) for rid, p in PROMPTS.items()})]
    results += [router.decode(list(PROMPTS)) for _ in range(5)]
    for result in results:
        for sampled in result.tokens:
            out[sampled.request_id].append((sampled.token.token_id, sampled.token.logprob))
    return out


def test_three_files_with_index_load_identically(tiny_model: TinyModel, tmp_path: Path) -> None:
    files = split_into_three(tiny_model.path, tmp_path / "three")
    assert sorted(p.name for p in (tmp_path / "three").glob("*.safetensors")) == files
    single = generate(tiny_model.path)
    three = generate(tmp_path / "three")
    assert three == single  # bit-identical tokens and logprobs
    assert [t for t, _ in single[1]] == tiny_model.greedy(PROMPTS[1], 6)[0]
