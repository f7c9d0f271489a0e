"""The installed package: compiled pieces in use, typing files shipped, fallback."""

import importlib.machinery
import importlib.resources
import os
import subprocess
import sys
import textwrap

import pytest

import fastbatch
import fastbatch._kernels
from fastbatch import registry
from subprocesses import OUTSIDE_THE_CHECKOUT


def _piece(name):
    return importlib.import_module(f"fastbatch._kernels.{name}")


@pytest.mark.parametrize("name", [*registry.NAMES, "_common"])
def test_every_piece_is_a_compiled_module(name):
    assert fastbatch.COMPILED
    assert _piece(name).__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


@pytest.mark.parametrize("name", registry.NAMES)
def test_the_package_exports_the_compiled_functions(name):
    for function in _piece(name).__all__:
        assert getattr(fastbatch, function) is getattr(_piece(name), function)


def test_tests_run_against_the_installed_package():
    """Under tox (FASTBATCH_EXPECT_INSTALLED=1) the wheel in site-packages is tested."""
    if os.environ.get("FASTBATCH_EXPECT_INSTALLED") == "1":
        assert "site-packages" in fastbatch.__file__, fastbatch.__file__
    for name in registry.NAMES:
        assert _piece(name).__file__.startswith(os.path.dirname(fastbatch.__file__))


@pytest.mark.parametrize("name", registry.NAMES)
def test_typing_files_ship_beside_the_pieces(name):
    assert importlib.resources.files("fastbatch").joinpath("py.typed").is_file()
    stub = importlib.resources.files("fastbatch._kernels").joinpath(f"{name}.pyi").read_text()
    for function in _piece(name).__all__:
        assert f"def {function}(" in stub


def test_stats_cover_every_piece():
    fastbatch.reset_stats()
    fastbatch.update_async_spec_token_ids([], {}, [], [])
    fastbatch._kernels.async_output_token_ids.update_async_output_token_ids([], {}, [], None)
    counts = fastbatch.stats()
    assert counts["async_spec_token_ids"]["calls"] == 1
    assert counts["async_output_token_ids"]["calls"] == 1
    assert counts.keys() == set(registry.NAMES)
    assert {"tensors", "tokens"} <= counts["penalty_output_tokens"].keys()
    assert {"calls", "found"} <= counts["prev_positions"].keys()
    assert {"calls", "common_requests", "spec_tokens"} <= counts["prepare_input_ids"].keys()
    fastbatch.reset_stats()
    assert {n for piece in fastbatch.stats().values() for n in piece.values()} == {0}


def test_fallback_warns_once_and_works():
    """With the compiled module missing, the reference takes over, with a warning."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["fastbatch._kernels"] = None  # makes the import fail
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import fastbatch
        assert not fastbatch.COMPILED
        assert [str(w.category.__name__) for w in caught] == ["RuntimeWarning"], caught
        assert "pure-Python fallback" in str(caught[0].message)
        outputs = [[1, -1]]
        fastbatch.update_async_output_token_ids(["a"], {"a": 0}, outputs, memoryview(
            bytearray((7).to_bytes(8, sys.byteorder))).cast("q", (1, 1)))
        assert outputs == [[1, 7]], outputs
        print("fallback ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            check=False, cwd=OUTSIDE_THE_CHECKOUT)
    assert result.returncode == 0, result.stderr
    assert "fallback ok" in result.stdout
