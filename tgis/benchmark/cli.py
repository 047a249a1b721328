"""``text-generation-benchmark``: TGI's benchmark flags (names, short forms, environment
variables, defaults), a live progress line while it runs, the tables and plots at the end."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any, TextIO

import click

from tgis.benchmark.report import full_report
from tgis.benchmark.session import Progress, StepError, Workload, run_benchmark
from tgis.benchmark.workload import Decoding, WorkloadError, load_tokenizer, prompt_ids
from tgis.log import log_level
from tgis.router.core.shard_client import ShardError
from tgis.settings.options import version_option
from tgis.settings.serving import DEFAULT_UDS_PATH

log = logging.getLogger("tgis.benchmark")

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
IGNORED_FLAGS = {"watermark": "this server has no watermarking"}


class LiveView:
    """One progress line per batch size: rewritten in place on a terminal, one plain line
    per finished batch size (and at its start) otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()

    def __call__(self, p: Progress) -> None:
        r = p.result
        if r.skipped:
            self._write(f"batch size {r.batch}: skipped ({r.skipped})", final=True)
            return
        text = f"batch size {r.batch}: {p.phase} {p.done}/{p.total}"
        if r.prefill_ms:
            text += f", last prefill {r.prefill_ms[-1]:.2f} ms, decode {r.decode_ms[-1]:.2f} ms"
        if p.phase == "done":
            self._write(text, final=True)
        elif self.tty or p.done == 0:
            self._write(text, final=False)

    def _write(self, text: str, final: bool) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def _options(function: Any) -> Any:
    """TGI's flags, in TGI's order."""
    generation = "Generation parameter, to test particular decoding strategies."
    options = [
        click.option("-t", "--tokenizer-name", envvar="TOKENIZER_NAME", required=True,
                     help="The tokenizer: a local directory with tokenizer.json (the model's "
                     "directory), or a model id in the local Hugging Face cache."),
        click.option("--revision", envvar="REVISION", default="main", show_default=True,
                     help="The revision of the tokenizer, for a model id."),
        click.option("-b", "--batch-size", type=click.IntRange(min=1), multiple=True,
                     help="A batch size (virtual users) to benchmark; repeat the flag "
                     "(default: 1, 2, 4, 8, 16, 32)."),
        click.option("-s", "--sequence-length", envvar="SEQUENCE_LENGTH", default=10,
                     type=click.IntRange(min=1), show_default=True,
                     help="Prompt length in tokens."),
        click.option("-d", "--decode-length", envvar="DECODE_LENGTH", default=8,
                     type=click.IntRange(min=2), show_default=True,
                     help="Tokens generated per sequence (the prefill samples the first)."),
        click.option("-r", "--runs", envvar="RUNS", default=10, type=click.IntRange(min=1),
                     show_default=True, help="Timed runs per batch size."),
        click.option("-w", "--warmups", envvar="WARMUPS", default=1,
                     type=click.IntRange(min=0), show_default=True,
                     help="Untimed runs per batch size, before the timed ones."),
        click.option("-m", "--master-shard-uds-path", envvar="MASTER_SHARD_UDS_PATH",
                     default=DEFAULT_UDS_PATH + "-0", show_default=True,
                     help="The socket of the running shard 0 (text-generation-server serve); "
                     "the router is bypassed."),
        click.option("--temperature", envvar="TEMPERATURE", type=float, help=generation),
        click.option("--top-k", envvar="TOP_K", type=int, help=generation),
        click.option("--top-p", envvar="TOP_P", type=float, help=generation),
        click.option("--typical-p", envvar="TYPICAL_P", type=float, help=generation),
        click.option("--repetition-penalty", envvar="REPETITION_PENALTY", type=float,
                     help=generation),
        click.option("--frequency-penalty", envvar="FREQUENCY_PENALTY", type=float,
                     help=generation),
        click.option("--watermark", envvar="WATERMARK", is_flag=True,
                     help="Accepted for TGI's command lines; ignored (no watermarking here)."),
        click.option("--do-sample", envvar="DO_SAMPLE", is_flag=True, help=generation),
        click.option("--top-n-tokens", envvar="TOP_N_TOKENS", type=click.IntRange(min=0),
                     help=generation + " The top-n alternatives of every generated token."),
    ]  # fmt: skip
    for option in reversed(options):
        function = option(function)
    return function


def parameters(options: dict[str, Any], tokenizer_name: str) -> list[tuple[str, object]]:
    """The parameters table's rows (TGI's, with None for flags not given)."""
    o = options
    return [
        ("Model", tokenizer_name),
        ("Sequence Length", o["sequence_length"]),
        ("Decode Length", o["decode_length"]),
        ("Top N Tokens", o["top_n_tokens"]),
        ("N Runs", o["runs"]),
        ("Warmups", o["warmups"]),
        ("Temperature", o["temperature"]),
        ("Top K", o["top_k"]),
        ("Top P", o["top_p"]),
        ("Typical P", o["typical_p"]),
        ("Repetition Penalty", o["repetition_penalty"]),
        ("Frequency Penalty", o["frequency_penalty"]),
        ("Watermark", o["watermark"]),
        ("Do Sample", o["do_sample"]),
    ]


def decoding(options: dict[str, Any]) -> Decoding:
    keys = ("temperature", "top_k", "top_p", "typical_p", "repetition_penalty")
    return Decoding(
        **{k: options[k] for k in keys},
        frequency_penalty=options["frequency_penalty"],
        do_sample=options["do_sample"],
        top_n_tokens=options["top_n_tokens"],
    )


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@_options
@version_option()
def main(**options: Any) -> None:
    """Text Generation Benchmarking tool: prefill and decode latency and throughput per
    batch size, measured on a running shard through its socket (the router bypassed)."""
    logging.basicConfig(level=log_level(), format="%(asctime)s %(levelname)s %(message)s")
    for flag, why in IGNORED_FLAGS.items():
        if options[flag]:
            log.warning("--%s is ignored: %s", flag.replace("_", "-"), why)
    socket = options["master_shard_uds_path"]
    if not Path(socket.removeprefix("unix://")).exists():
        raise click.ClickException(
            f"no shard socket at {socket}: start one (text-generation-server serve MODEL "
            "--uds-path PREFIX serves PREFIX-0) or pass --master-shard-uds-path"
        )
    try:
        tokenizer = load_tokenizer(options["tokenizer_name"], options["revision"])
        work = Workload(
            prompt=prompt_ids(tokenizer, options["sequence_length"]),
            decode_length=options["decode_length"],
            decoding=decoding(options),
            runs=options["runs"],
            warmups=options["warmups"],
        )
        batches = options["batch_size"] or DEFAULT_BATCH_SIZES
        info, results = asyncio.run(run_benchmark(socket, batches, work, LiveView(sys.stderr)))
    except (WorkloadError, ShardError, StepError) as err:
        raise click.ClickException(str(err)) from err
    log.info(
        "shard: %s, %s on %s, attention %s, %d KV blocks of %d tokens",
        info.model_type, info.dtype, info.device, info.attention_backend,
        info.num_blocks, info.block_size,
    )  # fmt: skip
    click.echo(full_report(parameters(options, options["tokenizer_name"]), results), nl=False)
    if all(r.skipped for r in results):
        sys.exit(1)
