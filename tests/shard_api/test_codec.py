"""The contract's one Python face survives protobuf both ways, as router and shard use it."""

from __future__ import annotations

import math
import pickle

from tgis.pb import shard_pb2
from tgis.shard_api.codec import (
    adapter_from_pb,
    adapter_to_pb,
    info_from_pb,
    info_to_pb,
    output_from_pb,
    output_to_pb,
    plan_from_pb,
    plan_to_pb,
)
from tgis.shard_api.messages import (
    AdapterInfo,
    AdapterKind,
    DetailOptions,
    InputTokenDetails,
    LengthPenalty,
    ModelKind,
    NewSequence,
    SampledToken,
    SamplingParams,
    ScheduledSequence,
    SequenceError,
    ShardInfo,
    StepOutput,
    StepPlan,
    TokenDetail,
    TopToken,
)

PLAN = StepPlan(
    step_id=7,
    new_sequences=(
        NewSequence(3, (1, 2, 3)),
        NewSequence(
            4,
            (5,),
            SamplingParams(
                temperature=0.5,
                top_k=5,
                top_p=0.75,
                typical_p=0.5,
                seed=2**63 + 5,
                repetition_penalty=1.25,
                min_new_tokens=3,
                length_penalty=LengthPenalty(2, 1.5),
                presence_penalty=0.5,
                frequency_penalty=-0.25,
                logit_bias=((3, -100.0), (9, 2.5)),
                min_p=0.125,
            ),
            DetailOptions(logprobs=True, ranks=True, top_n=2, input_tokens=True),
        ),
        NewSequence(5, (7, 8), prefix_id="nested/tuned-1", prefix_length=4),
        # A LoRA adapter with a prefix, and a prompt-tuning adapter's virtual tokens alone.
        NewSequence(6, (9,), prefix_id="p", prefix_length=2, adapter_id="loras/a-1"),
        NewSequence(8, (9, 10), prefix_length=5, adapter_id="tuned"),
    ),
    scheduled=(
        ScheduledSequence(3, 3, (0,)),
        ScheduledSequence(4, 1, (1, 2)),
        ScheduledSequence(5, 7, (3, 4, 5), cached_tokens=32),
        ScheduledSequence(1, 1),
        # A hybrid model's recurrent-state slots: slot 0 is sent, not taken for "none".
        ScheduledSequence(7, 2, (6,), state_slot=0),
        ScheduledSequence(8, 1, state_slot=5),
    ),
    finished_request_ids=(9, 10),
    preempted_request_ids=(2,),
    base_step_id=6,
)

OUTPUT = StepOutput(
    step_id=7,
    tokens=(
        SampledToken(3, TokenDetail(11)),
        SampledToken(4, TokenDetail(12, -0.5, 2, (TopToken(12, -0.5), TopToken(13, -1.5)))),
    ),
    input_tokens=(InputTokenDetails(4, (TokenDetail(5, math.nan), TokenDetail(6, -2.0, 1))),),
    errors=(
        SequenceError(5, "the model produced NaN logits"),
        SequenceError(6, "guided decoding: no token", constraint=True),
    ),
    forward_time_ns=123456,
)


def test_plan_round_trip() -> None:
    wire = plan_to_pb(PLAN).SerializeToString()
    assert plan_from_pb(shard_pb2.StepRequest.FromString(wire)) == PLAN


def test_output_round_trip() -> None:
    back = output_from_pb(
        shard_pb2.StepResponse.FromString(output_to_pb(OUTPUT).SerializeToString())
    )
    first_input = back.input_tokens[0].tokens[0]
    assert math.isnan(first_input.logprob)  # NaN != NaN: compare the rest separately
    assert back.input_tokens[0].tokens[1:] == OUTPUT.input_tokens[0].tokens[1:]
    assert (back.step_id, back.tokens, back.errors, back.forward_time_ns) == (
        OUTPUT.step_id,
        OUTPUT.tokens,
        OUTPUT.errors,
        OUTPUT.forward_time_ns,
    )


def test_info_round_trip() -> None:
    info = ShardInfo(
        model_kind=ModelKind.SEQ2SEQ_LM,
        eos_token_ids=(1, 2),
        vocab_size=32000,
        block_size=16,
        num_blocks=100,
        world_size=2,
        max_position_embeddings=4096,
        model_type="t5",
        dtype="bfloat16",
        device="cuda:0",
        attention_backend="hf",
        step_channel="/tmp/x-0.steps",
        adapters_enabled=True,
        max_loras=3,
        prefix_caching=True,
        state_slots=12,
        kv_window=4096,
    )
    back = info_from_pb(shard_pb2.InfoResponse.FromString(info_to_pb(info).SerializeToString()))
    assert back == info and back.is_seq2seq
    assert (back.adapters_enabled, back.max_loras, back.prefix_caching) == (True, 3, True)
    # An older shard's Info (no adapter fields) reads as adapters disabled, no prefix cache.
    plain = info_from_pb(shard_pb2.InfoResponse(block_size=16))
    assert (plain.adapters_enabled, plain.max_loras, plain.prefix_caching) == (False, 0, False)
    assert plain.kv_window == 0  # no window announced: no block goes early


def test_adapter_lookup_response_round_trip() -> None:
    for adapter in (AdapterInfo(AdapterKind.LORA), AdapterInfo(AdapterKind.PROMPT_TUNING, 8)):
        wire = adapter_to_pb(adapter).SerializeToString()
        back = adapter_from_pb(shard_pb2.AdapterLookupResponse.FromString(wire))
        assert back == adapter
        assert back.is_lora is (adapter.kind is AdapterKind.LORA)


def test_unset_fields_read_as_disabled_and_plans_pickle() -> None:
    pb = shard_pb2.StepRequest(step_id=1)
    pb.new_sequences.add(request_id=1, prompt_token_ids=[4]).sampling.temperature = 0.0
    (seq,) = plan_from_pb(pb).new_sequences
    assert seq.sampling == SamplingParams() and seq.details == DetailOptions()
    assert (seq.prefix_id, seq.prefix_length, seq.adapter_id) == ("", 0, "")
    assert pickle.loads(pickle.dumps(PLAN)) == PLAN  # tensor parallelism broadcasts plans
