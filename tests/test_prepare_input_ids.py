"""prepare_input_ids: the index rows of ``GPUModelRunner._prepare_input_ids``.

* ``prepare_input_ids_indices``: compiled kernel == pure-Python twin == vLLM
  0.31-0.33's loop (no vLLM needed: the oracle is ``vllm_loop``, the method's
  loop transcribed); bad input; leaks;
* the patched method against the REAL vLLM 0.33.0 method (``vllm``-marked):
  the real unbound method runs on a runner stand-in (``stand_in_call``: the
  attributes it reads, with vLLM's own ``CpuGpuBuffer``s, the device side a
  second CPU tensor), the patched method on an identical one; every buffer and
  attribute the method may write must end up the same.  Generated steps cover
  the unchanged batch (vLLM's single-copy fast path), moved, new and finished
  requests (the scatters), draft tokens (spec decode) with and without a draft
  tensor, prompt embeds on and off, a PP broadcast to wait for, and the first
  step (no previous sampled ids);
* the plugin side: the guard, the activation check, ``FASTBATCH_DISABLE``.

vLLM is imported only inside the ``vllm``-marked tests, so that the others
run where vLLM is not installed.
"""

import functools
import logging

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference, registry, vllm_plugin
from fastbatch.patches import prepare_input_ids as patch
from fastbatch.patches.prepare_input_ids import call_state, stand_in_call
from leaks import assert_no_leak

NAME = "prepare_input_ids"
PIECE = registry.piece(NAME)
NAMES = [f"r{i}" for i in range(10)]


def vllm_loop(req_ids, prev_positions_np, cu_num_tokens, scheduled_spec_tokens,
              prev_num_spec_tokens, num_reqs):
    """vLLM 0.31.0-0.33.0's loop, word for word; returns its lists and flags."""
    prev_positions = prev_positions_np[:num_reqs]
    sample_flattened_indices: list[int] = []
    spec_flattened_indices: list[int] = []
    prev_draft_token_indices: list[int] = []
    prev_indices: list[int] = []
    common_indices_match = True
    max_flattened_index = -1
    total_num_spec_tokens = 0

    for cur_index in range(num_reqs):
        prev_index = prev_positions[cur_index]
        if prev_index < 0:
            continue
        prev_indices.append(prev_index)
        req_id = req_ids[cur_index]
        draft_len = len(scheduled_spec_tokens.get(req_id, ()))
        total_num_spec_tokens += draft_len
        flattened_index = cu_num_tokens[cur_index].item() - 1
        sample_flattened_indices.append(flattened_index - draft_len)
        spec_flattened_indices.extend(
            range(flattened_index - draft_len + 1, flattened_index + 1)
        )
        start = prev_index * prev_num_spec_tokens
        prev_draft_token_indices.extend(range(start, start + draft_len))
        common_indices_match &= prev_index == flattened_index
        max_flattened_index = max(max_flattened_index, flattened_index)
    return (sample_flattened_indices, prev_indices, spec_flattened_indices,
            prev_draft_token_indices, bool(common_indices_match), max_flattened_index,
            total_num_spec_tokens)


def _as_lists(result):
    common, spec, match, max_flattened = result
    for rows in (common, spec):
        assert rows.dtype == np.int64 and rows.ndim == 2 and rows.shape[0] == 2
        assert rows.flags.c_contiguous and rows.flags.writeable
    return (common[0].tolist(), common[1].tolist(), spec[0].tolist(), spec[1].tolist(),
            match, max_flattened, spec.shape[1])


@st.composite
def steps(draw):
    """One step's inputs: decodes kept in place or moved, new requests, holes,
    draft tokens for some (lists, tuples, empty), cu_num_tokens int32 or int64,
    the unchanged batch, a strided prev_positions column."""
    num_reqs = draw(st.integers(0, 10))
    num_prev = draw(st.integers(0, 12))
    unchanged = draw(st.booleans())
    if unchanged:
        prev = list(range(num_reqs))
        num_scheduled = [1] * num_reqs
    else:
        prev = draw(st.lists(st.one_of(st.just(-1), st.integers(-3, num_prev + 2)),
                             min_size=num_reqs, max_size=num_reqs))
        num_scheduled = draw(st.lists(st.integers(0, 5), min_size=num_reqs,
                                      max_size=num_reqs))
    req_ids = draw(st.lists(st.sampled_from([*NAMES, None]), min_size=num_reqs,
                            max_size=num_reqs + 2))
    spec = draw(st.dictionaries(st.sampled_from(NAMES), st.one_of(
        st.lists(st.just(-1), max_size=4), st.tuples(st.just(-1))), max_size=6))
    if unchanged and draw(st.booleans()):
        spec = {}
    dtype = draw(st.sampled_from([np.int32, np.int64]))
    cu = np.cumsum(np.asarray(num_scheduled, dtype=dtype), dtype=dtype)
    stride = draw(st.sampled_from([1, 2]))
    column = np.full((num_reqs + draw(st.integers(0, 2))) * stride, 77, dtype=np.int64)
    column = column[::stride]
    column[:num_reqs] = prev
    k = draw(st.integers(0, 4))
    return req_ids, column, cu, spec, k, num_reqs


@given(step=steps())
def test_matches_vllm_loop(implementation, step):
    note(repr(step))
    assert _as_lists(implementation.prepare_input_ids_indices(*step)) == vllm_loop(*step)


@given(step=steps())
def test_compiled_and_reference_agree_on_results_and_stats(step):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        results.append(_as_lists(module.prepare_input_ids_indices(*step)))
        stats.append(module.stats()[NAME])
    assert results[0] == results[1]
    assert stats[0] == stats[1] == {"calls": 1, "common_requests": len(results[0][1]),
                                    "spec_tokens": results[0][6]}


def test_worked_example(implementation):
    """vLLM's comment: cu_num_tokens [2, 5, 8], drafts [1, 2, 2]; and a new request."""
    step = (["a", "b", "new", "c"], np.array([0, 1, -1, 2], dtype=np.int64),
            np.array([2, 5, 6, 9]), {"a": [-1], "b": [-1, -1], "c": [-1, -1]}, 2, 4)
    common, spec, match, max_flattened = implementation.prepare_input_ids_indices(*step)
    assert common.tolist() == [[0, 2, 6], [0, 1, 2]]
    assert spec.tolist() == [[1, 3, 4, 7, 8], [0, 2, 3, 4, 5]]
    assert (match, max_flattened) == (False, 8)


def test_unchanged_batch_matches(implementation):
    common, spec, match, max_flattened = implementation.prepare_input_ids_indices(
        ["a", "b", "c"], np.arange(3, dtype=np.int64), np.array([1, 2, 3]), {}, 3, 3)
    assert common.tolist() == [[0, 1, 2], [0, 1, 2]] and spec.shape == (2, 0)
    assert (match, max_flattened) == (True, 2)


def test_no_common_request(implementation):
    common, spec, match, max_flattened = implementation.prepare_input_ids_indices(
        ["a"], np.array([-1], dtype=np.int64), np.array([4]), {"a": [-1]}, 2, 1)
    assert common.shape == spec.shape == (2, 0) and (match, max_flattened) == (True, -1)


# --- bad input: a clear exception ---------------------------------------------

def _good():
    return [["a", "b", "c"], np.array([1, -1, 0], dtype=np.int64), np.array([2, 3, 5]),
            {"a": [-1], "c": [-1, -1]}, 2, 3]


def _bad_cases():
    """(name, mutate(args), exception, message) for each kind of bad input."""
    def at(position, value):
        def mutate(args):
            args[position] = value
        return mutate

    return [
        ("req_ids not a list", at(0, ("a", "b", "c")), TypeError, "req_ids"),
        ("spec not a dict", at(3, [("a", [-1])]), TypeError, "scheduled_spec_tokens"),
        ("positions int32", at(1, np.array([1, -1, 0], dtype=np.int32)), TypeError,
         "prev_positions"),
        ("positions a list", at(1, [1, -1, 0]), TypeError, "prev_positions"),
        ("cu float", at(2, np.array([2.0, 3.0, 5.0])), TypeError, "cu_num_tokens"),
        ("cu 2-D", at(2, np.array([[2, 3, 5]])), TypeError, "cu_num_tokens"),
        ("k not an int", at(4, 2.0), TypeError, "prev_num_spec_tokens"),
        ("k too big", at(4, 2**63), OverflowError, "prev_num_spec_tokens"),
        ("negative num_reqs", at(5, -1), ValueError, "num_reqs"),
        ("too few positions", at(5, 4), IndexError, "prev_positions"),
        ("too few req_ids", at(0, ["a"]), IndexError, "req_ids"),
        ("too few cu entries", at(2, np.array([2, 3])), IndexError, "cu_num_tokens"),
        ("draft without len", at(3, {"a": 5}), TypeError, "len"),
        ("unhashable id", at(0, [["a"], "b", "c"]), TypeError, "unhashable"),
        ("index overflow", at(4, 2**63 - 1), OverflowError, "do not fit in int64"),
    ]


@pytest.mark.parametrize(("name", "mutate", "exception", "message"), _bad_cases(),
                         ids=[case[0] for case in _bad_cases()])
def test_bad_input_raises(implementation, name, mutate, exception, message):
    args = _good()
    mutate(args)
    before = repr(args)
    with pytest.raises(exception, match=message):
        implementation.prepare_input_ids_indices(*args)
    assert repr(args) == before


def test_vllm_raises_too_where_a_common_request_is_out_of_range():
    """Where fastbatch raises IndexError for a missing req_id or cu_num_tokens
    entry of a common request, vLLM's loop raises IndexError as well."""
    for mutate in (lambda args: args.__setitem__(0, ["a"]),
                   lambda args: args.__setitem__(2, np.array([2, 3]))):
        args = _good()
        mutate(args)
        with pytest.raises(IndexError):
            vllm_loop(*args)


# --- references and memory ---------------------------------------------------

def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    req_ids = [f"r{i}" for i in range(64)]
    column = np.arange(64, dtype=np.int64)[::-1].copy()
    column[::7] = -1
    cu = np.cumsum(np.full(64, 3))
    spec = {req_id: [-1, -1] for req_id in req_ids[::2]}
    bad_spec = {**spec, "r9": 5}

    def step():
        kernel.prepare_input_ids_indices(req_ids, column, cu, spec, 2, 64)
        with pytest.raises(TypeError):
            kernel.prepare_input_ids_indices(req_ids, column, cu, bad_spec, 2, 64)
        with pytest.raises(IndexError):
            kernel.prepare_input_ids_indices(req_ids, column, cu[:3], spec, 2, 64)

    for _ in range(100):
        step()
    assert_no_leak(step, [req_ids, column, cu, spec, bad_spec, *req_ids], 2000)


# --- against the real vLLM 0.33.0 method ---------------------------------------

RUNNER_NAMES = [f"req-{i}" for i in range(12)]


@functools.cache
def vllm_method():
    """vLLM's own ``_prepare_input_ids`` (the first one seen, checked)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = PIECE.main.original() or GPUModelRunner._prepare_input_ids
    assert not getattr(method, "__fastbatch__", False)
    return method


@pytest.fixture
def stock_vllm():
    """The test starts and ends with vLLM's own method in place."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    PIECE.revert()
    assert GPUModelRunner._prepare_input_ids is vllm_method()
    yield
    PIECE.revert()


@st.composite
def runner_steps(draw):
    """The keywords of ``stand_in_call`` for one async step as vLLM makes it:
    the previous step's requests in rows 0..P-1, this step's batch after
    condense() (kept ones, maybe moved, plus new ones), a decode scheduling
    1 + its draft tokens (at most k), a new one a prompt chunk."""
    k = draw(st.integers(0, 3))
    num_prev = draw(st.integers(0, 10))
    prev_ids = draw(st.permutations(RUNNER_NAMES))[:num_prev]
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
    vllm_method()(stock.runner, *stock.arguments)
    patch._prepare_input_ids(ours.runner, *ours.arguments)
    return call_state(stock), call_state(ours)


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@given(keywords=runner_steps())
def test_matches_the_real_method(keywords):
    note(repr(keywords))
    expected, got = _run_both(keywords)
    assert got == expected


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
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


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_pins_index_tensors_exactly_when_stock_pins(monkeypatch):
    """With vLLM's PIN_MEMORY on, every index tensor goes through a pinned copy
    (no pinned memory on this machine: pin_memory() is recorded instead)."""
    import torch
    from vllm.v1.worker import gpu_model_runner

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


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_index_tensors_are_new_each_call():
    """Stock builds new index tensors every call (the device copies are
    non-blocking): so does the patch, never a buffer reused across steps."""
    import torch

    first = patch._index_tensor(fastbatch.prepare_input_ids_indices(
        ["a"], torch.tensor([0]).numpy(), torch.tensor([1]).numpy(), {}, 0, 1)[0][0])
    second = patch._index_tensor(fastbatch.prepare_input_ids_indices(
        ["a"], torch.tensor([0]).numpy(), torch.tensor([1]).numpy(), {}, 0, 1)[0][0])
    assert first.dtype == torch.int64 and first.data_ptr() != second.data_ptr()


# --- the plugin: the guard, the activation check, FASTBATCH_DISABLE -------------

@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_accepts_the_installed_vllm():
    import vllm
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert PIECE.main.check_target(vllm.__version__, vllm_method()) is None
    assert PIECE.apply() is True
    assert GPUModelRunner._prepare_input_ids is patch._prepare_input_ids
    assert PIECE.main.original() is vllm_method()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_cpu_runner_inherits_the_method():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert "_prepare_input_ids" not in vars(CPUModelRunner)
    PIECE.apply()
    assert CPUModelRunner._prepare_input_ids is patch._prepare_input_ids


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_refuses_another_variant(monkeypatch, logs):
    """The replacement is the method's own code, so any change of it (one
    harmless statement here; 0.21-0.30 carry four other variants) is refused."""
    import ast
    import inspect
    import textwrap

    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    tree = ast.parse(textwrap.dedent(inspect.getsource(vllm_method())))
    tree.body[0].body.insert(1, ast.parse("total_num_scheduled_tokens += 0").body[0])
    namespace = {}
    exec(compile(ast.fix_missing_locations(tree), gpu_model_runner.__file__, "exec"),
         dict(vars(gpu_model_runner)), namespace)
    changed = namespace["_prepare_input_ids"]
    monkeypatch.setattr(GPUModelRunner, "_prepare_input_ids", changed)
    assert PIECE.main.check_target("0.33.0", changed) is not None
    assert PIECE.apply() is False
    (warning,) = logs.at(logging.WARNING)
    assert PIECE.main.target in warning


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_guard_refuses_older_releases():
    for version in ("0.28.0", "0.30.0", "0.34.0"):
        assert "not a verified version" in PIECE.main.check_target(version, vllm_method())


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
@pytest.mark.parametrize("broken", ["swapped rows", "raises", "no drafts"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    right = fastbatch.prepare_input_ids_indices

    def wrong(*args):
        if broken == "raises":
            raise ValueError("boom")
        common, spec, match, max_flattened = right(*args)
        if broken == "swapped rows":
            return common[::-1].copy(), spec, match, max_flattened
        return common, spec[:, :0].copy(), match, max_flattened

    monkeypatch.setattr(fastbatch, "prepare_input_ids_indices", wrong)
    assert PIECE.apply() is False
    assert GPUModelRunner._prepare_input_ids is vllm_method()
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and PIECE.main.target in error


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_disable_leaves_it_stock(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", NAME)
    vllm_plugin.register()
    try:
        assert GPUModelRunner._prepare_input_ids is vllm_method()
        assert vllm_plugin.status()["patches"][NAME] is False
    finally:
        vllm_plugin.revert()


@pytest.mark.vllm
@pytest.mark.usefixtures("stock_vllm")
def test_patched_method_counts_its_work():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    PIECE.apply()
    fastbatch.reset_stats()
    call = stand_in_call(req_ids=["b", "a", "n"], prev_positions=[1, 0, -1],
                         num_scheduled=[2, 1, 3], scheduled_spec_tokens={"b": [-1]},
                         num_prev_reqs=2, prev_num_spec_tokens=1)
    GPUModelRunner._prepare_input_ids(call.runner, *call.arguments)
    stats = fastbatch.stats()[NAME]
    assert (stats["calls"], stats["common_requests"], stats["spec_tokens"]) == (1, 2, 1)


# --- FASTBATCH_VERIFY: the shadow check -----------------------------------------

REAL_KERNEL = fastbatch.prepare_input_ids_indices


def kernel_wrong_for_big_batches(req_ids, prev_positions, cu_num_tokens, spec_tokens,
                                 prev_num_spec_tokens, num_reqs):
    """The real kernel, then for batches of more than six requests (the
    activation check's have at most four) the previous rows of the common
    requests reversed, and the fast path refused."""
    common, spec, _, max_flattened_index = REAL_KERNEL(
        req_ids, prev_positions, cu_num_tokens, spec_tokens, prev_num_spec_tokens, num_reqs)
    if num_reqs > 6:
        common = np.stack([common[0], common[1][::-1]])
        return common, spec, False, max_flattened_index
    return common, spec, _, max_flattened_index


@pytest.mark.vllm
@pytest.mark.usefixtures("verified_piece")
@given(keywords=runner_steps())
def test_verify_finds_no_divergence_on_real_steps(keywords, checked_method):
    """Every call checked against the real method: no divergence, every
    buffer as vLLM's method leaves it; the first step (no previous sampled
    ids, no loop) is not checked."""
    note(repr(keywords))
    method = checked_method()
    stock, ours = stand_in_call(**keywords), stand_in_call(**keywords)
    checked = PIECE.main.checked
    vllm_method()(stock.runner, *stock.arguments)
    assert method(ours.runner, *ours.arguments) is None
    assert call_state(ours) == call_state(stock)
    assert PIECE.main.divergences == 0
    assert PIECE.main.checked == checked + keywords["prev_sampled"]


BIG_STEP = dict(req_ids=[f"r{i}" for i in range(8)], prev_positions=[7, 6, 5, 4, 3, 2, 1, -1],
                num_scheduled=[1, 2, 1, 1, 1, 1, 1, 3],
                scheduled_spec_tokens={"r1": [-1]}, num_prev_reqs=8, prev_num_spec_tokens=1,
                prompt_embeds=True, pp_work=True)


@pytest.mark.vllm
def test_verify_catches_a_bug_the_activation_check_cannot_see(verify_dir, monkeypatch, logs,
                                                              checked_method):
    method = checked_method()  # the activation check passed with the real kernel
    monkeypatch.setattr(fastbatch, "prepare_input_ids_indices", kernel_wrong_for_big_batches)
    small = dict(BIG_STEP, req_ids=["a", "b"], prev_positions=[1, 0], num_scheduled=[1, 1],
                 scheduled_spec_tokens={})
    call = stand_in_call(**small)
    method(call.runner, *call.arguments)  # small batches: right
    assert PIECE.main.divergences == 0
    stock, ours = stand_in_call(**BIG_STEP), stand_in_call(**BIG_STEP)
    buffers = (ours.runner.input_ids.gpu, ours.runner.is_token_ids.cpu)
    vllm_method()(stock.runner, *stock.arguments)

    assert method(ours.runner, *ours.arguments) is None  # vLLM's return value

    assert call_state(ours) == call_state(stock)  # in the runner's own buffers
    assert ours.runner.input_ids.gpu is buffers[0] and ours.runner.is_token_ids.cpu is buffers[1]
    assert ours.runner._pp_recv_work is None and ours.pp_work.waits == 1
    assert (PIECE.main.checked, PIECE.main.divergences) == (2, 1)
    assert vllm_plugin.status()["verify"]["divergences"][NAME] == 1
    (error,) = logs.at(logging.ERROR)
    assert f"'{NAME}'" in error and "input_ids.gpu[0]: fastbatch wrote" in error

    # The reproducer replays the divergence, and no longer with the real kernel.
    (path,) = verify_dir.iterdir()
    assert path.name.startswith(f"{NAME}-") and str(path) in error
    assert "input_ids.gpu" in vllm_plugin.replay(str(path))
    monkeypatch.setattr(fastbatch, "prepare_input_ids_indices", REAL_KERNEL)
    assert vllm_plugin.replay(str(path)) is None

    # From now on the piece runs vLLM's code: the kernel is not called again.
    monkeypatch.setattr(fastbatch, "prepare_input_ids_indices", kernel_wrong_for_big_batches)
    fastbatch.reset_stats()
    again = stand_in_call(**BIG_STEP)
    method(again.runner, *again.arguments)
    assert call_state(again) == call_state(stock)
    assert fastbatch.stats()[NAME]["calls"] == 0
    assert (PIECE.main.checked, PIECE.main.divergences) == (2, 1)
    assert len(list(verify_dir.iterdir())) == 1


@pytest.mark.vllm
def test_verify_sampled_checks_only_some_calls(verify_dir, monkeypatch, checked_method):
    import random
    from types import SimpleNamespace

    from fastbatch import _verify

    monkeypatch.setattr(_verify, "random", SimpleNamespace(Random=lambda: random.Random(19)))
    method = checked_method(0.25)
    draws = random.Random(19)
    expected = sum(draws.random() < 0.25 for _ in range(200))
    stock = stand_in_call(**BIG_STEP)
    vllm_method()(stock.runner, *stock.arguments)
    for _ in range(200):
        ours = stand_in_call(**BIG_STEP)
        method(ours.runner, *ours.arguments)
        assert call_state(ours) == call_state(stock)
    assert 0 < PIECE.main.checked == expected < 100
    assert PIECE.main.divergences == 0
