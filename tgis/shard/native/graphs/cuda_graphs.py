"""Decode and verify steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a large model on a GPU is a few milliseconds of memory traffic, and
launching its hundreds of kernels one by one from Python costs as much again. At start-up
``DecodeGraphs`` captures the model's forward (eager or compiled) for decode-only batches
of each bucket size (``graph_buckets``: 1, 2, 4, 8, then every 16 up to the largest batch),
over static input buffers: token ids, positions, KV slots, block tables and context
lengths. A step whose sequences all compute one token, at most the largest bucket of them,
is then run by copying its inputs into those buffers (one host-to-device copy), padding the
rows up to the bucket (pad rows write no KV: slot -1, and attend to one cached key), and
replaying the bucket's graph; other steps (prompts, chunks) run the forward directly.
Sampling stays outside the graph, on the replayed hidden states.

Speculative decoding's verify steps (the last token and up to k drafts per sequence) have
graphs of their own, of ``width`` 1 + k rows per sequence (``--speculate`` on the shard),
for batches up to ``--speculator-max-batch-size``. A step whose sequences each compute at
most ``width`` tokens is staged with every sequence's rows first in its slot of ``width``
rows and pad rows after them (token 0 at position 0, no KV slot); its context length is
raised by its pad rows, so its real rows keep their positions and the causal mask keeps
them from the pad rows, which attend to whatever keys lie past them. The real rows' hidden
states are gathered back into the step's order after the replay.

Only ``triton_paged`` attention is captured: its metadata are plain tensors whose shapes
depend on the bucket alone, and its decode kernel's grid is fixed by the bucket and the
longest possible context (``max_decode_context``; splits beyond a sequence's context are
empty). Tensor-parallel ranks capture their NCCL all-reduces with the rest (the row-parallel
layers' ``tgis::all_reduce``, ``parallel/collective_op.py``) and replay them in lock-step:
every rank runs the same Steps, so the same buckets (not yet run: it needs two GPUs).

``TGIS_CUDA_GRAPHS``: ``auto`` (default) captures on CUDA with ``triton_paged``, and runs
without graphs (a warning) if capture or the start-up check fails (on any rank); ``1``
makes such a failure a start-up error; ``0`` never captures. The start-up check replays the
smallest and the largest bucket against the forward run directly on the same inputs.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tgis.shard.native.attention.interface import BatchLayout
from tgis.shard.native.attention.kv_cache import KVCache
from tgis.shard.native.models import ForwardFn

if TYPE_CHECKING:  # imports Triton: only once graphs are captured
    from tgis.shard.native.attention.triton_paged import TritonPagedMetadata

log = logging.getLogger(__name__)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to ``max_batch``
    (included, as the last bucket, when it is not one of those)."""
    sizes = [s for s in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if s <= max_batch]
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


class DecodeGraphs:
    """The captured graphs of one model replica for steps of up to ``width`` tokens per
    sequence (1: decode steps; 1 + k: verify steps of k drafts), and their static buffers.
    A ``width`` above 1 must fit one query tile of the prefill kernel."""

    def __init__(
        self,
        forward: ForwardFn,
        kv_cache: KVCache,
        device: torch.device,
        buckets: tuple[int, ...],
        max_context: int,
        vocab_size: int,
        width: int = 1,
    ) -> None:
        self.forward = forward
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.device = device
        self.buckets = buckets
        self.width = width
        self.max_batch = buckets[-1]
        self.max_context = max_context
        # A sequence's pad rows lengthen its context by up to width - 1 positions.
        self.max_blocks = -(-(max_context + width - 1) // kv_cache.block_size)
        n, rows = self.max_batch, self.max_batch * width
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.gather = torch.arange(rows, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.context = torch.full((n,), width, dtype=torch.int32, device=device)
        self._seqs = torch.arange(n, dtype=torch.int32, device=device)
        self._starts = self._seqs * width
        self._widths = torch.full((n,), width, dtype=torch.int32, device=device)
        self._zeros = torch.zeros(n, dtype=torch.int32, device=device)
        self._none = torch.empty(0, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def metadata(self, bucket: int) -> TritonPagedMetadata:
        """The static attention metadata of a bucket: views of the input buffers (one
        decode per sequence for width 1, else one query tile per sequence)."""
        from tgis.shard.native.attention.triton_paged import TritonPagedMetadata

        decode = self.width == 1
        return TritonPagedMetadata(
            slot_mapping=self.slots[: bucket * self.width],
            block_tables=self.tables[:bucket],
            context_lens=self.context[:bucket],
            query_starts=self._starts[:bucket],
            query_lens=self._widths[:bucket],
            tile_seqs=self._none if decode else self._seqs[:bucket],
            tile_offsets=self._none if decode else self._zeros[:bucket],
            decode_seqs=self._seqs[:bucket] if decode else self._none,
            max_decode_context=self.max_context if decode else 0,
        )

    def _run_forward(self, bucket: int) -> torch.Tensor:
        rows = bucket * self.width
        return self.forward(
            self.input_ids[:rows], self.positions[:rows], self.kv_cache, self.metadata(bucket)
        )

    def capture(self, pool: Any = None) -> float:
        """Capture every bucket, largest first, in one memory pool (``pool``: one shared
        with other graphs; default a new one); seconds taken."""
        started = time.monotonic()
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compile kernels, settle the allocator
                for _ in range(2):
                    self._run_forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._run_forward(bucket)
            self.graphs[bucket] = graph
        torch.cuda.synchronize(self.device)
        return time.monotonic() - started

    def verify(self, seed: int = 0) -> None:
        """Replay the smallest and the largest bucket on random inputs (no KV written)
        against the forward run directly; RuntimeError when they differ."""
        gen = torch.Generator().manual_seed(seed)
        width = self.width
        for bucket in {self.buckets[0], self.buckets[-1]}:
            rows = bucket * width
            vocab_ids = torch.randint(0, self.vocab_size, (rows,), generator=gen)
            context = torch.randint(
                width, width + self.kv_cache.block_size, (bucket,), generator=gen
            )
            self.input_ids[:rows].copy_(vocab_ids)
            last = context.repeat_interleave(width) - 1
            self.positions[:rows].copy_(last - torch.arange(width - 1, -1, -1).repeat(bucket))
            self.slots[:rows].fill_(-1)
            self.gather[:rows].copy_(torch.arange(rows))
            self.context[:bucket].copy_(context.to(torch.int32))
            self.tables[:bucket].zero_()
            self.graphs[bucket].replay()
            replayed = self.outputs[bucket].clone()
            direct = self._run_forward(bucket)
            torch.cuda.synchronize(self.device)
            if not torch.allclose(replayed.float(), direct.float(), atol=1e-3, rtol=1e-3):
                diff = (replayed.float() - direct.float()).abs().max().item()
                raise RuntimeError(f"the graph of {bucket} sequences differs by {diff:.3g}")

    def bucket_for(self, layout: BatchLayout) -> int | None:
        """The bucket that runs this step, None when the step does not fit: more sequences
        than the largest bucket, a sequence computing none or more than ``width`` tokens
        (exactly 1 for width 1), or a context past the buffers."""
        lens = layout.query_lens
        count = len(lens)
        if count == 0 or count > self.max_batch or int(lens.min()) < 1:
            return None
        if int(lens.max()) > self.width or (self.width == 1 and int(lens.max()) != 1):
            return None
        padded_context = int((layout.context_lens + self.width - lens).max())
        if padded_context > self.max_blocks * self.kv_cache.block_size:
            return None
        if layout.block_tables.shape[1] > self.max_blocks:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, count)]

    def run(self, layout: BatchLayout, bucket: int) -> torch.Tensor:
        """Stage the step, replay the bucket's graph, and return the hidden states of the
        step's rows in the step's order (valid until the next replay)."""
        self.stage(layout, bucket)
        self.graphs[bucket].replay()
        tokens = len(layout.input_ids) if layout.input_ids is not None else 0
        if self.width == 1:
            return self.outputs[bucket][:tokens]
        return self.outputs[bucket].index_select(0, self.gather[:tokens])

    def stage(self, layout: BatchLayout, bucket: int) -> None:
        """Fill the static buffers' first ``bucket`` sequences (``width`` rows each): each
        sequence's rows first in its slot, then pad rows (token 0 at position 0, no KV slot);
        pad sequences attend to ``width`` keys of block 0. ``gather`` lists the step's rows
        in the buffers."""
        assert layout.input_ids is not None and layout.positions is not None
        lens, width = layout.query_lens, self.width
        count, tokens, rows = len(lens), len(layout.input_ids), bucket * width
        # Each token's row: its sequence's slot plus its place in the sequence's query.
        dest = np.repeat(np.arange(count) * width - layout.query_starts, lens) + np.arange(tokens)
        per_row = np.zeros((4, rows), dtype=np.int64)
        per_row[2] = -1  # pad rows: no KV written
        per_row[0, dest] = layout.input_ids
        per_row[1, dest] = layout.positions
        per_row[2, dest] = layout.slot_mapping
        per_row[3, :tokens] = dest
        per_seq = np.zeros((bucket, 1 + self.max_blocks), dtype=np.int64)
        per_seq[:, 0] = width  # pad sequences: width keys (block 0) to attend to
        per_seq[:count, 0] = layout.context_lens + width - lens
        tables = layout.block_tables
        per_seq[:count, 1 : 1 + tables.shape[1]] = tables
        host = np.concatenate([per_row.ravel(), per_seq.ravel()])
        staged = torch.from_numpy(host).to(self.device, non_blocking=True)
        rows_part, seq_part = staged.split([4 * rows, per_seq.size])
        by_row, by_seq = rows_part.view(4, rows), seq_part.view(per_seq.shape)
        self.input_ids[:rows].copy_(by_row[0])
        self.positions[:rows].copy_(by_row[1])
        self.slots[:rows].copy_(by_row[2])
        self.gather[:tokens].copy_(by_row[3, :tokens])
        self.context[:bucket].copy_(by_seq[:, 0])
        self.tables[:bucket].copy_(by_seq[:, 1:])
