"""What LoRA adapters cost a decode step: the same batch without adapters, with a mix of
adapters and plain rows, and with one adapter for every row.

In process, no server: the shard's ``ModelRunner`` on a Llama-shaped model with random
weights (``--load-format dummy``), and ``--adapters`` random LoRA adapters of rank
``--rank`` on every projection (q/k/v/o and the MLP), written as PEFT saves them into a
temporary adapter cache. For each batch size: ``B`` sequences with ``--context``-token
prompts are prefilled (not timed), then ``--steps`` decode steps of all ``B`` are timed,
the three cases taking turns step after step so that background noise hits them alike.
Reported: median ms per step of each case and its ratio to the batch without adapters.

A step with LoRA rows runs the eager forward (the compiled step and CUDA graphs never see
adapters), so on a host where the compiled step is faster that difference is part of the
cost, as it is when serving. Example::

    .venv/bin/python benchmarks/lora_bench.py --batches 8,32 --json lora.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from step_bench import Plans, parse_ints  # noqa: E402

from tgis.shard.cli import engine_from_environment  # noqa: E402
from tgis.shard.config import ShardConfig  # noqa: E402
from tgis.shard.loader import load_runner  # noqa: E402
from tgis.shard.native.runtime.model_runner import ModelRunner  # noqa: E402

# A small Llama shape that still has real matrix sizes for a CPU.
DEFAULT_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "eos_token_id": 2,
    "bos_token_id": 1,
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CASES = ("plain", "mixed", "one adapter")


def write_adapter(directory: Path, config: dict[str, Any], rank: int, seed: int) -> None:
    """A random LoRA adapter on every projection, in PEFT's file layout."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head_dim
    shapes = {  # (out, in) of each projection
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out, inp) in shapes.items():
            block = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS),
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))


def adapters_of(case: str, batch: int, ids: list[str]) -> dict[int, str]:
    if case == "plain":
        return {}
    if case == "one adapter":
        return dict.fromkeys(range(batch), ids[0])
    # mixed: every adapter and plain rows in turn
    cycle = [*ids, ""]
    return {rid: cycle[rid % len(cycle)] for rid in range(batch)}


def time_batch(
    runners: dict[str, ModelRunner], batch: int, args: argparse.Namespace, ids: list[str]
) -> dict[str, float]:
    plans: dict[str, Plans] = {}
    for case, runner in runners.items():
        runner.reset()
        plans[case] = Plans(runner.info.block_size, runner.info.vocab_size)
        for plan in plans[case].prefill(batch, args.context, 4096, adapters_of(case, batch, ids)):
            runner.step(plan)
        for _ in range(args.warmup):
            runner.step(plans[case].decode())
    walls: dict[str, list[float]] = {case: [] for case in runners}
    for _ in range(args.steps):
        for case, runner in runners.items():
            plan = plans[case].decode()
            started = time.perf_counter()
            runner.step(plan)
            walls[case].append((time.perf_counter() - started) * 1e3)
    return {case: statistics.median(values) for case, values in walls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        type=Path,
        help="directory with config.json (default: a 1024-wide, 8-layer Llama shape)",
    )
    parser.add_argument("--adapters", type=int, default=3, help="LoRA adapters in the mix")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batches", type=parse_ints, default=[8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        config = DEFAULT_CONFIG
        if model_dir is None:
            model_dir = Path(tmp) / "model"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(DEFAULT_CONFIG))
        else:
            config = json.loads((model_dir / "config.json").read_text())
        cache = Path(tmp) / "adapters"
        ids = [f"lora-{i}" for i in range(args.adapters)]
        for i, adapter_id in enumerate(ids):
            write_adapter(cache / adapter_id, config, args.rank, seed=i)
        blocks = max(args.batches) * (-(-(args.context + args.warmup + args.steps + 2) // 16))
        shard_config = ShardConfig(
            model_name=str(model_dir),
            load_format="dummy",
            adapter_cache=str(cache),
            max_loras=max(1, args.adapters),
            kv_cache_blocks=blocks,
            max_sequence_length=args.context + args.warmup + args.steps + 8,
            engine=engine_from_environment(),  # TGIS_LORA_KERNEL, ...
        )
        runner = load_runner(shard_config)
        assert isinstance(runner, ModelRunner)
        for adapter_id in ids:
            runner.lookup_adapter(adapter_id)
        # One runner per case, sharing the model: each keeps its own sequences and cache.
        runners = {"plain": runner}
        for case in CASES[1:]:
            runners[case] = load_runner(shard_config)  # type: ignore[assignment]
            for adapter_id in ids:
                runners[case].lookup_adapter(adapter_id)
        results = []
        print(f"{'batch':>5} {'case':>12} {'ms/step':>9} {'vs plain':>9}")
        for batch in args.batches:
            ms = time_batch(runners, batch, args, ids)
            for case in CASES:
                ratio = ms[case] / ms["plain"]
                print(f"{batch:>5} {case:>12} {ms[case]:>9.2f} {ratio:>9.2f}")
                results.append(
                    {
                        "batch": batch,
                        "case": case,
                        "ms_per_step": round(ms[case], 3),
                        "vs_plain": round(ratio, 3),
                    }
                )
        info = {
            "adapters": args.adapters,
            "rank": args.rank,
            "context": args.context,
            "device": runner.info.device,
            "dtype": runner.info.dtype,
            "results": results,
        }
        if args.json:
            args.json.write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
