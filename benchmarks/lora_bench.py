"""What LoRA adapters cost a decode step: the same batch without adapters, with a mix of
adapters and plain rows, and with one adapter for every row.

In process, no server: the shard's ``ModelRunner`` on a Llama-shaped model with random
weights (``--load-format dummy``), and ``--adapters`` random LoRA adapters of rank
``--rank`` on every projection (q/k/v/o and the MLP), written as PEFT saves them into a
temporary adapter cache. For each batch size: ``B`` sequences with ``--context``-token
prompts are prefilled (not timed), then ``--steps`` decode steps of all ``B`` are timed,
the three cases taking turns step after step so that background noise hits them alike.
Reported: median ms per step of each case and its ratio to the batch without adapters.

``--forwards eager,compiled`` runs every case (``--cases``) with the eager forward and with
the compiled one (``TGIS_COMPILE=1``; steps with LoRA rows run its LoRA graph,
``graphs/compiled_lora.py``), all taking turns, and adds each compiled case's ratio to the
same case eager. Otherwise the forward is ``TGIS_COMPILE``'s, as when serving. CUDA graphs
never replay steps with LoRA rows. Examples::

    .venv/bin/python benchmarks/lora_bench.py --batches 8,32 --json lora.json
    .venv/bin/python benchmarks/lora_bench.py --batches 8 --adapters 2 --cases plain,mixed \
        --forwards eager,compiled
"""

from __future__ import annotations

import argparse
import dataclasses
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


def adapters_of(case: str, batch: int, ids: list[str], plain_rows: int = 1) -> dict[int, str]:
    if case == "plain":
        return {}
    if case == "one adapter":
        return dict.fromkeys(range(batch), ids[0])
    # mixed: every adapter, then ``plain_rows`` rows without one, in turn
    cycle = [*ids, *[""] * plain_rows]
    return {rid: cycle[rid % len(cycle)] for rid in range(batch)}


def time_batch(
    runners: dict[tuple[str, str], ModelRunner],
    batch: int,
    args: argparse.Namespace,
    ids: list[str],
) -> dict[tuple[str, str], float]:
    """Median ms per decode step of each (case, forward), taking turns step after step."""
    plans: dict[tuple[str, str], Plans] = {}
    for case, runner in runners.items():
        runner.reset()
        plans[case] = Plans(runner.info.block_size, runner.info.vocab_size)
        adapters = adapters_of(case[0], batch, ids, args.mix_plain)
        for plan in plans[case].prefill(batch, args.context, 4096, adapters):
            runner.step(plan)
        for _ in range(args.warmup):
            runner.step(plans[case].decode())
    walls: dict[tuple[str, str], list[float]] = {case: [] for case in runners}
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
    parser.add_argument(
        "--mix-plain", type=int, default=1, help="rows without an adapter per cycle of the mix"
    )
    parser.add_argument("--batches", type=parse_ints, default=[8, 32])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}"
    )
    parser.add_argument(
        "--forwards",
        default="",
        help="comma-separated, of: eager, compiled (default: TGIS_COMPILE's choice)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cases = [c for c in CASES if c in args.cases.split(",")]
    if "plain" not in cases:
        parser.error("--cases must include plain (the ratios' reference)")
    forwards = [f for f in args.forwards.split(",") if f] or ["default"]
    if not set(forwards) <= {"eager", "compiled", "default"}:
        parser.error("--forwards takes eager and/or compiled")
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
        engine = engine_from_environment()  # TGIS_LORA_KERNEL, ...
        shard_config = ShardConfig(
            model_name=str(model_dir),
            load_format="dummy",
            adapter_cache=str(cache),
            max_loras=max(1, args.adapters),
            kv_cache_blocks=blocks,
            max_sequence_length=args.context + args.warmup + args.steps + 8,
            engine=engine,
        )
        switch = {"eager": "0", "compiled": "1", "default": engine.compile}
        # One runner per case and forward, each with its own random weights, sequences
        # and cache (the timing does not depend on the weights' values).
        runners: dict[tuple[str, str], ModelRunner] = {}
        for forward in forwards:
            forward_config = dataclasses.replace(
                shard_config, engine=dataclasses.replace(engine, compile=switch[forward])
            )
            for case in cases:
                runner = load_runner(forward_config)
                assert isinstance(runner, ModelRunner)
                for adapter_id in ids:
                    runner.lookup_adapter(adapter_id)
                runners[case, forward] = runner
        results = []
        header = ("batch", "case", "forward", "ms/step", "vs plain", "vs eager")
        print(" ".join(f"{h:>{w}}" for h, w in zip(header, (5, 12, 9, 9, 9, 9), strict=True)))
        for batch in args.batches:
            ms = time_batch(runners, batch, args, ids)
            for case, forward in runners:
                ratio = ms[case, forward] / ms["plain", forward]
                eager = ms.get((case, "eager"))
                vs_eager = ms[case, forward] / eager if eager and forward != "eager" else None
                shown = "" if vs_eager is None else f"{vs_eager:.2f}"
                print(
                    f"{batch:>5} {case:>12} {forward:>9} {ms[case, forward]:>9.2f}"
                    f" {ratio:>9.2f} {shown:>9}"
                )
                results.append(
                    {
                        "batch": batch,
                        "case": case,
                        "forward": forward,
                        "ms_per_step": round(ms[case, forward], 3),
                        "vs_plain": round(ratio, 3),
                        "vs_eager": None if vs_eager is None else round(vs_eager, 3),
                    }
                )
        info = {
            "adapters": args.adapters,
            "rank": args.rank,
            "mix_plain": args.mix_plain,
            "context": args.context,
            "device": runner.info.device,
            "dtype": runner.info.dtype,
            "results": results,
        }
        if args.json:
            args.json.write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
