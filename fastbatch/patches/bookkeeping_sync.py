"""Patch: ``vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync``.

What is replaced: the per-request loop of the method that, after sampling,
records each request's new tokens on the CPU side: ``token_ids_cpu``,
``is_token_ids`` and ``num_tokens_no_spec`` of the input batch, and the
request's ``output_token_ids`` list (the same list object that the input batch
and the sampling metadata hold). vLLM's method with that loop done by one
compiled call (``fastbatch.append_sampled_token_ids``). vLLM 0.31.0 to 0.33.0.

Guard: the whole method's fingerprint; the activation check on runner
stand-ins; the shadow runs vLLM's method on copies of what it writes.

When it can go: when fastbatch no longer supports a vLLM with Model Runner V1
(0.33.0 is the last), or if vLLM moves the loop into compiled or vectorised
code.

Upstream: vllm-project/vllm#41286 (the migration to Model Runner V2); vLLM
0.34.0 removed Model Runner V1, so nothing is left to propose upstream.

Story and numbers: ``docs/pieces/bookkeeping_sync.md``.
"""

from __future__ import annotations

import copy
from types import MethodType, SimpleNamespace
from typing import Any

import fastbatch
from fastbatch.patches._patch import Patch, Shadow

GROUP = "runner"  # fastbatch.registry.GROUPS

try:  # the names vLLM's method uses, from where vLLM's module takes them
    import numpy as np
    import vllm.envs as envs
    from vllm.utils.gpu_sync_debug import gpu_sync_allowed
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner, count_nans_per_row
except ImportError:  # another vLLM: its method is not the verified variant,
    np = envs = gpu_sync_allowed = RejectionSampler = count_nans_per_row = None
    GPUModelRunner = None

VERIFIED_FINGERPRINTS = {
    "e1369eeed7e9567dfcdb18b2dc48400554a0967e9286d10cc7d7c27723c70a1d":
        "vLLM 0.31.0-0.33.0",
}

# What the compiled call refuses without changing anything; vLLM's loop then
# runs and raises (or not) exactly as stock does.
_REFUSED = (AssertionError, AttributeError, IndexError, KeyError, OverflowError,
            RuntimeError, TypeError, ValueError)


def _vllm_loop(self: Any, req_ids: list[str], num_sampled_tokens: int,
               valid_sampled_token_ids: list[list[int]],
               invalid_req_indices_set: set[int] | None) -> None:
    """vLLM's loop, verbatim, for the inputs the compiled call refuses."""
    for req_idx in range(num_sampled_tokens):
        if self.use_async_scheduling:
            sampled_ids = [-1] if req_idx not in invalid_req_indices_set else None
        else:
            sampled_ids = valid_sampled_token_ids[req_idx]

        num_sampled_ids: int = len(sampled_ids) if sampled_ids else 0

        if not sampled_ids:
            continue

        start_idx = self.input_batch.num_tokens_no_spec[req_idx]
        end_idx = start_idx + num_sampled_ids
        assert end_idx <= self.max_model_len, (
            "Sampled token IDs exceed the max model length. "
            f"Total number of tokens: {end_idx} > max_model_len: "
            f"{self.max_model_len}"
        )

        self.input_batch.token_ids_cpu[req_idx, start_idx:end_idx] = sampled_ids
        self.input_batch.is_token_ids[req_idx, start_idx:end_idx] = True
        self.input_batch.num_tokens_no_spec[req_idx] = end_idx

        req_id = req_ids[req_idx]
        req_state = self.requests[req_id]
        req_state.output_token_ids.extend(sampled_ids)


def _bookkeeping_sync(
    self: Any,
    scheduler_output: Any,
    sampler_output: Any,
    logits: Any,
    hidden_states: Any,
    num_scheduled_tokens: int,
) -> tuple[Any, ...]:
    """fastbatch's drop-in for ``GPUModelRunner._bookkeeping_sync``: vLLM
    0.31.0-0.33.0's method with its per-request loop as one compiled call."""
    num_nans: Any = None
    num_nans_in_logits: dict[str, int] = {}
    if envs.VLLM_COMPUTE_NANS_IN_LOGITS:
        if self.use_async_scheduling:
            # Keep the counts on device; they ride the async output copy
            # stream rather than blocking here.
            num_nans = None if logits is None else count_nans_per_row(logits)
        else:
            num_nans_in_logits = self._get_nans_in_logits(logits)

    num_reqs = self.input_batch.num_reqs
    discard_sampled_tokens_req_indices = np.nonzero(
        self.discard_request_mask.np[:num_reqs]
    )[0]
    for i in discard_sampled_tokens_req_indices:
        gen = self.input_batch.generators.get(int(i))
        if gen is not None:
            gen.set_offset(gen.get_offset() - 4)

    # Copy some objects so they don't get modified after returning.
    # This is important when using async scheduling.
    req_ids_output_copy = self.input_batch.req_ids.copy()
    req_id_to_index_output_copy = self.input_batch.req_id_to_index.copy()

    num_sampled_tokens = sampler_output.sampled_token_ids.shape[0]
    sampled_token_ids = sampler_output.sampled_token_ids
    logprobs_tensors = sampler_output.logprobs_tensors
    invalid_req_indices = []
    invalid_req_indices_set = None
    logprobs_lists = None
    if not self.use_async_scheduling:
        with gpu_sync_allowed():
            # Get the valid generated tokens.
            max_gen_len = sampled_token_ids.shape[-1]
            if max_gen_len == 1:
                # No spec decode tokens.
                valid_sampled_token_ids = self._to_list(sampled_token_ids)
                # Mask out the sampled tokens that should not be sampled.
                for i in discard_sampled_tokens_req_indices:
                    valid_sampled_token_ids[int(i)].clear()

                if logprobs_tensors is not None:
                    logprobs_lists = logprobs_tensors.tolists()
            else:
                # Includes spec decode tokens.
                valid_sampled_token_ids, logprobs_lists = (
                    RejectionSampler.parse_output(
                        sampled_token_ids,
                        self.input_batch.vocab_size,
                        discard_sampled_tokens_req_indices,
                        logprobs_tensors=logprobs_tensors,
                    )
                )
    else:
        valid_sampled_token_ids = []
        invalid_req_indices = discard_sampled_tokens_req_indices.tolist()
        invalid_req_indices_set = set(invalid_req_indices)

        # Cache the sampled tokens on the GPU and avoid CPU sync.
        # These will be copied into input_ids in the next step
        # when preparing inputs.
        # With spec decoding, this is done in propose_draft_token_ids().
        if self.input_batch.prev_sampled_token_ids is None:
            assert sampled_token_ids.shape[-1] == 1
            self.input_batch.prev_sampled_token_ids = sampled_token_ids
        self.input_batch.prev_req_id_to_index = {
            req_id: i
            for i, req_id in enumerate(self.input_batch.req_ids)
            if i not in invalid_req_indices_set
        }

    # Cache the sampled tokens in the model runner, so that the scheduler
    # doesn't need to send them back.  (fastbatch: vLLM's loop, compiled.)
    req_ids = self.input_batch.req_ids
    try:
        fastbatch.append_sampled_token_ids(
            req_ids, self.requests, num_sampled_tokens,
            None if self.use_async_scheduling else valid_sampled_token_ids,
            invalid_req_indices_set, self.input_batch.num_tokens_no_spec,
            self.input_batch.token_ids_cpu, self.input_batch.is_token_ids,
            self.max_model_len)
        refused = False
    except _REFUSED:
        refused = True
    if refused:  # nothing changed: vLLM's loop, with vLLM's errors (and tracebacks)
        _vllm_loop(self, req_ids, num_sampled_tokens, valid_sampled_token_ids,
                   invalid_req_indices_set)

    # Compute prompt logprobs if needed.
    prompt_logprobs_dict = self._get_prompt_logprobs_dict(
        hidden_states[:num_scheduled_tokens],
        scheduler_output.num_scheduled_tokens,
    )

    return (
        num_nans_in_logits,
        num_nans,
        logprobs_lists,
        valid_sampled_token_ids,
        prompt_logprobs_dict,
        req_ids_output_copy,
        req_id_to_index_output_copy,
        invalid_req_indices,
    )




def stand_in_runner(*, use_async: bool, max_model_len: int, num_reqs: int,
                    req_ids: list[Any], req_id_to_index: dict[str, int],
                    generators: dict[int, Any], vocab_size: int,
                    prev_sampled_token_ids: Any, prev_req_id_to_index: Any,
                    num_tokens_no_spec: Any, token_ids_cpu: Any, is_token_ids: Any,
                    requests: dict[str, Any], discard_mask: Any,
                    prompt_logprobs: Any = None) -> SimpleNamespace:
    """What the method reads and writes of a ``GPUModelRunner``: its input
    batch's fields, the request states, the discard mask; ``_to_list`` as
    ``.tolist()``, vLLM's own ``_get_nans_in_logits``, and a
    ``_get_prompt_logprobs_dict`` that returns ``prompt_logprobs`` (or {})."""
    input_batch = SimpleNamespace(
        num_reqs=num_reqs, req_ids=req_ids, req_id_to_index=req_id_to_index,
        generators=generators, vocab_size=vocab_size,
        prev_sampled_token_ids=prev_sampled_token_ids,
        prev_req_id_to_index=prev_req_id_to_index, num_tokens_no_spec=num_tokens_no_spec,
        token_ids_cpu=token_ids_cpu, is_token_ids=is_token_ids)
    runner = SimpleNamespace(
        use_async_scheduling=use_async, max_model_len=max_model_len,
        input_batch=input_batch, requests=requests,
        discard_request_mask=SimpleNamespace(np=discard_mask),
        _to_list=lambda sampled: sampled.tolist(),
        _get_prompt_logprobs_dict=lambda hidden, scheduled: (
            {} if prompt_logprobs is None else prompt_logprobs),
    )
    runner._get_nans_in_logits = (
        (lambda logits: {}) if GPUModelRunner is None
        else MethodType(GPUModelRunner._get_nans_in_logits, runner))
    return runner


def _synthetic_step(use_async: bool,
                    max_model_len: int = 8) -> tuple[SimpleNamespace, tuple[Any, ...]]:
    """A GPUModelRunner stand-in after a step of four requests, one of them
    discarded (a partial prefill), and the arguments of ``_bookkeeping_sync``;
    with ``max_model_len`` 7 the last request hits vLLM's assertion."""
    req_ids = ["a", "b", "partial", "d"]
    runner = stand_in_runner(
        use_async=use_async, max_model_len=max_model_len, num_reqs=4, req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)}, generators={},
        vocab_size=100, prev_sampled_token_ids=None, prev_req_id_to_index=None,
        num_tokens_no_spec=np.array([3, 5, 2, 7, 0], dtype=np.int32),
        token_ids_cpu=np.zeros((5, 8), dtype=np.int32),
        is_token_ids=np.zeros((5, 8), dtype=bool),
        requests={req_id: SimpleNamespace(output_token_ids=[7] * (i % 2))
                  for i, req_id in enumerate(req_ids)},
        discard_mask=np.array([0, 0, 1, 0, 0], dtype=bool))
    sampler_output = SimpleNamespace(
        sampled_token_ids=np.array([[11], [12], [13], [2**18 + 5]], dtype=np.int64),
        logprobs_tensors=None)
    return runner, (SimpleNamespace(num_scheduled_tokens={}), sampler_output, None,
                    [0.0] * 4, 4)


def _state(runner: SimpleNamespace, result: tuple[Any, ...]) -> list[Any]:
    batch = runner.input_batch
    return [result, {r: s.output_token_ids for r, s in runner.requests.items()},
            batch.num_tokens_no_spec.tolist(), batch.token_ids_cpu.tolist(),
            batch.is_token_ids.tolist(), batch.prev_req_id_to_index]


def _outcome(method: Any, runner: SimpleNamespace, arguments: tuple[Any, ...]) -> list[Any]:
    try:
        result: Any = method(runner, *arguments)
    except AssertionError as exc:  # vLLM's max_model_len check
        result = ("AssertionError", str(exc))
    return _state(runner, result)


def activation_check(method: Any, replacement: Any) -> str | None:
    """Run both on the synthetic steps, async and not, and one that hits
    vLLM's assertion; why they disagree, or None."""
    for use_async, max_model_len in ((True, 8), (False, 8), (False, 7)):
        stock = _synthetic_step(use_async, max_model_len)
        ours = copy.deepcopy(stock)
        expected = _outcome(method, *stock)
        got = _outcome(replacement, *ours)
        if repr(got) != repr(expected):
            return (f"fastbatch gave {got}, vLLM gave {expected} (async: {use_async}, "
                    f"max_model_len: {max_model_len})")
    return None


# --- the shadow check (FASTBATCH_VERIFY) -------------------------------------

PROMPT_LOGPROBS = "<prompt logprobs: vLLM's own call, made once, on the live runner>"
_RESULT_FIELDS = ("num_nans_in_logits", "num_nans", "logprobs_lists",
                  "valid_sampled_token_ids", "prompt_logprobs_dict", "req_ids_output_copy",
                  "req_id_to_index_output_copy", "invalid_req_indices")


class Generator:
    """A discarded request's generator in the stand-in: its offset (or what
    reading it raised), as ``get_offset``/``set_offset`` see it."""

    def __init__(self, offset: Any) -> None:
        self.offset = offset

    def get_offset(self) -> int:
        if isinstance(self.offset, BaseException):
            raise self.offset
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def _offset(generator: Any) -> Any:
    try:
        return generator.get_offset()
    except Exception as exc:  # vLLM's call fails the same way on the stand-in
        return exc


def _windows(num_tokens_no_spec: Any, rows: int, width: int, columns: int) -> Any:
    """(row, column) indices of each sampled row's window: ``width`` columns
    from its ``num_tokens_no_spec`` on (clipped to the array)."""
    starts = np.asarray(num_tokens_no_spec[:rows], dtype=np.int64)
    cols = np.clip(starts[:, None] + np.arange(width, dtype=np.int64), 0, columns - 1)
    return np.arange(rows)[:, None], cols


def _snapshot(runner: Any, scheduler_output: Any, sampler_output: Any, logits: Any,
              hidden_states: Any, num_scheduled_tokens: int) -> dict[str, Any] | None:
    """Copies of what the method writes (the windows of the token arrays the
    loop can touch), what it reads shared.  None (nothing to check) where the
    batch's arrays are not the 2-D numpy arrays vLLM's batch holds."""
    batch = runner.input_batch
    sampled = sampler_output.sampled_token_ids
    token_ids, is_token_ids = batch.token_ids_cpu, batch.is_token_ids
    if not all(isinstance(a, np.ndarray) and a.ndim == 2 for a in (token_ids, is_token_ids)):
        return None
    num_sampled = sampled.shape[0]
    num_tokens = np.array(batch.num_tokens_no_spec, copy=True)
    rows = min(num_sampled, len(num_tokens), len(token_ids), len(is_token_ids))
    columns = min(token_ids.shape[1], is_token_ids.shape[1])
    width = (sampled.shape[-1] if sampled.ndim > 1 else 1) + 1
    where = _windows(num_tokens, rows, width, columns)
    num_reqs = batch.num_reqs
    discard = np.array(runner.discard_request_mask.np[:num_reqs], copy=True)
    generators = {}
    for index in np.nonzero(discard)[0].tolist():
        generator = batch.generators.get(index)
        if generator is not None:
            generators[index] = _offset(generator)
    req_ids = list(batch.req_ids)
    lists = {}
    for req_id in req_ids[:num_sampled]:
        state = runner.requests.get(req_id) if isinstance(req_id, str) else None
        if state is not None and isinstance(state.output_token_ids, list):
            lists[req_id] = state.output_token_ids
    return {
        "use_async": runner.use_async_scheduling, "max_model_len": runner.max_model_len,
        "num_reqs": num_reqs, "req_ids": req_ids, "req_id_to_index": batch.req_id_to_index,
        "generators": generators, "vocab_size": batch.vocab_size,
        "prev_sampled_token_ids": batch.prev_sampled_token_ids,
        "prev_req_id_to_index": batch.prev_req_id_to_index,
        "num_tokens_no_spec": num_tokens, "rows": rows, "width": width,
        "shape": (rows, min(columns, int(num_tokens[:rows].max(initial=0)) + width)),
        "token_ids.dtype": token_ids.dtype, "token_ids": token_ids[where],
        "is_token_ids": is_token_ids[where], "discard_mask": discard,
        "lists": lists, "lengths": {req_id: len(ids) for req_id, ids in lists.items()},
        "sampled_token_ids": sampled, "logprobs_tensors": sampler_output.logprobs_tensors,
        "logits": logits if envs.VLLM_COMPUTE_NANS_IN_LOGITS else None,
        "num_scheduled_tokens": num_scheduled_tokens,
    }


def _result(result: Any) -> Any:
    """The returned tuple, comparable: the prompt logprobs left out, the NaN
    counts copied to the CPU."""
    if not isinstance(result, tuple) or len(result) != len(_RESULT_FIELDS):
        return result
    nans = result[1]
    return (result[0], None if nans is None else nans.detach().to("cpu", copy=True),
            *result[2:4], PROMPT_LOGPROBS, *result[5:])


def _which(tensor: Any, before: Any, sampled: Any) -> str:
    if tensor is before:
        return "the one before the call"
    return "the sampled ids" if tensor is sampled else f"another object ({type(tensor)})"


def _run(method: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """``method`` on a stand-in made of fresh copies of ``inputs``."""
    rows, columns = inputs["shape"]
    where = _windows(inputs["num_tokens_no_spec"], rows, inputs["width"], max(columns, 1))
    # Zeroed (untouched pages cost nothing) except the windows the loop may write.
    token_ids = np.zeros((rows, columns), dtype=inputs["token_ids.dtype"])
    is_token_ids = np.zeros((rows, columns), dtype=bool)
    if columns:
        token_ids[where] = inputs["token_ids"]
        is_token_ids[where] = inputs["is_token_ids"]
    generators = {index: Generator(offset) for index, offset in inputs["generators"].items()}
    requests = {req_id: SimpleNamespace(output_token_ids=[]) for req_id in inputs["lengths"]}
    runner = stand_in_runner(
        use_async=inputs["use_async"], max_model_len=inputs["max_model_len"],
        num_reqs=inputs["num_reqs"], req_ids=list(inputs["req_ids"]),
        req_id_to_index=inputs["req_id_to_index"], generators=generators,
        vocab_size=inputs["vocab_size"],
        prev_sampled_token_ids=inputs["prev_sampled_token_ids"],
        prev_req_id_to_index=inputs["prev_req_id_to_index"],
        num_tokens_no_spec=inputs["num_tokens_no_spec"].copy(), token_ids_cpu=token_ids,
        is_token_ids=is_token_ids, requests=requests,
        discard_mask=inputs["discard_mask"].copy(), prompt_logprobs=PROMPT_LOGPROBS)
    sampler_output = SimpleNamespace(sampled_token_ids=inputs["sampled_token_ids"],
                                     logprobs_tensors=inputs["logprobs_tensors"])
    result = method(runner, SimpleNamespace(num_scheduled_tokens=None), sampler_output,
                    inputs["logits"], (), inputs["num_scheduled_tokens"])
    batch = runner.input_batch
    return {
        "result": _result(result),
        "generators": {index: gen.offset for index, gen in generators.items()},
        "prev_sampled_token_ids": _which(batch.prev_sampled_token_ids,
                                         inputs["prev_sampled_token_ids"],
                                         inputs["sampled_token_ids"]),
        "prev_req_id_to_index": batch.prev_req_id_to_index,
        "num_tokens_no_spec": batch.num_tokens_no_spec,
        "token_ids_cpu windows": token_ids[where] if columns else inputs["token_ids"],
        "is_token_ids windows": is_token_ids[where] if columns else inputs["is_token_ids"],
        "output lists": {req_id: (True, inputs["lengths"][req_id] + len(state.output_token_ids),
                                  state.output_token_ids)
                         for req_id, state in requests.items()},
    }


def _live_outcome(inputs: dict[str, Any], result: Any, runner: Any, scheduler_output: Any,
             sampler_output: Any, *args: Any) -> dict[str, Any]:
    """The same, read from the live runner after fastbatch's call."""
    batch = runner.input_batch
    where = _windows(inputs["num_tokens_no_spec"], inputs["rows"], inputs["width"],
                     min(batch.token_ids_cpu.shape[1], batch.is_token_ids.shape[1]))
    outputs = {}
    for req_id, ids in inputs["lists"].items():
        state = runner.requests.get(req_id)
        now = None if state is None else state.output_token_ids
        before = inputs["lengths"][req_id]
        outputs[req_id] = ((now is ids, len(now), now[before:]) if isinstance(now, list)
                           else (False, None, now))
    return {
        "result": _result(result),
        "generators": {index: _offset(batch.generators[index])
                       for index in inputs["generators"]},
        "prev_sampled_token_ids": _which(batch.prev_sampled_token_ids,
                                         inputs["prev_sampled_token_ids"],
                                         sampler_output.sampled_token_ids),
        "prev_req_id_to_index": batch.prev_req_id_to_index,
        "num_tokens_no_spec": np.array(batch.num_tokens_no_spec, copy=True),
        "token_ids_cpu windows": batch.token_ids_cpu[where],
        "is_token_ids windows": batch.is_token_ids[where],
        "output lists": outputs,
    }


def _differs(got: Any, expected: Any) -> str | None:
    """Why two outcomes' values differ (arrays and tensors by value, dtype and
    shape, NaNs equal; containers item by item), or None."""
    import torch

    if isinstance(expected, (np.ndarray, torch.Tensor)):
        if type(got) is not type(expected):
            return f"fastbatch gave a {type(got).__name__}, vLLM a {type(expected).__name__}"
        if (got.dtype, tuple(got.shape)) != (expected.dtype, tuple(expected.shape)):
            return (f"fastbatch gave {got.dtype} {tuple(got.shape)}, vLLM "
                    f"{expected.dtype} {tuple(expected.shape)}")
        if isinstance(expected, torch.Tensor):
            same = bool(((got == expected) | (got.isnan() & expected.isnan())).all()
                        if expected.is_floating_point() else torch.equal(got, expected))
        else:
            same = np.array_equal(got, expected, equal_nan=expected.dtype.kind in "fc")
        if not same:
            return f"fastbatch gave {got.tolist()}, vLLM {expected.tolist()}"
        return None
    if isinstance(expected, (tuple, list, dict)):
        if type(got) is not type(expected) or len(got) != len(expected):
            return f"fastbatch gave {got!r}, vLLM {expected!r}"
        try:  # in C where no array inside makes == ambiguous
            if got == expected:
                return None
        except (ValueError, RuntimeError):
            pass
        if isinstance(expected, dict):
            if got.keys() != expected.keys():
                return f"fastbatch gave keys {sorted(map(repr, got))}, vLLM " \
                       f"{sorted(map(repr, expected))}"
            pairs = ((key, got[key], expected[key]) for key in expected)
        else:
            pairs = ((index, a, b) for index, (a, b) in enumerate(zip(got, expected, strict=True)))
        for key, a, b in pairs:
            problem = _differs(a, b)
            if problem is not None:
                return f"[{key!r}]: {problem}"
        return None
    if got is expected or got == expected:
        return None
    if isinstance(expected, float) and isinstance(got, float) and got != got and \
            expected != expected:
        return None  # NaN and NaN
    return f"fastbatch gave {got!r}, vLLM {expected!r}"


def _compare(ours: dict[str, Any], stock: dict[str, Any]) -> str | None:
    for name, expected in stock.items():
        got = ours[name]
        if (name == "result" and isinstance(got, tuple) and isinstance(expected, tuple)
                and len(got) == len(expected) == len(_RESULT_FIELDS)):
            got, expected = dict(zip(_RESULT_FIELDS, got, strict=True)), dict(
                zip(_RESULT_FIELDS, expected, strict=True))
        problem = _differs(got, expected)
        if problem is not None:
            return f"{name}{problem}" if problem.startswith("[") else f"{name}: {problem}"
    return None


def _restore(inputs: dict[str, Any], stock: dict[str, Any], result: Any, runner: Any,
             scheduler_output: Any, sampler_output: Any, logits: Any, hidden_states: Any,
             num_scheduled_tokens: int) -> Any:
    """vLLM's values put back into the runner's own arrays, generators and
    output lists; vLLM's tuple returned, with the live prompt logprobs."""
    batch = runner.input_batch
    for index, offset in stock["generators"].items():
        batch.generators[index].set_offset(offset)
    batch.prev_sampled_token_ids = {
        "the one before the call": inputs["prev_sampled_token_ids"],
        "the sampled ids": sampler_output.sampled_token_ids,
    }[stock["prev_sampled_token_ids"]]
    batch.prev_req_id_to_index = stock["prev_req_id_to_index"]
    batch.num_tokens_no_spec[...] = stock["num_tokens_no_spec"]
    where = _windows(inputs["num_tokens_no_spec"], inputs["rows"], inputs["width"],
                     min(batch.token_ids_cpu.shape[1], batch.is_token_ids.shape[1]))
    batch.token_ids_cpu[where] = stock["token_ids_cpu windows"]
    batch.is_token_ids[where] = stock["is_token_ids windows"]
    for req_id, ids in inputs["lists"].items():
        runner.requests[req_id].output_token_ids = ids  # the list the batch shares
        ids[inputs["lengths"][req_id]:] = stock["output lists"][req_id][2]
    returned = list(stock["result"])
    if returned[1] is not None:  # vLLM's NaN counts, on the device of the logits
        returned[1] = returned[1].to(logits.device)
    if isinstance(result, tuple) and len(result) == len(_RESULT_FIELDS):
        returned[4] = result[4]
    else:  # fastbatch raised before computing the prompt logprobs: vLLM's call, once
        returned[4] = runner._get_prompt_logprobs_dict(
            hidden_states[:num_scheduled_tokens], scheduler_output.num_scheduled_tokens)
    return tuple(returned)


def _for_reproducer(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs without the live output lists (their lengths stay), the
    tensors on the CPU."""
    import torch

    def cpu(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().cpu()
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple
            return type(value)(*map(cpu, value))
        return value

    return {name: cpu(value) for name, value in inputs.items() if name != "lists"}


SHADOW = Shadow(snapshot=_snapshot, run=_run, outcome=_live_outcome, restore=_restore,
                compare=_compare, for_reproducer=_for_reproducer)

PATCH = Patch("vllm.v1.worker.gpu_model_runner:GPUModelRunner._bookkeeping_sync",
              _bookkeeping_sync, fingerprints=VERIFIED_FINGERPRINTS,
              activation_check=activation_check, shadow=SHADOW)
