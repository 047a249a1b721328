"""The prompt-prefix length cache (prefixes.py): TGIS's Moka cache of 256 ids for one hour,
failures not cached, one lookup for concurrent misses, metrics on misses only."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.prometheus_tools import Exposition, parse_exposition
from tgis.router.core.shard_client import PrefixLookupError, ShardError, ShardFailure
from tgis.router.intake.prefixes import CACHE_CAPACITY, CACHE_TTL_S, PrefixInfos
from tgis.router.ops.metrics import Metrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeShard:
    """Answers lookups from ``lengths``; a missing id fails as the shard does. Each lookup
    may wait on ``gate`` and advances the clock by ``cost`` seconds."""

    def __init__(self, clock: FakeClock, lengths: dict[str, int] | None = None) -> None:
        self.clock = clock
        self.lengths = dict(lengths or {})
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None
        self.cost = 0.25
        self.error: Exception | None = None

    async def lookup(self, prefix_id: str) -> int:
        self.calls.append(prefix_id)
        if self.gate is not None:
            await self.gate.wait()
        self.clock.now += self.cost
        if self.error is not None:
            raise self.error
        if prefix_id not in self.lengths:
            raise PrefixLookupError(f'prefix id "{prefix_id}" not found')
        return self.lengths[prefix_id]


def make(
    lengths: dict[str, int] | None = None, **kwargs: Any
) -> tuple[PrefixInfos, FakeShard, FakeClock, Metrics]:
    clock = FakeClock()
    shard = FakeShard(clock, lengths)
    metrics = Metrics(max_sequence_length=64, max_new_tokens=32, max_batch_size=4)
    return PrefixInfos(shard.lookup, metrics, clock=clock, **kwargs), shard, clock, metrics


def scrape(metrics: Metrics) -> Exposition:
    return parse_exposition(metrics.render().decode())


def run(factory: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(factory())  # type: ignore[arg-type]


def test_tgis_limits() -> None:
    assert (CACHE_CAPACITY, CACHE_TTL_S) == (256, 3600.0)


def test_miss_then_hit_asks_the_shard_once_and_records_the_miss_only() -> None:
    cache, shard, _, metrics = make({"p": 8})

    async def scenario() -> list[int]:
        return [await cache.get("p") for _ in range(3)]

    assert run(scenario) == [8, 8, 8]
    assert shard.calls == ["p"]
    exp = scrape(metrics)
    assert exp.value("tgi_prompt_load_duration_count") == 1
    assert exp.value("tgi_prompt_load_duration_sum") == pytest.approx(0.25)
    assert exp.value("tgi_prompt_load_failure") == 0


def test_entries_expire_an_hour_after_the_lookup() -> None:
    cache, shard, clock, metrics = make({"p": 8})

    async def scenario() -> None:
        assert await cache.get("p") == 8  # looked up at 1000, stored at 1000.25
        clock.now += CACHE_TTL_S - 1  # a use does not extend the entry's life
        assert await cache.get("p") == 8
        assert shard.calls == ["p"]
        shard.lengths["p"] = 12  # changed on disk: the old length lives on until expiry
        clock.now += 0.75  # 1000.25 + 3600 - 0.25 (binary fractions: exact)
        assert await cache.get("p") == 8
        clock.now += 0.25
        assert cache.cached("p") is None
        assert await cache.get("p") == 12

    run(scenario)
    assert shard.calls == ["p", "p"]
    assert scrape(metrics).value("tgi_prompt_load_duration_count") == 2


def test_at_most_256_entries_least_recently_used_out_first() -> None:
    lengths = {f"p{i}": i for i in range(CACHE_CAPACITY + 1)}
    cache, shard, _, _ = make(lengths)

    async def scenario() -> None:
        for i in range(CACHE_CAPACITY):
            await cache.get(f"p{i}")
        assert len(cache) == CACHE_CAPACITY
        await cache.get("p0")  # a hit: p0 is now the most recently used
        await cache.get(f"p{CACHE_CAPACITY}")  # one too many: p1 goes
        assert len(cache) == CACHE_CAPACITY
        assert cache.cached("p1") is None
        assert cache.cached("p0") == 0
        assert cache.cached(f"p{CACHE_CAPACITY}") == CACHE_CAPACITY
        calls = len(shard.calls)
        await cache.get("p2")
        assert len(shard.calls) == calls  # still cached
        await cache.get("p1")
        assert shard.calls[-1] == "p1"  # evicted: asked again

    run(scenario)


def test_expired_entries_make_room_before_live_ones() -> None:
    cache, _, clock, _ = make({"old": 1, "a": 2, "b": 3}, capacity=2)

    async def scenario() -> None:
        await cache.get("old")
        clock.now += CACHE_TTL_S / 2
        await cache.get("a")
        await cache.get("old")  # a hit: "a" is now the least recently used
        clock.now += CACHE_TTL_S / 2  # "old" expires, "a" does not
        await cache.get("b")  # one too many: the expired entry goes, not "a"
        assert len(cache) == 2
        assert (cache.cached("a"), cache.cached("b"), cache.cached("old")) == (2, 3, None)

    run(scenario)


def test_failures_are_not_cached_and_counted_each_time() -> None:
    cache, shard, _, metrics = make()

    async def scenario() -> list[str]:
        messages = []
        for _ in range(2):
            with pytest.raises(PrefixLookupError) as info:
                await cache.get("missing")
            messages.append(info.value.message)
        shard.lengths["missing"] = 4  # stored meanwhile: the next request finds it
        assert await cache.get("missing") == 4
        return messages

    assert run(scenario) == ['prefix id "missing" not found'] * 2
    assert shard.calls == ["missing"] * 3
    exp = scrape(metrics)
    assert exp.value("tgi_prompt_load_failure") == 2
    assert exp.value("tgi_prompt_load_failure_total") == 2
    assert exp.value("tgi_prompt_load_duration_count") == 1


def test_shard_errors_pass_through_uncached() -> None:
    cache, shard, _, metrics = make({"p": 3})
    shard.error = ShardError(ShardFailure.CONNECTION, "Could not connect to Text Generation server")

    async def scenario() -> None:
        with pytest.raises(ShardError):
            await cache.get("p")
        shard.error = None
        assert await cache.get("p") == 3

    run(scenario)
    assert scrape(metrics).value("tgi_prompt_load_failure") == 1


def test_concurrent_misses_share_one_lookup() -> None:
    cache, shard, _, metrics = make({"p": 5})

    async def scenario() -> list[int]:
        shard.gate = asyncio.Event()
        waiters = [asyncio.ensure_future(cache.get("p")) for _ in range(5)]
        other = asyncio.ensure_future(cache.get("q"))  # another id: a lookup of its own
        await asyncio.sleep(0.01)
        assert sorted(shard.calls) == ["p", "q"]
        shard.gate.set()
        with pytest.raises(PrefixLookupError):
            await other
        return list(await asyncio.gather(*waiters))

    assert run(scenario) == [5] * 5
    assert sorted(shard.calls) == ["p", "q"]
    exp = scrape(metrics)
    assert exp.value("tgi_prompt_load_duration_count") == 1
    assert exp.value("tgi_prompt_load_failure") == 1


def test_concurrent_misses_all_get_the_failure_then_the_next_asks_again() -> None:
    cache, shard, _, metrics = make()

    async def scenario() -> list[BaseException | int]:
        shard.gate = asyncio.Event()
        waiters = [asyncio.ensure_future(cache.get("p")) for _ in range(3)]
        await asyncio.sleep(0.01)
        shard.gate.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        shard.lengths["p"] = 7
        shard.gate = None
        assert await cache.get("p") == 7
        return list(results)

    results = run(scenario)
    assert all(isinstance(r, PrefixLookupError) for r in results)
    assert shard.calls == ["p", "p"]
    assert scrape(metrics).value("tgi_prompt_load_failure") == 1


def test_a_cancelled_waiter_leaves_the_lookup_to_the_others() -> None:
    cache, shard, _, _ = make({"p": 9})

    async def scenario() -> int:
        shard.gate = asyncio.Event()
        first = asyncio.ensure_future(cache.get("p"))
        second = asyncio.ensure_future(cache.get("p"))
        await asyncio.sleep(0.01)
        first.cancel()  # the client that caused the lookup went away
        await asyncio.sleep(0.01)
        shard.gate.set()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await second

    assert run(scenario) == 9
    assert shard.calls == ["p"]
    assert cache.cached("p") == 9


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        make(capacity=0)
