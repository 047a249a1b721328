"""Every native model family as tiny random transformers models (``FAMILIES``: one per config
variant that changes a code path), the prompts they are driven with and the oracle check
(``assert_matches_hf``: transformers' greedy tokens, logprobs within 1e-4)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.shard.driving import Router
from tests.shard.models import EOS, VOCAB, TinyModel
from tgis.shard_api.messages import DetailOptions

NEW_TOKENS = 10
LOGPROBS = DetailOptions(logprobs=True, ranks=True, generated_tokens=True)


def prompt_of(length: int, seed: int) -> list[int]:
    """A random prompt of token ids (avoiding the special ids 0-2)."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(length)]


PROMPTS = {1: prompt_of(3, 11), 2: prompt_of(12, 12), 3: prompt_of(29, 13)}


_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, eos_token_id=EOS, bos_token_id=1)
_LLAMA_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


@dataclass(frozen=True)
class Family:
    """One config variant: its transformers config and model classes and parameters."""

    config_class: str
    model_class: str
    params: dict[str, Any] = field(default_factory=dict)

    def build(self, path: Path, seed: int = 0, **overrides: Any) -> Any:
        """Build, randomise and save the model to ``path`` (``overrides``: config values
        replacing the family's, such as a larger ``vocab_size``); return the HF reference."""
        params = {**_COMMON, **self.params, **overrides}
        config = getattr(transformers, self.config_class)(**params)
        torch.manual_seed(seed)
        model = getattr(transformers, self.model_class)(config).eval()
        _randomise(model)
        model.save_pretrained(path)
        model.generation_config.eos_token_id = None  # the reference never stops early
        return model


def _randomise(model: torch.nn.Module) -> None:
    """Weights far from the default init, so that logits have no near-ties, and non-zero
    biases and norm parameters, so that a dropped or misplaced one shows."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices, and the 3-D stacks of a mixture's experts
                p.normal_(0.0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:  # norm weights
                p.normal_(1.0, 0.1)


FAMILIES: dict[str, Family] = {
    "granite": Family(
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            _LLAMA_SHAPE,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.4,
            logits_scaling=2.5,
        ),
    ),
    "mixtral": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(_LLAMA_SHAPE, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2),
    ),
    "qwen2-moe": Family(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            _LLAMA_SHAPE,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=64,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "granite-moe": Family(
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(
            _LLAMA_SHAPE,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.4,
            logits_scaling=2.5,
        ),
    ),
    "qwen3-moe": Family(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            _LLAMA_SHAPE,
            head_dim=32,
            moe_intermediate_size=48,
            num_experts=6,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    "qwen2-biases": Family(
        "Qwen2Config", "Qwen2ForCausalLM", dict(_LLAMA_SHAPE, tie_word_embeddings=False)
    ),
    "qwen2-yarn": Family(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            _LLAMA_SHAPE,
            rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=32),
        ),
    ),
    "qwen2-tied": Family(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(_LLAMA_SHAPE, tie_word_embeddings=True, num_key_value_heads=1),
    ),
    "gpt-bigcode-mqa": Family(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=True),
    ),
    "gpt-bigcode-mha": Family(
        "GPTBigCodeConfig",
        "GPTBigCodeForCausalLM",
        dict(n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=False, n_inner=96),
    ),
    "gpt-neox-parallel": Family(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            use_parallel_residual=True,
            rotary_pct=0.25,
            rotary_emb_base=5000,
        ),
    ),
    "gpt-neox-sequential": Family(
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=512,
            use_parallel_residual=False,
            rotary_pct=0.5,
        ),
    ),
    "falcon-new-gqa": Family(
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_kv_heads=2,
            new_decoder_architecture=True,
            tie_word_embeddings=False,
        ),
    ),
    "falcon-old-mqa": Family(
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=False,
            multi_query=True,
            parallel_attn=True,
        ),
    ),
    "falcon-old-sequential-bias": Family(
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            new_decoder_architecture=False,
            multi_query=False,
            parallel_attn=False,
            bias=True,
        ),
    ),
    "qwen3": Family(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(_LLAMA_SHAPE, head_dim=32, attention_bias=True, tie_word_embeddings=False),
    ),
    "olmo2": Family("Olmo2Config", "Olmo2ForCausalLM", dict(_LLAMA_SHAPE)),
    "phi3-longrope": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            _LLAMA_SHAPE,
            pad_token_id=0,
            max_position_embeddings=4096,
            original_max_position_embeddings=256,
            rope_scaling=dict(
                type="longrope",
                short_factor=[1.0 + 0.4 * i for i in range(8)],
                long_factor=[4.0 + i for i in range(8)],
            ),
        ),
    ),
    "phi3-partial": Family(
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(_LLAMA_SHAPE, pad_token_id=0, partial_rotary_factor=0.5),
    ),
    # Sliding windows of 8 keys, shorter than two of the prompts (tests/shard/native/models/
    # test_sliding_window.py): every layer (Mistral, Mixtral, Phi-3), the layers from
    # max_window_layers on (Qwen2, Qwen3: layer 0 full, layer 1 sliding).
    "mistral-window": Family(
        "MistralConfig", "MistralForCausalLM", dict(_LLAMA_SHAPE, sliding_window=8)
    ),
    "qwen2-window": Family(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(_LLAMA_SHAPE, use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "qwen3-window": Family(
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            _LLAMA_SHAPE,
            head_dim=32,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),
    ),
    "phi3-window": Family(
        "Phi3Config", "Phi3ForCausalLM", dict(_LLAMA_SHAPE, pad_token_id=0, sliding_window=8)
    ),
    "mixtral-window": Family(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(
            _LLAMA_SHAPE,
            intermediate_size=48,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
        ),
    ),
    # Starcoder2: LayerNorms and projections with biases, GELU MLP, tied head; its window.
    "starcoder2-window": Family(
        "Starcoder2Config", "Starcoder2ForCausalLM", dict(_LLAMA_SHAPE, sliding_window=8)
    ),
    # Gemma 2: four norms a layer (1 + weight), GeGLU, embeddings times sqrt(hidden), the
    # softmax scale 1/sqrt(query_pre_attn_scalar), attention and final logit soft-caps, layer
    # 0 sliding (8 keys), layer 1 global.
    "gemma2": Family(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            _LLAMA_SHAPE,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=4.0,
        ),
    ),
    # Gemma 3: Gemma 2's layer with offset q/k norms per head, layer 0 sliding (8 keys, its own
    # rope base 100), layer 1 global (base 10000, linear scaling 4), the final logit soft-cap.
    "gemma3": Family(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            _LLAMA_SHAPE,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            sliding_window_pattern=2,
            rope_theta=10000.0,
            rope_scaling=dict(rope_type="linear", factor=4.0),
            rope_local_base_freq=100.0,
            final_logit_softcapping=4.0,
        ),
    ),
    # Granite 4.0 hybrid: Mamba-2 layers 0 and 2 (8 heads in 2 groups, chunks of 8 tokens),
    # attention at layer 1 with RoPE, 4 experts beside a shared MLP, Granite's multipliers.
    "granite-hybrid": Family(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            _LLAMA_SHAPE,
            num_hidden_layers=3,
            intermediate_size=48,
            layer_types=["mamba", "attention", "mamba"],
            mamba_n_heads=8,
            mamba_d_head=16,
            mamba_n_groups=2,
            mamba_d_state=16,
            mamba_chunk_size=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=32,
            position_embedding_type="rope",
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.4,
            logits_scaling=2.5,
        ),
    ),
    # gpt-oss: attention sinks, biased q/k/v/o, layer 0 sliding (8 keys), layer 1 full, yarn
    # rope (transformers' default), 4 experts (top 2) with biases, a router bias and a clamped
    # SwiGLU whose limit (1.0) the tiny activations reach; sizes a multiple of MXFP4's blocks.
    "gpt-oss": Family(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            _LLAMA_SHAPE,
            head_dim=16,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.0,
        ),
    ),
    "starcoder2-untied": Family(
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(_LLAMA_SHAPE, sliding_window=None, tie_word_embeddings=False),
    ),
}


def assert_matches_hf(router: Router, model: TinyModel, prompts: dict[int, list[int]]) -> None:
    """The router's greedy tokens are HF's, their logprobs within 1e-4 of HF's."""
    for rid, prompt in prompts.items():
        expected, logits = model.greedy(prompt, NEW_TOKENS)
        assert router.generated[rid] == expected, f"request {rid}"
        details = [t.token for o in router.outputs for t in o.tokens if t.request_id == rid]
        for detail, step_logits in zip(details, logits, strict=True):
            ref = torch.log_softmax(step_logits, dim=-1)[detail.token_id].item()
            assert abs(detail.logprob - ref) < 1e-4, f"request {rid}"
