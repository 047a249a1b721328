"""In-process step benchmark: the shard's ``ModelRunner`` on decode batches, no server.

For each context length ``C`` (``--contexts``) and batch size ``B`` (``--batches``): ``B``
sequences with ``C``-token prompts are prefilled (in steps of at most ``--prefill-chunk``
tokens, timed as a whole: **prefill tok/s**, the first case's including first-call costs),
then ``--steps`` decode steps of all ``B`` are timed after
``--warmup`` untimed ones. Reported per (B, C):

- **ms per step**: wall time of ``ModelRunner.step`` (the plan's host work, the forward,
  sampling, the device synchronisation), median and p90; and the runner's own
  ``forward_time_ns`` median;
- **kernels per step** (CUDA): device kernels launched by one decode step, from
  ``torch.profiler`` (a CUDA graph replay counts its kernels, not one launch);
- **% of the memory roofline** (CUDA): the bytes a decode step must read at least (every
  weight matrix once, the lm head included, plus every sequence's K and V in every layer)
  divided by the device's copy bandwidth, measured here with a device-to-device copy, as a
  share of the measured step time. 100 % is the physical limit.

The model comes from a directory with a ``config.json``: random weights on the device
(``--load-format dummy``, the default; ``benchmarks/models/`` holds 8B/70B shapes) or the
real safetensors with ``--load-format auto``. The KV cache is sized for the largest (B, C)
exactly (``kv_cache_blocks``), so no warm-up measurement runs. Examples::

    python benchmarks/step_bench.py --model benchmarks/models/llama-3.1-8b \\
        --batches 1,8,32,64 --contexts 512,4096 --json step.json
    .venv/bin/python benchmarks/step_bench.py --model tgis/embedded_model/data \\
        --load-format auto --batches 1,8 --contexts 64 --steps 5      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tgis.shard.checkpoints.model_config import ModelConfig  # noqa: E402
from tgis.shard.cli import engine_from_environment  # noqa: E402
from tgis.shard.config import ShardConfig  # noqa: E402
from tgis.shard.loader import load_runner  # noqa: E402
from tgis.shard.native.models import model_class  # noqa: E402
from tgis.shard.native.runtime.model_runner import ModelRunner  # noqa: E402
from tgis.shard_api.messages import NewSequence, ScheduledSequence, StepPlan  # noqa: E402


@dataclass
class Result:
    batch: int
    context: int
    ms_per_step_p50: float
    ms_per_step_p90: float
    forward_ms_p50: float
    tokens_per_s: float
    kernels_per_step: int | None
    min_bytes_per_step: int
    roofline_ms: float | None
    roofline_pct: float | None
    prefill_tokens_per_s: float


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes per second a device-to-device copy moves (read + write), None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    reps = 10
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / reps
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / seconds


def weight_bytes_read(model_dir: Path, dtype: torch.dtype, max_seq: int) -> int:
    """Bytes of the weights a decode step reads at least: every tensor but the input
    embedding table (only B rows of it are read), unless the lm head is that table."""
    config = ModelConfig.from_dir(model_dir)
    shapes = model_class(config).checkpoint_shapes(config, max_seq)
    elem = torch.empty((), dtype=dtype).element_size()
    tied = not any(name.startswith("lm_head") for name in shapes)
    total = 0
    for name, shape in shapes.items():
        if "embed" in name and not tied:
            continue
        total += math.prod(shape) * elem
    return total


class Plans:
    """Step plans for the benchmark: fresh sequences with consecutive blocks."""

    def __init__(self, block_size: int, vocab_size: int) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.next_block = 0
        self.next_step = 1
        self.lengths: dict[int, int] = {}

    def _blocks(self, count: int) -> tuple[int, ...]:
        ids = tuple(range(self.next_block, self.next_block + count))
        self.next_block += count
        return ids

    def _plan(self, new: list[NewSequence], scheduled: list[ScheduledSequence]) -> StepPlan:
        plan = StepPlan(
            step_id=self.next_step,
            new_sequences=tuple(new),
            scheduled=tuple(scheduled),
            base_step_id=self.next_step - 1,
        )
        self.next_step += 1
        return plan

    def prefill(
        self, batch: int, context: int, chunk: int, adapters: dict[int, str] | None = None
    ) -> list[StepPlan]:
        """Steps prefilling ``batch`` prompts of ``context`` tokens, ``chunk`` at most each
        (sequence ``rid`` with LoRA adapter ``adapters[rid]`` where given)."""
        gen = torch.Generator().manual_seed(batch * 100_003 + context)
        prompts = {
            rid: torch.randint(3, self.vocab_size, (context,), generator=gen).tolist()
            for rid in range(batch)
        }
        done = dict.fromkeys(prompts, 0)
        plans: list[StepPlan] = []
        while any(done[r] < context for r in prompts):
            budget = chunk
            new: list[NewSequence] = []
            scheduled: list[ScheduledSequence] = []
            for rid, ids in prompts.items():
                if budget == 0 or done[rid] == context:
                    continue
                num = min(budget, context - done[rid])
                if done[rid] == 0:
                    adapter = (adapters or {}).get(rid, "")
                    new.append(NewSequence(rid, tuple(ids), adapter_id=adapter))
                before = -(-done[rid] // self.block_size)
                after = -(-(done[rid] + num) // self.block_size)
                scheduled.append(ScheduledSequence(rid, num, self._blocks(after - before)))
                done[rid] += num
                budget -= num
            plans.append(self._plan(new, scheduled))
        self.lengths = {rid: context + 1 for rid in prompts}  # prompt + the sampled token
        return plans

    def decode(self) -> StepPlan:
        """One token more for every sequence (a new block where one is crossed)."""
        scheduled = []
        for rid, length in self.lengths.items():
            grows = -(-length // self.block_size) - -(-(length - 1) // self.block_size)
            scheduled.append(ScheduledSequence(rid, 1, self._blocks(grows)))
            self.lengths[rid] = length + 1
        return self._plan([], scheduled)


def count_kernels(runner: ModelRunner, plan: StepPlan) -> int | None:
    """CUDA kernels one step launches (None on CPU)."""
    if runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.step(plan)
        torch.cuda.synchronize(runner.device)
    kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels += 1
    return kernels


def run_case(
    runner: ModelRunner,
    batch: int,
    context: int,
    args: argparse.Namespace,
    weights: int,
    kv_bytes_per_token: int,
    bandwidth: float | None,
) -> Result:
    runner.reset()
    plans = Plans(runner.info.block_size, runner.info.vocab_size)
    prefill_started = time.perf_counter()
    for plan in plans.prefill(batch, context, args.prefill_chunk):
        runner.step(plan)
    prefill_s = time.perf_counter() - prefill_started
    for _ in range(args.warmup):
        runner.step(plans.decode())
    walls: list[float] = []
    forwards: list[float] = []
    for _ in range(args.steps):
        plan = plans.decode()
        started = time.perf_counter()
        output = runner.step(plan)
        walls.append((time.perf_counter() - started) * 1e3)
        forwards.append(output.forward_time_ns / 1e6)
    kernels = count_kernels(runner, plans.decode())
    p50 = statistics.median(walls)
    p90 = sorted(walls)[max(0, math.ceil(0.9 * len(walls)) - 1)]
    mean_context = context + args.warmup + args.steps / 2
    needed = weights + int(batch * mean_context * kv_bytes_per_token)
    roofline_ms = needed / bandwidth * 1e3 if bandwidth else None
    return Result(
        batch=batch,
        context=context,
        ms_per_step_p50=round(p50, 3),
        ms_per_step_p90=round(p90, 3),
        forward_ms_p50=round(statistics.median(forwards), 3),
        tokens_per_s=round(batch / p50 * 1e3, 1),
        kernels_per_step=kernels,
        min_bytes_per_step=needed,
        roofline_ms=None if roofline_ms is None else round(roofline_ms, 3),
        roofline_pct=None if roofline_ms is None else round(100 * roofline_ms / p50, 1),
        prefill_tokens_per_s=round(batch * context / prefill_s, 1),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="directory with config.json")
    parser.add_argument("--load-format", default="dummy", choices=("dummy", "auto"))
    parser.add_argument("--dtype", default=None, help="float32/float16/bfloat16")
    parser.add_argument("--batches", type=parse_ints, default=[1, 8, 32, 64])
    parser.add_argument("--contexts", type=parse_ints, default=[512, 4096])
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per case")
    parser.add_argument("--warmup", type=int, default=3, help="untimed decode steps per case")
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    max_seq = max(args.contexts) + args.warmup + args.steps + 2
    block_size = 16
    per_seq = -(-max_seq // block_size) + 1
    config = ShardConfig(
        model_name=args.model,
        dtype=args.dtype,
        load_format=args.load_format,
        max_sequence_length=max_seq,
        max_batch_prefill_tokens=args.prefill_chunk,
        kv_cache_blocks=max(args.batches) * per_seq,
        engine=engine_from_environment(),  # TGIS_COMPILE, TGIS_ATTENTION_BACKEND, ...
    )
    started = time.perf_counter()
    runner = load_runner(config)
    load_seconds = time.perf_counter() - started
    assert isinstance(runner, ModelRunner), "the native engine is needed"
    spec = runner.kv_cache.spec
    dtype = spec.dtype
    weights = weight_bytes_read(Path(args.model), dtype, max_seq)
    kv_per_token = spec.bytes_per_block // spec.block_size
    bandwidth = copy_bandwidth(runner.device)
    results = [
        run_case(runner, b, c, args, weights, kv_per_token, bandwidth)
        for c in args.contexts
        for b in args.batches
    ]
    device = (
        torch.cuda.get_device_name(runner.device)
        if runner.device.type == "cuda"
        else f"CPU ({platform.processor() or platform.machine()})"
    )
    env: dict[str, Any] = {
        "model": args.model,
        "load_format": args.load_format,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "attention_backend": runner.attention.name,
        "compiled": type(runner.forward).__name__ != "method",
        "load_seconds": round(load_seconds, 2),
        "copy_bandwidth_gb_s": None if bandwidth is None else round(bandwidth / 1e9, 1),
        "weight_bytes_per_step": weights,
        "torch": torch.__version__,
    }
    print("\n".join(f"- **{k}**: {v}" for k, v in env.items()))
    print()
    print(
        "| B | context | ms/step p50 | p90 | forward ms | tok/s | kernels | roofline ms | % "
        "| prefill tok/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r.batch} | {r.context} | {r.ms_per_step_p50} | {r.ms_per_step_p90} | "
            f"{r.forward_ms_p50} | {r.tokens_per_s} | {r.kernels_per_step} | "
            f"{r.roofline_ms} | {r.roofline_pct} | {r.prefill_tokens_per_s} |"
        )
    if args.json:
        args.json.write_text(
            json.dumps({"environment": env, "results": [asdict(r) for r in results]}, indent=2)
        )


if __name__ == "__main__":
    main()
