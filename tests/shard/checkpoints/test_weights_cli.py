"""`text-generation-server download-weights` / `convert-to-safetensors` against a local HF cache.

No hub is reachable here, so every test builds its own cache directory
(``models--org--name/{blobs,snapshots/<commit>,refs/main}``, files symlinked to blobs as
huggingface_hub lays them out) and points ``HF_HUB_CACHE`` at it. transformers 5 can no
longer save PyTorch ``.bin`` checkpoints (``safe_serialization=False`` is ignored), so the
``.bin`` files are written with ``torch.save`` in transformers 4's layout: one
``pytorch_model.bin``, or ``pytorch_model-0000i-of-0000n.bin`` shards plus
``pytorch_model.bin.index.json``. The commands run as the real console script.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from tests.shard.checkpoints.fake_hub import FakeHub
from tgis.shard.checkpoints.convert import convert_directory
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.config import ShardConfig, canonical_dtype
from tgis.shard.errors import StartupError

SERVER = Path(sys.executable).parent / "text-generation-server"
REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PROMPT = torch.tensor([[1, 7, 42, 99, 3, 120, 5, 64]])


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaForCausalLM:
    params: dict[str, Any] = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    params.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**params)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)  # far from the init, so a wrong tensor changes the logits
    return model


def save_bin(model: LlamaForCausalLM, directory: Path, shards: int = 1) -> dict[str, torch.Tensor]:
    """transformers 4's ``save_pretrained(safe_serialization=False)`` layout; the state dict."""
    directory.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    state = model.state_dict()
    if shards == 1:
        torch.save(state, directory / "pytorch_model.bin")
        return state
    names = list(state)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        chunk = names[i * per_shard : (i + 1) * per_shard]
        torch.save({n: state[n] for n in chunk}, directory / file)
        weight_map.update(dict.fromkeys(chunk, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return state


def put_in_cache(source: Path, cache: Path, repo: str = REPO, commit: str = COMMIT) -> Path:
    """Lay ``source``'s files out as huggingface_hub does; return the snapshot directory."""
    repo_dir = cache / ("models--" + repo.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / commit
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(commit)  # huggingface_hub writes no newline
    return snapshot


def run_server(
    *args: str, cache: Path, offline: bool = True, **env: str
) -> subprocess.CompletedProcess[str]:
    full_env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1" if offline else "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TGIS_TERMINATION_LOG": str(cache.parent / "termination-log"),
        **env,
    }
    full_env.pop("HF_TOKEN", None)
    return subprocess.run(
        [str(SERVER), *args],
        env=full_env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def safetensors_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """Every tensor of every .safetensors file in ``directory``, and each file's metadata."""
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, dict[str, str]] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            metadata[path.name] = f.metadata() or {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                assert name not in tensors, f"{name} stored twice"
                tensors[name] = f.get_tensor(name)
    return tensors, metadata


def logits(model: LlamaForCausalLM) -> torch.Tensor:
    with torch.no_grad():
        out: Any = model(PROMPT)
    return out.logits


def assert_hf_loads_same(directory: Path, reference: LlamaForCausalLM) -> None:
    loaded = LlamaForCausalLM.from_pretrained(directory, use_safetensors=True).eval()
    torch.testing.assert_close(logits(loaded), logits(reference), rtol=0, atol=0)


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    path = tmp_path / "hub"
    path.mkdir()
    return path


def test_convert_single_file_in_cache(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama()
    state = save_bin(model, tmp_path / "src")
    snapshot = put_in_cache(tmp_path / "src", cache)

    result = run_server("convert-to-safetensors", REPO, cache=cache)

    assert result.returncode == 0, result.stderr
    assert (snapshot / "model.safetensors").is_file()
    assert not (snapshot / "model.safetensors.index.json").exists()
    assert not list(snapshot.glob(".*partial"))
    tensors, metadata = safetensors_state(snapshot)
    assert metadata["model.safetensors"] == {"format": "pt"}
    assert tensors.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name
    assert_hf_loads_same(snapshot, model)
    assert "pytorch_model.bin → model.safetensors" in result.stderr + result.stdout


def test_convert_sharded_checkpoint_writes_index(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=1)
    state = save_bin(model, tmp_path / "src", shards=3)
    snapshot = put_in_cache(tmp_path / "src", cache)

    result = run_server("convert-to-safetensors", REPO, "--revision", "main", cache=cache)

    assert result.returncode == 0, result.stderr
    new_files = sorted(p.name for p in snapshot.glob("*.safetensors"))
    assert new_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    bin_index = json.loads((snapshot / "pytorch_model.bin.index.json").read_text())
    expected_map = {
        name: file.replace("pytorch_", "").replace(".bin", ".safetensors")
        for name, file in bin_index["weight_map"].items()
    }
    assert index["weight_map"] == expected_map
    tensors, _ = safetensors_state(snapshot)
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in tensors.values()
    )
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name
        with safe_open(str(snapshot / index["weight_map"][name]), framework="pt") as f:
            assert name in f.keys()  # noqa: SIM118
    assert_hf_loads_same(snapshot, model)


def test_tied_lm_head_is_dropped_and_reloads(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=2, tie_word_embeddings=True)
    directory = tmp_path / "tied"
    save_bin(model, directory)
    on_disk = torch.load(directory / "pytorch_model.bin", weights_only=True)
    assert (  # the .bin really shares the storage, which safetensors refuses
        on_disk["lm_head.weight"].data_ptr() == on_disk["model.embed_tokens.weight"].data_ptr()
    )

    result = run_server("convert-to-safetensors", str(directory), cache=cache)

    assert result.returncode == 0, result.stderr
    tensors, metadata = safetensors_state(directory)
    assert "lm_head.weight" not in tensors
    assert metadata["model.safetensors"] == {
        "format": "pt",
        "lm_head.weight": "model.embed_tokens.weight",
    }
    assert torch.equal(tensors["model.embed_tokens.weight"], on_disk["lm_head.weight"])
    assert_hf_loads_same(directory, model)
    weights = Weights(directory, torch.device("cpu"), torch.float32)  # the shard's reader
    assert "lm_head.weight" not in weights
    assert torch.equal(weights.get("model.embed_tokens.weight"), on_disk["lm_head.weight"])


def test_shared_storage_not_tied_by_config_is_copied(tmp_path: Path) -> None:
    model = tiny_llama(seed=3)  # tie_word_embeddings=False
    save_bin(model, tmp_path)
    state = model.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]  # shared, but not tied
    fused = torch.randn(6, 4)
    state["extra.fused"] = fused
    state["extra.view"] = fused[2:5, 1:]  # a partial, non-contiguous view of the same storage
    torch.save(state, tmp_path / "pytorch_model.bin")

    converted = convert_directory(tmp_path, progress=False)

    assert [f.target.name for f in converted] == ["model.safetensors"]
    assert converted[0].dropped == {}
    copied = set(converted[0].copied)  # one name of each sharing pair gets its own storage
    assert len(copied) == 2
    assert len(copied & {"lm_head.weight", "model.embed_tokens.weight"}) == 1
    assert len(copied & {"extra.fused", "extra.view"}) == 1
    tensors, metadata = safetensors_state(tmp_path)
    assert metadata["model.safetensors"] == {"format": "pt"}
    assert tensors.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(tensors[name], tensor), name


def test_convert_refuses_existing_safetensors_and_needs_bins(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=4)
    model.save_pretrained(tmp_path / "st")  # safetensors only
    before = (tmp_path / "st" / "model.safetensors").read_bytes()
    save_bin(model, tmp_path / "st")

    refused = run_server("convert-to-safetensors", str(tmp_path / "st"), cache=cache)
    assert refused.returncode == 0, refused.stderr
    assert "remove them first to re-convert" in refused.stdout
    assert (tmp_path / "st" / "model.safetensors").read_bytes() == before

    (tmp_path / "empty").mkdir()
    missing = run_server("convert-to-safetensors", str(tmp_path / "empty"), cache=cache)
    assert "no PyTorch .bin weight files" in one_error_line(missing)
    not_cached = run_server("convert-to-safetensors", "tiny-org/absent", cache=cache)
    assert "not in the local Hugging Face cache" in one_error_line(not_cached)


def test_download_weights_finds_cached_safetensors(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=5)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    assert (tmp_path / "src" / "model.safetensors.index.json").is_file()
    snapshot = put_in_cache(tmp_path / "src", cache)
    files = sorted(p.name for p in snapshot.iterdir())

    for extra in ([], ["--revision", COMMIT], ["--extension", "safetensors"]):
        result = run_server("download-weights", REPO, *extra, cache=cache)
        assert result.returncode == 0, result.stderr
        assert "already present in the local cache" in result.stdout
        assert str(snapshot) in result.stdout
    assert sorted(p.name for p in snapshot.iterdir()) == files  # nothing written


def test_download_weights_incomplete_sharded_cache_is_not_enough(
    tmp_path: Path, cache: Path
) -> None:
    tiny_llama(seed=5).save_pretrained(tmp_path / "src", max_shard_size="20KB")
    snapshot = put_in_cache(tmp_path / "src", cache)
    shards = sorted(snapshot.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()  # an interrupted download

    result = run_server("download-weights", REPO, cache=cache)
    line = one_error_line(result)
    assert f"model '{REPO}' in the local Hugging Face cache" in line
    assert f"the .safetensors weights in {snapshot} are incomplete, missing {shards[-1].name}" in (
        line
    )
    assert "HF_HUB_OFFLINE" in line


def test_download_weights_missing_model_offline(cache: Path) -> None:
    result = run_server("download-weights", "tiny-org/not-there", cache=cache)

    line = one_error_line(result)
    assert "'tiny-org/not-there'" in line
    assert "not in the local Hugging Face cache" in line
    assert "HF_HUB_OFFLINE" in line
    assert (cache.parent / "termination-log").read_text().strip() == line.removeprefix("error: ")


def test_download_weights_hub_unreachable_is_one_line(cache: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on: connection refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"

    result = run_server(
        "download-weights", "tiny-org/anything", cache=cache, offline=False, HF_ENDPOINT=endpoint
    )

    line = one_error_line(result)
    assert f"cannot download model 'tiny-org/anything' from the Hugging Face Hub ({endpoint})" in (
        line
    )


def test_download_weights_converts_local_bin_directory(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=6, tie_word_embeddings=True)
    directory = tmp_path / "local"
    state = save_bin(model, directory, shards=2)

    refused = run_server("download-weights", str(directory), "--no-auto-convert", cache=cache)
    assert "only PyTorch .bin weights" in one_error_line(refused)
    assert not list(directory.glob("*.safetensors"))

    result = run_server("download-weights", str(directory), cache=cache)
    assert result.returncode == 0, result.stderr
    assert (directory / "model.safetensors.index.json").is_file()
    tensors, _ = safetensors_state(directory)
    for name, tensor in state.items():
        if name in tensors:
            assert torch.equal(tensors[name], tensor), name
    assert_hf_loads_same(directory, model)

    again = run_server("download-weights", str(directory), cache=cache)
    assert again.returncode == 0, again.stderr
    assert "already present in the directory" in again.stdout

    bins_only = run_server("download-weights", str(directory), "--extension", ".pt", cache=cache)
    assert "no .pt weights found in" in one_error_line(bins_only)


def test_download_weights_converts_cached_bin_offline(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=7)
    save_bin(model, tmp_path / "src")
    snapshot = put_in_cache(tmp_path / "src", cache)

    result = run_server("download-weights", REPO, cache=cache)

    assert result.returncode == 0, result.stderr
    assert (snapshot / "model.safetensors").is_file()
    assert_hf_loads_same(snapshot, model)
    as_bin = run_server("download-weights", REPO, "--extension", ".bin", cache=cache)
    assert as_bin.returncode == 0, as_bin.stderr
    assert "1 .bin file" in as_bin.stdout


def test_serve_dtype_aliases() -> None:
    for alias, name in [
        ("fp32", "float32"),
        ("float", "float32"),
        ("float32", "float32"),
        ("FP16", "float16"),
        ("half", "float16"),
        ("float16", "float16"),
        ("bf16", "bfloat16"),
        ("bfloat16", "bfloat16"),
    ]:
        assert canonical_dtype(alias) == name
        ShardConfig(dtype=canonical_dtype(alias)).validate()
    assert canonical_dtype(None) is None
    with pytest.raises(StartupError, match="unsupported --dtype 'int8'"):
        ShardConfig(dtype=canonical_dtype("int8")).validate()


def test_commands_are_listed() -> None:
    result = subprocess.run(
        [str(SERVER), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0
    for command in ("serve", "download-weights", "convert-to-safetensors"):
        assert command in result.stdout


def test_tokenizer_and_config_files_untouched(tmp_path: Path, cache: Path) -> None:
    """Conversion only adds files: the .bin and everything else stay as they were."""
    model = tiny_llama(seed=8)
    save_bin(model, tmp_path / "src")
    (tmp_path / "src" / "tokenizer_config.json").write_text("{}")
    snapshot = put_in_cache(tmp_path / "src", cache)
    before = {p.name: p.read_bytes() for p in snapshot.iterdir()}

    result = run_server("convert-to-safetensors", REPO, cache=cache)

    assert result.returncode == 0, result.stderr
    after = {p.name: p.read_bytes() for p in snapshot.iterdir()}
    assert set(after) - set(before) == {"model.safetensors"}
    assert all(after[name] == data for name, data in before.items())


# The online path, against tests/shard/checkpoints/fake_hub.py (the real Hub is not reachable here).


def hub_env(hub: FakeHub) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1"}


def test_download_from_hub_fetches_only_weights_and_meta(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=9)
    model.save_pretrained(tmp_path / "src", max_shard_size="20KB")
    save_bin(model, tmp_path / "src")  # the Hub also has .bin: they must not be fetched
    extra = {
        "tokenizer.json": b"{}",
        "tokenizer.model": b"sp",
        "README.md": b"# tiny",
        "training_args.bin": b"x",
        "tf_model.h5": b"h5",
        "onnx/model.safetensors": b"nested",
    }
    with FakeHub() as hub:
        hub.add(REPO, COMMIT, tmp_path / "src", extra)
        result = run_server("download-weights", REPO, cache=cache, offline=False, **hub_env(hub))
        assert result.returncode == 0, result.stderr
        fetched = hub.downloaded()
        hub.requests.clear()
        again = run_server("download-weights", REPO, cache=cache, offline=False, **hub_env(hub))
        assert again.returncode == 0, again.stderr
        assert "already present in the local cache" in again.stdout
        assert hub.requests == []  # found in the cache: the Hub is not asked at all

    shards = sorted(p.name for p in (tmp_path / "src").glob("*.safetensors"))
    meta = ["README.md", "config.json", "generation_config.json", "tokenizer.json"]
    expected = [*meta, "model.safetensors.index.json", "tokenizer.model", *shards]
    assert fetched == sorted(expected)
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert (cache / "models--tiny-org--tiny-llama" / "refs" / "main").read_text() == COMMIT
    assert_hf_loads_same(snapshot, model)


def test_download_from_hub_converts_bin_only_model(tmp_path: Path, cache: Path) -> None:
    model = tiny_llama(seed=10, tie_word_embeddings=True)
    save_bin(model, tmp_path / "src", shards=2)
    with FakeHub() as hub:
        hub.add(REPO, COMMIT, tmp_path / "src", {"tokenizer_config.json": b"{}"})
        refused = run_server(
            "download-weights", REPO, "--no-auto-convert", cache=cache, offline=False,
            **hub_env(hub),
        )  # fmt: skip
        assert "no .safetensors weights on the Hugging Face Hub" in one_error_line(refused)
        assert hub.downloaded() == []
        result = run_server("download-weights", REPO, cache=cache, offline=False, **hub_env(hub))
        assert result.returncode == 0, result.stderr

    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.glob("*.safetensors")) == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert (snapshot / "model.safetensors.index.json").is_file()
    assert_hf_loads_same(snapshot, model)


def test_download_from_hub_errors_are_one_line(tmp_path: Path, cache: Path) -> None:
    tiny_llama(seed=11).config.save_pretrained(tmp_path / "src")
    with FakeHub() as hub:
        hub.add(REPO, COMMIT, tmp_path / "src", {"tf_model.h5": b"h5"})
        env = hub_env(hub)
        missing = run_server(
            "download-weights", "tiny-org/absent", cache=cache, offline=False, **env
        )
        no_weights = run_server("download-weights", REPO, cache=cache, offline=False, **env)
        bad_revision = run_server(
            "download-weights", REPO, "--revision", "v9", cache=cache, offline=False, **env
        )
    assert "model 'tiny-org/absent' not found on the Hugging Face Hub" in one_error_line(missing)
    assert (
        f"no .safetensors weights found for model '{REPO}' on the Hugging Face Hub"
        in one_error_line(no_weights)
    )
    assert f"revision 'v9' of model '{REPO}' not found" in one_error_line(bad_revision)


def test_conversion_that_does_not_read_back_equal_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tgis.shard.checkpoints.convert as convert

    save_bin(tiny_llama(seed=12), tmp_path, shards=2)
    real_save = convert.save_file

    def corrupting_save(tensors: dict[str, torch.Tensor], path: str, **kw: Any) -> None:
        if "00002" in path:
            name = sorted(tensors)[0]
            tensors = {**tensors, name: tensors[name] + 1}
        real_save(tensors, path, **kw)

    monkeypatch.setattr(convert, "save_file", corrupting_save)
    with pytest.raises(convert.ConversionError, match="does not read back equal"):
        convert_directory(tmp_path, progress=False)
    assert not list(tmp_path.glob("*.safetensors*"))
    assert not list(tmp_path.glob(".*partial"))
