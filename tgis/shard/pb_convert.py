"""Protobuf ↔ plain dataclasses, at the edge of the shard (the only other pb user is the servicer).

Unset proto3 fields read as 0. Where 0 is not a meaningful value the field is read as
"disabled": ``top_p``, ``typical_p`` and ``repetition_penalty`` of 0 (or less) become 1.0.
"""

from __future__ import annotations

from tgis.pb import shard_pb2
from tgis.shard.messages import (
    DetailOptions,
    LengthPenalty,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    ShardInfo,
    StepOutput,
    StepPlan,
    TokenDetail,
)


def sampling_from_pb(pb: shard_pb2.SamplingParams) -> SamplingParams:
    """Decoding parameters of one sequence."""
    length_penalty = None
    if pb.HasField("length_penalty"):
        length_penalty = LengthPenalty(
            start_index=pb.length_penalty.start_index,
            decay_factor=pb.length_penalty.decay_factor,
        )
    return SamplingParams(
        temperature=pb.temperature,
        top_k=pb.top_k,
        top_p=pb.top_p if pb.top_p > 0 else 1.0,
        typical_p=pb.typical_p if pb.typical_p > 0 else 1.0,
        seed=pb.seed if pb.HasField("seed") else None,
        repetition_penalty=pb.repetition_penalty if pb.repetition_penalty > 0 else 1.0,
        min_new_tokens=pb.min_new_tokens,
        length_penalty=length_penalty,
    )


def details_from_pb(pb: shard_pb2.TokenDetailOptions) -> DetailOptions:
    """Which token details to compute."""
    return DetailOptions(
        logprobs=pb.logprobs,
        ranks=pb.ranks,
        top_n=pb.top_n,
        input_tokens=pb.input_tokens,
        generated_tokens=pb.generated_tokens,
    )


def plan_from_pb(pb: shard_pb2.StepRequest) -> StepPlan:
    """A StepRequest as a StepPlan."""
    return StepPlan(
        step_id=pb.step_id,
        new_sequences=tuple(
            NewSequence(
                request_id=ns.request_id,
                prompt_token_ids=tuple(ns.prompt_token_ids),
                sampling=sampling_from_pb(ns.sampling),
                details=details_from_pb(ns.details),
            )
            for ns in pb.new_sequences
        ),
        scheduled=tuple(
            ScheduledSequence(
                request_id=s.request_id,
                num_tokens=s.num_tokens,
                new_block_ids=tuple(s.new_block_ids),
            )
            for s in pb.scheduled
        ),
        finished_request_ids=tuple(pb.finished_request_ids),
        preempted_request_ids=tuple(pb.preempted_request_ids),
    )


def token_detail_to_pb(detail: TokenDetail, out: shard_pb2.TokenDetail) -> None:
    """Fill ``out`` from ``detail``."""
    out.token_id = detail.token_id
    out.logprob = detail.logprob
    out.rank = detail.rank
    for top in detail.top_tokens:
        out.top_tokens.add(token_id=top.token_id, logprob=top.logprob)


def step_output_to_pb(output: StepOutput) -> shard_pb2.StepResponse:
    """A StepOutput as a StepResponse."""
    pb = shard_pb2.StepResponse(step_id=output.step_id, forward_time_ns=output.forward_time_ns)
    for sampled in output.tokens:
        token_detail_to_pb(sampled.token, pb.tokens.add(request_id=sampled.request_id).token)
    for inputs in output.input_tokens:
        entry = pb.input_tokens.add(request_id=inputs.request_id)
        for detail in inputs.tokens:
            token_detail_to_pb(detail, entry.tokens.add())
    for error in output.errors:
        pb.errors.add(request_id=error.request_id, message=error.message)
    return pb


def info_to_pb(info: ShardInfo) -> shard_pb2.InfoResponse:
    """ShardInfo as an InfoResponse."""
    return shard_pb2.InfoResponse(
        model_kind=shard_pb2.ModelKind.Name(info.model_kind.value),
        eos_token_ids=list(info.eos_token_ids),
        vocab_size=info.vocab_size,
        block_size=info.block_size,
        num_blocks=info.num_blocks,
        world_size=info.world_size,
        max_position_embeddings=info.max_position_embeddings,
        model_type=info.model_type,
        dtype=info.dtype,
        device=info.device,
        attention_backend=info.attention_backend,
    )
