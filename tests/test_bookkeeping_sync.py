"""The bookkeeping loop: compiled == reference == vLLM 0.33's loop; bad input; leaks.

No vLLM needed: the oracle is ``vllm_0_33_bookkeeping_loop``, the per-request
loop of ``GPUModelRunner._bookkeeping_sync`` transcribed;
``test_vllm_bookkeeping_sync.py`` runs the real method.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference
from leaks import assert_no_leak


@dataclass
class Step:
    """The state the loop reads and writes, as a GPUModelRunner holds it."""

    use_async: bool
    req_ids: list[Any]
    requests: dict[Any, SimpleNamespace]
    num_sampled_tokens: int
    valid_sampled_token_ids: list[list[int]] | None
    discarded: set[int] | None
    num_tokens_no_spec: np.ndarray
    token_ids_cpu: np.ndarray
    is_token_ids: np.ndarray
    max_model_len: int
    output_lists: list[list[int]] = field(default_factory=list)

    def arguments(self) -> tuple[Any, ...]:
        return (self.req_ids, self.requests, self.num_sampled_tokens,
                self.valid_sampled_token_ids, self.discarded, self.num_tokens_no_spec,
                self.token_ids_cpu, self.is_token_ids, self.max_model_len)

    def state(self) -> list[Any]:
        """A deep copy of everything the loop may change."""
        return copy.deepcopy([{r: s.output_token_ids for r, s in self.requests.items()},
                              self.num_tokens_no_spec.tolist(), self.token_ids_cpu.tolist(),
                              self.is_token_ids.tolist(), self.valid_sampled_token_ids])


def vllm_0_33_bookkeeping_loop(step: Step) -> None:
    """vLLM 0.31.0-0.33.0's loop, transcribed (``self`` replaced by ``step``)."""
    invalid_req_indices_set = step.discarded
    valid_sampled_token_ids = step.valid_sampled_token_ids
    for req_idx in range(step.num_sampled_tokens):
        if step.use_async:
            sampled_ids = [-1] if req_idx not in invalid_req_indices_set else None
        else:
            sampled_ids = valid_sampled_token_ids[req_idx]
        num_sampled_ids: int = len(sampled_ids) if sampled_ids else 0
        if not sampled_ids:
            continue
        start_idx = step.num_tokens_no_spec[req_idx]
        end_idx = start_idx + num_sampled_ids
        assert end_idx <= step.max_model_len, (
            "Sampled token IDs exceed the max model length. "
            f"Total number of tokens: {end_idx} > max_model_len: "
            f"{step.max_model_len}"
        )
        step.token_ids_cpu[req_idx, start_idx:end_idx] = sampled_ids
        step.is_token_ids[req_idx, start_idx:end_idx] = True
        step.num_tokens_no_spec[req_idx] = end_idx
        req_state = step.requests[step.req_ids[req_idx]]
        req_state.output_token_ids.extend(sampled_ids)


TOKENS = st.one_of(st.integers(0, 600), st.integers(2**18 - 2, 2**18 + 2),
                   st.integers(2**31 - 3, 2**31 - 1), st.just(-1))


@st.composite
def steps(draw, max_reqs: int = 12) -> Step:
    """Batches as the runner has them after sampling: async or not, requests
    discarded (partial prefills), spec rows of several lengths (empty: all
    rejected or discarded), requests near ``max_model_len``."""
    num_reqs = draw(st.integers(0, max_reqs))
    use_async = draw(st.booleans())
    max_model_len = draw(st.integers(4, 24))
    width = max_model_len + draw(st.integers(0, 2))
    rows = max_reqs + 1
    req_ids = [f"req-{i}" for i in range(num_reqs)]
    requests = {req_id: SimpleNamespace(output_token_ids=draw(st.lists(TOKENS, max_size=4)))
                for req_id in req_ids}
    starts = draw(st.lists(st.integers(0, max_model_len), min_size=rows, max_size=rows))
    discarded = set(draw(st.lists(st.integers(0, max(num_reqs - 1, 0)), max_size=3)))
    if use_async:
        valid = None
    else:
        valid = [draw(st.lists(TOKENS, max_size=4)) for _ in range(num_reqs)]
        for index in discarded:
            if index < num_reqs:
                valid[index].clear()
    token_ids = np.array(draw(st.lists(st.integers(-5, 50), min_size=rows * width,
                                       max_size=rows * width)), dtype=np.int32)
    return Step(use_async, req_ids, requests, num_reqs, valid,
                discarded if use_async else None, np.array(starts, dtype=np.int32),
                token_ids.reshape(rows, width), np.zeros((rows, width), dtype=bool),
                max_model_len)


def _outcome(run, step: Step) -> tuple[Any, ...]:
    try:
        run(step)
    except Exception as exc:  # the exception type is the outcome
        return (type(exc),)
    return (None,)


@given(step=steps())
def test_matches_vllm_loop(implementation, step):
    note(repr(step))
    expected, got = copy.deepcopy(step), copy.deepcopy(step)
    before = step.state()
    lists = [s.output_token_ids for s in got.requests.values()]
    outcome = _outcome(vllm_0_33_bookkeeping_loop, expected)
    got_outcome = _outcome(
        lambda s: implementation.append_sampled_token_ids(*s.arguments()), got)
    assert got_outcome == outcome
    if outcome == (None,):
        assert got.state() == expected.state()
    else:  # refused: nothing changed (the patch then runs vLLM's loop)
        assert got.state() == before
    # The request states' lists were changed in place, never replaced.
    assert [s.output_token_ids for s in got.requests.values()] == lists
    assert all(a is b for a, b in zip(
        [s.output_token_ids for s in got.requests.values()], lists, strict=True))


@given(step=steps())
def test_compiled_and_reference_agree_on_results_and_stats(step):
    results, stats = [], []
    for module in (fastbatch._kernels, _reference):
        module.reset_stats()
        state = copy.deepcopy(step)
        try:
            result: Any = module.append_sampled_token_ids(*state.arguments())
        except Exception as exc:
            result = (type(exc), str(exc))
        results.append((result, state.state()))
        stats.append(module.stats())
    assert results[0] == results[1]
    assert stats[0] == stats[1]
    assert stats[0]["bookkeeping_calls"] == 1
    if isinstance(results[0][0], int):
        assert stats[0]["bookkeeping_requests_updated"] == results[0][0]


def _plain_step(num_reqs: int = 3, use_async: bool = True) -> Step:
    req_ids = [f"r{i}" for i in range(num_reqs)]
    return Step(use_async, req_ids,
                {r: SimpleNamespace(output_token_ids=[1, 2]) for r in req_ids}, num_reqs,
                None if use_async else [[5, 6] for _ in req_ids], set(),
                np.full(num_reqs, 2, dtype=np.int32), np.zeros((num_reqs, 8), dtype=np.int32),
                np.zeros((num_reqs, 8), dtype=bool), 8)


BAD_INPUTS = [
    ("req_ids", (), TypeError, "req_ids"),
    ("requests", [], TypeError, "requests"),
    ("discarded", [1], TypeError, "discarded"),
    ("num_sampled_tokens", -1, ValueError, "num_sampled_tokens"),
    ("num_sampled_tokens", 4, IndexError, "fewer than the 4 sampled"),
    ("num_tokens_no_spec", np.zeros(3, dtype=np.int64), TypeError, "num_tokens_no_spec"),
    ("num_tokens_no_spec", [2, 2, 2], TypeError, "num_tokens_no_spec"),
    ("token_ids_cpu", np.zeros((3, 8), dtype=np.int64), TypeError, "token_ids_cpu"),
    ("token_ids_cpu", np.zeros(24, dtype=np.int32), TypeError, "token_ids_cpu"),
    ("is_token_ids", np.zeros((3, 8), dtype=np.uint8), TypeError, "is_token_ids"),
    ("max_model_len", 2, AssertionError, "max model length"),
    ("max_model_len", "8", TypeError, "integer"),
    ("num_sampled_tokens", 3.0, TypeError, "integer"),
]


@pytest.mark.parametrize(("name", "value", "error", "message"), BAD_INPUTS)
@pytest.mark.parametrize("use_async", [True, False])
def test_bad_input_raises_clearly_and_changes_nothing(implementation, name, value, error,
                                                      message, use_async):
    step = _plain_step(use_async=use_async)
    before, good = step.state(), getattr(step, name)
    setattr(step, name, value)
    with pytest.raises(error, match=message):
        implementation.append_sampled_token_ids(*step.arguments())
    setattr(step, name, good)
    assert step.state() == before


@pytest.mark.parametrize("implementation_name", ["compiled", "reference"])
def test_bad_rows_and_states_raise_clearly(implementation_name):
    module = fastbatch._kernels if implementation_name == "compiled" else _reference
    cases = [
        (lambda s: s.valid_sampled_token_ids.__setitem__(1, (5,)), TypeError,
         r"valid_sampled_token_ids\[1\] must be a list"),
        (lambda s: s.valid_sampled_token_ids[2].append("7"), TypeError,
         r"valid_sampled_token_ids\[2\]\[2\] must be an int"),
        (lambda s: s.valid_sampled_token_ids[2].append(True), TypeError, "must be an int"),
        (lambda s: s.valid_sampled_token_ids[0].append(2**31), OverflowError, "int32"),
        (lambda s: s.valid_sampled_token_ids.pop(), IndexError, "valid_sampled_token_ids"),
        (lambda s: s.requests.pop("r2"), KeyError, "r2"),
        (lambda s: setattr(s.requests["r1"], "output_token_ids", (1,)), TypeError,
         "output_token_ids must be a list"),
        (lambda s: s.num_tokens_no_spec.__setitem__(2, -1), IndexError, "num_tokens_no_spec"),
        (lambda s: setattr(s, "token_ids_cpu", np.zeros((3, 3), dtype=np.int32)),
         IndexError, "columns"),
        (lambda s: setattr(s, "is_token_ids", np.zeros((2, 8), dtype=bool)), IndexError,
         "rows of the batch arrays"),
    ]
    for spoil, error, message in cases:
        step = _plain_step(use_async=False)
        spoil(step)
        before = step.state()
        with pytest.raises(error, match=message):
            module.append_sampled_token_ids(*step.arguments())
        assert step.state() == before


def test_strided_and_read_only_arrays(implementation):
    """Views with strides are written through them; read-only arrays are refused."""
    step = _plain_step(use_async=False)
    expected = copy.deepcopy(step)
    vllm_0_33_bookkeeping_loop(expected)
    big = np.zeros((6, 16), dtype=np.int32)
    step.token_ids_cpu = big[::2, ::2]
    implementation.append_sampled_token_ids(*step.arguments())
    assert step.token_ids_cpu.tolist() == expected.token_ids_cpu.tolist()
    assert big[1::2].sum() == 0 and big[:, 1::2].sum() == 0

    step = _plain_step()
    step.num_tokens_no_spec.flags.writeable = False
    with pytest.raises(TypeError, match="num_tokens_no_spec"):
        implementation.append_sampled_token_ids(*step.arguments())


def test_shares_the_sampled_ints_and_appends_in_order():
    """Sync: the output lists get the very int objects of the rows (as
    ``extend`` does); a list shared by two requests gets both, in order."""
    step = _plain_step(use_async=False)
    shared = step.requests["r0"].output_token_ids
    step.requests["r2"].output_token_ids = shared
    step.valid_sampled_token_ids = [[300_001], [300_002, 300_003], [300_004, 300_005]]
    fastbatch.append_sampled_token_ids(*step.arguments())
    assert shared == [1, 2, 300_001, 300_004, 300_005]
    assert shared[2] is step.valid_sampled_token_ids[0][0]
    assert shared[3] is step.valid_sampled_token_ids[2][0]


def test_no_leak_on_success_or_error():
    kernel = fastbatch._kernels
    step = _plain_step(num_reqs=64, use_async=False)
    bad_requests = dict(step.requests)
    del bad_requests["r9"]
    lists = [s.output_token_ids for s in step.requests.values()]

    def run():
        for ids in lists:
            del ids[2:]
        step.num_tokens_no_spec[:] = 2
        step.valid_sampled_token_ids = [[300_000 + i, 7] for i in range(64)]
        kernel.append_sampled_token_ids(*step.arguments())
        step.use_async, step.valid_sampled_token_ids = True, None
        kernel.append_sampled_token_ids(*step.arguments())
        step.use_async = False
        with pytest.raises(KeyError):
            kernel.append_sampled_token_ids(
                step.req_ids, bad_requests, *step.arguments()[2:])

    for _ in range(100):
        run()
    assert_no_leak(run, [step.req_ids, step.requests, bad_requests, *lists,
                         step.num_tokens_no_spec, step.token_ids_cpu, step.is_token_ids],
                   1000)
    assert lists[5] == [1, 2, 300_005, 7, -1]  # sync, then async
