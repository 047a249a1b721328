"""PEFT adapters from ADAPTER_CACHE: LoRA weights laid out per rank (checked against PEFT's
own layers), prompt-tuning adapters, every refusal's message, the LRU and shared loads."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, PromptTuningConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tgis.shard.adapters import adapter_cache
from tgis.shard.adapters.adapter_cache import AdapterCache
from tgis.shard.adapters.lora_layout import LoraPart, LoraSite, LoraWeights
from tgis.shard.adapters.prefix_store import PrefixStore
from tgis.shard.adapters.prefixes import PrefixUnavailable
from tgis.shard.adapters.request_adapters import Adapters
from tgis.shard.adapters.store_paths import StoreError, StoreErrorKind
from tgis.shard_api.messages import AdapterKind, NewSequence

H, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 4, 2, 16, 128, 2
KV = KV_HEADS * HEAD_DIM
CPU = torch.device("cpu")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BAD_ID = "must contain only alphanumeric, _ and - and /"


# --- the model, its sites, adapters -------------------------------------------------------


@pytest.fixture(scope="module")
def base() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=100,
        hidden_size=H,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def _even(size: int, rank: int, world: int) -> tuple[tuple[int, int], ...]:
    n = size // world
    return ((rank * n, (rank + 1) * n),)


def llama_sites(rank: int = 0, world: int = 1) -> list[LoraSite]:
    """A Llama layer's sites on ``rank`` of ``world``, as the native model describes them:
    q/k/v fused (heads split), o_proj by columns, gate/up fused, down_proj by columns."""
    sites: list[LoraSite] = []
    for layer in range(LAYERS):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        qkv = (
            LoraPart(f"{attn}.q_proj", H, H, _even(H, rank, world)),
            LoraPart(f"{attn}.k_proj", H, KV, _even(KV, rank, world)),
            LoraPart(f"{attn}.v_proj", H, KV, _even(KV, rank, world)),
        )
        gate_up = (
            LoraPart(f"{mlp}.gate_proj", H, INTER, _even(INTER, rank, world)),
            LoraPart(f"{mlp}.up_proj", H, INTER, _even(INTER, rank, world)),
        )
        sites += [
            LoraSite(qkv, row_parallel=False),
            LoraSite((LoraPart(f"{attn}.o_proj", H, H, _even(H, rank, world)),), True),
            LoraSite(gate_up, row_parallel=False),
            LoraSite((LoraPart(f"{mlp}.down_proj", INTER, H, _even(INTER, rank, world)),), True),
        ]
    return sites


def save_lora(
    base: LlamaForCausalLM,
    directory: Path,
    targets: Sequence[str] = tuple(ALL),
    seed: int = 0,
    safe: bool = True,
    **options: Any,
) -> Any:
    """A PEFT LoRA adapter of ``base`` with random A and B, saved to ``directory``."""
    torch.manual_seed(seed)
    options.setdefault("r", 4)
    options.setdefault("lora_alpha", 8)
    config = LoraConfig(target_modules=list(targets), **options)
    model: Any = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    model.save_pretrained(directory, safe_serialization=safe)
    return model.eval()


def peft_layer(model: PeftModel, module: str) -> Any:
    """PEFT's LoRA layer wrapping ``module``."""
    return model.get_submodule(f"base_model.model.{module}")


def peft_delta(model: PeftModel, module: str, x: torch.Tensor) -> torch.Tensor:
    """What PEFT's LoRA layer for ``module`` adds to the base layer's output."""
    layer = peft_layer(model, module)
    with torch.no_grad():
        return layer(x) - layer.base_layer(x)


def _inputs(seed: int = 1) -> dict[int, torch.Tensor]:
    """A random input batch per input width."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(3, n, generator=g) for n in (H, INTER)}


def site_output(site: LoraSite, pair: Any, xs: dict[int, torch.Tensor]) -> torch.Tensor:
    """``(x @ a) @ b`` for this rank's input of the site (a row-parallel site sees only its
    columns of x)."""
    part = site.parts[0]
    x = xs[part.in_features]
    if site.row_parallel:
        x = torch.cat([x[:, start:stop] for start, stop in part.ranges], dim=1)
    return (x @ pair.a) @ pair.b


def expected_column(
    site: LoraSite, model: PeftModel, targets: set[str], xs: dict[int, torch.Tensor]
) -> torch.Tensor:
    """PEFT's deltas of the site's parts, this rank's rows of each, zero for untargeted."""
    pieces = []
    for part in site.parts:
        x = xs[part.in_features]
        if part.module.rsplit(".", 1)[1] in targets:
            full = peft_delta(model, part.module, x)
            pieces += [full[:, start:stop] for start, stop in part.ranges]
        else:
            pieces.append(torch.zeros(x.shape[0], part.local_size))
    return torch.cat(pieces, dim=1)


def check_one_rank(
    model: PeftModel, weights: LoraWeights, sites: list[LoraSite], targets: Sequence[str]
) -> None:
    xs = _inputs()
    wanted = set(targets)
    for i, site in enumerate(sites):
        names = {p.module.rsplit(".", 1)[1] for p in site.parts}
        if not names & wanted:
            assert i not in weights.pairs
            continue
        out = site_output(site, weights.pairs[i], xs)
        if site.row_parallel:
            expected = peft_delta(model, site.parts[0].module, xs[site.parts[0].in_features])
        else:
            expected = expected_column(site, model, wanted, xs)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    directory = tmp_path / "adapters"
    directory.mkdir()
    return directory


def make_cache(
    root: Path,
    sites: Sequence[LoraSite] | None = None,
    dtype: torch.dtype = torch.float32,
    max_rank: int = 16,
    max_cached: int = 4,
    prefixes: bool = True,
) -> AdapterCache:
    prefix_store = PrefixStore(root, H, dtype, CPU, max_length=16, cache_bytes=1 << 20)
    return AdapterCache(
        root,
        sites=llama_sites() if sites is None else sites,
        dtype=dtype,
        device=CPU,
        max_rank=max_rank,
        max_cached=max_cached,
        prefix_store=prefix_store if prefixes else None,
    )


# --- LoRA layout against PEFT -------------------------------------------------------------


def test_all_seven_targets_match_peft(base: LlamaForCausalLM, root: Path) -> None:
    model = save_lora(base, root / "all")
    cache = make_cache(root)
    info = cache.lookup("all")
    assert (info.kind, info.prefix_length) == (AdapterKind.LORA, 0)
    weights = cache.lora("all")
    assert info.version == weights.version and len(info.version) == 16
    assert weights.adapter_id == "all"
    assert weights.rank == 4
    assert sorted(weights.pairs) == list(range(4 * LAYERS))
    qkv = weights.pairs[0]
    assert qkv.a.shape == (H, 12) and qkv.b.shape == (12, H + 2 * KV)  # R = 3 parts * r 4
    check_one_rank(model, weights, llama_sites(), ALL)


def test_a_subset_of_targets_leaves_the_rest_alone(base: LlamaForCausalLM, root: Path) -> None:
    model = save_lora(base, root / "qv", targets=["q_proj", "v_proj"])
    weights = make_cache(root).lora("qv")
    assert sorted(weights.pairs) == [0, 4]  # each layer's q/k/v site only
    pair = weights.pairs[0]
    assert pair.a.shape == (H, 8) and pair.b.shape == (8, H + 2 * KV)
    assert not pair.b[:, H : H + KV].any()  # k_proj's columns
    check_one_rank(model, weights, llama_sites(), ["q_proj", "v_proj"])


def test_rslora_scaling(base: LlamaForCausalLM, root: Path) -> None:
    model = save_lora(base, root / "rs", r=8, lora_alpha=16, use_rslora=True)
    weights = make_cache(root).lora("rs")
    assert weights.rank == 8
    check_one_rank(model, weights, llama_sites(), ALL)


def test_rank_and_alpha_patterns(base: LlamaForCausalLM, root: Path) -> None:
    model = save_lora(
        base,
        root / "patterns",
        r=16,
        lora_alpha=4,
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
        alpha_pattern={"v_proj": 32},
    )
    weights = make_cache(root).lora("patterns")
    assert weights.rank == 16
    assert weights.pairs[0].a.shape == (H, 2 + 16 + 16)
    assert weights.pairs[3].a.shape == (INTER, 16)  # layer 0's down_proj: the default r
    assert weights.pairs[7].a.shape == (INTER, 6)
    check_one_rank(model, weights, llama_sites(), ALL)


def test_bin_weights(base: LlamaForCausalLM, root: Path) -> None:
    model = save_lora(base, root / "bin", targets=["o_proj", "gate_proj"], safe=False)
    assert (root / "bin" / "adapter_model.bin").is_file()
    assert not (root / "bin" / "adapter_model.safetensors").exists()
    weights = make_cache(root).lora("bin")
    check_one_rank(model, weights, llama_sites(), ["o_proj", "gate_proj"])


def test_adapter_name_infix_is_tolerated(base: LlamaForCausalLM, root: Path) -> None:
    model = save_lora(base, root / "infix", targets=["k_proj", "up_proj"])
    path = root / "infix" / "adapter_model.safetensors"
    state = load_file(path)
    renamed = {k.replace(".weight", ".default.weight"): v for k, v in state.items()}
    assert all(".lora_A.default.weight" in k or ".lora_B.default.weight" in k for k in renamed)
    save_file(renamed, path)
    check_one_rank(model, make_cache(root).lora("infix"), llama_sites(), ["k_proj", "up_proj"])


def test_two_ranks_concatenate_and_sum_to_one(base: LlamaForCausalLM, root: Path) -> None:
    model = save_lora(base, root / "tp", r=4, lora_alpha=12)
    one = make_cache(root).lora("tp")
    ranks = [make_cache(root, llama_sites(rank, 2)).lora("tp") for rank in range(2)]
    xs = _inputs()
    for i, site in enumerate(llama_sites()):
        whole = site_output(site, one.pairs[i], xs)
        outs = [site_output(llama_sites(r, 2)[i], ranks[r].pairs[i], xs) for r in range(2)]
        if site.row_parallel:
            torch.testing.assert_close(outs[0] + outs[1], whole, atol=1e-5, rtol=1e-4)
            continue
        # each rank's output is its rows of every part, parts in order: regroup by part
        pieces, offset = [], 0
        for part in site.parts:
            half = part.local_size // 2
            pieces += [out[:, offset // 2 : offset // 2 + half] for out in outs]
            offset += part.local_size
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=1e-4)
    for rank in range(2):  # and each rank on its own agrees with PEFT
        sites = llama_sites(rank, 2)
        for i, site in enumerate(sites):
            if not site.row_parallel:
                got = site_output(site, ranks[rank].pairs[i], xs)
                torch.testing.assert_close(got, expected_column(site, model, set(ALL), xs))


def test_uneven_ranges_within_a_part(base: LlamaForCausalLM, root: Path) -> None:
    """A part whose rows on this rank are not one block (heads 0 and 3 of q, say)."""
    model = save_lora(base, root / "ranges", targets=["q_proj", "v_proj", "o_proj"])
    attn = "model.layers.0.self_attn"
    q = LoraPart(f"{attn}.q_proj", H, H, ((0, 16), (48, 64)))
    k = LoraPart(f"{attn}.k_proj", H, KV, ((16, 32),))
    v = LoraPart(f"{attn}.v_proj", H, KV, ((16, 32),))
    o = LoraPart(f"{attn}.o_proj", H, H, ((0, 16), (48, 64)))
    sites = [LoraSite((q, k, v), row_parallel=False), LoraSite((o,), row_parallel=True)]
    # the other layers' modules are in the adapter too: give them their sites
    sites += llama_sites()[4:]
    weights = make_cache(root, sites).lora("ranges")
    xs = _inputs()
    got = site_output(sites[0], weights.pairs[0], xs)
    expected = expected_column(sites[0], model, {"q_proj", "v_proj", "o_proj"}, xs)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    # row-parallel: this rank's columns of o_proj's input
    x = xs[H]
    pair = weights.pairs[1]
    partial = (torch.cat([x[:, 0:16], x[:, 48:64]], dim=1) @ pair.a) @ pair.b
    full = peft_delta(model, f"{attn}.o_proj", x)
    layer = peft_layer(model, f"{attn}.o_proj")
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    rest = x[:, 16:48] @ a[:, 16:48].T @ b.T * 2.0  # the other rank; scaling 8 / 4
    torch.testing.assert_close(partial + rest.detach(), full, atol=1e-5, rtol=1e-4)


def test_dtype_device_and_contiguity(base: LlamaForCausalLM, root: Path) -> None:
    save_lora(base, root / "bf16")
    weights = make_cache(root, dtype=torch.bfloat16).lora("bf16")
    for pair in weights.pairs.values():
        for t in (pair.a, pair.b):
            assert t.dtype == torch.bfloat16 and t.device == CPU and t.is_contiguous()


# --- refusals -----------------------------------------------------------------------------


def _refusal(cache: AdapterCache, adapter_id: str) -> StoreError:
    with pytest.raises(StoreError) as info:
        cache.lookup(adapter_id)
    return info.value


def _invalid(cache: AdapterCache, adapter_id: str) -> str:
    error = _refusal(cache, adapter_id)
    assert error.kind is StoreErrorKind.INVALID
    prefix = f"can't retrieve adapter with id '{adapter_id}': invalid adapter: "
    assert error.message.startswith(prefix), error.message
    return error.message.removeprefix(prefix)


def _edit_config(directory: Path, **changes: Any) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.fixture
def saved(base: LlamaForCausalLM, root: Path) -> Iterator[Path]:
    """A small valid LoRA adapter ``root/x`` to break."""
    save_lora(base, root / "x", targets=["q_proj", "down_proj"])
    yield root / "x"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"bias": "all"}, "bias 'all' is not supported (only 'none')"),
        ({"bias": "lora_only"}, "bias 'lora_only' is not supported (only 'none')"),
        ({"use_dora": True}, "DoRA (use_dora) is not supported"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save is not supported (lm_head)"),
        ({"layers_to_transform": [0]}, "layers_to_transform is not supported"),
        ({"lora_bias": True}, "lora_bias is not supported"),
        ({"r": 0}, "r must be a positive integer, got 0"),
        ({"lora_alpha": "big"}, "lora_alpha must be a number, got 'big'"),
        (
            {"r": 8},
            "module model.layers.0.self_attn.q_proj has rank 4 but adapter_config.json "
            "gives it r=8",
        ),
    ],
)
def test_config_refusals(saved: Path, root: Path, changes: dict[str, Any], reason: str) -> None:
    _edit_config(saved, **changes)
    assert _invalid(make_cache(root), "x") == reason


def _edit_weights(directory: Path, edit: Any) -> None:
    path = directory / "adapter_model.safetensors"
    state = dict(load_file(path))
    edit(state)
    save_file(state, path)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (
            lambda s: s.update({"base_model.model.lm_head.lora_A.weight": torch.ones(4, H)}),
            "module lm_head is not supported by this model",
        ),
        (
            lambda s: s.update({"base_model.model.model.norm.lora_A.weight": torch.ones(4, H)}),
            "module model.norm is not supported by this model",
        ),
        (
            lambda s: s.update(
                {"base_model.model.model.layers.0.mlp.up_proj.weight": (torch.ones(INTER, H))}
            ),
            "unsupported tensor base_model.model.model.layers.0.mlp.up_proj.weight in "
            "adapter_model.safetensors (only lora_A and lora_B weights can be applied)",
        ),
        (
            lambda s: s.update(
                {
                    "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": (
                        torch.ones(H)
                    )
                }
            ),
            "unsupported tensor base_model.model.model.layers.0.self_attn.q_proj."
            "lora_magnitude_vector in adapter_model.safetensors (only lora_A and lora_B "
            "weights can be applied)",
        ),
        (
            lambda s: s.pop(Q_B),
            "module model.layers.0.self_attn.q_proj has lora_A but no lora_B",
        ),
        (
            lambda s: s.pop(Q_A),
            "module model.layers.0.self_attn.q_proj has lora_B but no lora_A",
        ),
        (
            lambda s: s.update({Q_A: torch.ones(4, H + 1)}),
            f"lora_A of model.layers.0.self_attn.q_proj has shape [4, {H + 1}], expected [r, {H}]",
        ),
        (
            lambda s: s.update({Q_B: torch.ones(H, 3)}),
            f"lora_B of model.layers.0.self_attn.q_proj has shape [{H}, 3], expected [{H}, 4]",
        ),
        (
            lambda s: s.update({Q_A: torch.ones(4, H, dtype=torch.int32)}),
            "lora_A of model.layers.0.self_attn.q_proj is not a floating-point tensor "
            "(torch.int32)",
        ),
        (
            lambda s: s[Q_B].__setitem__((0, 0), float("inf")),
            "lora_B of model.layers.0.self_attn.q_proj contains non-finite values",
        ),
        (
            lambda s: s[Q_A].__setitem__((1, 2), float("nan")),
            "lora_A of model.layers.0.self_attn.q_proj contains non-finite values",
        ),
        (lambda s: s.clear(), "adapter_model.safetensors holds no lora_A/lora_B weights"),
    ],
)
def test_weight_refusals(saved: Path, root: Path, edit: Any, reason: str) -> None:
    _edit_weights(saved, edit)
    assert _invalid(make_cache(root), "x") == reason


def test_embedding_lora_is_refused(base: LlamaForCausalLM, root: Path) -> None:
    save_lora(base, root / "emb", targets=["embed_tokens", "q_proj"])
    # PEFT saves lora_embedding_A/B and the whole base embedding: the module is named
    reason = _invalid(make_cache(root), "emb")
    assert reason == "module model.embed_tokens is not supported by this model"


def test_lm_head_lora_from_peft_is_refused(base: LlamaForCausalLM, root: Path) -> None:
    save_lora(base, root / "head", targets=["lm_head"])
    assert _invalid(make_cache(root), "head") == "module lm_head is not supported by this model"


def test_rank_above_max_lora_rank(saved: Path, root: Path) -> None:
    assert _invalid(make_cache(root, max_rank=2), "x") == (
        "adapter rank 4 exceeds --max-lora-rank 2"
    )


def test_overflow_in_the_serving_dtype(saved: Path, root: Path) -> None:
    _edit_weights(saved, lambda s: s[Q_B].__setitem__((0, 0), 1e6))
    assert _invalid(make_cache(root, dtype=torch.float16), "x") == (
        "lora_B of model.layers.0.self_attn.q_proj contains non-finite values after scaling "
        "and conversion from torch.float32 to torch.float16"
    )


def test_unreadable_and_missing_weights(saved: Path, root: Path) -> None:
    (saved / "adapter_model.safetensors").write_bytes(b"garbage!garbage!")
    reason = _invalid(make_cache(root), "x")
    assert reason.startswith("cannot read adapter_model.safetensors: ")
    assert str(root) not in reason
    (saved / "adapter_model.safetensors").unlink()
    (saved / "adapter_model.bin").write_bytes(b"garbage")
    reason = _invalid(make_cache(root), "x")
    assert reason.startswith("cannot read adapter_model.bin: ")
    torch.save([torch.ones(2)], saved / "adapter_model.bin")
    assert (
        _invalid(make_cache(root), "x") == "adapter_model.bin does not hold a dictionary of tensors"
    )
    (saved / "adapter_model.bin").unlink()
    assert _invalid(make_cache(root), "x") == "no adapter_model.safetensors or adapter_model.bin"


def test_config_problems(saved: Path, root: Path) -> None:
    cache = make_cache(root)
    config = saved / "adapter_config.json"
    config.write_text("{not json")
    assert _invalid(cache, "x").startswith("adapter_config.json is not valid JSON (")
    config.write_text("[1, 2]")
    assert _invalid(cache, "x") == "adapter_config.json is not a JSON object"
    config.write_text('{"peft_type": "IA3"}')
    error = _refusal(cache, "x")
    assert error.kind is StoreErrorKind.INVALID
    assert error.message == "adapter type IA3 is not currently supported"
    config.write_text("{}")
    assert _refusal(cache, "x").message == "adapter type None is not currently supported"
    config.unlink()
    error = _refusal(cache, "x")
    assert error.kind is StoreErrorKind.NOT_FOUND
    assert error.message == (
        "can't retrieve adapter with id 'x': invalid adapter: no adapter_config.json found"
    )


def test_missing_directory(root: Path) -> None:
    error = _refusal(make_cache(root), "nested/missing")
    assert error.kind is StoreErrorKind.NOT_FOUND
    assert (
        error.message == "can't retrieve adapter with id 'nested/missing': directory does not exist"
    )


def test_model_without_lora_sites(saved: Path, root: Path) -> None:
    error = _refusal(make_cache(root, sites=[]), "x")
    assert error.kind is StoreErrorKind.INVALID
    assert error.message == "adapter type LORA is not currently supported for this model"


@pytest.mark.parametrize("adapter_id", ["../x", "/abs", "/", "a..b", "a b", "x/../x", "", "é$"])
def test_bad_ids(saved: Path, root: Path, adapter_id: str) -> None:
    error = _refusal(make_cache(root), adapter_id)
    assert error.kind is StoreErrorKind.INVALID
    assert error.message == f"Invalid adapter id '{adapter_id}', {BAD_ID}"


def test_symlinks_out_of_the_store(saved: Path, root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "x").mkdir(parents=True)
    for f in saved.iterdir():
        (outside / "x" / f.name).write_bytes(f.read_bytes())
    (root / "escape").symlink_to(outside / "x")
    cache = make_cache(root)
    assert _refusal(cache, "escape").message == f"Invalid adapter id 'escape', {BAD_ID}"
    (root / "inside").mkdir()
    (root / "inside" / "adapter_config.json").write_bytes(
        (saved / "adapter_config.json").read_bytes()
    )
    (root / "inside" / "adapter_model.safetensors").symlink_to(
        outside / "x" / "adapter_model.safetensors"
    )
    assert _refusal(cache, "inside").message == f"Invalid adapter id 'inside', {BAD_ID}"
    (root / "alias").symlink_to(saved)  # inside the store: fine
    assert cache.lookup("alias").kind is AdapterKind.LORA


# --- prompt tuning ------------------------------------------------------------------------


def save_prompt_tuning(base: LlamaForCausalLM, directory: Path, tokens: int = 5) -> torch.Tensor:
    torch.manual_seed(3)
    config = PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=tokens)
    model: Any = get_peft_model(copy.deepcopy(base), config)
    model.save_pretrained(directory)
    return load_file(directory / "adapter_model.safetensors")["prompt_embeddings"]


def test_prompt_tuning_adapter(base: LlamaForCausalLM, root: Path) -> None:
    embeddings = save_prompt_tuning(base, root / "pt", tokens=5)
    assert embeddings.shape == (5, H)
    cache = make_cache(root)
    info = cache.lookup("pt")
    assert (info.kind, info.prefix_length) == (AdapterKind.PROMPT_TUNING, 5)
    assert cache.lookup("pt") == info  # known now: no config re-read needed
    loaded = cache.load("pt")
    assert loaded.info == info and loaded.lora is None and loaded.prompt is not None
    torch.testing.assert_close(loaded.prompt, embeddings)
    assert cache.cached_ids() == []  # the LoRA LRU holds LoRA only
    with pytest.raises(StoreError, match="is a prompt-tuning adapter, not LoRA"):
        cache.lora("pt")


def test_a_lora_adapter_loads_weights_and_no_prompt(saved: Path, root: Path) -> None:
    loaded = make_cache(root).load("x")
    assert loaded.info.kind is AdapterKind.LORA
    assert loaded.prompt is None and loaded.lora is not None
    assert loaded.info.version == loaded.lora.version


def test_prompt_tuning_errors(base: LlamaForCausalLM, root: Path) -> None:
    save_prompt_tuning(base, root / "long", tokens=20)  # the store allows 16
    cache = make_cache(root)
    assert _invalid(cache, "long") == "Invalid prefix embedding length of 20"
    save_prompt_tuning(base, root / "empty")
    (root / "empty" / "adapter_model.safetensors").unlink()
    assert _invalid(cache, "empty") == "no adapter_model.safetensors or adapter_model.bin"
    save_prompt_tuning(base, root / "pt")
    error = _refusal(make_cache(root, prefixes=False), "pt")
    assert error.message == "adapter type PROMPT_TUNING is not currently supported for this model"


# --- the cache ----------------------------------------------------------------------------


def _same(a: LoraWeights, b: LoraWeights) -> bool:
    return a.pairs.keys() == b.pairs.keys() and all(
        torch.equal(a.pairs[i].a, b.pairs[i].a) and torch.equal(a.pairs[i].b, b.pairs[i].b)
        for i in a.pairs
    )


def test_lru_keeps_max_cached(base: LlamaForCausalLM, root: Path) -> None:
    for seed, name in enumerate("abc"):
        save_lora(base, root / name, targets=["q_proj"], seed=seed)
    cache = make_cache(root, max_cached=2)
    first = cache.lora("a")
    cache.lookup("b")
    assert cache.cached_ids() == ["a", "b"]
    cache.lookup("a")  # used: now the most recent
    cache.lookup("c")
    assert cache.cached_ids() == ["a", "c"]
    cache.lookup("b")
    assert cache.cached_ids() == ["c", "b"]
    again = cache.lora("a")  # evicted: read again
    assert again is not first and _same(again, first)
    assert cache.cached_ids() == ["b", "a"]
    assert cache.lora("a") is again


def test_concurrent_lookups_share_one_load(
    saved: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = adapter_cache.read_lora

    def slow_read(adapter_id: str, *args: Any) -> LoraWeights:
        calls.append(adapter_id)
        time.sleep(0.2)
        return real(adapter_id, *args)

    monkeypatch.setattr(adapter_cache, "read_lora", slow_read)
    cache = make_cache(root)
    barrier = threading.Barrier(8)
    results: list[LoraWeights] = []

    def worker() -> None:
        barrier.wait()
        results.append(cache.lora("x"))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["x"]
    assert len(results) == 8 and all(r is results[0] for r in results)


def test_failures_are_not_cached(saved: Path, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = adapter_cache.read_lora

    def counted(adapter_id: str, *args: Any) -> LoraWeights:
        calls.append(adapter_id)
        return real(adapter_id, *args)

    monkeypatch.setattr(adapter_cache, "read_lora", counted)
    cache = make_cache(root, max_rank=2)
    for _ in range(2):
        _refusal(cache, "x")
    assert calls == ["x", "x"]
    assert cache.cached_ids() == []
    cache.max_rank = 16  # fixed: the next lookup loads it
    assert cache.lookup("x").kind is AdapterKind.LORA
    assert cache.cached_ids() == ["x"]


# --- content versions ----------------------------------------------------------------------


def test_the_version_follows_the_files_not_the_load(base: LlamaForCausalLM, root: Path) -> None:
    """Read again unchanged (after eviction): the same version. The weights or the config
    rewritten: another, which a sequence that asked for the old one is refused over."""
    save_lora(base, root / "v", targets=["q_proj"])
    cache = make_cache(root, max_cached=1)
    first = cache.lookup("v").version
    save_lora(base, root / "other", targets=["q_proj"])
    cache.lookup("other")  # evicts "v"
    assert cache.cached_ids() == ["other"]
    assert cache.lookup("v").version == first
    config_path = root / "v" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = config["lora_alpha"] * 2
    config_path.write_text(json.dumps(config))
    cache.lookup("other")
    rescaled = cache.lookup("v").version
    assert rescaled != first
    adapters = Adapters(cache, max_loras=1)
    old = NewSequence(request_id=1, prompt_token_ids=(1, 2), adapter_id="v", adapter_version=first)
    with pytest.raises(PrefixUnavailable, match="adapter 'v' changed in its store"):
        adapters.for_sequence(old)
    _, weights = adapters.for_sequence(replace(old, adapter_version=rescaled))
    assert weights is not None and weights.version == rescaled
    _, unchecked = adapters.for_sequence(replace(old, adapter_version=""))
    assert unchecked is weights


def test_a_prompt_tuning_adapter_is_versioned_by_its_embeddings(
    base: LlamaForCausalLM, root: Path
) -> None:
    save_prompt_tuning(base, root / "pt", tokens=5)
    cache = make_cache(root)
    before = cache.lookup("pt").version
    adapters = Adapters(cache, max_loras=1)
    ns = NewSequence(1, (1,), adapter_id="pt", prefix_length=5, adapter_version=before)
    embeddings, lora = adapters.for_sequence(ns)
    assert embeddings is not None and lora is None
    fresh = make_cache(root)  # another rank, or this one after the prefix cache let it go
    torch.manual_seed(4)
    save_file({"prompt_embeddings": torch.randn(5, H)}, root / "pt" / "adapter_model.safetensors")
    assert fresh.lookup("pt").version != before
    with pytest.raises(PrefixUnavailable, match="adapter 'pt' changed in its store"):
        Adapters(fresh, max_loras=1).for_sequence(ns)
