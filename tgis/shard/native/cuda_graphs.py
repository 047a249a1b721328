"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

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

Only ``triton_paged`` attention is captured: its metadata are plain tensors whose shapes
depend on the bucket alone, and its decode kernel's grid is fixed by the bucket and the
longest possible context (``max_decode_context``; splits beyond a sequence's context are
empty). Tensor parallelism runs without graphs, as it runs without compilation.

``TGIS_CUDA_GRAPHS``: ``auto`` (default) captures on CUDA with ``triton_paged`` and one
rank, and runs without graphs (a warning) if capture or the start-up check fails; ``1``
makes such a failure a start-up error; ``0`` never captures. The start-up check replays the
smallest and the largest bucket against the forward run directly on the same inputs.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from tgis.shard.config import env_mode
from tgis.shard.native.attention.interface import BatchLayout
from tgis.shard.native.kv_cache import KVCache
from tgis.shard.native.models import ForwardFn

if TYPE_CHECKING:  # imports Triton: only once graphs are captured
    from tgis.shard.native.attention.triton_paged import TritonPagedMetadata

log = logging.getLogger(__name__)

GRAPHS_ENV = "TGIS_CUDA_GRAPHS"


def graphs_mode() -> str:
    """``TGIS_CUDA_GRAPHS`` as ``auto``, ``on`` or ``off`` (ValueError for other values)."""
    return env_mode(GRAPHS_ENV)


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 16, up to ``max_batch``
    (included, as the last bucket, when it is not one of those)."""
    sizes = [s for s in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if s <= max_batch]
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sizes)


class DecodeGraphs:
    """The captured decode graphs of one model replica and their static buffers."""

    def __init__(
        self,
        forward: ForwardFn,
        kv_cache: KVCache,
        device: torch.device,
        buckets: tuple[int, ...],
        max_context: int,
        vocab_size: int,
    ) -> None:
        self.forward = forward
        self.vocab_size = vocab_size
        self.kv_cache = kv_cache
        self.device = device
        self.buckets = buckets
        self.max_batch = buckets[-1]
        self.max_context = max_context
        self.max_blocks = -(-max_context // kv_cache.block_size)
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=device)
        self.context = torch.ones(n, dtype=torch.int32, device=device)
        self._rows = torch.arange(n, dtype=torch.int32, device=device)
        self._ones = torch.ones(n, dtype=torch.int32, device=device)
        self._none = torch.empty(0, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def metadata(self, bucket: int) -> TritonPagedMetadata:
        """The static attention metadata of a bucket: views of the input buffers."""
        from tgis.shard.native.attention.triton_paged import TritonPagedMetadata

        return TritonPagedMetadata(
            slot_mapping=self.slots[:bucket],
            block_tables=self.tables[:bucket],
            context_lens=self.context[:bucket],
            query_starts=self._rows[:bucket],
            query_lens=self._ones[:bucket],
            tile_seqs=self._none,
            tile_offsets=self._none,
            decode_seqs=self._rows[:bucket],
            max_decode_context=self.max_context,
        )

    def _run_forward(self, bucket: int) -> torch.Tensor:
        return self.forward(
            self.input_ids[:bucket], self.positions[:bucket], self.kv_cache, self.metadata(bucket)
        )

    def capture(self) -> float:
        """Capture every bucket, largest first, in one memory pool; seconds taken."""
        started = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
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
        for bucket in {self.buckets[0], self.buckets[-1]}:
            rows = bucket
            vocab_ids = torch.randint(0, self.vocab_size, (rows,), generator=gen)
            context = torch.randint(1, self.kv_cache.block_size + 1, (rows,), generator=gen)
            self.input_ids[:rows].copy_(vocab_ids)
            self.positions[:rows].copy_(context - 1)
            self.slots[:rows].fill_(-1)
            self.context[:rows].copy_(context.to(torch.int32))
            self.tables[:rows].zero_()
            self.graphs[bucket].replay()
            replayed = self.outputs[bucket].clone()
            direct = self._run_forward(bucket)
            torch.cuda.synchronize(self.device)
            if not torch.allclose(replayed.float(), direct.float(), atol=1e-3, rtol=1e-3):
                diff = (replayed.float() - direct.float()).abs().max().item()
                raise RuntimeError(f"the graph of {bucket} sequences differs by {diff:.3g}")

    def bucket_for(self, layout: BatchLayout) -> int | None:
        """The bucket that runs this step, None when it is not a decode-only step that fits."""
        count = len(layout.query_lens)
        if count == 0 or count > self.max_batch or bool((layout.query_lens != 1).any()):
            return None
        if layout.block_tables.shape[1] > self.max_blocks:
            return None
        return self.buckets[bisect.bisect_left(self.buckets, count)]

    def run(self, layout: BatchLayout, bucket: int) -> torch.Tensor:
        """Stage the step, replay the bucket's graph, and return the hidden states of the
        step's rows (valid until the next replay)."""
        self.stage(layout, bucket)
        self.graphs[bucket].replay()
        return self.outputs[bucket][: len(layout.query_lens)]

    def stage(self, layout: BatchLayout, bucket: int) -> None:
        """Fill the static buffers' first ``bucket`` rows: the step's rows, then pad rows
        (token 0 at position 0, no KV slot, one cached key in block 0)."""
        assert layout.input_ids is not None and layout.positions is not None
        count = len(layout.query_lens)
        width = self.max_blocks
        host = np.zeros((bucket, 4 + width), dtype=np.int64)
        host[:, 2] = -1  # pad rows: no KV written
        host[:, 3] = 1  # pad rows: one cached key (block 0) to attend to
        host[:count, 0] = layout.input_ids
        host[:count, 1] = layout.positions
        host[:count, 2] = layout.slot_mapping
        host[:count, 3] = layout.context_lens
        tables = layout.block_tables
        host[:count, 4 : 4 + tables.shape[1]] = tables
        staged = torch.from_numpy(host).to(self.device, non_blocking=True)
        self.input_ids[:bucket].copy_(staged[:, 0])
        self.positions[:bucket].copy_(staged[:, 1])
        self.slots[:bucket].copy_(staged[:, 2])
        self.context[:bucket].copy_(staged[:, 3])
        self.tables[:bucket].copy_(staged[:, 4:])
