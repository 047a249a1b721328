"""StalledStreams: a stream whose message waits past the limit has its call cancelled;
one that is reading, or between messages, is left alone."""

from __future__ import annotations

import asyncio

import pytest

from tgis.router.ops.stalled_streams import StalledStreams


def test_only_a_message_waiting_past_the_limit_cancels_its_call() -> None:
    async def scenario() -> None:
        streams = StalledStreams(limit=5.0)
        calls = {}

        async def call(name: str, sending_since: float | None) -> None:
            watched = streams.watch()
            watched.sending_since = sending_since
            calls[name] = watched
            try:
                await asyncio.sleep(60)
            finally:
                streams.forget(watched)

        tasks = {
            "stalled": asyncio.create_task(call("stalled", 100.0)),
            "sending": asyncio.create_task(call("sending", 104.0)),
            "idle": asyncio.create_task(call("idle", None)),
        }
        await asyncio.sleep(0)
        assert streams.cancel_stalled(now=105.5) == 1
        with pytest.raises(asyncio.CancelledError):
            await tasks["stalled"]
        assert not tasks["sending"].done() and not tasks["idle"].done()
        assert streams.cancel_stalled(now=105.5) == 0  # forgotten once cancelled
        assert streams.cancel_stalled(now=109.5) == 1
        with pytest.raises(asyncio.CancelledError):
            await tasks["sending"]
        tasks["idle"].cancel()
        await asyncio.gather(tasks["idle"], return_exceptions=True)
        assert not streams._streams

    asyncio.run(scenario())


def test_the_checker_runs_while_streams_are_watched() -> None:
    async def scenario() -> None:
        streams = StalledStreams(limit=0.2)

        async def stalled_call() -> None:
            watched = streams.watch()
            watched.sending_since = asyncio.get_running_loop().time() - 1.0
            try:
                await asyncio.sleep(60)
            finally:
                streams.forget(watched)

        task = asyncio.create_task(stalled_call())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
