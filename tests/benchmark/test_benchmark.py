"""``text-generation-benchmark``: TGI's flags, the Steps it sends, and its tables, measured
on the embedded model's shard served on a real Unix socket (its gRPC service and step
channel, as ``text-generation-server serve`` serves them)."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from tgis import __version__
from tgis.benchmark.cli import DEFAULT_BATCH_SIZES, main
from tgis.benchmark.report import full_report, percentile, summarize, text_plot
from tgis.benchmark.session import BatchResult
from tgis.benchmark.workload import Decoding, RunPlans, load_tokenizer, prompt_ids
from tgis.embedded_model import MODEL_DIR
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.serving.server import ShardServer
from tgis.shard_api.messages import ModelKind, ShardInfo

NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def shard_socket() -> Iterator[str]:
    """The embedded model's shard, served on a short Unix socket path from its own thread."""
    runner = load_runner(ShardConfig(model_name=str(MODEL_DIR), kv_cache_blocks=NUM_BLOCKS))
    directory = Path(tempfile.mkdtemp(prefix="tgis-bench-"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = ShardServer(runner, str(directory / "shard-0"))
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield str(server.socket_path)
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(0), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
        shutil.rmtree(directory, ignore_errors=True)


def table_rows(text: str, title: str) -> dict[tuple[str, int], list[float]]:
    """{(step, batch): numbers} of the markdown table whose header starts with ``title``
    (a blank step cell continues the step above, as TGI's merged cells)."""
    lines = text.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    rows: dict[tuple[str, int], list[float]] = {}
    step = ""
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        step = cells[0] or step
        rows[(step, int(cells[1]))] = [float(c.split()[0]) for c in cells[2:]]
    return rows


def test_flags_are_tgis_names_short_forms_and_defaults() -> None:
    ctx = main.make_context("text-generation-benchmark", ["-t", "gpt2"])
    p = ctx.params
    assert (p["tokenizer_name"], p["revision"], p["batch_size"]) == ("gpt2", "main", ())
    assert (p["sequence_length"], p["decode_length"], p["runs"], p["warmups"]) == (10, 8, 10, 1)
    assert p["master_shard_uds_path"] == "/tmp/text-generation-server-0"
    assert DEFAULT_BATCH_SIZES == (1, 2, 4, 8, 16, 32)
    args = "-t x -b 1 -b 8 -s 5 -d 3 -r 2 -w 0 -m /s --temperature 0.5 --top-k 4 --top-p 0.9 "
    args += "--typical-p 0.8 --repetition-penalty 1.1 --frequency-penalty 0.2 --watermark "
    args += "--do-sample --top-n-tokens 2 --revision r1"
    p = main.make_context("text-generation-benchmark", args.split()).params
    assert p["batch_size"] == (1, 8) and p["master_shard_uds_path"] == "/s"
    assert (p["sequence_length"], p["decode_length"], p["runs"], p["warmups"]) == (5, 3, 2, 0)
    assert (p["watermark"], p["do_sample"], p["top_n_tokens"], p["revision"]) == (
        True,
        True,
        2,
        "r1",
    )
    missing = CliRunner().invoke(main, [])
    assert missing.exit_code == 2 and "--tokenizer-name" in missing.output
    version = CliRunner().invoke(main, ["-V"], prog_name="text-generation-benchmark")
    assert version.exit_code == 0 and version.output == f"text-generation-benchmark {__version__}\n"


def test_sampling_follows_tgis_rule() -> None:
    assert Decoding().sampling().is_greedy
    assert Decoding(temperature=1.0).sampling().is_greedy
    assert not Decoding(top_k=5).sampling().is_greedy
    params = Decoding(do_sample=True, repetition_penalty=1.2).sampling()
    assert (params.temperature, params.seed, params.repetition_penalty) == (1.0, 0, 1.2)
    assert Decoding(top_n_tokens=3).details().top_n == 3


def test_prompt_has_the_asked_length_and_plans_grow_blocks() -> None:
    tokenizer = load_tokenizer(str(MODEL_DIR), None)
    for length in (1, 10, 333):
        assert len(prompt_ids(tokenizer, length)) == length
    info = ShardInfo(ModelKind.CAUSAL_LM, (2,), 1000, 16, 10, 1, 64, "llama", "f32", "cpu", "x")
    plans = RunPlans(info, 2, tuple(range(3, 19)), Decoding())  # 16 tokens: one block each
    prefill = plans.prefill()
    assert [s.new_block_ids for s in prefill.scheduled] == [(0,), (1,)]
    assert (prefill.step_id, prefill.base_step_id, len(prefill.new_sequences)) == (1, 0, 2)
    decode = plans.decode()  # position 16 opens a second block for each
    assert [s.new_block_ids for s in decode.scheduled] == [(2,), (3,)]
    assert [s.new_block_ids for s in plans.decode().scheduled] == [(), ()]
    assert decode.base_step_id == 1 and not decode.new_sequences


def test_statistics_tables_and_plot() -> None:
    assert percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert percentile([1.0, 2.0], 99) == 2.0
    s = summarize([2.0, 4.0, 6.0])
    assert (s.average, s.lowest, s.highest, s.p50) == (4.0, 2.0, 6.0, 4.0)
    result = BatchResult(4, 10, 7, prefill_ms=[20.0, 40.0], decode_ms=[70.0, 140.0])
    text = full_report([("Model", "m")], [result, BatchResult(64, 10, 7, skipped="too big")])
    latency = table_rows(text, "| Step  ")
    assert latency[("Prefill", 4)] == [30.0, 20.0, 40.0, 40.0, 40.0, 40.0]
    assert latency[("Decode (token)", 4)] == [15.0, 10.0, 20.0, 20.0, 20.0, 20.0]
    throughput = table_rows(text.split("| p99")[1], "| Step")
    assert throughput[("Prefill", 4)] == [150.0, 100.0, 200.0]  # 4 sequences / 20-40 ms
    assert throughput[("Prefill (prompt)", 4)] == [1500.0, 1000.0, 2000.0]
    assert throughput[("Decode", 4)] == [300.0, 200.0, 400.0]  # 4 * 7 tokens / 70-140 ms
    assert "Batch size 64 skipped: too big" in text and "0 = batch size 4" in text
    plot = text_plot("P", [("a", 1.0, 1.0), ("b", 3.0, 2.0)], width=10, height=3).split("\n")
    assert plot[1] == "2.00 |         b" and plot[3] == "1.00 |a"


def test_benchmark_against_a_served_shard(
    shard_socket: str, caplog: pytest.LogCaptureFixture
) -> None:
    args = ["-t", str(MODEL_DIR), "-m", shard_socket, "-s", "20", "-d", "4", "-r", "3"]
    args += ["-b", "1", "-b", "3", "-b", "40", "--watermark"]  # 40: 80 blocks, past 48
    with caplog.at_level(logging.WARNING, logger="tgis.benchmark"):
        done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "--watermark is ignored" in caplog.text
    progress = done.stderr
    assert "batch size 1: warmup 0/1" in progress and "batch size 3: run 0/3" in progress
    assert re.search(r"batch size 3: done 3/3, last prefill [\d.]+ ms", progress)
    assert "batch size 40: skipped (batch size 40 needs 80 KV blocks, the shard has 48)" in progress
    out = done.stdout
    assert "| Sequence Length    | 20 " in out and "| Watermark          | True " in out
    latency = table_rows(out, "| Step  ")
    throughput = table_rows(out.split("| p99")[1], "| Step")
    for batch in (1, 3):
        prefill, token, total = (latency[(s, batch)] for s in LATENCIES_NAMES)
        assert 0 < prefill[1] <= prefill[0] <= prefill[2]
        assert token[0] == pytest.approx(total[0] / 3, abs=0.01)  # 3 decode steps
        # the lowest throughput is the highest latency's: batch (x tokens) / latency
        low = throughput[("Prefill", batch)][1]
        assert low == pytest.approx(batch / prefill[2] * 1e3, rel=0.01)
        prompt_low = throughput[("Prefill (prompt)", batch)][1]
        assert prompt_low == pytest.approx(batch * 20 / prefill[2] * 1e3, rel=0.01)
        decode_low = throughput[("Decode", batch)][1]
        assert decode_low == pytest.approx(batch * 3 / total[2] * 1e3, rel=0.01)
    assert ("Prefill", 40) not in latency and "Batch size 40 skipped" in out


LATENCIES_NAMES = ("Prefill", "Decode (token)", "Decode (total)")


def test_missing_socket_and_bad_lengths_are_clear_errors(tmp_path: Path) -> None:
    args = ["-t", str(MODEL_DIR), "-m", str(tmp_path / "none-0"), "-b", "1"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 1 and "no shard socket at" in done.output
    done = CliRunner().invoke(main, [*args, "--decode-length", "1"])
    assert done.exit_code == 2 and "--decode-length" in done.output
