"""Each compiled function's docstring contains its pure-Python twin's
(cytoolz's habit: one contract, written once, read the same from either
implementation).  No vLLM needed."""

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
