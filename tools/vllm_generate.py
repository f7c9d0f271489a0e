"""Generate with real vLLM on a tiny model and report, as JSON, what happened.

Used by the end-to-end tests (tests/test_e2e.py) and the end-to-end benchmark
(benchmarks/e2e.py); each run is its own process, so that the environment
(``FASTBATCH``, ``VLLM_ENABLE_V1_MULTIPROCESSING``, ...) is read afresh by
vLLM.  The caller sets the environment; this script sets nothing of vLLM's
but the model runner (V1, the one that calls the replaced method).

    python tools/vllm_generate.py --model DIR --out result.json [--async-scheduling]

``--time-method`` times the functions fastbatch replaces; ``--profile-step``
times every function of the step (benchmarks/step_profile.py), both with the
timers of tools/function_timers.py.

The prompts mix sampling settings that need the output history (repetition,
presence and frequency penalties, bad words), greedy ones with ``logprobs=2``
and plain greedy ones (``--settings mixed``), or use penalties only
(``--settings penalties``), or are all plain greedy (``--settings greedy``) or
all with a repetition penalty (``--settings repetition``) or all greedy with
logprobs (``--settings logprobs=N``, N = 0, 1 or 5: the sampled token's
logprob and the top N; ``logprobs`` is ``logprobs=1``); with logprobs, the
report has per output ``logprobs`` (per position, ``[token id, logprob, rank,
decoded_token]`` of each entry vLLM returned, floats exact) and
``cumulative_logprobs``;
there are more prompts than ``max_num_seqs`` and their ``max_tokens`` differ
(unless one fixed ``--max-tokens`` is given without ``--varied``), so
requests join and leave mid-flight and rows are remapped between steps.
``--draft-model DIR`` turns on speculative decoding with that model as the
drafter (``method="draft_model"``: with async scheduling, vLLM 0.32.0 accepts
only EAGLE/MTP, draft-model, ``ngram_gpu``, DSpark and DFlash drafters, and
the CPU backend cannot build ``ngram_gpu``'s pinned buffers).
``--executor ray`` runs the worker as a Ray actor through vLLM's Ray executor
(``distributed_executor_backend="ray"``) on a small local Ray instance that
this script starts and stops; see ``_start_ray``.
``--plant-bugs NAME...`` (tests only, in-process runs) makes those pieces
(``all``: every one) subtly wrong once the engine is built
(tools/planted_bugs.py), for the FASTBATCH_VERIFY tests.
``--disable-each NAME...`` (tests only, in-process runs) then generates again
once per name, each on a fresh engine in this process with
``FASTBATCH_DISABLE=NAME``, fastbatch's patches reverted and applied again as
the plugin applies them when a process starts: one process for every name.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import Counter

from function_timers import (
    INSTANCE_STEP_FUNCTIONS,
    PER_REQUEST_FUNCTIONS,
    STEP_FUNCTIONS,
    FunctionTimers,
    seconds_per_timed_call,
)

# --settings kinds with logprobs on every prompt -> SamplingParams.logprobs
# ("logprobs": the name of logprobs=1 before there were three).
LOGPROBS_SETTINGS = {"logprobs=0": 0, "logprobs=1": 1, "logprobs=5": 5, "logprobs": 1}
# --settings structured: every output matches it (lower-case words and
# spaces), and it never completes, so that max_tokens ends every request.
STRUCTURED_REGEX = "[a-z ]*"

PROMPTS = [
    "Hello world", "The quick brown fox", "Once upon a time there was",
    "Async scheduling overlaps", "Numbers: 1 2 3", "Python, Rust, C",
    "A placeholder token id of", "The scheduler decides which requests",
    "Bad words are token sequences", "Repetition penalty", "This is a tiny model",
    "vLLM is written in", "Hello", "The lazy dog", "Frequency penalty and presence penalty",
    "0 1 2 3 4 5 6 7 8 9", "Once", "The sampler must never produce",
    "How many tokens each gets", "Testing vLLM on a CPU.",
]


def _bad_words(llm, tokenizer) -> list[str]:
    """Two single-token words the model really produces when unconstrained."""
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(PROMPTS[:6], greedy, use_tqdm=False)
    counts = Counter(t for o in outputs for t in o.outputs[0].token_ids)
    words = []
    for token, _ in counts.most_common():
        text = tokenizer.decode([token]).strip()
        if text and tokenizer.encode(text, add_special_tokens=False) == [token]:
            words.append(text)
        if len(words) == 2:
            break
    return words


def _settings(kind: str, bad_words: list[str]) -> list[tuple[str, dict]]:
    if kind == "penalties":
        return [
            ("repetition_penalty", {"repetition_penalty": 1.3}),
            ("presence_penalty", {"presence_penalty": 0.8}),
            ("frequency_penalty", {"frequency_penalty": 0.4}),
            ("penalties", {"repetition_penalty": 1.1, "presence_penalty": 0.3,
                           "frequency_penalty": 0.2}),
        ]
    if kind == "greedy":
        return [("greedy", {})]
    if kind == "repetition":
        return [("repetition_penalty", {"repetition_penalty": 1.2})]
    if kind in LOGPROBS_SETTINGS:
        return [(kind, {"logprobs": LOGPROBS_SETTINGS[kind]})]
    if kind == "structured":
        from vllm.sampling_params import StructuredOutputsParams

        return [("structured", {"structured_outputs": StructuredOutputsParams(
            regex=STRUCTURED_REGEX)})]
    return [
        ("repetition_penalty", {"repetition_penalty": 1.5}),
        ("presence_penalty", {"presence_penalty": 1.0}),
        ("frequency_penalty", {"frequency_penalty": 1.0}),
        ("bad_words", {"bad_words": bad_words}),
        ("all", {"repetition_penalty": 1.2, "presence_penalty": 0.5,
                 "frequency_penalty": 0.5, "bad_words": bad_words}),
        ("logprobs", {"logprobs": 2}),
        ("plain", {}),
    ]


def _logprobs(output) -> list[list[list]] | None:
    """Per position, ``[token id, logprob, rank, decoded_token]`` of each
    logprob vLLM returned (the sampled token's and the top ones), in vLLM's
    order, or None if none were asked for.  JSON keeps the floats exact."""
    positions = output.outputs[0].logprobs
    if positions is None:
        return None
    return [[[token, entry.logprob, entry.rank, entry.decoded_token]
             for token, entry in position.items()]
            for position in positions]


def _contains(sequence: list[int], part: list[int]) -> bool:
    return any(sequence[i:i + len(part)] == part for i in range(len(sequence) - len(part) + 1))


# What --time-method times (stock or patched, whichever is installed), by
# FASTBATCH_DISABLE name; "apply_all_penalties" is the whole penalties step
# around "penalties" (stock masks the -1 placeholders there, after the call).
REPLACED_FUNCTIONS = {
    "output": ("vllm.v1.worker.gpu_input_batch", "InputBatch.update_async_output_token_ids"),
    "spec": ("vllm.v1.worker.gpu_input_batch", "InputBatch.update_async_spec_token_ids"),
    "penalties": ("vllm.v1.sample.ops.penalties", "_convert_to_tensors"),
    "apply_all_penalties": ("vllm.v1.sample.ops.penalties", "apply_all_penalties"),
}


def _bad_word_violations(labels, token_ids, banned) -> list:
    return [[i, part] for i, (label, ids) in enumerate(zip(labels, token_ids, strict=True))
            if label in ("bad_words", "all") for part in banned if _contains(ids, part)]


def _shut_down(llm) -> None:
    """Stop an in-process engine and free what it holds, so that another can
    be built in this process (as vLLM's own tests do between engines)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def _with_each_disabled(names, make_llm, prompts, params, labels, banned) -> dict:
    """``--disable-each``: for each name, ``FASTBATCH_DISABLE=name``, the
    patches reverted and applied again (``vllm_plugin.register``, which vLLM's
    plugin loader calls once per process), a fresh engine, the same generate:
    its workers' status, token ids and bad-word violations, by name."""
    import fastbatch.vllm_plugin

    runs = {}
    for name in names:
        os.environ["FASTBATCH_DISABLE"] = name
        fastbatch.vllm_plugin.revert()
        fastbatch.vllm_plugin.register()
        llm = make_llm()
        token_ids = [list(o.outputs[0].token_ids)
                     for o in llm.generate(prompts, params, use_tqdm=False)]
        runs[name] = {"workers": llm.collective_rpc(fastbatch.vllm_plugin.status),
                      "token_ids": token_ids,
                      "bad_word_violations": _bad_word_violations(labels, token_ids, banned)}
        _shut_down(llm)
        del llm
    return runs


def _in_process_engine_core(llm):
    """The EngineCore of an in-process LLM (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise SystemExit("--profile-step needs VLLM_ENABLE_V1_MULTIPROCESSING=0")
    return core


def _fastbatch_environment() -> dict[str, str]:
    """fastbatch's switches in this process's environment (also run as a Ray task)."""
    return {name: value for name, value in os.environ.items() if name.startswith("FASTBATCH")}


def _start_ray():
    """Start a small local Ray instance for vLLM's Ray executor.

    Ray's processes (GCS, raylet, and the worker processes the raylet spawns)
    are started without the ``FASTBATCH*`` variables, as on a node started
    with ``ray start`` elsewhere: a vLLM worker then has them only if vLLM's
    Ray executor copies them from the driver (``get_driver_env_vars``).  The
    returned reference is a plain Ray task's view of them: ``{}`` shows that
    Ray itself did not carry them.

    vLLM's CPU platform has no Ray device key: on it, the test plugin's
    ``ray_on_cpu`` gives it one, here and (as a Ray worker setup hook) in
    every Ray worker process, and the instance declares one logical GPU per
    worker (tests/e2e_plugin/fastbatch_e2e_async_cpu.py says why).
    """
    import ray
    from vllm.platforms import current_platform

    options: dict = {}
    if current_platform.is_cpu():
        from fastbatch_e2e_async_cpu import ray_on_cpu

        ray_on_cpu()
        options = {"num_gpus": 1, "runtime_env": {
            "worker_process_setup_hook": "fastbatch_e2e_async_cpu.ray_on_cpu"}}
    switches = _fastbatch_environment()
    for name in switches:
        del os.environ[name]
    try:
        ray.init(num_cpus=1, include_dashboard=False, object_store_memory=100 * 2**20,
                 **options)
    finally:
        os.environ.update(switches)
    return ray.remote(_fastbatch_environment).remote()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--async-scheduling", action="store_true")
    parser.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="fixed max_tokens, EOS ignored (default: 8 to 62, varying by "
                             "prompt)")
    parser.add_argument("--varied", action="store_true",
                        help="with --max-tokens N: N/2 to N, varying by prompt")
    parser.add_argument("--settings",
                        choices=("mixed", "penalties", "greedy", "repetition", "structured",
                                 *LOGPROBS_SETTINGS),
                        default="mixed",
                        help="mixed: penalties, bad words, logprobs=2 and plain greedy; penalties: "
                             "repetition/presence/frequency penalties on every prompt; "
                             "greedy: plain greedy; repetition: a repetition penalty on "
                             "every prompt; logprobs=N (N = 0, 1, 5): greedy with "
                             "logprobs=N on every prompt; logprobs: logprobs=1; "
                             "structured: greedy, a regex (structured outputs, vLLM's "
                             "default backend) on every prompt")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: vLLM's")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-mb", type=int, default=64)
    parser.add_argument("--draft-model", default=None,
                        help="speculative decoding with this drafter (method draft_model)")
    parser.add_argument("--num-speculative-tokens", type=int, default=3)
    timing = parser.add_mutually_exclusive_group()
    timing.add_argument("--time-method", action="store_true",
                        help="time the replaced functions (needs in-process vLLM)")
    timing.add_argument("--profile-step", action="store_true",
                        help="time every function of the step (tools/function_timers.py "
                             "STEP_FUNCTIONS; needs in-process vLLM), after a warm-up "
                             "generate of the same prompts")
    parser.add_argument("--coarse", action="store_true",
                        help="with --profile-step: no timers on the functions called once "
                             "per request (their cost lands in their callers' rows)")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --profile-step: the timers read the thread's CPU time "
                             "(time.thread_time), not wall time, so that waiting for a core "
                             "on a busy machine is not counted")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="with --profile-step: max_tokens of the warm-up generate")
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the plain-greedy rerun (benchmarks)")
    parser.add_argument("--executor", choices=("default", "ray"), default="default",
                        help="ray: vLLM's Ray executor on a local Ray instance started "
                             "here (one worker)")
    parser.add_argument("--plant-bugs", nargs="+", default=[],
                        help="tests only: subtle bugs in these pieces (all: every one; "
                             "tools/planted_bugs.py; needs in-process vLLM)")
    parser.add_argument("--disable-each", nargs="+", default=[],
                        help="tests only: then generate again with FASTBATCH_DISABLE set to "
                             "each of these names in turn, each on a fresh engine in this "
                             "process (needs in-process vLLM)")
    args = parser.parse_args()

    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    import fastbatch.vllm_plugin

    report: dict = {"import_s": time.perf_counter() - started, "executor": args.executor}
    started = time.perf_counter()
    ray_task_environment = _start_ray() if args.executor == "ray" else None
    speculative_config = None if args.draft_model is None else {
        "method": "draft_model", "model": args.draft_model,
        "num_speculative_tokens": args.num_speculative_tokens}
    def make_llm():
        return LLM(model=args.model, dtype="float32", max_model_len=args.max_model_len,
                   enforce_eager=True, max_num_seqs=args.max_num_seqs,
                   kv_cache_memory_bytes=args.kv_cache_mb * 2**20, seed=0,
                   async_scheduling=args.async_scheduling,
                   max_num_batched_tokens=args.max_num_batched_tokens,
                   speculative_config=speculative_config,
                   distributed_executor_backend="ray" if args.executor == "ray" else None)

    llm = make_llm()
    report["engine_start_s"] = time.perf_counter() - started
    if args.plant_bugs:
        import planted_bugs

        planted_bugs.plant(args.plant_bugs)
    tokenizer = llm.get_tokenizer()
    bad_words = _bad_words(llm, tokenizer) if args.settings == "mixed" else []
    banned = [tokenizer.encode(prefix + word, add_special_tokens=False)
              for word in bad_words for prefix in ("", " ")]

    settings = _settings(args.settings, bad_words)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    labels, params, plain = [], [], []
    for i in range(len(prompts)):
        label, extra = settings[i % len(settings)]
        if args.max_tokens and args.varied:
            max_tokens = args.max_tokens - (i * 37) % (args.max_tokens // 2 + 1)
        else:
            max_tokens = args.max_tokens or 8 + (i * 23) % 55
        ignore_eos = args.max_tokens > 0 or i % 2 == 0
        labels.append(label)
        params.append(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                     ignore_eos=ignore_eos, **extra))
        plain.append(SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                    ignore_eos=ignore_eos))

    if args.time_method:
        timers = FunctionTimers(REPLACED_FUNCTIONS)
    elif args.profile_step:
        functions = {label: where for label, where in STEP_FUNCTIONS.items()
                     if not (args.coarse and label in PER_REQUEST_FUNCTIONS)}
        clock = time.thread_time if args.cpu_time else time.perf_counter
        timers = FunctionTimers(functions, INSTANCE_STEP_FUNCTIONS,
                                _in_process_engine_core(llm), clock=clock)
        warmup = [SamplingParams(temperature=0.0, max_tokens=args.warmup_tokens,
                                 ignore_eos=True, **settings[i % len(settings)][1])
                  for i in range(len(prompts))]
        llm.generate(prompts, warmup, use_tqdm=False)
        timers.reset()
    fastbatch.reset_stats()
    started, started_cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    report["generate_s"] = time.perf_counter() - started
    report["generate_cpu_s"] = time.process_time() - started_cpu
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [_logprobs(o) for o in outputs]
    if any(entry is not None for entry in logprobs):
        report["logprobs"] = logprobs
        report["cumulative_logprobs"] = [o.outputs[0].cumulative_logprob for o in outputs]
    report["output_tokens"] = sum(map(len, token_ids))
    report["tokens_per_s"] = report["output_tokens"] / report["generate_s"]
    report["methods"] = timers.report() if args.time_method else {}
    if args.profile_step:
        report["profile"] = {
            "timers": timers.report(), "where": timers.where, "absent": timers.absent,
            "clock": "thread_time" if args.cpu_time else "perf_counter",
            "seconds_per_timed_call": seconds_per_timed_call(clock=clock)}
    report["workers"] = llm.collective_rpc(fastbatch.vllm_plugin.status)
    plain_ids = [] if args.no_plain else [
        list(o.outputs[0].token_ids) for o in llm.generate(prompts, plain, use_tqdm=False)]
    report.update(
        driver_pid=os.getpid(),
        labels=labels,
        token_ids=token_ids,
        plain_token_ids=plain_ids,
        bad_words=bad_words,
        bad_word_violations=_bad_word_violations(labels, token_ids, banned),
    )
    if ray_task_environment is not None:
        import ray

        report.update(ray_version=ray.__version__,
                      ray_task_environment=ray.get(ray_task_environment))
        llm.llm_engine.engine_core.shutdown()  # the engine's Ray actor, then Ray
        ray.shutdown()
    if args.disable_each:
        _shut_down(llm)
        del llm
        report["disable_each"] = _with_each_disabled(args.disable_each, make_llm, prompts,
                                                     params, labels, banned)
    with open(args.out, "w") as out:
        json.dump(report, out)


if __name__ == "__main__":
    main()
