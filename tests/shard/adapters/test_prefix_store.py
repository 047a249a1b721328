"""Prompt-tuning prefixes: file formats, TGIS's tensor checks and messages, the LRU cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
import pytest
import torch
from safetensors.torch import save_file

from tgis.shard.adapters import prefix_store
from tgis.shard.adapters.prefix_store import (
    PrefixEmbeddings,
    PrefixLoad,
    PrefixStore,
)
from tgis.shard.adapters.prefixes import Prefixes, PrefixUnavailable
from tgis.shard.adapters.store_paths import StoreError, StoreErrorKind
from tgis.shard.cli import serve, shard_config
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard_api.messages import NewSequence

DIM = 8
CPU = torch.device("cpu")


def _store(root: Path, **overrides: Any) -> PrefixStore:
    args: dict[str, Any] = dict(
        store_path=root,
        embedding_dim=DIM,
        dtype=torch.float32,
        device=CPU,
        max_length=16,
        cache_bytes=1 << 20,
    )
    args.update(overrides)
    return PrefixStore(**args)


def _save(root: Path, prefix_id: str, name: str, value: Any) -> None:
    directory = root / prefix_id
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(value, directory / name)


def _error(store: PrefixStore, prefix_id: str) -> StoreError:
    with pytest.raises(StoreError) as info:
        store.get(prefix_id)
    return info.value


# --- file formats -------------------------------------------------------------------------


def test_decoder_pt_is_loaded_converted_and_counted(tmp_path: Path) -> None:
    tensor = torch.randn(4, DIM)
    _save(tmp_path, "nested/sentiment", "decoder.pt", tensor)
    prefix = _store(tmp_path, dtype=torch.float16).get("nested/sentiment")
    assert prefix.encoder is None
    assert prefix.decoder is not None and prefix.decoder.dtype == torch.float16
    assert torch.equal(prefix.decoder, tensor.to(torch.float16))
    assert prefix.length == 4
    assert prefix.nbytes == 512  # 64 bytes rounded up


def test_decoder_only_ignores_encoder_pt_and_needs_decoder(tmp_path: Path) -> None:
    _save(tmp_path, "enc_only", "encoder.pt", torch.randn(2, DIM))
    error = _error(_store(tmp_path), "enc_only")
    assert error.kind is StoreErrorKind.NOT_FOUND
    assert str(error) == 'prefix id "enc_only" not found'


def test_missing_prefix_is_not_found(tmp_path: Path) -> None:
    error = _error(_store(tmp_path), "nope")
    assert error.kind is StoreErrorKind.NOT_FOUND
    assert error.tgis_message == 'prefix id "nope" not found'


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_peft_prompt_tuning_adapter(tmp_path: Path, fmt: str) -> None:
    embeddings = torch.randn(3, DIM)
    directory = tmp_path / "peft"
    directory.mkdir()
    (directory / "adapter_config.json").write_text('{"peft_type": "PROMPT_TUNING"}')
    if fmt == "safetensors":
        save_file({"prompt_embeddings": embeddings}, directory / "adapter_model.safetensors")
    else:
        torch.save({"prompt_embeddings": embeddings}, directory / "adapter_model.bin")
    prefix = _store(tmp_path).get("peft")
    assert prefix.decoder is not None and torch.equal(prefix.decoder, embeddings)
    assert prefix.length == 3


def test_peft_prefers_safetensors(tmp_path: Path) -> None:
    directory = tmp_path / "both"
    directory.mkdir()
    save_file({"prompt_embeddings": torch.ones(2, DIM)}, directory / "adapter_model.safetensors")
    torch.save({"prompt_embeddings": torch.zeros(5, DIM)}, directory / "adapter_model.bin")
    assert _store(tmp_path).get("both").length == 2


def test_peft_without_prompt_embeddings_or_readable_file(tmp_path: Path) -> None:
    directory = tmp_path / "lora"
    directory.mkdir()
    save_file(
        {"base_model.lora_A.weight": torch.ones(2, DIM)}, directory / "adapter_model.safetensors"
    )
    error = _error(_store(tmp_path), "lora")
    assert error.kind is StoreErrorKind.INVALID
    assert "has no prompt_embeddings tensor" in str(error)
    other = tmp_path / "other"
    other.mkdir()
    (other / "adapter_model.pt").write_bytes(b"")  # PEFT-looking, but no file TGIS reads
    assert _error(_store(tmp_path), "other").kind is StoreErrorKind.NOT_FOUND


def test_peft_is_refused_for_encoder_decoder(tmp_path: Path) -> None:
    directory = tmp_path / "peft"
    directory.mkdir()
    save_file({"prompt_embeddings": torch.ones(2, DIM)}, directory / "adapter_model.safetensors")
    error = _error(_store(tmp_path, is_encoder_decoder=True), "peft")
    assert str(error) == "encoder-decoder architectures not supported for peft models"


def test_unreadable_file_fails_cleanly(tmp_path: Path) -> None:
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "decoder.pt").write_bytes(b"not a torch file")
    error = _error(_store(tmp_path), "junk")
    assert error.kind is StoreErrorKind.INVALID
    assert str(error).startswith("cannot read decoder.pt of prefix junk (")
    assert str(tmp_path) not in str(error)


def test_weights_only_refuses_pickled_objects(tmp_path: Path) -> None:
    _save(tmp_path, "pickled", "decoder.pt", PrefixLoad("x", 1.0))  # an arbitrary class
    assert str(_error(_store(tmp_path), "pickled")).startswith("cannot read decoder.pt")


def test_invalid_ids_and_symlinks_out(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir()
    _save(tmp_path, "outside", "decoder.pt", torch.randn(2, DIM))
    (root / "escape").symlink_to(tmp_path / "outside")
    store = _store(root)
    assert str(_error(store, "escape")) == "Invalid prefix id escape"
    assert str(_error(store, "../outside")).startswith("Invalid prefix id ../outside, must")
    assert str(_error(store, "/etc")) == "Invalid prefix id /etc"
    (root / "file_link").mkdir()
    (root / "file_link" / "decoder.pt").symlink_to(tmp_path / "outside" / "decoder.pt")
    assert str(_error(store, "file_link")) == "Invalid prefix id file_link"


# --- tensor checks --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"a": torch.ones(2, DIM)}, "Invalid prefix embedding tensor"),
        (torch.ones(DIM), "Invalid prefix embedding tensor"),
        (torch.ones(1, 2, DIM), "Invalid prefix embedding tensor"),
        (torch.ones(0, DIM), "Invalid prefix embedding length of 0"),
        (torch.ones(17, DIM), "Invalid prefix embedding length of 17"),
        (torch.ones(2, DIM + 1), f"Prefix embedding tensor dim {DIM + 1} does not match model (8)"),
        (torch.tensor([[float("nan")] * DIM]), "Prefix contains non-finite elements"),
        (torch.tensor([[float("inf")] * DIM]), "Prefix contains non-finite elements"),
    ],
)
def test_tensor_checks(tmp_path: Path, value: Any, message: str) -> None:
    _save(tmp_path, "p", "decoder.pt", value)
    error = _error(_store(tmp_path), "p")
    assert error.kind is StoreErrorKind.INVALID
    assert str(error) == message
    assert error.tgis_message == f"Unexpected <class 'Exception'>: {message}"


def test_max_length_is_inclusive(tmp_path: Path) -> None:
    _save(tmp_path, "p", "decoder.pt", torch.ones(16, DIM))
    assert _store(tmp_path).get("p").length == 16


@pytest.mark.parametrize(
    ("dtype", "name"), [(torch.float16, "torch.float16"), (torch.bfloat16, "torch.bfloat16")]
)
def test_non_finite_after_conversion(tmp_path: Path, dtype: torch.dtype, name: str) -> None:
    big = 1e39 if dtype == torch.bfloat16 else 1e5  # finite in float64/float32, inf after
    source = torch.float64 if dtype == torch.bfloat16 else torch.float32
    value = torch.full((2, DIM), big, dtype=source)
    _save(tmp_path, "p", "decoder.pt", value)
    error = _error(_store(tmp_path, dtype=dtype), "p")
    assert str(error) == (
        f"Prefix contains non-finite elements after conversion from {source} to {name}"
    )


def test_encoder_decoder_rules(tmp_path: Path) -> None:
    store = _store(tmp_path, is_encoder_decoder=True)
    _save(tmp_path, "odd", "encoder.pt", torch.ones(3, DIM))
    assert str(_error(store, "odd")) == "Encoder/decoder prefix tensor must be of even length"
    _save(tmp_path, "odd_dec", "decoder.pt", torch.ones(1, DIM))
    assert str(_error(store, "odd_dec")) == "Encoder/decoder prefix tensor must be of even length"
    _save(tmp_path, "enc", "encoder.pt", torch.ones(2, DIM))
    only_encoder = store.get("enc")
    assert only_encoder.decoder is None and only_encoder.length == 2
    _save(tmp_path, "dec", "decoder.pt", torch.ones(4, DIM))
    assert store.get("dec").encoder is None
    _save(tmp_path, "both", "decoder.pt", torch.ones(2, DIM))
    _save(tmp_path, "both", "encoder.pt", torch.ones(4, DIM))
    both = store.get("both")
    assert both.length == 6 and both.nbytes == 2 * 512
    (tmp_path / "empty").mkdir()
    assert _error(store, "empty").kind is StoreErrorKind.NOT_FOUND


# --- limits from the environment ------------------------------------------------------------


def parsed_config(monkeypatch: pytest.MonkeyPatch, env: dict[str, str], *args: str) -> ShardConfig:
    """The ShardConfig ``text-generation-server serve`` builds with ``env`` and ``args``."""
    for name in ("MAX_PROMPT_PREFIX_LENGTH", "PROMPT_CACHE_SIZE_MB"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    context = serve.make_context("serve", list(args))
    return shard_config(context.params)


def test_max_prefix_length(monkeypatch: pytest.MonkeyPatch) -> None:
    def limit(env: dict[str, str], length: int) -> int:
        config = parsed_config(monkeypatch, env, "--max-sequence-length", str(length))
        return config.prefix_length_limit

    assert limit({}, 2048) == 1024
    assert limit({}, 201) == 101
    assert limit({"MAX_PROMPT_PREFIX_LENGTH": "99"}, 100) == 99
    with pytest.raises(StartupError, match="MAX_PROMPT_PREFIX_LENGTH"):
        limit({"MAX_PROMPT_PREFIX_LENGTH": "100"}, 100)
    for bad in ("0", "x"):
        with pytest.raises(click.BadParameter) as refused:
            limit({"MAX_PROMPT_PREFIX_LENGTH": bad}, 100)
        assert "(env var: 'MAX_PROMPT_PREFIX_LENGTH')" in refused.value.format_message()


def test_prompt_cache_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parsed_config(monkeypatch, {}).prompt_cache_bytes == 512 * 1024 * 1024
    three = parsed_config(monkeypatch, {"PROMPT_CACHE_SIZE_MB": "3"})
    assert three.prompt_cache_bytes == 3 * 1024 * 1024
    with pytest.raises(click.BadParameter) as refused:
        parsed_config(monkeypatch, {"PROMPT_CACHE_SIZE_MB": "-1"})
    assert "(env var: 'PROMPT_CACHE_SIZE_MB')" in refused.value.format_message()


# --- the cache ------------------------------------------------------------------------------


def _rows_for_bytes(unit_count: int) -> torch.Tensor:
    """A float32 prefix of exactly ``unit_count`` × 512 bytes (16 rows of 8 floats = 512)."""
    return torch.ones(16 * unit_count, DIM)


def test_size_rounding() -> None:
    assert PrefixEmbeddings(torch.ones(1, 1)).nbytes == 512
    assert PrefixEmbeddings(torch.ones(16, DIM)).nbytes == 512
    assert PrefixEmbeddings(torch.ones(17, DIM)).nbytes == 1024
    assert PrefixEmbeddings(torch.ones(1, 1), torch.ones(1, 1)).nbytes == 1024


def test_lru_eviction_order_and_byte_accounting(tmp_path: Path) -> None:
    for name, units in (("a", 1), ("b", 1), ("c", 2), ("d", 1)):
        _save(tmp_path, name, "decoder.pt", _rows_for_bytes(units))
    store = _store(tmp_path, max_length=64, cache_bytes=3 * 512)
    store.get("a")
    store.get("b")
    assert store.cached_ids() == ["a", "b"] and store.used_bytes == 1024
    store.get("a")  # a is now the most recent
    assert store.cached_ids() == ["b", "a"]
    store.get("c")  # needs 2 units: evicts b only
    assert store.cached_ids() == ["a", "c"] and store.used_bytes == 1536
    store.get("d")  # evicts a
    assert store.cached_ids() == ["c", "d"] and store.used_bytes == 1536
    first = store.get("c")
    assert store.get("c") is first  # a hit returns the cached object


def test_prefix_larger_than_cache(tmp_path: Path) -> None:
    _save(tmp_path, "small", "decoder.pt", _rows_for_bytes(1))
    _save(tmp_path, "huge", "decoder.pt", _rows_for_bytes(3))
    store = _store(tmp_path, max_length=64, cache_bytes=2 * 512)
    store.get("small")
    error = _error(store, "huge")
    assert str(error) == "Prefix ID object huge exceeds the allowed cache size"
    assert error.tgis_message.startswith("Unexpected <class 'ValueError'>: Prefix ID object")
    assert store.cached_ids() == ["small"] and store.used_bytes == 512


def test_failures_are_not_cached(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert _error(store, "later").kind is StoreErrorKind.NOT_FOUND
    _save(tmp_path, "later", "decoder.pt", torch.ones(2, DIM))
    assert store.get("later").length == 2


def test_load_hook_records_successes_failures_and_not_hits(tmp_path: Path) -> None:
    loads: list[PrefixLoad] = []
    _save(tmp_path, "ok", "decoder.pt", torch.ones(2, DIM))
    store = _store(tmp_path, on_load=loads.append)
    store.get("ok")
    store.get("ok")
    _error(store, "missing")
    assert [(load.prefix_id, load.ok) for load in loads] == [("ok", True), ("missing", False)]
    assert all(load.seconds >= 0 for load in loads)
    assert isinstance(loads[1].error, StoreError)


def slow_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Make every file read take 50 ms; the paths read, in order."""
    calls: list[Path] = []
    real_read = prefix_store._read_file

    def slow_read(prefix_id: str, path: Path) -> Any:
        calls.append(path)
        time.sleep(0.05)
        return real_read(prefix_id, path)

    monkeypatch.setattr(prefix_store, "_read_file", slow_read)
    return calls


def run_together(worker: Callable[[], None], count: int) -> None:
    """``worker`` on ``count`` threads at once; returns when all are done."""
    threads = [threading.Thread(target=worker) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_concurrent_requests_load_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, "shared", "decoder.pt", torch.ones(4, DIM))
    calls = slow_reads(monkeypatch)
    loads: list[PrefixLoad] = []
    store = _store(tmp_path, on_load=loads.append)
    barrier = threading.Barrier(16)
    results: list[PrefixEmbeddings] = []

    def worker() -> None:
        barrier.wait()
        results.append(store.get("shared"))

    run_together(worker, 16)
    assert len(calls) == 1 and len(loads) == 1
    assert len(results) == 16 and all(r is results[0] for r in results)


def test_concurrent_failure_reaches_every_waiter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(tmp_path, "bad", "decoder.pt", torch.ones(3, DIM + 1))
    calls = slow_reads(monkeypatch)
    store = _store(tmp_path)
    barrier = threading.Barrier(16)
    errors: list[str] = []

    def worker() -> None:
        barrier.wait()
        try:
            store.get("bad")
        except StoreError as e:
            errors.append(str(e))

    run_together(worker, 16)
    assert len(calls) == 1
    assert errors == ["Prefix embedding tensor dim 9 does not match model (8)"] * 16


# --- content versions ----------------------------------------------------------------------


def test_the_version_is_a_digest_of_the_files_read(tmp_path: Path) -> None:
    """Equal files, equal versions (whatever the id, however often read); a rewritten file,
    another version; for encoder-decoder models both files count."""
    tensor = torch.randn(4, DIM)
    _save(tmp_path, "a", "decoder.pt", tensor)
    _save(tmp_path, "b", "decoder.pt", tensor)
    first = _store(tmp_path).get("a").version
    assert len(first) == 16
    assert _store(tmp_path).get("b").version == first
    _save(tmp_path, "a", "decoder.pt", tensor + 1)
    assert _store(tmp_path).get("a").version != first
    store = _store(tmp_path)
    assert store.get("b").version == first  # cached: what is in memory
    _save(tmp_path, "b", "decoder.pt", tensor + 1)
    assert store.get("b").version == first
    seq2seq = _store(tmp_path, is_encoder_decoder=True)
    _save(tmp_path, "e", "decoder.pt", torch.randn(4, DIM))
    without_encoder = seq2seq.get("e").version
    _save(tmp_path, "e", "encoder.pt", torch.randn(4, DIM))
    assert _store(tmp_path, is_encoder_decoder=True).get("e").version != without_encoder


def test_a_sequence_is_refused_a_prefix_of_other_contents(tmp_path: Path) -> None:
    _save(tmp_path, "p", "decoder.pt", torch.randn(3, DIM))
    looked_up = Prefixes(_store(tmp_path)).lookup("p")
    assert looked_up.length == 3
    ns = NewSequence(
        request_id=1,
        prompt_token_ids=(5,),
        prefix_id="p",
        prefix_length=3,
        prefix_version=looked_up.version,
    )
    _save(tmp_path, "p", "decoder.pt", torch.randn(3, DIM))
    reread = Prefixes(_store(tmp_path))
    with pytest.raises(PrefixUnavailable, match="prompt prefix 'p' changed in its store"):
        reread.embeddings(ns)
    assert reread.embeddings(replace(ns, prefix_version="")).length == 3  # not checked
    assert reread.embeddings(replace(ns, prefix_version=reread.lookup("p").version)).length == 3
