"""vLLM's real engine with a stand-in model (tests/standin_executor.py):
stock, ``FASTBATCH=1`` and ``FASTBATCH=1 FASTBATCH_VERIFY=1`` on the same
mixed traffic give the same outputs, on the vLLM installed (0.33.0 in
``tox -e vllm``, 0.34.0 in ``tox -e vllm34``).

In process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), through ``LLMEngine``'s
``add_request`` / ``step`` / ``abort_request``: arrivals at every step, many
sharing a prompt prefix (prefix caching), some long (chunked prefill, with a
small token budget), a KV cache small enough that requests are preempted,
aborts, stops of every kind (``max_tokens``, EOS, ``min_tokens``, stop token
ids, stop strings), logprobs 0, 1 and 5, ``n=2``; with async scheduling off
and on, and with spec decoding (the stand-in's drafter) both ways.

The pieces apply in this process through ``fastbatch.vllm_plugin.register()``
and go with ``revert()``, so stock and fastbatch runs alternate in one
process.  The stand-in's tokens depend on each request's history alone, so
the outputs are also the same across schedules: async against sync, spec
decoding against none (aborted requests aside).
"""

from __future__ import annotations

import functools
import math
import os
import random
import warnings

import pytest
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

import fastbatch
import standin_executor as standin
from fastbatch import registry, vllm_plugin

pytestmark = pytest.mark.vllm
standin.prepare_cpu_platform()

MAX_MODEL_LEN = 256
STEPS = 70
VOCAB = 512
PREFIXES = [[4 + (7 * i + j * 13) % (VOCAB - 4) for j in range(40)] for i in range(3)]
WORKLOADS = {
    "sync": dict(async_scheduling=False),
    "async": dict(async_scheduling=True),
    "spec-sync": dict(async_scheduling=False, spec=3),
    "spec-async": dict(async_scheduling=True, spec=3),
}
MODES = {"stock": {}, "fastbatch": {"FASTBATCH": "1"},
         "verify": {"FASTBATCH": "1", "FASTBATCH_VERIFY": "1"}}


def _prompt(rng: random.Random) -> list[int]:
    words = [rng.randrange(4, VOCAB) for _ in range(rng.randint(1, 8))]
    if rng.random() < 0.15:  # long: prefilled in chunks
        words += [rng.randrange(4, VOCAB) for _ in range(rng.randint(70, 140))]
    return (rng.choice(PREFIXES) if rng.random() < 0.7 else []) + words


def _params(rng: random.Random) -> SamplingParams:
    extra: dict = {"max_tokens": rng.randint(1, 32 if rng.random() < 0.8 else 96)}
    if rng.random() < 0.35:
        extra["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.12:
        extra.update(n=2, temperature=1.0, top_k=1)
    stop = rng.random()
    if stop < 0.2:
        extra.update(ignore_eos=False, min_tokens=rng.randint(1, extra["max_tokens"]))
    elif stop < 0.35:
        extra.update(ignore_eos=True, stop_token_ids=rng.sample(range(4, VOCAB), 8))
    elif stop < 0.45:
        extra.update(ignore_eos=True, stop=["e", "q"])
    elif stop < 0.6:
        extra["ignore_eos"] = False
    else:
        extra["ignore_eos"] = True
    extra.setdefault("temperature", 0.0)
    return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **extra)


def _logprobs(completion) -> list | None:
    if completion.logprobs is None:
        return None
    return [[(token, float.hex(entry.logprob), entry.rank, entry.decoded_token)
             for token, entry in position.items()] for position in completion.logprobs]


def traffic(engine, seed: int = 0, steps: int = STEPS) -> dict:
    """Mixed traffic, step by step; every request's completions, by index."""
    rng = random.Random(seed)
    scheduler = engine.engine_core.engine_core.scheduler
    preempt, preemptions = scheduler._preempt_request, [0]

    def counted_preempt(*args, **kwargs):
        preemptions[0] += 1
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counted_preempt  # this instance only
    results: dict[str, dict] = {}
    aborts: dict[int, list[str]] = {}
    aborted: set[str] = set()
    added = step = 0
    while step < steps or engine.has_unfinished_requests():
        if step < steps:
            for _ in range(rng.randint(0, 3)):
                request_id = f"r{added}"
                added += 1
                params = _params(rng)
                prompt = _prompt(rng)[:MAX_MODEL_LEN - params.max_tokens]
                engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
                if rng.random() < 0.06:
                    aborts.setdefault(step + rng.randint(1, 6), []).append(request_id)
            if step in aborts:
                aborted.update(aborts[step])
                engine.abort_request(aborts.pop(step))
        for output in engine.step():
            entry = results.setdefault(output.request_id, {})
            for completion in output.outputs:
                entry[completion.index] = {
                    "token_ids": list(completion.token_ids), "text": completion.text,
                    "finish_reason": completion.finish_reason,
                    "stop_reason": completion.stop_reason,
                    "cumulative_logprob": (None if completion.cumulative_logprob is None
                                           else float.hex(completion.cumulative_logprob)),
                    "logprobs": _logprobs(completion)}
        step += 1
    return {"results": results, "steps": step, "requests": added, "aborted": aborted,
            "preemptions": preemptions[0]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return standin.make_model_dir(tmp_path_factory.mktemp("standin-model"), VOCAB)


def _engine(model, workload: str, executor=None):
    from vllm.v1.engine.llm_engine import LLMEngine

    settings = dict(WORKLOADS[workload])
    spec = settings.pop("spec", 0)
    extra = {}
    if spec:
        # Any method that needs no weights of its own: the stand-in drafts.
        # (vLLM 0.33.0's V1 runner refuses ngram with async scheduling.)
        extra["speculative_config"] = (
            {"method": "ngram", "num_speculative_tokens": spec, "prompt_lookup_max": 3,
             "prompt_lookup_min": 2} if not settings["async_scheduling"] else
            {"method": "draft_model", "model": str(model), "num_speculative_tokens": spec})
    args = standin.engine_args(
        model, executor or standin.make_executor(), max_model_len=MAX_MODEL_LEN,
        max_num_seqs=16, max_num_batched_tokens=64,
        # 40 blocks of 16 tokens (24 with spec decoding, whose requests finish
        # sooner): preemption
        kv_cache_memory_bytes=(24 if spec else 40) * 16 * 64 * 2 * 2,
        **settings, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = LLMEngine.from_engine_args(args)
    config = engine.vllm_config
    assert config.scheduler_config.async_scheduling == settings["async_scheduling"]
    assert bool(config.speculative_config) == bool(spec)
    return engine


@pytest.fixture(scope="module")
def run(model, tmp_path_factory):
    """``run(workload, mode)``: the traffic's report, fastbatch's status and
    counters; the pieces installed for the run alone."""
    verify_dir = tmp_path_factory.mktemp("verify")

    @functools.cache
    def run(workload: str, mode: str) -> dict:
        saved = {name: os.environ.get(name) for name in
                 ("FASTBATCH", "FASTBATCH_VERIFY", "FASTBATCH_VERIFY_DIR",
                  "VLLM_ENABLE_V1_MULTIPROCESSING")}
        os.environ.update(MODES[mode], FASTBATCH_VERIFY_DIR=str(verify_dir),
                          VLLM_ENABLE_V1_MULTIPROCESSING="0")
        vllm_plugin.revert()
        try:
            vllm_plugin.register()
            fastbatch.reset_stats()
            engine = _engine(model, workload)
            report = traffic(engine)
            executor = engine.engine_core.engine_core.model_executor
            report["worker"] = {"proposed": executor.worker.proposed,
                                "accepted": executor.worker.accepted}
            report["status"] = vllm_plugin.status()
            engine.engine_core.shutdown()
            return report
        finally:
            vllm_plugin.revert()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    return run


def _would_act() -> list[str]:
    """The pieces ``python -m fastbatch`` says would act here and that act in
    EngineCore or the output processor (not the worker's model runner, which
    the stand-in replaces, nor the API server's)."""
    from fastbatch.__main__ import _piece_lines

    absent = vllm_plugin.without_target()
    names = []
    for piece in registry.pieces():
        if piece.name in absent or not piece.main.acts_under_v2:
            continue
        if any(target.startswith("vllm.entrypoints.") for target in piece.targets):
            continue
        acts, _ = _piece_lines(piece, fastbatch.COMPILED, set())
        if acts:
            names.append(piece.name)
    return names


def _work(counters: dict) -> int:
    """What a piece's counters say it did itself (not what it handed to vLLM)."""
    return sum(value for name, value in counters.items()
               if not name.startswith("stock") and name not in ("handed_over", "skipped"))


@pytest.mark.parametrize("workload", WORKLOADS)
def test_fastbatch_gives_stock_outputs(run, workload):
    stock = run(workload, "stock")
    assert stock["preemptions"] > 0, "the KV cache should be small enough to preempt"
    assert stock["requests"] > 80
    for mode in ("fastbatch", "verify"):
        report = run(workload, mode)
        assert report["results"] == stock["results"], mode
        assert report["steps"] == stock["steps"], mode
        assert report["preemptions"] == stock["preemptions"], mode
        assert report["worker"] == stock["worker"], mode
        verify = report["status"]["verify"]
        assert not any(verify["divergences"].values()), verify["divergences"]
    if WORKLOADS[workload].get("spec"):
        worker = stock["worker"]
        assert 0 < worker["accepted"] < worker["proposed"]


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_pieces_that_would_act_took_work(run, workload):
    """Every piece ``python -m fastbatch`` says would act here (in EngineCore
    or the output processor) took requests; with FASTBATCH_VERIFY every call
    of them was checked."""
    acting = _would_act()
    assert acting, "no piece would act on this vLLM"
    fast = run(workload, "fastbatch")["status"]
    assert {name for name, on in fast["patches"].items() if on} >= set(acting)
    idle = {name: fast["stats"][name] for name in acting if not _work(fast["stats"][name])}
    assert not idle, f"installed but took no work: {idle}"
    checked = run(workload, "verify")["status"]["verify"]["checked"]
    assert all(checked[name] for name in acting if run(workload, "verify")["status"]
               ["verify"]["rate"]), checked
    stock = run(workload, "stock")["status"]
    assert not stock["installed"]
    assert not any(_work(counters) for counters in stock["stats"].values())


def test_outputs_do_not_depend_on_the_schedule(run):
    """The stand-in's oracle: every schedule gives the same tokens (requests
    aborted part-way aside)."""
    base = run("sync", "stock")
    for workload in ("async", "spec-sync", "spec-async"):
        other = run(workload, "stock")
        aborted = base["aborted"] | other["aborted"]
        tokens = {request: {i: c["token_ids"] for i, c in completions.items()}
                  for request, completions in base["results"].items() if request not in aborted}
        theirs = {request: {i: c["token_ids"] for i, c in completions.items()}
                  for request, completions in other["results"].items()
                  if request not in aborted}
        assert theirs == tokens, workload


def test_a_planted_bug_is_seen(model, run, tmp_path, monkeypatch):
    """A wrong cumulative logprob planted in ``update_sample_logprobs`` once a
    request has more than 20 positions: without FASTBATCH_VERIFY the outputs
    differ from stock's; with it, the shadow check reports divergences and the
    outputs are stock's."""
    if "update_sample_logprobs" not in _would_act():
        pytest.skip("update_sample_logprobs does not act on this vLLM")
    from fastbatch.patches.update_sample_logprobs import PATCH

    real = PATCH.replacement

    def planted(self, logprobs_lists):
        result = real(self, logprobs_lists)
        if len(self.logprobs) > 20:
            self.cumulative_logprob += 1.0
        return result

    monkeypatch.setattr(PATCH, "replacement", planted)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    stock = run("sync", "stock")["results"]
    outcomes = {}
    for verify in ("0", "1"):
        monkeypatch.setenv("FASTBATCH", "1")
        monkeypatch.setenv("FASTBATCH_VERIFY", verify)
        vllm_plugin.revert()
        try:
            vllm_plugin.register()
            engine = _engine(model, "sync")
            outcomes[verify] = (traffic(engine)["results"], vllm_plugin.status()["verify"])
            engine.engine_core.shutdown()
        finally:
            vllm_plugin.revert()
    unchecked, _ = outcomes["0"]
    assert unchecked != stock
    differing = [request for request in stock if unchecked.get(request) != stock[request]]
    assert all(math.isfinite(float.fromhex(c["cumulative_logprob"]))
               for request in differing for c in unchecked[request].values())
    checked, verify = outcomes["1"]
    assert checked == stock
    assert verify["divergences"]["update_sample_logprobs"] >= 1
