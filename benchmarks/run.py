"""The main demonstration: the microbenchmark grid, a table, JSON and a plot.

    tox -e bench                      # installs vLLM 0.33.0 (CPU) and runs this
    python benchmarks/run.py --out results   # inside an environment that has it

Runs benchmarks/test_update_benchmarks.py, test_spec_benchmarks.py,
test_penalty_benchmarks.py and test_bookkeeping_benchmarks.py
(pytest-benchmark; every variant on identical fresh state each round, each
checked against stock vLLM), then prints the medians
and the ratios fastbatch vs stock vLLM 0.33.0, vs the vLLM <= 0.21 forward
scan and vs the floor, checks them against the targets, and writes
OUT/microbench.json (raw), OUT/microbench-summary.json, OUT/microbench.png
(the output-token update) and OUT/microbench-spec-penalties.png (the spec-token
update and the penalties' tensor).  Arguments it does not know go to pytest
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
                        *extra])
    if code != 0:
        sys.exit(f"benchmark run failed (pytest exit code {code})")
    return time.perf_counter() - started


def load_medians(raw: Path) -> tuple[dict, dict]:
    """{(mode, requests, output_len): {variant: median seconds}}, machine info
    (the output-token update; the other groups: ``load_groups``)."""
    data = json.loads(raw.read_text())
    cells: dict = {}
    for bench in data["benchmarks"]:
        info = bench["extra_info"]
        if "group" in info:
            continue
        key = (info["mode"], info["requests"], info["output_len"])
        cells.setdefault(key, {})[info["variant"]] = bench["stats"]["median"]
    return cells, data["machine_info"]


def load_groups(raw: Path) -> tuple[dict, dict]:
    """The spec-token update, {(requests, drafts): {variant: median seconds}}, and
    the penalties' tensor, {(requests, output_len): {variant: median seconds}}."""
    groups: dict = {"spec_tokens": {}, "penalties": {}}
    for bench in json.loads(raw.read_text())["benchmarks"]:
        info = bench["extra_info"]
        if info.get("group") == "spec_tokens":
            key = (info["requests"], info["drafts"])
        elif info.get("group") == "penalties":
            key = (info["requests"], info["output_len"])
        else:
            continue
        groups[info["group"]].setdefault(key, {})[info["variant"]] = bench["stats"]["median"]
    return groups["spec_tokens"], groups["penalties"]


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


def check_targets(cells: dict, grid_seconds: float, spec: dict | None = None,
                  penalty: dict | None = None) -> list[dict]:
    """The targets of the benchmark issues, measured; never asserted in tests.
    Each group's targets only if that group ran in full (it does in the full grid)."""
    targets = []

    def add(name, value, goal, ok):
        targets.append({"target": name, "measured": round(value, 3), "goal": goal, "met": ok})

    if cells:
        try:
            update_targets(cells, add)
        except (KeyError, ValueError):  # a partial grid (pytest -k)
            print("output-token update targets skipped: not every cell ran")
    spec_at_256 = [times["stock"] / times["fastbatch"]
                   for (n, _), times in (spec or {}).items() if n == 256]
    if spec_at_256:
        add("spec tokens: stock / fastbatch at 256 requests (worst k)", min(spec_at_256),
            ">= 10", min(spec_at_256) >= 10)
    if (256, 4000) in (penalty or {}):
        value = penalty[(256, 4000)]["stock"] / penalty[(256, 4000)]["fastbatch"]
        add("penalties tensor: stock / fastbatch at 256 x 4000", value, ">= 5", value >= 5)
        value = penalty[(256, 4000)]["stock_convert"] / penalty[(256, 4000)]["fastbatch"]
        add("penalties tensor: stock conversion alone / fastbatch at 256 x 4000", value,
            ">= 5", value >= 5)
    add("grid wall time, minutes", grid_seconds / 60, "< 10", grid_seconds < 600)
    return targets


def update_targets(cells: dict, add) -> None:
    """The output-token update's targets."""
    def fb(mode, n, length):
        return cells[(mode, n, length)]["fastbatch"]

    def ratio(mode, n, length, variant):
        return cells[(mode, n, length)][variant] / fb(mode, n, length)

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


def print_group_tables(spec: dict, penalty: dict) -> None:
    """The spec-token update and the penalties' tensor, with the ratios stock /
    fastbatch (and, for the penalties, vLLM's conversion alone / fastbatch)."""
    def print_rows(variants, ratios, rows):
        over_floor = "floor" in variants
        print(f"{'cell':<22}" + "".join(f"{v:>14}" for v in variants)
              + "".join(f"{'vs ' + r.removeprefix('stock_'):>11}" for r in ratios)
              + (f"{'/ floor':>9}" if over_floor else ""))
        for label, times in rows:
            print(f"{label:<22}"
                  + "".join(f"{times[v] * 1e6:>14.2f}" if v in times else f"{'-':>14}"
                            for v in variants)
                  + "".join(f"{times[r] / times['fastbatch']:>10.1f}x" if r in times
                            else f"{'-':>11}" for r in ratios)
                  + ((f"{times['fastbatch'] / times['floor']:>9.2f}" if "floor" in times
                      else f"{'-':>9}") if over_floor else ""))

    if spec:
        print("\nInputBatch.update_async_spec_token_ids, median time per step, microseconds"
              " (k: draft tokens per request; / floor: fastbatch time over the floor's)")
        print_rows(SPEC_VARIANTS, ("stock",),
                   ((f"spec tokens {n} k={k}", times) for (n, k), times in sorted(spec.items())))
    if penalty:
        print("\npenalties' output-token tensor, median time per step, microseconds (stock:"
              " _convert_to_tensors + the -1 masking of apply_all_penalties; stock_convert:"
              " _convert_to_tensors alone, the CPU part on a GPU; fallback: '-' where skipped)")
        print_rows(PENALTY_VARIANTS, ("stock", "stock_convert"),
                   ((f"penalties {n} x {length}", times)
                    for (n, length), times in sorted(penalty.items())))


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


def plot_groups(spec: dict, penalty: dict, path: Path) -> None:
    """Second figure: the spec-token update against requests, the penalties'
    tensor against output length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (spec_axes, penalty_axes) = plt.subplots(1, 2, figsize=(12, 4.8))
    colours = {"stock": "C3", "stock_convert": "C1", "fastbatch": "C0", "fallback": "C7",
               "floor": "C2"}
    for variant, colour in colours.items():
        for k, style in zip(sorted({k for _, k in spec}), ("o:", "s-", "^--"), strict=False):
            points = sorted((n, v[variant]) for (n, kk), v in spec.items()
                            if kk == k and variant in v)
            if points:
                spec_axes.plot([p[0] for p in points], [p[1] * 1e6 for p in points],
                               colour + style, label=f"{variant} (k={k})")
        for n, style in zip(sorted({n for n, _ in penalty}), ("o-", "s--"), strict=False):
            points = sorted((length, v[variant]) for (nn, length), v in penalty.items()
                            if nn == n and variant in v)
            if points:
                penalty_axes.plot([p[0] for p in points], [p[1] * 1e6 for p in points],
                                  colour + style, label=f"{variant} ({n} requests)")
    spec_axes.set(xscale="log", yscale="log", xlabel="requests in the batch",
                  ylabel="time per step (us)",
                  title="InputBatch.update_async_spec_token_ids")
    penalty_axes.set(xscale="log", yscale="log", xlabel="longest output (tokens)",
                     ylabel="time per step (us)",
                     title="penalties: output-token tensor (+ -1 masking)")
    for axes in (spec_axes, penalty_axes):
        axes.grid(True, which="both", alpha=0.3)
        if axes.lines:
            axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


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
    spec, penalty = load_groups(raw)
    row_lists = load_row_lists(raw)
    if cells:
        print_table(cells)
    print_group_tables(spec, penalty)
    bookkeeping = load_bookkeeping(raw)
    if bookkeeping:
        print_bookkeeping_table(bookkeeping)
    runner_groups = load_runner_groups(raw)
    print_runner_tables(runner_groups)
    print_row_lists(row_lists)
    targets = check_targets(cells, grid_seconds, spec, penalty)
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
        "spec_tokens_median_seconds": {f"{n}xk{k}": v for (n, k), v in sorted(spec.items())},
        "penalties_median_seconds": {f"{n}x{length}": v
                                     for (n, length), v in sorted(penalty.items())},
        "bookkeeping_median_seconds": {f"{n}-{mode}": v
                                       for (n, mode), v in sorted(bookkeeping.items())},
        **{f"{group}_median_seconds": {f"{shape}-{n}": v for (n, shape), v in sorted(cells.items())}
           for group, cells in runner_groups.items()},
        "row_lists_median_seconds": {f"{piece}-{n}x{width}": v
                                     for (piece, n, width), v in sorted(row_lists.items())},
    }, indent=1))
    if cells:
        plot(cells, args.out / "microbench.png")
        print(f"wrote {raw}, {summary_path} and {args.out / 'microbench.png'}")
    else:
        print(f"wrote {raw} and {summary_path}")
    if spec or penalty:
        plot_groups(spec, penalty, args.out / "microbench-spec-penalties.png")
        print(f"wrote {args.out / 'microbench-spec-penalties.png'}")


if __name__ == "__main__":
    main()
