"""SingleFlight: threads that ask for one key at once share one load, its error too, and
a failed load is not remembered."""

from __future__ import annotations

import threading
import time

from tgis.shard.adapters.single_flight import SingleFlight


def ask_at_once(
    flights: SingleFlight[int], lock: threading.Lock, load: object, count: int
) -> list[object]:
    barrier = threading.Barrier(count)
    results: list[object] = [None] * count

    def worker(i: int) -> None:
        barrier.wait()
        with lock:
            flight = flights.join("k")
        try:
            results[i] = flights.land(flight, load)  # type: ignore[arg-type]
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def counted(result: object) -> tuple[list[int], object]:
    """A slow load (every thread joins while it runs) that returns ``result``, or raises
    it when it is an exception, and the list of its calls."""
    calls: list[int] = []

    def load() -> object:
        calls.append(1)
        time.sleep(0.2)
        if isinstance(result, Exception):
            raise result
        return result

    return calls, load


def test_one_load_for_every_thread_asking_at_once() -> None:
    lock = threading.Lock()
    calls, load = counted(42)
    assert ask_at_once(SingleFlight(lock), lock, load, 8) == [42] * 8
    assert len(calls) == 1


def test_an_error_reaches_every_waiter_and_the_next_caller_loads_again() -> None:
    lock = threading.Lock()
    flights: SingleFlight[int] = SingleFlight(lock)
    calls, failing = counted(ValueError("unreadable"))
    results = ask_at_once(flights, lock, failing, 4)
    assert len(calls) == 1
    assert all(isinstance(r, ValueError) and str(r) == "unreadable" for r in results)
    with lock:
        flight = flights.join("k")
    assert flight.owner  # nothing remembered
    assert flights.land(flight, lambda: 7) == 7
