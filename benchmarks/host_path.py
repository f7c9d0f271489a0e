"""The host path as a GPU user meets it: vLLM's real engine with a stand-in
model (tests/standin_executor.py), stock against ``FASTBATCH=1``.

    python benchmarks/host_path.py [--concurrency 256 1024] [--tokens 64]
        [--workloads plain logprobs spec] [--forward-ms 0 10] [--repeats 3]
        [--tokenizer byte bpe] [--out results]

In process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), async scheduling on,
``OMP_NUM_THREADS=1``.  Each measurement builds an engine, warms it, then
runs ``concurrency`` requests at once (distinct 32-token prompts, greedy,
``ignore_eos``, ``--tokens`` output tokens each: the batch stays full to the
end) through ``LLMEngine.add_request`` / ``step``.  The tokenizer
(``--tokenizer``): ``byte``, the stand-in's 512-token byte-level one (many
sampled tokens are lone bytes, whose texts vLLM corrects), or ``bpe``, a BPE
of up to 32,000 tokens trained at the start on real English text (the
standard library's docstrings and comments: 23,955 tokens; see
``tools/tiny_model.py``).  Stock and ``FASTBATCH=1``
alternate (``fastbatch.vllm_plugin.register()`` / ``revert()`` in this
process), ``--repeats`` times each; the table gives medians.

Reported per cell:

- output tokens/s (wall time of the generation);
- host CPU in µs per request-step (a request-step: one request in one
  engine step), by stage, on the engine thread's CPU clock
  (``time.thread_time``: time waiting for a core is not counted):
  ``schedule`` (``Scheduler.schedule``), ``update`` (``update_from_output``),
  ``core other`` (the rest of EngineCore's step function), ``output``
  (``OutputProcessor.process_outputs``), ``engine other`` (the rest of
  ``LLMEngine.step``), and their sum ``host``; the stand-in model's own CPU
  and the simulated GPU's busy-wait are left out (``standin`` reports the
  former);
- with a simulated forward time (``--forward-ms``): the share of wall time the
  simulated GPU waits for the host, and the host time added per step on top
  of the forward time.

Outputs of stock and ``FASTBATCH=1`` are compared in every cell (token ids,
and logprobs where asked); a difference fails the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tools")]

PROMPT_LEN = 32
SPEC_TOKENS = 3
WORKLOADS = ("plain", "logprobs", "spec")
# The vocabulary asked of the tokenizer (``standin_executor.make_model_dir``).
TOKENIZERS = {"byte": 512, "bpe": 32000}


def _params(workload: str, tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0,
                          logprobs=1 if workload == "logprobs" else None,
                          output_kind=RequestOutputKind.FINAL_ONLY)


def _engine(model: Path, workload: str, concurrency: int, tokens: int, forward_s: float):
    from vllm.v1.engine.llm_engine import LLMEngine

    import standin_executor as standin

    extra = {}
    if workload == "spec":
        extra["speculative_config"] = {"method": "ngram",
                                       "num_speculative_tokens": SPEC_TOKENS,
                                       "prompt_lookup_max": 3, "prompt_lookup_min": 2}
        import vllm

        if vllm.__version__.startswith("0.33"):  # V1 refuses ngram with async
            extra["speculative_config"] = {"method": "draft_model", "model": str(model),
                                           "num_speculative_tokens": SPEC_TOKENS}
    blocks = concurrency * ((PROMPT_LEN + tokens + SPEC_TOKENS + 2) // 16 + 2) + 64
    executor = standin.make_executor(forward_s=forward_s, eos_period=0, kv_blocks=blocks)
    args = standin.engine_args(
        model, executor, max_model_len=PROMPT_LEN + tokens + 16, max_num_seqs=concurrency,
        max_num_batched_tokens=max(8192, concurrency * (1 + SPEC_TOKENS)),
        async_scheduling=True, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = LLMEngine.from_engine_args(args)
    assert engine.vllm_config.scheduler_config.async_scheduling
    return engine


def _generate(engine, prompts: list[list[int]], params, tag: str) -> dict:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            logprobs = None
            if completion.logprobs is not None:
                logprobs = [[(token, entry.logprob, entry.rank) for token, entry
                             in position.items()] for position in completion.logprobs]
            outputs[output.request_id] = (list(completion.token_ids), logprobs)
    return outputs


def measure(model: Path, workload: str, concurrency: int, tokens: int, forward_ms: float,
            fast: bool) -> dict:
    from function_timers import FunctionTimers

    import fastbatch
    import standin_executor as standin
    from fastbatch import vllm_plugin

    standin.prepare_cpu_platform()
    saved = os.environ.get("FASTBATCH")
    os.environ["FASTBATCH"] = "1" if fast else "0"
    vllm_plugin.revert()
    vllm_plugin.register()
    fastbatch.reset_stats()
    try:
        engine = _engine(model, workload, concurrency, tokens, forward_ms / 1000)
        params = _params(workload, tokens)
        import random

        rng = random.Random(concurrency)
        prompts = [[rng.randrange(4, 500) for _ in range(PROMPT_LEN)]
                   for _ in range(concurrency)]
        _generate(engine, prompts[: min(64, concurrency)], _params(workload, 8), "warm")
        core = engine.engine_core.engine_core
        executor = core.model_executor
        worker = executor.worker
        timers = FunctionTimers({}, {"core step": "step_fn"}, root=core, clock=time.thread_time)
        timers.time_late_bound("schedule", core.scheduler, "schedule")
        timers.time_late_bound("update", core.scheduler, "update_from_output")
        timers.time_late_bound("output", engine.output_processor, "process_outputs")
        timers.time_late_bound("engine step", engine, "step")
        timers.reset()
        standin_before, spin_before = worker.cpu_s, executor.gpu.spin_cpu_s
        request_steps = _RequestSteps(worker)
        gpu_before = (executor.gpu.busy_s, executor.gpu.waited_s, executor.gpu.steps)
        gc.collect()
        wall_start, cpu_start = time.perf_counter(), time.thread_time()
        outputs = _generate(engine, prompts, params, "r")
        wall, cpu = time.perf_counter() - wall_start, time.thread_time() - cpu_start
        report = timers.report()
        timers.collections.remove()
        seconds = {label: row["seconds"] for label, row in report.items()}
        standin_cpu = worker.cpu_s - standin_before
        spin_cpu = executor.gpu.spin_cpu_s - spin_before
        steps = request_steps.total()
        generated = sum(len(ids) for ids, _ in outputs.values())
        stages = {
            "schedule": seconds["schedule"],
            "update": seconds["update"],
            "core other": seconds["core step"] - seconds["schedule"] - seconds["update"]
            - standin_cpu - spin_cpu,
            "output": seconds["output"],
            "engine other": seconds["engine step"] - seconds["core step"] - seconds["output"],
        }
        busy = executor.gpu.busy_s - gpu_before[0]
        waited = executor.gpu.waited_s - gpu_before[1]
        gpu_steps = executor.gpu.steps - gpu_before[2]
        result = {
            "tokens_per_s": generated / wall, "wall_s": wall, "generated": generated,
            "request_steps": steps, "engine_steps": report["core step"]["calls"],
            "us_per_request_step": {k: 1e6 * v / steps for k, v in stages.items()},
            "host_us_per_request_step": 1e6 * sum(stages.values()) / steps,
            "thread_cpu_s": cpu, "standin_us_per_request_step": 1e6 * standin_cpu / steps,
            "spin_cpu_s": spin_cpu,
            "gc_s": seconds.get("garbage collection", 0.0),
            "stats": fastbatch.stats(),
            "outputs": outputs,
        }
        if forward_ms:
            result["gpu_wait_share"] = waited / (busy + waited) if busy + waited else 0.0
            result["host_ms_over_forward_per_step"] = (
                1000 * (wall / gpu_steps - forward_ms / 1000) if gpu_steps else 0.0)
        engine.engine_core.shutdown()
        del engine
        gc.collect()
        return result
    finally:
        vllm_plugin.revert()
        if saved is None:
            os.environ.pop("FASTBATCH", None)
        else:
            os.environ["FASTBATCH"] = saved


class _RequestSteps:
    """Requests per engine step, summed: counted on the stand-in's steps."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.start = worker.request_steps

    def total(self) -> int:
        return self.worker.request_steps - self.start


def _median(values):
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--forward-ms", type=float, nargs="+", default=[0.0, 10.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizer", default="byte", choices=TOKENIZERS,
                        help="byte: the 512-token byte-level one; bpe: a 32,000-token BPE "
                             "trained on real text")
    parser.add_argument("--out", default=None, help="folder for host_path.json and .md")
    args = parser.parse_args()

    import standin_executor as standin

    standin.prepare_cpu_platform()
    import vllm

    scratch = tempfile.mkdtemp(prefix="host-path-")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = standin.make_model_dir(Path(scratch) / "model", TOKENIZERS[args.tokenizer])
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    cells = []
    failed = False
    for forward_ms in args.forward_ms:
        for workload in args.workloads:
            for concurrency in args.concurrency:
                runs: dict[str, list[dict]] = {"stock": [], "fastbatch": []}
                for _ in range(args.repeats):
                    for name in ("stock", "fastbatch"):
                        runs[name].append(measure(model, workload, concurrency, args.tokens,
                                                  forward_ms, name == "fastbatch"))
                same = all(run["outputs"] == runs["stock"][0]["outputs"]
                           for name in runs for run in runs[name])
                failed |= not same
                cell = {"workload": workload, "concurrency": concurrency,
                        "forward_ms": forward_ms, "identical": same}
                for name, rows in runs.items():
                    cell[name] = {
                        "tokens_per_s": _median([r["tokens_per_s"] for r in rows]),
                        "host_us": _median([r["host_us_per_request_step"] for r in rows]),
                        "stages_us": {k: _median([r["us_per_request_step"][k] for r in rows])
                                      for k in rows[0]["us_per_request_step"]},
                        "standin_us": _median([r["standin_us_per_request_step"]
                                               for r in rows]),
                        "gpu_wait_share": _median([r.get("gpu_wait_share", 0.0)
                                                   for r in rows]),
                        "host_ms_over_forward": _median(
                            [r.get("host_ms_over_forward_per_step", 0.0) for r in rows]),
                        "engine_steps": _median([r["engine_steps"] for r in rows]),
                        "runs": [{k: v for k, v in r.items() if k != "outputs"}
                                 for r in rows],
                    }
                cells.append(cell)
                print(_row(cell), flush=True)
    table = _table(cells, args, vllm.__version__, vocab)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "host_path.json").write_text(json.dumps(
            {"vllm": vllm.__version__, "machine": platform.processor() or platform.machine(),
             "args": vars(args), "vocab": vocab, "cells": cells}, indent=1))
        (out / "host_path.md").write_text(table)
    if failed:
        sys.exit("outputs differ between stock and FASTBATCH=1")


HEADER = ("| workload | requests | fwd ms | tok/s stock / fb (x) | host µs/req-step stock / fb "
          "(x) | schedule | update | core other | output | GPU waits (stock / fb) |")


def _row(cell: dict) -> str:
    s, f = cell["stock"], cell["fastbatch"]
    stages = " | ".join(f"{s['stages_us'][k]:.1f} / {f['stages_us'][k]:.1f}"
                        for k in ("schedule", "update", "core other", "output"))
    wait = (f"{100 * s['gpu_wait_share']:.0f} % / {100 * f['gpu_wait_share']:.0f} %"
            if cell["forward_ms"] else "-")
    return (f"| {cell['workload']} | {cell['concurrency']} | {cell['forward_ms']:g} | "
            f"{s['tokens_per_s']:,.0f} / {f['tokens_per_s']:,.0f} "
            f"({f['tokens_per_s'] / s['tokens_per_s']:.2f}x) | "
            f"{s['host_us']:.1f} / {f['host_us']:.1f} ({s['host_us'] / f['host_us']:.2f}x) | "
            f"{stages} | {wait} |" + ("" if cell["identical"] else " OUTPUTS DIFFER"))


def _table(cells: list[dict], args, version: str, vocab: int) -> str:
    lines = [f"vLLM {version}, stand-in model ({args.tokenizer} tokenizer, {vocab:,} "
             "tokens), in process, async scheduling, "
             f"{args.tokens} output tokens per request, medians of {args.repeats} alternating "
             "runs; host µs per request-step on the engine thread's CPU clock "
             "(stand-in and simulated GPU left out)", "", HEADER,
             "|" + " --- |" * 10]
    lines += [_row(cell) for cell in cells]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
