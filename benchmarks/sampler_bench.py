"""The shard's sampler alone (``tgis/shard/step/sampling.py: sample``): milliseconds per
call for a batch of rows, per decoding configuration, vocabulary size and logit spread.

Logits are random normal times ``--spreads`` (1: flat, the nucleus of top-p is most of the
vocabulary; 4: peaked, as a trained model's usually are). Every row of a call has the same
parameters (seeds differ); the median of ``--calls`` calls after three untimed ones is
reported. Example::

    .venv/bin/python benchmarks/sampler_bench.py --rows 32 --vocabs 4096,128256 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tgis.shard.step.sampling import SamplingBatch, SamplingRow, sample
from tgis.shard_api.messages import SamplingParams

CONFIGS = {
    "greedy": SamplingParams(),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k 50 + top_p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "typical_p 0.9": SamplingParams(temperature=0.8, typical_p=0.9),
    "repetition_penalty 1.2": SamplingParams(repetition_penalty=1.2),
    # OpenAI's and vLLM's (tgis/shard/step/logit_adjustments.py)
    "presence 0.5 + frequency 0.5": SamplingParams(presence_penalty=0.5, frequency_penalty=0.5),
    "logit_bias (10 tokens)": SamplingParams(logit_bias=tuple((t, -5.0) for t in range(10))),
    "min_p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
}


def ms_per_call(logits: torch.Tensor, params: SamplingParams, calls: int) -> float:
    rows = [SamplingRow(params, list(range(200)), 10, seed=i) for i in range(logits.shape[0])]

    def call() -> None:
        sample(logits, SamplingBatch(rows, [2], logits.shape[-1], logits.device))

    for _ in range(3):
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--vocabs", default="4096,128256")
    parser.add_argument("--spreads", default="1,4", help="logit standard deviations (1,4)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1)")
    parser.add_argument("--calls", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocabs = [int(v) for v in args.vocabs.split(",")]
    spreads = [float(s) for s in args.spreads.split(",")]
    print(f"{args.rows} rows, {args.threads} thread(s), torch {torch.__version__}; ms per call")
    print()
    print(
        "| configuration | "
        + " | ".join(f"V={v}, N(0,{s:g})" for v in vocabs for s in spreads)
        + " |"
    )
    print("|---|" + "---:|" * (len(vocabs) * len(spreads)))
    gen = torch.Generator().manual_seed(0)
    logits = {(v, s): torch.randn(args.rows, v, generator=gen) * s for v in vocabs for s in spreads}
    for name, params in CONFIGS.items():
        cells = [
            f"{ms_per_call(logits[v, s], params, args.calls):.2f}" for v in vocabs for s in spreads
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
