"""The oracle for LoRA adapters: random adapters saved by PEFT, and PEFT's own greedy
``PeftModel.generate`` on them, which is what a LoRA ``adapter_id`` must reproduce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_lora(
    base_dir: Path,
    out_dir: Path,
    seed: int,
    r: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    rslora: bool = False,
    safetensors: bool = True,
) -> None:
    """A LoRA adapter of the model in ``base_dir`` with random A and B (PEFT starts B at
    zero, which would make the adapter a no-op), saved by PEFT to ``out_dir``."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        use_rslora=rslora,
        lora_dropout=0.0,
        bias="none",
    )
    model: Any = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(out_dir, safe_serialization=safetensors)


def lora_greedy(base_dir: Path, adapter_dir: Path | None, ids: list[int], new_tokens: int):
    """PEFT's greedy token ids after ``ids`` with the adapter in ``adapter_dir`` (None: the
    base model alone), and the raw logits of each step (float32)."""
    model: Any = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    tokens = out.sequences[0, len(ids) :].tolist()
    return tokens, [step[0].float() for step in out.logits]
