"""Fixtures the end-to-end modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.e2e.models import save_tiny_llama
from tests.e2e.server import LauncherProcess, healthy_launcher
from tgis.pb import generation_pb2_grpc as pb_grpc


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LauncherProcess]:
    """The embedded model served with the launcher's defaults, launched once per test
    process for every module that needs no server of its own (its tests read counters as
    differences and wait for the server to be idle, so they do not see one another)."""
    with healthy_launcher(tmp_path_factory.mktemp("embedded")) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def stub(server: LauncherProcess) -> Iterator[pb_grpc.GenerationServiceStub]:
    """A client of the module's ``server`` fixture, for the module's duration."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random float32 Llama (GQA: 4 query heads, 2 KV heads) with the embedded tokenizer,
    for the modules that start several launchers on it (tensor parallelism, several nodes)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return path
