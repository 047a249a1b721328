"""The GPU suite's shared pieces (the modules marked ``gpu``): a runner of a model directory
on the CUDA device, and float32 products in full precision, as the CPU oracle computes them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tgis.shard.config import EngineSettings, ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner


def cuda_runner(
    path: Path,
    *,
    backend: str = "",
    compiled: bool = False,
    graphs: str = "auto",
    dtype: str = "float32",
    speculate: int = 0,
) -> ModelRunner:
    engine = EngineSettings(
        attention_backend=backend or None, compile="1" if compiled else "0", cuda_graphs=graphs
    )
    config = ShardConfig(
        model_name=str(path),
        dtype=dtype,
        kv_cache_blocks=96,
        max_sequence_length=256,
        speculate=speculate,
        engine=engine,
    )
    runner = load_runner(config)
    assert isinstance(runner, ModelRunner)
    assert runner.device.type == "cuda"
    return runner


@pytest.fixture(autouse=True)
def no_tf32() -> None:
    """float32 products in full precision, as the CPU oracle computes them."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
