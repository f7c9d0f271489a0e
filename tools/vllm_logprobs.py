"""Logprobs through real vLLM's engine, every setting in one batch; reports
every returned value exactly, as JSON.

    python tools/vllm_logprobs.py --model DIR --out result.json [--async-scheduling]

The logprobs exactness run of the end-to-end tests (tests/test_e2e.py): a
stock run and a ``FASTBATCH=1`` run must write the same report.  One ``LLM``
(in process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``max_logprobs=-1``,
the engine's seed 0), one ``generate`` of every request configuration below
at once, more requests than ``max_num_seqs`` (they join and leave
mid-flight):

- ``logprobs`` 0, 1, 5 and -1 (the whole vocabulary; few requests, a few
  tokens each), each with ``flat_logprobs`` off and on;
- greedy, and random sampling (temperature 1, the engine's seed: per-request
  seeds crash vLLM's CPU backend under async scheduling) with ``n`` 2 and 3;
- repetition, frequency and presence penalties; stop strings, picked from a
  greedy probe of the same prompts so that they really stop requests (with
  and without ``include_stop_str_in_output``), and a common one with ``n=3``
  and penalties; EOS allowed on some;
- ``prompt_logprobs``; ``detokenize=False`` (no decoded tokens); requests
  without logprobs in the same batches.

The report holds, per request and completion: the text, the token ids, the
finish and stop reasons, ``cumulative_logprob``, and every logprob entry as
``[token id, logprob, rank, decoded token]`` position by position, floats
written with ``float.hex`` (bit for bit); for ``FlatLogprobs`` also its raw
lists; the type names of what vLLM returned (a ``numpy`` float where vLLM
gives a ``float`` is a difference).  Also: how many decoded tokens needed
vLLM's U+FFFD correction (``decode_stats``), and fastbatch's ``status()``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

MAX_MODEL_LEN = 256
PROMPTS = [
    "Hello world", "The quick brown fox", "Once upon a time there was",
    "Async scheduling overlaps", "Numbers: 1 2 3", "Python, Rust, C",
    "A placeholder token id of", "The scheduler decides which requests",
    "Bad words are token sequences", "Repetition penalty", "This is a tiny model",
    "vLLM is written in", "The lazy dog", "Frequency penalty and presence penalty",
    "0 1 2 3 4 5 6 7 8 9", "The sampler must never produce",
]
REPLACEMENT = "\ufffd"


def _stop_string(text: str, length: int) -> str | None:
    """A piece of ``text`` of ``length`` printable characters (no U+FFFD, not
    all space), as late as possible in its first two thirds, or None."""
    for start in range(max(0, 2 * len(text) // 3 - length), -1, -1):
        piece = text[start:start + length]
        if (len(piece) == length and piece.strip() and REPLACEMENT not in piece
                and all(char.isprintable() for char in piece)):
            return piece
    return None


def _common_character(texts: list[str]) -> str:
    counts = Counter(char for text in texts for char in text
                     if char.isprintable() and not char.isspace() and char != REPLACEMENT)
    return counts.most_common(1)[0][0] if counts else " "


def _cases(probe: dict[str, str], vocab_size: int) -> list[tuple[str, str, dict]]:
    """(label, prompt, SamplingParams arguments) of every request."""
    cases: list[tuple[str, str, dict]] = []
    prompts = iter(PROMPTS * 8)
    full_vocab_tokens = 4 if vocab_size > 1024 else 6
    for flat in (False, True):
        tag = "flat" if flat else "list"
        for k in (0, 1, 5):
            cases += [
                (f"greedy-{k}-{tag}", next(prompts),
                 {"temperature": 0.0, "max_tokens": 18 + 3 * k, "ignore_eos": True}),
                (f"random-n2-{k}-{tag}", next(prompts),
                 {"temperature": 1.0, "n": 2, "max_tokens": 14 + k, "ignore_eos": k != 1}),
                (f"penalties-{k}-{tag}", next(prompts),
                 {"temperature": 0.8, "max_tokens": 24, "repetition_penalty": 1.3,
                  "frequency_penalty": 0.5, "presence_penalty": 0.2, "ignore_eos": True}),
            ]
            for _, _, params in cases[-3:]:
                params.update(logprobs=k, flat_logprobs=flat)
        # stop strings that a greedy probe of the same prompt says are hit
        for i, (prompt, text) in enumerate(list(probe.items())[:2]):
            stop = _stop_string(text, 2 + i)
            if stop is not None:
                cases.append((f"stop-{i}-{tag}", prompt, {
                    "temperature": 0.0, "max_tokens": 32, "stop": [stop],
                    "include_stop_str_in_output": i == 1, "logprobs": 5 - 4 * i,
                    "flat_logprobs": flat, "ignore_eos": True}))
        cases += [
            (f"stop-n3-penalties-{tag}", next(prompts), {
                "temperature": 1.0, "n": 3, "max_tokens": 30,
                "stop": [_common_character(list(probe.values()))],
                "repetition_penalty": 1.2, "frequency_penalty": 0.4, "logprobs": 1,
                "flat_logprobs": flat}),
            (f"full-vocab-{tag}", next(prompts), {
                "temperature": 0.0, "max_tokens": full_vocab_tokens, "logprobs": -1,
                "flat_logprobs": flat, "ignore_eos": True}),
            (f"prompt-logprobs-{tag}", next(prompts), {
                "temperature": 0.0, "max_tokens": 10, "logprobs": 1, "prompt_logprobs": 2,
                "flat_logprobs": flat, "ignore_eos": True}),
            (f"no-detokenize-{tag}", next(prompts), {
                "temperature": 0.0, "max_tokens": 12, "logprobs": 1, "detokenize": False,
                "flat_logprobs": flat, "ignore_eos": True}),
        ]
    cases += [
        ("full-vocab-random-n2-flat", next(prompts), {
            "temperature": 1.0, "n": 2, "max_tokens": full_vocab_tokens - 2, "logprobs": -1,
            "flat_logprobs": True, "ignore_eos": True}),
        ("plain", next(prompts), {"temperature": 0.0, "max_tokens": 20, "ignore_eos": True}),
        ("plain-random-penalties", next(prompts), {
            "temperature": 1.0, "n": 2, "max_tokens": 20, "repetition_penalty": 1.2}),
    ]
    return cases


def _hex(value) -> str | None:
    """A float bit for bit (``float.hex``); anything else as its repr."""
    if value is None:
        return None
    return value.hex() if isinstance(value, float) else repr(value)


def _logprobs(container, types: set[str]) -> dict | None:
    """Every entry of a sample or prompt logprobs container, in vLLM's order."""
    if container is None:
        return None
    positions = []
    for position in container:
        if position is None:  # the first prompt position
            positions.append(None)
            continue
        types.add(f"position:{type(position).__name__}")
        entries = []
        for token, entry in position.items():
            types.update((f"token:{type(token).__name__}", f"entry:{type(entry).__name__}",
                          f"logprob:{type(entry.logprob).__name__}",
                          f"rank:{type(entry.rank).__name__}",
                          f"decoded:{type(entry.decoded_token).__name__}"))
            entries.append([token, _hex(entry.logprob), entry.rank, entry.decoded_token])
        positions.append(entries)
    report: dict = {"container": type(container).__name__, "positions": positions}
    if hasattr(container, "start_indices"):  # FlatLogprobs: its own lists as they are
        report["flat"] = {
            "start_indices": list(container.start_indices),
            "end_indices": list(container.end_indices),
            "token_ids": list(container.token_ids),
            "logprobs": [_hex(value) for value in container.logprobs],
            "ranks": list(container.ranks),
            "decoded_tokens": list(container.decoded_tokens),
        }
    return report


def _decode_stats(tokenizer, requests: list[dict]) -> dict[str, int]:
    """How many returned entries (requests with logprobs 0 to 5) decode alone
    to a text ending in U+FFFD, and how many vLLM corrected (its decoded
    token is not the lone decode): the byte-level path."""
    stats = Counter()
    lone: dict[int, str] = {}
    for request in requests:
        if request["params"].get("logprobs", -1) == -1:
            continue
        for completion in request["outputs"]:
            for position in (completion["logprobs"] or {}).get("positions", []):
                for token, _, _, decoded in position:
                    if decoded is None:
                        continue
                    if token not in lone:
                        lone[token] = tokenizer.decode([token])
                    stats["entries"] += 1
                    stats["lone_ends_in_replacement"] += lone[token].endswith(REPLACEMENT)
                    stats["corrected"] += decoded != lone[token]
                    stats["empty"] += decoded == ""
    return dict(stats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    args = parser.parse_args()

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams

    import fastbatch.vllm_plugin

    llm = LLM(model=args.model, dtype="float32", max_model_len=MAX_MODEL_LEN,
              enforce_eager=True, max_num_seqs=args.max_num_seqs,
              kv_cache_memory_bytes=64 * 2**20, seed=0, max_logprobs=-1,
              async_scheduling=args.async_scheduling)
    tokenizer = llm.get_tokenizer()
    vocab_size = len(tokenizer)
    probe_prompts = PROMPTS[-2:]
    probe = {prompt: output.outputs[0].text for prompt, output in zip(
        probe_prompts, llm.generate(probe_prompts, SamplingParams(
            temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False), strict=True)}
    cases = _cases(probe, vocab_size)
    fastbatch.reset_stats()
    started = time.perf_counter()
    outputs = llm.generate([prompt for _, prompt, _ in cases],
                           [SamplingParams(**params) for _, _, params in cases], use_tqdm=False)
    generate_s = time.perf_counter() - started
    requests = []
    for (label, prompt, params), output in zip(cases, outputs, strict=True):
        types: set[str] = set()
        requests.append({
            "label": label, "prompt": prompt, "params": params,
            "prompt_token_ids": list(output.prompt_token_ids),
            "prompt_logprobs": _logprobs(output.prompt_logprobs, types),
            "outputs": [{
                "index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                "cumulative_logprob": _hex(c.cumulative_logprob),
                "logprobs": _logprobs(c.logprobs, types)} for c in output.outputs],
            "types": sorted(types),
        })
    report = {
        "vocab_size": vocab_size, "generate_s": generate_s, "probe": probe,
        "requests": requests, "decode_stats": _decode_stats(tokenizer, requests),
        "status": fastbatch.vllm_plugin.status(),
    }
    with open(args.out, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
