"""Settings of how the shard computes: the engine, attention, kernels, compilation. Users set
them as environment variables (the launcher's environment reaches its shards); the shard
also takes them as options."""

from __future__ import annotations

from tgis.settings.declaration import Kind, Process
from tgis.settings.declaration import setting as _s

S = Process.SHARD

ENGINES = ("auto", "native", "hf")
ATTENTION_BACKENDS = ("torch_paged", "cpu_paged", "sdpa_varlen", "flash_varlen", "triton_paged")
LORA_KERNELS = ("auto", "triton", "torch")
QUANT_KERNELS = ("auto", "triton", "tgis", "torch", "dequant")
MODES = ("auto", "1", "0")
"""A three-way switch: ``auto``, on (1, true, yes, on) or off (0, false, no, off)."""

SETTINGS = (
    _s("engine", ("--engine",), ("TGIS_ENGINE",), Kind.STR, "auto",
       "native, hf (the transformers fallback) or auto; --deployment-framework tgis_native "
       "means native.", {S}, choices=ENGINES),
    _s("attention_backend", ("--attention-backend",), ("TGIS_ATTENTION_BACKEND",), Kind.STR,
       None, "Force an attention implementation (default: by device).", {S},
       choices=ATTENTION_BACKENDS),
    _s("flash_attention", ("--flash-attention",), ("FLASH_ATTENTION",), Kind.FLAG, False,
       "On CUDA, prefer flash-attn's varlen kernel when it is installed (TGIS's variable).",
       {S}),
    _s("lora_kernel", ("--lora-kernel",), ("TGIS_LORA_KERNEL",), Kind.STR, "auto",
       "How LoRA deltas are computed: triton (segmented kernels), torch (the reference), "
       "auto (triton on CUDA with Triton, else torch).", {S}, choices=LORA_KERNELS),
    _s("quant_kernel", ("--quant-kernel",), ("TGIS_QUANT_KERNEL",), Kind.STR, "auto",
       "The kernel of quantized layers: triton, tgis (the CPU kernel), torch, dequant (dense "
       "weights) or auto.", {S}, choices=QUANT_KERNELS),
    _s("compile", ("--compile",), ("TGIS_COMPILE",), Kind.STR, "auto",
       "Compile the step with torch.compile at start-up: auto (on CUDA only), 1, 0.", {S}),
    _s("cuda_graphs", ("--cuda-graphs",), ("TGIS_CUDA_GRAPHS",), Kind.STR, "auto",
       "Replay decode steps from CUDA graphs: auto, 1 (a failure stops start-up), 0.", {S}),
    _s("transformers_attn_impl", ("--transformers-attn-impl",), ("TRANSFORMERS_ATTN_IMPL",),
       Kind.STR, None, "attn_implementation of the transformers fallback's model.", {S}),
)  # fmt: skip
