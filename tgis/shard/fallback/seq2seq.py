"""The transformers fallback for encoder-decoder models (T5 and other ``AutoModelForSeq2SeqLM``).

A sequence's prompt is the encoder input; its generated tokens are the decoder's. The
router still schedules the prompt like a causal model's (possibly in chunks): chunks that
leave part of the prompt unscheduled compute nothing, and the step that completes the
prompt runs the encoder over the whole prompt once, together with the first decoder step
(the decoder start token), for every sequence completing its prompt in that step, as one
right-padded batch. Its cross-attention keys/values are cached with the self-attention
ones in the engine's ``KVBatch`` (decoder caches left-padded, encoder caches
right-padded).

Decode steps feed every decoding sequence's last token as one ``[rows, 1]`` batch through
transformers' ``EncoderDecoderCache``: the cross-attention keys/values come from the cache,
so the encoder output is passed as a zero-stride placeholder. Left padding is invisible to
T5's relative position buckets; decoders with absolute positions (BART and the like) are
batched only with rows of the same decoder length, one forward per length.

A prompt-tuning prefix (``Sequence.encoder_prefix`` and ``Sequence.prefix``, TGIS's
``encoder.pt`` and ``decoder.pt``) starts the prompt with one placeholder id per row,
encoder rows first: the encoder input is the encoder rows then the embeddings of the rest
of the prompt (``inputs_embeds``), and the decoder's first inputs are the decoder rows then
the decoder start token's embedding (``decoder_inputs_embeds``), so generation continues
after them. Sequences start together only with decoder prefixes of one length (no padding
in the decoder's first forward; a step may run one such forward per length).

Repetition penalty sees the decoder ids only (decoder start token + generated), as TGIS's
seq2seq models do. Input-token details are one entry per prompt token with logprob NaN
when logprobs were asked for, and no ranks or alternatives.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

from tgis.shard.fallback.engine import Forward, Part, combine, forget_rows, in_batch_order
from tgis.shard.fallback.kv import CrossKV, KVBatch, cache_tensors, select
from tgis.shard.step.plan import WorkItem
from tgis.shard.step.sequence import Sequence as ShardSequence
from tgis.shard.step.token_details import first_input_detail
from tgis.shard_api.messages import TokenDetail

# Model types whose decoder positions are relative (left padding changes nothing).
RELATIVE_POSITION_DECODERS = frozenset({"t5", "mt5", "umt5", "longt5", "switch_transformers"})


@dataclass(frozen=True)
class Seq2SeqSpec:
    """Model facts the engine needs besides the model itself."""

    decoder_start_token_id: int
    pad_token_id: int
    encoder_width: int  # hidden size of the encoder output
    relative_positions: bool


class HfSeq2SeqEngine:
    """Batched encoder runs and decoder steps of a transformers encoder-decoder model."""

    def __init__(self, model: Any, device: torch.device, spec: Seq2SeqSpec, empty: KVBatch) -> None:
        self.model = model
        self.device = device
        self.spec = spec
        self._empty = empty
        self._batch = empty

    def reset(self) -> None:
        """Drop every cache row."""
        self._batch = self._empty

    def forget(self, request_ids: Collection[int]) -> None:
        """Drop these sequences' rows at the next re-layout."""
        self._batch = forget_rows(self._batch, request_ids)

    def commit(self, forward: Forward) -> None:
        """Keep the cache the step produced."""
        self._batch = forward.batch

    def history(self, seq: ShardSequence) -> Sequence[int]:
        """Decoder ids only: the start token and the generated tokens."""
        return [self.spec.decoder_start_token_id, *seq.token_ids[seq.prompt_len :]]

    def run(self, work: Sequence[WorkItem], live: Collection[int]) -> Forward:
        """Start the sequences completing their prompt, step the decoding ones."""
        starting = [item for item in work if item.completes_prompt]
        decoding = [item for item in work if item.start >= item.seq.prompt_len]
        parts = [self._decode(group) for group in self._groups(decoding)]
        by_prefix: dict[int, list[WorkItem]] = {}
        for item in starting:  # equal decoder inputs' lengths: no decoder padding
            by_prefix.setdefault(_rows(item.seq.prefix), []).append(item)
        parts.extend(self._start(group) for group in by_prefix.values())
        return combine(parts, self._batch, live)

    def _groups(self, decoding: Sequence[WorkItem]) -> list[list[WorkItem]]:
        """Decode rows that can share a forward (all of them, or those of equal length)."""
        if not decoding:
            return []
        if self.spec.relative_positions:
            return [in_batch_order(decoding, self._batch)]
        by_length: dict[int, list[WorkItem]] = {}
        for item in decoding:
            length = _rows(item.seq.prefix) + item.start - item.seq.prompt_len
            by_length.setdefault(length, []).append(item)
        return list(by_length.values())

    def _start(self, items: Sequence[WorkItem]) -> Part:
        """Encoder over each whole prompt plus the first decoder step(s), one batch (every
        row's decoder prefix is as long)."""
        prompts = [_text(item.seq) for item in items]
        widths = [_rows(i.seq.encoder_prefix) + len(p) for i, p in zip(items, prompts, strict=True)]
        width = max(widths)
        pad = self.spec.pad_token_id
        ids = torch.tensor(
            [p + [pad] * (width - len(p)) for p in prompts], dtype=torch.long, device=self.device
        )
        enc_mask = torch.tensor(
            [[1] * w + [0] * (width - w) for w in widths], dtype=torch.long, device=self.device
        )
        start = torch.full(
            (len(items), 1), self.spec.decoder_start_token_id, dtype=torch.long, device=self.device
        )
        inputs: dict[str, torch.Tensor]
        if any(
            item.seq.prefix is not None or item.seq.encoder_prefix is not None for item in items
        ):
            inputs = self._prefixed_inputs(items, ids, start)
        else:
            inputs = {"input_ids": ids, "decoder_input_ids": start}
        decoder_length = _rows(items[0].seq.prefix) + 1
        out = self.model(
            **inputs,
            attention_mask=enc_mask,
            past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache()),
            use_cache=True,
        )
        keys, values = cache_tensors(out.past_key_values.self_attention_cache)
        cross_keys, cross_values = cache_tensors(out.past_key_values.cross_attention_cache)
        batch = KVBatch(
            rows=tuple(item.seq.request_id for item in items),
            keys=keys,
            values=values,
            mask=torch.ones(len(items), decoder_length, dtype=torch.long, device=self.device),
            packed=True,
            cross=CrossKV(cross_keys, cross_values, enc_mask),
        )
        return Part(
            sample_items=tuple(items),
            logits=out.logits[:, -1].float(),
            batch=batch,
            input_details=self._input_details(items),
        )

    def _prefixed_inputs(
        self, items: Sequence[WorkItem], ids: torch.Tensor, start: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """``inputs_embeds``: each row's encoder prefix rows, then its prompt's embeddings
        (right-padded, as wide as ``ids``); ``decoder_inputs_embeds``: its decoder prefix
        rows, then the decoder start token's embedding."""
        embed = self.model.get_input_embeddings()
        text = embed(ids)
        start_embeds = embed(start)
        encoder = torch.zeros_like(text)
        decoder = []
        for row, item in enumerate(items):
            seq = item.seq
            first = _rows(seq.encoder_prefix)
            if seq.encoder_prefix is not None:
                encoder[row, :first] = seq.encoder_prefix.to(text.dtype)
            length = seq.prompt_len - _virtual(seq)
            encoder[row, first : first + length] = text[row, :length]
            rows = [start_embeds[row]]
            if seq.prefix is not None:
                rows.insert(0, seq.prefix.to(text.dtype))
            decoder.append(torch.cat(rows))
        return {"inputs_embeds": encoder, "decoder_inputs_embeds": torch.stack(decoder)}

    def _decode(self, items: Sequence[WorkItem]) -> Part:
        """One decoder step of ``items`` (each has its last sampled token to feed)."""
        cached = select(self._batch, [item.seq.request_id for item in items])
        if cached.cross is None:
            raise RuntimeError("decoding rows have no encoder cache")
        rows = len(items)
        ids = torch.tensor(
            [[item.seq.token_ids[item.start]] for item in items],
            dtype=torch.long,
            device=self.device,
        )
        ones = torch.ones(rows, 1, dtype=torch.long, device=self.device)
        dec_mask = torch.cat([cached.mask, ones], dim=1)
        enc_mask = cached.cross.mask
        # The decoder reads the encoder output only for its shape: K/V come from the cache.
        placeholder = torch.zeros(
            1, 1, self.spec.encoder_width, dtype=cached.keys[0].dtype, device=self.device
        ).expand(rows, enc_mask.shape[1], -1)
        out = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=placeholder),
            attention_mask=enc_mask,
            decoder_input_ids=ids,
            decoder_attention_mask=dec_mask,
            past_key_values=EncoderDecoderCache(cached.cache(), cached.cross_cache()),
            use_cache=True,
        )
        keys, values = cache_tensors(out.past_key_values.self_attention_cache)
        batch = KVBatch(cached.rows, keys, values, dec_mask, packed=True, cross=cached.cross)
        return Part(tuple(items), out.logits[:, -1].float(), batch)

    @staticmethod
    def _input_details(starting: Sequence[WorkItem]) -> dict[int, list[TokenDetail]]:
        """Text-only prompt details: NaN logprob when asked for, no rank, no alternatives."""
        return {
            item.seq.request_id: [
                first_input_detail(t, item.seq.details)
                for t in item.seq.token_ids[: item.seq.prompt_len]
            ]
            for item in starting
            if item.prompt_details
        }


def _rows(prefix: torch.Tensor | None) -> int:
    """Rows of a prefix tensor (0: none)."""
    return 0 if prefix is None else int(prefix.shape[0])


def _virtual(seq: ShardSequence) -> int:
    """The placeholder ids starting ``seq``'s prompt: its encoder prefix's rows, then its
    decoder prefix's."""
    return _rows(seq.encoder_prefix) + _rows(seq.prefix)


def _text(seq: ShardSequence) -> list[int]:
    """The encoder's input ids: the prompt without its placeholders."""
    return seq.token_ids[_virtual(seq) : seq.prompt_len]
