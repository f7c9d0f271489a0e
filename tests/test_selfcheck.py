"""``python -m fastbatch``, the self-check, run as users run it (a subprocess).

Without vLLM (here made unimportable, so this also runs where vLLM is
installed), on the real vLLM 0.33.0 (markers ``vllm`` and ``v1_runner``) and
on the real vLLM 0.34.0, which has no Model Runner V1.  It must not need a
GPU nor start an engine.
"""

import os
import subprocess
import sys
import textwrap

import pytest

import fastbatch
from fastbatch import registry
from subprocesses import OUTSIDE_THE_CHECKOUT


def v2_pieces() -> list[str]:
    """The pieces that replace the scheduler's or the output processor's code,
    which Model Runner V2 runs too (importing every patch module needs torch:
    only the vLLM tests call it)."""
    return [piece.name for piece in registry.pieces() if piece.main.acts_under_v2]


# Makes vLLM unimportable, then runs the self-check as ``python -m`` does.
WITHOUT_VLLM = textwrap.dedent("""
    import runpy, sys
    sys.modules["vllm"] = None
    runpy.run_module("fastbatch", run_name="__main__", alter_sys=True)
""")
NO_COMPILED_FASTBATCH = textwrap.dedent("""
    import importlib.machinery, sys

    class NoCompiledFastbatch:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("fastbatch."):
                spec = importlib.machinery.PathFinder.find_spec(name, path)
                if spec is not None and isinstance(spec.loader,
                                                   importlib.machinery.ExtensionFileLoader):
                    raise ImportError(f"{name} blocked by the test")
            return None

    sys.meta_path.insert(0, NoCompiledFastbatch())
""")


def _self_check(*args, **env):
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("FASTBATCH", "VLLM_USE_V2"))}
    environment.update(env)
    return subprocess.run([sys.executable, "-W", "ignore", *args], capture_output=True,
                          text=True, env=environment, timeout=300, check=False,
                          cwd=OUTSIDE_THE_CHECKOUT)


def test_without_vllm_nothing_would_act():
    result = _self_check("-c", WITHOUT_VLLM)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == f"fastbatch {fastbatch.__version__}: compiled kernel"
    assert "vLLM: not found" in lines[2]
    assert lines[-1].endswith("nothing to act on")


def test_without_the_compiled_kernel_says_so():
    result = _self_check("-c", NO_COMPILED_FASTBATCH + WITHOUT_VLLM)
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stdout.startswith(
        f"fastbatch {fastbatch.__version__}: pure-Python fallback only: ")
    assert "FASTBATCH=1 leaves vLLM stock" in result.stdout


@pytest.mark.vllm
@pytest.mark.v1_runner
def test_on_vllm_0_33_every_piece_would_act():
    result = _self_check("-m", "fastbatch", VLLM_TARGET_DEVICE="cpu", FASTBATCH="1")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "FASTBATCH='1' (on)" in out
    assert "\nvLLM 0.33.0 (" in out
    lines = out.splitlines()
    for piece in registry.pieces():
        (start,) = [i for i, line in enumerate(lines) if line == f"  {piece.name}:"]
        expected = []
        for patch in piece.patches:
            check = ("passed" if patch.requires is None
                     else f"run once {patch.requires.target} is replaced")
            expected += [f"    {patch.target}", "      target: verified",
                         f"      activation check: {check}"]
        expected.append("    with FASTBATCH=1: replaced")
        assert lines[start + 1:start + 1 + len(expected)] == expected, out
    # The CPU platform has no Triton: vLLM picks the V1 runner.
    assert ("model runner by default here: V1 (Model Runner V2 needs Triton, which this "
            "platform does not have)") in out
    assert out.splitlines()[-1] == ("verdict: with FASTBATCH=1 these pieces would act: "
                                    + ", ".join(registry.NAMES))


@pytest.mark.vllm
@pytest.mark.v1_runner
def test_on_model_runner_v2_only_the_scheduler_piece_would_act():
    result = _self_check("-m", "fastbatch", VLLM_TARGET_DEVICE="cpu",
                         VLLM_USE_V2_MODEL_RUNNER="1", FASTBATCH="1")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert "runner pieces would stay idle" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        "verdict: with FASTBATCH=1 these pieces would act: " + ", ".join(v2_pieces()))


@pytest.mark.vllm
@pytest.mark.v1_runner
def test_on_model_runner_v2_nothing_would_act():
    result = _self_check("-m", "fastbatch", VLLM_TARGET_DEVICE="cpu",
                         VLLM_USE_V2_MODEL_RUNNER="1",
                         FASTBATCH_DISABLE=",".join(["async_spec_token_ids",
                                                     *v2_pieces()]),
                         FASTBATCH_VERIFY="often")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    out = result.stdout
    assert "FASTBATCH_VERIFY='often' (share of calls checked: 0)" in out
    assert "    left stock: listed in FASTBATCH_DISABLE" in out
    assert "model runner by default here: V2 (VLLM_USE_V2_MODEL_RUNNER=1 is set)" in out
    assert "pieces would stay idle" in out
    assert out.splitlines()[-1] == "verdict: with FASTBATCH=1 nothing would act here"


@pytest.mark.vllm
def test_without_model_runner_v1_the_host_pieces_would_act():
    """vLLM 0.34.0: every piece of the scheduler, the output processor and the
    API server would act; the V1 runner's pieces are one line, without a
    target; vLLM's only runner is V2."""
    from fastbatch import model_runner

    removed = model_runner.v1_removed()
    if removed is None:  # a vLLM with Model Runner V1: the tests above
        assert "vllm.v1.worker.gpu_model_runner" in sys.modules
        return
    result = _self_check("-m", "fastbatch", VLLM_TARGET_DEVICE="cpu", FASTBATCH="1")
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    runner_pieces = [name for name in registry.NAMES if name not in v2_pieces()]
    start = lines.index(f"  {', '.join(runner_pieces)}:")
    assert lines[start + 1] == f"    {removed}; nothing to replace"
    for name in v2_pieces():
        (at,) = [i for i, line in enumerate(lines) if line == f"  {name}:"]
        verdict = next(line for line in lines[at:] if "with FASTBATCH=1" in line)
        assert verdict == "    with FASTBATCH=1: replaced", result.stdout
    assert "model runner by default here: V2 (the only runner of vLLM" in result.stdout
    assert lines[-1] == ("verdict: with FASTBATCH=1 these pieces would act: "
                         + ", ".join(v2_pieces()))
