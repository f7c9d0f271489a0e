"""A fingerprint of a function's code that ignores comments, docstrings and layout.

The guard of each patch compares the live vLLM method's fingerprint with the
ones fastbatch was verified against.  ``ast.dump`` differs between Python
versions (3.12 and 3.13 each changed it), so this walks the tree itself,
skipping the fields that come and go between versions; it gives the same
hash for the same code on Python 3.10 to 3.13.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
from typing import Any

_VERSION_DEPENDENT_FIELDS = {"type_comment", "type_params", "kind"}


def _canonical(node: Any) -> str:
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if name in _VERSION_DEPENDENT_FIELDS or value is None or value == []:
                continue
            fields.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def _function_node(source: str) -> ast.FunctionDef:
    try:
        tree = ast.parse(textwrap.dedent(source))
    except SyntaxError:  # a multi-line string less indented than the def
        tree = ast.parse("class _Wrapper:\n" + source).body[0]
    node = tree.body[0]
    if not isinstance(node, ast.FunctionDef):
        raise ValueError("source is not a function definition")
    body = node.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        node.body = body[1:] or [ast.Pass()]  # drop the docstring
    return node


def fingerprint(function: Any) -> str:
    """sha256 of the canonical syntax tree of ``function``'s source.

    Raises ``OSError``/``TypeError`` when the source is not available.
    """
    return hashlib.sha256(_canonical(_function_node(inspect.getsource(function)))
                          .encode()).hexdigest()
