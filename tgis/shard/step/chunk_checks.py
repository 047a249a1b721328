"""What a scheduled chunk may ask for beyond computing known tokens: to start after a
prefix-cache hit's cached blocks (``cached_tokens``) and to verify drafted tokens
(``draft_token_ids``, or ``spec_tokens`` for the shard's draft model). A chunk that misuses
either makes the whole plan invalid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tgis.shard.errors import InvalidStepError
from tgis.shard.step.sequence import Sequence
from tgis.shard_api.messages import ScheduledSequence

__all__ = ["PlanLimits", "check_cached", "check_drafts", "check_state_slot"]


@dataclass(frozen=True)
class PlanLimits:
    """What the shard can accept: vocabulary ids, block ids, tokens per block."""

    vocab_size: int
    num_blocks: int
    block_size: int
    device: torch.device
    # False for engines that cannot recompute generated tokens (encoder-decoder fallback).
    resumes_generated: bool = True
    # The engine starts sequences after cached tokens (ScheduledSequence.cached_tokens).
    prefix_caching: bool = False
    # The engine verifies drafted tokens (ScheduledSequence.draft_token_ids).
    speculation: bool = False
    # The engine has a draft model (ScheduledSequence.spec_tokens).
    draft_model: bool = False
    # Recurrent-state slots (ScheduledSequence.state_slot; 0: the model has none).
    state_slots: int = 0


def check_cached(s: ScheduledSequence, seq: Sequence, computed: int, limits: PlanLimits) -> None:
    """InvalidStepError unless ``s.cached_tokens`` may be used: an engine with the prefix
    cache, a sequence starting from position 0 that wants no input-token details yet, whole
    blocks, and at least one token left to compute."""
    rid, cached = s.request_id, s.cached_tokens
    problem = None
    if not limits.prefix_caching:
        problem = "this engine has no prefix cache"
    elif computed:
        problem = f"the sequence has {computed} computed token(s)"
    elif cached % limits.block_size:
        problem = f"not a whole number of blocks (block size {limits.block_size})"
    elif cached >= len(seq.token_ids):
        problem = f"the sequence has only {len(seq.token_ids)} known token(s)"
    elif seq.details.input_tokens and seq.num_generated == 0:
        problem = "the sequence asked for input-token details"
    if problem is not None:
        raise InvalidStepError(f"request {rid}: cached_tokens {cached}: {problem}")


def check_state_slot(s: ScheduledSequence, limits: PlanLimits) -> None:
    """InvalidStepError unless ``s.state_slot`` is set exactly when the model has state
    slots, and names one of them."""
    rid, slot, slots = s.request_id, s.state_slot, limits.state_slots
    if slot is None and slots:
        raise InvalidStepError(f"request {rid}: no state_slot (the model has {slots})")
    if slot is not None and not 0 <= slot < slots:
        raise InvalidStepError(
            f"request {rid}: state_slot {slot} out of range (state slots {slots})"
        )


def check_drafts(s: ScheduledSequence, seq: Sequence, computed: int, limits: PlanLimits) -> None:
    """InvalidStepError unless ``s.draft_token_ids`` may be verified: an engine that
    speculates, a sequence decoding (every known token computed but the last) without a
    grammar, ``num_tokens`` counting the drafts, ids in the vocabulary."""
    rid, drafts = s.request_id, s.draft_token_ids
    problem = None
    if not limits.speculation:
        problem = "this engine does not verify drafts"
    elif s.spec_tokens and (drafts or not limits.draft_model):
        problem = "spec_tokens needs a draft model and no draft_token_ids"
    elif seq.num_generated == 0 or computed != len(seq.token_ids) - 1:
        problem = "the sequence is not decoding"
    elif s.num_tokens != 1 + len(drafts):
        problem = f"num_tokens {s.num_tokens} is not 1 + {len(drafts)} drafts"
    elif s.spec_tokens < 0:
        problem = "negative spec_tokens"
    elif seq.guide is not None:
        problem = "the sequence is guided"
    elif any(not 0 <= t < limits.vocab_size for t in drafts):
        problem = f"a draft id is out of range (vocab size {limits.vocab_size})"
    if problem is not None:
        count = len(drafts) or s.spec_tokens
        raise InvalidStepError(f"request {rid}: {count} drafted token(s): {problem}")
