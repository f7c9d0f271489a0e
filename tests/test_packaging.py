"""The installed package: compiled kernel in use, typing files shipped, fallback."""

import importlib.machinery
import importlib.resources
import os
import subprocess
import sys
import textwrap

import fastbatch


def test_compiled_kernel_is_the_one_imported():
    assert fastbatch.COMPILED
    assert fastbatch.update_async_output_token_ids is (
        fastbatch._kernel.update_async_output_token_ids)
    assert fastbatch._kernel.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def test_tests_run_against_the_installed_package():
    """Under tox (FASTBATCH_EXPECT_INSTALLED=1) the wheel in site-packages is tested."""
    if os.environ.get("FASTBATCH_EXPECT_INSTALLED") == "1":
        assert "site-packages" in fastbatch.__file__, fastbatch.__file__
    assert fastbatch._kernel.__file__.startswith(os.path.dirname(fastbatch.__file__))


def test_typing_files_ship_beside_the_kernel():
    files = importlib.resources.files("fastbatch")
    assert files.joinpath("py.typed").is_file()
    stub = files.joinpath("_kernel.pyi").read_text()
    assert "def update_async_output_token_ids(" in stub


def test_fallback_warns_once_and_works():
    """With the compiled module missing, the reference takes over, with a warning."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["fastbatch._kernel"] = None  # makes the import fail
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
                            check=False, cwd=os.path.dirname(os.__file__))
    assert result.returncode == 0, result.stderr
    assert "fallback ok" in result.stdout
