"""Stopping criteria precedence and stop-sequence byte matching (§1.5)."""

from __future__ import annotations

from typing import Any

import pytest

from tgis.router.core.detokenizer import IncrementalDetokenizer
from tgis.router.core.stopping import (
    StopChecker,
    StopDecision,
    find_stop_sequence,
    stream_hold_back_bytes,
)
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.request_types import StoppingParams, StopReason

EOS = 2
OTHER_EOS = 3


def checker(**kw: Any) -> StopChecker:
    return StopChecker(StoppingParams(**kw), {EOS, OTHER_EOS})


def test_precedence_time_limit_first() -> None:
    c = checker(max_new_tokens=5, min_new_tokens=3, deadline=10.0)
    # Even in the min-token phase and even when EOS / max tokens also hold.
    decision = c.check(EOS, 1, now=10.5)
    assert decision is not None and decision.reason == StopReason.TIME_LIMIT
    assert c.check(7, 5, now=11.0) == StopDecision(StopReason.TIME_LIMIT)
    assert c.check(7, 1, now=10.0) is None  # strictly after the deadline


def test_min_new_tokens_gate() -> None:
    c = checker(max_new_tokens=5, min_new_tokens=3)
    assert c.check(EOS, 1) is None
    assert c.check(EOS, 2) is None
    decision = c.check(EOS, 3)
    assert decision is not None and decision.reason == StopReason.EOS_TOKEN


def test_a_guided_request_ends_at_eos_before_min_new_tokens() -> None:
    """The shard lets EOS through before min_new_tokens only when the grammar allows
    nothing else: the output is complete, and the request ends there."""
    guided = StopChecker(
        StoppingParams(max_new_tokens=9, min_new_tokens=5), {EOS}, constrained=True
    )
    assert guided.check(7, 1) is None
    assert guided.check(EOS, 2) == StopDecision(StopReason.EOS_TOKEN)
    assert guided.check(9, 6) is None  # past min_new_tokens, only EOS or the limits stop
    assert checker(max_new_tokens=9, min_new_tokens=5).check(EOS, 2) is None  # unguided


def test_stop_token_ids_end_as_eos_after_min_new_tokens() -> None:
    c = StopChecker(
        StoppingParams(max_new_tokens=9, min_new_tokens=2, stop_token_ids=(40, 41)), {EOS}
    )
    assert c.check(40, 1) is None
    assert c.check(41, 2) == StopDecision(StopReason.EOS_TOKEN)
    assert c.check(42, 3) is None


def test_eos_is_a_set() -> None:
    c = checker(max_new_tokens=5)
    for eos in (EOS, OTHER_EOS):
        decision = c.check(eos, 1)
        assert decision is not None and decision.reason == StopReason.EOS_TOKEN
    assert c.check(4, 1) is None


def test_eos_beats_max_tokens() -> None:
    decision = checker(max_new_tokens=2).check(EOS, 2)
    assert decision is not None and decision.reason == StopReason.EOS_TOKEN


def test_max_tokens_and_token_limit() -> None:
    assert checker(max_new_tokens=2).check(9, 1) is None
    assert checker(max_new_tokens=2).check(9, 2) == StopDecision(StopReason.MAX_TOKENS)
    assert checker(max_new_tokens=2, truncated_to_fit=True).check(9, 2) == StopDecision(
        StopReason.TOKEN_LIMIT
    )


def test_stop_sequence_on_the_last_permitted_token_is_max_tokens() -> None:
    c = checker(max_new_tokens=2, stop_sequences=("end",))
    out = b"the end"
    assert c.check(9, 1, out, 4) == StopDecision(StopReason.STOP_SEQUENCE, "end", 4)
    assert c.check(9, 2, out, 4) == StopDecision(StopReason.MAX_TOKENS)
    t = checker(max_new_tokens=2, stop_sequences=("end",), truncated_to_fit=True)
    assert t.check(9, 2, out, 4) == StopDecision(StopReason.TOKEN_LIMIT)


@pytest.mark.parametrize(("include", "cut"), [(True, 11), (False, 6)])
def test_include_and_exclude_truncation(include: bool, cut: int) -> None:
    c = checker(stop_sequences=("confu",), include_stop_sequence=include)
    out = " I am confused."
    decision = c.check(9, 3, out.encode(), len(" confused."))
    assert decision == StopDecision(StopReason.STOP_SEQUENCE, "confu", cut)
    assert out[:cut] == (" I am confu" if include else " I am ")


def test_only_windows_touching_new_bytes() -> None:
    ss = [b"abc"]
    assert find_stop_sequence(ss, b"abcxyz", 3) is None  # entirely in old bytes
    assert find_stop_sequence(ss, b"xabc", 1) == (0, 1)  # the last byte is new
    assert find_stop_sequence(ss, b"abcd", 1) is None
    assert find_stop_sequence(ss, b"abcd", 2) == (0, 0)  # "c" is new
    assert find_stop_sequence(ss, b"abc", 0) is None  # nothing new (deferred bytes)
    assert find_stop_sequence(ss, b"ab", 2) is None


def test_rightmost_match_and_request_order() -> None:
    assert find_stop_sequence([b"bc"], b"abcabc", 6) == (0, 4)  # rightmost
    # The first stop sequence (request order) that matches wins, not the earliest in the text.
    assert find_stop_sequence([b"zz", b"c", b"ab"], b"abcab", 5) == (1, 2)
    assert find_stop_sequence([b"ab", b"c"], b"abcab", 5) == (0, 3)
    c = checker(stop_sequences=("lo", "hel"), include_stop_sequence=True)
    assert c.check(9, 1, b"hello", 5) == StopDecision(StopReason.STOP_SEQUENCE, "lo", 5)


def test_multibyte_stop_sequence_offsets_are_bytes() -> None:
    c = checker(stop_sequences=("日本",), include_stop_sequence=False)
    out = "é 日本語".encode()
    decision = c.check(9, 1, out, 9)
    assert decision == StopDecision(StopReason.STOP_SEQUENCE, "日本", 3)
    inc = checker(stop_sequences=("日本",), include_stop_sequence=True).check(9, 1, out, 9)
    assert inc is not None and inc.truncate_at_bytes == 9


def test_no_stop_sequences_needs_no_text() -> None:
    assert not checker().needs_text
    assert checker(stop_sequences=("x",)).needs_text
    assert checker(max_new_tokens=9).check(9, 1, b"xxx", 3) is None


def test_stream_hold_back_bytes() -> None:
    assert stream_hold_back_bytes(StoppingParams()) == 0
    assert stream_hold_back_bytes(StoppingParams(stop_sequences=("ab", "日本"))) == 6
    incl = StoppingParams(stop_sequences=("ab", "日本"), include_stop_sequence=True)
    assert stream_hold_back_bytes(incl) == 1


# ---------------------------------------------------------------------------------------------
# with the detokenizer: what a request actually sees


def generate(
    tok: RouterTokenizer,
    text: str,
    stopping: StoppingParams,
    *,
    hold_back: int | None = None,
) -> tuple[list[str], StopDecision | None, int]:
    """Feed the tokens of ``text`` as if generated; return streamed chunks, decision, count."""
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    safe = hold_back is None
    if hold_back is None:
        hold_back = stream_hold_back_bytes(stopping)
    det = IncrementalDetokenizer(tok, True, hold_back)
    check = StopChecker(stopping, {EOS})
    chunks = []
    decision = None
    count = 0
    for count, token_id in enumerate(ids, start=1):
        chunks.append(det.push(token_id))
        decision = check.check(token_id, count, det.output_bytes, det.bytes_added)
        if decision is not None:
            chunks.append(det.flush(decision.truncate_at_bytes))
            break
    else:
        chunks.append(det.flush())
    if safe:  # with TGIS's hold-back the streamed text is exactly the final text
        assert "".join(chunks) == det.text
    return chunks, decision, count


def test_stop_sequence_inside_a_token(bytelevel_tokenizer: RouterTokenizer) -> None:
    # "confu" ends inside the tokens of " confused" (" c", "on", "fus", "ed").
    for include, expected in [(True, " I am so confu"), (False, " I am so ")]:
        stopping = StoppingParams(
            max_new_tokens=50, stop_sequences=("confu",), include_stop_sequence=include
        )
        chunks, decision, count = generate(bytelevel_tokenizer, " I am so confused.", stopping)
        assert decision == StopDecision(StopReason.STOP_SEQUENCE, "confu", len(expected.encode()))
        assert "".join(chunks) == expected
        assert count == 7  # detected at the token that completed it ("fus")


def test_stop_sequence_across_token_boundaries(any_tokenizer: RouterTokenizer) -> None:
    stopping = StoppingParams(max_new_tokens=50, stop_sequences=("so conf",))
    chunks, decision, _ = generate(any_tokenizer, " I am so confused. Really.", stopping)
    assert decision is not None and decision.reason == StopReason.STOP_SEQUENCE
    assert "".join(chunks).endswith(" I am ")


def test_stop_sequence_in_a_multibyte_character_run(any_tokenizer: RouterTokenizer) -> None:
    stopping = StoppingParams(max_new_tokens=50, stop_sequences=("京",), include_stop_sequence=True)
    chunks, decision, _ = generate(any_tokenizer, "ok 東京日本 more", stopping)
    assert decision is not None and decision.stop_sequence == "京"
    assert "".join(chunks).endswith("ok 東京")


@pytest.mark.parametrize("include", [True, False])
def test_nothing_past_the_stop_sequence_is_streamed(
    bytelevel_tokenizer: RouterTokenizer, include: bool
) -> None:
    text = " The quick brown fox jumps over the lazy dog. Once upon a time"
    for ss in ("fox", "jumps o", "dog.", "n", "x j", " a"):
        stopping = StoppingParams(
            max_new_tokens=100, stop_sequences=("zzz", ss), include_stop_sequence=include
        )
        chunks, decision, _ = generate(bytelevel_tokenizer, text, stopping)
        assert decision is not None and decision.stop_sequence == ss
        end = text.index(ss) + (len(ss) if include else 0)
        assert "".join(chunks) == text[:end]
        # Every intermediate chunk stays within the final text.
        streamed = "".join(chunks[:-1])
        assert text[:end].startswith(streamed)


def test_no_hold_back_would_leak_text_past_the_stop_sequence(
    bytelevel_tokenizer: RouterTokenizer,
) -> None:
    """Why hold-back exists: without it a token's text after the stop sequence is emitted."""
    stopping = StoppingParams(
        max_new_tokens=50, stop_sequences=("confu",), include_stop_sequence=True
    )
    chunks, _, _ = generate(bytelevel_tokenizer, " I am so confused.", stopping, hold_back=0)
    assert "".join(chunks[:-1]) == " I am so confus"  # more than the final text
    chunks, _, _ = generate(bytelevel_tokenizer, " I am so confused.", stopping)
    assert "".join(chunks[:-1]) == " I am so co"


def test_stop_sequence_in_the_min_token_phase_is_never_detected(
    bytelevel_tokenizer: RouterTokenizer,
) -> None:
    text = " I am so confused. Really confused."
    stopping = StoppingParams(max_new_tokens=50, min_new_tokens=8, stop_sequences=("confu",))
    chunks, decision, count = generate(bytelevel_tokenizer, text, stopping)
    # The first "confu" completes at token 7 (< 8): skipped. The second one stops.
    assert decision is not None and decision.reason == StopReason.STOP_SEQUENCE
    assert "".join(chunks) == " I am so confused. Really "
    assert count > 8
    # With a stop sequence that only occurs in the min-token phase, nothing stops early.
    only_first = StoppingParams(max_new_tokens=50, min_new_tokens=8, stop_sequences=("so conf",))
    chunks, decision, _ = generate(bytelevel_tokenizer, text, only_first)
    assert decision is None and "".join(chunks) == text


def test_stop_sequence_on_the_last_token_keeps_the_text(
    bytelevel_tokenizer: RouterTokenizer,
) -> None:
    ids = bytelevel_tokenizer.tokenizer.encode(" I am so confused.", add_special_tokens=False).ids
    stopping = StoppingParams(max_new_tokens=7, stop_sequences=("confu",))
    chunks, decision, count = generate(bytelevel_tokenizer, " I am so confused.", stopping)
    assert len(ids) > 7 and count == 7
    assert decision == StopDecision(StopReason.MAX_TOKENS)
    assert "".join(chunks) == " I am so confus"  # not trimmed at the stop sequence
