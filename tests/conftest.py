"""Shared fixtures and hypothesis profiles.

Profiles (``HYPOTHESIS_PROFILE``): ``ci`` (default, thousands of batches in
total), ``quick`` for fast local runs, ``asan`` for the sanitizer build.
"""

import ast
import functools
import importlib.util
import logging
import os
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

import fastbatch
from fastbatch import _reference, registry

# A test module is collected only where the packages it imports at module
# level are installed (vLLM, torch), and the modules of theirs it names exist
# (Model Runner V1's are gone from vLLM 0.34.0), directly or through a module of its own
# (tests/, benchmarks/, fastbatch/) that imports them at module level: the
# tox environments that need those modules select them with -m, and pytest
# exits non-zero there if nothing was collected.  Tests that need vLLM in a
# module that other tests share import it inside the test.
HERE = Path(__file__).resolve().parent
LOCAL = {path.stem: path for folder in (HERE, HERE.parent / "benchmarks")
         for path in folder.glob("*.py")}
OPTIONAL = ("vllm", "torch")


@functools.cache
def _module_file(name: str) -> Path | None:
    """The file of a module of this project (fastbatch, tests, benchmarks)."""
    if name in LOCAL:
        return LOCAL[name]
    if name == "fastbatch" or name.startswith("fastbatch."):
        path = Path(fastbatch.__file__).parent.joinpath(*name.split(".")[1:])
        for candidate in (path.with_suffix(".py"), path / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


@functools.cache
def _imports(path: Path) -> tuple[frozenset[str], frozenset[Path]]:
    """The optional packages and the project's module files that ``path``
    imports at module level."""
    optional, local = set(), set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            if name.split(".")[0] in OPTIONAL:
                optional.add(name)
            elif (found := _module_file(name)) is not None:
                local.add(found)
    return frozenset(optional), frozenset(local)


def missing_imports(path: Path) -> set[str]:
    """The optional packages that are not installed and that ``path`` imports
    at module level, itself or through the project's modules it imports."""
    needed, seen, todo = set(), {path}, [path]
    while todo:
        optional, local = _imports(todo.pop())
        needed |= optional
        todo += local - seen
        seen |= local
    return {name for name in needed if not _found(name)}


@functools.cache
def _found(name: str) -> bool:
    """Whether ``name`` (a package, one of its modules, or a name a module
    defines) can be imported: a module of vLLM's that this release removed
    (Model Runner V1's, in 0.34.0) cannot."""
    parent, _, attribute = name.rpartition(".")
    if not parent:
        return importlib.util.find_spec(name) is not None
    try:
        if importlib.util.find_spec(name) is not None:
            return True
    except ModuleNotFoundError:  # its parent is a module: a name inside it
        pass
    if not _found(parent):
        return False
    with warnings.catch_warnings():  # import-time noise, as below
        warnings.simplefilter("ignore")
        return hasattr(importlib.import_module(parent), attribute)


def pytest_collection_modifyitems(config, items):
    """The tests of the V1 runner's pieces' files are marked ``v1_runner`` (as
    are the tests of other files that need Model Runner V1), which an
    environment of a vLLM without it (0.34.0) deselects.  (Where vLLM is
    installed: importing the patch modules needs torch.)"""
    if not importlib.util.find_spec("vllm"):
        return
    runner_files = {f"test_{piece.name}.py" for piece in registry.pieces()
                    if not piece.main.acts_under_v2}
    for item in items:
        if item.path.name in runner_files:
            item.add_marker(pytest.mark.v1_runner)


def pytest_ignore_collect(collection_path, config):
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return bool(missing_imports(collection_path)) or None
    return None


if importlib.util.find_spec("vllm"):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM is imported
    # Warnings are errors in this suite, but the import-time deprecation noise
    # of torch, transformers and vLLM is not ours to fix: import them quietly.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm.v1.core.sched.scheduler
        # Model Runner V1's modules, where this vLLM still has them (0.33.0 and
        # earlier; 0.34.0 removed them).
        V1_RUNNER = importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None
        if V1_RUNNER:
            import vllm.v1.worker.gpu_input_batch
            import vllm.v1.worker.gpu_model_runner  # noqa: F401 (imported quietly)
    if not V1_RUNNER:
        # vLLM 0.34.0's CPU platform refuses to build a config on x86 without
        # triton-cpu, which no registry here has.  These tests build configs for
        # the scheduler and the output processor (pure Python), never a kernel.
        from cpu_platform import lift_triton_refusal

        lift_triton_refusal()

settings.register_profile("ci", max_examples=2000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("quick", max_examples=100, deadline=None)
settings.register_profile("asan", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module", params=["compiled", "reference"])
def implementation(request):
    """Each implementation: the compiled kernel and the pure-Python fallback."""
    if request.param == "compiled":
        assert fastbatch.COMPILED, "the compiled kernel is not importable"
        return fastbatch._kernels
    return _reference


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def at(self, level):
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def logs():
    """Records of the 'vllm.fastbatch' logger (vLLM's 'vllm' logger does not
    propagate to the root logger, so caplog would not see them)."""
    logger = logging.getLogger("vllm.fastbatch")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def checked_method(request):
    """``checked_method(rate=1.0)``: the test module's ``PIECE`` installed with
    ``rate`` of its calls checked (once per installation); what then stands at
    its main target (the checked method)."""
    piece = request.module.PIECE

    def install(rate=1.0):
        if not piece.main.is_applied():
            assert piece.apply(verify=rate)
        assert piece.main.verify_rate == rate
        return piece.main.current()

    return install


@pytest.fixture
def verify_dir(request, monkeypatch, tmp_path):
    """FASTBATCH_VERIFY's reproducers go to tmp_path; the test module's
    ``PIECE`` stock before and after."""
    piece = request.module.PIECE
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    piece.revert()
    yield tmp_path
    piece.revert()


@pytest.fixture
def checks_every_call(request, monkeypatch, tmp_path):
    """The test module's ``PIECE``, one that checks inside the method it
    installs, checking every call (``verify_rate`` 1, its counters at zero)
    without being applied; reproducers go to tmp_path."""
    main = request.module.PIECE.main
    monkeypatch.setenv("FASTBATCH_VERIFY_DIR", str(tmp_path))
    for name, value in (("verify_rate", 1.0), ("checked", 0), ("divergences", 0),
                        ("reproducers", [])):
        monkeypatch.setattr(main, name, value)


@pytest.fixture(scope="module")
def verified_piece(request):
    """The test module's ``PIECE`` stock before and after a module's checked runs."""
    piece = request.module.PIECE
    piece.revert()
    yield
    piece.revert()
