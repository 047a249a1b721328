"""Protobuf ↔ the plain contract types (``messages.py``), in both directions.

The router encodes plans and decodes outputs, the shard the other way round; both use these
functions, so a field can only mean one thing. Unset proto3 fields read as 0; where 0 is not
a meaningful value it reads as "disabled": ``top_p``, ``typical_p`` and
``repetition_penalty`` of 0 (or less) become 1.0.
"""

from __future__ import annotations

from tgis.pb import shard_pb2
from tgis.shard_api.messages import (
    AdapterInfo,
    AdapterKind,
    DetailOptions,
    InputTokenDetails,
    LengthPenalty,
    ModelKind,
    NewSequence,
    PrefixInfo,
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

# ---- StepRequest -----------------------------------------------------------------------------


def sampling_to_pb(params: SamplingParams) -> shard_pb2.SamplingParams:
    pb = shard_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        typical_p=params.typical_p,
        repetition_penalty=params.repetition_penalty,
        min_new_tokens=params.min_new_tokens,
        grammar=params.grammar,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=dict(params.logit_bias),
        min_p=params.min_p,
    )
    if params.seed is not None:
        pb.seed = params.seed
    if params.length_penalty is not None:
        pb.length_penalty.start_index = params.length_penalty.start_index
        pb.length_penalty.decay_factor = params.length_penalty.decay_factor
    return pb


def sampling_from_pb(pb: shard_pb2.SamplingParams) -> SamplingParams:
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
        grammar=pb.grammar,
        presence_penalty=pb.presence_penalty,
        frequency_penalty=pb.frequency_penalty,
        logit_bias=tuple(sorted(pb.logit_bias.items())),
        min_p=pb.min_p,
    )


def _details_to_pb(d: DetailOptions) -> shard_pb2.TokenDetailOptions:
    return shard_pb2.TokenDetailOptions(
        logprobs=d.logprobs,
        ranks=d.ranks,
        top_n=d.top_n,
        input_tokens=d.input_tokens,
        generated_tokens=d.generated_tokens,
    )


def _details_from_pb(pb: shard_pb2.TokenDetailOptions) -> DetailOptions:
    return DetailOptions(
        logprobs=pb.logprobs,
        ranks=pb.ranks,
        top_n=pb.top_n,
        input_tokens=pb.input_tokens,
        generated_tokens=pb.generated_tokens,
    )


_GREEDY = SamplingParams()
_NO_DETAILS = DetailOptions()


def plan_to_pb(plan: StepPlan) -> shard_pb2.StepRequest:
    pb = shard_pb2.StepRequest(
        step_id=plan.step_id,
        finished_request_ids=plan.finished_request_ids,
        preempted_request_ids=plan.preempted_request_ids,
        base_step_id=plan.base_step_id,
    )
    for ns in plan.new_sequences:
        entry = pb.new_sequences.add(request_id=ns.request_id, prompt_token_ids=ns.prompt_token_ids)
        if ns.prefix_id:
            entry.prefix_id = ns.prefix_id
        if ns.prefix_length:  # a prefix's or a prompt-tuning adapter's virtual tokens
            entry.prefix_length = ns.prefix_length
        if ns.adapter_id:
            entry.adapter_id = ns.adapter_id
        if ns.prefix_version:
            entry.prefix_version = ns.prefix_version
        if ns.adapter_version:
            entry.adapter_version = ns.adapter_version
        if ns.sampling != _GREEDY:
            entry.sampling.CopyFrom(sampling_to_pb(ns.sampling))
        if ns.details != _NO_DETAILS:
            entry.details.CopyFrom(_details_to_pb(ns.details))
    add = pb.scheduled.add
    for s in plan.scheduled:
        add(
            request_id=s.request_id,
            num_tokens=s.num_tokens,
            new_block_ids=s.new_block_ids,
            cached_tokens=s.cached_tokens,
            draft_token_ids=s.draft_token_ids,
            spec_tokens=s.spec_tokens,
            state_slot=s.state_slot,
        )
    return pb


def plan_from_pb(pb: shard_pb2.StepRequest) -> StepPlan:
    return StepPlan(
        step_id=pb.step_id,
        new_sequences=tuple(
            NewSequence(
                request_id=ns.request_id,
                prompt_token_ids=tuple(ns.prompt_token_ids),
                sampling=sampling_from_pb(ns.sampling) if ns.HasField("sampling") else _GREEDY,
                details=_details_from_pb(ns.details) if ns.HasField("details") else _NO_DETAILS,
                prefix_id=ns.prefix_id,
                prefix_length=ns.prefix_length,
                adapter_id=ns.adapter_id,
                prefix_version=ns.prefix_version,
                adapter_version=ns.adapter_version,
            )
            for ns in pb.new_sequences
        ),
        scheduled=tuple(
            ScheduledSequence(
                s.request_id,
                s.num_tokens,
                tuple(s.new_block_ids),
                s.cached_tokens,
                tuple(s.draft_token_ids),
                s.spec_tokens,
                s.state_slot if s.HasField("state_slot") else None,
            )
            for s in pb.scheduled
        ),
        finished_request_ids=tuple(pb.finished_request_ids),
        preempted_request_ids=tuple(pb.preempted_request_ids),
        base_step_id=pb.base_step_id,
    )


# ---- StepResponse ----------------------------------------------------------------------------


def _detail_to_pb(detail: TokenDetail, out: shard_pb2.TokenDetail) -> None:
    out.token_id = detail.token_id
    if detail.logprob:
        out.logprob = detail.logprob
    if detail.rank:
        out.rank = detail.rank
    for top in detail.top_tokens:
        out.top_tokens.add(token_id=top.token_id, logprob=top.logprob)


def _detail_from_pb(pb: shard_pb2.TokenDetail) -> TokenDetail:
    if not pb.top_tokens and not pb.logprob and not pb.rank:
        return TokenDetail(pb.token_id)
    return TokenDetail(
        token_id=pb.token_id,
        logprob=pb.logprob,
        rank=pb.rank,
        top_tokens=tuple(TopToken(t.token_id, t.logprob) for t in pb.top_tokens),
    )


def output_to_pb(output: StepOutput) -> shard_pb2.StepResponse:
    pb = shard_pb2.StepResponse(step_id=output.step_id, forward_time_ns=output.forward_time_ns)
    add = pb.tokens.add
    for sampled in output.tokens:
        _detail_to_pb(sampled.token, add(request_id=sampled.request_id).token)
    for inputs in output.input_tokens:
        entry = pb.input_tokens.add(request_id=inputs.request_id)
        for detail in inputs.tokens:
            _detail_to_pb(detail, entry.tokens.add())
    for error in output.errors:
        pb.errors.add(
            request_id=error.request_id, message=error.message, constraint=error.constraint
        )
    return pb


def output_from_pb(pb: shard_pb2.StepResponse) -> StepOutput:
    return StepOutput(
        step_id=pb.step_id,
        tokens=tuple(SampledToken(t.request_id, _detail_from_pb(t.token)) for t in pb.tokens),
        input_tokens=tuple(
            InputTokenDetails(it.request_id, tuple(_detail_from_pb(t) for t in it.tokens))
            for it in pb.input_tokens
        ),
        errors=tuple(SequenceError(e.request_id, e.message, e.constraint) for e in pb.errors),
        forward_time_ns=pb.forward_time_ns,
    )


# ---- InfoResponse ----------------------------------------------------------------------------


def info_to_pb(info: ShardInfo) -> shard_pb2.InfoResponse:
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
        step_channel=info.step_channel,
        adapters_enabled=info.adapters_enabled,
        max_loras=info.max_loras,
        kv_window=info.kv_window,
        prefix_caching=info.prefix_caching,
        speculation=info.speculation,
        draft_model=info.draft_model,
        state_slots=info.state_slots,
    )


def info_from_pb(pb: shard_pb2.InfoResponse) -> ShardInfo:
    return ShardInfo(
        model_kind=ModelKind(pb.model_kind),
        eos_token_ids=tuple(pb.eos_token_ids),
        vocab_size=pb.vocab_size,
        block_size=pb.block_size,
        num_blocks=pb.num_blocks,
        world_size=pb.world_size,
        max_position_embeddings=pb.max_position_embeddings,
        model_type=pb.model_type,
        dtype=pb.dtype,
        device=pb.device,
        attention_backend=pb.attention_backend,
        step_channel=pb.step_channel,
        adapters_enabled=pb.adapters_enabled,
        max_loras=pb.max_loras,
        kv_window=pb.kv_window,
        prefix_caching=pb.prefix_caching,
        speculation=pb.speculation,
        draft_model=pb.draft_model,
        state_slots=pb.state_slots,
    )


# ---- AdapterLookupResponse -------------------------------------------------------------------


def adapter_to_pb(adapter: AdapterInfo) -> shard_pb2.AdapterLookupResponse:
    return shard_pb2.AdapterLookupResponse(
        kind=shard_pb2.AdapterKind.Name(adapter.kind.value),
        prefix_length=adapter.prefix_length,
        version=adapter.version,
    )


def adapter_from_pb(pb: shard_pb2.AdapterLookupResponse) -> AdapterInfo:
    return AdapterInfo(
        kind=AdapterKind(pb.kind), prefix_length=pb.prefix_length, version=pb.version
    )


# ---- PrefixLookupResponse --------------------------------------------------------------------


def prefix_to_pb(prefix: PrefixInfo) -> shard_pb2.PrefixLookupResponse:
    return shard_pb2.PrefixLookupResponse(prefix_length=prefix.length, version=prefix.version)


def prefix_from_pb(pb: shard_pb2.PrefixLookupResponse) -> PrefixInfo:
    return PrefixInfo(length=pb.prefix_length, version=pb.version)
