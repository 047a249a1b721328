"""Settings every test process shares."""

from __future__ import annotations

import importlib.util
import os

# The compiled step costs tens of seconds per model on a CPU; tests run the eager reference
# (the CPU default anyway) unless they ask for the compiled one (tests/shard/test_compiled.py),
# and so do the servers they launch (the variable is inherited).
os.environ.setdefault("TGIS_COMPILE", "0")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run on CPU tensors only in Triton's interpreter, which must be
# chosen before triton is first imported (transformers imports it while tests are collected):
# tests/shard/test_attention_triton.py runs the `triton_paged` kernels that way. Nothing
# else uses Triton on a CPU, and with a GPU the variable is left alone.
if importlib.util.find_spec("triton") is not None and not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
