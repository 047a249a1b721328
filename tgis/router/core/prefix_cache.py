"""Automatic prefix caching: which full KV blocks a request can reuse, and which blocks it
wrote that others may reuse (the blocks themselves are counted in ``block_pool.py``).

**Identity.** Block j of a request is identified by a hash chained from the start of its
positions: ``sha256(hash of block j-1 | the block's token ids)``, the chain rooted in
everything else that changes the keys and values of the same ids: the adapter (LoRA or
prompt tuning) and the prompt-tuning prefix, each with the version the shard reported
when the router looked it up (``ValidatedRequest.cache_identity``), so an adapter or
prefix rewritten in its store never meets the old one's blocks. A prefix's virtual tokens
are positions without ids (-1 here); its id and version in the root tell them apart.
Generated tokens are hashed too, so a preempted request finds its own blocks again and a
conversation's next turn finds the previous answer.

**Lookup** (at admission, ``Scheduler._admit``): the longest run of the request's full
blocks that are cached, capped so that at least one known token is left to compute (its
logits are needed). A request that wants input-token details and has not started
generating looks nothing up: every prompt position must be computed for them.

**Registration** (``register``, when a step's output is back, never when it is planned):
a running request's blocks that the step filled are made findable. A step the shard did
not run registers nothing, so a failed step has nothing to undo here.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from tgis.router.core.block_pool import BlockHash, BlockPool
from tgis.router.core.request_state import RequestState

__all__ = ["NO_HIT", "CacheHit", "PrefixCache"]

VIRTUAL_TOKEN = -1
"""The id hashed for a prompt-tuning prefix's virtual positions."""


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The cached blocks a request starts with (``tokens`` positions) and how many of
    them no sequence holds yet (taking those uses up free blocks)."""

    blocks: tuple[int, ...] = ()
    tokens: int = 0
    idle: int = 0
    queried: int = 0
    """Tokens looked up (0: the request did not use the cache)."""


NO_HIT = CacheHit()


class PrefixCache:
    """Finds and registers requests' full blocks in ``pool`` (nothing when disabled)."""

    def __init__(self, pool: BlockPool, enabled: bool) -> None:
        self.pool = pool
        self.enabled = enabled

    def lookup(self, state: RequestState) -> CacheHit:
        """The cached run of ``state``'s known full blocks (the pool is only read)."""
        if not self.enabled:
            return NO_HIT
        request = state.request
        if request.params.response.input_tokens and not state.generated_ids:
            return NO_HIT
        known = state.prompt_length + len(state.generated_ids)
        usable = (known - 1) // self.pool.block_size
        hashes = _hashes_up_to(state, usable, self.pool.block_size)
        blocks = tuple(self.pool.match(hashes[:usable]))
        return CacheHit(
            blocks=blocks,
            tokens=len(blocks) * self.pool.block_size,
            idle=self.pool.idle_among(blocks),
            queried=known,
        )

    def register(self, state: RequestState, computed: int) -> None:
        """``state``'s first ``computed`` positions are in its blocks now: make its full
        blocks among them findable (those it shared are already)."""
        if not self.enabled:
            return
        size = self.pool.block_size
        full = min(computed, state.prompt_length + len(state.generated_ids)) // size
        if full <= state.registered_blocks:
            return
        hashes = _hashes_up_to(state, full, size)
        for j in range(state.registered_blocks, full):
            self.pool.register(state.block_ids[j], hashes[j])
        state.registered_blocks = full


def _hashes_up_to(state: RequestState, count: int, block_size: int) -> list[BlockHash]:
    """``state.block_hashes`` extended to (at least) ``count`` blocks of known tokens."""
    hashes = state.block_hashes
    if len(hashes) >= count:
        return hashes
    request = state.request
    virtual, inputs, generated = request.prefix_length, request.input_ids, state.generated_ids
    prompt = virtual + len(inputs)
    parent = hashes[-1] if hashes else _root(state)
    sha256 = hashlib.sha256
    for j in range(len(hashes), count):
        start, end = j * block_size, (j + 1) * block_size
        if virtual <= start and end <= prompt:  # input tokens only: the common case
            ids = array("q", inputs[start - virtual : end - virtual])
        else:
            ids = array("q", [VIRTUAL_TOKEN] * max(min(end, virtual) - start, 0))
            ids.extend(inputs[max(start, virtual) - virtual : max(min(end, prompt) - virtual, 0)])
            ids.extend(generated[max(start, prompt) - prompt : max(end - prompt, 0)])
        parent = sha256(parent + ids.tobytes()).digest()
        hashes.append(parent)
    return hashes


def _root(state: RequestState) -> BlockHash:
    """What the chain starts from: everything besides token ids that changes the KV."""
    return hashlib.sha256(repr(state.request.cache_identity).encode()).digest()
