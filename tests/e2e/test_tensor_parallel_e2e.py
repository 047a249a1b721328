"""`text-generation-launcher --num-shard 2` on CPU (gloo): the same text as one shard (a
long prompt's second run from the prefix cache included; the two ranks also verify
drafted tokens, `--speculate 3 --speculate-always`, which the single shard does not: the
policy would not draft for a random model, whose drafts seldom land), and SIGTERM stops every
rank cleanly. With a draft model (`--speculator-name`, here the model itself) split over the
two ranks the text is the same too."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.e2e.probes import metric_sample
from tests.e2e.server import LauncherProcess, descendants, is_alive, start_launcher
from tgis.pb import generation_pb2 as pb
from tgis.pb import generation_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow

PROMPTS = ["Return the number of", "The file is", "A"]
LONG_PROMPT = "Every rank reads the cached blocks of this prompt. " * 8
NEW_TOKENS = 12


def start(log_dir: Path, model: Path, num_shard: int, *flags: str) -> LauncherProcess:
    return start_launcher(
        log_dir,
        [
            "--model-name",
            str(model),
            "--num-shard",
            str(num_shard),
            "--max-sequence-length",
            "256",
            *flags,
        ],
    )


def generate(launcher: LauncherProcess) -> list[str]:
    """Greedy texts of PROMPTS in one batch, then one seeded sampled text, then a long
    prompt twice (the second run starts from its cached blocks)."""
    stopping = pb.StoppingCriteria(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    greedy = pb.Parameters(method=pb.GREEDY, stopping=stopping)
    sampled = pb.Parameters(
        method=pb.SAMPLE,
        sampling=pb.SamplingParameters(temperature=0.9, top_k=40, seed=7),
        stopping=stopping,
    )
    with grpc.insecure_channel(launcher.grpc_target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        texts = []
        rounds = ((greedy, PROMPTS), (sampled, PROMPTS[:1]), (greedy, [LONG_PROMPT]))
        for params, prompts in (*rounds, (greedy, [LONG_PROMPT])):
            request = pb.BatchedGenerationRequest(
                requests=[pb.GenerationRequest(text=p) for p in prompts], params=params
            )
            response = stub.Generate(request, timeout=60)
            assert all(r.generated_token_count == NEW_TOKENS for r in response.responses)
            texts += [r.text for r in response.responses]
    return texts


@pytest.fixture(scope="module")
def single_shard_texts(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    launcher = start(tmp_path_factory.mktemp("tp1"), tiny_llama_dir, 1)
    try:
        launcher.wait_healthy()
        return generate(launcher)
    finally:
        assert launcher.stop() == 0, launcher.log_tail()


@pytest.fixture
def two_shards(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[LauncherProcess]:
    launcher = start(tmp_path, tiny_llama_dir, 2, "--speculate", "3", "--speculate-always")
    try:
        launcher.wait_healthy()
        yield launcher
    finally:
        launcher.stop()


def test_two_shards_generate_the_same_text_and_stop_cleanly(
    two_shards: LauncherProcess, single_shard_texts: list[str]
) -> None:
    launcher = two_shards
    assert generate(launcher) == single_shard_texts
    assert (metric_sample(launcher, "tgi_prefix_cache_hits") or 0) >= 64
    # Prompt lookup drafts in every step (the long prompt repeats itself, and so do some
    # outputs): both ranks verify them.
    assert (metric_sample(launcher, "tgi_spec_draft_tokens") or 0) > 0
    sockets = sorted(p.name for p in launcher.socket_dir.glob("shard-*"))
    # Both ranks serve gRPC; rank 0 alone runs Steps (its step channel).
    assert sockets == ["shard-0", "shard-0.steps", "shard-1"]
    children = descendants(launcher.proc.pid)
    assert len(children) >= 3, "expected two shards and a router"

    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.proc.wait(60) == 0, launcher.log_tail()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(is_alive(p) for p in children):
        time.sleep(0.1)
    assert not [p for p in children if is_alive(p)]
    assert not list(launcher.socket_dir.glob("shard-*")), "shard sockets left behind"
    log = launcher.log_tail(20000)
    for rank in (0, 1):
        assert f"Shard {rank} stopped: exit status: 0" in log, log
    assert "killing it" not in log, log
    assert "stop received from rank 0" in log, log


def test_a_draft_model_split_over_two_shards_gives_the_same_text(
    tiny_llama_dir: Path, single_shard_texts: list[str], tmp_path: Path
) -> None:
    """The model drafts for itself on both ranks (each holding half its heads and their KV
    cache): the ranks draft in lockstep, the output is the single shard's, and the greedy
    drafts (the model's own choices) are mostly confirmed."""
    launcher = start(tmp_path, tiny_llama_dir, 2, "--speculator-name", str(tiny_llama_dir))
    try:
        launcher.wait_healthy()
        assert generate(launcher) == single_shard_texts
        drafted = metric_sample(launcher, "tgi_spec_draft_tokens") or 0
        accepted = metric_sample(launcher, "tgi_spec_accepted_tokens") or 0
        assert drafted > 0 and accepted >= 0.5 * drafted, (drafted, accepted)
    finally:
        assert launcher.stop() == 0, launcher.log_tail()
