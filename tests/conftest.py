"""Settings every test process shares."""

from __future__ import annotations

import importlib.util
import os

import pytest

# Two workers on two cores (`make test`): each worker, and each server its tests launch,
# computes on one thread. Left alone, every process's OpenMP pool takes every core and the
# pools' idle threads spin against each other's work: on the 2-core host a full run took
# 8:09-9:15 and 13.9-16.5 CPU-minutes, against 6:47 and 11.5 with one thread each. Set
# before torch is first imported (below); the shard's own choice of threads per step is
# tested with explicit thread counts (tests/shard/test_cpu_threads.py).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The compiled step costs tens of seconds per model on a CPU; tests run the eager reference
# (the CPU default anyway) unless they ask for the compiled one
# (tests/shard/native/graphs/test_compiled.py), and so do the servers they launch (the
# variable is inherited).
os.environ.setdefault("TGIS_COMPILE", "0")

# float32 is the exact-oracle path (token for token against transformers in float32). On a
# processor with native bfloat16 `--dtype auto` serves bfloat16 (tgis/shard/device.py), so
# the servers tests launch are pinned to float32 through the launcher's (and the shard
# CLI's) DTYPE variable, and shards loaded in the test process see no native bfloat16
# (`_auto_dtype_is_float32`). Tests of the dtype rule and of bfloat16 ask for it.
os.environ.setdefault("DTYPE", "float32")


@pytest.fixture(autouse=True)
def _auto_dtype_is_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tgis.shard.device.cpu_bf16_flags", lambda *args: ())


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# Without a GPU, Triton kernels run on CPU tensors only in Triton's interpreter, which must be
# chosen before triton is first imported (transformers imports it while tests are collected):
# tests/shard/native/attention/test_triton_paged.py runs the `triton_paged` kernels that way.
# Nothing else uses Triton on a CPU, and with a GPU the variable is left alone.
if importlib.util.find_spec("triton") is not None and not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The longest modules first: with two workers (`make test`: pytest-xdist, --dist loadfile,
# whole modules to a worker in this order, --no-loadscope-reorder) the one-minute soak and
# the compilations start at once, beside each other, and the short modules fill in after;
# left to xdist's default order (most tests first) the soak ran last, alone, and the suite
# took 272 s instead of 227 s on the 2-core host. Seconds from `--durations=0`, fresh clone.
LONGEST_FIRST = (
    "tests/e2e/test_soak_e2e.py",  # ~63 s: a fixed one-minute load (TGIS_SOAK_SECONDS)
    "tests/shard/native/graphs/test_compiled.py",  # 74-90 s: torch.compile of every family
    "tests/e2e/test_families_e2e.py",  # 59 s: a launcher start per newer family
    "tests/shard/native/models/test_granite_hybrid.py",  # 10-20 s
    "tests/e2e/test_hybrid_e2e.py",  # 10-30 s
    "tests/e2e/test_guidellm_e2e.py",  # 22-44 s on a loaded host: two guidellm runs
    "tests/e2e/test_fuzz_e2e.py",  # 19-27 s
    "tests/e2e/test_faults_e2e.py",  # 21-25 s
    "tests/e2e/test_operations_e2e.py",  # 18-23 s
    "tests/shard/native/models/test_families.py",  # 11-18 s
    "tests/shard/parallel/test_tensor_parallel.py",  # 14-17 s
    "tests/shard/checkpoints/test_weights_cli.py",  # 12-15 s
    "tests/e2e/test_slow_clients_e2e.py",  # 11-12 s
    "tests/launcher/test_launcher_validation.py",  # 9-12 s
    "tests/e2e/test_prometheus.py",  # 10-11 s
    "tests/e2e/test_cancellation_e2e.py",  # 8-11 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    late = len(LONGEST_FIRST)

    def order(item: pytest.Item) -> int:
        return rank.get(item.nodeid.split("::", 1)[0], late)

    items.sort(key=order)  # stable: the rest keeps its order
