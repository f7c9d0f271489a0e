"""``python -m fastbatch``: what ``FASTBATCH=1`` would do here, before turning it on.

Prints fastbatch's version and whether its kernel is compiled; the vLLM
found; for each piece whether this vLLM is a verified target (or why not)
and the result of its activation check (the pieces without a target in this
vLLM, the V1 runner's where it has no Model Runner V1, in one line); and
which model runner this vLLM picks here by default.  Exits 1 when no piece would act, 0 otherwise.

Needs no GPU and starts no engine: it imports vLLM's modules and runs the
same guard and activation checks as the plugin, without patching anything.
"""

from __future__ import annotations

import os
import sys
from typing import Any

RUNNER_MEANING = {
    "v1": "every piece can act (the runner pieces replace code of the V1 runner)",
    "v2": ("fastbatch's runner pieces would stay idle: they serve the V1 runner; "
           "VLLM_USE_V2_MODEL_RUNNER=0 selects V1 (the scheduler's, the output processor's "
           "and the API server's pieces act under both)"),
}


def _patch_lines(patch: Any) -> tuple[bool, list[str]]:
    """Whether this vLLM would take ``patch`` (``Patch.judge``, as ``apply``
    decides), and the lines that say why (the activation check run even on a
    target the guard refuses)."""
    verdict = patch.judge(force=True, standalone=True)
    problem = verdict.problem
    return verdict.accepted, [
        f"    {patch.target}",
        f"      target: {'verified' if problem is None else 'refused: ' + problem}",
        f"      activation check: {verdict.check}"]


def _piece_lines(piece: Any, compiled: bool, skipped: set[str]) -> tuple[bool, list[str]]:
    """Whether the piece would act, and the lines that say why."""
    lines = [f"  {piece.name}:"]
    acts = compiled and piece.name not in skipped
    for patch in piece.patches:
        taken, patch_lines = _patch_lines(patch)
        lines += patch_lines
        acts = acts and (taken if patch is piece.main else True)
    if piece.name in skipped:
        lines.append("    left stock: listed in FASTBATCH_DISABLE")
    lines.append(f"    with FASTBATCH=1: {'replaced' if acts else 'stays stock'}")
    return acts, lines


def main() -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's import-time chatter
    import fastbatch
    from fastbatch import model_runner, registry, vllm_plugin

    print(f"fastbatch {fastbatch.__version__}: "
          + ("compiled kernel" if fastbatch.COMPILED else
             "pure-Python fallback only: " + vllm_plugin.kernel_missing_reason()))
    if not fastbatch.COMPILED:
        print("  without the compiled kernel FASTBATCH=1 leaves vLLM stock (the fallback "
              "is slower than vLLM's own code)")
    print(f"FASTBATCH={os.environ.get('FASTBATCH', '')!r} ({vllm_plugin.mode()}), "
          f"FASTBATCH_DISABLE={os.environ.get('FASTBATCH_DISABLE', '')!r}, "
          f"FASTBATCH_VERIFY={os.environ.get('FASTBATCH_VERIFY', '')!r} "
          f"(share of calls checked: {vllm_plugin.verify_rate():g})")
    try:
        import vllm
    except ImportError as exc:
        print(f"vLLM: not found ({exc}); nothing to act on")
        return 1
    print(f"vLLM {vllm.__version__} ({os.path.dirname(vllm.__file__)})")

    skipped = vllm_plugin.disabled()
    absent = vllm_plugin.without_target()
    acting = []
    print("pieces:")
    for piece in registry.pieces():
        if piece.name in absent:
            continue  # one line for the group, below
        acts, lines = _piece_lines(piece, fastbatch.COMPILED, skipped)
        print("\n".join(lines))
        if acts:
            acting.append(piece)

    if absent:
        print(f"  {', '.join(absent)}:\n    {next(iter(absent.values()))}; nothing to replace")
    runner: Any
    try:
        runner, why = model_runner.default_runner()
    except Exception as exc:  # a platform vLLM cannot configure without a model
        runner, why = "unknown", f"cannot tell ({type(exc).__name__}: {exc})"
    print(f"model runner by default here: {runner.upper() if runner != 'unknown' else runner}"
          f" ({why})")
    if absent:
        print("  fastbatch's scheduler, output processor and API server pieces act under it")
    else:
        print(f"  {RUNNER_MEANING.get(runner, 'fastbatch cannot tell whether its pieces act')}")
        print("  (a feature Model Runner V2 lacks also selects V1: see the README)")

    if runner == "v2":  # only what Model Runner V2 uses too: scheduler, output processor, API
        acting = [piece for piece in acting if piece.main.acts_under_v2]
    if acting:
        print("verdict: with FASTBATCH=1 these pieces would act: "
              + ", ".join(piece.name for piece in acting))
        return 0
    print("verdict: with FASTBATCH=1 nothing would act here")
    return 1


if __name__ == "__main__":
    sys.exit(main())
