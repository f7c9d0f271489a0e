"""Without the compiled kernel, FASTBATCH=1 leaves vLLM stock (tox -e vllm).

The pure-Python reference is slower than vLLM's own code (it is the test
oracle, not a fallback for vLLM): each process logs one warning instead.
"""

import logging
import subprocess
import sys
import textwrap

import pytest
from vllm.v1.sample.ops import penalties
from vllm.v1.worker.gpu_input_batch import InputBatch

import fastbatch
from fastbatch import registry, vllm_plugin
from subprocesses import OUTSIDE_THE_CHECKOUT

pytestmark = pytest.mark.vllm

# Run first in a subprocess: makes every compiled module of fastbatch
# unimportable, as with a wheel built for another interpreter.
BLOCK_COMPILED = textwrap.dedent("""
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


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def warnings_logged(monkeypatch):
    logger = logging.getLogger("vllm.fastbatch")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    for piece in registry.pieces():
        piece.revert()
    yield lambda: [r.getMessage() for r in handler.records if r.levelno == logging.WARNING]
    logger.removeHandler(handler)
    logger.setLevel(level)
    for piece in registry.pieces():
        piece.revert()


def test_no_compiled_kernel_leaves_vllm_stock_with_one_warning(monkeypatch, warnings_logged):
    stock = (InputBatch.update_async_output_token_ids, InputBatch.update_async_spec_token_ids,
             penalties._convert_to_tensors)
    monkeypatch.setattr(fastbatch, "COMPILED", False)
    monkeypatch.setattr(vllm_plugin, "_warned_no_kernel", False)
    monkeypatch.setenv("FASTBATCH", "1")
    vllm_plugin.register()
    vllm_plugin.register()  # vLLM loads plugins more than once per process
    assert (InputBatch.update_async_output_token_ids, InputBatch.update_async_spec_token_ids,
            penalties._convert_to_tensors) == stock
    assert vllm_plugin.status()["installed"] is False
    (warning,) = warnings_logged()
    assert "leaving vLLM stock" in warning and "slower than vLLM's own code" in warning
    assert "compiled" in warning


def test_no_compiled_kernel_for_real_in_a_vllm_process():
    """The compiled modules really cannot be imported; vLLM's own plugin loader
    runs fastbatch, which patches nothing and says why, once."""
    script = BLOCK_COMPILED + textwrap.dedent("""
        import os, warnings
        os.environ.update(FASTBATCH="1", VLLM_TARGET_DEVICE="cpu")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            import fastbatch
        assert not fastbatch.COMPILED
        assert any("compiled kernel unavailable" in str(w.message) for w in caught)
        import logging
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("vllm.fastbatch").addHandler(handler)
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        from fastbatch import vllm_plugin
        vllm_plugin.register()
        from vllm.v1.worker.gpu_input_batch import InputBatch
        assert not getattr(InputBatch.update_async_output_token_ids, "__fastbatch__", False)
        assert vllm_plugin.status()["installed"] is False
        messages = [r.getMessage() for r in records]
        assert len(messages) == 1, messages
        print(messages[0])
    """)
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", script],
                            capture_output=True, text=True, check=False,
                            cwd=OUTSIDE_THE_CHECKOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "leaving vLLM stock" in result.stdout
    assert "do not load in this interpreter" in result.stdout  # the build is there
