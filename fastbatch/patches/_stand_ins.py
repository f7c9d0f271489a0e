"""Stand-ins for the pieces' activation checks, shadows and tests: small
real vLLM requests, schedulers (built without ``__init__``, with the state a
method reads), KV-cache managers and grammars, and the KV-cache manager's
state as plain data.  Each imports vLLM's classes when called."""

from __future__ import annotations

import contextlib
import dis
import logging
from types import MethodType, SimpleNamespace
from typing import Any

from fastbatch.patches._compare import plain


def kv_manager_state(manager: Any) -> Any:
    """A KV-cache manager's state as plain data: block tables, cached counts,
    free queue order, ref counts and hashes, and the prefix cache's entries
    (each hash with the ids of the blocks cached under it)."""
    pool = manager.block_pool
    return (
        [({rid: [block.block_id for block in blocks]
           for rid, blocks in single.req_to_blocks.items()},
          dict(single.num_cached_block), sorted(single._partial_hit_reqs))
         for single in manager.coordinator.single_type_managers],
        [block.block_id for block in pool.free_block_queue.get_all_free_blocks()],
        [(block.block_id, block.ref_cnt, block.block_hash) for block in pool.blocks],
        _prefix_cache_entries(pool.cached_block_hash_to_block),
    )


def _prefix_cache_entries(cache: Any) -> dict[Any, list[int]]:
    """``BlockHashToBlockMap``'s entries as ``{hash: sorted block ids}``:
    vLLM 0.34.0 keeps one block id per hash in ``_cache`` and the ids of a
    hash cached by several blocks in ``_dup_ids``; before, ``_cache`` held a
    block, or a dict of blocks by id."""
    entries: dict[Any, list[int]] = {}
    for key, value in cache._cache.items():
        if isinstance(value, int):
            entries[key] = [value]
        elif isinstance(value, dict):
            entries[key] = sorted(value)
        else:
            entries[key] = [value.block_id]
    for key, ids in getattr(cache, "_dup_ids", {}).items():
        entries[key] = sorted(ids)
    return entries


def small_manager(enable_caching: bool) -> Any:
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(num_blocks=12, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=4, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    return KVCacheManager(config, max_model_len=64, scheduler_block_size=4,
                          hash_block_size=4, enable_caching=enable_caching)


def hashed_request(request_id: str) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    return Request(request_id=request_id, prompt_token_ids=[5, 6, 7, 8, 9, 10],
                   sampling_params=SamplingParams(max_tokens=16), pooling_params=None,
                   arrival_time=0.0, block_hasher=get_request_block_hasher(4, sha256))


def running_request(request_id: str, prompt_len: int, num_output: int, num_computed: int,
                   placeholders: int, structured: bool) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    request = Request(request_id=request_id, prompt_token_ids=list(range(3, 3 + prompt_len)),
                      sampling_params=SamplingParams(max_tokens=64), pooling_params=None,
                      arrival_time=0.0)
    request.append_output_token_ids(list(range(5, 5 + num_output)))
    request.num_computed_tokens = num_computed
    request.num_in_flight_tokens = placeholders
    request.num_output_placeholders = placeholders
    if structured:  # only ``is not None`` is read here
        request.structured_output_request = SimpleNamespace()
    return request


def scheduler_attributes(cls: Any) -> set[str]:
    """The attributes that ``cls.__init__`` (and each base class's
    ``__init__``) assigns on ``self``, read off their bytecode: what a
    scheduler of that class built by vLLM has (attributes that a helper
    called from ``__init__`` sets are not seen: the check then refuses)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        code = getattr(vars(klass).get("__init__"), "__code__", None)
        if code is None or not code.co_varnames:
            continue
        this = code.co_varnames[0]
        previous = None
        for instruction in dis.get_instructions(code):
            # ``self.name = value``: self loaded (alone, or last of a pair on
            # 3.13) just before STORE_ATTR.
            if (instruction.opname == "STORE_ATTR" and previous is not None
                    and previous.opname.startswith("LOAD_FAST")
                    and (previous.argval == this
                         or (type(previous.argval) is tuple and previous.argval[-1] == this))):
                names.add(instruction.argval)
            previous = instruction
    return names


def use_v2_values(cls: Any) -> tuple[bool | None, ...]:
    """The values of ``use_v2_model_runner`` to check: both where the
    release's scheduler has the attribute (vLLM up to 0.33.0), else None (not
    set: vLLM 0.34.0 has no such attribute)."""
    return (False, True) if "use_v2_model_runner" in scheduler_attributes(cls) else (None,)


def scheduled_request(request_id: str, prompt_len: int, num_output: int, num_computed: int,
                      placeholders: int = 0, spec: tuple[int, ...] = (), max_tokens: int = 64,
                      prefill_chunk: bool = False, eligible: int = 0, encoder: bool = False,
                      *, block_size: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    request = Request(request_id=request_id, prompt_token_ids=list(range(3, 3 + prompt_len)),
                      sampling_params=SamplingParams(max_tokens=max_tokens),
                      pooling_params=None, arrival_time=0.0,
                      block_hasher=get_request_block_hasher(block_size, sha256))
    request.append_output_token_ids(list(range(5, 5 + num_output)))
    request.num_computed_tokens = num_computed
    request.num_output_placeholders = placeholders
    request.spec_token_ids = list(spec)
    request.is_prefill_chunk = prefill_chunk
    request.next_decode_eligible_step = eligible
    request.status = RequestStatus.RUNNING
    return request


def stand_in_scheduler(cls: Any, enable_caching: bool, requests: list[Any],
                        manager: Any = None) -> Any:
    """A ``cls`` instance with just the state ``update_from_output`` reads on
    a step without connectors, stats or structured output (no engine: the
    check must be cheap), over ``manager`` or a small real KV-cache manager."""
    from collections import defaultdict
    from types import SimpleNamespace

    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler = object.__new__(cls)
    scheduler.__dict__.update(
        requests={request.request_id: request for request in requests},
        running=list(requests),
        kv_cache_manager=(small_manager(enable_caching) if manager is None
                          else manager),
        max_model_len=64, num_spec_tokens=0, num_sampled_tokens_per_step=1,
        defer_block_free=False, perf_metrics=None, connector=None, ec_connector=None,
        aux_output_connector=None, return_sampling_mask=False, is_mm_encoder_only=False,
        structured_output_manager=SimpleNamespace(
            accept_tokens=lambda request, tokens: StructuredOutputManager.accept_tokens(
                None, request, tokens)),  # its early return for plain requests
        grammar_compile_error_reqs={}, encoder_cache_mismatch_reqs=set(),
        recompute_kv_load_failures=True, log_stats=False,
        finished_req_ids_dict=defaultdict(set), finished_req_ids=set(),
        kv_event_publisher=None, waiting=None, kv_holding_waiting=None,
        async_kv_waiting=None, deferred_waiting=set(), spec_decode_metrics_level=None,
        # vLLM 0.34 reads these (the Mamba caching rule; watermarking, for a
        # request that reports prefill stats)
        has_mamba_layers=False, vllm_config=SimpleNamespace(watermark_config=None),
        _parked_reservations={}, _parked_reserved_blocks=0,  # (freeing a request)
        _inflight_prefills=set(), _kv_fetch_stages=None, _pending_encoder_input_ids={},
        encoder_cache_manager=EncoderCacheManager(cache_size=0), deferred_frees=[],
        sched_step_seq=0, processed_step_seq=0)
    return scheduler


def stand_in_requests() -> list[Any]:
    """Requests that cross block boundaries and stop in every way: by
    max_tokens, a stop token, EOS, and one that must pass min_tokens first;
    three of them with sample logprobs (1, 0 and -1: the whole vocabulary)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    requests = []
    for index, (max_tokens, stop, min_tokens, logprobs) in enumerate(
            [(9, [], 0, None), (20, [31], 0, 1), (20, [], 0, 0), (20, [], 6, -1)]):
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=stop,
                                min_tokens=min_tokens, logprobs=logprobs)
        params.update_from_generation_config({}, 2)  # EOS = 2
        requests.append(Request(
            request_id=f"r{index}", prompt_token_ids=[5, 6, 7, 8, 9, 10][:3 + index],
            sampling_params=params, pooling_params=None, arrival_time=0.0,
            block_hasher=get_request_block_hasher(4, sha256)))
    return requests


class StandInGrammar:
    """A grammar that accepts every token but those it ``refuses``, and keeps
    the tokens it accepted (the activation check's; the tests' lockstep
    extends it)."""

    def __init__(self, refuses: tuple[int, ...]) -> None:
        self.refuses, self.accepted = refuses, []

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if any(token in self.refuses for token in tokens):
            return False
        self.accepted.extend(tokens)
        return True


def with_stand_in_grammars(scheduler: Any) -> None:
    """Requests r1 and r3 get a grammar (r3's refuses token 20, its fifth),
    advanced through vLLM's own ``StructuredOutputManager.accept_tokens``."""
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.structured_output.request import StructuredOutputRequest

    manager = object.__new__(StructuredOutputManager)
    manager.enable_in_reasoning = True  # every token is the grammar's
    scheduler.structured_output_manager = manager
    for request_id, refuses in (("r1", ()), ("r3", (20,))):
        scheduler.requests[request_id].structured_output_request = StructuredOutputRequest(
            params=StructuredOutputsParams(regex="[a-z]*"), _grammar=StandInGrammar(refuses))


def running_scheduler(cls: Any, allocate: Any, batch: tuple[tuple[Any, ...], ...], *,
                      block_size: int, max_model_len: int, lookahead: int,
                      prefill_lookahead: int, budget: int, defer_prefills: bool = False) -> Any:
    """A scheduler of class ``cls`` (built without ``__init__``: the
    attributes ``schedule``'s running loop reads) over a small real KV-cache
    manager (prefix caching on, ``allocate`` its ``allocate_slots``) holding
    the blocks of ``batch``'s requests (rows: ``scheduled_request``'s
    arguments), and the loop's locals."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    config = KVCacheConfig(num_blocks=12 * len(batch), kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1,
                                                      head_size=1, dtype=torch.float32))])
    manager = KVCacheManager(config, max_model_len=max_model_len,
                             scheduler_block_size=block_size, hash_block_size=block_size,
                             enable_caching=True)
    manager.allocate_slots = MethodType(allocate, manager)
    scheduler = cls.__new__(cls)
    scheduler.running = [scheduled_request(*row, block_size=block_size) for row in batch]
    scheduler.kv_cache_manager = manager
    scheduler.ec_connector, scheduler.need_mamba_block_aligned_split = None, False
    scheduler.current_step, scheduler.max_model_len = 5, max_model_len
    scheduler.num_sampled_tokens_per_step = 1
    scheduler.num_prefill_lookahead, scheduler.num_lookahead_tokens = prefill_lookahead, lookahead
    (single,) = manager.coordinator.single_type_managers
    pool = manager.block_pool
    for request in scheduler.running:
        held = -(-(request.num_computed_tokens + 1) // single.block_size)
        single.req_to_blocks[request.request_id] = pool.get_new_blocks(held)
        single.num_cached_block[request.request_id] = 0
    return scheduler, {
        "req_index": 0, "token_budget": budget, "input_budget": budget + 40,
        "draft_slots": lookahead, "long_prefill_token_threshold": 8,
        "defer_prefills": defer_prefills, "prefill_scheduled": False, "drafts_needed": False}


def _not_a_planted_refusal(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Unexpected: grammar rejected tokens")


@contextlib.contextmanager
def planted_refusals_unlogged(module: str) -> Any:
    """vLLM's loop (of ``module``) logs a refusal as an error: the activation
    check's own are planted, and not logged."""
    scheduler_logger = logging.getLogger(module)
    scheduler_logger.addFilter(_not_a_planted_refusal)
    try:
        yield
    finally:
        scheduler_logger.removeFilter(_not_a_planted_refusal)


def side_state(scheduler: Any, outputs: Any) -> Any:
    """What ``update_from_output`` left in a stand-in scheduler and returned,
    as plain data (the activation check compares stock's and fastbatch's)."""
    import msgspec

    def fields(output: Any) -> Any:
        return {key: plain(value) if key == "new_logprobs" else value
                for key, value in msgspec.structs.asdict(output).items()
                if key != "timestamp"}

    return (
        {client: {**fields(eco), "outputs": [fields(out) for out in eco.outputs]}
         for client, eco in outputs.items()},
        list(outputs),
        {rid: (r.status, r.stop_reason, list(r._all_token_ids), list(r._output_token_ids),
               r.num_computed_tokens, r.num_output_placeholders, r.num_in_flight_tokens,
               list(r.block_hashes),
               getattr(getattr(r.structured_output_request, "_grammar", None), "accepted",
                       None))
         for rid, r in scheduler.requests.items()},
        [r.request_id for r in scheduler.running],
        kv_manager_state(scheduler.kv_cache_manager),
    )


def stand_in_logprobs(numpy: Any, logprobs_lists: Any, step: int, num_rows: int) -> Any:
    """The step's sample logprobs: none (every third step), or one row per
    request (strided views), found by row or (every other time) through
    ``cu_num_generated_tokens`` past a row of another request."""
    if step % 3 == 0:
        return None
    shift = step % 3 - 1  # 0: cu_num_generated_tokens None; 1: rows shifted by one
    rows = num_rows + shift
    values = numpy.arange(rows * 12, dtype=numpy.float32).reshape(rows, 12) * -0.5 - step
    ids = numpy.arange(rows * 12, dtype=numpy.int32).reshape(rows, 12) + step
    return logprobs_lists(ids[:, ::2], values[:, 1::2],
                          numpy.arange(rows, dtype=numpy.int64) + step,
                          list(range(shift, rows)) if shift else None)
