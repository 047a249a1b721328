"""An MLP speculator (``--speculator-name`` naming an ``MLPSpeculatorPreTrainedModel``
checkpoint, the format IBM's fms-extras trains and TGIS and vLLM read): ``n_predict``
small heads that draft from the target's own final hidden state, with no KV cache.

The checkpoint: ``config.json`` (``emb_dim``, the target's hidden size; ``inner_dim``, 0
meaning ``emb_dim``; ``vocab_size``; ``n_predict``; optional ``scale_input`` and
``tie_weights``) and, per head ``i``, ``emb.{i}.weight`` [vocab, inner], ``proj.{i}.weight``
([inner, emb] for the first head, [inner, inner] after), ``head.{i}.weight`` [vocab,
inner] and ``ln.{i}.weight`` / ``ln.{i}.bias`` [inner]. With ``tie_weights`` the heads share
``emb.0``, ``proj.1`` (after the first), ``head.0`` and ``ln.0``.

Drafting, from the hidden row ``h`` of the position that produced the last known token
``t``: ``state = h`` (with ``scale_input``, a parameter-free norm of it divided by √2); then
for each head ``i``: ``state = gelu(ln_i(proj_i(state) + emb_i(t) · emb_weight /
state_weight))``, ``t = argmax(head_i(state))``, the ``i``-th draft, where ``state_weight
= 0.5 ** (0.5 / n_predict)``, ``emb_weight = sqrt((1 - state_weight²) · inner / 2)`` and
``ln`` divides by the root mean square (eps 1e-6) before its weight and bias.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError

__all__ = ["MLPSpeculator", "is_mlp_speculator", "load_mlp_speculator"]

ARCHITECTURE = "MLPSpeculatorPreTrainedModel"
MODEL_TYPE = "mlp_speculator"
EPS = 1e-6


def is_mlp_speculator(model_dir: Path) -> bool:
    """Whether ``model_dir``'s config.json names an MLP speculator."""
    path = model_dir / "config.json"
    if not path.is_file():
        return False
    config = json.loads(path.read_text(encoding="utf-8"))
    return ARCHITECTURE in (config.get("architectures") or ()) or (
        config.get("model_type") == MODEL_TYPE
    )


@dataclass
class MLPSpeculator:
    """The heads' weights (one entry per head, tied ones repeated)."""

    emb: list[torch.Tensor]  # [vocab, inner]
    proj: list[torch.Tensor]  # [inner, emb] first, [inner, inner] after
    head: list[torch.Tensor]  # [vocab, inner]
    ln_weight: list[torch.Tensor]
    ln_bias: list[torch.Tensor]
    scale_input: bool = False

    @property
    def n_predict(self) -> int:
        return len(self.head)

    @property
    def emb_dim(self) -> int:
        return self.proj[0].shape[1]

    @property
    def vocab_size(self) -> int:
        return self.head[0].shape[0]

    @property
    def weights(self) -> tuple[float, float]:
        """(state_weight, emb_weight)."""
        state_weight = 0.5 ** (0.5 / self.n_predict)
        inner = self.proj[0].shape[0]
        return state_weight, math.sqrt((1 - state_weight**2) * (inner / 2))

    def step(
        self, index: int, state: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``index``: (its state [rows, inner], its float32 logits [rows, vocab]) from
        the previous state (the target's hidden rows for the first head) and the last
        tokens [rows] (differentiable: a test fits a speculator through it)."""
        state_weight, emb_weight = self.weights
        if index == 0 and self.scale_input:
            state = _rms(state.float()).to(state.dtype) / math.sqrt(2)
        z = self.emb[index][tokens]
        state = state @ self.proj[index].T + z * (emb_weight / state_weight)
        normed = _rms(state.float()) * self.ln_weight[index].float() + self.ln_bias[index].float()
        state = F.gelu(normed).to(state.dtype)
        return state, (state @ self.head[index].T).float()


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def load_mlp_speculator(
    model_dir: Path,
    device: torch.device,
    dtype: torch.dtype,
    hidden_size: int | None,
    vocab: int,
) -> MLPSpeculator:
    """The speculator in ``model_dir``, checked against the target's hidden size (None:
    unknown) and vocabulary (StartupError where they differ or a weight is missing)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    n_predict = int(config.get("n_predict", 0))
    if n_predict < 1:
        raise StartupError(f"n_predict ({n_predict}) must be at least 1")
    emb_dim = int(config.get("emb_dim", 0))
    if hidden_size is not None and emb_dim != hidden_size:
        raise StartupError(
            f"its emb_dim ({emb_dim}) is not the model's hidden size ({hidden_size})"
        )
    tied = bool(config.get("tie_weights", False))
    weights = Weights(model_dir, device, dtype)
    try:

        def get(kind: str, i: int, suffix: str = "weight") -> torch.Tensor:
            shared = {"proj": min(i, 1)}.get(kind, 0) if tied else i
            for name in (f"{kind}.{i}.{suffix}", f"{kind}.{shared}.{suffix}"):
                for full in (name, f"speculator.{name}"):
                    if full in weights:
                        return weights.get(full)
            raise StartupError(f"its weight {kind}.{i}.{suffix} is missing")

        heads = range(n_predict)
        model = MLPSpeculator(
            emb=[get("emb", i) for i in heads],
            proj=[get("proj", i) for i in heads],
            head=[get("head", i) for i in heads],
            ln_weight=[get("ln", i) for i in heads],
            ln_bias=[get("ln", i, "bias") for i in heads],
            scale_input=bool(config.get("scale_input", False)),
        )
    finally:
        weights.close()
    if model.vocab_size != vocab or model.emb[0].shape[0] != vocab:
        raise StartupError(
            f"its vocabulary has {model.vocab_size} tokens, the model's {vocab}; a "
            "speculator must share the model's tokenizer"
        )
    return model
