"""Lockstep harness: two real vLLM schedulers, stock and fastbatch, step by step.

Both are real ``Scheduler`` or ``AsyncScheduler`` instances of the installed
vLLM (0.33.0 in the ``vllm`` tox environment), built on the CPU from a small
``VllmConfig`` and a one-group full-attention ``KVCacheConfig``; no model runs.
A fake model runner, driven by a seeded RNG, answers every step with the
same ``ModelRunnerOutput`` for both (one sampled token per request whose
scheduled chunk reaches the end of its known tokens, EOS or a stop token
now and then, never a stop token before ``min_tokens``, as vLLM's sampler
guarantees).  New requests arrive and requests are aborted at random steps.
In the workloads with sample logprobs (``LOGPROB_WORKLOADS``) some requests
ask for them and the runner answers, when any request of the step does, with
a ``LogprobsLists`` (one row per request, or one per sampled token found
through ``cu_num_generated_tokens``) or with none; each side gets its own
copy of the arrays.  In the workloads with grammars (``GRAMMAR_WORKLOADS``)
some requests have structured output: a stand-in grammar, advanced through
vLLM's own ``StructuredOutputManager``, that refuses a token or none (vLLM
then stops the request with an error).

After every step the harness compares, as plain data:

- the ``SchedulerOutput`` (every field) and the ``EngineCoreOutputs`` (numpy
  arrays by dtype, shape, strides and bytes; named tuples with their type);
- the KV cache: every request's block table, ``num_cached_block``, partial
  hits, the free-block queue in order, every block's ref count and hash, and
  the hash -> block map of the block pool;
- every request: token lists, block hashes, ``num_computed_tokens``,
  placeholders, status, stop reason, and the running/waiting queues.

The first difference raises ``Divergence`` naming the step and the path of
the differing field.  ``stock`` and ``fast`` are built by the caller's
``make``: the fast side gets fastbatch's replacement bound on its own
objects, so both live in one process without touching each other.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import random
import tempfile
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from fastbatch.patches._compare import first_difference
from fastbatch.patches._stand_ins import StandInGrammar as _StandInGrammar

EOS_TOKEN_ID = 2
VOCAB_SIZE = 64  # small, so that stop tokens turn up by chance too
_ARCHITECTURE = "FastbatchSchedulerOnlyLM"
_MODEL_DIR: str | None = None


class Divergence(AssertionError):
    """Stock and fastbatch disagree; the message names the step and the field."""


@dataclasses.dataclass(frozen=True)
class Workload:
    """One mix of scheduler settings and traffic (all sizes in tokens)."""

    name: str
    async_scheduling: bool = False
    prefix_caching: bool = True
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 256
    long_prefill_token_threshold: int = 0
    arrival_probability: float = 0.5  # chance of new requests in a step
    max_arrivals: int = 3
    abort_probability: float = 0.03
    max_prompt: int = 100
    max_output: int = 80
    eos_probability: float = 0.02
    # The scheduler's Model Runner V2 branches (how outputs are packaged, resumed
    # requests sent as new, PP decode stagger): set on the scheduler after it is
    # built, since the CPU platform (no Triton) picks V1.
    model_runner_v2: bool = False
    # Sample logprobs: the chance that a request asks for them (then 0, 1, 5
    # or -1), and how the runner answers a step with such requests, one of
    # these drawn each step: "rows" (a row per request), "cu" (a row per
    # sampled token, found through cu_num_generated_tokens), "none" (None).
    logprobs_probability: float = 0.0
    runner_logprobs: tuple[str, ...] = ("rows",)
    # Spec decoding: the scheduler's num_spec_tokens and num_lookahead_tokens
    # (set after it is built: no draft model on the CPU), and how the fake
    # drafter and runner answer.  Sync scheduling: after each step every
    # decoding request gets 0 to num_spec_tokens drafts (the engine's
    # ``update_draft_token_ids``).  Async scheduling: as vLLM's engine does,
    # the scheduler never sees the drafts; it schedules its -1 placeholders
    # (num_spec_tokens of them), which the worker fills.  Of the drafts
    # scheduled the runner accepts all, some or none (one of
    # ``draft_acceptance`` drawn per request) and samples one token more.
    num_spec_tokens: int = 0
    num_lookahead_tokens: int = 0
    draft_acceptance: tuple[str, ...] = ("all", "some", "none")
    # The scheduler's statistics (``log_stats``, vllm serve's default): each
    # step's SchedulerStats (spec decoding's counts among them) is compared
    # with the rest of the outputs; events' timestamps are not.
    log_stats: bool = False
    # Structured output: the chance that a request has a grammar (half of them
    # refuse one token, which the runner samples now and then).
    grammar_probability: float = 0.0


WORKLOADS = (
    Workload("decode", max_num_seqs=24, arrival_probability=0.3, abort_probability=0.0,
             eos_probability=0.0),
    Workload("decode-async", async_scheduling=True, max_num_seqs=24,
             arrival_probability=0.3, abort_probability=0.0, eos_probability=0.0),
    Workload("mixed", abort_probability=0.05),
    Workload("mixed-async", async_scheduling=True, abort_probability=0.05),
    Workload("no-prefix-cache", prefix_caching=False),
    Workload("no-prefix-cache-async", async_scheduling=True, prefix_caching=False),
    Workload("preemption", num_blocks=28, max_num_seqs=12, arrival_probability=0.7,
             max_prompt=40, max_output=160),
    Workload("preemption-async", async_scheduling=True, num_blocks=28, max_num_seqs=12,
             arrival_probability=0.7, max_prompt=40, max_output=160),
    Workload("chunked-prefill", max_num_batched_tokens=64, long_prefill_token_threshold=24,
             max_prompt=200, arrival_probability=0.8),
    Workload("chunked-prefill-async", async_scheduling=True, max_num_batched_tokens=64,
             long_prefill_token_threshold=24, max_prompt=200, arrival_probability=0.8),
    Workload("arrivals-every-step", block_size=8, arrival_probability=1.0, max_arrivals=2,
             max_output=24, max_num_seqs=32, num_blocks=400),
    Workload("everything-async", async_scheduling=True, block_size=4, num_blocks=90,
             max_num_batched_tokens=48, long_prefill_token_threshold=16,
             arrival_probability=0.9, abort_probability=0.05, eos_probability=0.05,
             max_prompt=60, max_output=60),
    Workload("mixed-async-mrv2", async_scheduling=True, abort_probability=0.05,
             model_runner_v2=True),
    Workload("preemption-async-mrv2", async_scheduling=True, num_blocks=28, max_num_seqs=12,
             arrival_probability=0.7, max_prompt=40, max_output=160, model_runner_v2=True),
)

# Workloads with sample logprobs (not in WORKLOADS: the other pieces' tests
# keep theirs).
LOGPROB_WORKLOADS = (
    Workload("logprobs", max_num_seqs=24, logprobs_probability=0.5,
             runner_logprobs=("rows", "cu", "none")),
    Workload("logprobs-async", async_scheduling=True, max_num_seqs=24,
             logprobs_probability=0.5, abort_probability=0.05,
             runner_logprobs=("rows", "cu", "none")),
    Workload("logprobs-chunked-prefill-async", async_scheduling=True,
             max_num_batched_tokens=64, long_prefill_token_threshold=24, max_prompt=200,
             arrival_probability=0.8, logprobs_probability=0.7, runner_logprobs=("cu",)),
    Workload("logprobs-preemption-async", async_scheduling=True, num_blocks=28,
             max_num_seqs=12, arrival_probability=0.7, max_prompt=40, max_output=160,
             eos_probability=0.05, logprobs_probability=0.6,
             runner_logprobs=("rows", "cu")),
)
LOGPROB_CHOICES = (0, 1, 5, -1)

# Workloads with structured output (not in WORKLOADS: the other pieces' tests
# keep theirs).
GRAMMAR_WORKLOADS = (
    Workload("grammar", max_num_seqs=24, grammar_probability=0.6),
    Workload("grammar-async", async_scheduling=True, max_num_seqs=24,
             grammar_probability=0.6, abort_probability=0.05),
    Workload("grammar-logprobs-preemption-async", async_scheduling=True, num_blocks=28,
             max_num_seqs=12, arrival_probability=0.7, max_prompt=40, max_output=160,
             eos_probability=0.05, logprobs_probability=0.5, grammar_probability=0.5),
    Workload("grammar-spec-decode", abort_probability=0.05, num_spec_tokens=3,
             num_lookahead_tokens=3, grammar_probability=0.5),
)

# Workloads with spec decoding's drafts and lookahead slots (not in
# WORKLOADS: the other pieces' tests keep theirs).
SPEC_WORKLOADS = (
    Workload("spec-decode", max_num_seqs=24, arrival_probability=0.3,
             abort_probability=0.0, eos_probability=0.0, num_spec_tokens=3,
             num_lookahead_tokens=3),
    Workload("spec-decode-mixed", abort_probability=0.05, num_spec_tokens=3,
             num_lookahead_tokens=3),
    Workload("spec-decode-no-prefix-cache", prefix_caching=False, num_spec_tokens=4,
             num_lookahead_tokens=4, max_output=120),
    Workload("spec-decode-preemption", num_blocks=40, max_num_seqs=12,
             arrival_probability=0.7, max_prompt=40, max_output=160, num_spec_tokens=3,
             num_lookahead_tokens=3),
    Workload("spec-decode-small-blocks", block_size=4, num_blocks=300,
             max_num_batched_tokens=96, long_prefill_token_threshold=16,
             arrival_probability=0.8, num_spec_tokens=5, num_lookahead_tokens=2,
             draft_acceptance=("all", "some")),
    Workload("spec-decode-drafts-only", max_num_seqs=24, num_spec_tokens=3,
             num_lookahead_tokens=0),  # ngram-like: drafts, no lookahead slots
    Workload("spec-decode-max-model-len", max_model_len=64, max_prompt=40,
             max_output=100, num_spec_tokens=3, num_lookahead_tokens=3,
             draft_acceptance=("all",)),
    # Async scheduling: the scheduler's drafts are placeholders.
    Workload("spec-decode-async", async_scheduling=True, max_num_seqs=24,
             arrival_probability=0.3, abort_probability=0.0, eos_probability=0.0,
             num_spec_tokens=3, num_lookahead_tokens=3),
    Workload("spec-decode-async-mixed", async_scheduling=True, abort_probability=0.05,
             num_spec_tokens=3, num_lookahead_tokens=3),
    Workload("spec-decode-async-preemption", async_scheduling=True, num_blocks=40,
             max_num_seqs=12, arrival_probability=0.7, max_prompt=40, max_output=160,
             num_spec_tokens=3, num_lookahead_tokens=3),
    Workload("spec-decode-async-small-blocks", async_scheduling=True, block_size=4,
             num_blocks=300, max_num_batched_tokens=96, long_prefill_token_threshold=16,
             arrival_probability=0.8, num_spec_tokens=5, num_lookahead_tokens=2,
             draft_acceptance=("all", "some")),
)


def _model_dir() -> str:
    """A config-only model directory whose architecture needs no import.

    vLLM's ``ModelConfig`` inspects the architecture's class; an in-process
    class registered with ``ModelRegistry`` keeps that from importing a real
    model module (and its GPU-side dependencies).  Nothing ever runs it.
    """
    global _MODEL_DIR
    if _MODEL_DIR is None:
        import torch.nn as nn
        from vllm import ModelRegistry

        class FastbatchSchedulerOnlyLM(nn.Module):
            def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
                super().__init__()

            def forward(self, *args: Any, **kwargs: Any) -> Any:
                raise NotImplementedError("scheduler tests run no model")

            def compute_logits(self, hidden_states: Any) -> Any:
                raise NotImplementedError("scheduler tests run no model")

            def embed_input_ids(self, input_ids: Any) -> Any:
                raise NotImplementedError("scheduler tests run no model")

        ModelRegistry.register_model(_ARCHITECTURE, FastbatchSchedulerOnlyLM)
        path = tempfile.mkdtemp(prefix="fastbatch-sched-")
        with open(os.path.join(path, "config.json"), "w") as file:
            json.dump({
                "architectures": [_ARCHITECTURE], "model_type": "llama",
                "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
                "num_key_value_heads": 2, "num_hidden_layers": 1,
                "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
                "torch_dtype": "float32", "bos_token_id": 1,
                "eos_token_id": EOS_TOKEN_ID, "rms_norm_eps": 1e-6,
            }, file)
        _MODEL_DIR = path
    return _MODEL_DIR


def make_scheduler(workload: Workload) -> Any:
    """A real vLLM scheduler for ``workload`` (the CPU platform turns async
    scheduling off in the config; it is put back here when asked for)."""
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler_config = SchedulerConfig(
        max_num_seqs=workload.max_num_seqs,
        max_num_batched_tokens=workload.max_num_batched_tokens,
        max_model_len=workload.max_model_len,
        long_prefill_token_threshold=workload.long_prefill_token_threshold,
        enable_chunked_prefill=True,
        async_scheduling=workload.async_scheduling,
        is_encoder_decoder=False,
    )
    model_config = ModelConfig(model=_model_dir(), dtype="float32", seed=0,
                               skip_tokenizer_init=True,
                               max_model_len=workload.max_model_len)
    cache_config = CacheConfig(block_size=workload.block_size,
                               enable_prefix_caching=workload.prefix_caching)
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config)
    vllm_config.scheduler_config.async_scheduling = workload.async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=workload.num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=workload.block_size, num_kv_heads=1, head_size=1,
            dtype=torch.float32))])
    cache_config.num_gpu_blocks = workload.num_blocks
    cls = AsyncScheduler if workload.async_scheduling else Scheduler
    scheduler = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                    log_stats=workload.log_stats,
                    structured_output_manager=StructuredOutputManager(vllm_config),
                    block_size=workload.block_size)
    if workload.model_runner_v2 and hasattr(scheduler, "use_v2_model_runner"):
        # Read nowhere else at run time (``can_skip_drafts`` needs lookahead tokens).
        # vLLM 0.34.0 has no V1 runner: its scheduler always takes these branches
        # and has no such attribute.
        scheduler.use_v2_model_runner = True
    if workload.num_spec_tokens:
        # What the scheduler's __init__ derives from a speculative config's
        # counts (a real one needs a draft model).
        from vllm.utils.math_utils import cdiv

        scheduler.num_spec_tokens = workload.num_spec_tokens
        if hasattr(scheduler, "_spec_token_placeholders"):  # up to 0.33.0's AsyncScheduler
            scheduler._spec_token_placeholders = [-1] * workload.num_spec_tokens
        scheduler.num_lookahead_tokens = workload.num_lookahead_tokens
        scheduler._spec_decode_step_blocks = cdiv(
            1 + workload.num_spec_tokens + workload.num_lookahead_tokens,
            workload.block_size)
    return scheduler


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    min_tokens: int
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None = None
    grammar: tuple[int, ...] | None = None  # the tokens its grammar refuses


class StandInGrammar(_StandInGrammar):
    """A request's grammar: the activation check's stand-in (accepts every
    token but those it ``refuses``, keeps what it accepted) with the rest of
    the interface vLLM's scheduler uses under spec decoding."""

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        valid = []
        for token in tokens:
            if token in self.refuses:
                break
            valid.append(token)
        return valid

    def is_terminated(self) -> bool:
        return False


@functools.cache
def block_hasher(block_size: int) -> Any:
    """One block hasher per block size, shared by every request, as vLLM's
    EngineCore makes one and hands it to each request it admits."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)


def make_request(spec: RequestSpec, block_size: int) -> Any:
    """A fresh vLLM ``Request`` (each scheduler gets its own objects)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    params = SamplingParams(
        max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
        stop_token_ids=list(spec.stop_token_ids), ignore_eos=spec.ignore_eos,
        logprobs=spec.logprobs,
        structured_outputs=None if spec.grammar is None else StructuredOutputsParams(
            regex="[a-z]*"))
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    request = Request(request_id=spec.request_id, prompt_token_ids=list(spec.prompt),
                      sampling_params=params, pooling_params=None, arrival_time=0.0,
                      block_hasher=block_hasher(block_size))
    if spec.grammar is not None:  # compiled already (vLLM's engine compiles it)
        request.structured_output_request.grammar = StandInGrammar(spec.grammar)
    return request


def snapshot(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain, comparable data (dataclasses, msgspec structs and
    objects field by field; KV blocks by id; sets sorted; dicts in order)."""
    if _depth > 40:
        raise RecursionError("snapshot too deep")
    depth = _depth + 1
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if type(value).__name__ == "KVCacheBlock":
        return ("block", value.block_id)
    if isinstance(value, tuple) and hasattr(type(value), "_fields"):  # a named tuple
        return {"__type__": type(value).__name__,
                "items": [snapshot(item, depth) for item in value]}
    if isinstance(value, (list, tuple)):
        return [snapshot(item, depth) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((snapshot(item, depth) for item in value), key=repr)
    if isinstance(value, (dict, MappingProxyType)):  # in order: the order is part of it
        # (a tuple of pairs, in order)
        return tuple((snapshot(key, depth), snapshot(item, depth))
                     for key, item in value.items())
    if type(value).__module__ == "numpy" and hasattr(value, "tobytes"):
        # exactly: dtype, shape, strides, bytes
        return {"__numpy__": [value.dtype.str, list(value.shape), list(value.strides)],
                "bytes": value.tobytes()}
    if hasattr(value, "tolist"):  # torch
        return value.tolist()
    if callable(value) and not hasattr(value, "__dict__"):
        return getattr(value, "__qualname__", repr(value))
    fields: list[str]
    if dataclasses.is_dataclass(value):
        fields = [field.name for field in dataclasses.fields(value)]
    elif hasattr(value, "__struct_fields__"):
        fields = list(value.__struct_fields__)
    elif hasattr(value, "__dict__"):
        fields = sorted(vars(value))
    else:
        return repr(value)
    snap = {name: snapshot(getattr(value, name, None), depth) for name in fields
            if name not in ("timestamp", "pool", "prev_free_block", "next_free_block")}
    snap["__type__"] = type(value).__name__
    return snap


def kv_state(scheduler: Any) -> dict[str, Any]:
    """The KV cache manager's state as plain data."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    pool_map = pool.cached_block_hash_to_block
    cached = pool_map._cache
    groups = []
    for single in manager.coordinator.single_type_managers:
        groups.append({
            "req_to_blocks": {rid: [block.block_id for block in blocks]
                              for rid, blocks in single.req_to_blocks.items()},
            "num_cached_block": dict(single.num_cached_block),
            "partial_hits": snapshot(single._partial_hit_reqs),
            "new_block_ids": list(single.new_block_ids),
            "pending_cow": snapshot(single._pending_cow_copies),
        })
    return {
        "groups": groups,
        "free_queue": [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        "num_free": pool.get_num_free_blocks(),
        "blocks": [(block.block_id, block.ref_cnt, snapshot(block.block_hash),
                    block.block_hash_num_tokens, block.is_null) for block in pool.blocks],
        "hash_to_block": snapshot({
            key: _block_ids(value) for key, value in cached.items()}),
        # vLLM 0.34.0 keeps the ids of a hash cached by several blocks apart
        "hash_to_more_blocks": snapshot({
            key: list(value) for key, value in getattr(pool_map, "_dup_ids", {}).items()}),
    }


def _block_ids(value: Any) -> Any:
    """A prefix-cache entry as block ids: a block id (vLLM 0.34.0), a block, or
    several blocks by id (0.33.0)."""
    if isinstance(value, int):
        return value
    return sorted(value) if isinstance(value, dict) else value.block_id


_REQUEST_FIELDS = ("status", "stop_reason", "_all_token_ids", "_output_token_ids",
                   "num_computed_tokens", "num_output_placeholders", "num_in_flight_tokens",
                   "num_preemptions", "is_prefill_chunk", "spec_token_ids", "block_hashes",
                   "num_stale_output_tokens", "num_prompt_tokens", "max_tokens",
                   "structured_output_request")


def request_state(scheduler: Any) -> dict[str, Any]:
    """Every request's bookkeeping, and the queues, as plain data."""
    return {
        "requests": {rid: {name: snapshot(getattr(request, name, None))
                           for name in _REQUEST_FIELDS}
                     for rid, request in scheduler.requests.items()},
        "running": [request.request_id for request in scheduler.running],
        "waiting": [request.request_id for request in scheduler.waiting],
        "finished_req_ids": sorted(scheduler.finished_req_ids),
    }


class Lockstep:
    """Drive ``stock`` and ``fast`` with the same traffic; compare each step.

    ``make(workload)`` builds one scheduler; ``make_fast(workload)`` (default:
    the same) builds the other.  ``tamper(step, scheduler_output)`` may edit
    the fast side's output before the comparison (to prove that the harness
    sees a planted difference).
    """

    def __init__(self, workload: Workload, seed: int,
                 make_fast: Callable[[Workload], Any] | None = None) -> None:
        self.workload = workload
        self.rng = random.Random(seed)
        self.stock = make_scheduler(workload)
        self.fast = (make_fast or make_scheduler)(workload)
        self.next_id = 0
        self.prefixes = [tuple(self.rng.randrange(3, VOCAB_SIZE) for _ in range(48))
                         for _ in range(3)]
        # (scheduler output per side, sampled ids per request, sample logprobs)
        # not yet answered.
        self.in_flight: list[tuple[Any, Any, dict[str, list[int]], Any]] = []
        self.steps = 0
        self.preemptions = 0

    def _new_spec(self) -> RequestSpec:
        rng, workload = self.rng, self.workload
        length = rng.randint(1, workload.max_prompt)
        if rng.random() < 0.5:  # a shared prefix, for prefix-cache hits
            prefix = rng.choice(self.prefixes)
            prompt = (prefix + tuple(rng.randrange(3, VOCAB_SIZE) for _ in range(length)))
            prompt = prompt[:max(length, rng.randint(1, len(prompt)))]
        else:
            prompt = tuple(rng.randrange(3, VOCAB_SIZE) for _ in range(length))
        prompt = prompt[:workload.max_model_len - 1]
        self.next_id += 1
        stop = tuple(rng.sample(range(3, VOCAB_SIZE), rng.randint(1, 2))) \
            if rng.random() < 0.3 else ()
        max_tokens = rng.randint(1, workload.max_output)
        min_tokens = rng.randint(0, min(8, max_tokens)) if rng.random() < 0.3 else 0
        ignore_eos = rng.random() < 0.2
        logprobs = None
        if workload.logprobs_probability and rng.random() < workload.logprobs_probability:
            logprobs = rng.choice(LOGPROB_CHOICES)
        grammar = None
        if workload.grammar_probability and rng.random() < workload.grammar_probability:
            grammar = (rng.randrange(3, VOCAB_SIZE),) if rng.random() < 0.5 else ()
        return RequestSpec(
            request_id=f"r{self.next_id}", prompt=prompt, max_tokens=max_tokens,
            min_tokens=min_tokens, stop_token_ids=stop, ignore_eos=ignore_eos,
            logprobs=logprobs, grammar=grammar)

    def _traffic(self) -> None:
        rng, workload = self.rng, self.workload
        if rng.random() < workload.arrival_probability:
            for _ in range(rng.randint(1, workload.max_arrivals)):
                spec = self._new_spec()
                self.stock.add_request(make_request(spec, workload.block_size))
                self.fast.add_request(make_request(spec, workload.block_size))
        if self.stock.requests and rng.random() < workload.abort_probability:
            from vllm.v1.request import RequestStatus

            victim = rng.choice(sorted(self.stock.requests))
            for side in (self.stock, self.fast):
                side.finish_requests(victim, RequestStatus.FINISHED_ABORTED)

    def _sample(self, scheduler_output: Any) -> dict[str, list[int]]:
        """The fake runner: one token for each request whose chunk completes
        its known tokens (read from the stock side, right after scheduling)."""
        if self.workload.num_spec_tokens:
            return self._sample_spec(scheduler_output)
        rng = self.rng
        sampled: dict[str, list[int]] = {}
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.stock.requests[req_id]
            if request.is_prefill_chunk:
                sampled[req_id] = []
                continue
            params = request.sampling_params
            # Tokens before this one (under async scheduling the placeholders
            # already count this step's token).
            produced = request.num_output_tokens + max(request.num_output_placeholders - 1, 0)
            may_stop = produced >= params.min_tokens
            roll = rng.random()
            if may_stop and roll < self.workload.eos_probability:
                token = EOS_TOKEN_ID
            else:
                token = rng.randrange(3, VOCAB_SIZE)
                while not may_stop and token in params.all_stop_token_ids:
                    token = rng.randrange(3, VOCAB_SIZE)
            sampled[req_id] = [token]
        return sampled

    def _sample_spec(self, scheduler_output: Any) -> dict[str, list[int]]:
        """The fake runner with spec decoding: of a request's scheduled drafts
        the first ``accepted`` (all, some or none), then one sampled token;
        never a stop token before ``min_tokens`` (the drafts are never EOS
        nor a stop token).  Under async scheduling the drafts scheduled are
        placeholders: the accepted ones are the worker's, drawn here."""
        rng = self.rng
        sampled: dict[str, list[int]] = {}
        drafts_of = scheduler_output.scheduled_spec_decode_tokens
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.stock.requests[req_id]
            if request.is_prefill_chunk:
                sampled[req_id] = []
                continue
            drafts = list(drafts_of.get(req_id, ()))
            mode = rng.choice(self.workload.draft_acceptance)
            accepted = (len(drafts) if mode == "all" else 0 if mode == "none"
                        else rng.randint(0, len(drafts)))
            params = request.sampling_params
            if self.workload.async_scheduling:
                choices = [t for t in range(3, VOCAB_SIZE) if t not in params.all_stop_token_ids]
                tokens = [rng.choice(choices) for _ in range(accepted)]
                # the placeholders already count this step's tokens, and the
                # previous step's while it is in flight
                earlier = max(request.num_output_placeholders - 1 - len(drafts), 0)
            else:
                tokens, earlier = drafts[:accepted], 0
            produced = request.num_output_tokens + earlier + len(tokens)
            may_stop = produced >= params.min_tokens
            if may_stop and rng.random() < self.workload.eos_probability:
                token = EOS_TOKEN_ID
            else:
                token = rng.randrange(3, VOCAB_SIZE)
                while not may_stop and token in params.all_stop_token_ids:
                    token = rng.randrange(3, VOCAB_SIZE)
            sampled[req_id] = [*tokens, token]
        return sampled

    def _drafts(self, scheduler_output: Any) -> Any:
        """The fake drafter after a step: 0 to ``num_spec_tokens`` drafts for
        every request of the step still decoding (read from the stock side),
        as vLLM's ``DraftTokenIds``; never EOS nor a stop token."""
        from vllm.v1.outputs import DraftTokenIds

        rng, req_ids, drafts = self.rng, [], []
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.stock.requests.get(req_id)
            if request is None or request.is_finished() or request.is_prefill_chunk:
                continue
            stops = request.sampling_params.all_stop_token_ids
            choices = [t for t in range(3, VOCAB_SIZE) if t not in stops]
            req_ids.append(req_id)
            drafts.append([rng.choice(choices)
                           for _ in range(rng.randint(0, self.workload.num_spec_tokens))])
        return DraftTokenIds(req_ids, drafts)

    def _sample_logprobs(self, scheduler_output: Any,
                         sampled: dict[str, list[int]]) -> Any:
        """The fake runner's sample logprobs for the step, as
        ``(arrays, cu_num_generated_tokens)``, or None: none asked for, or the
        runner gives none."""
        import numpy

        workload = self.workload
        if not workload.logprobs_probability:
            return None
        req_ids = list(scheduler_output.num_scheduled_tokens)
        wanted = [self.stock.requests[rid].sampling_params.logprobs for rid in req_ids]
        wanted = [VOCAB_SIZE if k == -1 else k for k in wanted if k is not None]
        if not wanted:
            return None
        mode = self.rng.choice(workload.runner_logprobs)
        if mode == "none":
            return None
        cu = None
        if mode == "cu":  # one row per sampled token: prefill chunks have none
            cu = [0]
            for rid in req_ids:
                cu.append(cu[-1] + len(sampled[rid]))
            rows = cu[-1]
        else:
            rows = len(req_ids)
        width = max(wanted) + 1
        random = numpy.random.RandomState(self.rng.getrandbits(32))
        ids = random.randint(0, VOCAB_SIZE, size=(rows, 2 * width)).astype(numpy.int32)
        values = -random.exponential(size=(rows, width)).astype(numpy.float32)
        ranks = random.randint(1, VOCAB_SIZE, size=rows).astype(numpy.int64)
        return (ids, values, ranks), cu

    @staticmethod
    def _runner_output(scheduler_output: Any, sampled: dict[str, list[int]],
                       logprobs: Any = None) -> Any:
        from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput

        req_ids = list(scheduler_output.num_scheduled_tokens)
        lists = None
        if logprobs is not None:  # this side's own copy (token ids strided, as a view)
            (ids, values, ranks), cu = logprobs
            lists = LogprobsLists(ids.copy()[:, ::2], values.copy(), ranks.copy(),
                                  None if cu is None else list(cu))
        indices = ({"req_id_to_index": {rid: i for i, rid in enumerate(req_ids)}}
                   if "req_id_to_index" in ModelRunnerOutput.__dataclass_fields__ else {})
        return ModelRunnerOutput(
            req_ids=req_ids, **indices,  # vLLM 0.34.0 removed the index map
            sampled_token_ids=[list(sampled[rid]) for rid in req_ids], logprobs=lists)

    def _compare(self, what: str, stock: Any, fast: Any) -> None:
        found = first_difference(fast, stock, what)
        if found is not None:
            raise Divergence(f"{self.workload.name} step {self.steps}: {found}")

    def _compare_states(self) -> None:
        self._compare("kv", kv_state(self.stock), kv_state(self.fast))
        self._compare("requests", request_state(self.stock), request_state(self.fast))

    def _answer_oldest(self, tamper: Callable[[int, Any], None] | None) -> None:
        stock_output, fast_output, sampled, logprobs = self.in_flight.pop(0)
        stock_result = self.stock.update_from_output(
            stock_output, self._runner_output(stock_output, sampled, logprobs))
        fast_result = self.fast.update_from_output(
            fast_output, self._runner_output(fast_output, sampled, logprobs))
        if tamper is not None:
            tamper(self.steps, fast_result)
        self._compare("engine_core_outputs", snapshot(stock_result), snapshot(fast_result))
        if self.workload.num_spec_tokens and not self.workload.async_scheduling:
            drafts = self._drafts(stock_output)
            for side in (self.stock, self.fast):  # each side its own lists
                side.update_draft_token_ids(type(drafts)(
                    list(drafts.req_ids), [list(ids) for ids in drafts.draft_token_ids]))
        self._compare_states()

    def step(self, tamper: Callable[[int, Any], None] | None = None) -> None:
        """One engine step on both sides: traffic, schedule, compare, and the
        model's answer (one step later under async scheduling, as vLLM's
        batch queue does), compare."""
        self.steps += 1
        self._traffic()
        stock_output = self.stock.schedule()
        fast_output = self.fast.schedule()
        self._compare("scheduler_output", snapshot(stock_output), snapshot(fast_output))
        self.preemptions += len(stock_output.preempted_req_ids or ())
        self._compare_states()
        sampled = self._sample(stock_output)
        self.in_flight.append((stock_output, fast_output, sampled,
                               self._sample_logprobs(stock_output, sampled)))
        depth = 2 if self.workload.async_scheduling else 1
        while len(self.in_flight) >= depth:
            self._answer_oldest(tamper)

    def run(self, steps: int, tamper: Callable[[int, Any], None] | None = None) -> None:
        for _ in range(steps):
            self.step(tamper)
