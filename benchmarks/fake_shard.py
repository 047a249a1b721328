"""An instant fake shard: a real ``tgis.shard.v1.ShardService`` without a model.

It answers ``Info`` (gRPC) with the embedded model's facts (EOS id, vocabulary size, 16-token
KV blocks), plenty of blocks and its step channel, ``Health`` and ``Reset`` at once, and each
Step on the step channel (``tgis.shard_api.channel``, the router's hot path) at once (or
after ``--step-delay-ms``, to stand in for a device's forward time) with deterministic token
ids.
Every sequence gets one token per step once its prompt is complete, exactly as the real shard
does, and the tokens cycle through whole-word vocabulary entries of the tokenizer (``Ġword``
in byte-level BPE), so they detokenize to English-looking text and are never EOS or special.

With ``--fail-steps`` it is a broken shard instead: Info and Health answer, but every Step
fails (``INTERNAL``) until SIGUSR1 toggles the fault off (and on again); the fault tests
(tests/e2e/test_faults_e2e.py) check the router's health reports against it.

It exists so that ``benchmarks/router_only.py`` can measure the router's own ceiling: with the
shard costing (almost) nothing, the tokens per second the router streams are bounded by its
own scheduling, protobuf, detokenization, stop checks and streaming.

Run on its own (``router_only.py`` starts it this way)::

    .venv/bin/python benchmarks/fake_shard.py --uds /tmp/fake-shard-0
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from tgis.pb import shard_pb2, shard_pb2_grpc
from tgis.shard_api.channel import StepChannelServer, StepFailed, step_channel_path
from tgis.shard_api.messages import (
    SampledToken,
    SequenceError,
    StepErrorCode,
    StepOutput,
    StepPlan,
    TokenDetail,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
EMBEDDED_TOKENIZER = REPO_ROOT / "tgis" / "embedded_model" / "data" / "tokenizer.json"
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def word_token_ids(tokenizer_json: Path, limit: int = 512) -> list[int]:
    """Up to ``limit`` ids of whole-word tokens (``Ġ`` + 2+ ASCII letters), lowest ids first.

    Special tokens are excluded by construction (their content never starts with ``Ġ``).
    Raises ``ValueError`` when the tokenizer has no such token (not byte-level BPE).
    """
    data = json.loads(tokenizer_json.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    ids = sorted(
        i
        for token, i in vocab.items()
        if token.startswith("Ġ") and len(token) > 2 and token[1:].isascii() and token[1:].isalpha()
        if i not in special
    )
    if not ids:
        raise ValueError(f"{tokenizer_json}: no 'Ġword' tokens (not a byte-level BPE vocabulary)")
    return ids[:limit]


def model_facts(tokenizer_json: Path) -> tuple[tuple[int, ...], int]:
    """EOS ids and vocabulary size of the model next to ``tokenizer_json``.

    EOS comes from the sibling ``config.json`` (an int or a list), else id 2; the vocabulary
    size from ``config.json``, else the tokenizer's own.
    """
    data = json.loads(tokenizer_json.read_text())
    vocab_size = len(data["model"]["vocab"])
    eos: tuple[int, ...] = (2,)
    config_path = tokenizer_json.parent / "config.json"
    if config_path.exists():
        config = json.loads(config_path.read_text())
        value = config.get("eos_token_id")
        if isinstance(value, int):
            eos = (value,)
        elif isinstance(value, list) and value:
            eos = tuple(int(v) for v in value)
        vocab_size = int(config.get("vocab_size", vocab_size))
    return eos, vocab_size


@dataclass
class FakeSequence:
    """What the fake shard remembers of one sequence."""

    prompt_len: int
    computed: int = 0
    generated: int = 0


@dataclass
class FakeShardConfig:
    """The facts ``Info`` reports and how ``Step`` behaves."""

    token_ids: list[int]
    eos_token_ids: tuple[int, ...] = (2,)
    vocab_size: int = 4096
    block_size: int = 16
    num_blocks: int = 65536
    max_position_embeddings: int = 0
    step_delay_s: float = 0.0
    fail_steps: bool = False
    """Every Step fails with ``INJECTED_FAULT`` while this is set (SIGUSR1 toggles it)."""
    prefix_caching: bool = False
    """Info says the engine reads cached blocks (the router's prefix cache may be on)."""


INJECTED_FAULT = "injected fault: this fake shard fails every step"


class FakeShardServicer(shard_pb2_grpc.ShardServiceServicer):
    """Answers every ShardService RPC at once, from plain Python state; ``step`` serves the
    step channel."""

    def __init__(self, config: FakeShardConfig, step_channel: str) -> None:
        self.config = config
        self.step_channel = step_channel
        self.sequences: dict[int, FakeSequence] = {}
        self.steps = 0
        self.tokens = 0
        self._lock = threading.Lock()

    async def Info(
        self, request: shard_pb2.InfoRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.InfoResponse:
        """The embedded model's facts, with plenty of KV blocks."""
        c = self.config
        return shard_pb2.InfoResponse(
            model_kind=shard_pb2.CAUSAL_LM,
            eos_token_ids=list(c.eos_token_ids),
            vocab_size=c.vocab_size,
            block_size=c.block_size,
            num_blocks=c.num_blocks,
            world_size=1,
            max_position_embeddings=c.max_position_embeddings,
            model_type="fake",
            dtype="none",
            device="none",
            attention_backend="none",
            step_channel=self.step_channel,
            prefix_caching=c.prefix_caching,
        )

    async def Health(
        self, request: shard_pb2.HealthRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.HealthResponse:
        """Always healthy."""
        return shard_pb2.HealthResponse()

    async def Reset(
        self, request: shard_pb2.ResetRequest, context: grpc.aio.ServicerContext
    ) -> shard_pb2.ResetResponse:
        """Forget every sequence."""
        with self._lock:
            self.sequences.clear()
        return shard_pb2.ResetResponse()

    def step(self, plan: StepPlan) -> StepOutput:
        """One token per sequence whose known tokens are all computed now; no forward pass."""
        if self.config.step_delay_s > 0:
            time.sleep(self.config.step_delay_s)
        if self.config.fail_steps:
            raise StepFailed(StepErrorCode.INTERNAL, INJECTED_FAULT)
        with self._lock:
            sequences = self.sequences
            for request_id in plan.finished_request_ids:
                sequences.pop(request_id, None)
            # Preempted sequences keep their tokens and recompute them all.
            for request_id in plan.preempted_request_ids:
                if (seq := sequences.get(request_id)) is not None:
                    seq.computed = 0
            for new in plan.new_sequences:
                sequences[new.request_id] = FakeSequence(len(new.prompt_token_ids))
            ids = self.config.token_ids
            tokens: list[SampledToken] = []
            errors: list[SequenceError] = []
            for chunk in plan.scheduled:
                seq = sequences.get(chunk.request_id)
                if seq is None:
                    errors.append(SequenceError(chunk.request_id, "unknown sequence"))
                    continue
                # A prefix-cache hit: its leading positions are already computed.
                seq.computed += chunk.cached_tokens + chunk.num_tokens
                if seq.computed < seq.prompt_len + seq.generated:
                    continue  # mid-prompt (chunked prefill) or mid-recompute: no token yet
                token = ids[(chunk.request_id * 7 + seq.generated) % len(ids)]
                seq.generated += 1
                tokens.append(SampledToken(chunk.request_id, TokenDetail(token)))
            self.steps += 1
            self.tokens += len(tokens)
        return StepOutput(plan.step_id, tuple(tokens), errors=tuple(errors))


def toggle_fault(config: FakeShardConfig) -> None:
    """SIGUSR1: steps start failing, or stop failing."""
    config.fail_steps = not config.fail_steps
    print(f"fake shard: fail_steps={config.fail_steps}", file=sys.stderr, flush=True)


async def serve(config: FakeShardConfig, uds_path: str, ready_file: Path | None = None) -> None:
    """Serve on ``unix://uds_path`` until SIGTERM/SIGINT; touch ``ready_file`` once bound."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(uds_path)
    channel_path = step_channel_path(uds_path)
    servicer = FakeShardServicer(config, channel_path)
    channel = StepChannelServer(channel_path, servicer.step)
    channel.start()
    server = grpc.aio.server(
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    shard_pb2_grpc.add_ShardServiceServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{uds_path}")
    await server.start()
    if ready_file is not None:
        ready_file.write_text(str(os.getpid()))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, toggle_fault, config)
    await stop.wait()
    await server.stop(1.0)
    channel.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(uds_path)
    print(
        f"fake shard: {servicer.steps} steps, {servicer.tokens} tokens",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Command line of the standalone fake shard."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0] if __doc__ else None)
    parser.add_argument("--uds", required=True, help="Unix socket path to listen on")
    parser.add_argument(
        "--tokenizer", type=Path, default=EMBEDDED_TOKENIZER, help="tokenizer.json for token ids"
    )
    parser.add_argument("--num-blocks", type=int, default=65536, help="KV blocks in Info")
    parser.add_argument("--step-delay-ms", type=float, default=0.0, help="sleep per Step (0)")
    parser.add_argument("--ready-file", type=Path, help="written with the pid once serving")
    parser.add_argument(
        "--fail-steps", action="store_true", help="every Step fails until SIGUSR1 (toggles)"
    )
    parser.add_argument(
        "--prefix-caching", action="store_true", help="Info allows the router's prefix cache"
    )
    args = parser.parse_args(argv)
    eos, vocab_size = model_facts(args.tokenizer)
    config = FakeShardConfig(
        token_ids=[i for i in word_token_ids(args.tokenizer) if i not in eos],
        eos_token_ids=eos,
        vocab_size=vocab_size,
        num_blocks=args.num_blocks,
        step_delay_s=args.step_delay_ms / 1000,
        fail_steps=args.fail_steps,
        prefix_caching=args.prefix_caching,
    )
    asyncio.run(serve(config, args.uds, args.ready_file))
    return 0


if __name__ == "__main__":
    sys.exit(main())
