"""The native engine's runner: owns the model, the paged KV cache, the block tables and
every sequence's state.

``ModelRunner`` runs the step algorithm of ``step.runner.SequenceRunner``; its part
(``_compute``): the scheduled sequences' next tokens are flattened into one varlen batch
(ids, absolute positions, KV slots) and the model runs once; logits are taken at the last
computed position of every sequence whose known tokens are now all computed, and one token
is sampled for each (sequences mid-prompt get none); sequences that asked for input-token
details also get logits at their prompt positions. A step that raises changes nothing but
the forgetting of finished sequences and the preemptions (applied first).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from tgis.shard.adapters.lora_layout import LoraWeights
from tgis.shard.adapters.prefixes import NO_PREFIXES, Prefixes
from tgis.shard.adapters.request_adapters import NO_ADAPTERS, Adapters
from tgis.shard.cpu_threads import StepTiming, busy_host_seconds, cpu_threads
from tgis.shard.native.attention.block_tables import BlockTables, flatten
from tgis.shard.native.attention.interface import AttentionBackend, BatchLayout
from tgis.shard.native.attention.kv_cache import KVCache
from tgis.shard.native.graphs.compiled import CompiledForward
from tgis.shard.native.linear.lora_rows import LoraRows, lora_rows
from tgis.shard.native.linear.lora_rows import lora_kernel as choose_lora_kernel
from tgis.shard.native.models import CausalLM, ForwardFn
from tgis.shard.native.models.decoder import EmbeddingRows
from tgis.shard.native.models.recurrent_state import RecurrentStates, StateStep
from tgis.shard.native.runtime.prefix_rows import embedding_rows
from tgis.shard.native.speculation.draft_model import Drafter, draft_computed_after
from tgis.shard.step.guided import PendingMasks
from tgis.shard.step.plan import PlanLimits, ResolvedStep, WorkItem
from tgis.shard.step.results import sample_tokens, start_masks
from tgis.shard.step.runner import Computed, SequenceRunner
from tgis.shard.step.sequence import Sequence
from tgis.shard.step.speculation import verify_drafts
from tgis.shard.step.token_details import first_input_detail, token_details
from tgis.shard_api.messages import (
    InputTokenDetails,
    NewSequence,
    ScheduledSequence,
    SequenceError,
    ShardInfo,
    StepPlan,
    TokenDetail,
)

if TYPE_CHECKING:
    from tgis.shard.native.graphs.cuda_graphs import DecodeGraphs

# Prompt positions whose logits are materialised at once for input-token details.
INPUT_DETAIL_ROWS = 256


@dataclass(frozen=True)
class _FlatBatch:
    """The flattened inputs of one step and where each sequence's rows are."""

    layout: BatchLayout
    # Prompt-tuning prefixes' virtual tokens computed this step (None: none).
    prefix_rows: EmbeddingRows | None
    # LoRA adapters of the step and their rows (None: none).
    lora_rows: LoraRows | None
    sample_rows: torch.Tensor  # [sampling items] last row of each, in work order
    sample_items: tuple[WorkItem, ...]
    # Speculative decoding: the 1 + k rows of each drafted item, and those items.
    draft_rows: torch.Tensor
    draft_items: tuple[WorkItem, ...]
    # Input-token details: (item, first row, number of rows) per asking sequence.
    detail_spans: tuple[tuple[WorkItem, int, int], ...]
    # The sequences' recurrent-state slots (a model with Mamba layers; None: none).
    state: StateStep | None = None


class ModelRunner(SequenceRunner):
    """Executes StepPlans against one model replica (one rank)."""

    def __init__(  # noqa: PLR0913 - the runner's parts, each optional but the first five
        self,
        model: CausalLM,
        kv_cache: KVCache,
        attention: AttentionBackend,
        info: ShardInfo,
        device: torch.device,
        forward: ForwardFn | None = None,
        prefixes: Prefixes | None = None,
        adapters: Adapters | None = None,
        states: RecurrentStates | None = None,
    ) -> None:
        self.model = model
        # The recurrent-state slots of a model with Mamba layers (recurrent_state.py).
        self.states = states
        self.prefixes = prefixes or NO_PREFIXES
        self.adapters = adapters or NO_ADAPTERS
        # Which computes LoRA deltas (TGIS_LORA_KERNEL; lora_rows.lora_kernel): auto's
        # choice until the loader sets the configured one (use_lora_kernel).
        self.lora_kernel = "torch"
        # The model's forward: eager (the reference), or compiled.CompiledForward.
        self.forward: ForwardFn = forward or model.forward
        # Steps replayed from CUDA graphs (cuda_graphs.py; set by the loader): the decode
        # steps' graphs first, then the verify steps' (speculative decoding) if any.
        self.graph_sets: tuple[DecodeGraphs, ...] = ()
        # Speculative decoding's draft model or MLP speculator (speculation/; attach_draft).
        self.draft: Drafter | None = None
        self.kv_cache = kv_cache
        self.attention = attention
        self.info = info
        self.device = device
        self.use_lora_kernel("auto")
        self.sequences: dict[int, Sequence] = {}
        self.dropped: set[int] = set()
        self.block_tables = BlockTables()
        self.threads = cpu_threads(info.world_size) if device.type == "cpu" else None
        self.limits = PlanLimits(
            vocab_size=info.vocab_size,
            num_blocks=kv_cache.num_blocks,
            block_size=kv_cache.block_size,
            device=device,
            prefix_caching=info.prefix_caching,
            speculation=states is None,
            state_slots=0 if states is None else states.num_slots,
        )

    def reset(self) -> None:
        super().reset()
        self.block_tables.clear()

    def use_lora_kernel(self, choice: str) -> None:
        """Compute LoRA deltas with ``choice``'s kernel (``TGIS_LORA_KERNEL``; ValueError for
        an unknown one); without adapters there is nothing to compute."""
        if self.adapters.enabled:
            self.lora_kernel = choose_lora_kernel(self.device, choice)

    def warm_up(self) -> None:
        """Run a prompt and a decode step through the forward (compiling it, if it is
        compiled), with adapters enabled a decode step with LoRA rows too (the compiled
        forward's LoRA graph), and forget them."""
        prompt = tuple(range(3, 3 + min(4, max(1, self.kv_cache.block_size - 2))))
        slot = self._own_slot
        first = ScheduledSequence(1, len(prompt), (0,), state_slot=slot)
        self.step(StepPlan(1, (NewSequence(1, prompt),), (first,)))
        self.step(StepPlan(2, (), (ScheduledSequence(1, 1, state_slot=slot),)))
        if self.adapters.enabled and isinstance(self.forward, CompiledForward):
            self.sequences[1].lora = LoraWeights("warm-up", {}, 0)  # targets no site
            self.step(StepPlan(3, (), (ScheduledSequence(1, 1, state_slot=slot),)))
        self.reset()

    def calibrate_cpu_threads(self) -> StepTiming | None:
        """On the CPU, measure this model's step cost for the thread policy
        (``cpu_threads.py``) and return it; None where there is no choice to make."""
        if self.threads is None or self.threads.small == self.threads.large:
            return None
        timing = self._measure_step_timing()
        self.threads = self.threads.calibrated(timing)
        return timing

    def _measure_step_timing(self) -> StepTiming:
        """Time, on the reduced thread count, a prompt of up to 32 tokens (as many as two
        blocks of the cache hold) and a one-token decode after it (each the faster of two
        runs, the first also warming up), and forget them."""
        assert self.threads is not None
        blocks = tuple(range(min(2, self.kv_cache.num_blocks)))
        length = min(32, len(blocks) * self.kv_cache.block_size - 1)
        prompt = tuple(3 + i % 64 for i in range(length))
        torch.set_num_threads(self.threads.small)
        saved, self.threads = self.threads, None  # no switching while measuring
        prompt_s, decode_s = float("inf"), float("inf")
        try:
            for attempt in range(2):
                first = 1 + 2 * attempt
                prompt_plan = StepPlan(
                    first,
                    (NewSequence(first, prompt),),
                    (ScheduledSequence(first, length, blocks, state_slot=self._own_slot),),
                )
                prompt_s = min(prompt_s, self._timed_step(prompt_plan, saved.small))
                decode = ScheduledSequence(first, 1, state_slot=self._own_slot)
                decode_plan = StepPlan(first + 1, (), (decode,))
                decode_s = min(decode_s, self._timed_step(decode_plan, saved.small))
                self.reset()
        finally:
            self.threads = saved
        return StepTiming.from_two_steps(decode_s, length, prompt_s)

    @property
    def _own_slot(self) -> int | None:
        """The state slot of the runner's own steps (warm-up, calibration), if the model
        has slots."""
        return None if self.states is None else 0

    def _timed_step(self, plan: StepPlan, threads: int) -> float:
        """Run ``plan``; its seconds on ``threads`` threads, not counting the time other
        processes held the cores (``busy_host_seconds``)."""
        wall, cpu = time.perf_counter(), time.process_time()
        self.step(plan)
        return busy_host_seconds(time.perf_counter() - wall, time.process_time() - cpu, threads)

    def _forget(self, request_id: int) -> None:
        super()._forget(request_id)
        self.block_tables.release(request_id)

    def _compute(self, resolved: ResolvedStep) -> Computed:
        """Flatten the work into one varlen batch, run the model once (the guided rows'
        masks are filled meanwhile), sample the rows whose sequence gets a token and score
        the prompt positions asked for."""
        if self.threads is not None:
            tokens = sum(item.num_tokens for item in resolved.work)
            rows = sum(1 for item in resolved.work if item.samples)
            wanted = self.threads.for_step(tokens, rows)
            if torch.get_num_threads() != wanted:
                torch.set_num_threads(wanted)
        try:
            work = resolved.work
            if self.draft is not None:  # items asking for drafts get them first
                work = self.draft.draft(work, self.block_tables)
            batch = self._flatten(work)
            masks = start_masks(batch.sample_items, self.grammars, self.device)
            hidden = self._hidden_states(
                batch.layout, batch.prefix_rows, batch.lora_rows, batch.state
            )
            sampled, errors = self._sample(hidden, batch, masks)
            accepted = self._verify(hidden, batch, sampled, errors)
            if self.draft is not None:  # an MLP speculator drafts from these rows
                starts = batch.layout.query_starts.tolist()
                self.draft.observe(work, starts, hidden, sampled, accepted)
            input_details = self._input_details(hidden, batch, work)
            if batch.state is not None:  # the step succeeded: its new states count
                batch.state.commit()
        except BaseException:
            for seq in resolved.new:  # never registered: give their rows back
                self.block_tables.release(seq.request_id)
            raise
        drafted = work if work is not resolved.work else ()
        return Computed(sampled, input_details, errors, accepted, drafted)

    def attach_draft(self, draft: Drafter) -> None:
        """Draft with ``draft`` when a step asks (``ScheduledSequence.spec_tokens``). Its
        cache shares the target's block tables and catches up from any position, so no
        block may be given back early (``kv_window`` 0)."""
        self.draft = draft
        self.limits = replace(self.limits, draft_model=True)
        self.info = replace(self.info, draft_model=True, kv_window=0)

    def _commit(self, resolved: ResolvedStep, computed: Computed) -> tuple[InputTokenDetails, ...]:
        """The step's commit, then each drafted sequence's valid draft-cache positions."""
        completed = super()._commit(resolved, computed)
        for item in computed.work:
            if item.spec_tokens and item.seq.request_id in computed.sampled:
                confirmed = len(computed.accepted.get(item.seq.request_id, ()))
                item.seq.draft_computed = draft_computed_after(item, confirmed)
        return completed

    def _hidden_states(
        self,
        layout: BatchLayout,
        prefix_rows: EmbeddingRows | None,
        lora: LoraRows | None,
        state: StateStep | None = None,
    ) -> torch.Tensor:
        """The forward pass of the step: a decode or verify step that fits a captured bucket
        replays its CUDA graph (``cuda_graphs.py``), a step computing prefix rows runs the
        eager forward (the only one that takes them), as does a step using LoRA adapters
        unless the forward is compiled (its LoRA graph, ``compiled_lora.py``), any other
        step runs ``self.forward``; a model with recurrent state always runs its eager
        forward, with the step's ``state``."""
        if state is not None:
            input_ids, positions, slot_mapping = layout.to_device(self.device)
            metadata = self.attention.prepare(layout, self.device, slot_mapping)
            stateful: Any = self.model
            return stateful.forward(
                input_ids, positions, self.kv_cache, metadata, prefix_rows, lora, state=state
            )
        plain = prefix_rows is None and lora is None  # CUDA graphs hold neither
        for graphs in self.graph_sets if plain else ():
            bucket = graphs.bucket_for(layout)
            if bucket is not None:
                return graphs.run(layout, bucket)
        input_ids, positions, slot_mapping = layout.to_device(self.device)
        metadata = self.attention.prepare(layout, self.device, slot_mapping)
        if plain:
            return self.forward(input_ids, positions, self.kv_cache, metadata)
        if prefix_rows is None and isinstance(self.forward, CompiledForward):
            return self.forward(input_ids, positions, self.kv_cache, metadata, lora)
        return self.model.forward(input_ids, positions, self.kv_cache, metadata, prefix_rows, lora)

    def _flatten(self, work: SequenceOf[WorkItem]) -> _FlatBatch:
        layout = flatten(work, self.block_tables, self.kv_cache.block_size)
        sample_rows: list[int] = []
        sample_items: list[WorkItem] = []
        draft_rows: list[int] = []
        draft_items: list[WorkItem] = []
        detail_spans: list[tuple[WorkItem, int, int]] = []
        query_starts = layout.query_starts.tolist()
        for item, row in zip(work, query_starts, strict=True):
            if item.drafts:
                draft_rows.extend(range(row, row + item.num_tokens))
                draft_items.append(item)
            elif item.samples:
                sample_rows.append(row + item.num_tokens - 1)
                sample_items.append(item)
            if item.prompt_details:
                # Position p's logits score prompt token p + 1.
                last_scored = min(item.end, item.seq.prompt_len - 1)
                if item.start < last_scored:
                    detail_spans.append((item, row, last_scored - item.start))
        return _FlatBatch(
            layout=layout,
            prefix_rows=embedding_rows(work, query_starts),
            lora_rows=lora_rows(work, query_starts, self.device, self.lora_kernel),
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
            sample_items=tuple(sample_items),
            draft_rows=torch.tensor(draft_rows, dtype=torch.long, device=self.device),
            draft_items=tuple(draft_items),
            detail_spans=tuple(detail_spans),
            state=self._state_step(work, layout),
        )

    def _state_step(self, work: SequenceOf[WorkItem], layout: BatchLayout) -> StateStep | None:
        """The step's sequences with their state slots, for a model with recurrent state."""
        if self.states is None:
            return None
        slots = [item.state_slot for item in work]
        assert None not in slots  # resolve_plan checked every scheduled sequence has one
        return StateStep.build(
            self.states,
            layout.query_starts.tolist(),
            layout.query_lens.tolist(),
            slots,  # type: ignore[arg-type]
            [item.start for item in work],
        )

    def _sample(
        self, hidden: torch.Tensor, batch: _FlatBatch, masks: PendingMasks | None
    ) -> tuple[dict[int, TokenDetail], list[SequenceError]]:
        if not batch.sample_items:
            return {}, []
        logits = self.model.compute_logits(hidden[batch.sample_rows])
        return sample_tokens(
            logits, batch.sample_items, self.info, lambda seq: seq.token_ids, masks
        )

    def _verify(
        self,
        hidden: torch.Tensor,
        batch: _FlatBatch,
        sampled: dict[int, TokenDetail],
        errors: list[SequenceError],
    ) -> dict[int, list[TokenDetail]]:
        """Sample the drafted items' rows (``step/speculation.py``): each one's first token
        joins ``sampled``, its failures ``errors``; returns the confirmed tokens after it."""
        if not batch.draft_items:
            return {}
        logits = self.model.compute_logits(hidden[batch.draft_rows])
        verified, failed = verify_drafts(logits, batch.draft_items, self.info)
        errors.extend(failed)
        accepted: dict[int, list[TokenDetail]] = {}
        for rid, tokens in verified.items():
            sampled[rid] = tokens[0]
            accepted[rid] = tokens[1:]
        return accepted

    def _input_details(
        self, hidden: torch.Tensor, batch: _FlatBatch, work: SequenceOf[WorkItem]
    ) -> dict[int, list[TokenDetail]]:
        """Details of the prompt positions computed this step, for sequences that asked;
        the first prompt token (no logits score it) gets a NaN/zero entry."""
        result: dict[int, list[TokenDetail]] = {}
        for item in work:
            if item.start == 0 and item.prompt_details:
                detail = first_input_detail(item.seq.token_ids[0], item.seq.details)
                result[item.seq.request_id] = [detail]
        for item, row, count in batch.detail_spans:
            seq = item.seq
            details: list[TokenDetail] = []
            # Bounded pieces: a long prompt times a large vocabulary would not fit at once.
            for offset in range(0, count, INPUT_DETAIL_ROWS):
                n = min(INPUT_DETAIL_ROWS, count - offset)
                logits = self.model.compute_logits(hidden[row + offset : row + offset + n])
                first = item.start + offset + 1  # position p's logits score token p + 1
                targets = torch.tensor(
                    seq.token_ids[first : first + n], dtype=torch.long, device=self.device
                )
                details += token_details(logits, targets, [seq.details] * n)
            result.setdefault(seq.request_id, []).extend(details)
        return result
