"""The step channel on a real Unix socket: order, pipelining, failures, connection loss."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tgis.shard_api.channel import StepChannelClient, StepChannelServer, StepFailed
from tgis.shard_api.messages import (
    SampledToken,
    ScheduledSequence,
    StepErrorCode,
    StepOutput,
    StepPlan,
    TokenDetail,
)


@pytest.fixture
def socket_path() -> Iterator[str]:
    path = Path(tempfile.mkdtemp(prefix="tgis-chan-"))
    yield str(path / "s.steps")
    shutil.rmtree(path, ignore_errors=True)


class Recorder:
    """Answers each plan with one token per scheduled sequence, or fails as told."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.release = threading.Event()
        self.release.set()

    def __call__(self, plan: StepPlan) -> StepOutput:
        self.release.wait(5)
        self.seen.append(plan.step_id)
        if plan.step_id == 13:
            raise StepFailed(StepErrorCode.OUT_OF_MEMORY, "out of memory")
        if plan.step_id == 14:
            raise RuntimeError("boom")
        tokens = tuple(
            SampledToken(s.request_id, TokenDetail(plan.step_id)) for s in plan.scheduled
        )
        return StepOutput(plan.step_id, tokens, forward_time_ns=plan.step_id)


def plan(step_id: int) -> StepPlan:
    return StepPlan(step_id, scheduled=(ScheduledSequence(1, 1, (2,)),), base_step_id=step_id - 1)


def test_steps_run_in_order_and_answer_in_order(socket_path: str) -> None:
    handler = Recorder()
    server = StepChannelServer(socket_path, handler)
    server.start()

    async def scenario() -> None:
        client = await StepChannelClient.connect(socket_path)
        handler.release.clear()  # hold the first step: the others queue behind it
        futures = [client.send(plan(i)) for i in range(1, 11)]
        await asyncio.sleep(0.05)
        assert client.in_flight == 10
        handler.release.set()
        outputs = await asyncio.gather(*futures)
        assert [o.step_id for o in outputs] == list(range(1, 11))
        assert outputs[3].tokens == (SampledToken(1, TokenDetail(4)),)
        with pytest.raises(StepFailed) as oom:
            await client.send(plan(13))
        assert oom.value.code is StepErrorCode.OUT_OF_MEMORY
        with pytest.raises(StepFailed) as internal:
            await client.send(plan(14))
        assert internal.value.code is StepErrorCode.INTERNAL and "boom" in internal.value.message
        assert (await client.send(plan(15))).step_id == 15  # the channel survives failures
        client.close()

    try:
        asyncio.run(scenario())
    finally:
        server.close()
    assert handler.seen == [*range(1, 11), 13, 14, 15]
    assert not Path(socket_path).exists()


def test_steps_in_flight_fail_when_the_shard_goes_away(socket_path: str) -> None:
    handler = Recorder()
    server = StepChannelServer(socket_path, handler)
    server.start()

    async def scenario() -> None:
        client = await StepChannelClient.connect(socket_path)
        handler.release.clear()
        pending = client.send(plan(1))
        await asyncio.sleep(0.05)
        # As the shard stops: close on a thread, which drops the connection at once and
        # then waits for the step still running, which ends after it.
        closing = asyncio.ensure_future(asyncio.to_thread(server.close))
        await asyncio.sleep(0.05)
        assert not closing.done(), "close() did not wait for the running step"
        handler.release.set()
        await asyncio.wait_for(closing, 5)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(pending, 5)
        with pytest.raises(ConnectionError):
            await client.send(plan(2))

    asyncio.run(scenario())
