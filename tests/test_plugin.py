"""The vLLM plugin: switch values, idempotence, version/shape guard, activation check.

Runs on the real vLLM 0.33.0 (tox -e vllm); nothing of vLLM is mocked.  The
"changed target" and "wrong kernel" cases are simulated by putting another
function in place of vLLM's method or of fastbatch's kernel.
"""

import logging
import subprocess
import sys
import textwrap

import pytest
import torch
from vllm.v1.worker.gpu_input_batch import InputBatch

import fastbatch
from batches import vllm_0_21_method
from fastbatch import vllm_plugin
from fastbatch.patches import gpu_input_batch as patch

pytestmark = pytest.mark.vllm
STOCK_METHOD = InputBatch.update_async_output_token_ids


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


@pytest.fixture(autouse=True)
def stock_vllm(monkeypatch):
    """Every test starts and ends with vLLM's own method in place."""
    patch.revert()
    assert InputBatch.update_async_output_token_ids is STOCK_METHOD
    yield
    patch.revert()  # monkeypatch then undoes the test's own replacements


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", "off"])
def test_switch_off_leaves_vllm_stock(monkeypatch, logs, value):
    if value is None:
        monkeypatch.delenv("FASTBATCH", raising=False)
    else:
        monkeypatch.setenv("FASTBATCH", value)
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is STOCK_METHOD
    assert logs.records == []


@pytest.mark.parametrize("value", ["1", "true", "YES", " on ", "force", "FORCE"])
def test_switch_on_installs_once(monkeypatch, logs, value):
    monkeypatch.setenv("FASTBATCH", value)
    vllm_plugin.register()
    installed = InputBatch.update_async_output_token_ids
    assert installed is patch.update_async_output_token_ids
    assert patch.original() is STOCK_METHOD
    vllm_plugin.register()  # vLLM loads plugins more than once
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is installed
    assert patch.original() is STOCK_METHOD
    infos = logs.at(logging.INFO)
    assert len(infos) == 1
    for expected in (fastbatch.__version__, "vLLM 0.33.0", patch.TARGET, "compiled kernel"):
        assert expected in infos[0]
    assert vllm_plugin.status()["installed"] is True


@pytest.mark.parametrize("value", ["2", "maybe", "enable"])
def test_garbage_value_warns_and_stays_stock(monkeypatch, logs, value):
    monkeypatch.setenv("FASTBATCH", value)
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is STOCK_METHOD
    (warning,) = logs.at(logging.WARNING)
    assert repr(value) in warning and "stock" in warning


def test_switch_off_imports_nothing_of_vllm():
    """Unset, the plugin does not even import vLLM (or fastbatch's patches)."""
    script = textwrap.dedent("""
        import os, sys
        os.environ.pop("FASTBATCH", None)
        from fastbatch import vllm_plugin
        vllm_plugin.register()
        assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "vllm"
        assert "fastbatch.patches.gpu_input_batch" not in sys.modules
        print("untouched")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "untouched" in result.stdout


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    (entry_point,) = [ep for ep in entry_points(group="vllm.general_plugins")
                      if ep.name == "fastbatch"]
    assert entry_point.load() is vllm_plugin.register


def test_plugin_loaded_by_vllm_itself(monkeypatch):
    """vLLM's own plugin loader finds and runs fastbatch."""
    script = textwrap.dedent("""
        import os
        os.environ["FASTBATCH"] = "1"
        os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from vllm.v1.worker.gpu_input_batch import InputBatch
        assert getattr(InputBatch.update_async_output_token_ids, "__fastbatch__", False)
        print("patched by vLLM's loader")
    """)
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", script],
                            capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "patched by vLLM's loader" in result.stdout


def test_guard_accepts_the_installed_vllm():
    import vllm

    assert patch.check_target(vllm.__version__, STOCK_METHOD) is None


def test_guard_refuses_a_changed_method(monkeypatch, logs):
    monkeypatch.setattr(InputBatch, "update_async_output_token_ids", vllm_0_21_method)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is vllm_0_21_method
    (warning,) = logs.at(logging.WARNING)
    assert "not a verified variant" in warning and "FASTBATCH=force" in warning


def test_guard_refuses_an_unknown_version(monkeypatch, logs):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is STOCK_METHOD
    (warning,) = logs.at(logging.WARNING)
    assert "vLLM 0.34.0 is not a verified version" in warning


def test_guard_refuses_a_missing_method(monkeypatch, logs):
    monkeypatch.delattr(InputBatch, "update_async_output_token_ids")
    monkeypatch.setenv("FASTBATCH", "force")
    vllm_plugin.register()
    assert not hasattr(InputBatch, "update_async_output_token_ids")
    assert any("does not exist" in w for w in logs.at(logging.WARNING))


def test_force_patches_an_unknown_version(monkeypatch, logs):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    monkeypatch.setenv("FASTBATCH", "force")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is patch.update_async_output_token_ids
    assert any("patching anyway" in w for w in logs.at(logging.WARNING))


def test_force_still_needs_the_activation_check(monkeypatch, logs):
    """The 0.21 forward scan disagrees with fastbatch on the synthetic batch."""
    monkeypatch.setattr(InputBatch, "update_async_output_token_ids", vllm_0_21_method)
    monkeypatch.setenv("FASTBATCH", "force")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is vllm_0_21_method
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error


@pytest.mark.parametrize("broken", ["wrong result", "raises"])
def test_activation_check_refuses_a_wrong_kernel(monkeypatch, logs, broken):
    def wrong_kernel(req_ids, prev, outputs, sampled, copy_ready):
        if broken == "raises":
            raise ValueError("boom")
        for ids in outputs:
            if ids:
                ids[-1] = 0

    monkeypatch.setattr(fastbatch, "update_async_output_token_ids", wrong_kernel)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert InputBatch.update_async_output_token_ids is STOCK_METHOD
    (error,) = logs.at(logging.ERROR)
    assert "activation check failed" in error and "stock" in error


def test_revert_restores_the_original(monkeypatch):
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    assert vllm_plugin.status()["installed"] is True
    patch.revert()
    assert InputBatch.update_async_output_token_ids is STOCK_METHOD
    assert patch.original() is None
    assert vllm_plugin.status()["installed"] is False


def test_patched_method_counts_its_work(monkeypatch):
    """The counters show that real placeholders were replaced by the fast path."""
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    (batch, *_) = patch._synthetic_batches(torch)
    InputBatch.update_async_output_token_ids(batch)
    stats = vllm_plugin.status()["stats"]
    assert stats["calls"] == 1 and stats["requests_updated"] == 4
    assert stats["tokens_written"] == 4


def test_ray_workers_get_the_switch_from_the_driver(monkeypatch):
    """The README's Ray claim, checked on vLLM's own code (Ray itself is not installed).

    The Ray executor sends the driver's environment minus worker-specific
    variables (get_driver_env_vars), and RayWorkerProc.initialize_worker
    applies it before the worker starts, which is when plugins are loaded.
    """
    import ast
    import pathlib

    import vllm
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    monkeypatch.setenv("FASTBATCH", "1")
    assert get_driver_env_vars(WORKER_SPECIFIC_ENV_VARS)["FASTBATCH"] == "1"

    source = pathlib.Path(vllm.__file__).parent / "v1/executor/ray_executor_v2.py"
    (initialize_worker,) = [
        node for node in ast.walk(ast.parse(source.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name == "initialize_worker"]
    first_line = {}
    for node in ast.walk(initialize_worker):
        if isinstance(node, ast.Call):
            first_line.setdefault(ast.unparse(node.func), node.lineno)
    assert first_line["os.environ.setdefault"] < first_line["super().__init__"]
