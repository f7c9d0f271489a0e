"""``prev_positions`` against the REAL vLLM 0.33.0 ``GPUModelRunner._compute_prev_positions``.

The real unbound method runs on a runner stand-in (the attributes it reads,
with vLLM's own ``CpuGpuBuffer``), the patched one on an identical copy; the
whole buffer must end up the same.  And the plugin side: the guard accepts
this vLLM and refuses a changed method, the activation check refuses a wrong
kernel, ``FASTBATCH_DISABLE=prev_positions`` leaves it stock.
"""

import logging
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

import fastbatch
from fastbatch import vllm_plugin
from fastbatch.patches import prev_positions as patch

pytestmark = pytest.mark.vllm
STOCK = GPUModelRunner._compute_prev_positions
NAMES = [f"req-{i}" for i in range(12)]


def _runner(req_ids, prev_req_id_to_index, max_num_reqs):
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
    prev_ids = draw(st.permutations(NAMES))[:num_prev]
    prev_map = {req_id: row for row, req_id in enumerate(prev_ids)}
    kept = draw(st.lists(st.sampled_from(prev_ids), unique=True)) if prev_ids else []
    new = [f"new-{i}" for i in range(draw(st.integers(0, 4)))]
    req_ids = draw(st.permutations(kept + new))
    num_reqs = draw(st.integers(max(0, len(req_ids) - 2), len(req_ids)))
    return req_ids, prev_map, num_reqs


@given(step=steps())
def test_matches_the_real_method(step):
    note(repr(step))
    req_ids, prev_map, num_reqs = step
    stock, ours = _runner(req_ids, prev_map, 16), _runner(req_ids, prev_map, 16)
    STOCK(stock, num_reqs)
    patch._compute_prev_positions(ours, num_reqs)
    assert _state(ours) == _state(stock)


def test_worked_example():
    stock = _runner(["kept", "moved", "new"], {"kept": 0, "moved": 2, "gone": 1}, 5)
    ours = _runner(["kept", "moved", "new"], {"kept": 0, "moved": 2, "gone": 1}, 5)
    STOCK(stock, 3)
    patch._compute_prev_positions(ours, 3)
    assert _state(ours) == _state(stock)
    assert ours.prev_positions.np.tolist() == [0, 2, -1, 55, 55]


def test_a_bad_value_raises_as_stock_does_but_writes_nothing():
    stock = _runner(["a", "b"], {"a": 1, "b": "x"}, 4)
    ours = _runner(["a", "b"], {"a": 1, "b": "x"}, 4)
    with pytest.raises((TypeError, ValueError)):
        STOCK(stock, 2)
    with pytest.raises(TypeError, match="'b'"):
        patch._compute_prev_positions(ours, 2)
    assert stock.prev_positions.np.tolist()[:2] == [1, 55]  # stock: half written
    assert ours.prev_positions.np.tolist()[:2] == [55, 55]


# --- the plugin ----------------------------------------------------------------


@pytest.fixture(autouse=True)
def stock_vllm():
    patch.revert()
    assert GPUModelRunner._compute_prev_positions is STOCK
    yield
    patch.revert()


def test_guard_accepts_the_installed_vllm():
    import vllm

    assert patch.check_target(vllm.__version__, STOCK) is None
    assert patch.apply() is True
    assert GPUModelRunner._compute_prev_positions is patch._compute_prev_positions
    assert patch.original() is STOCK


def test_cpu_runner_inherits_the_method():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert "_compute_prev_positions" not in vars(CPUModelRunner)
    patch.apply()
    assert CPUModelRunner._compute_prev_positions is patch._compute_prev_positions


def test_guard_refuses_a_changed_method(monkeypatch, logs):
    def changed(self, num_reqs):
        prev = self.input_batch.prev_req_id_to_index
        for i, req_id in enumerate(self.input_batch.req_ids[:num_reqs]):
            self.prev_positions.np[i] = prev.get(req_id, -1)

    monkeypatch.setattr(GPUModelRunner, "_compute_prev_positions", changed)
    assert patch.apply() is False
    assert GPUModelRunner._compute_prev_positions is changed
    (warning,) = logs.at(logging.WARNING)
    assert patch.TARGET in warning and "not a verified variant" in warning


@pytest.mark.parametrize("broken", ["wrong result", "raises"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    def wrong(req_ids, prev, column, num_reqs):
        if broken == "raises":
            raise ValueError("boom")
        for i, req_id in enumerate(req_ids[:num_reqs]):
            column[i] = prev.get(req_id, 0)  # 0 instead of -1 for new requests

    monkeypatch.setattr(fastbatch, "compute_prev_positions", wrong)
    assert patch.apply() is False
    assert GPUModelRunner._compute_prev_positions is STOCK
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and patch.TARGET in error


def test_disable_leaves_it_stock(monkeypatch, logs):
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", "prev_positions")
    vllm_plugin.register()
    assert GPUModelRunner._compute_prev_positions is STOCK
    assert vllm_plugin.status()["patches"]["prev_positions"] is False
    for module in vllm_plugin.PATCHES.values():
        __import__(module, fromlist=["revert"]).revert()


def test_patched_method_counts_its_work():
    patch.apply()
    fastbatch.reset_stats()
    runner = _runner(["a", "b", "c"], {"a": 1, "c": 0}, 4)
    GPUModelRunner._compute_prev_positions(runner, 3)
    stats = fastbatch.stats()
    assert (stats["prev_positions_calls"], stats["prev_positions_found"]) == (1, 2)
