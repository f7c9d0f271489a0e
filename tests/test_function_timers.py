"""tools/function_timers.py, the in-engine profiles' timers (no vLLM): a
timer leaves out the garbage collections that ran inside its call, and the
collections are their own row."""

import gc
import importlib.util
import time
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "function_timers.py"


@pytest.fixture
def timers_module():
    spec = importlib.util.spec_from_file_location("function_timers", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Step:
    """A stand-in with one method to time: it only runs a collection."""

    def work(self) -> None:
        gc.collect()


def test_a_timer_leaves_out_the_collections_inside_its_call(timers_module, monkeypatch):
    monkeypatch.setattr(Step, "work", Step.work)  # put back after the test
    timers = timers_module.FunctionTimers({"Step.work": (__name__, "Step.work")})
    try:
        garbage = [[] for _ in range(200_000)]
        for item in garbage:
            item.append(item)  # cycles: only a collection frees them
        del garbage
        timers.reset()
        Step().work()
        report = timers.report()
    finally:
        timers.collections.remove()
    collections = report[timers_module.GARBAGE_COLLECTION]
    assert collections["calls"] == 1 and report["Step.work"]["calls"] == 1
    # The collection of 200,000 cycles is the collections' row, not the
    # method's, whose own time is the call around it.
    assert collections["seconds"] > 0
    assert report["Step.work"]["seconds"] < 0.5 * collections["seconds"]


def test_collections_are_timed_only_while_installed(timers_module):
    collections = timers_module.Collections(time.perf_counter)
    gc.collect()
    assert (collections.seconds, collections.calls) == (0.0, 0)
    collections.install()
    try:
        gc.collect()
    finally:
        collections.remove()
    assert collections.calls == 1 and collections.seconds > 0
    gc.collect()
    assert collections.calls == 1
    collections.reset()
    assert (collections.seconds, collections.calls) == (0.0, 0)


def test_a_late_bound_timer_times_what_the_class_holds_at_each_call(timers_module, monkeypatch):
    """``time_late_bound`` times an instance's method whatever its class holds
    when it is called: a method set on the class after the timer (a patch
    applied or reverted) is called and timed, and other instances are left
    alone."""
    made = []

    class Processor:
        def process(self, value):
            made.append(("stock", value))
            return value

    def patched(self, value):
        made.append(("patched", value))
        return -value

    timed, other = Processor(), Processor()
    timers = timers_module.FunctionTimers({})
    try:
        timers.time_late_bound("Processor.process", timed, "process")
        assert timed.process(1) == 1
        monkeypatch.setattr(Processor, "process", patched)
        assert timed.process(2) == -2
        assert other.process(3) == -3
        report = timers.report()
    finally:
        timers.collections.remove()
    assert made == [("stock", 1), ("patched", 2), ("patched", 3)]
    assert report["Processor.process"]["calls"] == 2
    assert report["Processor.process"]["seconds"] > 0
    (where,) = timers.where["Processor.process"]
    assert where.endswith("Processor instance .process, late bound")
