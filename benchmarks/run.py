"""The microbenchmark grid against stock vLLM 0.33.0: a table, JSON and plots.

    tox -e bench-micro                # installs vLLM 0.33.0 (CPU) and runs this
    python benchmarks/run.py --out results   # inside an environment that has it

Runs benchmarks/test_update_benchmarks.py, test_spec_benchmarks.py and
test_penalty_benchmarks.py (pytest-benchmark, one test per cell in paired
rounds: fastbatch timed by pytest-benchmark, every other variant timed in the
same round on the same fresh state, each checked against stock vLLM; see
benchmarks/paired.py), then, after pytest-benchmark's own table (fastbatch
only), writes OUT/microbench.json (raw), OUT/microbench-summary.json,
OUT/microbench.png (the output-token update, warm and cold) and
OUT/microbench-spec-penalties.png (the spec-token update and the penalties'
tensor), and prints the summary last: median microseconds per variant, the
median per-round ratios fastbatch vs stock vLLM 0.33.0, vs the vLLM <= 0.21
forward scan and vs the floor with their quartiles, the medians of the
runner pieces' cells (test_bookkeeping_benchmarks.py,
test_runner_input_benchmarks.py, test_row_lists_benchmarks.py: stock and
fastbatch timed as separate pytest-benchmark tests, not paired), the machine
and the grid's wall time.  test_verify_benchmarks.py's FASTBATCH_VERIFY costs are in the raw
JSON (group ``verify``).  The engine itself: benchmarks/engine.py
(``tox -e bench``).  Arguments it does not know go to pytest
(e.g. ``-k penalties``); the report covers the groups that ran.
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
SPEC_VARIANTS = ("stock", "fastbatch", "fallback", "floor")
PENALTY_VARIANTS = ("stock", "stock_convert", "fastbatch", "fallback")
BOOKKEEPING_VARIANTS = ("stock", "fastbatch", "fallback")
BENCHMARK_FILES = ("test_update_benchmarks.py", "test_spec_benchmarks.py",
                   "test_penalty_benchmarks.py", "test_bookkeeping_benchmarks.py",
                   "test_runner_input_benchmarks.py", "test_verify_benchmarks.py",
                   "test_row_lists_benchmarks.py")


def run_grid(raw: Path, extra: list[str]) -> float:
    import pytest

    started = time.perf_counter()
    code = pytest.main([*(str(HERE / name) for name in BENCHMARK_FILES), "-q",
                        "-p", "no:cacheprovider",
                        "--benchmark-only", f"--benchmark-json={raw}",
                        "--benchmark-columns=median,iqr,rounds", "--benchmark-sort=name",
                        "--benchmark-time-unit=us",
                        *extra])
    if code != 0:
        sys.exit(f"benchmark run failed (pytest exit code {code})")
    return time.perf_counter() - started


def load(raw: Path) -> tuple[dict, dict, dict, dict]:
    """The paired summaries (benchmarks/paired.py) of each group, keyed by cell:
    the output-token update {(mode, requests, output_len, cold)}, the
    spec-token update {(requests, drafts)}, the penalties' tensor
    {(requests, output_len)}; and the machine info."""
    data = json.loads(raw.read_text())
    cells: dict = {}
    spec: dict = {}
    penalty: dict = {}
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        if "paired" not in info:
            continue
        if info.get("group") == "spec_tokens":
            spec[(info["requests"], info["drafts"])] = info["paired"]
        elif info.get("group") == "penalties":
            penalty[(info["requests"], info["output_len"])] = info["paired"]
        else:
            key = (info["mode"], info["requests"], info["output_len"], info["cold"])
            cells[key] = info["paired"]
    return cells, spec, penalty, data["machine_info"]


def ratio(paired: dict, variant: str) -> float:
    """Median of the per-round ratios variant / fastbatch (how many times
    faster fastbatch is)."""
    return paired["ratios"][variant]["median"]


def over_floor(paired: dict) -> dict:
    """fastbatch / floor per round (the inverse of the floor's ratio)."""
    floor = paired["ratios"]["floor"]
    return {"median": 1 / floor["median"], "q1": 1 / floor["q3"], "q3": 1 / floor["q1"],
            "min": 1 / floor["max"], "max": 1 / floor["min"]}


def _spread(values: dict) -> str:
    return f"{values['median']:.2f} [{values['q1']:.2f}-{values['q3']:.2f}]"


def print_rows(title: str, variants: tuple, ratios: tuple, rows, with_floor: bool) -> None:
    """One table: median microseconds per variant, then the per-round ratios
    (median [quartiles]) of each variant in ``ratios`` over fastbatch, and
    fastbatch over the floor."""
    print(f"\n{title}")
    print(f"{'cell':<24}" + "".join(f"{v.replace('_', ' '):>14}" for v in variants)
          + "".join(f"{r.replace('_', ' ') + ' / fb':>24}" for r in ratios)
          + (f"{'fb / floor':>22}" if with_floor else ""))
    for label, paired in rows:
        times = paired["median_seconds"]
        line = f"{label:<24}" + "".join(
            f"{times[v] * 1e6:>14.2f}" if v in times else f"{'-':>14}" for v in variants)
        line += "".join(f"{_spread(paired['ratios'][r]):>24}" if r in paired["ratios"]
                        else f"{'-':>24}" for r in ratios)
        if with_floor:
            line += (f"{_spread(over_floor(paired)):>22}" if "floor" in paired["ratios"]
                     else f"{'-':>22}")
        print(line)


def print_tables(cells: dict, spec: dict, penalty: dict) -> None:
    if cells:
        def label(key):
            mode, n, length, cold = key
            return f"{mode}{' cold' if cold else ''} {n} x {length}"

        print_rows("InputBatch.update_async_output_token_ids, warm caches",
                   VARIANTS, ("stock", "forward_scan"),
                   ((label(k), p) for k, p in sorted(cells.items()) if not k[3]), True)
        cold = sorted(k for k in cells if k[3])
        if cold:
            print_rows("... the same, cold: lists and ints laid out as a generation builds "
                       "them, caches flushed before every call; beside each, its warm twin",
                       ("stock", "fastbatch", "floor"), ("stock",),
                       ((label(key), cells[key]) for k in cold
                        for key in (k, (*k[:3], False)) if key in cells), True)
    if spec:
        print_rows("InputBatch.update_async_spec_token_ids (k: draft tokens per request)",
                   SPEC_VARIANTS, ("stock",),
                   ((f"spec tokens {n} k={k}", p) for (n, k), p in sorted(spec.items())), True)
    if penalty:
        print_rows("penalties' output-token tensor (stock: _convert_to_tensors + the -1 "
                   "masking of apply_all_penalties; fastbatch: its conversion, no masking "
                   "after it; stock convert: _convert_to_tensors alone, the CPU part on a GPU)",
                   PENALTY_VARIANTS, ("stock", "stock_convert"),
                   ((f"penalties {n} x {length}", p)
                    for (n, length), p in sorted(penalty.items())), False)


def _ratio_points(axes, points: list, label: str, style: str) -> None:
    """Median ratio with its interquartile range as error bars."""
    if not points:
        return
    xs = [x for x, _ in points]
    medians = [r["median"] for _, r in points]
    errors = [[r["median"] - r["q1"] for _, r in points],
              [r["q3"] - r["median"] for _, r in points]]
    axes.errorbar(xs, medians, yerr=errors, fmt=style, capsize=3, label=label)


def plot(cells: dict, path: Path) -> None:
    """The output-token update: times at 4000 tokens (warm), and the ratios
    stock / fastbatch per cell, warm and cold, with their spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (times_axes, ratio_axes) = plt.subplots(1, 2, figsize=(12, 4.8))
    styles = {"stock": "C3o-", "forward_scan": "C1s--", "fastbatch": "C0^-",
              "fallback": "C7v:", "floor": "C2.-"}
    for variant, style in styles.items():
        points = sorted((n, p["median_seconds"][variant]) for (m, n, length, cold), p
                        in cells.items() if m == "decode" and length == 4000 and not cold
                        and variant in p["median_seconds"])
        if points:
            times_axes.plot([x for x, _ in points], [t * 1e6 for _, t in points], style,
                            label=variant.replace("_", " "))
    times_axes.set(xscale="log", yscale="log", xlabel="requests in the batch",
                   ylabel="median time per step (us)",
                   title="decode, 4000 tokens per request, warm")
    for (mode, cold), style in ((("decode", False), "C0o-"), (("spec", False), "C9s--"),
                                (("decode", True), "C3o-"), (("spec", True), "C1s--")):
        _ratio_points(ratio_axes, sorted(
            (n, p["ratios"]["stock"]) for (m, n, length, c), p in cells.items()
            if m == mode and c == cold and length == 4000),
            f"{mode}, {'cold' if cold else 'warm'}", style)
    ratio_axes.axhline(1, color="grey", lw=0.8)
    ratio_axes.set(xscale="log", yscale="log", xlabel="requests in the batch",
                   ylabel="stock / fastbatch (median of rounds, IQR bars)",
                   title="how many times faster, 4000 tokens per request")
    for axes in (times_axes, ratio_axes):
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle("InputBatch.update_async_output_token_ids per step "
                    "(spec: 4 drafts; cold: caches flushed, lists laid out by a generation)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def plot_groups(spec: dict, penalty: dict, path: Path) -> None:
    """The spec-token update against requests (times at k=3, ratios per k) and
    the penalties' tensor against output length (times at 1024 requests,
    ratios per batch size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ((spec_times, penalty_times), (spec_ratios, penalty_ratios)) = plt.subplots(
        2, 2, figsize=(12, 8))
    colours = {"stock": "C3o-", "stock_convert": "C1s--", "fastbatch": "C0^-",
               "fallback": "C7v:", "floor": "C2.-"}
    k_shown = 3 if any(k == 3 for _, k in spec) else max((k for _, k in spec), default=0)
    n_shown = max((n for n, _ in penalty), default=0)
    for variant, style in colours.items():
        points = sorted((n, p["median_seconds"][variant]) for (n, k), p in spec.items()
                        if k == k_shown and variant in p["median_seconds"])
        if points:
            spec_times.plot([x for x, _ in points], [t * 1e6 for _, t in points], style,
                            label=variant.replace("_", " "))
        points = sorted((length, p["median_seconds"][variant]) for (n, length), p
                        in penalty.items() if n == n_shown and variant in p["median_seconds"])
        if points:
            penalty_times.plot([x for x, _ in points], [t * 1e6 for _, t in points], style,
                               label=variant.replace("_", " "))
    for k, style in zip(sorted({k for _, k in spec}), ("C0o-", "C2s--", "C4^:"), strict=False):
        _ratio_points(spec_ratios, sorted((n, p["ratios"]["stock"]) for (n, kk), p
                                          in spec.items() if kk == k), f"k={k}", style)
    for n, style in zip(sorted({n for n, _ in penalty}), ("C0o-", "C3s--"), strict=False):
        _ratio_points(penalty_ratios, sorted((length, p["ratios"]["stock"]) for (nn, length), p
                                             in penalty.items() if nn == n),
                      f"{n} requests", style)
    spec_times.set(title=f"InputBatch.update_async_spec_token_ids, k={k_shown}",
                   ylabel="median time per step (us)")
    penalty_times.set(title=f"penalties: output-token tensor, {n_shown} requests",
                      ylabel="median time per step (us)")
    spec_ratios.set(xlabel="requests in the batch", title="stock / fastbatch, per k",
                    ylabel="median of rounds (IQR bars)")
    penalty_ratios.set(xlabel="longest output (tokens)",
                       title="stock (conversion + masking) / fastbatch (conversion)",
                       ylabel="median of rounds (IQR bars)")
    for axes in (spec_times, penalty_times, spec_ratios, penalty_ratios):
        axes.set(xscale="log", yscale="log")
        axes.grid(True, which="both", alpha=0.3)
        if axes.lines or axes.containers:
            axes.legend(fontsize=8)
    for axes in (spec_ratios, penalty_ratios):
        axes.axhline(1, color="grey", lw=0.8)
    spec_times.set(xlabel="requests in the batch")
    penalty_times.set(xlabel="longest output (tokens)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def load_bookkeeping(raw: Path) -> dict:
    """``_bookkeeping_sync``, {(requests, "async"/"sync"): {variant: median seconds}}."""
    cells: dict = {}
    for bench in json.loads(raw.read_text())["benchmarks"]:
        info = bench["extra_info"]
        if info.get("group") == "bookkeeping":
            key = (info["requests"], "async" if info["use_async"] else "sync")
            cells.setdefault(key, {})[info["variant"]] = bench["stats"]["median"]
    return cells


def print_bookkeeping_table(cells: dict) -> None:
    """``_bookkeeping_sync`` per decode step, with the ratio stock / fastbatch."""
    print("\nGPUModelRunner._bookkeeping_sync (whole method, plain decode), median time per"
          " step, microseconds")
    print(f"{'cell':<22}" + "".join(f"{v:>14}" for v in BOOKKEEPING_VARIANTS)
          + f"{'vs stock':>11}")
    for (n, mode), times in sorted(cells.items()):
        print(f"{f'bookkeeping {n} {mode}':<22}"
              + "".join(f"{times[v] * 1e6:>14.2f}" if v in times else f"{'-':>14}"
                        for v in BOOKKEEPING_VARIANTS)
              + (f"{times['stock'] / times['fastbatch']:>10.1f}x"
                 if {"stock", "fastbatch"} <= times.keys() else f"{'-':>11}"))
RUNNER_GROUPS = ("prev_positions", "input_ids")  # benchmarks/test_runner_input_benchmarks.py


def load_runner_groups(raw: Path) -> dict:
    """The runner's input preparation: {group: {(requests, shape): {variant: median s}}}."""
    groups: dict = {group: {} for group in RUNNER_GROUPS}
    for bench in json.loads(raw.read_text())["benchmarks"]:
        info = bench["extra_info"]
        if info.get("group") in groups:
            key = (info["requests"], info["shape"])
            groups[info["group"]].setdefault(key, {})[info["variant"]] = \
                bench["stats"]["median"]
    return groups


def print_runner_tables(groups: dict) -> None:
    """``_compute_prev_positions`` and ``_prepare_input_ids``: medians, and stock /
    fastbatch."""
    variants = ("stock", "fastbatch", "fallback")
    for group, cells in groups.items():
        if not cells:
            continue
        print(f"\n{group}: median time per call, microseconds")
        print(f"{'cell':<16}" + "".join(f"{v:>12}" for v in variants) + f"{'vs stock':>10}")
        for (requests, shape), times in sorted(cells.items(), key=lambda c: (c[0][1], c[0][0])):
            row = f"{shape + ' ' + str(requests):<16}"
            row += "".join(f"{times[v] * 1e6:>12.2f}" if v in times else f"{'-':>12}"
                           for v in variants)
            if "stock" in times and "fastbatch" in times:
                row += f"{times['stock'] / times['fastbatch']:>9.1f}x"
            print(row)


def load_row_lists(raw: Path) -> dict:
    """The rows-to-lists pieces (group ``row_lists``),
    {(piece, requests, width): {variant: median seconds}}."""
    rows: dict = {}
    for bench in json.loads(raw.read_text())["benchmarks"]:
        info = bench["extra_info"]
        if info.get("group") == "row_lists":
            key = (info["piece"], info["requests"], info["width"])
            rows.setdefault(key, {})[info["variant"]] = bench["stats"]["median"]
    return rows


def print_row_lists(rows: dict) -> None:
    """get_output, parse_output, drafts and the whole spec step, stock / fastbatch."""
    if not rows:
        return
    print("\nthe step's rows as lists, median time per call, microseconds (width: ids per"
          " row; spec_step: drafts to lists + the spec-token update, k=3)")
    print(f"{'cell':<28}{'stock':>12}{'fastbatch':>12}{'vs stock':>10}")
    for (piece, requests, width), times in sorted(rows.items()):
        ratio = (f"{times['stock'] / times['fastbatch']:>9.1f}x"
                 if {"stock", "fastbatch"} <= times.keys() else f"{'-':>10}")
        print(f"{f'{piece} {requests} x {width}':<28}"
              + "".join(f"{times[v] * 1e6:>12.2f}" if v in times else f"{'-':>12}"
                        for v in ("stock", "fastbatch")) + ratio)


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
    cells, spec, penalty, machine = load(raw)
    bookkeeping = load_bookkeeping(raw)
    runner_groups = load_runner_groups(raw)
    row_lists = load_row_lists(raw)
    import vllm

    import fastbatch

    machine_line = (f"{machine['cpu'].get('brand_raw', '?')}, {machine['cpu'].get('count')} "
                    f"cores, Python {platform.python_version()}, vLLM {vllm.__version__}, "
                    f"fastbatch {fastbatch.__version__} (compiled: {fastbatch.COMPILED})")
    summary_path.write_text(json.dumps({
        "machine": machine_line,
        "grid_seconds": grid_seconds,
        "output_tokens": {f"{m}{'-cold' if c else ''}-{n}x{length}": p
                          for (m, n, length, c), p in sorted(cells.items())},
        "spec_tokens": {f"{n}xk{k}": p for (n, k), p in sorted(spec.items())},
        "penalties": {f"{n}x{length}": p for (n, length), p in sorted(penalty.items())},
        "bookkeeping_median_seconds": {f"{n}-{mode}": v
                                       for (n, mode), v in sorted(bookkeeping.items())},
        **{f"{group}_median_seconds": {f"{shape}-{n}": v for (n, shape), v in sorted(cells.items())}
           for group, cells in runner_groups.items()},
        "row_lists_median_seconds": {f"{piece}-{n}x{width}": v
                                     for (piece, n, width), v in sorted(row_lists.items())},
    }, indent=1))
    written = [raw, summary_path]
    if cells:
        plot(cells, args.out / "microbench.png")
        written.append(args.out / "microbench.png")
    if spec or penalty:
        plot_groups(spec, penalty, args.out / "microbench-spec-penalties.png")
        written.append(args.out / "microbench-spec-penalties.png")
    print(f"\nwrote {', '.join(map(str, written))}")

    print("\n" + "=" * 30 + " SUMMARY " + "=" * 30)
    print("Times: median microseconds per call (one step's update), each variant timed"
          " in the same\nrounds on the same state.  Ratios: 'stock / fb' is how many times"
          " faster fastbatch is,\nas the median of the per-round ratios [first-third"
          " quartile]; 'fb / floor' is fastbatch's\ntime over the floor's (1.00 = as fast as"
          " the minimal loop).  On a shared machine absolute\ntimes move by tens of percent"
          " from run to run; the per-round ratios much less.")
    print_tables(cells, spec, penalty)
    if bookkeeping:
        print_bookkeeping_table(bookkeeping)
    print_runner_tables(runner_groups)
    print_row_lists(row_lists)
    print(f"\nmachine: {machine_line}\ngrid wall time: {grid_seconds:.0f} s")


if __name__ == "__main__":
    main()
