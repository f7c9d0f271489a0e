"""``input_ids`` against the REAL vLLM 0.33.0 ``GPUModelRunner._prepare_input_ids``.

The real unbound method runs on a runner stand-in (``stand_in_call``: the
attributes it reads, with vLLM's own ``CpuGpuBuffer``s, the device side a
second CPU tensor), the patched method on an identical one; every buffer and
attribute the method may write must end up the same.  Generated steps cover
the unchanged batch (vLLM's single-copy fast path), moved, new and finished
requests (the scatters), draft tokens (spec decode) with and without a draft
tensor, prompt embeds on and off, a PP broadcast to wait for, and the first
step (no previous sampled ids).  And the plugin side.
"""

import logging

import pytest
import torch
from hypothesis import given, note
from hypothesis import strategies as st
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

import fastbatch
from fastbatch import vllm_plugin
from fastbatch.patches import prepare_input_ids as patch
from fastbatch.patches.prepare_input_ids import call_state, stand_in_call

pytestmark = pytest.mark.vllm
STOCK = GPUModelRunner._prepare_input_ids
NAMES = [f"req-{i}" for i in range(12)]


@st.composite
def steps(draw):
    """The keywords of ``stand_in_call`` for one async step as vLLM makes it:
    the previous step's requests in rows 0..P-1, this step's batch after
    condense() (kept ones, maybe moved, plus new ones), a decode scheduling
    1 + its draft tokens (at most k), a new one a prompt chunk."""
    k = draw(st.integers(0, 3))
    num_prev = draw(st.integers(0, 10))
    prev_ids = draw(st.permutations(NAMES))[:num_prev]
    prev_map = {req_id: row for row, req_id in enumerate(prev_ids)}
    if draw(st.booleans()):  # the unchanged batch, in place
        req_ids = list(prev_ids)
    else:
        kept = draw(st.lists(st.sampled_from(prev_ids), unique=True)) if prev_ids else []
        new = [f"new-{i}" for i in range(draw(st.integers(0, 4)))]
        req_ids = draw(st.permutations(kept + new))
    spec, num_scheduled = {}, []
    for req_id in req_ids:
        drafts = draw(st.integers(0, k)) if k else 0
        if drafts or (k and draw(st.booleans())):
            spec[req_id] = [-1] * drafts
        num_scheduled.append(1 + drafts if req_id in prev_map
                             else draw(st.integers(1, 5)) + drafts)
    return dict(req_ids=req_ids, prev_positions=[prev_map.get(r, -1) for r in req_ids],
                num_scheduled=num_scheduled, scheduled_spec_tokens=spec,
                num_prev_reqs=num_prev, prev_num_spec_tokens=k,
                draft_tokens=draw(st.booleans()), prompt_embeds=draw(st.booleans()),
                pp_work=draw(st.booleans()), prev_sampled=draw(st.integers(0, 5)) > 0)


def _run_both(keywords):
    stock, ours = stand_in_call(**keywords), stand_in_call(**keywords)
    STOCK(stock.runner, *stock.arguments)
    patch._prepare_input_ids(ours.runner, *ours.arguments)
    return call_state(stock), call_state(ours)


@given(keywords=steps())
def test_matches_the_real_method(keywords):
    note(repr(keywords))
    expected, got = _run_both(keywords)
    assert got == expected


@pytest.mark.parametrize("case", ["unchanged", "moved", "spec", "spec without drafts",
                                  "all new", "first step"])
def test_each_path(case):
    """One hand-made step per path, with the result spelled out where short."""
    keywords = {
        "unchanged": dict(req_ids=["a", "b"], prev_positions=[0, 1], num_scheduled=[1, 1],
                          scheduled_spec_tokens={}, num_prev_reqs=2,
                          prev_num_spec_tokens=0),
        "moved": dict(req_ids=["b", "new", "a"], prev_positions=[1, -1, 0],
                      num_scheduled=[1, 2, 1], scheduled_spec_tokens={}, num_prev_reqs=2,
                      prev_num_spec_tokens=0, pp_work=True),
        "spec": dict(req_ids=["a", "b"], prev_positions=[1, 0], num_scheduled=[3, 2],
                     scheduled_spec_tokens={"a": [-1, -1], "b": [-1]}, num_prev_reqs=2,
                     prev_num_spec_tokens=2, prompt_embeds=True),
        "spec without drafts": dict(req_ids=["a"], prev_positions=[0], num_scheduled=[3],
                                    scheduled_spec_tokens={"a": [-1, -1]},
                                    num_prev_reqs=1, prev_num_spec_tokens=2,
                                    draft_tokens=False),
        "all new": dict(req_ids=["x", "y"], prev_positions=[-1, -1], num_scheduled=[2, 3],
                        scheduled_spec_tokens={}, num_prev_reqs=3, prev_num_spec_tokens=0,
                        prompt_embeds=True),
        "first step": dict(req_ids=["x"], prev_positions=[-1], num_scheduled=[4],
                           scheduled_spec_tokens={}, num_prev_reqs=0,
                           prev_num_spec_tokens=0, prev_sampled=False, pp_work=True,
                           prompt_embeds=True),
    }[case]
    expected, got = _run_both(keywords)
    assert got == expected
    if case == "spec":
        # rows: a (prev row 1) at 0..2, b (prev row 0) at 3..4; prev sampled ids
        # are 5000 + 3 * row, drafts 9000 + 2 * row + j.
        assert got["input_ids.gpu"][:5] == [5003, 9002, 9003, 5000, 9000]
        assert got["is_token_ids.cpu"][:5] == [True, True, True, True, True]
    if case == "moved":
        assert got["input_ids.gpu"][:4] == [5001, 1001, 1002, 5000]
        assert got["_pp_recv_work"] is None and got["pp_waits"] == 1


def test_pins_index_tensors_exactly_when_stock_pins(monkeypatch):
    """With vLLM's PIN_MEMORY on, every index tensor goes through a pinned copy
    (no pinned memory on this machine: pin_memory() is recorded instead)."""
    pinned = []

    def pin_memory(tensor):
        pinned.append(tensor.tolist())
        return tensor.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    call = stand_in_call(req_ids=["b", "a"], prev_positions=[1, 0], num_scheduled=[2, 1],
                         scheduled_spec_tokens={"b": [-1]}, num_prev_reqs=2,
                         prev_num_spec_tokens=1)
    monkeypatch.setattr(gpu_model_runner, "PIN_MEMORY", True)
    patch._prepare_input_ids(call.runner, *call.arguments)
    assert pinned == [[0, 2], [1, 0], [1], [1]]
    monkeypatch.setattr(gpu_model_runner, "PIN_MEMORY", False)
    pinned.clear()
    patch._prepare_input_ids(call.runner, *call.arguments)
    assert pinned == []


def test_index_tensors_are_new_each_call():
    """Stock builds new index tensors every call (the device copies are
    non-blocking): so does the patch, never a buffer reused across steps."""
    first = patch._index_tensor(fastbatch.prepare_input_ids_indices(
        ["a"], torch.tensor([0]).numpy(), torch.tensor([1]).numpy(), {}, 0, 1)[0][0])
    second = patch._index_tensor(fastbatch.prepare_input_ids_indices(
        ["a"], torch.tensor([0]).numpy(), torch.tensor([1]).numpy(), {}, 0, 1)[0][0])
    assert first.dtype == torch.int64 and first.data_ptr() != second.data_ptr()


# --- the plugin ----------------------------------------------------------------


@pytest.fixture(autouse=True)
def stock_vllm():
    patch.revert()
    assert GPUModelRunner._prepare_input_ids is STOCK
    yield
    patch.revert()


def test_guard_accepts_the_installed_vllm():
    import vllm

    assert patch.check_target(vllm.__version__, STOCK) is None
    assert patch.apply() is True
    assert GPUModelRunner._prepare_input_ids is patch._prepare_input_ids
    assert patch.original() is STOCK


def test_cpu_runner_inherits_the_method():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert "_prepare_input_ids" not in vars(CPUModelRunner)
    patch.apply()
    assert CPUModelRunner._prepare_input_ids is patch._prepare_input_ids


def test_guard_refuses_another_variant(monkeypatch, logs):
    """The replacement is the method's own code, so any change of it (one
    harmless statement here; 0.21-0.30 carry four other variants) is refused."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(STOCK)))
    tree.body[0].body.insert(1, ast.parse("total_num_scheduled_tokens += 0").body[0])
    namespace = {}
    exec(compile(ast.fix_missing_locations(tree), gpu_model_runner.__file__, "exec"),
         dict(vars(gpu_model_runner)), namespace)
    changed = namespace["_prepare_input_ids"]
    monkeypatch.setattr(GPUModelRunner, "_prepare_input_ids", changed)
    assert patch.check_target("0.33.0", changed) is not None
    assert patch.apply() is False
    (warning,) = logs.at(logging.WARNING)
    assert patch.TARGET in warning


def test_guard_refuses_older_releases():
    for version in ("0.28.0", "0.30.0", "0.34.0"):
        assert "not a verified version" in patch.check_target(version, STOCK)


@pytest.mark.parametrize("broken", ["swapped rows", "raises", "no drafts"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    right = fastbatch.prepare_input_ids_indices

    def wrong(*args):
        if broken == "raises":
            raise ValueError("boom")
        common, spec, match, max_flattened = right(*args)
        if broken == "swapped rows":
            return common[::-1].copy(), spec, match, max_flattened
        return common, spec[:, :0].copy(), match, max_flattened

    monkeypatch.setattr(fastbatch, "prepare_input_ids_indices", wrong)
    assert patch.apply() is False
    assert GPUModelRunner._prepare_input_ids is STOCK
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and patch.TARGET in error


def test_disable_leaves_it_stock(monkeypatch):
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", "input_ids")
    vllm_plugin.register()
    try:
        assert GPUModelRunner._prepare_input_ids is STOCK
        assert vllm_plugin.status()["patches"]["input_ids"] is False
    finally:
        for module in vllm_plugin.PATCHES.values():
            __import__(module, fromlist=["revert"]).revert()


def test_patched_method_counts_its_work():
    patch.apply()
    fastbatch.reset_stats()
    call = stand_in_call(req_ids=["b", "a", "n"], prev_positions=[1, 0, -1],
                         num_scheduled=[2, 1, 3], scheduled_spec_tokens={"b": [-1]},
                         num_prev_reqs=2, prev_num_spec_tokens=1)
    GPUModelRunner._prepare_input_ids(call.runner, *call.arguments)
    stats = fastbatch.stats()
    assert (stats["input_ids_calls"], stats["input_ids_common_requests"],
            stats["input_ids_spec_tokens"]) == (1, 2, 1)
