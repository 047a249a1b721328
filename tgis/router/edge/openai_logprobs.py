"""OpenAI's logprobs bodies from token details (the shard's, as gRPC's ``TokenInfo``).

Completions: ``tokens`` (each token decoded alone), ``token_logprobs``, ``top_logprobs`` (a
dict by token text: alternatives that decode alike share one entry) and ``text_offset``
(where each token's text starts, counted over the tokens' texts from the start of the
choice's text: a stream's offsets go on from the chunk before). With ``echo``, the prompt's
tokens come first, the first one with a null logprob and null alternatives (no position
predicts it; OpenAI and vLLM answer so). Chat: ``{"content": [{token, logprob, bytes,
top_logprobs}]}``. A logprob that is not finite is null (JSON has no NaN).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from tgis.router.intake.tokenization import RouterTokenizer
from tgis.shard_api.messages import TokenDetail

__all__ = ["Logprobs", "joined"]


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Logprobs:
    """Logprobs bodies of one model's tokens."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, tokens: Sequence[TokenDetail], start: int = 0, *, prompt: bool = False
    ) -> tuple[dict[str, Any], int]:
        """The completion logprobs of ``tokens`` whose text starts at offset ``start``
        (``prompt``: the prompt's, its first token unpredicted), and the offset after."""
        texts = [self.text(t.token_id) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(start)
            start += len(text)
        logprobs: list[float | None] = [_finite(t.logprob) for t in tokens]
        tops: list[dict[str, float | None] | None] = [
            {self.text(top.token_id): _finite(top.logprob) for top in t.top_tokens} for t in tokens
        ]
        if prompt and tokens:
            logprobs[0] = tops[0] = None
        body = {
            "tokens": texts,
            "token_logprobs": logprobs,
            "top_logprobs": tops,
            "text_offset": offsets,
        }
        return body, start

    def chat(self, tokens: Sequence[TokenDetail]) -> dict[str, Any]:
        return {"content": [self._chat_token(t) for t in tokens]}

    def _chat_token(self, token: TokenDetail) -> dict[str, Any]:
        text = self.text(token.token_id)
        return {
            "token": text,
            "logprob": _finite(token.logprob),
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [
                {
                    "token": (t := self.text(top.token_id)),
                    "logprob": _finite(top.logprob),
                    "bytes": list(t.encode("utf-8")),
                }
                for top in token.top_tokens
            ],
        }


def joined(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Two completion logprobs bodies as one (the prompt's, then the output's)."""
    return {key: first[key] + second[key] for key in first}
