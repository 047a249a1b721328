"""KV memory of one long generation with and without a sliding window, measured.

The embedded model's shape (4 layers, 2 KV heads of 64; ``--dtype``) as a Mistral with
dummy weights, once with ``--window`` keys on every layer and once without, each served
by the native runner on the CPU and driven by the router's own scheduler
(``new_scheduler`` over the shard's ``Info``), one request of ``--prompt`` tokens
generating until ``--length`` positions. Printed per case: the ``kv_window`` the shard
announced, the most KV blocks in use at once (the used-KV gauge) and at the end, their
bytes for this model, the same blocks for Mistral 7B's KV shape (32 layers, 8 KV heads of
128, bfloat16: 2 MiB a block of 16; only the block count is measured there), and the time.

Example::

    .venv/bin/python benchmarks/window_kv_bench.py --length 4096 --window 512
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tgis.embedded_model import MODEL_DIR
from tgis.router.core.batching import SchedulerLimits
from tgis.router.core.request_state import OutputRules, RequestStatus
from tgis.router.core.scheduler import new_scheduler
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.request_types import (
    GenerationParams,
    ResponseOptions,
    SamplingParams,
    StoppingParams,
    ValidatedRequest,
)
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner

MISTRAL_7B_BLOCK_BYTES = 2 * 32 * 8 * 128 * 2 * 16
"""K and V, 32 layers, 8 KV heads of 128, bfloat16, 16 positions."""


def write_config(directory: Path, window: int | None, length: int) -> None:
    """The embedded model's config as a Mistral with ``window`` (None: full attention)."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    config.update(
        architectures=["MistralForCausalLM"],
        model_type="mistral",
        sliding_window=window,
        max_position_embeddings=length,
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))


def run_case(window: int | None, args: argparse.Namespace, rules: OutputRules) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        write_config(Path(tmp), window, args.length)
        runner = load_runner(
            ShardConfig(
                model_name=tmp,
                load_format="dummy",
                dtype=args.dtype,
                max_sequence_length=args.length,
                kv_cache_blocks=args.length // 16 + 8,
            )
        )
    assert isinstance(runner, ModelRunner)
    info = runner.info
    limits = SchedulerLimits(max_batch_size=1, max_batch_prefill_tokens=512)
    scheduler = new_scheduler(limits, info, prefix_caching=False)
    new_tokens = args.length - args.prompt
    stopping = StoppingParams(max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    sampling = SamplingParams()
    request = ValidatedRequest(
        text="",
        input_ids=tuple(range(10, 10 + args.prompt)),
        params=GenerationParams(sampling, stopping, ResponseOptions()),
        stopping=stopping,
        sampling=sampling,
    )
    state = rules.new_state(1, request, 0.0)
    scheduler.add(state)
    most = 0
    start = time.perf_counter()
    while scheduler.has_work:
        step = scheduler.schedule(0.0)
        scheduler.update(step, runner.step(step.plan), 0.0)
        if state.status is RequestStatus.RUNNING:
            most = max(most, scheduler.blocks.num_used)
            last = scheduler.blocks.num_used
    seconds = time.perf_counter() - start
    assert len(state.generated_ids) == new_tokens, state.finish_reason
    block_bytes = runner.kv_cache.spec.bytes_per_block
    return {
        "window": window or 0,
        "kv_window": info.kv_window,
        "peak_blocks": most,
        "last_blocks": last,
        "peak_bytes": most * block_bytes,
        "peak_bytes_mistral_7b": most * MISTRAL_7B_BLOCK_BYTES,
        "released": scheduler.window_released,
        "seconds": seconds,
    }


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096, help="positions at the end")
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--dtype", default="float32", help="the CPU's fastest")
    args = parser.parse_args()
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    rules = OutputRules(tokenizer=tokenizer, eos_token_ids=())
    print(
        f"one request: {args.prompt}-token prompt generating to {args.length} positions, "
        f"blocks of 16, embedded model's shape as Mistral (dummy weights, {args.dtype}, CPU)"
    )
    print("| window | kv_window | peak blocks | end blocks | peak KV | as Mistral 7B | time |")
    print("|---|---|---|---|---|---|---|")
    for window in (args.window, None):
        r = run_case(window, args, rules)
        print(
            f"| {r['window'] or 'none'} | {r['kv_window']} | {r['peak_blocks']} | "
            f"{r['last_blocks']} | {mib(r['peak_bytes'])} | {mib(r['peak_bytes_mistral_7b'])} "
            f"| {r['seconds']:.1f} s |"
        )


if __name__ == "__main__":
    main()
