"""Wrap vLLM functions with timers where they are looked up.

The clock is ``time.perf_counter`` (wall time), or ``time.thread_time`` (the
CPU time of the calling thread: time spent waiting for a core, on a busy
machine, is not counted) with ``FunctionTimers(..., clock=time.thread_time)``.

Used by tools/vllm_generate.py (``--time-method``, ``--profile-step``) in an
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the timers must run
in the process that runs the model runner and the scheduler.  Install them
after ``LLM(...)`` is built, so that whatever stands at each attribute then
(vLLM's function, or fastbatch's replacement) is what is timed.

A function is named by ``(module, qualname)``:

- ``"Class.method"``: the class attribute is wrapped, and so is the same
  attribute on every subclass that overrides it (``CPUModelRunner`` subclasses
  ``GPUModelRunner``, ``AsyncScheduler`` overrides ``Scheduler``'s
  ``_update_*``).  A call that reaches the timer again while it runs (an
  override calling ``super()``, recursion) is counted once, the outermost.
- ``"function"`` at module level: the binding in ``module`` and every other
  binding of the same object under the same name in any loaded module (each
  ``from module import function`` makes its own binding, which is where its
  callers look it up: ``apply_all_penalties`` in ``sampler.py`` and
  ``rejection_sampler.py``).

Some callables are kept on instances (``EngineCore.step_fn`` is a bound
method stored at start-up; the draft model's ``forward``); those are named by
an attribute path from a live object (``INSTANCE_STEP_FUNCTIONS``).

A name that does not exist in the installed vLLM is reported as absent.

The garbage collector's collections are timed on the same clock (through
``gc.callbacks``) and reported as their own row, ``GARBAGE_COLLECTION``; a
timer leaves out the collections that ran inside its call.  A collection
lands whole in whichever function happens to allocate when the collector's
thresholds are crossed, and its cost grows with every object tracked (a
full one walks the whole heap): without this, a function's row would carry
collections that are not its own work.
"""

from __future__ import annotations

import functools
import gc
import importlib
import sys
import time
from typing import Any

# label -> (module, qualname).  The functions of a V1 decode step, in the
# order of the report: engine (the output processor's calls for each request
# after ``process_outputs``), runner (execute_model, then sample_tokens),
# the async output, the input batch, sampling, the scheduler.
STEP_FUNCTIONS: dict[str, tuple[str, str]] = {
    "LLMEngine.step": ("vllm.v1.engine.llm_engine", "LLMEngine.step"),
    "OutputProcessor.process_outputs": ("vllm.v1.engine.output_processor",
                                        "OutputProcessor.process_outputs"),
    "LogprobsProcessor.update_from_output": ("vllm.v1.engine.logprobs",
                                             "LogprobsProcessor.update_from_output"),
    "BaseIncrementalDetokenizer.update": ("vllm.v1.engine.detokenizer",
                                          "BaseIncrementalDetokenizer.update"),
    "RequestState.make_request_output": ("vllm.v1.engine.output_processor",
                                         "RequestState.make_request_output"),
    "GPUModelRunner.execute_model": ("vllm.v1.worker.gpu_model_runner",
                                     "GPUModelRunner.execute_model"),
    "GPUModelRunner._update_states": ("vllm.v1.worker.gpu_model_runner",
                                      "GPUModelRunner._update_states"),
    "GPUModelRunner._prepare_inputs": ("vllm.v1.worker.gpu_model_runner",
                                       "GPUModelRunner._prepare_inputs"),
    "GPUModelRunner._prepare_input_ids": ("vllm.v1.worker.gpu_model_runner",
                                          "GPUModelRunner._prepare_input_ids"),
    "GPUModelRunner._compute_prev_positions": ("vllm.v1.worker.gpu_model_runner",
                                               "GPUModelRunner._compute_prev_positions"),
    "GPUModelRunner._calc_spec_decode_metadata": ("vllm.v1.worker.gpu_model_runner",
                                                  "GPUModelRunner._calc_spec_decode_metadata"),
    "GPUModelRunner._build_attention_metadata": ("vllm.v1.worker.gpu_model_runner",
                                                 "GPUModelRunner._build_attention_metadata"),
    "GPUModelRunner._model_forward": ("vllm.v1.worker.gpu_model_runner",
                                      "GPUModelRunner._model_forward"),
    "GPUModelRunner.sample_tokens": ("vllm.v1.worker.gpu_model_runner",
                                     "GPUModelRunner.sample_tokens"),
    "GPUModelRunner._sample": ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),
    "GPUModelRunner._bookkeeping_sync": ("vllm.v1.worker.gpu_model_runner",
                                         "GPUModelRunner._bookkeeping_sync"),
    "GPUModelRunner.propose_draft_token_ids": ("vllm.v1.worker.gpu_model_runner",
                                               "GPUModelRunner.propose_draft_token_ids"),
    "GPUModelRunner._get_draft_token_ids_cpu": ("vllm.v1.worker.gpu_model_runner",
                                                "GPUModelRunner._get_draft_token_ids_cpu"),
    "AsyncGPUModelRunnerOutput.get_output": ("vllm.v1.worker.gpu_model_runner",
                                             "AsyncGPUModelRunnerOutput.get_output"),
    "InputBatch.update_async_output_token_ids": ("vllm.v1.worker.gpu_input_batch",
                                                 "InputBatch.update_async_output_token_ids"),
    "InputBatch.update_async_spec_token_ids": ("vllm.v1.worker.gpu_input_batch",
                                               "InputBatch.update_async_spec_token_ids"),
    "InputBatch.refresh_metadata": ("vllm.v1.worker.gpu_input_batch",
                                    "InputBatch.refresh_metadata"),
    "InputBatch.condense": ("vllm.v1.worker.gpu_input_batch", "InputBatch.condense"),
    "Sampler.forward": ("vllm.v1.sample.sampler", "Sampler.forward"),
    "RejectionSampler.forward": ("vllm.v1.sample.rejection_sampler", "RejectionSampler.forward"),
    "RejectionSampler.parse_output": ("vllm.v1.sample.rejection_sampler",
                                      "RejectionSampler.parse_output"),
    "apply_all_penalties": ("vllm.v1.sample.ops.penalties", "apply_all_penalties"),
    "penalties._convert_to_tensors": ("vllm.v1.sample.ops.penalties", "_convert_to_tensors"),
    "Scheduler.schedule": ("vllm.v1.core.sched.scheduler", "Scheduler.schedule"),
    "KVCacheManager.allocate_slots": ("vllm.v1.core.kv_cache_manager",
                                      "KVCacheManager.allocate_slots"),
    "Scheduler._update_after_schedule": ("vllm.v1.core.sched.scheduler",
                                         "Scheduler._update_after_schedule"),
    "Scheduler._make_cached_request_data": ("vllm.v1.core.sched.scheduler",
                                            "Scheduler._make_cached_request_data"),
    "Scheduler.update_from_output": ("vllm.v1.core.sched.scheduler",
                                     "Scheduler.update_from_output"),
    "Scheduler._update_request_with_output": ("vllm.v1.core.sched.scheduler",
                                              "Scheduler._update_request_with_output"),
    "check_stop": ("vllm.v1.core.sched.utils", "check_stop"),
    "Scheduler.get_grammar_bitmask": ("vllm.v1.core.sched.scheduler",
                                      "Scheduler.get_grammar_bitmask"),
    "StructuredOutputManager.accept_tokens": ("vllm.v1.structured_output",
                                              "StructuredOutputManager.accept_tokens"),
}

# Called once per scheduled request per step: their timers cost about 0.16 us
# a call inside the rows of ``process_outputs`` and the scheduler (the
# scheduler's weigh more on stock's side, which calls them for every request;
# ``--coarse`` leaves them all out).
PER_REQUEST_FUNCTIONS = ("LogprobsProcessor.update_from_output",
                         "BaseIncrementalDetokenizer.update", "RequestState.make_request_output",
                         "KVCacheManager.allocate_slots", "Scheduler._update_request_with_output",
                         "check_stop", "StructuredOutputManager.accept_tokens")

# label -> attribute path from the in-process EngineCore.  "engine step" is
# the step function EngineCore chose at start-up (``step``, or
# ``step_with_batch_queue`` under async scheduling): one call schedules a
# batch, runs it, and takes the previous batch's output; its count is the
# number of steps.
INSTANCE_STEP_FUNCTIONS: dict[str, str] = {
    "engine step": "step_fn",
    "drafter model forward":
        "model_executor.driver_worker.worker.model_runner.drafter.model.forward",
}


GARBAGE_COLLECTION = "garbage collection"


class Collections:
    """Seconds and number of the garbage collector's collections, on
    ``clock``, while installed (``install``, ``remove``)."""

    __slots__ = ("calls", "clock", "seconds", "started")

    def __init__(self, clock: Any = time.perf_counter) -> None:
        self.clock = clock
        self.seconds = 0.0
        self.calls = 0
        self.started: float | None = None

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = self.clock()
        elif self.started is not None:
            self.seconds += self.clock() - self.started
            self.calls += 1
            self.started = None

    def install(self) -> None:
        gc.callbacks.append(self._callback)

    def remove(self) -> None:
        gc.callbacks.remove(self._callback)

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0


class Timer:
    """Seconds and calls of one label, over all of its bindings, on the clock
    of ``collections``; the seconds leave out its collections that ran
    inside."""

    __slots__ = ("calls", "collections", "running", "seconds")

    def __init__(self, collections: Collections) -> None:
        self.collections = collections
        self.seconds = 0.0
        self.calls = 0
        self.running = False

    def reset(self) -> None:
        self.seconds = 0.0
        self.calls = 0


def _timed(function: Any, timer: Timer) -> Any:
    collections = timer.collections
    clock = collections.clock

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if timer.running:  # super() or recursion: the outermost call counts
            return function(*args, **kwargs)
        timer.running = True
        collected = collections.seconds
        start = clock()
        try:
            return function(*args, **kwargs)
        finally:
            timer.seconds += clock() - start - (collections.seconds - collected)
            timer.calls += 1
            timer.running = False

    return timed


def _subclasses(cls: type) -> list[type]:
    found, pending = [], [cls]
    while pending:
        for sub in pending.pop().__subclasses__():
            if sub not in found:
                found.append(sub)
                pending.append(sub)
    return found


def _wrap_class_attribute(cls: type, name: str, timer: Timer) -> list[str]:
    """Wrap ``name`` on ``cls`` and on each subclass overriding it; where wrapped."""
    owners = [cls] + [sub for sub in _subclasses(cls) if name in vars(sub)]
    where = []
    for owner in owners:
        value = next((vars(klass)[name] for klass in owner.__mro__ if name in vars(klass)), None)
        if isinstance(value, staticmethod | classmethod):
            wrapped: Any = type(value)(_timed(value.__func__, timer))
        elif callable(value):
            wrapped = _timed(value, timer)
        else:
            continue  # a property or a plain value: not a function of the step
        setattr(owner, name, wrapped)
        where.append(f"{owner.__module__}.{owner.__qualname__}.{name}")
    return where


def _wrap_module_function(module: Any, name: str, timer: Timer) -> list[str]:
    """Wrap every binding of ``module.name``'s object under ``name``; where wrapped."""
    function = getattr(module, name)
    where = []
    for loaded_name, loaded in list(sys.modules.items()):
        if getattr(loaded, "__dict__", {}).get(name) is function:
            setattr(loaded, name, _timed(function, timer))
            where.append(f"{loaded_name}.{name}")
    return where


class FunctionTimers:
    """Timers installed on the functions named by ``functions`` (label ->
    (module, qualname)) and ``instance_functions`` (label -> attribute path
    from ``root``, a live object), reading ``clock``; and the garbage
    collections, which the timers leave out (``report``'s
    ``GARBAGE_COLLECTION`` row)."""

    def __init__(self, functions: dict[str, tuple[str, str]],
                 instance_functions: dict[str, str] | None = None, root: Any = None,
                 clock: Any = time.perf_counter) -> None:
        self.collections = Collections(clock)
        self.collections.install()
        self.timers: dict[str, Timer] = {}
        self.where: dict[str, list[str]] = {}
        self.absent: list[str] = []
        for label, (module_name, qualname) in functions.items():
            self._install(label, lambda m=module_name, q=qualname: self._bind(m, q))
        for label, path in (instance_functions or {}).items():
            self._install(label, lambda p=path: self._bind_instance(root, p))

    def _install(self, label: str, bind: Any) -> None:
        timer = Timer(self.collections)
        try:
            where = bind()(timer)
        except (ImportError, AttributeError):
            where = []
        if where:
            self.timers[label], self.where[label] = timer, where
        else:
            self.absent.append(label)

    @staticmethod
    def _bind(module_name: str, qualname: str) -> Any:
        owner: Any = importlib.import_module(module_name)
        *parents, name = qualname.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        getattr(owner, name)  # AttributeError: absent in this vLLM
        if parents:
            return lambda timer: _wrap_class_attribute(owner, name, timer)
        return lambda timer: _wrap_module_function(owner, name, timer)

    @staticmethod
    def _bind_instance(root: Any, path: str) -> Any:
        *parents, name = path.split(".")
        owner = root
        for parent in parents:
            owner = getattr(owner, parent)
        function = getattr(owner, name)
        if not callable(function):
            raise AttributeError(path)

        def install(timer: Timer) -> list[str]:
            setattr(owner, name, _timed(function, timer))
            return [f"{type(owner).__qualname__} instance .{name}"]

        return install

    def time_late_bound(self, label: str, owner: Any, name: str) -> None:
        """Time ``owner.name`` on the instance ``owner``, calling at each call
        whatever its class holds then: a patch applied to or reverted from the
        class afterwards is timed both ways (a timer on the class is replaced
        by them)."""
        timer = Timer(self.collections)

        def call(*args: Any, **kwargs: Any) -> Any:
            return getattr(type(owner), name)(owner, *args, **kwargs)

        setattr(owner, name, _timed(call, timer))
        self.timers[label] = timer
        self.where[label] = [f"{type(owner).__qualname__} instance .{name}, late bound"]

    def reset(self) -> None:
        for timer in self.timers.values():
            timer.reset()
        self.collections.reset()

    def report(self) -> dict[str, dict[str, float]]:
        """label -> seconds and calls; ``GARBAGE_COLLECTION``: the
        collections' seconds and number."""
        return {**{label: {"seconds": timer.seconds, "calls": timer.calls}
                   for label, timer in self.timers.items()},
                GARBAGE_COLLECTION: {"seconds": self.collections.seconds,
                                     "calls": self.collections.calls}}


def seconds_per_timed_call(repeats: int = 200_000, clock: Any = time.perf_counter) -> float:
    """What a timer reading ``clock`` adds to one call (and so to its callers'
    time, on that clock): a timed no-op against a plain one."""
    def nothing() -> None:
        return None

    timed = _timed(nothing, Timer(Collections(clock)))
    best = []
    for function in (nothing, timed, nothing, timed):
        start = clock()
        for _ in range(repeats):
            function()
        best.append(clock() - start)
    return max(0.0, (min(best[1], best[3]) - min(best[0], best[2])) / repeats)
