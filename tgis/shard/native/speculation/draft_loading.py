"""Load the draft model of ``--speculator-name`` (TGIS's ``SPECULATOR_NAME``): a causal LM
of a native family that shares the target's tokenizer, read onto the target's device in the
target's dtype. Its KV cache takes as many blocks as the target's (``draft_model.py``), so
the target's sizing counts both caches' bytes per block.

With tensor parallelism the draft model is split over the ranks like the target (each rank
reads its slice of every tensor and holds its heads' KV cache): every rank runs the same
drafting steps in lockstep, and the logits are gathered whole on each rank, so every rank
takes the same greedy drafts.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tgis.model_files import ModelNotFoundError, resolve_model_dir
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.config import ShardConfig
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import KVCache, KVCacheSpec
from tgis.shard.native.models import CausalLM, model_class
from tgis.shard.native.speculation.draft_model import DraftModel
from tgis.shard.native.speculation.mlp_drafter import MLPDrafter
from tgis.shard.native.speculation.mlp_speculator import (
    MLPSpeculator,
    is_mlp_speculator,
    load_mlp_speculator,
)
from tgis.shard.parallel.group import SINGLE, TensorParallel

__all__ = ["LoadedDraft", "LoadedMLP", "load_draft"]

log = logging.getLogger(__name__)

HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
"""Where a config.json gives the hidden size an MLP speculator's ``emb_dim`` must equal."""


@dataclass(frozen=True)
class LoadedDraft:
    """A draft model's weights, before its KV cache is sized."""

    model: CausalLM
    name: str

    @property
    def spec(self) -> KVCacheSpec:
        return self.model.kv_cache_spec

    @property
    def bytes_per_block(self) -> int:
        """Its KV cache's bytes per block of the target's."""
        return self.spec.bytes_per_block

    def with_cache(
        self,
        num_blocks: int,
        attention: AttentionBackend,
        device: torch.device,
        commit: bool,
        eos_token_ids: tuple[int, ...] = (),
    ) -> DraftModel:
        """The draft model with a KV cache of ``num_blocks`` blocks (the target's)."""
        cache = KVCache(self.spec, num_blocks, device, commit=commit)
        return DraftModel(self.model, cache, attention, device, self.name, eos_token_ids)


@dataclass(frozen=True)
class LoadedMLP:
    """An MLP speculator (``mlp_speculator.py``): no KV cache."""

    model: MLPSpeculator
    name: str
    bytes_per_block: int = 0

    def with_cache(
        self,
        num_blocks: int,
        attention: AttentionBackend,
        device: torch.device,
        commit: bool,
        eos_token_ids: tuple[int, ...] = (),
    ) -> MLPDrafter:
        """Its drafter (the arguments are a draft model's; it has no cache)."""
        del num_blocks, attention, device, commit
        return MLPDrafter(self.model, self.name, eos_token_ids)


def load_draft(
    config: ShardConfig,
    target: ModelConfig,
    attention: AttentionBackend,
    device: torch.device,
    dtype: torch.dtype,
    tp: TensorParallel = SINGLE,
) -> LoadedDraft | LoadedMLP | None:
    """The draft model ``config.speculator_name`` names (None: none), checked against the
    target (the same vocabulary size and tokenizer), with this rank's slice of its weights;
    or the MLP speculator it names (its config.json's architecture), whole on every rank."""
    name = config.speculator_name
    if not name:
        return None
    try:
        draft_dir = resolve_model_dir(name)
    except ModelNotFoundError as e:
        raise StartupError(f"speculator {name}: {e}") from None
    if is_mlp_speculator(draft_dir):
        return _load_mlp(name, draft_dir, target, device, dtype)
    draft_config = ModelConfig.from_dir(draft_dir)
    if draft_config.vocab_size != target.vocab_size:
        raise StartupError(
            f"speculator {name}: its vocabulary has {draft_config.vocab_size} tokens, the "
            f"model's {target.vocab_size}; a draft model must share the model's tokenizer"
        )
    _check_tokenizer(name, draft_dir, target.model_dir)
    try:
        factory = model_class(draft_config)
        weights = Weights(draft_dir, device, dtype, tp=tp)
        model = factory(draft_config, weights, attention, config.max_sequence_length)
        weights.close()
    except StartupError as e:
        raise StartupError(f"speculator {name}: {e}") from None
    log.info(
        "Draft model %s (%s) loaded from %s (rank %d of %d): %d KV bytes per block",
        name,
        draft_config.model_type,
        draft_dir,
        tp.rank,
        tp.world_size,
        model.kv_cache_spec.bytes_per_block,
    )
    return LoadedDraft(model, name)


def _load_mlp(
    name: str, draft_dir: Path, target: ModelConfig, device: torch.device, dtype: torch.dtype
) -> LoadedMLP:
    try:
        hidden = next((target.raw[k] for k in HIDDEN_KEYS if k in target.raw), None)
        model = load_mlp_speculator(draft_dir, device, dtype, hidden, target.vocab_size)
    except StartupError as e:
        raise StartupError(f"speculator {name}: {e}") from None
    log.info("MLP speculator %s loaded from %s: %d heads", name, draft_dir, model.n_predict)
    return LoadedMLP(model, name)


def _check_tokenizer(name: str, draft_dir: Path, model_dir: Path) -> None:
    """StartupError when both directories hold a ``tokenizer.json`` and they differ."""
    files = [d / "tokenizer.json" for d in (draft_dir, model_dir)]
    if not all(f.is_file() for f in files):
        return
    digests = {hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
    if len(digests) > 1:
        raise StartupError(
            f"speculator {name}: its tokenizer.json differs from the model's; a draft "
            "model must share the model's tokenizer"
        )
