"""Model implementations and the registry that maps Hugging Face architectures to them: one
module per family (``llama``, ``llama_moe``, ``gpt_bigcode``, ``gpt_neox``, ``falcon``,
``starcoder2``, ...) over the shared decoder (``decoder``: ``DecoderLM``), its layers
(``layers``) and rotary embeddings (``rotary``); a new family is a module here and an
entry in the registry below."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from tgis.shard.adapters.lora_layout import LoraSite
from tgis.shard.checkpoints.model_config import ModelConfig
from tgis.shard.checkpoints.weights import Weights
from tgis.shard.errors import StartupError
from tgis.shard.native.attention.interface import AttentionBackend
from tgis.shard.native.attention.kv_cache import KVCache, KVCacheSpec
from tgis.shard.native.linear.lora_rows import LoraRows
from tgis.shard.native.models.decoder import EmbeddingRows
from tgis.shard.native.models.falcon import FalconForCausalLM
from tgis.shard.native.models.gemma2 import Gemma2ForCausalLM
from tgis.shard.native.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from tgis.shard.native.models.gpt_bigcode import GPTBigCodeForCausalLM
from tgis.shard.native.models.gpt_neox import GPTNeoXForCausalLM
from tgis.shard.native.models.gpt_oss import GptOssForCausalLM
from tgis.shard.native.models.granite_hybrid import GraniteHybridForCausalLM
from tgis.shard.native.models.layers import Shapes
from tgis.shard.native.models.llama import LlamaForCausalLM
from tgis.shard.native.models.llama_moe import LlamaMoeForCausalLM
from tgis.shard.native.models.olmo2 import Olmo2ForCausalLM
from tgis.shard.native.models.phi3 import Phi3ForCausalLM
from tgis.shard.native.models.qwen3 import Qwen3ForCausalLM
from tgis.shard.native.models.starcoder2 import Starcoder2ForCausalLM


class CausalLM(Protocol):
    """What the model runner needs from a decoder-only model."""

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        """The shape of one KV-cache block."""
        ...

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: Any,
        rows: EmbeddingRows | None = None,
        lora: LoraRows | None = None,
    ) -> torch.Tensor:
        """Final hidden states [tokens, hidden] of the flattened batch; ``rows`` replace
        the vocabulary embeddings of some rows (prompt-tuning prefixes), ``lora`` adds
        LoRA adapters' deltas to some rows."""
        ...

    def lora_sites(self) -> list[LoraSite]:
        """The linear layers LoRA adapters may target (``DecoderLM.lora_sites``)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [rows, vocab] of selected hidden rows."""
        ...


ForwardFn = Callable[[torch.Tensor, torch.Tensor, KVCache, Any], torch.Tensor]
"""``forward(input_ids, positions, kv_cache, attention metadata)`` → final hidden states: a
model's eager ``forward``, or ``compiled.CompiledForward``."""


class ModelFactory(Protocol):
    """A model class: its constructor, the check of a config before any weight is read, and
    the checkpoint layout it reads."""

    def __call__(
        self,
        config: ModelConfig,
        weights: Weights,
        attention: AttentionBackend,
        max_sequence_length: int,
    ) -> CausalLM: ...

    def check_config(self, config: ModelConfig, max_sequence_length: int) -> None:
        """StartupError for a variant of the architecture the class cannot run."""
        ...

    def checkpoint_shapes(self, config: ModelConfig, max_sequence_length: int) -> Shapes:
        """Every tensor a checkpoint of ``config`` holds, by name, with its full shape (the
        names the class reads); what ``--load-format dummy`` creates instead."""
        ...


# Hugging Face ``architectures[0]`` → implementation. Granite and Qwen2 are Llama with a
# few options, chosen by ``model_type`` (``LlamaArgs``).
ARCHITECTURES: dict[str, ModelFactory] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "GraniteForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaMoeForCausalLM,
    "Qwen2MoeForCausalLM": LlamaMoeForCausalLM,
    "Qwen3MoeForCausalLM": LlamaMoeForCausalLM,
    "GraniteMoeForCausalLM": LlamaMoeForCausalLM,
    "GraniteMoeHybridForCausalLM": GraniteHybridForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "GPTNeoXForCausalLM": GPTNeoXForCausalLM,
    "FalconForCausalLM": FalconForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Starcoder2ForCausalLM": Starcoder2ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # its language model
    "GptOssForCausalLM": GptOssForCausalLM,
    "RWForCausalLM": FalconForCausalLM,  # Falcon's original remote-code checkpoints
}
# Fallback when a config names no architecture.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "gpt_bigcode": "GPTBigCodeForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "falcon": "FalconForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
    "RefinedWeb": "RWForCausalLM",
    "RefinedWebModel": "RWForCausalLM",
}


def model_class(config: ModelConfig) -> ModelFactory:
    """The implementation for ``config``; StartupError naming the architecture otherwise."""
    arch = config.architecture or MODEL_TYPES.get(config.model_type, "")
    factory = ARCHITECTURES.get(arch)
    if factory is None:
        name = config.architecture or config.model_type
        raise StartupError(
            f"unsupported model architecture '{name}' (model_type '{config.model_type}'); "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    return factory


def check_config(config: ModelConfig, max_sequence_length: int) -> None:
    """StartupError, before any weight is read, when the native implementation cannot run
    ``config``: an unknown architecture or an unsupported variant of a known one (ALiBi,
    sliding window, a rope type, ...). Loading raises the same error."""
    try:
        factory = model_class(config)
        _check_mxfp4(config, factory)
        factory.check_config(config, max_sequence_length)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, StartupError):
            raise
        name = config.architecture or config.model_type
        raise StartupError(f"{name}: config.json is missing or has a bad value for {e}") from e


def _check_mxfp4(config: ModelConfig, factory: ModelFactory) -> None:
    """StartupError for an MXFP4 checkpoint of a family other than gpt-oss (the only one
    whose MXFP4 tensors tgis reads: its experts, dequantized at load)."""
    quantization = config.raw.get("quantization_config") or {}
    method = str(quantization.get("quant_method", "")).lower()
    if method == "mxfp4" and factory is not GptOssForCausalLM:
        name = config.architecture or config.model_type
        raise StartupError(
            f"{name}: MXFP4 checkpoints are read for gpt-oss's experts only; serve the "
            "unquantized checkpoint"
        )
