"""The benchmark's runs against a shard: per batch size, warm-ups then timed runs, each a
Reset, one prefill Step and ``decode_length - 1`` decode Steps (the prefill samples the first
of the ``decode_length`` tokens, as TGI's ``max_new_tokens``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tgis.benchmark.workload import Decoding, RunPlans, WorkloadError
from tgis.router.core.shard_client import ShardClient
from tgis.shard_api.messages import ShardInfo, StepOutput, StepPlan


@dataclass
class BatchResult:
    """The timings of one batch size: per timed run, the prefill Step's latency and the
    whole decode's (milliseconds, wall time seen by this client)."""

    batch: int
    sequence_length: int
    decode_steps: int
    prefill_ms: list[float] = field(default_factory=list)
    decode_ms: list[float] = field(default_factory=list)
    skipped: str = ""
    """Why this batch size did not run ("" when it did)."""


@dataclass(frozen=True)
class Progress:
    """Where the benchmark is: ``phase`` is "warmup", "run" or "done" (the batch size ends);
    ``done`` of ``total`` runs of that phase have finished."""

    result: BatchResult
    phase: str
    done: int
    total: int


@dataclass(frozen=True)
class Workload:
    prompt: tuple[int, ...]
    decode_length: int
    decoding: Decoding
    runs: int
    warmups: int


class StepError(RuntimeError):
    """A Step came back with sequence errors or without one token per sequence."""


async def _step(client: ShardClient, plan: StepPlan, batch: int) -> StepOutput:
    output = await client.step_result(client.send_step(plan))
    if output.errors:
        raise StepError(f"step {plan.step_id}: {output.errors[0].message}")
    if len(output.tokens) != batch:
        raise StepError(f"step {plan.step_id}: {len(output.tokens)} tokens for {batch} sequences")
    return output


async def one_run(
    client: ShardClient, info: ShardInfo, batch: int, work: Workload
) -> tuple[float, float]:
    """(prefill ms, decode ms) of one run on a freshly Reset shard."""
    await client.reset()
    plans = RunPlans(info, batch, work.prompt, work.decoding)
    started = time.perf_counter()
    await _step(client, plans.prefill(), batch)
    prefilled = time.perf_counter()
    for _ in range(work.decode_length - 1):
        await _step(client, plans.decode(), batch)
    decoded = time.perf_counter()
    return (prefilled - started) * 1e3, (decoded - prefilled) * 1e3


async def run_batch(
    client: ShardClient,
    info: ShardInfo,
    batch: int,
    work: Workload,
    report: Callable[[Progress], None],
) -> BatchResult:
    """Warm-ups, then the timed runs, of one batch size (``skipped`` set, when it cannot run
    on this shard)."""
    result = BatchResult(batch, len(work.prompt), work.decode_length - 1)
    try:
        RunPlans(info, batch, work.prompt, work.decoding).check(work.decode_length)
    except WorkloadError as err:
        result.skipped = str(err)
        report(Progress(result, "done", 0, work.runs))
        return result
    for done in range(work.warmups):
        report(Progress(result, "warmup", done, work.warmups))
        await one_run(client, info, batch, work)
    for done in range(work.runs):
        report(Progress(result, "run", done, work.runs))
        prefill, decode = await one_run(client, info, batch, work)
        result.prefill_ms.append(prefill)
        result.decode_ms.append(decode)
    report(Progress(result, "done", work.runs, work.runs))
    return result


async def run_benchmark(
    uds_path: str,
    batches: Sequence[int],
    work: Workload,
    report: Callable[[Progress], None],
    connect_timeout: float = 60.0,
) -> tuple[ShardInfo, list[BatchResult]]:
    """Connect to the shard at ``uds_path`` and run every batch size in turn; the shard is
    Reset before each run and at the end."""
    client = ShardClient(uds_path)
    try:
        await client.wait_ready(connect_timeout)
        info = await client.info()
        results = [await run_batch(client, info, b, work, report) for b in batches]
        await client.reset()
        return info, results
    finally:
        await client.close()
