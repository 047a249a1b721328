"""What the benchmark asks the shard to do: the prompt, the sampling, and the Steps of one
run (a batch prefilled in one Step, then decoded one token per Step)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tgis.model_files import resolve_model_dir
from tgis.shard_api.messages import (
    DetailOptions,
    NewSequence,
    SamplingParams,
    ScheduledSequence,
    ShardInfo,
    StepPlan,
)

FILLER_TEXT = (
    "A benchmark prompt is only a number of tokens: the words repeat until the prompt is as "
    "long as asked, and the model reads them all in the prefill before it decodes."
)
"""Text repeated (then cut) to make the prompt of ``--sequence-length`` tokens."""


class WorkloadError(ValueError):
    """The workload cannot run on this shard (a bad tokenizer, too few blocks, ...)."""


def load_tokenizer(name: str, revision: str | None) -> Tokenizer:
    """The tokenizer of ``name``: a directory with tokenizer.json, or a model id in the local
    Hugging Face cache (nothing is downloaded)."""
    local = Path(name)
    if (local / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(local / "tokenizer.json"))
    try:
        model_dir = resolve_model_dir(name, revision)
    except ValueError as err:
        raise WorkloadError(f"tokenizer {name!r}: {err}") from err
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise WorkloadError(f"tokenizer {name!r}: no tokenizer.json in {model_dir}")
    return Tokenizer.from_file(str(path))


def prompt_ids(tokenizer: Tokenizer, length: int) -> tuple[int, ...]:
    """Exactly ``length`` token ids: the filler text tokenized (special tokens included),
    repeated as often as needed, cut to ``length``."""
    if length < 1:
        raise WorkloadError("--sequence-length must be at least 1")
    once = tokenizer.encode(FILLER_TEXT, add_special_tokens=True).ids
    if not once:
        raise WorkloadError("the tokenizer encodes the filler text as no tokens")
    repeats = -(-length // len(once))
    ids = tokenizer.encode(" ".join([FILLER_TEXT] * repeats), add_special_tokens=True).ids
    while len(ids) < length:  # a tokenizer may merge across repeats
        ids = ids + once
    return tuple(ids[:length])


@dataclass(frozen=True)
class Decoding:
    """TGI's generation flags (None: not given)."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    do_sample: bool = False
    top_n_tokens: int | None = None

    @property
    def samples(self) -> bool:
        """Whether tokens are sampled: ``--do-sample``, or a flag that changes the
        distribution (TGI's rule: a temperature other than 1, top-k, top-p or typical-p
        below 1)."""
        return (
            self.do_sample
            or (self.temperature is not None and self.temperature != 1.0)
            or bool(self.top_k)
            or (self.top_p is not None and self.top_p < 1.0)
            or (self.typical_p is not None and self.typical_p < 1.0)
        )

    def sampling(self) -> SamplingParams:
        """The sequences' parameters: greedy unless ``samples``; seed 0 when sampling."""
        temperature = (self.temperature or 1.0) if self.samples else 0.0
        return SamplingParams(
            temperature=temperature,
            top_k=self.top_k or 0,
            top_p=1.0 if self.top_p is None else self.top_p,
            typical_p=1.0 if self.typical_p is None else self.typical_p,
            seed=0 if self.samples else None,
            repetition_penalty=self.repetition_penalty or 1.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )

    def details(self) -> DetailOptions:
        """Token details: the top-n alternatives of every generated token when asked."""
        if not self.top_n_tokens:
            return DetailOptions()
        return DetailOptions(logprobs=True, top_n=self.top_n_tokens, generated_tokens=True)


def blocks_needed(batch: int, positions: int, block_size: int) -> int:
    """KV blocks a batch of ``batch`` sequences of ``positions`` positions holds."""
    return batch * -(-positions // block_size)


class RunPlans:
    """The Steps of one run for a shard just Reset: step 1 announces and prefills all
    ``batch`` sequences (request ids 0..batch-1, blocks numbered from 0), each later step
    decodes every sequence by one token."""

    def __init__(
        self, info: ShardInfo, batch: int, prompt: tuple[int, ...], decoding: Decoding
    ) -> None:
        self.info = info
        self.batch = batch
        self.prompt = prompt
        self.decoding = decoding
        self._next_block = 0
        self._step = 0
        self._lengths = dict.fromkeys(range(batch), 0)

    def check(self, decode_length: int) -> None:
        """WorkloadError when the shard cannot hold this run."""
        info = self.info
        if max(self.prompt) >= info.vocab_size:
            raise WorkloadError(
                f"the tokenizer's ids reach {max(self.prompt)}, past the model's vocabulary "
                f"({info.vocab_size}): is it the model's tokenizer?"
            )
        needed = blocks_needed(self.batch, len(self.prompt) + decode_length, info.block_size)
        if needed > info.num_blocks:
            raise WorkloadError(
                f"batch size {self.batch} needs {needed} KV blocks, the shard has {info.num_blocks}"
            )
        if info.state_slots and self.batch > info.state_slots:
            raise WorkloadError(
                f"batch size {self.batch} is past the shard's {info.state_slots} state slots"
            )

    def _scheduled(self, rid: int, tokens: int) -> ScheduledSequence:
        before = self._lengths[rid]
        grows = -(-(before + tokens) // self.info.block_size) - -(-before // self.info.block_size)
        blocks = tuple(range(self._next_block, self._next_block + grows))
        self._next_block += grows
        self._lengths[rid] = before + tokens
        slot = rid if self.info.state_slots else None
        return ScheduledSequence(rid, tokens, blocks, state_slot=slot)

    def _plan(
        self, scheduled: tuple[ScheduledSequence, ...], new: tuple[NewSequence, ...] = ()
    ) -> StepPlan:
        self._step += 1
        return StepPlan(self._step, new, scheduled, base_step_id=self._step - 1)

    def prefill(self) -> StepPlan:
        sampling, details = self.decoding.sampling(), self.decoding.details()
        new = tuple(NewSequence(rid, self.prompt, sampling, details) for rid in self._lengths)
        scheduled = tuple(self._scheduled(rid, len(self.prompt)) for rid in self._lengths)
        return self._plan(scheduled, new)

    def decode(self) -> StepPlan:
        return self._plan(tuple(self._scheduled(rid, 1) for rid in self._lengths))
