"""prev_positions: ``GPUModelRunner._compute_prev_positions``.

* compiled kernel == pure-Python twin == vLLM 0.33's loop (no vLLM needed: the
  oracle is ``vllm_loop``, the method's loop transcribed); bad input; leaks;
* against the REAL vLLM 0.33.0 method (``vllm``-marked): the real unbound
  method runs on a runner stand-in (the attributes it reads, with vLLM's own
  ``CpuGpuBuffer``), the patched one on an identical copy; the whole buffer
  must end up the same;
* the plugin side: the guard accepts this vLLM and refuses a changed method,
  the activation check refuses a wrong kernel,
  ``FASTBATCH_DISABLE=prev_positions`` leaves it stock.

vLLM is imported only inside the ``vllm``-marked tests, so that the others
run where vLLM is not installed.
"""

import functools
import logging
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference, registry, vllm_plugin
from fastbatch.patches import prev_positions as patch
from leaks import assert_no_leak

NAME = "prev_positions"
PIECE = registry.piece(NAME)
NAMES = [f"r{i}" for i in range(12)]


def vllm_loop(req_ids, prev_req_id_to_index, prev_positions_np, num_reqs):
    """vLLM 0.21.0-0.33.0's loop (after its early return for an empty map)."""
    prev_positions = prev_positions_np[:num_reqs]
    for i, req_id in enumerate(req_ids[:num_reqs]):
        prev_positions[i] = prev_req_id_to_index.get(req_id, -1)


@st.composite
def columns(draw):
    """(req_ids, map, column, num_reqs): kept, moved, new and finished
    requests, holes, duplicates, fewer or more requests than num_reqs, a
    strided column."""
    req_ids = draw(st.lists(st.sampled_from([*NAMES, None]), max_size=10))
    prev = draw(st.dictionaries(st.sampled_from(NAMES), st.one_of(
        st.integers(0, 16), st.integers(-2**63, 2**63 - 1), st.just(-1)), max_size=12))
    num_reqs = draw(st.integers(0, len(req_ids) + 2))
    slots = min(num_reqs, len(req_ids)) + draw(st.integers(0, 3))
    stride = draw(st.sampled_from([1, 2]))
    column = np.arange(100, 100 + slots * stride, dtype=np.int64)[::stride]
    return req_ids, prev, column, num_reqs


@given(case=columns())
def test_matches_vllm_loop(implementation, case):
    note(repr(case))
    req_ids, prev, column, num_reqs = case
    expected = column.copy()
    vllm_loop(req_ids, prev, expected, num_reqs)
    found = implementation.compute_prev_positions(req_ids, prev, column, num_reqs)
    assert column.tolist() == expected.tolist()
    assert found == sum(1 for req_id in req_ids[:num_reqs] if req_id in prev)


@given(case=columns())
def test_compiled_and_reference_agree_on_results_and_stats(case):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        req_ids, prev, column, num_reqs = case
        column = column.copy()
        results.append((module.compute_prev_positions(req_ids, prev, column, num_reqs),
                        column.tolist()))
        stats.append(module.stats()[NAME])
    assert results[0] == results[1]
    assert stats[0] == stats[1] == {"calls": 1, "found": results[0][0]}


def test_worked_example(implementation):
    column = np.full(6, 7, dtype=np.int64)
    found = implementation.compute_prev_positions(
        ["kept", "moved", "new", None, "last"], {"kept": 0, "moved": 3, "gone": 1,
                                                 "last": 2}, column[:4], 4)
    assert found == 2
    assert column.tolist() == [0, 3, -1, -1, 7, 7]  # only num_reqs entries written


def test_values_numpy_accepts_are_accepted(implementation):
    """vLLM stores Python ints; bools and numpy ints store as numpy stores them."""
    column = np.zeros(3, dtype=np.int64)
    implementation.compute_prev_positions(
        ["a", "b", "c"], {"a": True, "b": np.int32(5), "c": 2**63 - 1}, column, 3)
    assert column.tolist() == [1, 5, 2**63 - 1]


# --- bad input: a clear exception, and nothing changed ----------------------

def _bad_cases():
    """(name, args, exception, message) for each kind of bad input."""
    good_ids, good_map = ["a", "b", "c"], {"a": 2, "b": 0}

    def column(dtype=np.int64, size=3):
        return np.full(size, 7, dtype=dtype)

    read_only = column()
    read_only.flags.writeable = False
    return [
        ("req_ids not a list", (tuple(good_ids), good_map, column(), 3), TypeError, "req_ids"),
        ("map not a dict", (good_ids, [("a", 2)], column(), 3), TypeError,
         "prev_req_id_to_index"),
        ("column int32", (good_ids, good_map, column(np.int32), 3), TypeError, "int64"),
        ("column float", (good_ids, good_map, column(np.float64), 3), TypeError, "int64"),
        ("column 2-D", (good_ids, good_map, np.zeros((3, 1), np.int64), 3), TypeError,
         "1-D"),
        ("column a list", (good_ids, good_map, [7, 7, 7], 3), TypeError, "prev_positions"),
        ("column read-only", (good_ids, good_map, read_only, 3), TypeError, "writable"),
        ("too few slots", (good_ids, good_map, column(size=2), 3), IndexError, "slots"),
        ("negative num_reqs", (good_ids, good_map, column(), -1), ValueError, "num_reqs"),
        ("value a string", (good_ids, {"a": "2"}, column(), 3), TypeError, "'a'"),
        ("value a float", (good_ids, {"b": 1.0}, column(), 3), TypeError, "'b'"),
        ("value None", (good_ids, {"c": None}, column(), 3), TypeError, "'c'"),
        ("value too big", (good_ids, {"c": 2**63}, column(), 3), OverflowError, "int64"),
        ("value too small", (good_ids, {"c": -2**63 - 1}, column(), 3), OverflowError,
         "int64"),
        ("unhashable id", (["a", ["b"]], good_map, column(), 3), TypeError, "unhashable"),
    ]


@pytest.mark.parametrize(("name", "args", "exception", "message"), _bad_cases(),
                         ids=[case[0] for case in _bad_cases()])
def test_bad_input_raises_before_any_change(implementation, name, args, exception,
                                            message):
    column = args[2]
    before = np.array(column).tolist()
    with pytest.raises(exception, match=message):
        implementation.compute_prev_positions(*args)
    assert np.array(column).tolist() == before


def test_vllm_would_write_part_of_the_column_before_failing():
    """Where vLLM's loop fails half way (a bad value after good ones), it has
    already written the good ones; fastbatch writes nothing (stricter)."""
    column, ours = np.full(3, 7, dtype=np.int64), np.full(3, 7, dtype=np.int64)
    with pytest.raises(TypeError):
        vllm_loop(["a", "b"], {"a": 1, "b": None}, column, 2)
    with pytest.raises(TypeError):
        fastbatch.compute_prev_positions(["a", "b"], {"a": 1, "b": None}, ours, 2)
    assert column.tolist() == [1, 7, 7] and ours.tolist() == [7, 7, 7]


# --- references and memory ---------------------------------------------------

def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    req_ids = [f"r{i}" for i in range(64)] + [None]
    prev = {req_id: 300_000 + i for i, req_id in enumerate(req_ids[:60])}
    bad_prev = {**prev, "r9": 1.5}
    column = np.zeros(80, dtype=np.int64)

    def step():
        kernel.compute_prev_positions(req_ids, prev, column, 65)
        with pytest.raises(TypeError):
            kernel.compute_prev_positions(req_ids, bad_prev, column, 65)
        with pytest.raises(IndexError):
            kernel.compute_prev_positions(req_ids, prev, column[:3], 65)

    for _ in range(100):
        step()
    assert_no_leak(step, [req_ids, prev, bad_prev, column, *req_ids[:64]], 2000)
    assert column[:3].tolist() == [300_000, 300_001, 300_002]


# --- against the real vLLM 0.33.0 method ---------------------------------------

RUNNER_NAMES = [f"req-{i}" for i in range(12)]


@functools.cache
def vllm_method():
    """vLLM's own ``_compute_prev_positions`` (the first one seen, checked)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = PIECE.main.original() or GPUModelRunner._compute_prev_positions
    assert not getattr(method, "__fastbatch__", False)
    return method


@pytest.fixture
def stock_vllm():
    """The test starts and ends with vLLM's own method in place."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    PIECE.revert()
    assert GPUModelRunner._compute_prev_positions is vllm_method()
    yield
    PIECE.revert()


def _runner(req_ids, prev_req_id_to_index, max_num_reqs):
    import torch
    from vllm.v1.utils import CpuGpuBuffer

    positions = CpuGpuBuffer(max_num_reqs, dtype=torch.int64, device=torch.device("cpu"),
                             pin_memory=False)
    positions.np[:] = 55  # stale values from an earlier step
    positions.gpu.fill_(-7)
    return SimpleNamespace(
        input_batch=SimpleNamespace(req_ids=list(req_ids),
                                    prev_req_id_to_index=dict(prev_req_id_to_index)),
        prev_positions=positions)


def _state(runner):
    return (runner.prev_positions.cpu.tolist(), runner.prev_positions.np.tolist(),
            runner.prev_positions.gpu.tolist(), sorted(vars(runner)),
            runner.input_batch.req_ids, runner.input_batch.prev_req_id_to_index)


@st.composite
def steps(draw):
    """A step after condense(): kept, moved, new and finished requests; the
    first step (empty map); num_reqs below the number of ids."""
    num_prev = draw(st.integers(0, 10))
    prev_ids = draw(st.permutations(RUNNER_NAMES))[:num_prev]
    prev_map = {req_id: row for row, req_id in enumerate(prev_ids)}
    kept = draw(st.lists(st.sampled_from(prev_ids), unique=True)) if prev_ids else []
    new = [f"new-{i}" for i in range(draw(st.integers(0, 4)))]
    req_ids = draw(st.permutations(kept + new))
    num_reqs = draw(st.integers(max(0, len(req_ids) - 2), len(req_ids)))
    return req_ids, prev_map, num_reqs


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@given(step=steps())
def test_matches_the_real_method(step):
    note(repr(step))
    req_ids, prev_map, num_reqs = step
    stock, ours = _runner(req_ids, prev_map, 16), _runner(req_ids, prev_map, 16)
    vllm_method()(stock, num_reqs)
    patch._compute_prev_positions(ours, num_reqs)
    assert _state(ours) == _state(stock)


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_worked_example_on_the_real_method():
    stock = _runner(["kept", "moved", "new"], {"kept": 0, "moved": 2, "gone": 1}, 5)
    ours = _runner(["kept", "moved", "new"], {"kept": 0, "moved": 2, "gone": 1}, 5)
    vllm_method()(stock, 3)
    patch._compute_prev_positions(ours, 3)
    assert _state(ours) == _state(stock)
    assert ours.prev_positions.np.tolist() == [0, 2, -1, 55, 55]


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_a_bad_value_raises_as_stock_does_but_writes_nothing():
    stock = _runner(["a", "b"], {"a": 1, "b": "x"}, 4)
    ours = _runner(["a", "b"], {"a": 1, "b": "x"}, 4)
    with pytest.raises((TypeError, ValueError)):
        vllm_method()(stock, 2)
    with pytest.raises(TypeError, match="'b'"):
        patch._compute_prev_positions(ours, 2)
    assert stock.prev_positions.np.tolist()[:2] == [1, 55]  # stock: half written
    assert ours.prev_positions.np.tolist()[:2] == [55, 55]


# --- the plugin: the guard, the activation check, FASTBATCH_DISABLE -------------

@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_accepts_the_installed_vllm():
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert PIECE.main.check_target(vllm.__version__, vllm_method()) is None
    assert PIECE.apply() is True
    assert GPUModelRunner._compute_prev_positions is patch._compute_prev_positions
    assert PIECE.main.original() is vllm_method()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_cpu_runner_inherits_the_method():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert "_compute_prev_positions" not in vars(CPUModelRunner)
    PIECE.apply()
    assert CPUModelRunner._compute_prev_positions is patch._compute_prev_positions


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_refuses_a_changed_method(monkeypatch, logs):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def changed(self, num_reqs):
        prev = self.input_batch.prev_req_id_to_index
        for i, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            self.prev_positions.np[i] = prev.get(req_id, -1)

    monkeypatch.setattr(GPUModelRunner, "_compute_prev_positions", changed)
    assert PIECE.apply() is False
    assert GPUModelRunner._compute_prev_positions is changed
    (warning,) = logs.at(logging.WARNING)
    assert PIECE.main.target in warning and "not a verified variant" in warning


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("broken", ["wrong result", "raises"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def wrong(req_ids, prev, column, num_reqs):
        if broken == "raises":
            raise ValueError("boom")
        for i, req_id in enumerate(req_ids[:num_reqs]):
            column[i] = prev.get(req_id, 0)  # 0 instead of -1 for new requests

    monkeypatch.setattr(fastbatch, "compute_prev_positions", wrong)
    assert PIECE.apply() is False
    assert GPUModelRunner._compute_prev_positions is vllm_method()
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and PIECE.main.target in error


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_disable_leaves_it_stock(monkeypatch, logs):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", NAME)
    vllm_plugin.register()
    try:
        assert GPUModelRunner._compute_prev_positions is vllm_method()
        assert vllm_plugin.status()["patches"][NAME] is False
    finally:
        vllm_plugin.revert()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_patched_method_counts_its_work():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    PIECE.apply()
    fastbatch.reset_stats()
    runner = _runner(["a", "b", "c"], {"a": 1, "c": 0}, 4)
    GPUModelRunner._compute_prev_positions(runner, 3)
    stats = fastbatch.stats()
    assert (stats[NAME]["calls"], stats[NAME]["found"]) == (1, 2)


# --- FASTBATCH_VERIFY: the shadow check -----------------------------------------

REAL_KERNEL = fastbatch.compute_prev_positions


def kernel_wrong_for_big_batches(req_ids, prev, column, num_reqs):
    """The real kernel, then the first slot one off, for batches of more than
    six requests (the activation check's have at most five)."""
    found = REAL_KERNEL(req_ids, prev, column, num_reqs)
    if num_reqs > 6:
        column[0] += 1
    return found


@pytest.mark.vllm
@pytest.mark.usefixtures("verified_piece")
@given(step=steps())
def test_verify_finds_no_divergence_on_real_steps(step, checked_method):
    """Every call checked against the real method: no divergence, and the
    column is what vLLM's method leaves."""
    note(repr(step))
    method = checked_method()
    req_ids, prev_map, num_reqs = step
    stock, ours = _runner(req_ids, prev_map, 16), _runner(req_ids, prev_map, 16)
    checked = PIECE.main.checked
    vllm_method()(stock, num_reqs)
    assert method(ours, num_reqs) is None
    assert _state(ours) == _state(stock)
    assert PIECE.main.divergences == 0
    assert PIECE.main.checked == checked + 1  # the early return (first step) too


@pytest.mark.vllm
def test_verify_catches_a_bug_the_activation_check_cannot_see(verify_dir, monkeypatch, logs,
                                                              checked_method):
    method = checked_method()  # the activation check passed with the real kernel
    monkeypatch.setattr(fastbatch, "compute_prev_positions", kernel_wrong_for_big_batches)
    req_ids = [f"req-{i}" for i in range(8)]
    prev = {req_id: 9 - i for i, req_id in enumerate(req_ids[:6])}
    small = _runner(req_ids[:5], prev, 10)
    method(small, 5)  # small batches: right
    assert PIECE.main.divergences == 0
    stock, ours = _runner(req_ids, prev, 10), _runner(req_ids, prev, 10)
    column = ours.prev_positions.np
    vllm_method()(stock, 8)

    assert method(ours, 8) is None  # vLLM's return value

    assert _state(ours) == _state(stock)  # vLLM's column, in the runner's own buffer
    assert ours.prev_positions.np is column
    assert ours.prev_positions.np.tolist()[:8] == [9, 8, 7, 6, 5, 4, -1, -1]
    assert (PIECE.main.checked, PIECE.main.divergences) == (2, 1)
    assert vllm_plugin.status()["verify"]["divergences"][NAME] == 1
    (error,) = logs.at(logging.ERROR)
    assert f"'{NAME}'" in error and "prev_positions[0]: fastbatch wrote 10, vLLM 9" in error

    # The reproducer replays the divergence, and no longer with the real kernel.
    (path,) = verify_dir.iterdir()
    assert path.name.startswith(f"{NAME}-") and str(path) in error
    assert "prev_positions[0]" in vllm_plugin.replay(str(path))
    monkeypatch.setattr(fastbatch, "compute_prev_positions", REAL_KERNEL)
    assert vllm_plugin.replay(str(path)) is None

    # From now on the piece runs vLLM's code: the kernel is not called again.
    monkeypatch.setattr(fastbatch, "compute_prev_positions", kernel_wrong_for_big_batches)
    fastbatch.reset_stats()
    again = _runner(req_ids, prev, 10)
    method(again, 8)
    assert _state(again) == _state(stock)
    assert fastbatch.stats()[NAME]["calls"] == 0
    assert (PIECE.main.checked, PIECE.main.divergences) == (2, 1)
    assert len(list(verify_dir.iterdir())) == 1


@pytest.mark.vllm
def test_verify_sampled_checks_only_some_calls(verify_dir, monkeypatch, checked_method):
    import random

    from fastbatch import _verify

    monkeypatch.setattr(_verify, "random", SimpleNamespace(Random=lambda: random.Random(19)))
    method = checked_method(0.25)
    draws = random.Random(19)
    expected = sum(draws.random() < 0.25 for _ in range(200))
    stock = _runner(["a", "b", "c"], {"a": 2, "c": 0}, 4)
    vllm_method()(stock, 3)
    for _ in range(200):
        ours = _runner(["a", "b", "c"], {"a": 2, "c": 0}, 4)
        method(ours, 3)
        assert _state(ours) == _state(stock)
    assert 0 < PIECE.main.checked == expected < 100
    assert PIECE.main.divergences == 0
