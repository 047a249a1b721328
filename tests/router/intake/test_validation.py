"""Parameter conversion (§1.3), validation rules and messages (§2), input handling (§1.6), seeds."""

from __future__ import annotations

import math
from typing import Any

import grpc
import pytest

from tgis.pb import generation_pb2 as pb
from tgis.router.edge.fmaas import convert_params
from tgis.router.edge.status import status_code
from tgis.router.errors import ValidationError
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import (
    ServerLimits,
    prefix_lookup_error,
    tokenizer_validation_error,
    validate_input,
    validate_inputs,
    validate_params,
)
from tgis.router.request_types import GenerationParams, LengthPenalty, ResolvedAdapters

LIMITS = ServerLimits(max_sequence_length=200, max_new_tokens=169)
SS_MSG = "can specify at most 6 non-empty stop sequences, each not more than 240 UTF8 bytes"
DETAIL_MSG = "must request input and/or generated tokens to request extra token detail"
LP_MSG = "length_penalty must be >= 1.0 and <= 10.0"
MIN_MSG = "min_new_tokens must be <= max_new_tokens"


def make(**fields: Any) -> pb.Parameters:
    return pb.Parameters(**fields)


def conv(p: pb.Parameters | None, default_include: bool = False, now: float = 100.0) -> Any:
    return convert_params(p, default_include_stop_seqs=default_include, now=now)


def error_of(p: pb.Parameters | None, limits: ServerLimits = LIMITS) -> str | None:
    try:
        validate_params(conv(p), limits)
    except ValidationError as err:
        assert status_code(err) == grpc.StatusCode.INVALID_ARGUMENT
        return err.message
    return None


# ---------------------------------------------------------------------------------------------
# conversion


def test_absent_params_are_the_defaults() -> None:
    gp = conv(None, default_include=True)
    assert gp.sampling.temperature == 0.0 and gp.sampling.is_greedy
    assert (gp.sampling.top_k, gp.sampling.top_p, gp.sampling.typical_p) == (0, 1.0, 1.0)
    assert gp.sampling.seed is None and gp.sampling.repetition_penalty == 1.0
    assert gp.sampling.length_penalty is None
    assert gp.stopping.max_new_tokens == 20 and gp.stopping.min_new_tokens == 0
    assert gp.stopping.stop_sequences == () and gp.stopping.deadline is None
    assert gp.stopping.include_stop_sequence is True
    assert gp.truncate_input_tokens == 0
    assert not gp.response.input_text and gp.response.top_n_tokens == 0


def test_zero_means_default() -> None:
    gp = conv(
        make(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(temperature=0.0, top_p=0.0, typical_p=0.0, top_k=0),
            stopping=pb.StoppingCriteria(max_new_tokens=0, min_new_tokens=0, time_limit_millis=0),
            decoding=pb.DecodingParameters(repetition_penalty=0.0),
        )
    )
    assert gp.sampling.temperature == 1.0  # SAMPLE + temperature 0 -> 1
    assert gp.sampling.top_p == 1.0 and gp.sampling.typical_p == 1.0 and gp.sampling.top_k == 0
    assert gp.sampling.repetition_penalty == 1.0
    assert gp.stopping.max_new_tokens == 20 and gp.stopping.deadline is None


def test_sample_without_sampling_message_is_temperature_one() -> None:
    gp = conv(make(method=pb.SAMPLE))
    assert gp.sampling.temperature == 1.0 and gp.sampling.seed is None
    assert not gp.sampling.is_greedy


def test_sample_values_are_copied() -> None:
    gp = conv(
        make(
            method=pb.SAMPLE,
            sampling=pb.SamplingParameters(
                temperature=0.5, top_k=7, top_p=0.9, typical_p=0.8, seed=2**64 - 1
            ),
        )
    )
    s = gp.sampling
    assert s.temperature == 0.5 and s.top_k == 7 and s.seed == 2**64 - 1
    assert s.top_p == pytest.approx(0.9) and s.typical_p == pytest.approx(0.8)


def test_greedy_ignores_sampling_fields() -> None:
    p = make(
        method=pb.GREEDY,
        sampling=pb.SamplingParameters(temperature=0.01, top_k=5, top_p=1.5, typical_p=7, seed=3),
    )
    gp = conv(p)
    assert gp.sampling.temperature == 0.0 and gp.sampling.is_greedy
    assert (gp.sampling.top_k, gp.sampling.top_p, gp.sampling.typical_p) == (0, 1.0, 1.0)
    assert gp.sampling.seed is None
    assert error_of(p) is None  # the same values fail in SAMPLE mode
    p.method = pb.SAMPLE
    assert error_of(p) == "temperature must be >= 0.05"


def test_stopping_and_response_are_copied() -> None:
    gp = conv(
        make(
            stopping=pb.StoppingCriteria(
                max_new_tokens=5,
                min_new_tokens=2,
                stop_sequences=["a", "bc"],
                time_limit_millis=1500,
            ),
            response=pb.ResponseOptions(
                input_text=True, generated_tokens=True, token_logprobs=True, top_n_tokens=3
            ),
            truncate_input_tokens=17,
        ),
        now=100.0,
    )
    assert gp.stopping.max_new_tokens == 5 and gp.stopping.min_new_tokens == 2
    assert gp.sampling.min_new_tokens == 2  # the shard masks EOS until then
    assert gp.stopping.stop_sequences == ("a", "bc")
    assert gp.stopping.deadline == pytest.approx(101.5)
    assert gp.response.input_text and gp.response.generated_tokens and gp.response.token_logprobs
    assert gp.response.top_n_tokens == 3 and not gp.response.input_tokens
    assert gp.truncate_input_tokens == 17


@pytest.mark.parametrize("default", [True, False])
def test_include_stop_sequence_default_and_override(default: bool) -> None:
    unset = conv(make(stopping=pb.StoppingCriteria(stop_sequences=["x"])), default_include=default)
    assert unset.stopping.include_stop_sequence is default
    explicit = conv(
        make(stopping=pb.StoppingCriteria(include_stop_sequence=not default)),
        default_include=default,
    )
    assert explicit.stopping.include_stop_sequence is (not default)


def test_length_penalty_conversion() -> None:
    lp = pb.DecodingParameters.LengthPenalty(start_index=8, decay_factor=1.5)
    with_rep = conv(make(decoding=pb.DecodingParameters(repetition_penalty=1.2, length_penalty=lp)))
    assert with_rep.sampling.length_penalty == LengthPenalty(8, 1.5)
    assert with_rep.sampling.repetition_penalty == pytest.approx(1.2)
    # A valid length penalty is honoured without a repetition penalty too.
    alone = conv(make(decoding=pb.DecodingParameters(length_penalty=lp)))
    assert alone.sampling.length_penalty == LengthPenalty(8, 1.5)
    assert alone.sampling.repetition_penalty == 1.0
    # Out of [1.0, 10.0] (0.0: present but unset) fails rule 8, with or without a repetition
    # penalty.
    for decay in (0.0, 0.99, 10.01, math.inf, math.nan):
        bad = pb.DecodingParameters.LengthPenalty(start_index=1, decay_factor=decay)
        p = make(decoding=pb.DecodingParameters(length_penalty=bad))
        assert error_of(p) == LP_MSG, decay
        p = make(decoding=pb.DecodingParameters(repetition_penalty=1.1, length_penalty=bad))
        assert error_of(p) == LP_MSG, decay


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_fail_validation(value: float) -> None:
    """NaN and infinities in any float parameter: INVALID_ARGUMENT naming the field, before
    anything is queued (TGIS let a NaN temperature through to fail inside the step)."""
    cases = {
        "temperature": make(method=pb.SAMPLE, sampling=pb.SamplingParameters(temperature=value)),
        "top_p": make(method=pb.SAMPLE, sampling=pb.SamplingParameters(top_p=value)),
        "typical_p": make(method=pb.SAMPLE, sampling=pb.SamplingParameters(typical_p=value)),
        "repetition_penalty": make(decoding=pb.DecodingParameters(repetition_penalty=value)),
    }
    for name, params in cases.items():
        assert error_of(params) == f"{name} must be a finite number", name
    # GREEDY ignores the sampling fields, non-finite or not (TGIS's conversion).
    greedy = make(method=pb.GREEDY, sampling=pb.SamplingParameters(temperature=value))
    assert error_of(greedy) is None


def test_top_k_above_i32_max_becomes_negative() -> None:
    gp = conv(make(method=pb.SAMPLE, sampling=pb.SamplingParameters(top_k=2**31)))
    assert gp.sampling.top_k == -(2**31)
    ok = conv(make(method=pb.SAMPLE, sampling=pb.SamplingParameters(top_k=2**31 - 1)))
    assert ok.sampling.top_k == 2**31 - 1


# ---------------------------------------------------------------------------------------------
# rules 1-11


def sample(**kw: Any) -> pb.Parameters:
    return make(method=pb.SAMPLE, sampling=pb.SamplingParameters(**kw))


def stopping(**kw: Any) -> pb.Parameters:
    return make(stopping=pb.StoppingCriteria(**kw))


def detail(**kw: Any) -> pb.Parameters:
    return make(response=pb.ResponseOptions(**kw))


def penalty(rep: float, decay: float | None = None) -> pb.Parameters:
    if decay is None:
        return make(decoding=pb.DecodingParameters(repetition_penalty=rep))
    lp = pb.DecodingParameters.LengthPenalty(start_index=0, decay_factor=decay)
    return make(decoding=pb.DecodingParameters(repetition_penalty=rep, length_penalty=lp))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (sample(temperature=0.01), "temperature must be >= 0.05"),
        (sample(temperature=-1.0), "temperature must be >= 0.05"),
        (sample(temperature=0.049), "temperature must be >= 0.05"),
        (sample(top_p=1.5), "top_p must be > 0.0 and <= 1.0"),
        (sample(top_p=-0.1), "top_p must be > 0.0 and <= 1.0"),
        (sample(typical_p=1.01), "typical_p must be <= 1.0"),
        (sample(top_k=2**32 - 1), "top_k must be strictly positive"),
        (stopping(max_new_tokens=170), "max_new_tokens must be <= 169"),
        (stopping(max_new_tokens=20, min_new_tokens=21), MIN_MSG),
        (stopping(min_new_tokens=21), MIN_MSG),  # default 20
        (penalty(-1.0), "repetition_penalty must be > 0.0"),
        (penalty(1.1, 0.5), LP_MSG),
        (penalty(1.1, 10.5), LP_MSG),
        (stopping(stop_sequences=list("abcdefg")), SS_MSG),
        (detail(token_logprobs=True), DETAIL_MSG),
        (detail(token_ranks=True), DETAIL_MSG),
        (detail(top_n_tokens=2), DETAIL_MSG),
        (stopping(stop_sequences=["ok", ""]), SS_MSG),
        (stopping(stop_sequences=["x" * 241]), SS_MSG),
        (stopping(stop_sequences=["é" * 121]), SS_MSG),  # 121 chars but 242 bytes
    ],
)
def test_validation_messages(params: pb.Parameters, message: str) -> None:
    assert error_of(params) == message


@pytest.mark.parametrize(
    "params",
    [
        sample(temperature=0.05),  # exactly the f32 limit
        sample(top_p=1.0, typical_p=1.0, top_k=50),
        sample(typical_p=-3.0),  # negative typical_p is not validated
        stopping(max_new_tokens=169, min_new_tokens=169),
        penalty(1.1, 1.0),
        penalty(1.1, 10.0),
        stopping(stop_sequences=list("abcdef")),
        stopping(stop_sequences=["x" * 240, "é" * 120]),
        detail(token_logprobs=True, token_ranks=True, top_n_tokens=99, generated_tokens=True),
        detail(token_logprobs=True, input_tokens=True),
    ],
)
def test_valid_params(params: pb.Parameters) -> None:
    assert error_of(params) is None


def test_max_stop_sequences_changes_the_limit_not_the_message() -> None:
    """--max-stop-sequences (TGI's flag): TGIS's rule and message, with the flag's number."""
    two = ServerLimits.from_args(200, 169, max_stop_sequences=2)
    message = "can specify at most 2 non-empty stop sequences, each not more than 240 UTF8 bytes"
    assert error_of(stopping(stop_sequences=["a", "b", "c"]), two) == message
    assert error_of(stopping(stop_sequences=["a", "b"]), two) is None
    assert error_of(stopping(stop_sequences=["a", ""]), two) == message  # rule 11 too
    nine = ServerLimits.from_args(200, 169, max_stop_sequences=9)
    assert error_of(stopping(stop_sequences=list("abcdefghi")), nine) is None
    assert error_of(
        stopping(stop_sequences=["a"]), ServerLimits.from_args(200, 169, max_stop_sequences=0)
    ) == ("can specify at most 0 non-empty stop sequences, each not more than 240 UTF8 bytes")
    assert ServerLimits.from_args(200, 169).max_stop_sequences == 6  # TGIS's


def test_max_top_n_tokens_is_no_limit_unless_set() -> None:
    """TGIS forwards any top_n_tokens (its proto comment's 5 is not checked); TGI's
    --max-top-n-tokens sets a limit, checked after rule 11."""
    asked = detail(generated_tokens=True, top_n_tokens=6)
    assert error_of(asked) is None
    five = ServerLimits.from_args(200, 169, max_top_n_tokens=5)
    assert error_of(asked, five) == "top_n_tokens (6) must be <= 5"
    assert error_of(detail(generated_tokens=True, top_n_tokens=5), five) is None
    zero = ServerLimits.from_args(200, 169, max_top_n_tokens=0)
    assert error_of(detail(input_tokens=True, top_n_tokens=1), zero) == (
        "top_n_tokens (1) must be <= 0"
    )
    # the earlier rules first
    assert error_of(detail(top_n_tokens=6), five) == DETAIL_MSG
    both = _combined(asked, stopping(stop_sequences=[""]))
    assert error_of(both, five) == SS_MSG


def test_default_max_new_tokens_fails_a_low_server_limit() -> None:
    assert error_of(None, ServerLimits(200, 10)) == "max_new_tokens must be <= 10"
    assert error_of(make(), ServerLimits(200, 10)) == "max_new_tokens must be <= 10"


def _combined(a: pb.Parameters, b: pb.Parameters) -> pb.Parameters:
    p = pb.Parameters()
    p.MergeFrom(a)
    p.MergeFrom(b)
    return p


@pytest.mark.parametrize(
    ("first", "second", "message"),
    [
        (sample(temperature=0.01), stopping(max_new_tokens=500), "temperature must be >= 0.05"),
        (sample(temperature=0.01, top_p=2.0), make(), "temperature must be >= 0.05"),
        (sample(top_p=2.0, typical_p=2.0), make(), "top_p must be > 0.0 and <= 1.0"),
        (sample(typical_p=2.0, top_k=2**31), make(), "typical_p must be <= 1.0"),
        (sample(top_k=2**31), stopping(max_new_tokens=500), "top_k must be strictly positive"),
        (stopping(max_new_tokens=500, min_new_tokens=501), make(), "max_new_tokens must be <= 169"),
        (stopping(min_new_tokens=30), penalty(-2.0), MIN_MSG),
        (penalty(-2.0, 0.1), make(), "repetition_penalty must be > 0.0"),
        (penalty(1.1, 0.1), stopping(stop_sequences=list("abcdefgh")), LP_MSG),
        (stopping(stop_sequences=list("abcdefg")), detail(token_ranks=True), SS_MSG),
        (detail(token_ranks=True), stopping(stop_sequences=[""]), DETAIL_MSG),
    ],
)
def test_rule_order(first: pb.Parameters, second: pb.Parameters, message: str) -> None:
    assert error_of(_combined(first, second)) == message


def test_validate_params_is_pure() -> None:
    gp = conv(stopping(max_new_tokens=5))
    validate_params(gp, LIMITS)
    assert gp == conv(stopping(max_new_tokens=5))


def test_server_limits_from_args() -> None:
    assert ServerLimits.from_args(200, 1024) == ServerLimits(200, 199)
    assert ServerLimits.from_args(200, 169) == ServerLimits(200, 169)
    assert (LIMITS.max_stop_sequences, LIMITS.max_stop_sequence_bytes) == (6, 240)


def test_prefix_and_tokenizer_messages() -> None:
    err = prefix_lookup_error("invalid_prefix_id", 'prefix id "invalid_prefix_id" not found')
    assert err.message == (
        "can't retrieve prompt prefix with id 'invalid_prefix_id': "
        'prefix id "invalid_prefix_id" not found'
    )
    assert tokenizer_validation_error("boom").message == "tokenizer error boom"
    assert status_code(err) == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------------------------------------
# per-input rules, truncation, TOKEN_LIMIT, seeds


def gparams(**stop: Any) -> GenerationParams:
    truncate = stop.pop("truncate", 0)
    method = stop.pop("method", pb.GREEDY)
    seed = stop.pop("seed", None)
    sampling = pb.SamplingParameters(seed=seed) if seed is not None else None
    p = make(method=method, stopping=pb.StoppingCriteria(**stop), truncate_input_tokens=truncate)
    if sampling is not None:
        p.sampling.CopyFrom(sampling)
    gp = conv(p)
    validate_params(gp, LIMITS)
    return gp


def ids(n: int) -> list[int]:
    return list(range(10, 10 + n))


def input_error(n: int, gp: GenerationParams, prefix: int = 0) -> str:
    with pytest.raises(ValidationError) as info:
        validate_input("x", ids(n), gp, LIMITS, adapters=ResolvedAdapters(prefix_length=prefix))
    return info.value.message


def test_rule_14_boundary() -> None:
    gp = gparams(max_new_tokens=10)
    assert input_error(200, gp) == "input tokens (200) plus prefix length (0) must be < 200"
    assert input_error(250, gp) == "input tokens (250) plus prefix length (0) must be < 200"
    assert input_error(150, gp, prefix=50) == (
        "input tokens (150) plus prefix length (50) must be < 200"
    )
    ok = validate_input("x", ids(199), gp, LIMITS)
    assert ok.input_length == 199
    assert ok.stopping.max_new_tokens == 1 and ok.stopping.truncated_to_fit


def test_rule_15_boundary() -> None:
    gp = gparams(max_new_tokens=169, min_new_tokens=150)
    assert input_error(69, gp) == (
        "input tokens (69) plus prefix length (0) plus min_new_tokens (150) must be <= 200"
    )
    assert input_error(40, gp, prefix=11) == (
        "input tokens (40) plus prefix length (11) plus min_new_tokens (150) must be <= 200"
    )
    ok = validate_input("x", ids(50), gp, LIMITS)
    assert ok.stopping.max_new_tokens == 150 and ok.stopping.truncated_to_fit
    # 198 + min 2 == 200 is allowed: 2 tokens, then TOKEN_LIMIT.
    edge = validate_input("x", ids(198), gparams(max_new_tokens=20, min_new_tokens=2), LIMITS)
    assert edge.stopping.max_new_tokens == 2 and edge.stopping.truncated_to_fit


def test_rule_14_is_checked_before_rule_15() -> None:
    gp = gparams(max_new_tokens=169, min_new_tokens=150)
    assert input_error(200, gp) == "input tokens (200) plus prefix length (0) must be < 200"


def test_token_limit_reduction() -> None:
    r = validate_input("x", ids(186), gparams(max_new_tokens=100), LIMITS)
    assert r.stopping.max_new_tokens == 14 and r.stopping.truncated_to_fit
    exact = validate_input("x", ids(180), gparams(max_new_tokens=20), LIMITS)
    assert exact.stopping.max_new_tokens == 20 and not exact.stopping.truncated_to_fit
    fits = validate_input("x", ids(5), gparams(), LIMITS)
    assert fits.stopping.max_new_tokens == 20 and not fits.stopping.truncated_to_fit
    # The request-wide params keep the requested value.
    assert r.params.stopping.max_new_tokens == 100


def test_truncation_keeps_the_tail_and_fixes_up_bos() -> None:
    full = [1, *ids(20)]
    gp = gparams(truncate=5)
    with_bos = validate_input("text", full, gp, LIMITS, bos_token_id=1)
    assert with_bos.input_ids == (1, 26, 27, 28, 29)
    assert with_bos.text == "text"  # the echo is the untruncated original
    without = validate_input("text", full, gp, LIMITS)
    assert without.input_ids == (25, 26, 27, 28, 29)
    # T >= length or 0: nothing happens.
    assert validate_input(
        "t", full, gparams(truncate=21), LIMITS, bos_token_id=1
    ).input_ids == tuple(full)
    assert validate_input("t", full, gparams(truncate=0), LIMITS).input_ids == tuple(full)


def test_truncation_happens_before_the_length_checks() -> None:
    r = validate_input("x", ids(500), gparams(truncate=100, max_new_tokens=150), LIMITS)
    assert r.input_length == 100
    assert r.stopping.max_new_tokens == 100 and r.stopping.truncated_to_fit


def test_truncation_with_a_real_bos_tokenizer(llama_tokenizer: RouterTokenizer) -> None:
    text = "Once upon a time, there was a little girl who lived in a village near the forest."
    full = llama_tokenizer.encode(text)
    bos = llama_tokenizer.bos_token_id
    assert bos is not None and full[0] == bos
    r = validate_input(text, full, gparams(truncate=4), LIMITS, bos_token_id=bos)
    assert r.input_ids == (bos, *full[-3:])


def test_seeds_for_sampled_inputs() -> None:
    gp = gparams(method=pb.SAMPLE)
    reqs = validate_inputs(["same"] * 5, [ids(3)] * 5, gp, LIMITS)
    seeds = [r.sampling.seed for r in reqs]
    assert all(s is not None and 0 <= s <= 2**32 - 1 for s in seeds)
    assert len(set(seeds)) == 5
    assert gp.sampling.seed is None  # the shared params are not modified


def test_client_seed_is_shared() -> None:
    for seed in (12345, 2**64 - 1, 0):
        gp = gparams(method=pb.SAMPLE, seed=seed)
        reqs = validate_inputs(["a", "b", "c"], [ids(2)] * 3, gp, LIMITS)
        assert [r.sampling.seed for r in reqs] == [seed] * 3


def test_greedy_gets_no_seed() -> None:
    reqs = validate_inputs(["a", "b"], [ids(2)] * 2, gparams(), LIMITS)
    assert [r.sampling.seed for r in reqs] == [None, None]


def test_first_failing_input_wins() -> None:
    gp = gparams(max_new_tokens=100, min_new_tokens=100)
    with pytest.raises(ValidationError) as info:
        validate_inputs(["ok", "long", "min"], [ids(5), ids(200), ids(150)], gp, LIMITS)
    assert info.value.message == "input tokens (200) plus prefix length (0) must be < 200"
    with pytest.raises(ValidationError) as info:
        validate_inputs(["ok", "min", "long"], [ids(5), ids(150), ids(200)], gp, LIMITS)
    assert info.value.message == (
        "input tokens (150) plus prefix length (0) plus min_new_tokens (100) must be <= 200"
    )


def test_a_prefix_counts_in_the_token_limit_reduction_but_not_in_the_input_length() -> None:
    # 150 + 30 + 40 > 200: max_new_tokens lowered to 200 - 150 - 30 = 20 (-> TOKEN_LIMIT).
    r = validate_input(
        "x",
        ids(150),
        gparams(max_new_tokens=40),
        LIMITS,
        adapters=ResolvedAdapters(prefix_length=30),
    )
    assert r.input_length == 150 and r.prompt_length == 180
    assert r.stopping.max_new_tokens == 20 and r.stopping.truncated_to_fit
    # Without the prefix the same request fits as asked.
    plain = validate_input("x", ids(150), gparams(max_new_tokens=40), LIMITS)
    assert plain.stopping.max_new_tokens == 40 and not plain.stopping.truncated_to_fit
    # The boundary of rule 14 with a prefix: 169 + 30 = 199 < 200, one token left.
    edge = validate_input(
        "x",
        ids(169),
        gparams(max_new_tokens=10),
        LIMITS,
        adapters=ResolvedAdapters(prefix_length=30),
    )
    assert edge.stopping.max_new_tokens == 1 and edge.stopping.truncated_to_fit
    assert input_error(170, gparams(max_new_tokens=10), prefix=30) == (
        "input tokens (170) plus prefix length (30) must be < 200"
    )
    # Truncation applies to the input only; the prefix is kept whole.
    cut = validate_input(
        "x", ids(300), gparams(truncate=100), LIMITS, adapters=ResolvedAdapters(prefix_length=99)
    )
    assert cut.input_length == 100 and cut.stopping.max_new_tokens == 1


def test_every_input_of_a_batch_carries_the_prefix() -> None:
    reqs = validate_inputs(
        ["a", "b"], [ids(3), ids(7)], gparams(), LIMITS, adapters=ResolvedAdapters("pt/x", 5)
    )
    assert [(r.prefix_id, r.prefix_length, r.input_length) for r in reqs] == [
        ("pt/x", 5, 3),
        ("pt/x", 5, 7),
    ]
    none = validate_input("a", ids(3), gparams(), LIMITS)
    assert (none.prefix_id, none.prefix_length, none.prompt_length) == ("", 0, 3)


def test_temperature_005_from_a_float64_body_passes_as_the_float32_field_does() -> None:
    """The OpenAI and TGI routes carry a float64 0.05, gRPC the float32 one: both are TGIS's
    smallest temperature."""
    from tgis.router.intake import validation
    from tgis.router.request_types import SamplingParams

    for value in (0.05, validation._f32(0.05)):
        validation._check_warpers(SamplingParams(temperature=value))
    with pytest.raises(ValidationError, match=r"temperature must be >= 0\.05"):
        validation._check_warpers(SamplingParams(temperature=0.0499999))
