"""Fixtures for the shard tests: tiny random Llama checkpoints and a router stand-in."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.shard.driving import Router
from tests.shard.models import NUM_BLOCKS, TinyModel, build_tiny_llama
from tgis.shard.config import ShardConfig
from tgis.shard.loader import load_runner
from tgis.shard.native.runtime.model_runner import ModelRunner


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """One tiny random Llama for the whole session."""
    path = tmp_path_factory.mktemp("tiny-llama")
    return TinyModel(path, build_tiny_llama(path))


@pytest.fixture
def make_runner(tiny_model: TinyModel) -> Callable[..., ModelRunner]:
    """A fresh ModelRunner on the tiny model (other ShardConfig fields as keywords)."""

    def make(**kwargs: object) -> ModelRunner:
        kwargs.setdefault("kv_cache_blocks", NUM_BLOCKS)
        return load_runner(ShardConfig(model_name=str(tiny_model.path), **kwargs))  # type: ignore[arg-type]

    return make


@pytest.fixture
def runner(make_runner: Callable[..., ModelRunner]) -> ModelRunner:
    """A fresh ModelRunner on the tiny model."""
    return make_runner()


@pytest.fixture
def router(runner: ModelRunner) -> Router:
    """A router stand-in driving a fresh runner."""
    return Router(runner)
