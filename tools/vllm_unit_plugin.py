"""pytest plugin for ``tools/vllm_unit_tests.py``: vLLM's own unit tests with
fastbatch active the way a user's process has it.

Loaded with ``-p vllm_unit_plugin`` (``tools/`` on ``PYTHONPATH``), before
vLLM's conftest files and before collection, it calls
``vllm.plugins.load_general_plugins()``: vLLM's loader runs every
``vllm.general_plugins`` entry point, fastbatch's among them, which applies
the pieces if ``FASTBATCH`` says so.  Nothing else of fastbatch is imported
here before that call.

It writes into ``FASTBATCH_UNIT_OUT``: ``outcomes.json`` (the controller's,
one outcome a test id) and ``status-<pid>.json`` (each process that ran
tests: ``fastbatch.vllm_plugin.status()``, counters and verify results, and
``by_file``: per test file the CPU seconds and the counters that moved).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

CPU_PLATFORM = Path(__file__).resolve().parent.parent / "tests" / "cpu_platform.py"

_outcomes: dict[str, str] = {}
_durations: dict[str, float] = {}
_by_file: dict[str, dict[str, int]] = {}  # counters that moved, per test file
_last: dict[str, int] = {}


def _flat_stats() -> dict[str, int]:
    try:
        import fastbatch
    except ImportError:
        return {}
    if not fastbatch.COMPILED:
        return {}
    return {f"{piece}.{name}": value for piece, counters in fastbatch.stats().items()
            for name, value in counters.items()}


def _out_dir() -> str | None:
    return os.environ.get("FASTBATCH_UNIT_OUT") or None


def _lift_the_triton_check() -> None:
    """vLLM 0.34.0's CPU platform refuses to build a config on x86 without
    triton-cpu, which no registry here has; the selected tests build configs
    for the scheduler and the output processor (pure Python), never a kernel.
    fastbatch's ``tests/cpu_platform.py`` lifts that refusal, as for its own
    tests; the same in every mode, stock included.  0.33.0 only warns:
    nothing is changed there."""
    import importlib.util

    if importlib.util.find_spec("vllm.v1.worker.gpu_input_batch") is not None:
        return  # Model Runner V1 is there: 0.33.0 or older
    spec = importlib.util.spec_from_file_location("fastbatch_tests_cpu_platform", CPU_PLATFORM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.lift_triton_refusal()


def pytest_configure(config: pytest.Config) -> None:
    from importlib.metadata import entry_points

    names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
    if os.environ.get("FASTBATCH", "0") not in ("", "0") and "fastbatch" not in names:
        raise pytest.UsageError(
            "vllm_unit_plugin: FASTBATCH is set but no 'fastbatch' entry point of group "
            f"vllm.general_plugins is installed here (found {names}); install fastbatch "
            "(or: tools/vllm_unit_tests.py --link-source)")
    _lift_the_triton_check()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    _last.update(_flat_stats())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu = time.process_time()
    yield
    now = _flat_stats()
    into = _by_file.setdefault(item.nodeid.split("::")[0], {})
    into["cpu_s"] = round(into.get("cpu_s", 0) + time.process_time() - cpu, 3)
    for name, value in now.items():
        if value != _last.get(name, 0):
            into[name] = into.get(name, 0) + value - _last.get(name, 0)
    _last.update(now)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # One outcome a test: an error in setup or teardown counts as failed, a
    # skip in setup as skipped.
    previous = _outcomes.get(report.nodeid)
    if report.failed:
        outcome = "failed"
    elif report.skipped:
        outcome = "skipped"
    else:
        outcome = "passed" if report.when == "call" else None
    if (outcome is not None and previous != "failed"
            and not (previous == "skipped" and outcome == "passed")):
        _outcomes[report.nodeid] = outcome
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = _out_dir()
    if out is None:
        return
    os.makedirs(out, exist_ok=True)
    if not hasattr(session.config, "workerinput"):  # the controller (or the one process)
        with open(os.path.join(out, "outcomes.json"), "w") as f:
            json.dump({"outcomes": dict(sorted(_outcomes.items())),
                       "durations": {k: round(v, 3) for k, v in sorted(_durations.items())}},
                      f, indent=1)
    try:
        from fastbatch.vllm_plugin import status
    except ImportError:  # stock run without fastbatch installed
        return
    if not _by_file:  # the xdist controller: it ran no test
        return
    with open(os.path.join(out, f"status-{os.getpid()}.json"), "w") as f:
        json.dump(dict(status(), by_file=_by_file), f, indent=1, default=str)
