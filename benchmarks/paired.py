"""Paired rounds: every variant timed on the same state in the same round.

On a shared machine the time of one call moves by tens of percent from one
moment to the next, so the ratio of two medians taken minutes apart (one
pytest-benchmark test per variant) moves as much.  Here pytest-benchmark times
one variant per test (``fastbatch``), and every other variant of the cell is
timed in the same round, on the same freshly reset state, in pytest-benchmark's
untimed setup (even rounds: just before) or teardown (odd rounds: just after).
Each round thus gives times taken within milliseconds of each other under the
same load, and the per-round ratio cancels most of that load.  The report is
the median of the per-round ratios with its spread (quartiles, min and max).

Variants a hundred times slower than the rest (vLLM <= 0.21's forward scan,
the pure-Python fallback) get rounds of their own, fewer, after the others':
in the same round as the fast variants, their milliseconds of memory traffic
(and the preemptions they attract on a shared machine) would leave the fast
ones cold in a cell meant to be warm.

Cold rounds (``evict``): the caches are flushed right before each timed call,
by touching a buffer bigger than the last-level cache, as a model's forward
pass does between two steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """The largest CPU cache of this machine (sysfs), else ``default``."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=default)


class Evictor:
    """Flushes the caches: writes one word of every cache line of a buffer
    twice the size of the last-level cache (after it, the benchmark's lists,
    ints, dict and strings come from memory, as after a forward pass)."""

    def __init__(self) -> None:
        self._buffer = np.zeros(2 * last_level_cache_bytes() // 8, dtype=np.int64)

    def __call__(self) -> None:
        self._buffer[::8] += 1  # 8 int64 = one 64-byte line


class PairedRounds:
    """pytest-benchmark's ``setup``/``teardown`` for one cell.

    ``prepare()`` puts the state back to fresh and returns the positional
    arguments of a call; ``others`` maps a variant name to a callable taking
    those arguments; ``check(name)`` (optional) verifies the state after the
    first call of each other variant; ``evict`` (optional) flushes the caches
    before every call, timed or not; else ``touch`` (optional) reads what a
    call will read, right before it, so that warm means warm even when the
    round's slow variants (or another process on this shared machine) have
    just evicted it.
    """

    def __init__(self, prepare: Callable[[], tuple], others: Mapping[str, Callable[..., Any]],
                 check: Callable[[str], None] | None = None,
                 evict: Callable[[], None] | None = None,
                 touch: Callable[[], None] | None = None) -> None:
        self.prepare, self.others, self.check = prepare, others, check
        self.evict, self.touch = evict, touch
        self.times: dict[str, list[float]] = {name: [] for name in others}
        self._round = 0

    def _fresh(self) -> tuple:
        args = self.prepare()
        if self.evict is not None:
            self.evict()
        elif self.touch is not None:
            self.touch()
        return args

    def _time_others(self) -> None:
        for name, function in self.others.items():
            args = self._fresh()
            started = time.perf_counter()
            function(*args)
            self.times[name].append(time.perf_counter() - started)
            if self.check is not None and len(self.times[name]) == 1:
                self.check(name)

    def setup(self) -> tuple[tuple, dict]:
        if self._round % 2 == 0:
            self._time_others()
        return self._fresh(), {}

    def teardown(self, *args: Any, **kwargs: Any) -> None:
        if self._round % 2 == 1:
            self._time_others()
        self._round += 1

    def run(self, timed: Callable[..., Any], rounds: int) -> list[float]:
        """The same rounds without pytest-benchmark: the times of ``timed``."""
        times = []
        for _ in range(rounds):
            args, _ = self.setup()
            started = time.perf_counter()
            timed(*args)
            times.append(time.perf_counter() - started)
            self.teardown()
        return times

    def summary(self, timed_name: str, timed: list[float]) -> dict[str, Any]:
        """Per variant: the median time (seconds); per other variant: the
        per-round ratios other / timed, as median, quartiles, min and max."""
        rounds = min([len(timed), *(len(t) for t in self.times.values())])
        medians = {timed_name: statistics.median(timed[:rounds])}
        ratios = {}
        for name, times in self.times.items():
            medians[name] = statistics.median(times[:rounds])
            ratios[name] = spread([o / t for o, t in zip(times, timed, strict=False)][:rounds])
        return {"rounds": rounds, "median_seconds": medians, "ratios": ratios}


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles, min and max of ``values``."""
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q1": q1, "q3": q3,
            "min": min(values), "max": max(values)}


def rounds_for(seconds_per_round: float, budget_s: float, most: int = 2000,
               least: int = 7) -> int:
    """How many paired rounds fit in ``budget_s`` (at least ``least``)."""
    return max(least, min(most, int(budget_s / max(seconds_per_round, 1e-7))))
