"""Time Model Runner V2's per-request host loops (vLLM 0.34.0, CPU torch).

Runs vLLM's OWN functions (unbound, on stand-in `self` objects built from
numpy / CPU torch) wherever the function has no CUDA call; otherwise a copy of
the loop body. Usage: python benchmarks/mrv2_host_loops.py [name ...]  (vLLM 0.34.0 installed)
Prints median microseconds per call for N = 256 and 1024, k = 0 (one token
per request per step) and k = 3 (spec decoding, 3 drafts per request).
"""
import os
import pickle
import sys
import time
import types
from statistics import median

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import logging

logging.disable(logging.WARNING)

import numpy as np  # noqa: E402 (after VLLM_TARGET_DEVICE)
import torch  # noqa: E402 (after VLLM_TARGET_DEVICE)
from vllm.v1.core.sched.output import CachedRequestData  # noqa: E402 (after VLLM_TARGET_DEVICE)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402 (after VLLM_TARGET_DEVICE)
from vllm.v1.worker.gpu.async_utils import AsyncOutput  # noqa: E402 (after VLLM_TARGET_DEVICE)
from vllm.v1.worker.gpu.block_table import BlockTables  # noqa: E402 (after VLLM_TARGET_DEVICE)
from vllm.v1.worker.gpu.buffer_utils import StagedWriteTensor  # noqa: E402 (after VLLM_TARGET_DEVICE)
from vllm.v1.worker.gpu.model_runner import GPUModelRunner, sort_batch_req_ids  # noqa: E402 (after VLLM_TARGET_DEVICE)
from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler  # noqa: E402 (after VLLM_TARGET_DEVICE)

NS = types.SimpleNamespace
RNG = np.random.default_rng(0)
MAX_REQS = 1024


def timeit(fn, setup=None, reps=None):
    """Median over `reps` single calls (setup runs outside the timer)."""
    reps = int(os.environ.get("REPS", 1000)) if reps is None else reps
    ts = []
    for i in range(reps + 20):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if i >= 20:
            ts.append(t1 - t0)
    return median(ts) * 1e6


def req_ids(n):
    return [f"chatcmpl-{i:032x}-{i % 7}" for i in range(n)]  # vLLM-like ids


# --------------------------------------------------------------------------
def bench_get_output(n, k):
    """async_utils.py AsyncOutput.get_output: real method, stub copy_event."""
    ids = req_ids(n)
    width = k + 1
    sampled = RNG.integers(0, 150_000, size=(n, width), dtype=np.int64)
    if k == 0:
        num = np.ones(n, dtype=np.int32)
    else:  # 1 bonus + accepted drafts: 1..k+1
        num = RNG.integers(1, width + 1, size=n, dtype=np.int32)
    ao = object.__new__(AsyncOutput)
    ao.copy_event = NS(synchronize=lambda: None)
    ao.sampled_token_ids = sampled
    ao.num_sampled_tokens_np = num
    ao.sampling_mask_tensors = None
    ao.num_nans = None
    ao.logprobs_tensors = None
    ao.prompt_logprobs_dict = {}
    ao.prompt_token_id_logprobs_dict = {}
    ao.pending_aux_output = None
    ao._has_fault = None
    ao.model_runner_output = ModelRunnerOutput(req_ids=ids, sampled_token_ids=None)
    whole = timeit(ao.get_output)
    t_tolist = timeit(lambda: (sampled.tolist(), num.tolist()))

    def loop_only_setup():
        global _L
        _L = (sampled.tolist(), num.tolist())

    def loop_only():
        for token_ids, num_tokens in zip(*_L, strict=False):
            del token_ids[num_tokens:]

    t_loop = timeit(loop_only, loop_only_setup)
    return f"whole {whole:7.1f}  (.tolist() x2 {t_tolist:6.1f}, del-loop {t_loop:6.1f})"


# --------------------------------------------------------------------------
def _fake_block_tables():
    swt = object.__new__(StagedWriteTensor)
    swt.gpu = torch.empty((MAX_REQS, 256), dtype=torch.int32)
    swt._typecode = "i"
    swt._staged_write_indices, swt._staged_write_starts = [], []
    swt._staged_write_cu_lens, swt._staged_write_chunks = [], []
    import array

    swt._staged_write_contents = array.array("i")
    swt._staged_write_max_len = 0
    swt._staged_write_len = 0
    bt = object.__new__(BlockTables)
    bt.num_kv_cache_groups = 1
    bt.num_blocks = NS(np=np.zeros((1, MAX_REQS), dtype=np.int32))
    bt.redirect_writes_to_null_block = False
    bt.block_tables = [swt]
    return bt, swt


def bench_update_requests(n, k):
    """model_runner.py GPUModelRunner.update_requests: real method.
    Decode step: one new KV block for 1/16 of requests (k=0) or 4/16 (k=3),
    block size 16."""
    ids = req_ids(n)
    slots = RNG.permutation(MAX_REQS)[:n]
    rs = NS(
        req_id_to_index=dict(zip(ids, slots.tolist(), strict=False)),
        num_computed_tokens_np=np.zeros(MAX_REQS, dtype=np.int32),
        prefill_len=NS(np=np.full(MAX_REQS, 512, dtype=np.int32)),
        num_computed_prefill_tokens=np.zeros(MAX_REQS, dtype=np.int32),
    )
    bt, swt = _fake_block_tables()
    rate = (k + 1) / 16
    new_blocks = [([int(x)],) if RNG.random() < rate else None
                  for x in RNG.integers(0, 60000, n)]
    cached = CachedRequestData(
        req_ids=ids,
        new_token_ids=[[] for _ in ids],
        new_block_ids=new_blocks,
        num_computed_tokens=RNG.integers(600, 2000, n).tolist(),
        num_output_tokens=RNG.integers(1, 1000, n).tolist(),
    )
    so = NS(scheduled_cached_reqs=cached, new_block_ids_to_zero=None,
            kv_cache_block_copies=None)
    me = NS(req_states=rs, block_tables=bt, kv_block_zeroer=None)
    def setup():  # what apply_staged_writes / the next step would reset
        swt.clear_staged_writes()
        bt.num_blocks.np[:] = 40

    t = timeit(lambda: GPUModelRunner.update_requests(me, so), setup)
    return f"{t:7.1f}  ({sum(b is not None for b in new_blocks)} requests with a new block)"


# --------------------------------------------------------------------------
def _gather_inputs(n, k):
    ids = req_ids(n)
    slots = RNG.permutation(MAX_REQS)[:n]
    rs = NS(
        req_id_to_index=dict(zip(ids, slots.tolist(), strict=False)),
        prefill_len=NS(np=np.full(MAX_REQS, 512, dtype=np.int32)),
        num_computed_prefill_tokens=np.full(MAX_REQS, 512, dtype=np.int32),
        max_seq_len=np.full(MAX_REQS, 4096, dtype=np.int32),
    )
    me = NS(req_states=rs, decode_query_len=k + 1, use_pp=False,
            adaptive_verification=None, pcp_manager=None)
    nst = {r: k + 1 for r in ids}
    drafts = {r: [-1] * k for r in ids} if k else {}
    so = NS(num_scheduled_tokens=nst, total_num_scheduled_tokens=n * (k + 1),
            scheduled_spec_decode_tokens=drafts)
    return me, so, nst, drafts


def bench_gather(n, k):
    """model_runner.py GPUModelRunner.gather_batch_req_state: real method
    (plus execute_model's own max(num_scheduled_tokens.values()))."""
    me, so, nst, drafts = _gather_inputs(n, k)

    def whole():
        max(so.num_scheduled_tokens.values())
        GPUModelRunner.gather_batch_req_state(me, so, False)

    t = timeit(whole)
    t_sort = timeit(lambda: sort_batch_req_ids(nst, drafts, k + 1))
    return f"whole {t:7.1f}  (sort_batch_req_ids {t_sort:6.1f})"


# --------------------------------------------------------------------------
def bench_set_draft_tokens(n, k):
    """spec_decode/utils.py DraftTokensHandler.set_draft_tokens: real method,
    no structured output (the default branch: one dict store per request)."""
    if k == 0:
        return "n/a (only with spec decoding)"
    ids = req_ids(n)
    h = object.__new__(DraftTokensHandler)
    h._draft_tokens_by_req = {r: k for r in ids}
    ib = NS(has_structured_output_reqs=False, req_ids=ids)
    dt = torch.zeros((n, k), dtype=torch.int64)
    return f"{timeit(lambda: h.set_draft_tokens(ib, dt)):7.1f}"


def bench_get_draft_tokens(n, k):
    """spec_decode/utils.py DraftTokensHandler.get_draft_tokens: real method.
    Called by EngineCore.post_step only with spec decoding and async
    scheduling OFF (or for a deferred grammar bitmask)."""
    if k == 0:
        return "n/a (only with spec decoding)"
    ids = req_ids(n)
    h = object.__new__(DraftTokensHandler)
    h._draft_tokens_by_req = {r: k for r in ids}
    h._copy_pending = False
    h._deferred_req_ids = None
    return f"{timeit(h.get_draft_tokens):7.1f}"


# --------------------------------------------------------------------------
def bench_pickle_output(n, k):
    """Not the runner: the worker->EngineCore message with worker processes
    (MultiprocExecutor pickles ModelRunnerOutput; approximated by pickle 5)."""
    ids = req_ids(n)
    width = k + 1
    toks = [RNG.integers(0, 150_000, RNG.integers(1, width + 1) if k else 1).tolist()
            for _ in ids]
    mro = ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks)
    d = timeit(lambda: pickle.dumps(mro, protocol=5))
    blob = pickle.dumps(mro, protocol=5)
    loaded = timeit(lambda: pickle.loads(blob))
    return f"dumps {d:6.1f} + loads {loaded:6.1f}  ({len(blob)} bytes)"


def bench_lora(n, k):
    """lora_utils.py get_num_active_loras_for_dispatch + LoraState.make_lora_inputs
    (real LoraState; LoRA enabled, every request with one of 4 adapters).
    Only with --enable-lora; what _set_active_loras does next is not timed."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.worker.gpu.lora_utils import LoraState, get_num_active_loras_for_dispatch
    ids = req_ids(n)
    ls = LoraState(MAX_REQS)
    loras = [LoRARequest(f"a{i}", i + 1, f"/x/a{i}") for i in range(4)]
    slots = RNG.permutation(MAX_REQS)[:n]
    for r, s_ in zip(ids, slots, strict=False):
        ls.add_request(r, int(s_), loras[int(s_) % 4])
    nst = np.full(n, k + 1, dtype=np.int32)
    cfg = NS(max_loras=4)

    def step():
        get_num_active_loras_for_dispatch(cfg, ls, list(ids), False)
        ls.make_lora_inputs(ids, slots, nst, nst)

    return f"{timeit(step):7.1f}"


def bench_grammar_mapping(n, k):
    """structured_outputs.py apply_grammar_bitmask: copy of its host part
    (dict over the whole batch + list over grammar rows); every request
    structured here. Runs only when some request in the batch has a grammar."""
    ids = req_ids(n)
    stride = k + 1

    def body():
        req_id_to_idx = {req_id: i for i, req_id in enumerate(ids)}
        mapping = [req_id_to_idx[req_id] * stride + position
                   for req_id in ids for position in range(stride)]
        torch.tensor(mapping, dtype=torch.int32, device="cpu")

    return f"{timeit(body):7.1f}"


BENCHES = {
    "lora": bench_lora,
    "grammar_mapping": bench_grammar_mapping,
    "get_output": bench_get_output,
    "update_requests": bench_update_requests,
    "gather": bench_gather,
    "set_draft_tokens": bench_set_draft_tokens,
    "get_draft_tokens": bench_get_draft_tokens,
    "pickle_output": bench_pickle_output,
}

if __name__ == "__main__":
    names = sys.argv[1:] or list(BENCHES)
    for name in names:
        for k in (0, 3):
            for n in (256, 1024):
                print(f"{name:17s} N={n:5d} k={k}: {BENCHES[name](n, k)} us", flush=True)
