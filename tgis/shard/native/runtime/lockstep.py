"""Rank 0 drives the other ranks: every command is broadcast, run everywhere, then checked.

Only rank 0 talks to the router. For each Step (and Reset, Health, PrefixLookup,
AdapterLookup, and the final Stop) it broadcasts a `Message` over the control group as a
tensor of bytes (a Step's plan in `lockstep_wire`'s layout; nothing pickled); every rank —
rank 0 included — runs the same `ModelRunner` call (`resolve_plan` first, so a plan that
fails validation fails on every rank before any collective), then all ranks exchange a small
`Outcome` (the error, if any, and the sampled token ids): its length and digest, and the
outcomes themselves only when those differ. Identical outcomes are the normal case, failures
included: rank 0 returns its own result or raises its own error, and the workers wait for
the next command. Different outcomes mean the replicas no longer hold the same state: every
rank stops (`LockstepError`), and the launcher sees a shard exit and stops the server.

The order of collectives is the same on every rank because rank 0 issues commands one at a
time (a lock) and each command's tensor collectives happen inside the same model code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import NoReturn

import torch

from tgis.shard.adapters.store_paths import invalid
from tgis.shard.native.runtime.lockstep_wire import (
    Outcome,
    decode_outcome,
    decode_plan,
    encode_outcome,
    encode_plan,
)
from tgis.shard.native.runtime.model_runner import ModelRunner
from tgis.shard.parallel.distributed import broadcast_command, first_line, gather_payloads
from tgis.shard.parallel.group import TensorParallel
from tgis.shard_api.messages import (
    AdapterInfo,
    NewSequence,
    PrefixInfo,
    ShardInfo,
    StepOutput,
    StepPlan,
)

log = logging.getLogger(__name__)


class Command(Enum):
    """What rank 0 asks every rank to do."""

    STEP = "step"
    RESET = "reset"
    HEALTH = "health"
    PREFIX = "prefix"  # load a prompt-tuning prefix from this rank's store
    ADAPTER = "adapter"  # load an adapter from this rank's adapter cache
    STOP = "stop"


@dataclass(frozen=True)
class Message:
    """One broadcast command."""

    command: Command
    plan: StepPlan | None = None
    prefix_id: str = ""
    adapter_id: str = ""


_COMMANDS = list(Command)
_CODES = {command: code for code, command in enumerate(_COMMANDS)}


def send_message(tp: TensorParallel, message: Message) -> None:
    """Rank 0: broadcast `message` (a command code and its payload's bytes)."""
    if message.command is Command.STEP:
        assert message.plan is not None
        payload = encode_plan(message.plan)
    else:
        payload = (message.prefix_id or message.adapter_id).encode()
    broadcast_command(tp, _CODES[message.command], payload)


def receive_message(tp: TensorParallel) -> Message:
    """A rank > 0: the message rank 0 broadcast."""
    code, payload = broadcast_command(tp)
    command = _COMMANDS[code]
    if command is Command.STEP:
        return Message(command, decode_plan(payload))
    if command is Command.PREFIX:
        return Message(command, prefix_id=payload.decode())
    if command is Command.ADAPTER:
        return Message(command, adapter_id=payload.decode())
    return Message(command)


def exchange_outcomes(tp: TensorParallel, outcome: Outcome) -> list[Outcome]:
    """Every rank's outcome, in rank order (ours alone decoded when all are equal)."""
    mine = encode_outcome(outcome)
    payloads = gather_payloads(tp, mine)
    return [outcome if p == mine else decode_outcome(p) for p in payloads]


class LockstepError(RuntimeError):
    """The ranks are no longer in lock-step (different outcomes, or a rank is gone)."""


Result = StepOutput | PrefixInfo | AdapterInfo | None
"""A command's result: a Step's output, a prefix's length and version, an adapter's kind,
or nothing."""


def execute(runner: ModelRunner, message: Message) -> tuple[Result, Exception | None]:
    """Run one command on this rank's replica → (its result, the exception raised)."""
    try:
        if message.command is Command.STEP:
            assert message.plan is not None
            return runner.step(message.plan), None
        if message.command is Command.PREFIX:
            return runner.lookup_prefix(message.prefix_id), None
        if message.command is Command.ADAPTER:
            return runner.lookup_adapter(message.adapter_id), None
        if message.command is Command.RESET:
            runner.reset()
        elif message.command is Command.HEALTH:
            runner.health()
        return None, None
    except Exception as e:
        return None, e


def outcome_of(output: Result, error: Exception | None) -> Outcome:
    """The summary every rank compares."""
    if error is not None:
        return Outcome(error=f"{type(error).__name__}: {error}")
    if isinstance(output, PrefixInfo):
        return Outcome(prefix=output)
    if isinstance(output, AdapterInfo):
        return Outcome(adapter=output)
    if output is None:
        return Outcome()
    return Outcome(
        tokens=tuple((t.request_id, t.token.token_id) for t in output.tokens),
        failed=tuple(e.request_id for e in output.errors),
    )


def divergence(command: Command, outcomes: list[Outcome]) -> str | None:
    """None when the ranks agree; else a one-line description. Health may differ (a rank's
    own device), and is reported by rank 0 instead; so may a prefix or adapter lookup (each
    rank's own store; nothing but the cache changed), which then fails alone."""
    lookups = (Command.HEALTH, Command.PREFIX, Command.ADAPTER)
    if command in lookups or all(o == outcomes[0] for o in outcomes):
        return None
    parts = [f"rank {r}: {o.error or f'{len(o.tokens)} tokens'}" for r, o in enumerate(outcomes)]
    return f"ranks diverged on {command.value} ({'; '.join(parts)})"


def lookup_disagreement(message: Message, ours: Outcome, theirs: Outcome) -> str:
    """Why a prefix or adapter that rank 0 loaded fails: another rank read it otherwise."""

    def read(outcome: Outcome) -> str:
        if outcome.error:
            return outcome.error
        if message.command is Command.PREFIX:
            return str(outcome.prefix)
        return str(outcome.adapter)

    if message.command is Command.PREFIX:
        what = f"the tensor-parallel ranks read prefix {message.prefix_id} differently"
    else:
        what = (
            f"can't retrieve adapter with id '{message.adapter_id}': the tensor-parallel "
            "ranks read it differently"
        )
    return f"{what} (rank 0: {read(ours)}, another: {read(theirs)})"


def with_seeds(plan: StepPlan) -> StepPlan:
    """Give every sampled new sequence without a seed one, so all ranks draw alike."""
    seeded = tuple(_with_seed(ns) for ns in plan.new_sequences)
    if all(a is b for a, b in zip(seeded, plan.new_sequences, strict=True)):
        return plan
    return replace(plan, new_sequences=seeded)


def _with_seed(sequence: NewSequence) -> NewSequence:
    sampling = sequence.sampling.seeded()
    return sequence if sampling is sequence.sampling else replace(sequence, sampling=sampling)


class LockstepRunner:
    """Rank 0's runner: the servicer's Runner, running every call on all ranks.

    `on_fatal` is called (once) when the ranks leave lock-step; the caller should shut the
    process down with a failure.
    """

    def __init__(
        self,
        runner: ModelRunner,
        tp: TensorParallel,
        on_fatal: Callable[[], None] | None = None,
    ) -> None:
        self.runner = runner
        self.tp = tp
        self.on_fatal = on_fatal
        self.failed = False
        self._closed = False
        self._lock = threading.Lock()

    @property
    def info(self) -> ShardInfo:
        """Rank 0's facts (world_size says how many ranks serve the model)."""
        return self.runner.info

    def step(self, plan: StepPlan) -> StepOutput:
        """Run `plan` on every rank; rank 0's output (or error)."""
        output = self._run(Message(Command.STEP, with_seeds(plan)))
        assert isinstance(output, StepOutput)
        return output

    def lookup_prefix(self, prefix_id: str) -> PrefixInfo:
        """Load a prompt-tuning prefix on every rank (each from its own store, as TGIS's
        shards do); its length and version, or rank 0's error. Ranks that disagree fail
        that lookup alone."""
        prefix = self._run(Message(Command.PREFIX, prefix_id=prefix_id))
        assert isinstance(prefix, PrefixInfo)
        return prefix

    def lookup_adapter(self, adapter_id: str) -> AdapterInfo:
        """Load an adapter on every rank (each from its own adapter cache, each keeping its
        slice of a LoRA adapter); what it is, or rank 0's error. Ranks that disagree fail
        that lookup alone."""
        info = self._run(Message(Command.ADAPTER, adapter_id=adapter_id))
        assert isinstance(info, AdapterInfo)
        return info

    def reset(self) -> None:
        """Forget every sequence on every rank."""
        self._run(Message(Command.RESET))

    def health(self) -> None:
        """Raise unless every rank answers and its device is healthy."""
        self._run(Message(Command.HEALTH))

    def close(self) -> None:
        """Tell the other ranks to stop (once; skipped after a failure)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.failed:
                return
            try:
                send_message(self.tp, Message(Command.STOP))
            except Exception as e:
                log.warning("could not tell the other ranks to stop: %s", first_line(e))

    def _run(self, message: Message) -> Result:
        with self._lock:
            if self.failed or self._closed:
                raise LockstepError("the tensor-parallel ranks are stopped")
            try:
                send_message(self.tp, message)
                output, error = execute(self.runner, message)
                outcomes = exchange_outcomes(self.tp, outcome_of(output, error))
            except Exception as e:
                self._fail(f"lost contact with the other ranks: {first_line(e)}")
            problem = divergence(message.command, outcomes)
            if problem is not None:
                self._fail(problem)
        if message.command is Command.HEALTH:
            bad = [f"rank {r}: {o.error}" for r, o in enumerate(outcomes) if o.error]
            if bad:
                raise RuntimeError("; ".join(bad))
        if message.command in (Command.PREFIX, Command.ADAPTER) and error is None:
            other = next((o for o in outcomes if o != outcomes[0]), None)
            if other is not None:
                raise invalid(lookup_disagreement(message, outcomes[0], other))
        if error is not None:
            raise error
        return output

    def _fail(self, problem: str) -> NoReturn:
        self.failed = True
        log.error("Tensor parallelism failed, stopping: %s", problem)
        if self.on_fatal is not None:
            self.on_fatal()
        raise LockstepError(problem)


def run_worker(runner: ModelRunner, tp: TensorParallel) -> None:
    """A rank > 0: run rank 0's commands until Stop.

    Raises LockstepError when the ranks diverge, and c10d's error when rank 0 is gone.
    """
    if runner.device.type == "cuda":
        torch.cuda.set_device(runner.device)  # this thread's current device
    while True:
        message = receive_message(tp)
        if message.command is Command.STOP:
            log.info("Rank %d: stop received from rank 0", tp.rank)
            return
        output, error = execute(runner, message)
        problem = divergence(message.command, exchange_outcomes(tp, outcome_of(output, error)))
        if problem is not None:
            raise LockstepError(problem)
