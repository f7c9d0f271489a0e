"""The incremental detokenizer of long outputs: vLLM's ``update`` against fastbatch's.

    tox -e bench-detokenizer
    python benchmarks/detokenizer.py --out results   # env with vLLM

vLLM's ``FastIncrementalDetokenizer`` (the one every ``tokenizers`` tokenizer
gets) appends each token's text with ``self.output_text += text``, which
copies the request's whole text: its cost grows with the output's length.
Here ``--requests`` detokenizers of the tiny model's ``--vocab``-token
tokenizer (default 4096: a BPE trained on English text, tools/tiny_model.py),
each fed real English text one token an update as the output processor feeds
it, are grown to each ``--lengths`` output length; then ``--timed`` more
updates of every request are timed, through vLLM's method
(``BaseIncrementalDetokenizer.update``) and through fastbatch's
(``detokenizer_update``), in alternating rounds (``--rounds`` each way, each
on fresh detokenizers).  Reported: microseconds per update, medians (and
min-max) over the rounds, and ``DecodeStream.step`` alone at that length
for scale.  The two sides' texts and token ids must be identical, or the
script exits non-zero.  Writes OUT/detokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
TOOLS = Path(__file__).resolve().parent.parent / "tools"


def tokenizer_and_ids(vocab: int, count: int) -> tuple[object, list[int]]:
    """vLLM's wrapping of the tiny model's tokenizer, and ``count`` token ids
    of real English text (the text repeated as needed)."""
    sys.path.insert(0, str(TOOLS))
    import tiny_model
    from transformers import AutoTokenizer
    from vllm.tokenizers.hf import get_cached_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        tiny_model._make_tokenizer(scratch, vocab)
        tokenizer = get_cached_tokenizer(AutoTokenizer.from_pretrained(scratch))
    ids = tokenizer.encode("\n".join(tiny_model.real_text()), add_special_tokens=False)
    return tokenizer, (ids * (count // len(ids) + 1))[:count]


def detokenizers(tokenizer: object, requests: int) -> list:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    return [IncrementalDetokenizer.from_new_request(tokenizer, EngineCoreRequest(
        request_id=str(i), prompt_token_ids=[1, 2, 3], mm_features=None,
        sampling_params=SamplingParams(max_tokens=1 << 20), pooling_params=None,
        arrival_time=0.0, lora_request=None, cache_salt=None, data_parallel_rank=None))
        for i in range(requests)]


def one_round(update: object, tokenizer: object, ids: list[int], requests: int, length: int,
              timed: int) -> tuple[float, float, list]:
    """Fresh detokenizers grown to ``length`` tokens through ``update``, then
    ``timed`` updates each: (us per update, us per DecodeStream.step alone,
    the final states)."""
    states = detokenizers(tokenizer, requests)
    streams = [ids[(97 * i) % 1000:] for i in range(requests)]
    for step in range(length):
        for detokenizer, stream in zip(states, streams, strict=True):
            update(detokenizer, [stream[step]], False)
    started = time.perf_counter()
    for step in range(length, length + timed):
        for detokenizer, stream in zip(states, streams, strict=True):
            update(detokenizer, [stream[step]], False)
    per_update = (time.perf_counter() - started) / (timed * requests) * 1e6
    started = time.perf_counter()
    for step in range(length + timed, length + 2 * timed):
        for detokenizer, stream in zip(states, streams, strict=True):
            detokenizer.stream.step(detokenizer.tokenizer, stream[step])
    per_step = (time.perf_counter() - started) / (timed * requests) * 1e6
    return per_update, per_step, [(d.token_ids, d.output_text) for d in states]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 2048, 8192, 32768])
    parser.add_argument("--timed", type=int, default=256, help="updates timed per request")
    parser.add_argument("--rounds", type=int, default=5, help="rounds each way (default 5)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()

    import vllm

    from fastbatch import registry
    from fastbatch.patches import detokenizer_update

    piece = registry.piece("detokenizer_update")
    if not piece.apply():
        sys.exit("fastbatch's detokenizer_update could not be applied to this vLLM")
    sides = {"stock": piece.main.original(), "fastbatch": detokenizer_update.update}
    tokenizer, ids = tokenizer_and_ids(args.vocab, max(args.lengths) + 2 * args.timed + 1000)
    results = []
    for length in args.lengths:
        times: dict[str, list[float]] = {side: [] for side in sides}
        steps: list[float] = []
        finals = {}
        for _ in range(args.rounds):
            for side, update in sides.items():
                per_update, per_step, final = one_round(update, tokenizer, ids, args.requests,
                                                        length, args.timed)
                times[side].append(per_update)
                steps.append(per_step)
                finals.setdefault(side, final)
        if finals["fastbatch"] != finals["stock"]:
            sys.exit(f"texts or token ids differ at length {length}")
        row = {"length": length, "characters": len(finals["stock"][0][1]),
               "step_us": statistics.median(steps)}
        for side, values in times.items():
            row[side] = {"median_us": statistics.median(values), "min_us": min(values),
                         "max_us": max(values)}
        row["speedup"] = row["stock"]["median_us"] / row["fastbatch"]["median_us"]
        results.append(row)
        print(f"{length:>6} tokens ({row['characters']:>7} chars): stock "
              f"{row['stock']['median_us']:6.2f} us, fastbatch "
              f"{row['fastbatch']['median_us']:6.2f} us ({row['speedup']:.1f}x); "
              f"DecodeStream.step {row['step_us']:.2f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"vllm": vllm.__version__, "vocab": args.vocab, "requests": args.requests,
              "timed": args.timed, "rounds": args.rounds, "results": results}
    (args.out / "detokenizer.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
