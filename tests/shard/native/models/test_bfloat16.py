"""The newer native families served in bfloat16 against transformers' float32.

test_families.py checks every family token for token in float32 (tests/conftest.py keeps
``--dtype auto`` at float32 in tests); bfloat16 was checked only on the tiny Llama
(tests/shard/test_device.py). Here one variant of each newer family is loaded with
``dtype="bfloat16"`` on the default CPU backend, prefills three prompts together and decodes
8 tokens each. transformers in float32 is then run on the same tokens (the prompt and what the
runner chose so far), so every step is compared and none is lost when bfloat16 legitimately
picks the runner-up at a near-tie:

- where float32's top-1/top-2 log-probability margin is at least ``MARGIN`` the runner's token
  is float32's top-1, and there are at least ``MIN_CLEAR`` such steps per family;
- at every step the runner's log-probability of its token is within ``LOGPROB_TOLERANCE`` of
  float32's (``MOE_LOGPROB_TOLERANCE`` for the families with experts: a router score within
  bfloat16's error of the next expert's switches that expert in bfloat16, which moves the
  output discretely; transformers' own bfloat16 model moves by the same amount on those
  steps), and within ``MEAN_LOGPROB_TOLERANCE`` on average.

Measured on a processor with native bfloat16 (oneDNN; 24 steps per family): the largest and
mean |logprob gap|; the runner's gaps track transformers' own bfloat16 model's on the same
tokens step by step.

=================  ========  =======  ===========
family             max gap   mean     clear steps
=================  ========  =======  ===========
qwen3              0.043     0.016    10
olmo2              0.047     0.014    10
phi3-longrope      0.079     0.023    14
gemma2             0.009     0.003     4
gemma3             0.013     0.003     4
starcoder2-window  0.025     0.010    13
mistral-window     0.037     0.017    12
mixtral            0.069     0.021    14
qwen3-moe          0.178     0.021    13  (expert switch; transformers bf16: 0.194)
granite-moe        0.014     0.006     5
gpt-oss            0.205     0.025    10  (expert switch; transformers bf16: 0.189)
granite-hybrid     0.045     0.009     6
=================  ========  =======  ===========
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.shard.driving import Router
from tests.shard.families import FAMILIES, PROMPTS
from tests.shard.models import TinyModel
from tests.shard.native.models.test_families import make_runner
from tgis.shard_api.messages import DetailOptions

NEW_TOKENS = 8
LOGPROB_TOLERANCE = 0.12
MOE_LOGPROB_TOLERANCE = 0.25
MEAN_LOGPROB_TOLERANCE = 0.04
MARGIN = 0.25
MIN_CLEAR = 3
MOE_FAMILIES = {"mixtral", "qwen3-moe", "granite-moe", "gpt-oss", "granite-hybrid"}

BF16_FAMILIES = (
    "qwen3",
    "olmo2",
    "phi3-longrope",
    "gemma2",
    "gemma3",
    "starcoder2-window",
    "mistral-window",
    "mixtral",
    "qwen3-moe",
    "granite-moe",
    "gpt-oss",
    "granite-hybrid",
)


@dataclass(frozen=True)
class Comparison:
    """Every step of every prompt: the runner's |logprob gap| to float32, whether float32's
    margin there is clear, and the clear steps where the runner chose another token."""

    gaps: tuple[float, ...]
    clear: tuple[bool, ...]
    mismatches: tuple[str, ...]


def compare_bfloat16(model: TinyModel) -> Comparison:
    """Serve ``PROMPTS`` in bfloat16 and compare each step with float32 transformers run on
    the same tokens (the prompt and what the runner generated so far)."""
    runner = make_runner(model.path, dtype="bfloat16")
    assert runner.info.dtype == "bfloat16"
    router = Router(runner)
    details = DetailOptions(logprobs=True, generated_tokens=True)
    for rid, prompt in PROMPTS.items():
        router.add(rid, prompt, details=details)
    router.step({rid: len(p) for rid, p in PROMPTS.items()})
    for _ in range(NEW_TOKENS - 1):
        router.decode(PROMPTS)
    gaps: list[float] = []
    clear: list[bool] = []
    mismatches: list[str] = []
    for rid, prompt in PROMPTS.items():
        ours = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        ids = torch.tensor([prompt + [d.token_id for d in ours]])
        with torch.no_grad():
            logits = model.hf(ids).logits[0, len(prompt) - 1 : -1].float()
        for step, (detail, step_logits) in enumerate(zip(ours, logits, strict=True)):
            logprobs = torch.log_softmax(step_logits, dim=-1)
            top2 = logprobs.topk(2)
            clear.append((top2.values[0] - top2.values[1]).item() >= MARGIN)
            if clear[-1] and detail.token_id != top2.indices[0].item():
                mismatches.append(f"request {rid} step {step}: {detail.token_id}")
            gaps.append(abs(detail.logprob - logprobs[detail.token_id].item()))
    return Comparison(tuple(gaps), tuple(clear), tuple(mismatches))


@pytest.mark.parametrize("name", BF16_FAMILIES)
def test_bfloat16_is_within_tolerance_of_float32_transformers(name: str, tmp_path: Path) -> None:
    tolerance = MOE_LOGPROB_TOLERANCE if name in MOE_FAMILIES else LOGPROB_TOLERANCE
    result = compare_bfloat16(TinyModel(tmp_path, FAMILIES[name].build(tmp_path)))
    assert len(result.gaps) == len(PROMPTS) * NEW_TOKENS
    assert not result.mismatches, result.mismatches
    assert sum(result.clear) >= MIN_CLEAR, result.clear
    assert max(result.gaps) <= tolerance, result.gaps
    assert sum(result.gaps) / len(result.gaps) <= MEAN_LOGPROB_TOLERANCE, result.gaps
