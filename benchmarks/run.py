"""The main demonstration: the microbenchmark grid, a table, JSON and a plot.

    tox -e bench                      # installs vLLM 0.33.0 (CPU) and runs this
    python benchmarks/run.py --out results   # inside an environment that has it

Runs benchmarks/test_update_benchmarks.py (pytest-benchmark; every variant
on identical fresh state each round, each checked against stock vLLM), then
prints the medians and the ratios fastbatch vs stock vLLM 0.33.0, vs the
vLLM <= 0.21 forward scan and vs the floor, checks them against the targets,
and writes OUT/microbench.json (raw), OUT/microbench-summary.json and
OUT/microbench.png.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = ("stock", "forward_scan", "fastbatch", "fallback", "floor")


def run_grid(raw: Path, extra: list[str]) -> float:
    import pytest

    started = time.perf_counter()
    code = pytest.main([str(HERE / "test_update_benchmarks.py"), "-q", "-p", "no:cacheprovider",
                        "--benchmark-only", f"--benchmark-json={raw}",
                        "--benchmark-columns=median,iqr,rounds", "--benchmark-sort=name",
                        *extra])
    if code != 0:
        sys.exit(f"benchmark run failed (pytest exit code {code})")
    return time.perf_counter() - started


def load_medians(raw: Path) -> tuple[dict, dict]:
    """{(mode, requests, output_len): {variant: median seconds}}, machine info."""
    data = json.loads(raw.read_text())
    cells: dict = {}
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        key = (info["mode"], info["requests"], info["output_len"])
        cells.setdefault(key, {})[info["variant"]] = bench["stats"]["median"]
    return cells, data["machine_info"]


def check_targets(cells: dict, grid_seconds: float) -> list[dict]:
    """The targets of the benchmark issue, measured; never asserted in tests."""
    def fb(mode, n, length):
        return cells[(mode, n, length)]["fastbatch"]

    def ratio(mode, n, length, variant):
        return cells[(mode, n, length)][variant] / fb(mode, n, length)

    targets = []

    def add(name, value, goal, ok):
        targets.append({"target": name, "measured": round(value, 3), "goal": goal, "met": ok})

    for mode in ("decode", "spec"):
        value = ratio(mode, 256, 4000, "stock")
        add(f"{mode}: stock / fastbatch at 256 x 4000", value, ">= 15", value >= 15)
    for n in (256, 1024):
        worst = max(fb("decode", n, length) / cells[("decode", n, length)]["floor"]
                    for length in (100, 4000, 60000))
        add(f"decode: fastbatch / floor at {n} requests (worst length)", worst, "<= 1.3",
            worst <= 1.3)
    for n in (1, 64, 256, 1024, 4096):
        flat = max(fb(mode, n, 60000) / fb(mode, n, 100) for mode in ("decode", "spec"))
        floor_flat = (cells[("decode", n, 60000)]["floor"]
                      / cells[("decode", n, 100)]["floor"])
        add(f"fastbatch at 60000 / at 100 tokens, {n} requests (floor: {floor_flat:.2f})",
            flat, "<= 1.2", flat <= 1.2)
    worst_small = min(ratio(mode, 1, length, "stock")
                      for mode in ("decode", "spec") for length in (100, 4000, 60000))
    add("stock / fastbatch at 1 request (worst cell)", worst_small, ">= 1", worst_small >= 1)
    worst_idle = min(v["stock"] / v["fastbatch"] for k, v in cells.items() if k[0] == "idle")
    add("stock / fastbatch, nothing needed (worst cell)", worst_idle, ">= 1 (same path)",
        worst_idle >= 0.97)
    add("grid wall time, minutes", grid_seconds / 60, "< 10", grid_seconds < 600)
    return targets


def print_table(cells: dict) -> None:
    header = (f"{'cell':<22}" + "".join(f"{v:>13}" for v in VARIANTS)
              + f"{'vs stock':>10}{'vs fwd':>10}{'/ floor':>9}")
    print("\nmedian time per step, microseconds (ratios: how many times faster fastbatch is;"
          " / floor: fastbatch time over the floor's)")
    print(header)
    for (mode, n, length), times in sorted(cells.items()):
        row = f"{mode + ' ' + str(n) + ' x ' + str(length):<22}"
        row += "".join(f"{times[v] * 1e6:>13.2f}" if v in times else f"{'-':>13}"
                       for v in VARIANTS)
        row += f"{times['stock'] / times['fastbatch']:>9.1f}x"
        row += f"{times['forward_scan'] / times['fastbatch']:>9.0f}x"
        row += (f"{times['fastbatch'] / times['floor']:>9.2f}" if "floor" in times
                else f"{'-':>9}")
        print(row)


def plot(cells: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_requests, by_length) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"stock": "C3o-", "forward_scan": "C1s--", "fastbatch": "C0^-",
              "fallback": "C7v:", "floor": "C2.-"}
    for variant, style in styles.items():
        for mode, marker_fill in (("decode", "full"), ("spec", "none")):
            points = sorted((n, v[variant]) for (m, n, length), v in cells.items()
                            if m == mode and length == 4000 and variant in v)
            if points:
                by_requests.plot([p[0] for p in points], [p[1] * 1e6 for p in points], style,
                                 fillstyle=marker_fill, label=f"{variant} ({mode})")
            points = sorted((length, v[variant]) for (m, n, length), v in cells.items()
                            if m == mode and n == 256 and variant in v)
            if points:
                by_length.plot([p[0] for p in points], [p[1] * 1e6 for p in points], style,
                               fillstyle=marker_fill, label=f"{variant} ({mode})")
    by_requests.set(xscale="log", yscale="log", xlabel="requests in the batch",
                    ylabel="time per step (us)", title="output length 4000")
    by_length.set(xscale="log", yscale="log", xlabel="output tokens per request",
                  ylabel="time per step (us)", title="256 requests")
    for axes in (by_requests, by_length):
        axes.grid(True, which="both", alpha=0.3)
    by_length.legend(fontsize=7, ncol=2)
    figure.suptitle("InputBatch.update_async_output_token_ids per step "
                    "(filled: decode, hollow: spec decode with 4 drafts)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--report-only", action="store_true",
                        help="re-read OUT/microbench.json instead of running the grid")
    args, extra = parser.parse_known_args()
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.out / "microbench.json"
    summary_path = args.out / "microbench-summary.json"
    if args.report_only:
        grid_seconds = json.loads(summary_path.read_text())["grid_seconds"]
    else:
        grid_seconds = run_grid(raw, extra)
    cells, machine = load_medians(raw)
    print_table(cells)
    targets = check_targets(cells, grid_seconds)
    print("\ntargets")
    for target in targets:
        print(f"  {'met   ' if target['met'] else 'MISSED'} {target['target']}: "
              f"{target['measured']} (goal {target['goal']})")
    import vllm

    import fastbatch

    machine_line = (f"{machine['cpu'].get('brand_raw', '?')}, {machine['cpu'].get('count')} "
                    f"cores, Python {platform.python_version()}, vLLM {vllm.__version__}, "
                    f"fastbatch {fastbatch.__version__} (compiled: {fastbatch.COMPILED})")
    print(f"\nmachine: {machine_line}\ngrid wall time: {grid_seconds:.0f} s")
    summary_path.write_text(json.dumps({
        "machine": machine_line,
        "grid_seconds": grid_seconds,
        "targets": targets,
        "median_seconds": {f"{m}-{n}x{length}": v for (m, n, length), v in sorted(cells.items())},
    }, indent=1))
    plot(cells, args.out / "microbench.png")
    print(f"wrote {raw}, {summary_path} and {args.out / 'microbench.png'}")


if __name__ == "__main__":
    main()
