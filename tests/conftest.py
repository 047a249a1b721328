"""Settings every test process shares."""

from __future__ import annotations

import importlib.util
import os

import pytest

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


# The longest modules first: with two workers (`make test`: pytest-xdist, --dist loadfile,
# whole modules to a worker in collection order) the suite then ends with short modules on
# both workers instead of one long module alone. Measured with `--durations=0`, seconds on
# the 2-core host (README.md, "Testing").
LONGEST_FIRST = (
    "tests/e2e/test_soak_e2e.py",  # 122 s: a fixed two-minute load
    "tests/shard/test_compiled.py",  # 74 s: torch.compile of every family
    "tests/e2e/test_faults_e2e.py",  # 21 s
    "tests/e2e/test_fuzz_e2e.py",  # 19 s
    "tests/e2e/test_operations_e2e.py",  # 18 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    late = len(LONGEST_FIRST)

    def order(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], late)

    items.sort(key=order)  # stable: the rest keeps its order
