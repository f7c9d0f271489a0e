"""vLLM's real engine with a stand-in model: an ``Executor`` for
``EngineArgs(distributed_executor_backend=...)``.

vLLM's ``LLMEngine`` / EngineCore, its scheduler, KV-cache manager and output
processor run unchanged; only the worker is replaced, by ``StandinWorker``:

- **Tokens.**  A request's next token is a deterministic function of that
  request's own token history (a hash of its prompt, the number of tokens it
  has generated, and its last token), never of the batch or the step: every
  correct schedule (batch size, KV-cache size, token budget, chunked
  prefill, preemption, async scheduling on or off, spec decoding) gives the
  same tokens.  Now and then the token is the EOS (``eos_period``).
- **Logprobs.**  Deterministic floats, ranks and top-k ids, functions of the
  same history; rows as vLLM's sampler lays them out (the sampled token
  first, then the top-k; one row per request of ``req_ids`` without spec
  decoding, one per generated token with it, ``cu_num_generated_tokens``
  giving the boundaries).
- **Spec decoding.**  A stand-in drafter proposes ``k`` tokens after each
  sampled step, each one right or wrong by a deterministic rule; the step
  that verifies them accepts the longest right prefix and adds one token, as
  greedy rejection sampling does: the final tokens are those without spec
  decoding.  Under async scheduling the scheduler sends placeholders and the
  worker uses its own drafts; under sync scheduling EngineCore takes them
  (``take_draft_token_ids``) and sends them back, trimmed.
- **A settable forward time** per step (``forward_s``): a simulated GPU
  timeline.  A step submitted at ``t`` runs from ``max(t, end of the step
  before)`` for ``forward_s``; its output is ready at the end (a busy-wait,
  or a sleep, in ``Future.result``), so that under async scheduling the host's
  next step overlaps it as with a GPU.  ``StandinExecutor.gpu`` counts the
  busy time and the time the "GPU" waited for the host.
- **The KV-cache layout** is declared by ``kv_groups`` (one full-attention
  group by default; sliding-window groups and several groups can be
  declared).

The worker's state is in numpy arrays, one slot per request, and a step is a
few array operations over the batch: its cost per request is small next to
vLLM's host path (``StandinWorker.cpu_s`` counts it, for benchmarks to
leave out).

Works on vLLM 0.33.0 and 0.34.0 (0.34.0 removed
``ModelRunnerOutput.req_id_to_index`` and sends resumed requests as new
ones; both are feature-detected).  The options travel with the executor
class: ``make_executor(forward_s=0.01, spec_tokens=3)``.

Test tooling only: ``prepare_cpu_platform()`` lifts vLLM 0.34.0's CPU
platform's refusal to configure without triton-cpu (x86) and keeps async
scheduling on where asked, in this process; nothing of the kind is in
fastbatch.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
from vllm.v1.outputs import (
    EMPTY_MODEL_RUNNER_OUTPUT,
    DraftTokenIds,
    LogprobsLists,
    ModelRunnerOutput,
)

# 0.34.0 removed ModelRunnerOutput.req_id_to_index.
HAS_REQ_ID_TO_INDEX = "req_id_to_index" in {
    field.name for field in dataclasses.fields(ModelRunnerOutput)}

_U = np.uint64
_M1, _M2 = _U(0xBF58476D1CE4E5B9), _U(0x94D049BB133111EB)
_GOLDEN = _U(0x9E3779B97F4A7C15)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, on a uint64 array (wrapping arithmetic)."""
    x = (x ^ (x >> _U(30))) * _M1
    x = (x ^ (x >> _U(27))) * _M2
    return x ^ (x >> _U(31))


@dataclasses.dataclass(frozen=True)
class Options:
    """What the stand-in model does; the executor class carries one."""

    forward_s: float = 0.0
    """Simulated forward time per step with tokens scheduled (0: none)."""
    busy_wait: bool = True
    """Wait for the simulated GPU by spinning (as a host thread polling a GPU
    does) rather than sleeping."""
    spec_tokens: int = 0
    """Drafts proposed per request (match the engine's
    ``num_speculative_tokens``; 0: read it from the engine's config)."""
    draft_right: float = 0.7
    """Share of draft tokens that are right (each one decided by its hash)."""
    eos_period: int = 64
    """About one token in this many is the EOS (0: never)."""
    first_token: int = 4
    """Sampled tokens are drawn from ``[first_token, vocab)`` (above the tiny
    tokenizer's special tokens), or are the EOS."""
    kv_groups: tuple[tuple[str, int, int], ...] = (("full", 0, 1),)
    """The KV-cache layout: one ``(kind, sliding_window, num_layers)`` per
    group, kind ``"full"`` or ``"sliding"``."""
    kv_blocks: int = 4096
    """Blocks per layer when the engine sets no ``kv_cache_memory_bytes``."""
    seed: int = 0


def options_from_env() -> Options:
    """``Options`` from ``STANDIN_OPTIONS`` (``name=value,...``), for the
    EngineCore process of a multiprocess engine, which resolves the class
    ``StandinExecutor`` by name."""
    raw = os.environ.get("STANDIN_OPTIONS", "")
    values: dict[str, Any] = {}
    types = {field.name: field.type for field in dataclasses.fields(Options)}
    for item in filter(None, raw.split(",")):
        name, _, value = item.partition("=")
        kind = types[name]
        values[name] = (value.lower() in ("1", "true") if kind == "bool" else
                        float(value) if kind == "float" else int(value))
    return Options(**values)


# The model --------------------------------------------------------------------

class StandinWorker:
    """What EngineCore asks of a worker, without a model."""

    def __init__(self, vllm_config: Any, options: Options) -> None:
        self.vllm_config = vllm_config
        self.options = options
        model_config = vllm_config.model_config
        self.vocab = int(model_config.get_vocab_size())
        eos = getattr(model_config.hf_config, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0]
        self.eos = int(eos) if eos is not None else -1
        spec = vllm_config.speculative_config
        self.k = options.spec_tokens or (spec.num_speculative_tokens if spec else 0)
        self.max_len = int(model_config.max_model_len) + self.k + 2
        self.powers = _mix(np.arange(1, self.max_len + 1, dtype=np.uint64) * _GOLDEN)
        self.seed = _mix(np.array([options.seed + 1], dtype=np.uint64) * _GOLDEN)[0]
        self.slot_of: dict[str, int] = {}
        self.free: list[int] = []
        self._grow(256)
        self.pending: ModelRunnerOutput | None = None
        self.drafts_out: DraftTokenIds | None = None
        self.cpu_s = 0.0  # thread CPU time spent in execute_model
        self.steps = self.request_steps = 0
        self.samples = 0
        self.accepted = self.proposed = 0
        self.kv_cache_config = None

    # state ------------------------------------------------------------------

    def _grow(self, size: int) -> None:
        old = getattr(self, "prompt_hash", None)
        fields = {"prompt_hash": np.uint64, "n_out": np.int64, "last": np.int64,
                  "hist_len": np.int64, "computed": np.int64, "num_logprobs": np.int64}
        start = 0 if old is None else len(old)
        for name, dtype in fields.items():
            grown = np.zeros(size, dtype=dtype)
            if old is not None:
                grown[:start] = getattr(self, name)
            setattr(self, name, grown)
        drafts = np.full((size, max(self.k, 1)), -1, dtype=np.int64)
        if old is not None:
            drafts[:start] = self.drafts
        self.drafts = drafts
        self.free.extend(range(size - 1, start - 1, -1))

    def _slot(self, req_id: str) -> int:
        slot = self.slot_of.get(req_id)
        if slot is None:
            if not self.free:
                self._grow(2 * len(self.prompt_hash))
            slot = self.slot_of[req_id] = self.free.pop()
        return slot

    def _set_history(self, slot: int, prompt: Any, tokens: Any, computed: int) -> None:
        """The request's history is ``tokens`` (its prompt, then its outputs)."""
        ids = np.asarray(prompt, dtype=np.uint64)
        self.prompt_hash[slot] = _mix(np.array(
            [(ids * self.powers[:len(ids)]).sum() ^ self.seed ^ _U(len(ids))],
            dtype=np.uint64))[0]
        self.n_out[slot] = len(tokens) - len(ids)
        self.last[slot] = tokens[-1]
        self.hist_len[slot] = len(tokens)
        self.computed[slot] = computed
        self.drafts[slot] = -1

    def _add(self, new: Any) -> None:
        slot = self._slot(new.req_id)
        tokens = getattr(new, "prefill_token_ids", None) or new.prompt_token_ids
        self._set_history(slot, new.prompt_token_ids, tokens, new.num_computed_tokens)
        params = new.sampling_params
        logprobs = None if params is None else params.logprobs
        self.num_logprobs[slot] = (-1 if logprobs is None else
                                   self.vocab if logprobs == -1 else logprobs)

    def _update_states(self, so: Any) -> None:
        for req_id in so.finished_req_ids:
            slot = self.slot_of.pop(req_id, None)
            if slot is not None:
                self.free.append(slot)
        for new in so.scheduled_new_reqs:
            self._add(new)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None)  # 0.33.0
        if resumed:
            for i, req_id in enumerate(cached.req_ids):
                if req_id in resumed:
                    slot = self.slot_of[req_id]
                    tokens = cached.all_token_ids[req_id]
                    prompt_len = int(self.hist_len[slot] - self.n_out[slot])
                    self._set_history(slot, tokens[:prompt_len], tokens,
                                      cached.num_computed_tokens[i])

    # the token function ------------------------------------------------------

    def _state(self, slots: np.ndarray, n_out: np.ndarray, last: np.ndarray) -> np.ndarray:
        """The hash of a history: prompt, number of outputs, last token."""
        return _mix(self.prompt_hash[slots]
                    ^ _mix(n_out.astype(np.uint64) * _GOLDEN + last.astype(np.uint64)))

    def _token(self, state: np.ndarray) -> np.ndarray:
        span = self.vocab - self.options.first_token
        tokens = (self.options.first_token + (state >> _U(8)) % _U(span)).astype(np.int64)
        if self.options.eos_period and self.eos >= 0:
            tokens[(state % _U(self.options.eos_period)) == 0] = self.eos
        return tokens

    def _logprobs(self, states: np.ndarray, tokens: np.ndarray, width: int) -> LogprobsLists:
        """Rows ``[sampled, top-1, ..., top-width]``: deterministic in the
        history alone (a column does not depend on ``width``)."""
        n = len(tokens)
        rank = (1 + (states >> _U(20)) % _U(3)).astype(np.int64)
        jitter = ((states >> _U(24)) % _U(1024)).astype(np.float32) / np.float32(4096)
        columns = np.arange(width, dtype=np.int64)
        step = (1 + (states >> _U(36)) % _U(5)).astype(np.int64)
        span = self.vocab - self.options.first_token
        # top-k candidates other than the sampled token, distinct from it
        cand = (tokens[:, None] - self.options.first_token + 1
                + columns[None, :] * step[:, None]) % span + self.options.first_token
        cand[cand == tokens[:, None]] = self.options.first_token  # an EOS sample
        before = columns[None, :] < (rank[:, None] - 1)
        at = columns[None, :] == (rank[:, None] - 1)
        shifted = np.concatenate([cand[:, :1], cand[:, :-1]], axis=1) if width else cand
        top = np.where(before, cand, np.where(at, tokens[:, None], shifted))
        top_lp = -(np.float32(0.05) + columns[None, :].astype(np.float32) * np.float32(0.5)
                   + jitter[:, None])
        ids = np.empty((n, width + 1), dtype=np.int32)
        ids[:, 0] = tokens
        ids[:, 1:] = top
        lps = np.empty((n, width + 1), dtype=np.float32)
        lps[:, 0] = -(np.float32(0.05) + (rank - 1).astype(np.float32) * np.float32(0.5)
                      + jitter)
        lps[:, 1:] = top_lp
        return LogprobsLists(ids, lps, rank, None)

    # the step ----------------------------------------------------------------

    def execute_model(self, so: Any) -> ModelRunnerOutput | None:
        start = time.thread_time()
        try:
            self._update_states(so)
            if not so.total_num_scheduled_tokens:
                return EMPTY_MODEL_RUNNER_OUTPUT
            self.pending = self._step(so)
            return None
        finally:
            self.cpu_s += time.thread_time() - start

    def _step(self, so: Any) -> ModelRunnerOutput:
        self.steps += 1
        scheduled = so.num_scheduled_tokens
        req_ids = list(scheduled)
        num = len(req_ids)
        self.request_steps += num
        slot_of = self.slot_of
        slots = np.fromiter([slot_of[r] for r in req_ids], dtype=np.int64, count=num)
        n_sched = np.fromiter(scheduled.values(), dtype=np.int64, count=num)
        spec = so.scheduled_spec_decode_tokens
        k = self.k
        n_spec = np.zeros(num, dtype=np.int64)
        drafts = None
        if spec:
            drafts = np.full((num, max(k, 1)), -1, dtype=np.int64)
            index = {r: i for i, r in enumerate(req_ids)}
            for req_id, ids in spec.items():
                i = index[req_id]
                n = len(ids)
                n_spec[i] = n
                if n and ids[0] == -1:  # async: placeholders, the worker's own drafts
                    drafts[i, :n] = self.drafts[slots[i], :n]
                else:
                    drafts[i, :n] = ids
        computed = self.computed[slots]
        hist_len = self.hist_len[slots]
        samples = computed + n_sched - n_spec >= hist_len
        rows = np.flatnonzero(samples)
        s_slots = slots[rows]
        n_out = self.n_out[s_slots].copy()
        last = self.last[s_slots].copy()
        m = len(rows)
        width = (int(n_spec.max()) if spec else 0) + 1
        out = np.full((m, width), -1, dtype=np.int64)
        states = np.zeros((m, width), dtype=np.uint64)
        count = np.zeros(m, dtype=np.int64)
        alive = np.ones(m, dtype=bool)
        r_spec = n_spec[rows]
        r_drafts = drafts[rows] if drafts is not None else None
        for j in range(width):
            state = self._state(s_slots, n_out, last)
            token = self._token(state)
            out[:, j] = np.where(alive, token, -1)
            states[:, j] = state
            count += alive
            if j < width - 1:
                alive &= (j < r_spec) & (r_drafts[:, j] == token)
            last = np.where(alive, token, last)
            n_out += alive
        accepted = count - 1
        # what the worker now holds: outputs appended, tokens computed
        last_token = out[np.arange(m), count - 1]
        self.n_out[s_slots] += count
        self.last[s_slots] = last_token
        self.hist_len[s_slots] += count
        rejected = np.zeros(num, dtype=np.int64)
        rejected[rows] = r_spec - accepted
        self.computed[slots] = computed + n_sched - rejected
        self.samples += int(count.sum())
        self.accepted += int(accepted.sum())
        self.proposed += int(r_spec.sum())

        if width == 1:
            sampled: list[list[int]] = [[] for _ in range(num)]
            tokens_now = out[:, 0].tolist()
            for row, token in zip(rows.tolist(), tokens_now, strict=True):
                sampled[row] = [token]
        else:
            sampled = [[] for _ in range(num)]
            out_rows = out.tolist()
            for row, values, c in zip(rows.tolist(), out_rows, count.tolist(), strict=True):
                sampled[row] = values[:c]

        logprobs = None
        wanted = self.num_logprobs[slots]
        if wanted.max() >= 0:
            top = int(wanted.max())
            if spec:
                mask = np.arange(width)[None, :] < count[:, None]
                lists = self._logprobs(states[mask], out[mask], top)
                per_req = np.zeros(num, dtype=np.int64)
                per_req[rows] = count
                cu = np.concatenate([[0], np.cumsum(per_req)]).tolist()
                logprobs = LogprobsLists(lists.logprob_token_ids, lists.logprobs,
                                         lists.sampled_token_ranks, cu)
            else:
                all_states = np.zeros(num, dtype=np.uint64)
                all_tokens = np.full(num, self.options.first_token, dtype=np.int64)
                all_states[rows] = states[:, 0]
                all_tokens[rows] = out[:, 0]
                logprobs = self._logprobs(all_states, all_tokens, top)

        if k and m:
            self._draft(rows, s_slots, req_ids, num)
        kwargs: dict[str, Any] = {}
        if HAS_REQ_ID_TO_INDEX:
            kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 logprobs=logprobs, **kwargs)

    def _draft(self, rows: np.ndarray, s_slots: np.ndarray, req_ids: list[str],
               num: int) -> None:
        """The drafter: k tokens per sampled request, each right (the model's
        own next token) when its hash says so."""
        k = self.k
        n_out = self.n_out[s_slots].copy()
        last = self.last[s_slots].copy()
        right_below = _U(int(self.options.draft_right * 1024))
        drafts = np.empty((len(rows), k), dtype=np.int64)
        for j in range(k):
            state = self._state(s_slots, n_out, last)
            token = self._token(state)
            wrong = ((state >> _U(44)) % _U(1024)) >= right_below
            token = np.where(wrong, (token + 1 - self.options.first_token)
                             % (self.vocab - self.options.first_token)
                             + self.options.first_token, token)
            drafts[:, j] = token
            last = token
            n_out = n_out + 1
        self.drafts[s_slots] = drafts
        lists: list[list[int]] = [[] for _ in range(num)]
        for row, values in zip(rows.tolist(), drafts.tolist(), strict=True):
            lists[row] = values
        self.drafts_out = DraftTokenIds(req_ids, lists)

    def sample_tokens(self, grammar_output: Any) -> ModelRunnerOutput:
        output, self.pending = self.pending, None
        assert output is not None, "sample_tokens without a step"
        return output

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        drafts, self.drafts_out = self.drafts_out, None
        return drafts

    # set-up calls --------------------------------------------------------------

    def _specs(self) -> list[tuple[Any, int]]:
        block_size = self.vllm_config.cache_config.block_size or 16
        specs = []
        for kind, window, layers in self.options.kv_groups:
            common = dict(block_size=block_size, num_kv_heads=1, head_size=64,
                          dtype=torch.float16)
            spec = (FullAttentionSpec(**common) if kind == "full" else
                    SlidingWindowSpec(sliding_window=window, **common))
            specs.append((spec, layers))
        return specs

    def get_kv_cache_spec(self) -> dict[str, Any]:
        layers = {}
        for group, (spec, count) in enumerate(self._specs()):
            for layer in range(count):
                layers[f"model.layers.{group}.{layer}.self_attn.attn"] = spec
        return layers

    def determine_available_memory(self) -> int:
        wanted = self.vllm_config.cache_config.kv_cache_memory_bytes
        if wanted:
            return int(wanted)
        return sum(spec.page_size_bytes * count for spec, count in self._specs()) \
            * self.options.kv_blocks

    def get_supported_kv_cache_layouts(self) -> list[str]:
        from vllm.v1.attention.backends.utils import _DEFAULT_LAYOUT_PREFERENCE

        return [layout.name for layout in _DEFAULT_LAYOUT_PREFERENCE]

    def set_kv_cache_layout(self, layout: str, cp_kv_cache_interleave_size: int) -> None:
        from vllm.v1.worker.worker_base import WorkerBase

        WorkerBase.set_kv_cache_layout(self, layout, cp_kv_cache_interleave_size)

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        if isinstance(kv_cache_config, list):  # one per rank, as the executor sends them
            kv_cache_config = kv_cache_config[0]
        self.kv_cache_config = kv_cache_config
        self.vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks

    def compile_or_warm_up_model(self) -> Any:
        from vllm.v1.worker.worker_base import CompilationTimes

        return CompilationTimes(0.0, 0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    def extensible_kv_cache_unsupported_reason(self) -> str:
        return "the stand-in model has no device memory"

    def disable_extensible_kv_cache(self) -> None:
        self.vllm_config.cache_config.enable_extensible_kv_cache = False

    def update_max_model_len(self, max_model_len: int) -> None:
        self.vllm_config.model_config.max_model_len = max_model_len

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


# The executor ------------------------------------------------------------------

class _Ready(Future):
    """A step's output, ready once the simulated GPU has run the step."""

    def __init__(self, value: Any, ready_at: float, gpu: GpuTimeline,
                 busy_wait: bool) -> None:
        super().__init__()
        self._value, self._ready_at, self._gpu, self._busy_wait = (
            value, ready_at, gpu, busy_wait)

    def done(self) -> bool:
        return time.perf_counter() >= self._ready_at

    def result(self, timeout: float | None = None) -> Any:
        ready_at = self._ready_at
        if time.perf_counter() < ready_at:
            start = time.thread_time()
            if self._busy_wait:
                while time.perf_counter() < ready_at:
                    pass
            else:
                time.sleep(max(0.0, ready_at - time.perf_counter()))
            self._gpu.spin_cpu_s += time.thread_time() - start
        return self._value


@dataclasses.dataclass
class GpuTimeline:
    """The simulated GPU: busy time, the time it waited for the host between
    steps, the span from the first step's start to the last one's end."""

    steps: int = 0
    spin_cpu_s: float = 0.0
    """The CPU time of the threads that waited for it (spinning)."""
    busy_s: float = 0.0
    waited_s: float = 0.0
    first_start: float | None = None
    free_at: float = 0.0

    def run(self, forward_s: float) -> float:
        now = time.perf_counter()
        if self.first_start is None:
            self.first_start = now
        elif now > self.free_at:
            self.waited_s += now - self.free_at
        start = max(now, self.free_at)
        self.free_at = start + forward_s
        self.busy_s += forward_s
        self.steps += 1
        return self.free_at

    @property
    def span_s(self) -> float:
        return 0.0 if self.first_start is None else self.free_at - self.first_start


class StandinExecutor(Executor):
    """``distributed_executor_backend=make_executor(...)``: one stand-in
    worker in the EngineCore process."""

    options: Options | None = None
    instances: ClassVar[list[StandinExecutor]] = []  # the ones built in this process

    def _init_executor(self) -> None:
        options = type(self).options or options_from_env()
        self.options = options
        self.worker = StandinWorker(self.vllm_config, options)
        self.gpu = GpuTimeline()
        self._ready_at = 0.0
        StandinExecutor.instances.append(self)

    @classmethod
    def supports_async_scheduling(cls) -> bool:
        return True

    def collective_rpc(self, method: str | Callable, timeout: float | None = None,
                       args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False, single_value: bool = False) -> Any:
        call = method if callable(method) else getattr(type(self.worker), method)
        try:
            result = call(self.worker, *args, **(kwargs or {}))
        except Exception as exc:
            if not non_block:
                raise
            future: Future = Future()
            future.set_exception(exc)
            return future
        value = result if single_value else [result]
        if not non_block:
            return value
        future = Future()
        future.set_result(value)
        return future

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        output = self.collective_rpc("execute_model", args=(scheduler_output,),
                                     non_block=non_block, single_value=True)
        if scheduler_output.total_num_scheduled_tokens and self.options.forward_s:
            self._ready_at = self.gpu.run(self.options.forward_s)
        return output

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        output = self.worker.sample_tokens(grammar_output)
        future = _Ready(output, self._ready_at, self.gpu, self.options.busy_wait)
        return future if non_block else future.result()

    def take_draft_token_ids(self) -> Any:
        return self.worker.take_draft_token_ids()

    def determine_available_memory(self) -> list[int]:
        return [self.worker.determine_available_memory()]

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        return


def make_executor(**options: Any) -> type[StandinExecutor]:
    """A ``StandinExecutor`` class carrying these ``Options``."""
    return type("StandinExecutor", (StandinExecutor,), {"options": Options(**options)})


# Test tooling: the CPU platform and a model folder without weights ---------------

def prepare_cpu_platform() -> None:
    """In this process: vLLM 0.34.0's CPU platform configures without
    triton-cpu (``cpu_platform.lift_triton_refusal``), and
    ``async_scheduling`` keeps the value asked for (the CPU platform turns it
    off).  Idempotent.  Test tooling only."""
    from cpu_platform import lift_triton_refusal
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform.__dict__["check_and_update_config"].__func__, "standin", False):
        return
    lift_triton_refusal()
    hook = CpuPlatform.__dict__["check_and_update_config"].__func__

    def check_and_update_config(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True

    check_and_update_config.standin = True
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def make_model_dir(path: str | Path, vocab: int = 512) -> Path:
    """A model folder with no weights: a Llama ``config.json`` and the tiny
    byte-level tokenizer of ``tools/tiny_model.py`` (``vocab`` 512) or its
    English BPE (larger).  The stand-in never loads weights."""
    import importlib.util

    from transformers import LlamaConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tool = Path(__file__).resolve().parent.parent / "tools" / "tiny_model.py"
    spec = importlib.util.spec_from_file_location("_standin_tiny_model", tool)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer = module._make_tokenizer(str(path), vocab)
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                head_dim=64, max_position_embeddings=4096,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
                torch_dtype="float16").save_pretrained(str(path))
    return path


def engine_args(model: str | Path, executor: type[Executor], **overrides: Any) -> Any:
    """``EngineArgs`` for a stand-in engine: no weights loaded, eager."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs: dict[str, Any] = dict(
        model=str(model), distributed_executor_backend=executor, load_format="dummy",
        enforce_eager=True, dtype="float16", max_model_len=512, block_size=16, seed=0,
        enable_prefix_caching=True, enable_chunked_prefill=True)
    kwargs.update(overrides)
    return EngineArgs(**kwargs)
