"""The benchmark's results as TGI's tool prints them (markdown tables of the parameters,
the latencies and the throughputs, per batch size) and a text plot of latency against
throughput.

Definitions (TGI's): **Prefill** latency is the prefill Step's; its throughput counts one
token per sequence (``batch / latency``: the first tokens). **Decode (total)** is the time of
all decode Steps of a run, **Decode (token)** that divided by their number, and decode
throughput ``batch * decode steps / total``. Added here: **Prefill (prompt)**, the prompt
tokens the prefill read per second (``batch * sequence length / latency``).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tgis.benchmark.session import BatchResult

Metric = Callable[[BatchResult], list[float]]


@dataclass(frozen=True)
class Summary:
    average: float
    lowest: float
    highest: float
    p50: float
    p90: float
    p99: float


def percentile(values: Sequence[float], p: float) -> float:
    """The value at rank ``p`` % of the sorted values (index ``floor(p/100 * n)``, at most
    the last)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


def summarize(values: Sequence[float]) -> Summary:
    return Summary(
        average=statistics.fmean(values),
        lowest=min(values),
        highest=max(values),
        p50=percentile(values, 50),
        p90=percentile(values, 90),
        p99=percentile(values, 99),
    )


def prefill_latency(r: BatchResult) -> list[float]:
    return list(r.prefill_ms)


def decode_token_latency(r: BatchResult) -> list[float]:
    return [ms / r.decode_steps for ms in r.decode_ms]


def decode_total_latency(r: BatchResult) -> list[float]:
    return list(r.decode_ms)


def prefill_throughput(r: BatchResult) -> list[float]:
    return [r.batch / (ms / 1e3) for ms in r.prefill_ms]


def prefill_prompt_throughput(r: BatchResult) -> list[float]:
    return [r.batch * r.sequence_length / (ms / 1e3) for ms in r.prefill_ms]


def decode_throughput(r: BatchResult) -> list[float]:
    return [r.batch * r.decode_steps / (ms / 1e3) for ms in r.decode_ms]


LATENCIES: tuple[tuple[str, Metric], ...] = (
    ("Prefill", prefill_latency),
    ("Decode (token)", decode_token_latency),
    ("Decode (total)", decode_total_latency),
)
THROUGHPUTS: tuple[tuple[str, Metric], ...] = (
    ("Prefill", prefill_throughput),
    ("Prefill (prompt)", prefill_prompt_throughput),
    ("Decode", decode_throughput),
)


def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table with its columns padded to their widest cell."""
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def parameters_table(parameters: Sequence[tuple[str, object]]) -> str:
    return markdown(("Parameter", "Value"), [(k, str(v)) for k, v in parameters])


def _metric_rows(
    results: Sequence[BatchResult], metrics: Sequence[tuple[str, Metric]], unit: str, full: bool
) -> list[list[str]]:
    rows = []
    ran = [r for r in results if not r.skipped]
    for step, metric in metrics:
        for i, r in enumerate(ran):
            s = summarize(metric(r))
            values = [s.average, s.lowest, s.highest] + ([s.p50, s.p90, s.p99] if full else [])
            # the step is named once per group of rows, as TGI's merged cells
            rows.append(
                [step if i == 0 else "", str(r.batch), *(f"{v:.2f} {unit}" for v in values)]
            )
    return rows


def latency_table(results: Sequence[BatchResult]) -> str:
    header = ("Step", "Batch Size", "Average", "Lowest", "Highest", "p50", "p90", "p99")
    return markdown(header, _metric_rows(results, LATENCIES, "ms", full=True))


def throughput_table(results: Sequence[BatchResult]) -> str:
    header = ("Step", "Batch Size", "Average", "Lowest", "Highest")
    return markdown(header, _metric_rows(results, THROUGHPUTS, "tokens/secs", full=False))


def text_plot(
    title: str, points: Sequence[tuple[str, float, float]], width: int = 56, height: int = 12
) -> str:
    """A scatter plot in characters: ``(label, throughput, latency)`` points, throughput
    across, latency up; each point drawn as its label's first character."""
    if not points:
        return f"{title}: no data"
    xs = [p[1] for p in points]
    ys = [p[2] for p in points]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    grid = [[" "] * width for _ in range(height)]
    for label, x, y in points:
        col = 0 if x1 == x0 else round((x - x0) / (x1 - x0) * (width - 1))
        row = 0 if y1 == y0 else round((y - y0) / (y1 - y0) * (height - 1))
        grid[height - 1 - row][col] = label[0]
    margin = max(len(f"{y1:.2f}"), len(f"{y0:.2f}"))
    lines = [f"{title} (latency ms up, throughput tokens/secs across)"]
    for i, cells in enumerate(grid):
        tick = f"{y1:.2f}" if i == 0 else f"{y0:.2f}" if i == height - 1 else ""
        lines.append((f"{tick:>{margin}} |" + "".join(cells)).rstrip())
    lines.append(" " * margin + " +" + "-" * width)
    left, right = f"{x0:.2f}", f"{x1:.2f}"
    lines.append(" " * (margin + 2) + left + right.rjust(width - len(left)))
    return "\n".join(lines)


POINT_LABELS = "0123456789abcdefghijklmnopqrstuvwxyz"


def plots(results: Sequence[BatchResult]) -> str:
    """Prefill and decode: each batch size's average latency against its average
    throughput (TGI's latency-throughput charts), with the legend of the point labels."""
    ran = [r for r in results if not r.skipped]
    labels = {r.batch: POINT_LABELS[i % len(POINT_LABELS)] for i, r in enumerate(ran)}
    parts = []
    for title, latency, throughput in (
        ("Prefill", prefill_latency, prefill_throughput),
        ("Decode (token)", decode_token_latency, decode_throughput),
    ):
        points = [
            (labels[r.batch], statistics.fmean(throughput(r)), statistics.fmean(latency(r)))
            for r in ran
        ]
        parts.append(text_plot(title, points))
    legend = ", ".join(f"{label} = batch size {b}" for b, label in labels.items())
    return "\n\n".join(parts) + "\n" + legend


def full_report(parameters: Sequence[tuple[str, object]], results: Sequence[BatchResult]) -> str:
    """Everything printed at the end: the three tables, the plots, skipped batch sizes."""
    parts = [parameters_table(parameters)]
    if any(not r.skipped for r in results):
        parts += [latency_table(results), throughput_table(results), plots(results)]
    parts += [f"Batch size {r.batch} skipped: {r.skipped}" for r in results if r.skipped]
    return "\n\n".join(parts) + "\n"
