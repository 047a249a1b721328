"""The CPU parts of the benchmark scripts run and report figures (not a timing test: the
figures are only checked to exist and be sane). ``step_bench.py`` is what
``benchmarks/gpu_check.sh`` runs on a GPU; here it runs on the embedded model's shape with
dummy weights and with its real weights, and ``lora_bench.py`` on the same shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EMBEDDED = ROOT / "tgis" / "embedded_model" / "data"

pytestmark = pytest.mark.slow


def run_script(script: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("load_format", ["dummy", "auto"])
def test_step_bench_reports_every_case(tmp_path: Path, load_format: str) -> None:
    out = tmp_path / "step.json"
    run_script(
        "step_bench.py",
        "--model", str(EMBEDDED),
        "--load-format", load_format,
        "--batches", "1,4",
        "--contexts", "16,40",
        "--steps", "3",
        "--warmup", "1",
        "--json", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    results = report["results"] if isinstance(report, dict) else report
    cases = {(r["batch"], r["context"]) for r in results}
    assert cases == {(1, 16), (1, 40), (4, 16), (4, 40)}
    for r in results:
        assert r["forward_ms_p50"] > 0 and 0 < r["ms_per_step_p50"] <= r["ms_per_step_p90"]
        assert r["kernels_per_step"] is None  # CPU: no CUDA kernels counted


def test_lora_bench_reports_the_three_cases(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    stdout = run_script(
        "lora_bench.py",
        "--model", str(EMBEDDED),
        "--adapters", "2",
        "--rank", "4",
        "--batches", "3",
        "--context", "8",
        "--steps", "3",
        "--warmup", "1",
        "--json", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert (report["adapters"], report["rank"]) == (2, 4)
    assert [r["case"] for r in report["results"]] == ["plain", "mixed", "one adapter"]
    for r in report["results"]:
        assert r["ms_per_step"] > 0
    assert report["results"][0]["vs_plain"] == 1.0
    assert "one adapter" in stdout


def test_serve_builds_distinct_prompts_of_exact_lengths() -> None:
    """``serve.py --distinct-prompts``: every prompt has exactly its token count and none
    shares its first 16-token KV block with another; without it one text per length."""
    import asyncio
    import importlib.util

    from tokenizers import Tokenizer

    from tgis.pb import generation_pb2 as pb

    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "benchmarks" / "serve.py")
    assert spec is not None and spec.loader is not None
    serve = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = serve  # its dataclasses look their module up
    try:
        spec.loader.exec_module(serve)
    finally:
        del sys.modules[spec.name]
    tokenizer = Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))

    def count(text: str) -> int:
        return len(tokenizer.encode(text).ids)

    class TokenizeOnly:
        """The one RPC the calibration calls, answered by the model's own tokenizer."""

        async def Tokenize(self, request: object, timeout: float) -> object:
            texts = [r.text for r in request.requests]  # type: ignore[attr-defined]
            return pb.BatchedTokenizeResponse(
                responses=[pb.TokenizeResponse(token_count=count(t)) for t in texts]
            )

    wanted = {(f"{i}:", n) for i in range(40) for n in (17, 40)} | {("", 40)}
    prompts = asyncio.run(serve.calibrate_prompts(TokenizeOnly(), "the", wanted))
    assert set(prompts) == wanted
    for (head, n), text in prompts.items():
        assert count(text) == n and text.startswith(head), (head, n, text)
    first_blocks = {tuple(tokenizer.encode(prompts[f"{i}:", 40]).ids[:16]) for i in range(40)}
    assert len(first_blocks) == 40
    assert set(prompts["", 40].split()) == {"the"}


def test_sampler_bench_reports_every_configuration() -> None:
    out = run_script("sampler_bench.py", "--rows", "4", "--vocabs", "300", "--calls", "2")
    rows = [
        line for line in out.splitlines() if line.startswith("| ") and "configuration" not in line
    ]
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "sampler_bench", ROOT / "benchmarks" / "sampler_bench.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert [row.split("|")[1].strip() for row in rows] == list(bench.CONFIGS), out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")][1:]
        assert len(cells) == 2 and all(float(c) > 0 for c in cells), row


def test_quant_bench_reports_every_variant(tmp_path: Path) -> None:
    """Dense, int8 and FP8 (its products forced onto the CPU) at load, and random 4-bit
    GPTQ layers of the embedded model's shape."""
    out = tmp_path / "quant.json"
    stdout = run_script(
        "quant_bench.py",
        "--model", str(EMBEDDED),
        "--variants", "dense,int8,gptq:torch,fp8:torch",
        "--batches", "1,2",
        "--contexts", "16",
        "--steps", "2",
        "--rounds", "1",
        "--json", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert set(report) == {"dense", "int8", "gptq:torch", "fp8:torch"}
    dense = report["dense"]["weight_bytes"]
    assert report["int8"]["weight_bytes"] < dense and report["gptq:torch"]["weight_bytes"] < dense
    linears = report["dense"]["linear_bytes"]
    assert report["gptq:torch"]["linear_bytes"] < report["int8"]["linear_bytes"] < linears
    assert any(k.startswith("int4 (_weight_int4pack") for k in report["gptq:torch"]["kernels"])
    assert report["fp8:torch"]["linear_bytes"] < 0.55 * linears  # one byte a weight
    assert any(k.startswith("fp8 (torch._scaled_mm") for k in report["fp8:torch"]["kernels"])
    for data in report.values():
        assert set(data["cases"]) == {"b1-c16", "b2-c16"}
        assert all(t > 0 for times in data["cases"].values() for t in times)
    assert "speed vs dense" in stdout


def test_quant_kernels_reports_every_row_count() -> None:
    stdout = run_script(
        "quant_kernels.py", "--shapes", "64x256", "--rows", "1,70", "--repeats", "2"
    )
    rows = [line.split() for line in stdout.splitlines()[2:]]
    assert [(r[0], r[2]) for r in rows] == [("4", "1"), ("4", "70"), ("8", "1"), ("8", "70")]
    assert all(float(v) > 0 for r in rows for v in r[3:6])


def test_speculation_bench_reports_both_workloads() -> None:
    """The script ``gpu_check.sh`` runs for speculative decoding, small: one round of each
    server, its table and the two medians."""
    stdout = run_script(
        "speculation_bench.py",
        "--rounds", "1",
        "--repeats", "1",
        "--new-tokens", "16",
        "--concurrency", "2",
        "--speculate", "3",
    )  # fmt: skip
    row = next(line for line in stdout.splitlines() if line.startswith("| 1 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert len(cells) == 9
    assert float(cells[1]) > 0 and float(cells[2]) > 0
    assert cells[4].endswith("%") and float(cells[5]) >= 1.0
    assert "median TPOT ratio" in stdout and "throughput ratio" in stdout


def test_the_seldom_confirmed_model_is_noise_but_its_norms(tmp_path: Path) -> None:
    """``speculation_bench.py --seldom-confirmed``'s model: the embedded model's files, its
    norms kept and every other tensor Gaussian noise of 3x its standard deviation."""
    import importlib.util

    import torch
    from safetensors.torch import load_file

    spec = importlib.util.spec_from_file_location(
        "speculation_bench", ROOT / "benchmarks" / "speculation_bench.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    target = bench.seldom_confirmed_model(EMBEDDED, tmp_path / "model")
    assert sorted(p.name for p in target.iterdir()) == sorted(p.name for p in EMBEDDED.iterdir())
    base, noise = load_file(EMBEDDED / "model.safetensors"), load_file(target / "model.safetensors")
    assert base.keys() == noise.keys()
    for name, tensor in base.items():
        assert noise[name].dtype == tensor.dtype and noise[name].shape == tensor.shape
        if "norm" in name:
            assert torch.equal(noise[name], tensor), name
        else:
            ratio = noise[name].float().std() / tensor.float().std()
            assert 2.7 < ratio < 3.3, (name, ratio)
            pair = torch.stack([noise[name].float().flatten(), tensor.float().flatten()])
            assert abs(torch.corrcoef(pair)[0, 1]) < 0.1, name  # not the weights, scaled


def test_openai_bench_reports_every_api(tmp_path: Path) -> None:
    """The issue 24 and 34 benchmark, small: one round of the three APIs at two stream
    counts, every request's token counts checked by the script (exit 0), the ratios
    printed."""
    out = tmp_path / "openai.json"
    stdout = run_script(
        "openai_bench.py",
        "--concurrency", "1,3",
        "--rounds", "1",
        "--num-requests", "3",
        "--input-tokens", "64",
        "--output-tokens", "6",
        "--word", "a",  # TGI cannot force the length: a prompt whose output meets no EOS
        "--json", str(out),
    )  # fmt: skip
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["api"], r["stats"]["label"]) for r in runs) == [
        ("grpc", "c=1"), ("grpc", "c=3"), ("openai", "c=1"), ("openai", "c=3"),
        ("tgi", "c=1"), ("tgi", "c=3"),
    ]  # fmt: skip
    for run in runs:
        stats = run["stats"]
        assert stats["completed"] == 3 and stats["output_tokens"] == 18
        assert stats["input_tokens"] == 3 * 64 and stats["output_throughput"] > 0
        assert 1 <= run["messages_per_request"] <= 6
        if run["api"] == "tgi":  # one event per token
            assert run["messages_per_request"] == 6
    assert "| c=3 |" in stdout and "OpenAI / gRPC" in stdout and "TGI / gRPC" in stdout
