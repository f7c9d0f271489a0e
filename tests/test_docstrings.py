"""Each compiled function's docstring contains its pure-Python twin's
(cytoolz's habit: one contract, written once, read the same from either
implementation), and each patch module's docstring is a short contract.
No vLLM needed."""

import ast
from pathlib import Path

import pytest

from fastbatch import _kernels, _reference, registry


def _words(text):
    """A docstring as one line of words: its layout and indentation aside."""
    return " ".join((text or "").split())


def contains_twin(kernel_doc, twin_doc):
    return bool(_words(twin_doc)) and _words(twin_doc) in _words(kernel_doc)


def test_the_check_can_fail():
    assert contains_twin("f(x)\n\nDoes   x.\n   Returns y.\n\nCompiled: z.", "Does x.\nReturns y.")
    assert not contains_twin("f(x)\n\nDoes x.", "Does x.  Returns y.")
    assert not contains_twin("f(x)\n\nDoes x.", None)


@pytest.mark.parametrize("name", registry.NAMES)
def test_each_kernel_docstring_contains_its_twins(name):
    kernel, twin = _kernels.PIECES[name], _reference.PIECES[name]
    for function in kernel.__all__:
        twin_doc = getattr(twin, function).__doc__
        assert _words(twin_doc), f"{name}.{function}: the twin has no docstring"
        assert contains_twin(getattr(kernel, function).__doc__, twin_doc), (
            f"{name}.{function}: the compiled docstring does not contain the twin's")


@pytest.mark.parametrize("name", registry.NAMES)
def test_each_patch_module_docstring_is_a_contract(name):
    """What is replaced, the guard, when it can go and the upstream issue, in
    10 to 20 lines; the narrative and the numbers are on the piece's page.
    Read from the source: importing a patch module needs vLLM."""
    path = Path(__file__).resolve().parent.parent / "fastbatch" / "patches" / f"{name}.py"
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    assert 10 <= len(doc.splitlines()) <= 20, f"{name}: {len(doc.splitlines())} lines"
    for part in ("What is replaced:", "Guard:", "When it can go:", "Upstream:",
                 f"docs/pieces/{name}.md"):
        assert part in doc, f"{name}: no {part!r}"
