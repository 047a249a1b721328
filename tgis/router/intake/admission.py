"""Admission: everything a generation call goes through before its inputs are queued.

The servicer (``edge/servicer.py``) converts the protobuf request into a
:class:`GenerationCall` and asks :class:`Admission`, in this order: the client batch size
(``--max-client-batch-size``), concurrency permits (one per input, all or nothing), then
:meth:`Admission.validate`: the request-wide parameter rules, the adapter and the prompt
prefix (asked of the shard through their caches), tokenization, and the per-input rules,
giving one :class:`ValidatedRequest` per input. Every refusal is a ``RouterError`` raised
after its failure metric is recorded; the servicer only turns it into a status.

Metrics as TGIS: the raw length of every tokenized input (also of inputs refused
afterwards), then for a valid request each input's length and requested max_new_tokens and,
once, the validation time since the RPC arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from tgis.router.core.shard_client import (
    AdapterLookupError,
    PrefixLookupError,
    ShardError,
)
from tgis.router.errors import OverloadedError, ValidationError
from tgis.router.intake.adapters import AdapterKinds
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.guided import GrammarCompiler
from tgis.router.intake.limits import client_batch_size_error
from tgis.router.intake.prefixes import PrefixInfos
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import (
    ADAPTERS_DISABLED_MESSAGE,
    PREFIX_WITH_PROMPT_TUNING_MESSAGE,
    ServerLimits,
    adapter_lookup_error,
    check_adapter_id,
    prefix_lookup_error,
    tokenizer_validation_error,
    unsupported_adapter_error,
    validate_inputs,
    validate_params,
)
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import (
    NO_ADAPTERS,
    GenerationParams,
    GuidedKind,
    GuidedRequest,
    ResolvedAdapters,
    ValidatedRequest,
)
from tgis.shard_api.messages import AdapterInfo, AdapterKind, PrefixInfo

__all__ = ["GUIDED_UNAVAILABLE_MESSAGE", "Admission", "CompileObserver", "GenerationCall"]

CompileObserver = Callable[[GuidedKind, float, float, "str | None"], None]
"""Told of a guided constraint's compilation: (kind, start, end, error or None), monotonic
seconds; the call's span records it (``edge/tracing.py``)."""

GUIDED_UNAVAILABLE_MESSAGE = "guided decoding is not available: the model has no EOS token"


@dataclass(frozen=True, slots=True)
class GenerationCall:
    """A Generate or GenerateStream call in plain terms (``edge/fmaas.py: generation_call``)."""

    texts: tuple[str, ...]
    params: GenerationParams
    prefix_id: str | None = None
    """TGIS's ``prefix_id``: None when absent; present, even as "", it names a prefix."""
    adapter_id: str = ""
    """vllm-tgis-adapter's ``adapter_id``: "" when absent or empty (no adapter)."""
    add_special_tokens: bool = True
    """False for texts that carry their special tokens already (a rendered chat template)."""
    token_ids: tuple[tuple[int, ...], ...] | None = None
    """The inputs as token ids (OpenAI's prompts given as ids), taken as they are instead of
    tokenizing ``texts`` (which then hold their decoded text); None: tokenize."""


def _check_token_ids(params: GenerationParams, vocab_size: int | None) -> None:
    """Every ``logit_bias`` id is in the model's vocabulary: the shard checks it too, and
    would fail the request during generation (a 500) where this refuses it (a 400)."""
    if vocab_size is None:
        return
    bad = next((t for t, _ in params.sampling.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValidationError(
            f"logit_bias token id {bad} is not in the model's vocabulary (size {vocab_size})"
        )


async def _no_prefixes(prefix_id: str) -> PrefixInfo:
    """The lookup of a router without a shard: no prefix exists (the shard's message)."""
    raise PrefixLookupError(f'prefix id "{prefix_id}" not found')


class Admission:
    """The checks and lookups between a call's arrival and its inputs' queueing.

    ``prefixes``: where prompt-prefix lengths come from (the shard, through a cache); None
    for a router without a shard, which finds no prefix. ``adapters``: where adapters' kinds
    come from (the shard's adapter cache, through a cache); None when the shard has no
    adapter cache, so that every ``adapter_id`` is refused. ``grammars``: compiles guided
    decoding constraints (None: every constrained request is refused). ``vocab_size``: the
    model's, which token ids a request names (the OpenAI routes' ``logit_bias``) must be
    under (None: not checked).
    """

    def __init__(
        self,
        *,
        tokenizer: RouterTokenizer,
        limits: ServerLimits,
        limiter: ConcurrencyLimiter,
        metrics: Metrics,
        prefixes: PrefixInfos | None = None,
        adapters: AdapterKinds | None = None,
        grammars: GrammarCompiler | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.limits = limits
        self.limiter = limiter
        self.metrics = metrics
        self.prefixes = prefixes if prefixes is not None else PrefixInfos(_no_prefixes, metrics)
        self.adapters = adapters
        self.grammars = grammars

    # ---- before validation ----------------------------------------------------------------

    def check_batch_size(self, count: int) -> None:
        """Refuse a Generate call with more inputs than ``--max-client-batch-size``
        (counted as a validation failure)."""
        error = client_batch_size_error(count, self.limits.max_client_batch_size)
        if error is not None:
            self.metrics.request_failure("validation")
            raise ValidationError(error)

    @contextmanager
    def permits(self, count: int) -> Iterator[None]:
        """Hold ``count`` concurrency permits for the block (all or nothing).

        Raises:
            OverloadedError: not enough permits (``Model is overloaded``), counted as
                ``conc_limit``; nothing is held then.
        """
        if not self.limiter.try_acquire(count):
            self.metrics.request_failure("conc_limit")
            raise OverloadedError()
        try:
            yield
        finally:
            self.limiter.release(count)

    # ---- validation -----------------------------------------------------------------------

    async def validate(
        self, call: GenerationCall, arrival: float, on_compile: CompileObserver | None = None
    ) -> list[ValidatedRequest]:
        """Check the parameters, resolve the adapter and the prompt prefix, tokenize and
        check every input (first error wins); ``on_compile`` is told when and how a guided
        constraint was compiled.

        Raises:
            ValidationError: the first refusal, counted as a validation failure.
        """
        try:
            validated = await self._validate(call, on_compile)
        except ValidationError:
            self.metrics.request_failure("validation")
            raise
        for v in validated:
            # The requested max_new_tokens (params), not the one lowered to fit (TOKEN_LIMIT).
            self.metrics.input_validated(v.input_length, v.params.stopping.max_new_tokens)
        self.metrics.validation_done(time.monotonic() - arrival)
        return validated

    async def _validate(
        self, call: GenerationCall, on_compile: CompileObserver | None
    ) -> list[ValidatedRequest]:
        validate_params(call.params, self.limits)
        _check_token_ids(call.params, self.vocab_size)
        adapters = await self.resolve_adapters(call.prefix_id, call.adapter_id)
        if call.token_ids is None:
            encoded = await self._encode(call.texts, call.add_special_tokens)
        else:
            encoded = self._given_ids(call.token_ids)
        validated = validate_inputs(
            call.texts,
            encoded,
            call.params,
            self.limits,
            adapters=adapters,
            bos_token_id=self.tokenizer.bos_token_id if call.add_special_tokens else None,
        )
        if call.params.guided is None:
            return validated
        grammar = await self._grammar(call.params.guided, on_compile)
        return [replace(v, sampling=replace(v.sampling, grammar=grammar)) for v in validated]

    async def _grammar(self, guided: GuidedRequest, on_compile: CompileObserver | None) -> str:
        """The compiled constraint (last: the other checks are cheaper)."""
        if self.grammars is None:
            raise ValidationError(GUIDED_UNAVAILABLE_MESSAGE)
        start = time.monotonic()
        try:
            grammar = await self.grammars.compile(guided)
        except ValidationError as err:
            if on_compile is not None:
                on_compile(guided.kind, start, time.monotonic(), err.message)
            raise
        if on_compile is not None:
            on_compile(guided.kind, start, time.monotonic(), None)
        return grammar

    async def _encode(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """The inputs' token ids (rule 13 when the tokenizer fails); every raw length is
        recorded, also of inputs refused afterwards."""
        try:
            encoded = await self.tokenizer.encode_batch_async(texts, add_special_tokens)
        except Exception as err:
            raise tokenizer_validation_error(err) from err
        for ids in encoded:
            self.metrics.input_tokenized(len(ids))
        return encoded

    def _given_ids(self, token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Inputs given as token ids, each id in the vocabulary when its size is known;
        their lengths recorded as tokenized inputs' are."""
        for ids in token_ids:
            self.metrics.input_tokenized(len(ids))
            size = self.vocab_size
            bad = next((t for t in ids if size is not None and not 0 <= t < size), None)
            if bad is not None:
                raise ValidationError(
                    f"prompt token id {bad} is not in the model's vocabulary (size {size})"
                )
        return [list(ids) for ids in token_ids]

    # ---- adapters and prompt prefixes -----------------------------------------------------

    async def resolve_adapters(self, prefix_id: str | None, adapter_id: str) -> ResolvedAdapters:
        """The call's adapter and prompt prefix (validation rules 12a-12d, then 12):

        * ``adapter_id`` ("": none) is refused when the shard has no adapter cache
          (``adapter_id supplied but no adapter store was configured``) or when it is not a
          valid id (checked here, before any RPC); otherwise the shard is asked its kind
          (``AdapterKinds``, cached), its refusals going to the client verbatim;
        * ``prefix_id`` (when set, even to "") keeps TGIS's meaning: a prompt-tuning prefix
          whose length the shard tells (rule 12). It goes with a LoRA adapter, not with a
          prompt-tuning one (``prefix_id and a prompt-tuning adapter_id cannot be
          combined``), whose virtual tokens stand in for a prefix's instead.

        Raises:
            ValidationError: the first refusal.
        """
        adapter: AdapterInfo | None = None
        if adapter_id:
            if self.adapters is None:
                raise ValidationError(ADAPTERS_DISABLED_MESSAGE)
            check_adapter_id(adapter_id)
            adapter = await self._adapter_info(self.adapters, adapter_id)
        kind = None if adapter is None else adapter.kind
        if prefix_id is not None:
            if kind is AdapterKind.PROMPT_TUNING:
                raise ValidationError(PREFIX_WITH_PROMPT_TUNING_MESSAGE)
            prefix = await self._prefix_info(prefix_id)
            return ResolvedAdapters(
                prefix_id,
                prefix.length,
                adapter_id,
                kind,
                prefix_version=prefix.version,
                adapter_version="" if adapter is None else adapter.version,
            )
        if adapter is None:
            return NO_ADAPTERS
        prefix_length = adapter.prefix_length if kind is AdapterKind.PROMPT_TUNING else 0
        return ResolvedAdapters(
            "", prefix_length, adapter_id, kind, adapter_version=adapter.version
        )

    def forget_lookups(self, request: ValidatedRequest) -> None:
        """Look ``request``'s prefix and adapter up again next time (it failed during
        generation, perhaps because the shard holds other contents for them now)."""
        if request.prefix_id:
            self.prefixes.forget(request.prefix_id)
        if request.adapter_id and self.adapters is not None:
            self.adapters.forget(request.adapter_id)

    @staticmethod
    async def _adapter_info(adapters: AdapterKinds, adapter_id: str) -> AdapterInfo:
        """The adapter's kind (rule 12c: ValidationError when the shard refuses it, with
        its message as is, or cannot tell)."""
        try:
            adapter = await adapters.get(adapter_id)
        except AdapterLookupError as err:
            raise ValidationError(err.message) from err
        except ShardError as err:
            raise adapter_lookup_error(adapter_id, err.detail) from err
        if adapter.is_lora and not adapters.lora_supported:
            raise unsupported_adapter_error("LORA")
        return adapter

    async def _prefix_info(self, prefix_id: str) -> PrefixInfo:
        """The prompt prefix's virtual tokens and version (rule 12: ValidationError when the
        shard cannot tell, with its message)."""
        try:
            return await self.prefixes.get(prefix_id)
        except PrefixLookupError as err:
            raise prefix_lookup_error(prefix_id, err.message) from err
        except ShardError as err:
            raise prefix_lookup_error(prefix_id, err.detail) from err
