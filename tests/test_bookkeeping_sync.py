"""bookkeeping_sync: the per-request loop of ``GPUModelRunner._bookkeeping_sync``.

* compiled kernel == pure-Python twin == vLLM 0.33's loop (no vLLM needed: the
  oracle is ``vllm_0_33_bookkeeping_loop``, the loop transcribed); bad input;
  leaks;
* the patch against the REAL vLLM 0.33.0 ``_bookkeeping_sync``
  (``vllm``-marked): each generated step is built twice as a real
  ``InputBatch`` (``add_request`` for every request, ``remove_request`` for
  some, ``condense`` or holes left), with the real ``CachedRequestState``
  objects, and a stand-in runner carrying what the method reads (the real
  ``_get_prompt_logprobs_dict`` and the CPU runner's ``_to_list``).  vLLM's
  own method runs on one copy, fastbatch's on the other: the return values,
  every array the batch holds, every output list (values and identity: still
  the very list the state and the batch share), ``prev_req_id_to_index`` and
  ``prev_sampled_token_ids`` must come out the same, and so must any
  exception.  Spec decoding runs the real ``RejectionSampler.parse_output`` on
  rows with rejections.  And the guard and the activation check.

vLLM is imported only inside the ``vllm``-marked tests, so that the others
run where vLLM is not installed.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from types import MethodType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st

import fastbatch
from fastbatch import _reference, registry, vllm_plugin
from fastbatch.patches import bookkeeping_sync as patch
from leaks import assert_no_leak

NAME = "bookkeeping_sync"
PIECE = registry.piece(NAME)


# --- compiled == reference == vLLM 0.33's loop (transcribed) ------------------

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
    assert stats[0][NAME]["calls"] == 1
    if isinstance(results[0][0], int):
        assert stats[0][NAME]["requests_updated"] == results[0][0]


# --- bad input: a clear exception, and nothing changed ----------------------

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


# --- references and memory ---------------------------------------------------

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


# --- against the real vLLM 0.33.0 _bookkeeping_sync ---------------------------

MAX_REQS = 12
WIDTH = 48  # the InputBatch's max_model_len (columns of token_ids_cpu)
VOCAB = 1000
EXAMPLES = int(os.environ.get("FASTBATCH_VLLM_EXAMPLES", 1000))


@st.composite
def runner_steps(draw):
    """What a step looks like when ``_bookkeeping_sync`` runs."""
    num_added = draw(st.integers(0, MAX_REQS))
    prompt_lens = draw(st.lists(st.integers(1, 8), min_size=num_added, max_size=num_added))
    outputs = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=6),
                            min_size=num_added, max_size=num_added))
    removed = draw(st.sets(st.integers(0, max(num_added - 1, 0)), max_size=3)
                   ) if num_added else set()
    num_reqs = num_added - len(removed)
    use_async = draw(st.booleans())
    num_spec = draw(st.sampled_from([0, 0, 1, 3]))
    # Tokens per row: the first always sampled, then accepted drafts, then -1.
    accepted = draw(st.lists(st.integers(0, num_spec), min_size=num_reqs, max_size=num_reqs))
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_reqs * (num_spec + 1),
                           max_size=num_reqs * (num_spec + 1)))
    return SimpleNamespace(
        prompt_lens=prompt_lens, outputs=outputs, removed=removed,
        condense=draw(st.booleans()) if removed else True,
        use_async=use_async, num_spec=num_spec, accepted=accepted, tokens=tokens,
        discarded=draw(st.lists(st.booleans(), min_size=num_reqs, max_size=num_reqs)),
        prev_sampled=use_async and (num_spec > 0 or draw(st.booleans())),
        max_model_len=draw(st.sampled_from([WIDTH, WIDTH, 14, 12])),
    )


def _runner(step):
    """A real InputBatch holding ``step`` and a stand-in GPUModelRunner around it."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    input_batch = InputBatch(
        max_num_reqs=MAX_REQS, max_model_len=WIDTH, max_num_batched_tokens=WIDTH,
        device=torch.device("cpu"), vocab_size=VOCAB, block_sizes=[16],
        max_num_blocks_per_req=[WIDTH // 16],
        # The batch and the sampling metadata then share the output lists.
        logitsprocs_need_output_token_ids=True,
    )
    requests = {}
    for index, (prompt_len, output) in enumerate(zip(step.prompt_lens, step.outputs,
                                                     strict=True)):
        state = CachedRequestState(
            req_id=f"req-{index}", prompt_token_ids=list(range(1, prompt_len + 1)),
            mm_features=[], sampling_params=SamplingParams(temperature=0.0),
            generator=None, block_ids=([],), num_computed_tokens=prompt_len,
            output_token_ids=list(output))
        requests[state.req_id] = state
        input_batch.add_request(state)
    for index in sorted(step.removed):
        input_batch.remove_request(f"req-{index}")
        del requests[f"req-{index}"]
    if step.condense:
        input_batch.condense()
    input_batch.refresh_metadata()
    num_reqs = input_batch.num_reqs

    columns = step.num_spec + 1
    sampled = np.array(step.tokens, dtype=np.int32).reshape(num_reqs, columns)
    for row, accepted in enumerate(step.accepted):
        sampled[row, accepted + 1:] = -1  # rejected drafts
    discard = np.zeros(MAX_REQS, dtype=bool)
    discard[:num_reqs] = step.discarded
    if step.prev_sampled:  # with spec decoding, propose_draft_token_ids set it
        input_batch.prev_sampled_token_ids = torch.zeros((num_reqs, 1), dtype=torch.int32)
    runner = SimpleNamespace(
        use_async_scheduling=step.use_async, max_model_len=step.max_model_len,
        input_batch=input_batch, requests=requests, num_prompt_logprobs={},
        discard_request_mask=SimpleNamespace(np=discard),
    )
    runner._to_list = MethodType(CPUModelRunner._to_list, runner)
    runner._get_prompt_logprobs_dict = MethodType(GPUModelRunner._get_prompt_logprobs_dict,
                                                  runner)
    sampler_output = SimpleNamespace(sampled_token_ids=torch.from_numpy(sampled),
                                     logprobs_tensors=None)
    arguments = (SimpleNamespace(num_scheduled_tokens={}), sampler_output, None,
                 torch.zeros(num_reqs), num_reqs)
    return runner, arguments


def _run_method(method, runner, arguments):
    try:
        return ("returned", method(runner, *arguments))
    except Exception as exc:  # the exception is the outcome
        return ("raised", type(exc), str(exc))


def _runner_state(runner, arguments):
    batch = runner.input_batch
    return [
        batch.num_tokens_no_spec.tolist(), batch.token_ids_cpu.tolist(),
        batch.is_token_ids.tolist(), list(batch.req_output_token_ids),
        {req_id: state.output_token_ids for req_id, state in runner.requests.items()},
        batch.prev_req_id_to_index,
        batch.prev_sampled_token_ids is arguments[1].sampled_token_ids,
        None if batch.prev_sampled_token_ids is None else batch.prev_sampled_token_ids.shape,
    ]


def _check_identities(runner):
    """The batch, its sampling metadata and the states still share each list."""
    batch = runner.input_batch
    assert batch.sampling_metadata.output_token_ids is batch.req_output_token_ids
    for req_id, index in batch.req_id_to_index.items():
        assert batch.req_output_token_ids[index] is runner.requests[req_id].output_token_ids


def vllm_method():
    """vLLM's own ``_bookkeeping_sync``, whatever is installed now."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    method = PIECE.main.original() or GPUModelRunner._bookkeeping_sync
    assert not getattr(method, "__fastbatch__", False)
    return method


@pytest.mark.vllm
@settings(max_examples=EXAMPLES)
@given(step=runner_steps())
def test_patched_method_matches_real_vllm(step):
    note(repr(step))
    stock, ours = _runner(step), _runner(step)
    fastbatch.reset_stats()
    expected = _run_method(vllm_method(), *stock)
    got = _run_method(patch._bookkeeping_sync, *ours)
    assert got == expected
    assert _runner_state(*ours) == _runner_state(*stock)
    _check_identities(ours[0])
    if got[0] == "returned":  # and the compiled call did it, vLLM's loop did not
        valid_sampled_token_ids = got[1][3]
        updated = (len(step.discarded) - sum(step.discarded) if step.use_async
                   else sum(1 for ids in valid_sampled_token_ids if ids))
        assert fastbatch.stats()[NAME]["calls"] == 1
        assert fastbatch.stats()[NAME]["requests_updated"] == updated


@pytest.mark.vllm
def test_examples_cover_every_path():
    """The cases the strategy must reach: async and sync, spec rows, discards,
    the assertion, holes (vLLM raises KeyError: fastbatch runs its loop)."""
    seen = set()

    @settings(max_examples=300, database=None)
    @given(step=runner_steps())
    def collect(step):
        stock = _runner(step)
        outcome = _run_method(vllm_method(), *stock)
        seen.add(("async" if step.use_async else "sync", step.num_spec > 0,
                  any(step.discarded), outcome[0] == "raised" and outcome[1].__name__))

    collect()
    kinds = {(mode, spec) for mode, spec, _, _ in seen}
    assert kinds == {("async", False), ("async", True), ("sync", False), ("sync", True)}
    assert {raised for *_, raised in seen} >= {False, "AssertionError", "KeyError"}
    assert any(discarded for _, _, discarded, _ in seen)


@pytest.mark.vllm
def test_the_plugin_installs_it_on_the_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert PIECE.apply()
    try:
        assert GPUModelRunner._bookkeeping_sync is patch._bookkeeping_sync
        step = SimpleNamespace(
            prompt_lens=[3, 4, 5], outputs=[[7], [], [8, 9]], removed={1}, condense=True,
            use_async=True, num_spec=0, accepted=[0, 0], tokens=[11, 12],
            discarded=[False, True], prev_sampled=False, max_model_len=WIDTH)
        stock, ours = _runner(step), _runner(step)
        assert (_run_method(GPUModelRunner._bookkeeping_sync, *ours)
                == _run_method(vllm_method(), *stock))
        assert _runner_state(*ours) == _runner_state(*stock)
    finally:
        PIECE.revert()
    assert not getattr(GPUModelRunner._bookkeeping_sync, "__fastbatch__", False)


# --- the guard and the activation check ---------------------------------------

@pytest.mark.vllm
def test_guard_accepts_033_and_refuses_a_changed_method():
    import vllm

    assert patch.PATCH.check_target(vllm.__version__, vllm_method()) is None
    assert "not a verified version" in patch.PATCH.check_target("0.30.0", vllm_method())

    def changed(self, *args):  # any other code: refused
        return vllm_method()(self, *args)

    assert "not a verified variant" in patch.PATCH.check_target(vllm.__version__, changed)


@pytest.mark.vllm
def test_activation_check_passes_and_refuses_a_wrong_kernel(monkeypatch):
    assert patch.activation_check(vllm_method(), patch._bookkeeping_sync) is None

    def forgets_the_counts(req_ids, requests, num_sampled, valid, discarded, num_tokens,
                           *rest):
        for index in range(num_sampled):
            if valid is None:
                requests[req_ids[index]].output_token_ids.append(-1)
            else:
                requests[req_ids[index]].output_token_ids.extend(valid[index])

    monkeypatch.setattr(fastbatch, "append_sampled_token_ids", forgets_the_counts)
    assert patch.activation_check(vllm_method(), patch._bookkeeping_sync) is not None


# --- FASTBATCH_VERIFY: the shadow check -----------------------------------------

REAL_KERNEL = fastbatch.append_sampled_token_ids


def kernel_wrong_for_big_batches(req_ids, requests, num_sampled_tokens, *rest):
    """The real kernel, then for batches of more than four requests (the
    activation check's have four) the first request's last token written
    one off, an extra placeholder in its output list and its token count one
    too many."""
    found = REAL_KERNEL(req_ids, requests, num_sampled_tokens, *rest)
    if num_sampled_tokens > 4:
        num_tokens_no_spec, token_ids_cpu = rest[2], rest[3]
        token_ids_cpu[0, num_tokens_no_spec[0] - 1] += 1
        requests[req_ids[0]].output_token_ids.append(-1)
        num_tokens_no_spec[0] += 1
    return found


@pytest.mark.vllm
@pytest.mark.usefixtures("verified_piece")
@settings(max_examples=EXAMPLES)
@given(step=runner_steps())
def test_verify_finds_no_divergence_on_real_steps(step, checked_method):
    """Every call checked against the real method (vLLM's exceptions
    included): no divergence, and the runner as vLLM's method leaves it."""
    note(repr(step))
    method = checked_method()
    stock, ours = _runner(step), _runner(step)
    checked = PIECE.main.checked
    expected = _run_method(vllm_method(), *stock)
    assert _run_method(method, *ours) == expected
    assert _runner_state(*ours) == _runner_state(*stock)
    _check_identities(ours[0])
    assert PIECE.main.divergences == 0
    assert PIECE.main.checked == checked + 1


def _big_step(use_async):
    """Six requests, the second discarded (with a generator); spec rows with
    rejections when not async."""
    return SimpleNamespace(
        prompt_lens=[3, 4, 5, 2, 6, 1], outputs=[[7], [], [8, 9], [1], [2, 2], []],
        removed=set(), condense=True, use_async=use_async, num_spec=0 if use_async else 2,
        accepted=[0, 2, 1, 0, 2, 1], tokens=list(range(100, 100 + 6 * (1 if use_async else 3))),
        discarded=[False, True, False, False, False, False], prev_sampled=False,
        max_model_len=WIDTH)


def _with_generator(runner):
    runner.input_batch.generators[1] = patch.Generator(1000)  # offset-keeping stand-in
    return runner


@pytest.mark.vllm
@pytest.mark.parametrize("use_async", [True, False])
def test_verify_catches_a_bug_the_activation_check_cannot_see(verify_dir, monkeypatch, logs,
                                                             use_async, checked_method):
    method = checked_method()  # the activation check passed with the real kernel
    monkeypatch.setattr(fastbatch, "append_sampled_token_ids", kernel_wrong_for_big_batches)
    small = _big_step(use_async)
    small.prompt_lens, small.outputs = small.prompt_lens[:3], small.outputs[:3]
    small.accepted, small.discarded = small.accepted[:3], small.discarded[:3]
    small.tokens = small.tokens[:len(small.tokens) // 2]
    assert _run_method(method, *_runner(small))[0] == "returned"  # small batches: right
    assert PIECE.main.divergences == 0
    step = _big_step(use_async)
    stock, ours = _runner(step), _runner(step)
    _with_generator(stock[0]), _with_generator(ours[0])
    lists = {req_id: state.output_token_ids for req_id, state in ours[0].requests.items()}
    expected = _run_method(vllm_method(), *stock)

    got = _run_method(method, *ours)

    assert got == expected and got[0] == "returned"  # vLLM's return value
    assert _runner_state(*ours) == _runner_state(*stock)
    _check_identities(ours[0])  # vLLM's lists, the very ones the batch shares
    assert all(state.output_token_ids is lists[req_id]
               for req_id, state in ours[0].requests.items())
    assert ours[0].input_batch.generators[1].offset == 996
    assert (PIECE.main.checked, PIECE.main.divergences) == (2, 1)
    assert vllm_plugin.status()["verify"]["divergences"][NAME] == 1
    (error,) = logs.at(logging.ERROR)
    assert f"'{NAME}'" in error and "num_tokens_no_spec: fastbatch gave" in error

    # The reproducer replays the divergence, and no longer with the real kernel.
    (path,) = verify_dir.iterdir()
    assert path.name.startswith(f"{NAME}-") and str(path) in error
    assert "num_tokens_no_spec" in vllm_plugin.replay(str(path))
    monkeypatch.setattr(fastbatch, "append_sampled_token_ids", REAL_KERNEL)
    assert vllm_plugin.replay(str(path)) is None

    # From now on the piece runs vLLM's code: the kernel is not called again.
    monkeypatch.setattr(fastbatch, "append_sampled_token_ids", kernel_wrong_for_big_batches)
    fastbatch.reset_stats()
    again = _runner(step)
    _with_generator(again[0])
    assert _run_method(method, *again) == expected
    assert _runner_state(*again) == _runner_state(*stock)
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
    expected = sum(draws.random() < 0.25 for _ in range(100))
    step = _big_step(True)
    stock = _runner(step)
    result = _run_method(vllm_method(), *stock)
    for _ in range(100):
        ours = _runner(step)
        assert _run_method(method, *ours) == result
        assert _runner_state(*ours) == _runner_state(*stock)
    assert 0 < PIECE.main.checked == expected < 50
    assert PIECE.main.divergences == 0
