"""GET /metrics content: every metric of TGIS's catalogue (spec §8) with its kind, labels,
label values and buckets, both names of every counter, the extras, and promtool's approval.

The expected catalogue is written out here from the spec, independently of metrics.py.
"""

from __future__ import annotations

import itertools
import math
import time

import pytest

from tests.prometheus_tools import Exposition, parse_exposition, promtool_check
from tgis.router.ops.metrics import Metrics, step_method
from tgis.router.ops.prometheus import WindowedSummary, equal_steps

MAX_SEQUENCE_LENGTH = 2048
MAX_NEW_TOKENS = 1024
MAX_BATCH_SIZE = 4

KINDS = ("single", "batch", "stream")
METHODS = ("prefill", "next_token")
# name -> {label: allowed values} (every combination is exported from the start)
COUNTERS: dict[str, dict[str, tuple[str, ...]]] = {
    "tgi_request_count": {"kind": KINDS},
    "tgi_request_input_count": {},
    "tgi_request_failure": {
        "err": (
            "conc_limit",
            "queue_full",
            "validation",
            "generate",
            "cancelled",
            "timeout",
            "unknown",
        )
    },
    "tgi_request_success": {
        "stop_reason": ("MAX_TOKENS", "EOS_TOKEN", "TIME_LIMIT", "STOP_SEQUENCE", "TOKEN_LIMIT"),
        "kind": KINDS,
    },
    "tgi_batch_concatenation_count": {},
    "tgi_batch_inference_count": {"method": METHODS},
    "tgi_batch_inference_success": {"method": METHODS},
    "tgi_batch_inference_failure": {"method": METHODS, "reason": ("oom", "connection", "error")},
    "tgi_queue_jump": {},
    "tgi_granular_batch_addition": {},
    "tgi_prefill_weight_limit_exceeded": {},
    "tgi_prefill_padding_limit_exceeded": {},
    "tgi_prompt_load_failure": {},
    "tgi_tokenize_request_count": {},
    "tgi_tokenize_request_input_count": {},
}
EXTRA_COUNTERS = ("tgi_prompt_tokens", "tgi_generated_tokens", "tgi_request_preemption_count")
GAUGES = (
    "tgi_batch_current_size",
    "tgi_batch_input_tokens",
    "tgi_batch_max_remaining_tokens",
    "tgi_queue_size",
)
EXTRA_GAUGES = ("tgi_kv_cache_usage_ratio", "tgi_kv_cache_used_blocks", "tgi_kv_cache_total_blocks")

DURATION = [0.0001 * 1.5**k for k in range(1, 36)]
SEQ_STEPS = [MAX_SEQUENCE_LENGTH / 64 * k for k in range(1, 65)]
NEW_STEPS = [MAX_NEW_TOKENS / 64 * k for k in range(1, 65)]
# name -> (label names besides le, buckets)
HISTOGRAMS: dict[str, tuple[tuple[str, ...], list[float]]] = {
    "tgi_request_input_length": ((), SEQ_STEPS),
    "tgi_request_max_new_tokens": ((), NEW_STEPS),
    "tgi_request_validation_duration": ((), DURATION),
    "tgi_request_queue_duration": ((), DURATION),
    "tgi_request_inference_duration": ((), DURATION),
    "tgi_request_mean_time_per_token_duration": ((), DURATION),
    "tgi_request_duration": ((), DURATION),
    "tgi_request_generated_tokens": ((), NEW_STEPS),
    "tgi_request_total_tokens": ((), SEQ_STEPS),
    "tgi_batch_inference_batch_size": (("method",), [1, 2, 3, 4]),
    "tgi_batch_inference_duration": (("makeup", "method"), DURATION),
    "tgi_batch_inference_forward_duration": (("makeup", "method"), DURATION),
    "tgi_batch_inference_tokproc_duration": (("makeup", "method"), DURATION),
    "tgi_prompt_load_duration": ((), DURATION),
    "tgi_tokenize_request_tokens": ((), [2.0**k for k in range(6, 20)]),
    "tgi_tokenize_request_duration": ((), DURATION),
}
EXTRA_HISTOGRAMS = ("tgi_request_time_to_first_token_duration", "tgi_request_inter_token_duration")
SUMMARIES = ("tgi_request_raw_input_length", "tgi_batch_next_tokens")
QUANTILES = ("0", "0.5", "0.9", "0.95", "0.99", "0.999", "1")


def new_metrics() -> Metrics:
    return Metrics(
        max_sequence_length=MAX_SEQUENCE_LENGTH,
        max_new_tokens=MAX_NEW_TOKENS,
        max_batch_size=MAX_BATCH_SIZE,
    )


def exposition(metrics: Metrics) -> Exposition:
    return parse_exposition(metrics.render().decode())


def exercise(m: Metrics) -> None:
    """One call of every recording method, so that every series has a value."""
    m.request_received("single", 1)
    m.request_received("batch", 3)
    m.request_received("stream", 1)
    m.request_failure("validation")
    m.input_tokenized(40)
    m.input_validated(32, 100)
    m.validation_done(0.002)
    m.prompt_load_failed()
    m.prompt_loaded(0.01)
    m.request_succeeded(
        stop_reason="EOS_TOKEN",
        kind="single",
        input_length=32,
        generated_tokens=10,
        duration=1.5,
        inference_seconds=1.0,
    )
    m.tokenize_received(2)
    m.tokenize_done(17, 0.001)
    m.request_admitted(0.05)
    m.request_cancelled()
    m.request_timed_out()
    m.request_preempted()
    m.first_token(0.2)
    m.next_token(0.03)
    m.set_queue_size(3)
    m.set_batch(2, 80, 300)
    m.set_kv_cache(10, 64)
    m.batch_concatenated()
    m.prefill_budget_exceeded()
    m.step_started("prefill", 2, 64)
    m.step_succeeded("prefill", 0.05, 0.04, prompt_tokens=64, generated_tokens=2)
    m.step_processed("prefill", 0.001)
    m.step_started("next_token", 2, 0)
    m.step_failed("next_token", "oom")


def test_every_tgis_counter_is_exported_under_both_names_with_every_label_value() -> None:
    m = new_metrics()
    exercise(m)
    exp = exposition(m)
    for name, labels in COUNTERS.items():
        assert exp.types.get(name) == "untyped", name
        assert exp.types.get(f"{name}_total") == "counter", name
        expected = [
            dict(zip(labels, combo, strict=True)) for combo in itertools.product(*labels.values())
        ]
        for exported in (name, f"{name}_total"):
            got = [s.labels for s in exp.of(exported)]
            assert sorted(map(sorted, map(dict.items, got))) == sorted(
                map(sorted, map(dict.items, expected))
            ), exported
        plain = {tuple(sorted(s.labels.items())): s.value for s in exp.of(name)}
        total = {tuple(sorted(s.labels.items())): s.value for s in exp.of(f"{name}_total")}
        assert plain == total, name


def test_counters_count_once_per_event_in_both_names() -> None:
    m = new_metrics()
    exercise(m)
    exp = exposition(m)
    for suffix in ("", "_total"):
        assert exp.value(f"tgi_request_count{suffix}", kind="batch") == 1
        assert exp.value(f"tgi_request_input_count{suffix}") == 5
        assert (
            exp.value(f"tgi_request_success{suffix}", stop_reason="EOS_TOKEN", kind="single") == 1
        )
        assert (
            exp.value(f"tgi_request_success{suffix}", stop_reason="MAX_TOKENS", kind="single") == 0
        )
        assert exp.value(f"tgi_request_failure{suffix}", err="cancelled") == 1
        assert exp.value(f"tgi_batch_inference_count{suffix}", method="prefill") == 1
        assert exp.value(f"tgi_batch_inference_count{suffix}", method="next_token") == 1
        assert exp.value(f"tgi_batch_inference_success{suffix}", method="prefill") == 1
        failure = f"tgi_batch_inference_failure{suffix}"
        assert exp.value(failure, method="next_token", reason="oom") == 1
        assert exp.value(f"tgi_tokenize_request_input_count{suffix}") == 2
        assert exp.value(f"tgi_prompt_tokens{suffix}") == 64
        assert exp.value(f"tgi_generated_tokens{suffix}") == 2


def test_zero_input_generate_counts_the_call_but_no_input() -> None:
    m = new_metrics()
    m.request_received("batch", 0)
    exp = exposition(m)
    assert exp.value("tgi_request_count", kind="batch") == 1
    assert exp.value("tgi_request_input_count") == 0


def test_extras_are_exported() -> None:
    m = new_metrics()
    exercise(m)
    exp = exposition(m)
    for name in EXTRA_COUNTERS:
        assert exp.types.get(name) == "untyped" and exp.types.get(f"{name}_total") == "counter"
    for name in GAUGES + EXTRA_GAUGES:
        assert exp.types.get(name) == "gauge", name
        assert len(exp.of(name)) == 1 and exp.of(name)[0].labels == {}
    assert exp.value("tgi_kv_cache_usage_ratio") == 10 / 64
    assert exp.value("tgi_kv_cache_used_blocks") == 10
    assert exp.value("tgi_kv_cache_total_blocks") == 64
    assert exp.value("tgi_batch_current_size") == 2
    assert exp.value("tgi_batch_input_tokens") == 80
    assert exp.value("tgi_batch_max_remaining_tokens") == 300
    assert exp.value("tgi_queue_size") == 3
    for name in EXTRA_HISTOGRAMS:
        assert exp.types.get(name) == "histogram"
        assert [float(s.labels["le"]) for s in exp.of(f"{name}_bucket")][:-1] == pytest.approx(
            DURATION
        )
        assert exp.value(f"{name}_count") == 1


def test_histograms_have_tgis_buckets_and_labels() -> None:
    m = new_metrics()
    exercise(m)
    exp = exposition(m)
    for name, (labelnames, buckets) in HISTOGRAMS.items():
        assert exp.types.get(name) == "histogram", name
        rows = exp.of(f"{name}_bucket")
        assert rows, name
        series: dict[tuple[tuple[str, str], ...], list[float]] = {}
        for s in rows:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            assert tuple(k for k, _ in key) == labelnames, name
            series.setdefault(key, []).append(float(s.labels["le"]))
        for key, les in series.items():
            assert les[-1] == math.inf, name
            assert les[:-1] == pytest.approx(buckets), (name, key)
        if "method" in labelnames:
            assert {dict(k)["method"] for k in series} == set(METHODS), name
        if "makeup" in labelnames:
            assert {dict(k)["makeup"] for k in series} == {"single_only"}, name


def test_unbucketed_tgis_histograms_are_summaries_with_tgis_quantiles() -> None:
    m = new_metrics()
    exercise(m)
    exp = exposition(m)
    for name in SUMMARIES:
        assert exp.types.get(name) == "summary", name
        assert [s.labels["quantile"] for s in exp.of(name)] == list(QUANTILES)
        assert exp.value(f"{name}_count") == 1
    assert exp.value("tgi_request_raw_input_length", quantile="0.5") == 40
    assert exp.value("tgi_batch_next_tokens_sum") == 64


def test_histograms_record_at_tgis_moments() -> None:
    m = new_metrics()
    exercise(m)
    exp = exposition(m)
    assert exp.value("tgi_request_input_length_sum") == 32
    assert exp.value("tgi_request_max_new_tokens_sum") == 100
    assert exp.value("tgi_request_total_tokens_sum") == 42
    assert exp.value("tgi_request_generated_tokens_sum") == 10
    assert exp.value("tgi_request_mean_time_per_token_duration_sum") == pytest.approx(0.1)
    assert exp.value("tgi_batch_inference_batch_size_sum", method="prefill") == 2
    assert exp.value("tgi_batch_inference_batch_size_sum", method="next_token") == 2
    duration = "tgi_batch_inference_forward_duration_sum"
    assert exp.value(duration, method="prefill", makeup="single_only") == pytest.approx(0.04)
    # A failed step records no duration.
    assert (
        exp.value("tgi_batch_inference_duration_count", method="next_token", makeup="single_only")
        == 0
    )


def test_mean_time_per_token_is_zero_without_tokens() -> None:
    m = new_metrics()
    m.request_succeeded(
        stop_reason="TIME_LIMIT",
        kind="stream",
        input_length=5,
        generated_tokens=0,
        duration=0.5,
        inference_seconds=0.0,
    )
    exp = exposition(m)
    assert exp.value("tgi_request_mean_time_per_token_duration_sum") == 0
    assert exp.value("tgi_request_mean_time_per_token_duration_count") == 1
    assert exp.value("tgi_request_success", stop_reason="TIME_LIMIT", kind="stream") == 1


def test_step_method_labels_mixed_steps_prefill() -> None:
    assert step_method(prompt_tokens=0) == "next_token"
    assert step_method(prompt_tokens=1) == "prefill"


def test_engine_step_calls() -> None:
    m = new_metrics()
    m.set_queue_size(2)
    m.set_batch(3, 40, 17)
    m.step_started("next_token", 3, 0)
    m.step_succeeded("next_token", 0.01, 0.005, generated_tokens=3)
    m.step_started("next_token", 3, 0)
    m.step_failed("next_token", "connection")
    m.request_cancelled()
    m.counter("request_count").inc("single")
    exp = exposition(m)
    assert exp.value("tgi_queue_size") == 2
    assert exp.value("tgi_batch_current_size") == 3
    assert exp.value("tgi_batch_input_tokens") == 40
    assert exp.value("tgi_batch_max_remaining_tokens") == 17
    assert exp.value("tgi_batch_inference_count_total", method="next_token") == 2
    assert exp.value("tgi_batch_inference_success", method="next_token") == 1
    assert exp.value("tgi_batch_inference_failure", method="next_token", reason="connection") == 1
    assert exp.value("tgi_request_failure", err="cancelled") == 1
    forward = "tgi_batch_inference_forward_duration_sum"
    assert exp.value(forward, method="next_token", makeup="single_only") == pytest.approx(0.005)
    assert exp.value("tgi_request_count", kind="single") == 1


def test_token_buckets_for_small_limits_are_whole_tokens() -> None:
    assert equal_steps(4096) == tuple(64.0 * k for k in range(1, 65))
    assert equal_steps(10) == tuple(float(k) for k in range(1, 11))
    assert equal_steps(1) == (1.0,)


def test_summary_quantiles_cover_a_sliding_window() -> None:
    now = [0.0]
    summary = WindowedSummary("x", "doc", window_s=60.0, clock=lambda: now[0])
    assert all(math.isnan(v) for v in summary.quantiles().values())
    for value in range(1, 101):
        summary.observe(value)
    q = summary.quantiles()
    assert (q[0.0], q[0.5], q[0.9], q[0.99], q[1.0]) == (1, 50, 90, 99, 100)
    now[0] = 30.0
    summary.observe(1000)
    now[0] = 61.0  # the first hundred are out of the window; sum and count are not
    q = summary.quantiles()
    assert q[0.0] == q[1.0] == 1000
    assert (summary.count, summary.sum) == (101, 5050 + 1000)


def test_no_created_series() -> None:
    m = new_metrics()
    exercise(m)
    assert not [s for s in exposition(m).samples if s.name.endswith("_created")]


def test_promtool_accepts_the_exposition() -> None:
    m = new_metrics()
    promtool_check(m.render())
    exercise(m)
    promtool_check(m.render())


def test_gateway_protocol_info_gauges_keep_one_current_series() -> None:
    """The inference gateway's model-server protocol (proposal 003): the cache config in
    labels with value 1; the LoRA gauge's labels list the running and the waiting adapters
    once each, comma-separated without spaces, its value the Unix time of the update; a
    change of labels leaves one series (the endpoint picker reads the greatest value)."""
    m = new_metrics()
    exp = exposition(m)
    assert exp.types["tgi_lora_requests_info"] == "gauge"
    (idle,) = exp.of("tgi_lora_requests_info")
    assert idle.labels == {
        "max_lora": "0",
        "running_lora_adapters": "",
        "waiting_lora_adapters": "",
    }
    assert not exp.of("tgi_cache_config_info")  # until the engine knows the pool

    m.set_cache_config(16, 512)
    before = time.time()
    m.set_lora_requests(2, ["b", "a", "b"], ["c", "a", "c"])
    after = time.time()
    exp = exposition(m)
    assert exp.types["tgi_cache_config_info"] == "gauge"
    assert exp.value("tgi_cache_config_info", block_size="16", num_gpu_blocks="512") == 1
    (lora,) = exp.of("tgi_lora_requests_info")
    assert lora.labels == {
        "max_lora": "2",
        "running_lora_adapters": "a,b",
        "waiting_lora_adapters": "a,c",
    }
    assert before <= lora.value <= after  # repr() of the float: nothing rounded away
    promtool_check(m.render())

    m.set_cache_config(16, 256)
    m.set_lora_requests(2, [], [])
    exp = exposition(m)
    assert [s.labels for s in exp.of("tgi_cache_config_info")] == [
        {"block_size": "16", "num_gpu_blocks": "256"}
    ]
    (lora,) = exp.of("tgi_lora_requests_info")
    assert (lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"]) == ("", "")
    assert lora.value >= after
