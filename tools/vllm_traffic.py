"""Mixed, randomized traffic through real vLLM's engine, step by step; reports
every request's outputs, as JSON.

    python tools/vllm_traffic.py --model DIR --out result.json --steps 300 --seed 0

The FASTBATCH_VERIFY soak of the end-to-end tests (tests/test_e2e.py): the
same seed gives the same traffic, so a run with ``FASTBATCH=1`` (and
``FASTBATCH_VERIFY=1``) must give exactly the outputs of a stock run.  In
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), through ``LLMEngine``'s
``add_request``/``step``/``abort_request``, greedy, with async scheduling
when asked:

- requests arrive at every step (0 to ``--max-arrivals`` of them), many
  sharing a prompt prefix (prefix caching: cache hits, and blocks filled and
  cached in the middle of a prompt), some long enough for chunked prefill
  (``max_num_batched_tokens`` is small);
- the KV cache is small, so that requests are preempted and resumed;
- some requests are aborted a few steps after they arrive;
- stops of every kind: ``max_tokens``, ``min_tokens`` with EOS allowed,
  stop token ids, EOS;
- repetition, presence and frequency penalties, logprobs (0, 1, 5), ``n=2``
  (temperature 1 with top-k 1: sampled, and still one answer).

The report has, per request id, its outputs' token ids, finish reasons,
cumulative logprobs and per-position logprobs (``[token, logprob, rank]``),
the engine steps taken, and fastbatch's ``status()`` of this process.
"""

from __future__ import annotations

import argparse
import json
import os
import random

MAX_MODEL_LEN = 256
PREFIXES = [
    "The scheduler decides which requests run in each step, and how many tokens each",
    "Once upon a time there was a tiny model that generated tokens on a CPU",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma"]


def _prompt(rng: random.Random) -> str:
    """A prompt that shares a prefix with others most of the time; now and
    then a long one, which the small token budget prefills in chunks."""
    words = rng.choices(WORDS, k=rng.randint(1, 6))
    if rng.random() < 0.15:
        words += rng.choices(WORDS, k=rng.randint(60, 120))
    prefix = rng.choice(PREFIXES) if rng.random() < 0.7 else ""
    return " ".join([prefix, *words]).strip()


def _params(rng: random.Random, vocab_size: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # now and then a long answer: it crosses blocks, and the KV cache runs out
    extra: dict = {"max_tokens": rng.randint(1, 48 if rng.random() < 0.8 else 160)}
    if rng.random() < 0.3:
        extra["repetition_penalty"] = rng.choice([1.1, 1.3])
    if rng.random() < 0.2:
        extra["presence_penalty"] = 0.5
        extra["frequency_penalty"] = 0.3
    if rng.random() < 0.35:
        extra["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.15:  # parallel sampling needs a temperature: top-k 1 keeps it exact
        extra.update(n=2, temperature=1.0, top_k=1)
    stop = rng.random()
    if stop < 0.2:  # EOS allowed, but not before min_tokens
        extra.update(ignore_eos=False, min_tokens=rng.randint(1, extra["max_tokens"]))
    elif stop < 0.35:
        extra.update(ignore_eos=True,
                     stop_token_ids=rng.sample(range(3, vocab_size), 3))
    elif stop < 0.5:
        extra["ignore_eos"] = False
    else:
        extra["ignore_eos"] = True
    extra.setdefault("temperature", 0.0)
    return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **extra)


def _logprobs(completion) -> list | None:
    if completion.logprobs is None:
        return None
    return [[[token, entry.logprob, entry.rank] for token, entry in position.items()]
            for position in completion.logprobs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300,
                        help="engine steps with arrivals; then the rest is drained")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-arrivals", type=int, default=3)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    parser.add_argument("--kv-cache-mb", type=int, default=2,
                        help="small: requests are preempted")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM

    import fastbatch.vllm_plugin

    llm = LLM(model=args.model, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True,
              max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=args.kv_cache_mb * 2**20,
              seed=0, async_scheduling=args.async_scheduling, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # in process
    preempt, preemptions = scheduler._preempt_request, [0]

    def counted_preempt(*call_args, **kwargs):
        preemptions[0] += 1
        return preempt(*call_args, **kwargs)

    scheduler._preempt_request = counted_preempt  # this instance only
    tokenizer = llm.get_tokenizer()
    vocab_size = len(tokenizer)
    rng = random.Random(args.seed)
    aborts: dict[int, list[str]] = {}
    results: dict[str, dict] = {}
    added = steps = 0
    fastbatch.reset_stats()
    while steps < args.steps or engine.has_unfinished_requests():
        if steps < args.steps:
            for _ in range(rng.randint(0, args.max_arrivals)):
                request_id = f"r{added}"
                added += 1
                params = _params(rng, vocab_size)
                prompt = tokenizer.encode(_prompt(rng))[:MAX_MODEL_LEN - params.max_tokens]
                engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
                if rng.random() < 0.08:
                    aborts.setdefault(steps + rng.randint(1, 6), []).append(request_id)
            if steps in aborts:
                engine.abort_request(aborts.pop(steps))
        for output in engine.step():
            results[output.request_id] = {
                "finished": output.finished,
                "outputs": [{"token_ids": list(c.token_ids), "finish_reason": c.finish_reason,
                             "stop_reason": c.stop_reason,
                             "cumulative_logprob": c.cumulative_logprob,
                             "logprobs": _logprobs(c)} for c in output.outputs]}
        steps += 1
    report = {"steps": steps, "requests": added, "results": results,
              "preemptions": preemptions[0], "status": fastbatch.vllm_plugin.status()}
    with open(args.out, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
